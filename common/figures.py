"""Regenerate every figure in figs/ from real runs: ``python -m common.figures``.

Each chapter lists the runs it needs (a script and its flags) and which of their outputs
become which figure. ``--only 01`` regenerates the figures whose names start with 01;
``--device cuda`` runs on a GPU (the figures then get a ``_cuda`` suffix so the CPU ones
stay). Runs go to runs/figs/<run name>/.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from common.memory import fmt_bytes

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

# ---- chapter 5: surviving faults (docs/chapter_faults.md); the table reads the checkpoints
_5 = ["--model", "small", "--steps", "4", "--global-batch-size", "8", "--seq-len", "128", "--eval-batches", "0",
      "--no-trace-memory", "--ckpt-every", "2"]
CHAPTER5 = [
    Run("05_ddp4", "step3_multi_gpu/train_ddp.py", _5, nproc=4),
    Run("05_zero1_4", "step3_multi_gpu/train_ddp.py", _5 + ["--zero1"], nproc=4),
    Run("05_fsdp4", "step3_multi_gpu/train_fsdp.py", _5, nproc=4),
]

RUNS = CHAPTER1 + CHAPTER2 + CHAPTER3A + CHAPTER3B + CHAPTER4 + CHAPTER5


def run_dir(name: str, suffix: str = "") -> Path:
    return ROOT / "runs" / "figs" / (name + suffix)


def summary(name: str, suffix: str = "") -> dict:
    return json.loads((run_dir(name, suffix) / "summary.json").read_text())


def n_param_tensors(s: dict) -> int:
    # embedding + 9 per block (4 attention, 3 MLP, 2 norms) + final norm + output
    return 9 * s["model_config"]["n_layers"] + 3


def chapter1_table(suffix: str) -> dict[str, str]:
    """The memory anatomy of the baseline: measured bytes beside 4N / 4N / 8N."""
    s = summary("baseline", suffix)
    n, mem = s["n_params"], s["memory"][0]
    peak, at = mem["peak_by_category"], mem["at_peak"]
    rows = [
        ("parameters", "4 N", 4 * n, peak["parameters"]),
        ("gradients", "4 N", 4 * n, peak["gradients"]),
        # On CPU AdamW keeps a 4-byte `step` counter per parameter tensor beside its state
        # (on CUDA that counter lives on the CPU, outside the GPU's bytes).
        ("optimizer state (AdamW)", "8 N" + (" + 4 B x tensors" if s["device"] == "cpu" else ""),
         8 * n + (4 * n_param_tensors(s) if s["device"] == "cpu" else 0), peak["optimizer state"]),
        ("activations", "grows with batch x seq", None, peak["activations"]),
        ("other (temporaries)", "", None, peak["other"]),
    ]
    lines = ["| category | formula | predicted | measured peak | at the step's peak |", "|---|---|---|---|---|"]
    for (name, formula, pred, got), cat in zip(rows, ("parameters", "gradients", "optimizer state",
                                                      "activations", "other")):
        exact = (lambda b: f"{b:,} B") if pred else fmt_bytes  # model state: to the byte
        lines.append(f"| {name} | {formula} | {exact(pred) if pred else ''} | {exact(got)} | "
                     f"{fmt_bytes(at[cat])} |")
    lines.append(f"| **total** | | | | **{fmt_bytes(mem['peak_bytes'])}** |")
    lines.append("")
    lines.append(f"N = {n:,} parameters ({s['model']} preset), batch {s['global_batch_size']} x "
                 f"{s['seq_len']} tokens, fp32, {s['device_name']}; "
                 f"{s['tokens_per_s']:,.0f} tokens/s, {s['step_time_s'] * 1e3:.0f} ms/step, loss "
                 f"{s['first_loss']:.2f} -> {s['final_loss']:.2f} in {s['steps']} steps.")
    return {"table-01" + suffix: "\n".join(lines)}


from common.dp_theory import write_chapter3a_table  # noqa: E402

# callables(suffix) -> {README marker: markdown}; each draws on the runs above
from common.faults_report import write_faults_table  # noqa: E402

POST_STEPS = [chapter1_table, write_chapter3a_table, write_faults_table]


def update_readme(tables: dict[str, str], readme: Path = ROOT / "README.md"):
    """Replace the text between <!-- BEGIN name --> and <!-- END name --> markers."""
    text = readme.read_text()
    for name, body in tables.items():
        begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
        if begin not in text:
            print(f"README.md has no {begin} marker; table {name} not written", flush=True)
            continue
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{begin}\n{body}\n{end}{tail}"
    readme.write_text(text)


def launch(run: Run, out: Path, device: str):
    script = run.script
    cmd = [sys.executable, script] if run.nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={run.nproc}", script]
    cmd += run.flags + ["--out", str(out.relative_to(ROOT)), "--device", device]
    shown = ["python", *cmd[1:]] if run.nproc == 1 else ["torchrun", *cmd[3:]]
    print("$", " ".join(shown), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="regenerate only the figures whose names start with this")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = p.parse_args(argv)
    suffix = "" if args.device == "cpu" else "_cuda"
    # a run is redone if one of its figures, or its name (runs that only feed a table), matches --only
    todo = [r for r in RUNS if any(f.startswith(args.only) for f in r.figures) or (not r.figures and not args.only)
            or (args.only and r.name.startswith(args.only))]
    for run in todo:
        out = run_dir(run.name, suffix)
        launch(run, out, args.device)
        for fig, src in run.figures.items():
            dest = ROOT / "figs" / fig.replace(".png", f"{suffix}.png")
            shutil.copyfile(out / src, dest)
            print(f"wrote {dest.relative_to(ROOT)}", flush=True)
    tables = {}
    for post in POST_STEPS:
        try:
            tables.update(post(suffix))
        except FileNotFoundError as e:  # --only skipped the runs this table needs
            print(f"skipped {post.__name__}: {e.filename} is missing", flush=True)
    update_readme(tables)


if __name__ == "__main__":
    main()
