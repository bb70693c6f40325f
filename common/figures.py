"""Regenerate every figure in figs/ from real runs: ``python -m common.figures``.

Each chapter lists the runs it needs (a script and its flags) and which of their outputs
become which figure. ``--only 01`` regenerates the figures whose names start with 01;
``--device cuda`` runs on a GPU (the figures then get a ``_cuda`` suffix so the CPU ones
stay). Runs go to runs/figs/<run name>/.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Run:
    name: str                     # runs/figs/<name>/
    script: str                   # path from the repo root
    flags: list[str]
    nproc: int = 1                # >1: launched with torchrun
    figures: dict[str, str] = field(default_factory=dict)  # figs/ name -> file in the run folder


# ---- chapter 1: the single-device baseline --------------------------------------------
CHAPTER1 = [
    Run("baseline", "step1_single_gpu/train.py",
        ["--model", "small", "--steps", "30", "--global-batch-size", "8", "--seq-len", "256"],
        figures={"01_memory_trace_baseline.png": "memory_trace.png"}),
]

# ---- chapter 2: memory savers on one device -------------------------------------------
CHAPTER2: list[Run] = []

# ---- chapter 3a: the data-parallel family ---------------------------------------------
CHAPTER3A: list[Run] = []

# ---- chapter 3b: the model-parallel family --------------------------------------------
CHAPTER3B: list[Run] = []

# ---- chapter 4: the communication lab (docs/commlab.md) -------------------------------
CHAPTER4 = [
    Run("commlab_collectives", "step3_multi_gpu/bench_collectives.py", [], nproc=4,
        figures={"04_collectives_busbw.png": "collectives.png", "04_collectives_table.md": "collectives.md"}),
    Run("commlab_ring", "step3_multi_gpu/ring_allreduce.py", [], nproc=4,
        figures={"04_ring_vs_allreduce.png": "ring_vs_allreduce.png", "04_ring_table.md": "ring_allreduce.md"}),
    Run("commlab_comm_hooks", "step3_multi_gpu/compare_comm_hooks.py",
        ["--model", "small", "--steps", "30", "--seq-len", "128", "--global-batch-size", "8"], nproc=4,
        figures={"04_comm_hooks.png": "comm_hooks.png", "04_comm_hooks_table.md": "comm_hooks.md"}),
]

RUNS = CHAPTER1 + CHAPTER2 + CHAPTER3A + CHAPTER3B + CHAPTER4
POST_STEPS = []  # callables(device_suffix) that draw figures from several runs' outputs


def launch(run: Run, out: Path, device: str):
    cmd = [sys.executable, str(ROOT / run.script)]
    if run.nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={run.nproc}",
               str(ROOT / run.script)]
    cmd += run.flags + ["--out", str(out), "--device", device]
    print("$", " ".join(cmd[1:] if run.nproc > 1 else ["python", *cmd[1:]]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="regenerate only the figures whose names start with this")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = p.parse_args(argv)
    suffix = "" if args.device == "cpu" else "_cuda"
    todo = [r for r in RUNS if any(f.startswith(args.only) for f in r.figures) or (not r.figures and not args.only)]
    for run in todo:
        out = ROOT / "runs" / "figs" / (run.name + suffix)
        launch(run, out, args.device)
        for fig, src in run.figures.items():
            dest = ROOT / "figs" / fig.replace(".png", f"{suffix}.png")
            shutil.copyfile(out / src, dest)
            print(f"wrote {dest.relative_to(ROOT)}", flush=True)
    for post in POST_STEPS:
        post(suffix, args.only)


if __name__ == "__main__":
    main()
