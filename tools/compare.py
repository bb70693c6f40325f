"""Put several runs side by side, from the files the runs wrote.

    python -m tools.compare runs/train_ddp runs/train_fsdp --labels DDP,FSDP --out runs/compare

A run folder holds ``summary.json``, ``metrics.jsonl`` and ``memory_trace.json`` (see
common/measure/metrics.py and common/measure/memory_result.py); everything here reads only those, so a figure or
a table in the README is always a function of real runs. It draws

- ``memory_timelines.png``: one panel per run on ONE y scale; rank 0's memory stacked by
  category, every other rank's total as a line;
- ``peak_by_category.png``: per run a group of bars, one per rank: what was alive at that
  rank's peak, by category;

and prints (and writes ``compare.md``) a table: peak memory per rank, bytes each rank
communicated per optimizer step, tokens/s and final loss. Runs that differ in more than
the strategy (precision, model, batch, steps, ...; read from their summary.json) get a
column for each such setting, and the figure titles name it: an fp32 run beside a bf16
one compares precision as much as sharding.

Chapter 2's figures and table (step2_memory/figures.py) use the same functions with one rank.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file (python tools/x.py): find common/

from common.measure.comm import sent_per_step
from common.errors import UserError, main_guard
from common.measure.byte_units import byte_unit, fmt_bytes
from common.measure.memory_categories import categories
from common.measure.memory_figure import COLORS, render, stack_order
from common.figure_file import save_figure


@dataclass
class RunResult:
    label: str
    folder: Path
    summary: dict
    rows: list[dict]            # metrics.jsonl, one row per optimizer step
    traces: list[dict]          # memory_trace.json: one timeline per rank ([] without tracing)

    @property
    def trace(self) -> dict:
        """Rank 0's memory timeline."""
        if not self.traces:
            raise UserError(f"{self.folder} has no memory_trace.json: its run recorded no memory (it ran with "
                            f"--no-trace-memory, or ended before its --trace-start step); rerun it with the trace on "
                            f"(the default) and a --trace-start before its last step.")
        return self.traces[0]

    @classmethod
    def load(cls, label: str | None, folder) -> "RunResult":
        folder = Path(folder)
        if not folder.is_dir():
            raise UserError(f"run folder {folder} does not exist; pass the --out folder of a finished run.")
        if not (folder / "summary.json").exists():
            raise UserError(f"{folder} has no summary.json; pass the --out folder of a run that finished.")
        summary = _read_json(folder / "summary.json")
        if not isinstance(summary, dict) or not {"global_batch_size", "seq_len"} <= summary.keys():
            raise UserError(f"{folder / 'summary.json'} is not a run's summary (no global_batch_size or seq_len); "
                            f"pass the --out folder of a run that finished, or rerun it.")
        metrics = folder / "metrics.jsonl"
        rows = []
        lines = metrics.read_text(errors="replace").splitlines() if metrics.exists() else []
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                if i < len(lines) - 1:  # a torn last line is a killed run's; one in the middle is damage
                    raise UserError(f"{metrics}: line {i + 1} is not JSON; rerun that run, or delete the file to "
                                    f"compare without its per-step times.") from None
        trace = folder / "memory_trace.json"
        traces = _read_json(trace) if trace.exists() else []
        return cls(label or folder.name, folder, summary, rows, traces)

    @property
    def step_time(self) -> float:
        """Median step time, leaving out the first step (warm-up) and the traced ones.

        The median, not the mean: on a shared machine a few steps stall for reasons that
        have nothing to do with the run.
        """
        if not self.rows:
            return self.summary["step_time_s"]
        times = [r["step_time_s"] for r in self.rows[1:] if not r["traced"]] or [r["step_time_s"] for r in self.rows]
        return statistics.median(times)

    @property
    def tokens_per_s(self) -> float:
        return self.summary["global_batch_size"] * self.summary["seq_len"] / self.step_time

    @property
    def peaks(self) -> list[dict]:
        """Per rank {rank, peak_bytes, at_peak}: from the trace, else from summary.json."""
        return self.traces or self.summary.get("memory") or []

    def comm_per_step(self) -> list[int] | None:
        """Logical bytes each rank sent per optimizer step (a pipeline's point-to-point
        transfers once, at the sender); None when the run did not count them."""
        comm = self.summary.get("comm")
        if not comm:
            return None
        return [int(sent_per_step(rank)[0]) for rank in comm]


