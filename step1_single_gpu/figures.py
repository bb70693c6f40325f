"""Chapter 1's figures and tables, made by ``python -m tools.figures --only 01``: the
baseline run (its memory trace), the memory anatomy beside 4N / 4N / 8N (block
``table-01`` of README.md here) and what the trained model writes (``generate-01``).

tools/figures.py gathers CHAPTER1 into its runs and POST_STEPS into its tables.
"""
from __future__ import annotations

import subprocess
import sys

from common import ROOT
from common.errors import UserError
from common.measure.byte_units import fmt_bytes
from tools.figure_runs import Run, run_dir, summary

# ---- chapter 1: the single-device baseline --------------------------------------------
CHAPTER1 = [
    Run("baseline", "step1_single_gpu/train.py",
        ["--model", "small", "--steps", "30", "--global-batch-size", "8", "--seq-len", "256", "--save-weights"],
        figures={"01_memory_trace_baseline.png": "memory_trace.png"}),
]


def n_param_tensors(s: dict) -> int:
    # embedding + 9 per block (4 attention, 3 MLP, 2 norms) + final norm + output
    return 9 * s["model_config"]["n_layers"] + 3


def chapter1_table(suffix: str = "") -> dict[str, str]:
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


# The chapter ends with what its run learned: the generator on its weights, command and output shown.
GENERATE_01 = ["--prompt", "def fib(", "--max-new-tokens", "200", "--temperature", "0.8", "--top-k", "50", "--seed", "0"]


def chapter1_generation(suffix: str = "") -> dict[str, str]:
    """The baseline run's model continuing a prompt: python -m tools.generate on its weights.pt."""
    import shlex
    folder = run_dir("baseline", suffix)
    if not (folder / "weights.pt").is_file():
        raise FileNotFoundError(2, "no weights", str(folder / "weights.pt"))
    args = [str(folder.relative_to(ROOT)), *GENERATE_01, "--device", "cuda" if suffix else "cpu"]
    p = subprocess.run([sys.executable, "-m", "tools.generate", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    if p.returncode:
        raise UserError(f"python -m tools.generate failed: {p.stderr.strip()[-300:]}")
    text = p.stdout.rstrip("\n").replace("```", "`\u200b``")  # a fence in the output must not end the block
    return {"generate-01" + suffix: f"```bash\npython -m tools.generate {shlex.join(args)}\n```\n\n```text\n{text}\n```"}


# (prefix of what it writes in figs/, callable(suffix) -> {README marker: markdown})
POST_STEPS = [("01", chapter1_table), ("01", chapter1_generation)]
