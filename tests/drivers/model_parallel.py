"""Test-only driver: run many model-parallel trainings inside ONE torchrun job.

    torchrun --standalone --nproc-per-node N tests/drivers/model_parallel.py OUT_DIR CASES_JSON

Starting four processes that import torch takes most of ten seconds on a 2-core machine,
so instead of one launch per check, every rank runs the step scripts' ``main()`` one after
another (tools/multirun.py), with bad flags too. Rank 0
also trains the single-process reference (the step 1 loop) for each configuration and
writes OUT_DIR/results.json for tests/test_model_parallel.py to assert on.

Each case in CASES_JSON: {"name", "script", "flags": [...], "expect_error": bool}.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import cli  # noqa: E402
from common.data import Batches, load_corpus  # noqa: E402
from common.model import build_model  # noqa: E402
from tests.tolerances import WEIGHT_ATOL  # noqa: E402
from tools.multirun import run_script  # noqa: E402
from common.training import adamw, clip_grad_norm, evaluate, lr_schedule  # noqa: E402

RANK = int(os.environ["RANK"])


# --save-weights under a pipeline: what each rank sends to rank 0 (and rank 0 receives) while
# the weights are gathered, in bytes; one copy per stage should travel, nothing else. Rank 0's
# "ready" before each tensor (one int32) is counted apart, as messages.
WEIGHTS = {"active": False, "sent": 0, "received": 0, "tensors_received": 0, "readies_sent": 0,
           "readies_received": 0}


def _is_ready(tensor) -> bool:
    return tensor.dtype == torch.int32 and tensor.numel() == 1  # no weight is one int32


def _count_weight_traffic():
    import torch.distributed as dist

    import common.weights as full_weights
    real_gather, real_send, real_recv = full_weights.full_state_dict, dist.send, dist.recv

    def full_state_dict(*args, **kwargs):
        WEIGHTS["active"] = True
        try:
            return real_gather(*args, **kwargs)
        finally:
            WEIGHTS["active"] = False

    def send(tensor, *args, **kwargs):
        if WEIGHTS["active"] and _is_ready(tensor):
            WEIGHTS["readies_sent"] += 1
        elif WEIGHTS["active"]:
            WEIGHTS["sent"] += tensor.numel() * tensor.element_size()
        return real_send(tensor, *args, **kwargs)

    def recv(tensor, *args, **kwargs):
        if WEIGHTS["active"] and _is_ready(tensor):
            WEIGHTS["readies_received"] += 1
        elif WEIGHTS["active"]:
            WEIGHTS["received"] += tensor.numel() * tensor.element_size()
            WEIGHTS["tensors_received"] += 1
        return real_recv(tensor, *args, **kwargs)

    full_weights.full_state_dict, dist.send, dist.recv = full_state_dict, send, recv


def reference(flags: list[str], amp: str = "off") -> dict:
    """The single-process run (step 1's loop; step 2's autocast with ``amp`` bf16) with the same shared flags."""
    p = cli.parser(None)
    cli.add_moe_flags(p)  # the mixture-of-experts presets: step 1 adds the router's loss
    args = cli.parse(p, [f for f in flags if f != "--save-weights"] + ["--no-trace-memory"])
    corpus = load_corpus(args.data, seed=args.seed, vocab_size=args.model_config.vocab_size)
    batches = iter(Batches(corpus.train, args.seq_len, args.global_batch_size, seed=args.seed))
    model = build_model(args.model_config, "cpu", seed=args.seed)
    optimizer = adamw(model.parameters(), args)
    scheduler = lr_schedule(optimizer, args)
    losses, norms, vals = [], [], {}
    for step in range(args.steps):
        x, y = next(batches)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp == "bf16"):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        (loss + model.moe_aux_loss()).backward()
        norms.append(clip_grad_norm(model.parameters(), args.max_norm).item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(loss.item())
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step == args.steps - 1):
            vals[step] = evaluate(model, corpus.val, args, "cpu")  # as Run does with --eval-every
    return {"losses": losses, "grad_norms": norms, "val_losses": vals, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


SHARED = {"--model", "--n-layers", "--steps", "--global-batch-size", "--seq-len", "--lr", "--warmup-steps",
          "--seed", "--data", "--max-norm", "--n-experts", "--aux-loss-weight", "--eval-every", "--eval-batches"}


def last_value(flags: list[str], name: str, default: str) -> str:
    """A flag's value as argparse reads it: the last one given wins."""
    values = [b for a, b in zip(flags, flags[1:]) if a == name]
    return values[-1] if values else default


