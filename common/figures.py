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
# The baseline's model, batch and sequence length, so that every row of the table differs
# from it by the saving alone. Runs with no figures of their own: the post step below
# draws each trace beside the baseline's, on its scale.
_CH2 = ["--model", "small", "--global-batch-size", "8", "--seq-len", "256", "--steps", "8", "--eval-batches", "0"]
CHAPTER2 = [
    Run("02_baseline", "step1_single_gpu/train.py", _CH2),
    Run("02_amp", "step2_memory/train_amp.py", _CH2 + ["--amp", "bf16"]),
    Run("02_amp_sac", "step2_memory/train_amp_ac.py", _CH2 + ["--amp", "bf16", "--ac", "selective"]),
    Run("02_amp_ac", "step2_memory/train_amp_ac.py", _CH2 + ["--amp", "bf16", "--ac", "full"]),
    Run("02_accum_fp32", "step2_memory/train_accum.py", _CH2 + ["--amp", "off", "--ac", "none", "--grad-accum", "4"]),
    Run("02_amp_ac_accum", "step2_memory/train_accum.py", _CH2 + ["--amp", "bf16", "--ac", "full", "--grad-accum", "4"]),
    # The step times of the same set-ups, taken in turns in one process: runs made one
    # after another on a shared machine see different loads.
    Run("02_bench", "step2_memory/bench_memory_savers.py", _CH2[:6] + ["--steps", "10"]),
]
_CH2_LABELS = {"02_baseline": "fp32 baseline (step 1)", "02_amp": "AMP bf16", "02_amp_sac": "AMP + selective AC",
               "02_amp_ac": "AMP + full AC", "02_accum_fp32": "fp32, 4 micro-batches",
               "02_amp_ac_accum": "AMP + full AC + 4 micro-batches"}

# ---- chapter 3a: the data-parallel family ---------------------------------------------
CHAPTER3A: list[Run] = []

# ---- chapter 3b: the model-parallel family --------------------------------------------
CHAPTER3B: list[Run] = []

RUNS = CHAPTER1 + CHAPTER2 + CHAPTER3A + CHAPTER3B


def chapter2(suffix: str, only: str = "") -> dict[str, str]:
    """Each saving's trace beside the baseline's, the peaks by category, and the table.

    Returns {README marker: table}, and writes the table into docs/chapter2.md too."""
    if only and not ("02".startswith(only) or only.startswith("02")):
        return {}
    import json
    import platform

    from common.comparison import RunResult, markdown_table, render_beside, render_peak_bars

    runs = {r.name: RunResult.load(_CH2_LABELS[r.name], ROOT / "runs" / "figs" / (r.name + suffix))
            for r in CHAPTER2 if r.name in _CH2_LABELS}
    bench = json.loads((ROOT / "runs" / "figs" / f"02_bench{suffix}" / "bench.json").read_text())
    s = runs["02_baseline"].summary
    what = f"{s['model']} model, batch {s['global_batch_size']} x {s['seq_len']} tokens, {s['device_name']}"
    figs = ROOT / "figs"
    figs.mkdir(exist_ok=True)
    for name, fig, title in [
        ("02_amp", "02_memory_trace_amp", "AMP (bf16 autocast) beside the fp32 baseline"),
        ("02_amp_ac", "02_memory_trace_amp_ac", "AMP + full activation checkpointing beside the fp32 baseline"),
    ]:
        render_beside([runs["02_baseline"], runs[name]], figs / f"{fig}{suffix}.png", f"{title}: {what}")
    render_beside([runs["02_baseline"], runs["02_accum_fp32"], runs["02_amp_ac_accum"]],
                  figs / f"02_memory_trace_accum{suffix}.png",
                  f"Gradient accumulation (4 micro-batches of 2) beside the fp32 baseline: {what}")
    render_peak_bars(list(runs.values()), figs / f"02_peak_memory{suffix}.png",
                     f"What is alive at the memory peak, by category: {what}",
                     budget=None if suffix else (128 * 2**20, "a pretend 128 MiB device"))
    if s["device"].startswith("cuda"):
        device = s["device_name"]
    else:
        cpuinfo = Path("/proc/cpuinfo")
        names = [line.split(":", 1)[1].strip() for line in (cpuinfo.read_text().splitlines() if cpuinfo.exists()
                                                             else []) if line.startswith("model name")]
        device = f"CPU ({names[0] if names else platform.processor()}, {len(names) or '?'} cores), no GPU"
    info, times = bench["info"], {_CH2_LABELS["02_" + k]: v["min_s"] for k, v in bench["result"].items()}
    threads = f" on {info['threads']} CPU thread{'s' if info['threads'] != 1 else ''}" if info["threads"] else ""
    load = (f" (load average {info['load_before']:.1f} before timing, {info['load_after']:.1f} after)"
            if info["load_before"] is not None else "")
    commands = [" ".join(["python", r.script, *r.flags[len(_CH2):]]) for r in CHAPTER2 if r.name in _CH2_LABELS]
    text = (f"Device: {device}; {what}.\n\n"
            f"Memory: live tensor bytes at each run's peak, from the memory tracer of the run the command makes. "
            f"Step time: the fastest of {info['rounds']} steps per set-up{threads}, the set-ups taking turns step "
            f"by step in one process (`python step2_memory/bench_memory_savers.py`; medians in "
            f"runs/figs/02_bench{suffix}/bench.md){load}.\n\n"
            + markdown_table(list(runs.values()), commands, step_times=times))
    (figs / f"02_table{suffix}.md").write_text(text)
    _splice(ROOT / "docs" / "chapter2.md", f"table-02{suffix}", text)
    for f in ("02_memory_trace_amp", "02_memory_trace_amp_ac", "02_memory_trace_accum", "02_peak_memory", "02_table"):
        print(f"wrote figs/{f}{suffix}.{'md' if f.endswith('table') else 'png'}", flush=True)
    return {f"table-02{suffix}": text}


def _splice(doc: Path, name: str, text: str):
    """Replace what stands between <!-- BEGIN name --> and <!-- END name --> in doc, if both are there."""
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    if not doc.exists():
        return
    content = doc.read_text()
    if begin in content and end in content:
        head, rest = content.split(begin, 1)
        doc.write_text(f"{head}{begin}\n{text.rstrip()}\n{end}{rest.split(end, 1)[1]}")
        print(f"updated the table in {doc.relative_to(ROOT)}", flush=True)


# callables(device_suffix, only) that draw figures from several runs' outputs; they return
# {README marker: markdown} for the tables to write between <!-- BEGIN marker --> and <!-- END marker -->
POST_STEPS = [chapter2]


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
    todo = [r for r in RUNS if any(f.startswith(args.only) for f in r.figures)
            or (not r.figures and r.name.startswith(args.only))]  # runs that only feed a post step
    for run in todo:
        out = ROOT / "runs" / "figs" / (run.name + suffix)
        launch(run, out, args.device)
        for fig, src in run.figures.items():
            dest = ROOT / "figs" / fig.replace(".png", f"{suffix}.png")
            shutil.copyfile(out / src, dest)
            print(f"wrote {dest.relative_to(ROOT)}", flush=True)
    for post in POST_STEPS:
        for name, text in (post(suffix, args.only) or {}).items():
            _splice(ROOT / "README.md", name, text)


if __name__ == "__main__":
    main()
