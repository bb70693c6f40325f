"""The pipeline bubble, measured: train_pp.py at several micro-batch counts in one job.

    torchrun --nproc-per-node 2 tools/pipeline_bubble.py --model small --seq-len 128 --out runs/pp_bubble

For each schedule and micro-batch count m it trains a few steps (tools/multirun.py
runs train_pp.py's main() in this same torchrun job) and reads, per rank, the time
spent in forward and backward computation against the wall time of the schedule's step.
What is left is the bubble: waiting for the neighbouring stage. Rank 0 draws
pipeline_bubble.png beside the textbook (p-1)/(m+p-1) and writes pipeline_bubble.json.

Every flag it does not know is passed on to train_pp.py.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.errors import UserError, main_guard  # noqa: E402
from tools.multirun import run_script  # noqa: E402

SCRIPT = "step3_multi_gpu/train_pp.py"


@main_guard
def main():
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedules", default="gpipe,1f1b", help="comma-separated: gpipe, 1f1b (default: both)")
    p.add_argument("--microbatches", default="1,2,4,8", help="comma-separated micro-batch counts (default: 1,2,4,8)")
    p.add_argument("--out", default="runs/pp_bubble")
    args, rest = p.parse_known_args()
    out = Path(args.out)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    schedules, counts = check_sweep(args.schedules, args.microbatches, world)
    results = []
    for schedule in schedules:
        for m in counts:
            if schedule != "gpipe" and m < world:
                continue  # 1F1B cannot start with fewer micro-batches than stages
            run_out = out / f"{schedule}_m{m}"
            code, _ = run_script(SCRIPT, [*rest, "--schedule", schedule, "--microbatches", str(m),
                                          "--no-trace-memory", "--out", str(run_out)])
            if code:
                sys.exit(code)
            if int(os.environ.get("RANK", "0")) == 0:
                s = json.loads((run_out / "summary.json").read_text())
                results.append({"schedule": schedule, "microbatches": m, "pp": world, **s["bubble"],
                                "step_time_s": s["step_time_s"]})
    if int(os.environ.get("RANK", "0")) == 0:
        (out / "pipeline_bubble.json").write_text(json.dumps(results, indent=1))
        (out / "pipeline_bubble.md").write_text(table(results) + "\n")
        plot(results, out / "pipeline_bubble.png", " ".join(rest))


def check_sweep(schedules: str, microbatches: str, world: int) -> tuple[list[str], list[int]]:
    """The sweep's lists, refused before the first run if one of them cannot be measured
    (the figure draws gpipe and 1f1b; 1F1B skips counts below the number of stages)."""
    names = [s.strip() for s in schedules.split(",") if s.strip()]
    if not names or any(s not in ("gpipe", "1f1b") for s in names):
        raise UserError(f"--schedules {schedules!r}: give a comma-separated list of gpipe and 1f1b.")
    try:
        counts = [int(m) for m in microbatches.split(",")]
    except ValueError:
        counts = []
    if not counts or any(m < 1 for m in counts):
        raise UserError(f"--microbatches {microbatches!r}: give comma-separated positive whole numbers, e.g. 1,2,4,8.")
    if all(s != "gpipe" and m < world for s in names for m in counts):
        raise UserError(f"--microbatches {microbatches}: 1f1b needs at least {world} (the number of stages); "
                        f"add larger counts or gpipe to --schedules.")
    return names, counts


def table(results: list[dict]) -> str:
    """Idle fraction per rank against (p-1)/(m+p-1), one row per schedule and m."""
    pp = results[0]["pp"]
    lines = ["| schedule | m | step (ms) | " + " | ".join(f"rank {i} busy / idle (ms)" for i in range(pp))
             + " | idle fraction, measured | (p-1)/(m+p-1) |", "|" + "---|" * (pp + 5)]
    for r in results:
        ranks = r["per_rank"]
        times = " | ".join(f"{x['busy_s'] * 1e3:.0f} / {x['idle_s'] * 1e3:.0f}" for x in ranks)
        idle = " / ".join(f"{x['idle_fraction']:.2f}" for x in ranks)
        lines.append(f"| {r['schedule']} | {r['microbatches']} | {r['window_s'] * 1e3:.0f} | {times} | {idle} | "
                     f"{r['formula']:.2f} |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path, flags: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pp = results[0]["pp"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1.5, 1]})
    # Left: per rank, busy and idle milliseconds of one step, for every configuration.
    x, labels = 0.0, []
    for r in results:
        for rank in r["per_rank"]:
            busy, idle = rank["busy_s"] * 1e3, rank["idle_s"] * 1e3
            left.bar(x, busy, color="#4C72B0", width=0.8)
            left.bar(x, idle, bottom=busy, color="#DD8452", width=0.8)
            x += 1
        labels.append((x - (len(r["per_rank"]) + 1) / 2, f"{r['schedule']}\nm={r['microbatches']}"))
        x += 0.8
    left.set_xticks([a for a, _ in labels], [b for _, b in labels], fontsize=8)
    left.set_ylabel("ms per step (bars: rank 0, rank 1, ...)")
    left.set_title("Each rank's step: computing (blue) or waiting (orange)", fontsize=10)
    left.legend(handles=[plt.Rectangle((0, 0), 1, 1, color="#4C72B0"), plt.Rectangle((0, 0), 1, 1, color="#DD8452")],
                labels=["busy: forward + backward", "idle: the bubble"], fontsize=8, loc="upper left")
    # Right: the idle fraction against the formula.
    ms = sorted({r["microbatches"] for r in results})
    grid = [m / 4 for m in range(4, 4 * max(ms) + 1)]
    for p, style in ((pp, "-"), (2 * pp, ":")):
        right.plot(grid, [(p - 1) / (m + p - 1) for m in grid], style, color="k",
                   label=f"(p-1)/(m+p-1), p={p}" + ("" if p == pp else " (not measured)"))
    for sched, marker, color in (("gpipe", "o", "#4C72B0"), ("1f1b", "s", "#C44E52")):
        rs = [r for r in results if r["schedule"] == sched]
        if not rs:
            continue
        for i in range(pp):
            right.scatter([r["microbatches"] for r in rs], [r["per_rank"][i]["idle_fraction"] for r in rs],
                          marker=marker, facecolor=color if i == 0 else "none", edgecolor=color, s=40, zorder=3,
                          label=f"{sched} measured, rank {i}")
    right.set_xscale("log", base=2)
    right.set_xticks(ms, [str(m) for m in ms])
    right.set_ylim(0, 1)
    right.set_xlabel("micro-batches per step (m)")
    right.set_ylabel("idle fraction of the step")
    right.set_title(f"Bubble on {pp} stages: measured vs formula", fontsize=10)
    right.legend(fontsize=7)
    right.grid(alpha=0.3)
    fig.suptitle(f"Pipeline bubble, {pp} ranks on CPU (gloo): {flags}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
