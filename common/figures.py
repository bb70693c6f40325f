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
_3A = ["--model", "small", "--steps", "6", "--global-batch-size", "8", "--seq-len", "128", "--eval-batches", "2"]
CHAPTER3A: list[Run] = [
    Run("3a_ddp", "step3_multi_gpu/train_ddp.py", _3A, nproc=4,
        figures={"03_memory_trace_ddp.png": "memory_trace.png"}),
    Run("3a_zero1", "step3_multi_gpu/train_ddp.py", _3A + ["--zero1"], nproc=4,
        figures={"03_memory_trace_zero1.png": "memory_trace.png"}),
    Run("3a_fsdp_zero2", "step3_multi_gpu/train_fsdp.py", _3A + ["--no-reshard-after-forward"], nproc=4,
        figures={"03_memory_trace_zero2.png": "memory_trace.png"}),
    Run("3a_fsdp_zero3", "step3_multi_gpu/train_fsdp.py", _3A, nproc=4,
        figures={"03_memory_trace_fsdp.png": "memory_trace.png"}),
    Run("3a_hsdp", "step3_multi_gpu/train_fsdp.py", _3A + ["--hsdp", "2", "2"], nproc=4,
        figures={"03_memory_trace_hsdp.png": "memory_trace.png"}),
    Run("3a_fsdp_bf16_ac", "step3_multi_gpu/train_fsdp.py", _3A + ["--mixed-precision", "--activation-checkpointing"],
        nproc=4, figures={"03_memory_trace_fsdp_bf16_ac.png": "memory_trace.png"}),
]

# ---- chapter 3b: the model-parallel family --------------------------------------------
CHAPTER3B: list[Run] = []

RUNS = CHAPTER1 + CHAPTER2 + CHAPTER3A + CHAPTER3B
from common.dp_theory import write_chapter3a_table  # noqa: E402

POST_STEPS = [write_chapter3a_table]  # callables(device_suffix) that draw figures from several runs' outputs


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