def _read_json(path: Path):
    """A run's JSON file, or one sentence naming it (a run killed while writing, a hand edit)."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path} cannot be read ({type(e).__name__}: {str(e)[:80]}); rerun that run, or leave "
                        f"its folder out.") from None


def render_timelines(runs: list[RunResult], path, title: str, ymax: float | None = None):
    """One panel per run, all on one y scale: rank 0 stacked by category, the other
    ranks' totals as lines."""
    traces = []
    for r in runs:
        t = r.trace
        label = r.label if len(r.traces) == 1 else (
            f"{r.label}: rank 0 by category, ranks 1-{len(r.traces) - 1} total as lines")
        traces.append(dict(t, label=label, other_ranks=r.traces[1:]))
    render(traces, path, title=textwrap.fill(title, 110), ymax=ymax)


def render_peak_bars(runs: list[RunResult], path, title: str, budget: tuple[int, str] | None = None):
    """Per run a group of stacked bars, one per rank: what was alive at its memory peak,
    by category. The first run's highest rank peak is the 1.00x reference.

    ``budget``: (bytes, label) of a memory limit to draw across the bars."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    peaks = [r.peaks for r in runs]
    if any(not p for p in peaks):
        missing = [r.folder for r, p in zip(runs, peaks) if not p]
        raise UserError(f"{missing[0]} recorded no memory (its run had --no-trace-memory, or ended before its "
                        f"--trace-start step); rerun it with the trace on (the default) and a --trace-start before "
                        f"its last step.")
    top = max(m["peak_bytes"] for p in peaks for m in p)
    scale, unit = byte_unit(top)
    widest = max(len(p) for p in peaks)
    group_w = 0.8 if widest > 1 else 0.62          # width of one run's group of bars
    fig, ax = plt.subplots(figsize=(max(1.5 * len(runs) * max(1, widest / 2.5) + 2.5, 4.5), 5.2))
    base = max(m["peak_bytes"] for m in peaks[0])
    ticks, ticklabels = [], []
    order = stack_order(*[m for p in peaks for m in p])
    for g, (r, ranks) in enumerate(zip(runs, peaks)):
        n = len(ranks)
        w = group_w / n
        xs = g + (np.arange(n) - (n - 1) / 2) * w
        bottom = np.zeros(n)
        for cat in order:
            vals = np.array([m["at_peak"].get(cat, 0) for m in ranks]) / scale
            ax.bar(xs, vals, bottom=bottom, color=COLORS[cat], width=w * 0.92, edgecolor="white", linewidth=0.5)
            for i, v in enumerate(vals):
                if n == 1 and v > 0.06 * top / scale:  # label the segments big enough to hold a number
                    ax.text(xs[i], bottom[i] + v / 2, f"{v:.0f}", ha="center", va="center", fontsize=7,
                            color="white")
            bottom += vals
        pk = max(m["peak_bytes"] for m in ranks)
        ax.text(g, pk / scale, f"{fmt_bytes(pk)}\n{pk / base:.2f}x", ha="center", va="bottom", fontsize=8,
                bbox=dict(fc="white", ec="none", pad=0.3), zorder=3)
        if n > 1:
            for x, m in zip(xs, ranks):
                ax.text(x, 0, str(m.get("rank", "")), ha="center", va="top", fontsize=6, color="0.3")
        ticks.append(g)
        ticklabels.append(textwrap.fill(r.label, 18, break_on_hyphens=False) + (f"\n(ranks 0-{n - 1})" if n > 1 else ""))
    ax.axhline(base / scale, color="k", linestyle=":", linewidth=0.8)
    if budget:
        ax.axhline(budget[0] / scale, color="#C44E52", linestyle="--", linewidth=1)
        ax.text(len(runs) - 0.55, budget[0] / scale, budget[1], ha="right", va="bottom", fontsize=8, color="#C44E52")
    ax.set_xticks(ticks, ticklabels, fontsize=8)
    ax.tick_params(axis="x", length=0, pad=10 if widest > 1 else 4)
    ax.set_ylabel(f"live memory at the peak ({unit})" + (", per rank" if widest > 1 else ""))
    ax.set_ylim(0, top / scale * 1.18)
    ax.spines[["top", "right"]].set_visible(False)
    ax.legend(handles=[Patch(color=COLORS[c], label=c) for c in reversed(order)], fontsize=8,
              loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    # wrapped to the figure's width (about 11 characters an inch at this size), so a narrow
    # figure of two runs does not clip it
    ax.set_title(textwrap.fill(title, min(80, max(40, int(fig.get_size_inches()[0] * 11)))), fontsize=10)
    save_figure(fig, path)
    plt.close(fig)


def markdown_table(runs: list[RunResult], commands: list[str] | None = None,
                   step_times: dict[str, float] | None = None, flops: dict[str, int] | None = None) -> str:
    """Chapter 2's table: rank 0's peak memory by category at the peak, step time and
    tokens/s, each against runs[0].

    ``step_times`` (seconds, by label) replaces the runs' own step times, e.g. with
    times measured side by side by common.measure.interleaved_bench.interleaved. ``flops`` (by
    label): the matmul and attention FLOPs of one step, recomputation included
    (common.measure.interleaved_bench.matmul_flops), shown against runs[0]'s."""
    mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    cats = categories(*[r.trace for r in runs])
    head = (["run"] + (["command"] if commands else []) + [f"{c} (MiB)" for c in cats]
            + ["peak (MiB)", "peak vs baseline", "step time (ms)", "tokens/s", "step time vs baseline"]
            + (["matmul FLOPs vs baseline"] if flops else []))
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    base = runs[0]
    step_time = lambda r: step_times[r.label] if step_times else r.step_time  # noqa: E731
    for i, r in enumerate(runs):
        at = r.trace["at_peak"]
        tokens_per_s = r.summary["global_batch_size"] * r.summary["seq_len"] / step_time(r)
        cells = ([r.label] + ([f"`{commands[i]}`"] if commands else []) + [mib(at.get(c, 0)) for c in cats]
                 + [f"**{mib(r.trace['peak_bytes'])}**", f"{r.trace['peak_bytes'] / base.trace['peak_bytes']:.2f}x",
                    f"{step_time(r) * 1e3:.0f}", f"{tokens_per_s:,.0f}", f"{step_time(r) / step_time(base):.2f}x"]
                 + ([f"{flops[r.label] / flops[base.label]:.2f}x"] if flops else []))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# What makes two runs' numbers differ besides the label: read from summary.json, named in
