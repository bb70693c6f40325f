"""The memory trace's categories: the five every trace has, the one a run has only when it
has the thing (a checkpoint's host copy), and the name of what the CUDA allocator held beyond
the trace. Shared by the tracer (common/measure/memory.py), its result (memory_result.py),
its figure (memory_figure.py) and the formulas' report (theory.py)."""
from __future__ import annotations

CATEGORIES = ("parameters", "gradients", "optimizer state", "activations", "other")
# A category a run has only if it has the thing: its key is absent from the traces (and
# figures) of every other run, which therefore stay as they were.
STAGING = "checkpoint staging"
EXTRA_CATEGORIES = (STAGING,)
# Not a category of the trace: what the allocator held beyond it (CUDA), drawn hatched on top
UNSEEN = "not seen by the trace"


def categories(*traces) -> tuple[str, ...]:
    """The categories these traces hold: the five, then any extra one some trace has."""
    return CATEGORIES + tuple(c for c in EXTRA_CATEGORIES if any(c in t.get("at_peak", {}) for t in traces))
