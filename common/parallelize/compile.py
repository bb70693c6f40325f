"""``torch.compile``, one transformer block at a time, applied from outside the model.

Per block, not the whole model: every block has the same code, so dynamo compiles one
graph and reuses it for all of them (compile time does not grow with depth), and the
parallelism's hooks between blocks (FSDP's all-gathers and reduce-scatters, DDP's
bucketed all-reduces) stay outside the graphs, in eager mode, where they already overlap
with compute. Applied after AC (the recomputation is then inside the graph, fused with
the rest) and after tensor parallelism or FSDP have changed the block (the graph is
traced on what really runs). What runs eagerly before the first block must hand it a
finished tensor, not one whose collective is still in flight (tensor parallelism's
embedding does: common/parallelize/tp.py, EmbeddingParallel, says why). ``Module.compile``
works in place: parameter names and state_dict keys do not change, so checkpoints load
with or without ``--compile``.
"""
from __future__ import annotations

import torch.nn as nn


def apply_compile(model: nn.Module, enabled: bool = True) -> list[str]:
    """Compile every block of ``model.layers`` in place; returns the names of those blocks."""
    if not enabled or getattr(model, "layers", None) is None:
        return []
    for block in model.layers.values():
        block.compile()
    return list(model.layers)
