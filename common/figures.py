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
# Every strategy on the same 4 ranks, model, data and batch, so the table compares like
# with like. 8 layers: the interleaved schedule needs two stages per rank. They run in one
# torchrun job (common/multirun.py): on 2 cores each launch of 4 ranks costs ~10 s.
_3B = ["--model", "small", "--n-layers", "8", "--global-batch-size", "8", "--seq-len", "64", "--steps", "5",
       "--eval-batches", "1", "--trace-start", "1", "--trace-steps", "2"]
_TP, _PP, _2D = "step3_multi_gpu/train_tp.py", "step3_multi_gpu/train_pp.py", "step3_multi_gpu/train_2d.py"
PLANS: dict[str, list[tuple[str, str, list[str]]]] = {"03_strategies": [
    ("tp", _TP, _3B),
    ("tp_sp", _TP, _3B + ["--sequence-parallel"]),
    ("pp_gpipe", _PP, _3B + ["--schedule", "gpipe", "--microbatches", "8"]),
    ("pp_1f1b", _PP, _3B + ["--schedule", "1f1b", "--microbatches", "8"]),
    ("pp_interleaved", _PP, _3B + ["--schedule", "interleaved1f1b", "--microbatches", "8"]),
    ("2d", _2D, _3B + ["--tp", "2"]),
    ("fsdp_via_2d", _2D, _3B + ["--tp", "1"]),  # FSDP alone: a 4 x 1 mesh
    # chapter 3a's scripts, where this checkout has them, on the same footing
    *[(Path(s).stem.removeprefix("train_"), s, _3B) for s in ("step3_multi_gpu/train_ddp.py",
                                                              "step3_multi_gpu/train_fsdp.py")
      if (ROOT / s).exists()],
]}
CHAPTER3B: list[Run] = [
    Run("03_single", "step1_single_gpu/train.py", _3B, figures={"03_memory_trace_single.png": "memory_trace.png"}),
    Run("03_strategies", "common/multirun.py", ["--plan", "03_strategies"], nproc=4, figures={
        "03_memory_trace_tp.png": "tp/memory_trace.png",
        "03_memory_trace_tp_sp.png": "tp_sp/memory_trace.png",
        "03_memory_trace_pp.png": "pp_1f1b/memory_trace.png",
        "03_memory_trace_pp_gpipe.png": "pp_gpipe/memory_trace.png",
        "03_memory_trace_2d.png": "2d/memory_trace.png"}),
    # 2 ranks on 2 cores: each rank has a core, so waiting is not confused with time-sharing
    Run("03_bubble", "common/pipeline_bubble.py",
        ["--model", "small", "--global-batch-size", "8", "--seq-len", "128", "--steps", "6", "--eval-batches", "0",
         "--schedules", "gpipe,1f1b", "--microbatches", "1,2,4,8"],
        nproc=2, figures={"03_pipeline_bubble.png": "pipeline_bubble.png", "03_pipeline_bubble.md": "pipeline_bubble.md"}),
]

RUNS = CHAPTER1 + CHAPTER2 + CHAPTER3A + CHAPTER3B


def chapter3b_table(suffix: str = "", only: str = "") -> dict[str, str]:
    """Measured per-rank memory, bytes and step time of every strategy in the 03_strategies
    plan; written to figs/03_table.md and returned as {README marker: markdown}."""
    from common.model_parallel import chapter3b_table as table
    if only and not ("03_table".startswith(only) or only.startswith("03")):
        return {}
    runs = ROOT / "runs" / "figs" / ("03_strategies" + suffix)
    if not runs.exists():
        print(f"skipped the chapter 3b table: {runs} is missing", flush=True)
        return {}
    single = ROOT / "runs" / "figs" / ("03_single" + suffix)
    md = table(runs, [name for name, _, _ in PLANS["03_strategies"]], single=single)
    (ROOT / "figs" / f"03_table{suffix}.md").write_text(md + "\n")
    print(f"wrote figs/03_table{suffix}.md", flush=True)
    return {"table-03b" + suffix: md}


POST_STEPS = [chapter3b_table]  # callables(device_suffix) that draw figures from several runs' outputs


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