# the table and the figure titles when the runs do not share it. An fp32 run beside a bf16
# one, or a batch of 8 beside one of 16, moves the peak as much as the strategy does.
def _strategy(s: dict) -> str | None:
    if s.get("strategy") == "single":  # steps 1 and 2: one device; their savers are the precision column
        return "one device"
    lesson = s.get("lesson")  # the script's title, e.g. "Pipeline parallel (1f1b, 8 micro-batches)"
    if lesson:
        return lesson.split(", ", 1)[1] if lesson.startswith("Step ") and ", " in lesson else lesson
    return s.get("strategy") or s.get("script")


SETTINGS = {  # name in the table -> its value from a summary (None: the run did not record it)
    "strategy": _strategy,
    "model": lambda s: s.get("model") and (f"{s['model']} ({s['n_params'] / 1e6:.2f}M parameters)"
                                          if s.get("n_params") else s["model"]),
    "precision": lambda s: s.get("savers") or s.get("dtype"),  # "fp32", "AMP bf16 + full AC", ...
    "batch": lambda s: f"{s['global_batch_size']} x {s['seq_len']} tokens",
    "steps": lambda s: s.get("steps"),
    "lr": lambda s: s.get("lr"),
    "seed": lambda s: s.get("seed"),
    "data": lambda s: s.get("data"),
    "device": lambda s: s.get("device_name") or s.get("device"),
    "ranks": lambda s: s.get("world_size"),
}


def settings(runs: list["RunResult"]) -> tuple[dict[str, object], dict[str, list]]:
    """(the settings every run shares: name -> value, the ones that differ: name -> value per
    run). A setting no run recorded (an older summary.json) is in neither."""
    shared, differ = {}, {}
    for name, get in SETTINGS.items():
        values = [get(r.summary) for r in runs]
        if all(v is None for v in values):
            continue
        if len(set(map(str, values))) == 1:
            shared[name] = values[0]
        else:
            differ[name] = ["?" if v is None else v for v in values]
    return shared, differ


