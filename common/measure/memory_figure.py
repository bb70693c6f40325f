"""The memory trace's figure (``render``): a stacked area per category, one panel per rank,
the phases as bands along the top, the peak annotated, the allocator's peak as a dashed line;
and the colours and stacking order it draws with (tools/compare.py draws with them too)."""
from __future__ import annotations

import numpy as np

from common.measure.byte_units import byte_unit, fmt_bytes
from common.measure.memory_categories import CATEGORIES, STAGING, UNSEEN, categories
from common.figure_file import save_figure

COLORS = {"parameters": "#4C72B0", "gradients": "#DD8452", "optimizer state": "#55A868",
          "activations": "#C44E52", "other": "#8C8C8C", STAGING: "#64B5CD"}
STACK_ORDER = ("parameters", "optimizer state", "gradients", "activations", "other")  # persistent at the bottom


def stack_order(*traces) -> tuple[str, ...]:
    """STACK_ORDER, then the extra categories these traces hold (on top)."""
    return STACK_ORDER + categories(*traces)[len(CATEGORIES):]
PHASE_COLORS = {"forward": "#D9D9D9", "backward": "#969696", "clipping": "#8172B3", "optimizer": "#404040"}
ALLOCATOR_COLOR = "#B8860B"  # the allocator's peak, drawn as a line beside the traced curve


