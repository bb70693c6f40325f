"""DeepSpeed's ZeRO stages 1, 2 and 3 beside ours: ZeRO-1 (train_ddp.py --zero1) and FSDP2
as ZeRO-2 and ZeRO-3 (train_fsdp.py --no-reshard-after-forward, and its default).

    python -m tools.deepspeed_compare                       # 2 ranks, small model, fp32
    python -m tools.deepspeed_compare --nproc 4 --model 125m --steps 20

The six runs share the model, data, global batch, seed, AdamW, learning-rate schedule and
clipping, in fp32, and run one after another in one torchrun job (tools/multirun.py). It
writes to --out (default runs/deepspeed_compare): deepspeed.md, a table of the losses,
per-rank memory by category at each run's peak, bytes each rank sent per step and step
time, and deepspeed.png, what each run's ranks held at their peaks. Flags it does not
know go to every training script. Without DeepSpeed it says so in one sentence and
compares our three runs alone: nothing else in the tutorial needs DeepSpeed.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import ROOT  # noqa: E402
from common.errors import UserError, main_guard  # noqa: E402
from common.measure.byte_units import fmt_bytes  # noqa: E402

DDP, FSDP, DS = "step3_multi_gpu/train_ddp.py", "step3_multi_gpu/train_fsdp.py", "step3_multi_gpu/train_deepspeed.py"
# name -> (label, script, flags); our three first: the DeepSpeed rows are read against them
RUNS = {
    "ours_zero1": ("ours: DDP + ZeRO-1", DDP, ["--zero1"]),
    "ours_zero2": ("ours: FSDP2 ZeRO-2", FSDP, ["--no-reshard-after-forward"]),
    "ours_zero3": ("ours: FSDP2 ZeRO-3", FSDP, []),
    "ds_zero1": ("DeepSpeed ZeRO-1", DS, ["--zero-stage", "1"]),
    "ds_zero2": ("DeepSpeed ZeRO-2", DS, ["--zero-stage", "2"]),
    "ds_zero3": ("DeepSpeed ZeRO-3", DS, ["--zero-stage", "3"]),
}
DEFAULTS = ["--model", "small", "--steps", "8", "--seq-len", "128", "--global-batch-size", "8", "--eval-batches", "0"]
NO_DEEPSPEED = ("DeepSpeed is not installed (pip install deepspeed==0.19.8; the tutorial does not need it), so "
                "only our three runs are compared.")


def have_deepspeed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def launch(names: list[str], nproc: int, out: Path, rest: list[str]) -> None:
    """All runs in one torchrun job: each script's main() in turn (tools/multirun.py)."""
    runs = [{"name": n, "script": RUNS[n][1], "argv": [*DEFAULTS, *rest, *RUNS[n][2], "--amp", "off",
                                                       "--out", str(out / n)]} for n in names]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "tools/multirun.py", "--runs", json.dumps(runs)]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    if any(n.startswith("ds_") for n in names):
        env.setdefault("DS_ACCELERATOR", "cpu" if "cuda" not in rest else "cuda")
    log = out / "runs.log"
    with open(log, "w") as f:
        p = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env, text=True)
    if p.returncode:
        tail = log.read_text().strip().splitlines()[-3:]
        raise UserError(f"a run failed (exit {p.returncode}); the output is in {log}: {' / '.join(tail)}")


def losses(folder: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


def sent_per_step(s: dict) -> int | None:
    """Bytes rank 0 sent per optimizer step, as our counter saw them (a ring's wire bytes)."""
    comm = (s.get("comm") or [None])[0]
    return sum(c["wire_bytes"] for c in comm.values()) if comm else None


def table(out: Path, names: list[str]) -> str:
    """The markdown table: one row per run, rank 0's memory at its peak (every rank holds
    the same amounts in these data-parallel runs), the loss against our ZeRO-1's."""
    ref = losses(out / "ours_zero1")
    head = ("| run | final loss | largest loss gap to ours ZeRO-1 | parameters | gradients | optimizer state | "
            "activations | other | peak (rank 0) | sent per step (rank 0) | step time |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for n in names:
        s = json.loads((out / n / "summary.json").read_text())
        gap = max(abs(a - b) for a, b in zip(losses(out / n), ref))
        m = s["memory"][0]["at_peak"] if s.get("memory") else {}
        mem = " | ".join(fmt_bytes(m[c], ".1f") if c in m else "-" for c in
                         ("parameters", "gradients", "optimizer state", "activations", "other"))
        peak = fmt_bytes(s["memory"][0]["peak_bytes"], ".1f") if s.get("memory") else "-"
        sent = sent_per_step(s)
        rows.append(f"| {RUNS[n][0]} | {s['final_loss']:.6f} | {gap:.1e} | {mem} | **{peak}** | "
                    f"{fmt_bytes(sent, '.1f') if sent is not None else '-'} | {s['step_time_s'] * 1e3:,.0f} ms |")
    return "\n".join(rows)


def figure(out: Path, names: list[str], title: str) -> None:
    from tools.compare import RunResult, render_peak_bars
    runs = [RunResult.load(RUNS[n][0], out / n) for n in names]
    render_peak_bars(runs, out / "deepspeed.png", title)


@main_guard
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--nproc", type=int, default=2, help="ranks (default: 2)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "deepspeed_compare")
    args, rest = p.parse_known_args(argv)
    if args.nproc < 2:
        raise UserError(f"--nproc must be at least 2: one rank has nothing to shard (got {args.nproc}).")
    names = list(RUNS)
    if not have_deepspeed():
        print(NO_DEEPSPEED, flush=True)
        names = [n for n in names if not n.startswith("ds_")]
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{len(names)} runs on {args.nproc} ranks, one after another; output in {args.out}/runs.log", flush=True)
    launch(names, args.nproc, args.out, rest)
    md = table(args.out, names)
    s = json.loads((args.out / names[0] / "summary.json").read_text())
    what = (f"{s['model']} model, {args.nproc} ranks, batch {s['global_batch_size']} x {s['seq_len']}, fp32, "
            f"{s['device_name']}")
    figure(args.out, names, f"ZeRO stages, ours and DeepSpeed's: what each rank holds at its peak ({what})")
    command = " ".join(["python -m tools.deepspeed_compare", *(argv if argv is not None else sys.argv[1:])])
    header = f"{what}; `{command}`"
    (args.out / "deepspeed.md").write_text(header + "\n\n" + md + "\n")
    (args.out / "deepspeed.json").write_text(json.dumps({n: losses(args.out / n) for n in names}))
    print(md)


if __name__ == "__main__":
    main()
