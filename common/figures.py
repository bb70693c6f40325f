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
_CH2 = ["--model", "small", "--global-batch-size", "8", "--seq-len", "256", "--steps", "8"]
CHAPTER2 = [
    Run("02_baseline", "step1_single_gpu/train.py", _CH2),
    Run("02_amp", "step2_memory/train_amp.py", _CH2 + ["--amp", "bf16"]),
    Run("02_amp_sac", "step2_memory/train_amp_ac.py", _CH2 + ["--amp", "bf16", "--ac", "selective"]),
    Run("02_amp_ac", "step2_memory/train_amp_ac.py", _CH2 + ["--amp", "bf16", "--ac", "full"]),
    Run("02_accum_fp32", "step2_memory/train_accum.py", _CH2 + ["--amp", "off", "--ac", "none", "--grad-accum", "4"]),
    Run("02_amp_ac_accum", "step2_memory/train_accum.py", _CH2 + ["--amp", "bf16", "--ac", "full", "--grad-accum", "4"]),
]
_CH2_LABELS = {"02_baseline": "fp32 baseline (step 1)", "02_amp": "AMP bf16", "02_amp_sac": "AMP + selective AC",
               "02_amp_ac": "AMP + full AC", "02_accum_fp32": "fp32, 4 micro-batches",
               "02_amp_ac_accum": "AMP + full AC + 4 micro-batches"}
# The same set-ups again for the step times, timed in turns in one process (common/bench.py):
# runs made one after another on a shared machine see different loads.
_CH2_BENCH = {"02_baseline": {}, "02_amp": {"amp": "bf16"}, "02_amp_sac": {"amp": "bf16", "ac": "selective"},
              "02_amp_ac": {"amp": "bf16", "ac": "full"}, "02_accum_fp32": {"grad_accum": 4},
              "02_amp_ac_accum": {"amp": "bf16", "ac": "full", "grad_accum": 4}}
_CH2_BENCH_ROUNDS = 10

# ---- chapter 3a: the data-parallel family ---------------------------------------------
CHAPTER3A: list[Run] = []

# ---- chapter 3b: the model-parallel family --------------------------------------------
CHAPTER3B: list[Run] = []

RUNS = CHAPTER1 + CHAPTER2 + CHAPTER3A + CHAPTER3B


def chapter2(suffix: str, only: str):
    """Each saving's trace beside the baseline's, the peaks by category, and the table."""
    if only and not ("02".startswith(only) or only.startswith("02")):
        return
    import json
    import os
    import platform

    import torch

    from common.bench import interleaved, memory_saver_step
    from common.comparison import RunResult, markdown_table, render_beside, render_peak_bars

    runs = {r.name: RunResult.load(_CH2_LABELS[r.name], ROOT / "runs" / "figs" / (r.name + suffix)) for r in CHAPTER2}
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
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() \
        else platform.processor()
    device = s["device_name"] if s["device"].startswith("cuda") else f"CPU ({cpu}, {os.cpu_count()} cores)"
    commands = [" ".join(["python", r.script, *r.flags[len(_CH2):]]) for r in CHAPTER2]
    print(f"timing the {len(_CH2_BENCH)} set-ups in turns, {_CH2_BENCH_ROUNDS} steps each", flush=True)
    load_before = os.getloadavg()[0]
    # One thread: when other jobs hold the cores, a second OpenMP thread that is not
    # scheduled stalls every op at its barrier, unevenly across set-ups (measured here: a
    # baseline step that takes 0.45 s on an idle machine took 2 to 26 s with two threads
    # at a load average of 12, and 2.2 to 2.5 s with one).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        bench = interleaved({runs[name].label: memory_saver_step(s["model"], s["global_batch_size"], s["seq_len"],
                                                                 s["device"], **kw) for name, kw in _CH2_BENCH.items()},
                            rounds=_CH2_BENCH_ROUNDS)
    finally:
        torch.set_num_threads(threads)
    times = {label: b["min_s"] for label, b in bench.items()}
    text = (f"Device: {device}, no GPU; torch {torch.__version__}; {what}.\n\n"
            f"Memory: live tensor bytes at each run's peak, from the memory tracer of the run the command "
            f"makes. Step time: the fastest of {_CH2_BENCH_ROUNDS} steps per set-up on one CPU thread, the set-ups "
            f"taking turns step by step in one process (`common/bench.py`; medians in runs/figs/02_bench.json), because this machine was shared with other jobs (load "
            f"average {load_before:.1f} before timing, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} "
            f"cores): runs made one after the other saw different loads.\n\n"
            + markdown_table(list(runs.values()), commands, step_times=times))
    (ROOT / "runs" / "figs" / f"02_bench{suffix}.json").write_text(json.dumps(bench, indent=1))
    (figs / f"02_table{suffix}.md").write_text(text)
    for doc in (ROOT / "README.md", ROOT / "docs" / "chapter2.md"):
        _splice(doc, f"figs/02_table{suffix}.md", text)
    for f in ("02_memory_trace_amp", "02_memory_trace_amp_ac", "02_memory_trace_accum", "02_peak_memory", "02_table"):
        print(f"wrote figs/{f}{suffix}.{'md' if f.endswith('table') else 'png'}", flush=True)


def _splice(doc: Path, name: str, text: str):
    """Replace what stands between <!-- begin NAME --> and <!-- end NAME --> in doc, if both are there."""
    begin, end = f"<!-- begin {name} -->", f"<!-- end {name} -->"
    if not doc.exists():
        return
    content = doc.read_text()
    if begin in content and end in content:
        head, rest = content.split(begin, 1)
        doc.write_text(f"{head}{begin}\n{text.rstrip()}\n{end}{rest.split(end, 1)[1]}")
        print(f"updated the table in {doc.relative_to(ROOT)}", flush=True)


POST_STEPS = [chapter2]  # callables(device_suffix, only) that draw figures from several runs' outputs


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
        post(suffix, args.only)


if __name__ == "__main__":
    main()
