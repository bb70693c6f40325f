"""The pipeline bubble, measured: train_pp.py with each schedule at several micro-batch counts, in one job.

    torchrun --nproc-per-node 2 tools/pipeline_bubble.py --model small --seq-len 128 --out runs/pp_bubble

For each schedule and micro-batch count m it trains a few steps (tools/multirun.py
runs train_pp.py's main() in this same torchrun job) and reads, per rank, the time
spent computing (forward "F", whole backward "B", or the zero-bubble schedules' two halves
of it: input "I" and weight "W") against the wall time of the schedule's step. What is
left is the bubble: waiting for a neighbouring stage. Rank 0 writes pipeline_bubble.json,
pipeline_bubble.md (measured beside each schedule's formula and its simulation),
pipeline_bubble.png and pipeline_timeline.png (one step of each schedule, rank by rank).
Counts a schedule cannot run are skipped (1f1b: m >= p; interleaved1f1b: multiples of p;
dualpipev: m >= 2p).

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
from common.parallelize.pp import SCHEDULES  # noqa: E402
from common.figure_file import save_figure  # noqa: E402
from tools.multirun import run_script  # noqa: E402

SCRIPT = "step3_multi_gpu/train_pp.py"


@main_guard
def main():
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedules", default="gpipe,1f1b", help=f"comma-separated, of {', '.join(SCHEDULES)} "
                   "(default: gpipe,1f1b)")
    p.add_argument("--microbatches", default="1,2,4,8", help="comma-separated micro-batch counts (default: 1,2,4,8)")
    p.add_argument("--out", default="runs/pp_bubble")
    args, rest = p.parse_known_args()
    out = Path(args.out)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    schedules, counts = check_sweep(args.schedules, args.microbatches, world)
    results = []
    for schedule in schedules:
        for m in counts:
            if not runnable(schedule, m, world):
                continue
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
        plot_timelines(results, out / "pipeline_timeline.png", " ".join(rest))


def runnable(schedule: str, m: int, world: int) -> bool:
    """Whether train_pp.py accepts m micro-batches for this schedule on ``world`` stages."""
    return {"1f1b": m >= world, "interleaved1f1b": m % world == 0, "dualpipev": m >= 2 * world}.get(schedule, True)


def check_sweep(schedules: str, microbatches: str, world: int) -> tuple[list[str], list[int]]:
    """The sweep's lists, refused before the first run if one of them cannot be measured
    (counts a schedule cannot run are skipped; at least one pair must be left)."""
    names = [s.strip() for s in schedules.split(",") if s.strip()]
    if not names or any(s not in SCHEDULES for s in names):
        raise UserError(f"--schedules {schedules!r}: give a comma-separated list of {', '.join(SCHEDULES)}.")
    try:
        counts = [int(m) for m in microbatches.split(",")]
    except ValueError:
        counts = []
    if not counts or any(m < 1 for m in counts):
        raise UserError(f"--microbatches {microbatches!r}: give comma-separated positive whole numbers, e.g. 1,2,4,8.")
    if not any(runnable(s, m, world) for s in names for m in counts):
        raise UserError(f"--microbatches {microbatches}: none of these counts runs {', '.join(names)} on {world} "
                        f"stages (1f1b needs at least {world}, dualpipev {2 * world}, interleaved1f1b a multiple of "
                        f"{world}); add larger counts or gpipe to --schedules.")
    return names, counts


FORMULAS = {"gpipe": "(p-1)/(m+p-1)", "1f1b": "(p-1)/(m+p-1)", "interleaved1f1b": "(p-1)/(2m+p-1)",
            "zbv": "(p-1)/(6m+p-1)", "dualpipev": "(p-1)/(6m+p-1)"}
COLORS = {"gpipe": "#4C72B0", "1f1b": "#C44E52", "interleaved1f1b": "#8172B3", "zbv": "#55A868", "dualpipev": "#CCB974"}
MARKERS = {"gpipe": "o", "1f1b": "s", "interleaved1f1b": "D", "zbv": "^", "dualpipev": "v"}


def table(results: list[dict]) -> str:
    """Idle fraction per rank against the schedule's formula and its simulation, one row per schedule and m."""
    pp = results[0]["pp"]
    lines = ["| schedule | m | step (ms) | " + " | ".join(f"rank {i} busy / idle (ms)" for i in range(pp))
             + " | idle fraction, measured | formula | simulated |", "|" + "---|" * (pp + 6)]
    for r in results:
        ranks = r["per_rank"]
        times = " | ".join(f"{x['busy_s'] * 1e3:.0f} / {x['idle_s'] * 1e3:.0f}" for x in ranks)
        idle = " / ".join(f"{x['idle_fraction']:.2f}" for x in ranks)
        sim = f"{max(r['simulated']):.2f}" if r.get("simulated") else ""
        lines.append(f"| {r['schedule']} | {r['microbatches']} | {r['window_s'] * 1e3:.0f} | {times} | {idle} | "
                     f"{FORMULAS[r['schedule']]} = {r['formula']:.2f} | {sim} |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path, flags: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pp = results[0]["pp"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"width_ratios": [1.6, 1]})
    # Left: per rank, busy and idle milliseconds of one step, for every configuration.
    x, labels = 0.0, []
    for r in results:
        for rank in r["per_rank"]:
            busy, idle = rank["busy_s"] * 1e3, rank["idle_s"] * 1e3
            left.bar(x, busy, color=COLORS[r["schedule"]], width=0.8)
            left.bar(x, idle, bottom=busy, color="#DDDDDD", edgecolor="#999999", width=0.8)
            x += 1
        labels.append((x - (len(r["per_rank"]) + 1) / 2, f"{r['schedule'].replace('interleaved', 'int. ')}\n"
                                                          f"m={r['microbatches']}"))
        x += 0.8
    left.set_xticks([a for a, _ in labels], [b for _, b in labels], fontsize=6.5)
    left.set_ylabel("ms per step (bars: rank 0, rank 1, ...)")
    left.set_title("Each rank's step: computing (coloured by schedule) or waiting (grey)", fontsize=10)
    # Right: the idle fraction against each schedule's formula.
    ms = sorted({r["microbatches"] for r in results})
    grid = [m / 4 for m in range(4, 4 * max(ms) + 1)]
    drawn = set()
    for sched in dict.fromkeys(r["schedule"] for r in results):
        rs = [r for r in results if r["schedule"] == sched]
        color = COLORS[sched]
        if FORMULAS[sched] not in drawn:  # one curve per formula, in the colour of its first schedule
            drawn.add(FORMULAS[sched])
            k = {"(p-1)/(m+p-1)": 1, "(p-1)/(2m+p-1)": 2, "(p-1)/(6m+p-1)": 6}[FORMULAS[sched]]
            right.plot(grid, [(pp - 1) / (k * m + pp - 1) for m in grid], "-", color=color, lw=1,
                       label=FORMULAS[sched].replace("p", str(pp)))
        for i in range(pp):
            right.scatter([r["microbatches"] for r in rs], [r["per_rank"][i]["idle_fraction"] for r in rs],
                          marker=MARKERS[sched], facecolor=color if i == 0 else "none", edgecolor=color, s=40,
                          zorder=3, label=f"{sched}, rank {i}")
    right.set_xscale("log", base=2)
    right.set_xticks(ms, [str(m) for m in ms])
    right.set_ylim(0, 1)
    right.set_xlabel("micro-batches per step (m)")
    right.set_ylabel("idle fraction of the step")
    right.set_title(f"Bubble on {pp} ranks: measured (points) vs formula (lines)", fontsize=10)
    right.legend(fontsize=6.5, ncol=2)
    right.grid(alpha=0.3)
    fig.suptitle(f"Pipeline bubble, {pp} ranks on CPU (gloo): {flags}", fontsize=10)
    save_figure(fig, path)
    plt.close(fig)


KINDS = {"F": ("forward", "#4C72B0"), "B": ("backward (whole)", "#C44E52"), "I": ("backward, input half", "#DD8452"),
         "W": ("backward, weight half", "#55A868")}


def plot_timelines(results: list[dict], path: Path, flags: str):
    """One panel per schedule, at the largest m every schedule ran (else each its largest):
    each rank's actions of its median step on one time axis; the gaps are the bubble."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in results if r.get("timeline")]
    if not results:
        return
    schedules = list(dict.fromkeys(r["schedule"] for r in results))
    shared = set.intersection(*({r["microbatches"] for r in results if r["schedule"] == s} for s in schedules))
    rows = [max((r for r in results if r["schedule"] == s and (not shared or r["microbatches"] == max(shared))),
                key=lambda r: r["microbatches"]) for s in schedules]
    pp = rows[0]["pp"]
    # Each panel on its own step's scale: the pattern within a step is the message (the
    # step times, which a shared CPU stretches unevenly, are in the titles and the table).
    fig, axes = plt.subplots(len(rows), 1, figsize=(13, 0.7 + 0.75 * pp * len(rows)), squeeze=False)
    for ax, r in zip(axes[:, 0], rows):
        longest = r["window_s"] * 1e3
        for rank, actions in enumerate(r["timeline"]):
            y = pp - 1 - rank
            ax.barh(y, r["window_s"] * 1e3, left=0, height=0.8, color="#EEEEEE", edgecolor="#BBBBBB", lw=0.5)
            first = min((a[1] for a in actions), default=0)
            for kind, stage, mb, t0, t1 in actions:  # a rank's second stage (interleaved, V) paler
                ax.barh(y, (t1 - t0) * 1e3, left=t0 * 1e3, height=0.8, color=KINDS[kind][1], edgecolor="white",
                        lw=0.3, alpha=1.0 if stage == first else 0.6)
                if (t1 - t0) * 1e3 > longest / 60:
                    ax.text((t0 + t1) / 2 * 1e3, y, str(mb), ha="center", va="center", fontsize=5.5, color="white")
            idle = r["per_rank"][rank]["idle_fraction"]
            ax.text(longest * 1.005, y, f"idle {idle:.0%}", va="center", fontsize=7)
        ax.set_yticks(range(pp), [f"rank {pp - 1 - i}" for i in range(pp)], fontsize=7)
        sim = f", simulated {max(r['simulated']):.0%}" if r.get("simulated") else ""
        ax.set_title(f"{r['schedule']}, m = {r['microbatches']}: step {r['window_s'] * 1e3:.0f} ms; formula "
                     f"{FORMULAS[r['schedule']]} = {r['formula']:.0%}{sim}", fontsize=8, loc="left")
        ax.set_xlim(0, longest * 1.08)
    axes[-1, 0].set_xlabel("ms from the first rank entering the step (numbers: micro-batch; grey: waiting); "
                           "each panel on its own scale")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for _, c in KINDS.values()] + [
        plt.Rectangle((0, 0), 1, 1, facecolor="#EEEEEE", edgecolor="#BBBBBB")]
    fig.legend(handles, [n for n, _ in KINDS.values()] + ["idle (the bubble)"], loc="lower center", fontsize=7,
               ncol=5, title="paler: the rank's second stage", title_fontsize=7)
    fig.suptitle(f"One step of each schedule, rank by rank, {pp} ranks on CPU (gloo): {flags}", fontsize=9, x=0.01,
                 ha="left")
    save_figure(fig, path, (0, 0.06, 1, 0.98))
    plt.close(fig)


def v_memory_table(runs: dict[str, Path]) -> str:
    """One row per schedule's run (4 ranks, traced): each rank's activations at their peak,
    measured, beside common/measure/theory.py's prediction, and its whole peak."""
    from common.measure.byte_units import fmt_bytes
    summaries = {name: json.loads((path / "summary.json").read_text()) for name, path in runs.items()}
    pp = len(next(iter(summaries.values()))["memory"])
    lines = ["| schedule | " + " | ".join(f"rank {r}: activations (predicted) / peak" for r in range(pp)) + " |",
             "|" + "---|" * (pp + 1)]
    for name, s in summaries.items():
        predicted = {p["rank"]: p for p in s["predicted"]["per_rank"]}
        cells = [f"{fmt_bytes(m['peak_by_category']['activations'])} ({fmt_bytes(predicted[m['rank']]['activations'])})"
                 f" / {fmt_bytes(m['peak_bytes'])}" for m in sorted(s["memory"], key=lambda m: m["rank"])]
        lines.append(f"| {name}, m = {s['microbatches']} | " + " | ".join(cells) + " |")
    s = next(iter(summaries.values()))
    lines += ["", f"{s['model']} preset with {len(sum(s['stage_layers'], []))} layers, batch {s['global_batch_size']} x "
              f"{s['seq_len']} tokens, fp32, {pp} ranks on CPU; measured by the memory tracer in one traced step."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
