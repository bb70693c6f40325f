"""Launched under torchrun by tests/test_step3a.py: step 1 and the step 3a scripts in one job.

Starting torch costs seconds per process on a small machine, so one torchrun job runs
the single-process reference (step1_single_gpu/train.py, on every rank) and then each
strategy's real script, one after another. The driver owns the process group; each
script's ``main()`` joins it (common/distributed.py) and writes its trained weights with
``--save-weights``. Rank 0 writes what the test asserts on to a JSON file: per run the
per-step losses, summary.json (memory per rank, bytes per collective), the largest weight
difference from the reference, exit code and error text.

    torchrun --nproc-per-node W tests/drivers/dp.py OUT.json PLAN
"""
import contextlib
import importlib.util
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from common.measure.syncs import SyncCounter  # noqa: E402
from common.model import Transformer, build_model, get_config  # noqa: E402
from common.parallelize.fsdp import apply_fsdp  # noqa: E402

COMMON = ["--model", "debug", "--seq-len", "32", "--steps", "4", "--eval-batches", "0", "--device", "cpu",
          "--trace-start", "2", "--trace-steps", "1", "--data", "synthetic",
          "--max-norm", "0.5"]  # small enough that every step clips
SCRIPTS = {"step1": "step1_single_gpu/train.py", "step2_amp": "step2_memory/train_amp.py", "ddp": "step3_multi_gpu/train_ddp.py",
           "fsdp": "step3_multi_gpu/train_fsdp.py", "tp": "step3_multi_gpu/train_tp.py",
           "pp": "step3_multi_gpu/train_pp.py", "2d": "step3_multi_gpu/train_2d.py",
           "3d": "step3_multi_gpu/train_3d.py"}


def run(script: str, flags: list[str], out: Path) -> tuple[int, str]:
    """A script's main() on this job's process group: (exit code, its stderr)."""
    path = SCRIPTS[script]
    spec = importlib.util.spec_from_file_location(Path(path).stem + "_under_test", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.argv = [str(ROOT / path), *flags, "--out", str(out)]
    err, code = io.StringIO(), 0
    with contextlib.redirect_stderr(err):
        try:
            module.main()
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()


def full_weights(model) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
            for n, p in model.named_parameters()}


def weight_diff(a: dict, b: dict) -> dict:
    """Largest absolute difference, and the share of elements off by more than 1e-6."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    diffs = torch.cat([(a[k].float() - b[k].float()).abs().flatten() for k in a])
    return {"max_abs": diffs.max().item(), "frac_over_1e-6": (diffs > 1e-6).float().mean().item()}


def main(out_json: str, plan: str):
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    plan = json.loads(plan)
    results = {"world": world}
    tmp = Path(tempfile.mkdtemp(prefix=f"dp_driver_{world}_")) if rank == 0 else None
    tmp_list = [str(tmp)]
    dist.broadcast_object_list(tmp_list, src=0)
    tmp = Path(tmp_list[0])

    # FSDP on the meta device, then to_empty + init_weights: the same weights as step 1, bitwise.
    cfg = get_config("debug")
    reference_init = full_weights(build_model(cfg, "cpu", seed=0))
    with torch.device("meta"):
        sharded = Transformer(cfg)
    apply_fsdp(sharded, init_device_mesh("cpu", (world,)))
    sharded.to_empty(device="cpu")
    sharded.init_weights(seed=0)
    got = full_weights(sharded)
    results["fsdp_init_bitwise"] = all(torch.equal(got[k], reference_init[k]) for k in reference_init)

    reference = None
    for name, (script, flags) in plan.items():
        out = tmp / name
        start = time.perf_counter()
        with SyncCounter("cpu") if name.endswith("_syncs") else contextlib.nullcontext() as syncs:
            code, err = run(script, COMMON + flags + ["--save-weights"], out)
        entry = {"code": code, "stderr": err[-2000:], "seconds": time.perf_counter() - start,
                 "figure": (out / "memory_trace.png").exists()}
        if syncs is not None:  # host syncs per step (common/measure/syncs.py)
            entry["syncs"] = syncs.per_step()
        if code == 0 and rank == 0:
            weights = torch.load(out / "weights.pt")
            if name == "reference":  # the fp32 one; reference_bf16 is only compared by its losses
                reference = weights
            elif reference is not None:
                entry["weights"] = weight_diff(weights, reference)
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            entry["losses"] = [r["loss"] for r in rows]
            entry["grad_norms"] = [r["grad_norm"] for r in rows]
            entry["val_losses"] = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}  # --eval-every
            entry["summary"] = json.loads((out / "summary.json").read_text())
            if (out / "profile").exists():  # --profile: the traces, the collectives they hold, the figure
                entry["profile_traces"] = sorted(p.name for p in (out / "profile").iterdir())
                events = json.loads((out / "profile" / "trace_rank0.json").read_text())["traceEvents"]
                entry["profile_comm_names"] = sorted({e["name"] for e in events if e["name"].startswith("gloo:")})
                entry["profile_figure"] = (out / "profile_timeline.png").exists()
        results[name] = entry
        dist.barrier()
    if rank == 0:
        Path(out_json).write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