def describe(runs: list["RunResult"], what: str | None = None) -> str:
    """A title's second half: what the runs share (``what`` if given), then what differs."""
    shared, differ = settings(runs)
    if what is None:
        model = str(shared.get("model", ""))
        parts = [(model.replace(" (", " model (", 1) if " (" in model else f"{model} model") if model else None,
                 f"batch {shared['batch']}" if "batch" in shared else None,
                 shared.get("precision"),
                 f"{shared['steps']} steps" if "steps" in shared else None,
                 shared.get("device"),
                 f"{shared['ranks']} rank{'s' if shared['ranks'] != 1 else ''}" if "ranks" in shared else None]
        what = ", ".join(str(p) for p in parts if p)
    others = [k for k in differ if k != "strategy"]  # the strategy is what a comparison is about
    return what + (f"; runs differ in {', '.join(others)}" if others else "")


def _spread(values: list[float], fmt) -> str:
    lo, hi = min(values), max(values)
    return fmt(hi) if len(values) == 1 or hi - lo <= 0.005 * hi else f"{fmt(lo)} - {fmt(hi)}"


def compare_table(runs: list[RunResult]) -> str:
    """Several runs, possibly on several ranks: a line naming what they share, then per run
    the settings that differ between them (one column each: the strategy, precision, model,
    batch, ...), per-rank peak memory (the highest rank and the range over ranks), logical
    bytes communicated per optimizer step per rank, tokens/s (median step, whole job) and
    the final loss."""
    shared, differ = settings(runs)
    extra = [k for k in differ if k != "ranks"]  # ranks has its column anyway
    head = ["run", *extra, "ranks", "peak, highest rank", "peak per rank (range)", "peak vs first",
            "sent per step per rank", "tokens/s", "final loss"]
    note = [f"All runs: {', '.join(f'{k} {v}' for k, v in shared.items())}."] if shared else []
    if set(differ) - {"strategy"}:
        note.append(f"They differ in {', '.join(differ)}: the columns compare all of these, not the strategy alone.")
    lines = ([" ".join(note), ""] if note else []) + [
        "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    base = max((m["peak_bytes"] for m in runs[0].peaks), default=None)
    for i, r in enumerate(runs):
        peaks = [m["peak_bytes"] for m in r.peaks]
        comm = r.comm_per_step()
        s = r.summary
        cells = [r.label, *(str(differ[k][i]) for k in extra), str(s.get("world_size", len(peaks) or 1)),
                 f"**{fmt_bytes(max(peaks))}**" if peaks else "n/a",
                 _spread(peaks, fmt_bytes) if peaks else "n/a",
                 f"{max(peaks) / base:.2f}x" if peaks and base else "n/a",
                 ("0 B" if not any(comm) else _spread(comm, fmt_bytes)) if comm is not None else "n/a",
                 f"{r.tokens_per_s:,.0f}",
                 f"{s['final_loss']:.4f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def compare(folders, labels=None, out=None, title: str | None = None) -> str:
    """Draw the two figures into ``out`` (if given) and return the markdown table."""
    labels = list(labels or [])
    if labels and len(labels) != len(folders):
        raise UserError(f"--labels names {len(labels)} runs but {len(folders)} run folders were given; "
                        f"give one label per folder.")
    runs = [RunResult.load(labels[i] if labels else None, f) for i, f in enumerate(folders)]
    table = compare_table(runs)
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        what = describe(runs, title)
        if all(r.traces for r in runs):
            render_timelines(runs, out / "memory_timelines.png", f"Live memory per rank, one scale: {what}")
        render_peak_bars(runs, out / "peak_by_category.png", f"What is alive at each rank's memory peak: {what}")
        (out / "compare.md").write_text(table)
    return table


@main_guard
def main(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m tools.compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run folders (the --out of each run)")
    p.add_argument("--labels", default=None, help="comma-separated names, one per run (default: folder names)")
    p.add_argument("--out", default="runs/compare", help="folder for the figures and compare.md (default: runs/compare)")
    p.add_argument("--title", default=None, help="what the runs share, for the figure titles (default: read "
                                                 "from their summary.json; what differs is named either way)")
    args = p.parse_args(argv)
    labels = [s.strip() for s in args.labels.split(",")] if args.labels else None
    table = compare(args.runs, labels, args.out, args.title)
    print(table, flush=True)
    print(f"wrote {args.out}/memory_timelines.png, peak_by_category.png and compare.md", flush=True)


if __name__ == "__main__":
    sys.exit(main())
