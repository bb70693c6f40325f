"""Figures and tables that put several runs side by side, from the files the runs wrote.

A run folder holds ``summary.json``, ``metrics.jsonl`` and ``memory_trace.json`` (see
common/metrics.py and common/memory.py); everything here reads only those, so a table
in the README is always a function of real runs.
"""
from __future__ import annotations

import json
import statistics
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.memory import CATEGORIES, COLORS, STACK_ORDER, fmt_bytes, render


@dataclass
class RunResult:
    label: str
    folder: Path
    summary: dict
    rows: list[dict]
    trace: dict  # rank 0's memory timeline

    @classmethod
    def load(cls, label: str, folder) -> "RunResult":
        folder = Path(folder)
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        trace = json.loads((folder / "memory_trace.json").read_text())[0]
        return cls(label, folder, json.loads((folder / "summary.json").read_text()), rows, trace)

    @property
    def step_time(self) -> float:
        """Median step time, leaving out the first step (warm-up) and the traced ones.

        The median, not the mean: on a shared machine a few steps stall for reasons that
        have nothing to do with the run.
        """
        times = [r["step_time_s"] for r in self.rows[1:] if not r["traced"]] or [r["step_time_s"] for r in self.rows]
        return statistics.median(times)

    @property
    def tokens_per_s(self) -> float:
        return self.summary["global_batch_size"] * self.summary["seq_len"] / self.step_time


def render_beside(runs: list[RunResult], path, title: str):
    """The runs' memory timelines stacked one above the other on one y scale."""
    render([dict(r.trace, label=r.label) for r in runs], path, title=title)


def render_peak_bars(runs: list[RunResult], path, title: str, budget: tuple[int, str] | None = None):
    """One stacked bar per run: what was alive at its memory peak, by category.

    ``budget``: (bytes, label) of a memory limit to draw across the bars."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    top = max(r.trace["peak_bytes"] for r in runs)
    scale, unit = (2**30, "GiB") if top >= 2**30 else (2**20, "MiB")
    fig, ax = plt.subplots(figsize=(1.5 * len(runs) + 2.5, 5.2))
    x = np.arange(len(runs))
    bottom = np.zeros(len(runs))
    for cat in STACK_ORDER:
        vals = np.array([r.trace["at_peak"][cat] for r in runs]) / scale
        ax.bar(x, vals, bottom=bottom, color=COLORS[cat], width=0.62, edgecolor="white", linewidth=0.5)
        for i, v in enumerate(vals):
            if v > 0.06 * top / scale:  # label the segments big enough to hold a number
                ax.text(x[i], bottom[i] + v / 2, f"{v:.0f}", ha="center", va="center", fontsize=7, color="white")
        bottom += vals
    base = runs[0].trace["peak_bytes"]
    for i, r in enumerate(runs):
        pk = r.trace["peak_bytes"]
        ax.text(x[i], pk / scale, f"{fmt_bytes(pk)}\n{pk / base:.2f}x", ha="center", va="bottom", fontsize=8,
                bbox=dict(fc="white", ec="none", pad=0.3), zorder=3)
    ax.axhline(base / scale, color="k", linestyle=":", linewidth=0.8)
    if budget:
        ax.axhline(budget[0] / scale, color="#C44E52", linestyle="--", linewidth=1)
        ax.text(x[-1] + 0.45, budget[0] / scale, budget[1], ha="right", va="bottom", fontsize=8, color="#C44E52")
    ax.set_xticks(x, [textwrap.fill(r.label, 18, break_on_hyphens=False) for r in runs], fontsize=8)
    ax.set_ylabel(f"live memory at the peak ({unit})")
    ax.set_ylim(0, top / scale * 1.18)
    ax.spines[["top", "right"]].set_visible(False)
    ax.legend(handles=[Patch(color=COLORS[c], label=c) for c in reversed(STACK_ORDER)], fontsize=8,
              loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown_table(runs: list[RunResult], commands: list[str] | None = None,
                   step_times: dict[str, float] | None = None) -> str:
    """Peak memory by category at the peak, step time and tokens/s, each against runs[0].

    ``step_times`` (seconds, by label) replaces the runs' own step times, e.g. with
    times measured side by side by common.bench.interleaved."""
    mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    head = (["run"] + (["command"] if commands else []) + [f"{c} (MiB)" for c in CATEGORIES]
            + ["peak (MiB)", "peak vs baseline", "step time (ms)", "tokens/s", "step time vs baseline"])
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    base = runs[0]
    step_time = lambda r: step_times[r.label] if step_times else r.step_time  # noqa: E731
    for i, r in enumerate(runs):
        at = r.trace["at_peak"]
        tokens_per_s = r.summary["global_batch_size"] * r.summary["seq_len"] / step_time(r)
        cells = ([r.label] + ([f"`{commands[i]}`"] if commands else []) + [mib(at[c]) for c in CATEGORIES]
                 + [f"**{mib(r.trace['peak_bytes'])}**", f"{r.trace['peak_bytes'] / base.trace['peak_bytes']:.2f}x",
                    f"{step_time(r) * 1e3:.0f}", f"{tokens_per_s:,.0f}", f"{step_time(r) / step_time(base):.2f}x"])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
