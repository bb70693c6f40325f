"""Grow the batch k times: what should the learning rate do? Keep it, linear, square root.

    python -m tools.lr_scaling                         # small model, batch 8 -> 32, on the real text
    python -m tools.lr_scaling --k 8 --model 125m --global-batch-size 16 --seq-len 1024 --steps 400   # a GPU

Every run sees the same number of tokens (the budget of ``--steps`` steps at
``--global-batch-size``): the baseline, then k times the batch for 1/k of the steps with
the peak learning rate kept, multiplied by k (the linear rule, derived for SGD: k small
steps of lr ~ one step of k lr on the mean gradient of k times the batch), or by sqrt(k) (the rule argued
for adaptive optimizers such as Adam, whose update size does not grow with the gradient's
scale but whose gradient noise shrinks as 1/sqrt(k)); each with the baseline's warm-up
(in tokens: 1/k as many steps) and with none. The script is step2_memory/train_amp.py
(bf16), one run after another in this process. Written to ``--out`` (default
runs/lr_scaling): lr_scaling.md (final training and validation loss of each run),
lr_scaling.png (training loss against tokens seen), lr_scaling.json. Every flag it does
not know is passed on to the script.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import ROOT  # noqa: E402
from common.errors import UserError, main_guard  # noqa: E402
from common.figure_file import save_figure  # noqa: E402

SCRIPT = "step2_memory/train_amp.py"
RULES = {"keep": lambda k: 1.0, "linear": lambda k: float(k), "sqrt": math.sqrt}


def plan(k: int, batch: int, steps: int, lr: float, warmup: int) -> list[dict]:
    """The runs: name, batch, steps, peak lr, warm-up steps. The same tokens for each."""
    runs = [{"name": "baseline", "rule": "-", "batch": batch, "steps": steps, "lr": lr, "warmup": warmup}]
    for rule, factor in RULES.items():
        for with_warmup in (True, False):
            runs.append({"name": f"{rule}{'' if with_warmup else '_no_warmup'}", "rule": rule, "batch": k * batch,
                         "steps": steps // k, "lr": lr * factor(k), "warmup": warmup // k if with_warmup else 0})
    return runs


def run_one(r: dict, rest: list[str], out: Path) -> dict:
    from tools.multirun import run_script
    argv = [*rest, "--global-batch-size", str(r["batch"]), "--steps", str(r["steps"]), "--lr", repr(r["lr"]),
            "--warmup-steps", str(r["warmup"]), "--no-trace-memory", "--out", str(out / r["name"])]
    print(f"$ python {SCRIPT} {' '.join(argv)}", flush=True)
    with contextlib.redirect_stdout(io.StringIO()):
        code, err = run_script(SCRIPT, argv, capture_stderr=True)
    if code:
        raise UserError(f"{SCRIPT} ({r['name']}) failed (exit {code}): {err.strip().splitlines()[-1:]}")
    summary = json.loads((out / r["name"] / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / r["name"] / "metrics.jsonl").read_text().splitlines()]
    tokens = summary["global_batch_size"] * summary["seq_len"]
    return {**r, "final_loss": summary["final_loss"], "val_loss": summary.get("val_loss"),
            "curve": [[(row["step"] + 1) * tokens, row["loss"]] for row in rows]}


def table(results: list[dict], k: int) -> str:
    lines = ["| run | batch | steps | peak lr | warm-up steps | final training loss | validation loss |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        val = "-" if r["val_loss"] is None else f"{r['val_loss']:.3f}"
        lines.append(f"| {r['name']} | {r['batch']} | {r['steps']} | {r['lr']:.2e} | {r['warmup']} | "
                     f"{r['final_loss']:.3f} | {val} |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path, title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    colors = {"-": "black", "keep": "#4C72B0", "linear": "#C44E52", "sqrt": "#55A868"}
    for r in results:
        xs, ys = zip(*r["curve"])
        ax.plot(xs, ys, color=colors[r["rule"]], ls="--" if r["name"].endswith("no_warmup") else "-",
                lw=2 if r["rule"] == "-" else 1.3, label=f"{r['name']} (lr {r['lr']:.1e})")
    ax.set(xlabel="tokens seen", ylabel="training loss", title=title)
    ax.legend(fontsize=8, ncol=2)
    save_figure(fig, path)
    plt.close(fig)


@main_guard
def main(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--k", type=int, default=4, help="how many times the batch grows (default: 4)")
    p.add_argument("--global-batch-size", type=int, default=8, help="the baseline's batch (default: 8)")
    p.add_argument("--steps", type=int, default=200, help="the baseline's steps; the budget in tokens (default: 200)")
    p.add_argument("--lr", type=float, default=1e-3, help="the baseline's peak learning rate (default: 1e-3)")
    p.add_argument("--warmup-steps", type=int, default=20, help="the baseline's warm-up (default: 20)")
    p.add_argument("--out", default=str(ROOT / "runs" / "lr_scaling"))
    args, rest = p.parse_known_args(argv)
    if args.k < 2:
        raise UserError(f"--k must be at least 2 (got {args.k}): the batch has to grow.")
    if args.steps % args.k or args.warmup_steps % args.k:
        raise UserError(f"--steps {args.steps} and --warmup-steps {args.warmup_steps} must be multiples of --k "
                        f"{args.k}, so that every run sees the same tokens and warms up over the same ones.")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        raise UserError(f"--lr must be a positive number (got {args.lr}).")
    out = Path(args.out)
    results = [run_one(r, rest, out) for r in plan(args.k, args.global_batch_size, args.steps, args.lr,
                                                    args.warmup_steps)]
    md = table(results, args.k)
    base = results[0]
    best = min(results[1:], key=lambda r: r["val_loss"] if r["val_loss"] is not None else r["final_loss"])
    what = (f"batch {args.global_batch_size} -> {args.k * args.global_batch_size}, "
            f"{args.steps * args.global_batch_size} sequences each")
    out.mkdir(parents=True, exist_ok=True)
    (out / "lr_scaling.json").write_text(json.dumps(results, indent=1))
    (out / "lr_scaling.md").write_text(md + "\n")
    plot(results, out / "lr_scaling.png", f"Learning rate when the batch grows {args.k}x: {what}")
    print(md, flush=True)
    print(f"best of the {args.k}x-batch runs: {best['name']} (the baseline: {base['final_loss']:.3f} training, "
          f"{base['val_loss'] if base['val_loss'] is None else round(base['val_loss'], 3)} validation). "
          f"Written to {out}/lr_scaling.md, lr_scaling.png, lr_scaling.json", flush=True)
    return results


if __name__ == "__main__":
    main()