def render(traces: list[dict], path, title: str, ymax: float | None = None) -> list[dict]:
    """A stacked-area figure, one panel per rank, phases shaded, the peak annotated.

    All panels share one y scale (the highest peak, or ``ymax``), so several runs' traces
    can be compared by eye; a trace's ``label`` key, if any, names its panel, and its
    ``other_ranks`` key, if any (traces of the same run's other ranks), adds each of those
    ranks' total as a line over the stacked areas (tools/compare.py draws runs this way).
    The allocator's own peak over the same steps, where it was measured, is a dashed line:
    the gap between it and the traced curve is memory the trace does not see.

    Returns each panel's layout in pixels ({"box", "peak", "label", "allocator"}: the "at
    the peak" box, the peak marker, its label and the allocator line's height, None without
    one), for the tests: the box never covers the marker.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    def allocator(t):
        return t.get("allocator_peak_bytes") or 0

    peak = max([max(t["peak_bytes"], allocator(t)) for t in traces]
               + [o["peak_bytes"] for t in traces for o in t.get("other_ranks", ())])
    order = stack_order(*traces)
    top = ymax or peak
    scale, unit = byte_unit(top)
    fig, axes = plt.subplots(len(traces), 1, figsize=(12.5, 2.2 + 2.6 * len(traces)), squeeze=False, sharex=False)
    panels = []
    for ax, t in zip(axes[:, 0], traces):
        s = t["series"]
        x = np.asarray(s["event"])
        ys = [np.asarray(s.get(c, np.zeros(len(x)))) / scale for c in order]
        ax.stackplot(x, ys, colors=[COLORS[c] for c in order], step="post", linewidth=0)
        if UNSEEN in s:  # what the allocator held beyond the trace (CUDA), hatched on top of it
            base = np.sum(ys, axis=0)
            ax.fill_between(x, base, base + np.asarray(s[UNSEEN]) / scale, step="post", facecolor="none",
                            hatch="////", edgecolor=ALLOCATOR_COLOR, linewidth=0)
        end = t["events"] - 1
        for o in t.get("other_ranks", ()):
            end = max(end, o["events"] - 1)
        pk, pe = t["peak_bytes"], t["peak_event"]
        # The "at the peak" box stands beside the panel, where it hides nothing (inside, a box
        # away from the peak covered the other step's peak); the peak's label faces the roomier side.
        box_right = pe < 0.5 * end
        for o, ls in zip(t.get("other_ranks", ()), ("-", "--", "-.", ":") * 64):
            so = o["series"]
            ax.plot(so["event"], np.sum([so[c] for c in categories(o)], axis=0) / scale, color="k", linewidth=0.9,
                    linestyle=ls, drawstyle="steps-post", label=f"rank {o['rank']} total", alpha=0.75)
        if t.get("other_ranks"):
            ax.legend(loc="upper left", fontsize=7, frameon=False, bbox_to_anchor=(0, 0.86))
        spans = t["phases"] + [(end, None)]
        for (a, ph), (b, _) in zip(spans[:-1], spans[1:]):
            if ph is None:
                continue
            ax.axvspan(a, b, ymin=0.955, ymax=1.0, color=PHASE_COLORS.get(ph, "#404040"), linewidth=0)
            if b - a > 0.06 * end:
                ax.text((a + b) / 2, 0.977, ph, transform=ax.get_xaxis_transform(), fontsize=7, ha="center",
                        va="center", color="white" if ph not in ("forward",) else "black")
        for ev, step in t["steps"]:
            ax.axvline(ev, color="k", linestyle=":", linewidth=0.8)
            ax.text(ev, 0.93, f" step {step}", transform=ax.get_xaxis_transform(), fontsize=8, va="top")
        alloc = allocator(t)
        alloc_line = ax.axhline(alloc / scale, color=ALLOCATOR_COLOR, linestyle="--", linewidth=1.2) if alloc else None
        (marker,) = ax.plot([pe], [pk / scale], marker="v", color="k", markersize=6)
        label = ax.text(pe, pk / scale, f" peak {fmt_bytes(pk)}", fontsize=8, va="bottom",
                        ha="left" if box_right else "right")
        lines = [f"at the peak ({fmt_bytes(pk)}):"] + [f"{c}: {fmt_bytes(b)}" for c, b in t["at_peak"].items() if b]
        if alloc:
            lines += [f"allocator's peak (dashed): {fmt_bytes(alloc)}", f"traced / allocator: {pk / alloc:.3f}"]
        if t.get("unseen"):
            u = t["unseen"]
            lines += [f"{UNSEEN} (hatched):", f"  {fmt_bytes(u['at_peak'])} here, {fmt_bytes(u['max_bytes'])} at most,",
                      f"  {fmt_bytes(u['alive_before_bytes'])} alive before the step"]
        box = ax.text(1.01, 1.0, "\n".join(lines), transform=ax.transAxes, ha="left", va="top", fontsize=8,
                      bbox=dict(boxstyle="round", fc="white", ec="0.7", alpha=0.9))
        ax.set_xlim(0, end)
        ax.set_ylim(0, top / scale * 1.25)
        ax.set_ylabel(f"live memory ({unit})")
        name = t.get("label") or (f"rank {t['rank']}" if len(traces) > 1 else t["device"])
        ax.set_title(name, fontsize=9, loc="left")
        panels.append((box, marker, label, ax, alloc_line))
    axes[-1, 0].set_xlabel("allocation / free events")
    handles = [Patch(color=COLORS[c], label=c) for c in reversed(order)]
    if any(allocator(t) for t in traces):
        handles.append(Line2D([], [], color=ALLOCATOR_COLOR, linestyle="--", label="allocator's peak"))
    if any(UNSEEN in t["series"] for t in traces):
        handles.append(Patch(facecolor="none", hatch="////", edgecolor=ALLOCATOR_COLOR, label=UNSEEN))
    # The phase bands along the top, every phase named (a short one, like clipping, has no room for its name)
    seen = {ph for t in traces for _, ph in t["phases"] if ph}
    handles += [Patch(color=c, label=f"{ph} (band)") for ph, c in PHASE_COLORS.items() if ph in seen]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=11)
    rows = -(-len(handles) // 6)
    save_figure(fig, path, (0, (0.06 if len(traces) > 1 else 0.1) * (1 + 0.5 * (rows - 1)), 1, 0.97))
    renderer = fig.canvas.get_renderer()
    layout = []
    for box, marker, label, ax, line in panels:
        mx, my = ax.transData.transform(marker.get_xydata()[0])
        layout.append({"box": box.get_bbox_patch().get_window_extent(renderer).extents.tolist(),
                       "peak": [float(mx), float(my)],
                       "label": label.get_window_extent(renderer).extents.tolist(),
                       "allocator": None if line is None else float(ax.transData.transform((0, line.get_ydata()[0]))[1])})
    plt.close(fig)
    return layout