def shared_flags(flags: list[str]) -> list[str]:
    out = []
    for a, b in zip(flags, flags[1:] + [""]):
        if a in SHARED:
            out += [a, b]
    return out


def main():
    import common.weights as full_weights

    out_dir, cases = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    results, refs = {}, {}
    _count_weight_traffic()
    for case in cases:
        case_out = out_dir / case["name"]
        flags = case["flags"] + ["--out", str(case_out), "--device", "cpu"]
        t0 = time.perf_counter()
        WEIGHTS.update(sent=0, received=0, tensors_received=0, readies_sent=0, readies_received=0)
        full_weights.IN_FLIGHT.update(bytes=0, peak_bytes=0)
        code, err = run_script(case["script"], flags, capture_stderr=True)
        res = {"exit_code": code, "stderr_tail": err[-2000:], "wall_s": time.perf_counter() - t0,
               "weights_sent": WEIGHTS["sent"], "weights_received": WEIGHTS["received"],
               "weight_tensors_received": WEIGHTS["tensors_received"], "readies_sent": WEIGHTS["readies_sent"],
               "readies_received": WEIGHTS["readies_received"],
               "weights_peak_in_flight": full_weights.IN_FLIGHT["peak_bytes"]}
        if RANK == 0 and code == 0 and not case.get("expect_error"):
            amp = last_value(case["flags"], "--amp", "bf16")  # step 3's default
            key = json.dumps(shared_flags(case["flags"]))
            if key not in refs:
                refs[key] = reference(shared_flags(case["flags"]))
            ref = refs[key]
            if amp == "bf16":  # the one-device bf16 run, beside the fp32 one
                if key + "bf16" not in refs:
                    refs[key + "bf16"] = reference(shared_flags(case["flags"]), "bf16")
                res["ref_bf16_losses"] = refs[key + "bf16"]["losses"]
            rows = [json.loads(line) for line in (case_out / "metrics.jsonl").read_text().splitlines()]
            res["losses"] = [r["loss"] for r in rows]
            res["ref_losses"] = ref["losses"]
            res["grad_norms"] = [r["grad_norm"] for r in rows]
            res["val_losses"] = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
            res["ref_val_losses"] = ref["val_losses"]
            res["ref_grad_norms"] = ref["grad_norms"]
            res["summary"] = json.loads((case_out / "summary.json").read_text())
            weights = case_out / "weights.pt"
            if weights.exists():
                got = torch.load(weights)
                res["weight_keys_match"] = sorted(got) == sorted(ref["state"])
                diffs = [(got[k] - ref["state"][k]).abs() for k in ref["state"] if k in got]
                res["weight_max_abs_diff"] = max(d.max().item() for d in diffs)
                res["weight_n_over_atol"] = sum(int((d > WEIGHT_ATOL).sum()) for d in diffs)
                res["weight_numel"] = sum(d.numel() for d in diffs)
                res["weight_largest_bytes"] = max(t.numel() * t.element_size() for t in got.values())
        results[case["name"]] = res
        if RANK == 0:
            print(f"[driver] {case['name']}: exit {code} in {res['wall_s']:.1f} s", file=sys.__stderr__, flush=True)
    if RANK == 0:
        (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    else:  # what the other ranks saw: every rank must exit, and say why, the same way
        (out_dir / f"results_rank{RANK}.json").write_text(json.dumps(
            {k: {"exit_code": v["exit_code"], "stderr_tail": v["stderr_tail"], "weights_sent": v["weights_sent"],
                 "readies_received": v["readies_received"], "weights_peak_in_flight": v["weights_peak_in_flight"]}
             for k, v in results.items()}))


if __name__ == "__main__":
    main()
