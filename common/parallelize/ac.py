"""Activation checkpointing, applied to a model from the outside.

Activation checkpointing (AC) is applied the way FSDP2's ``fully_shard`` is: the block's
class is swapped for a subclass whose ``forward`` runs the original one under
``torch.utils.checkpoint``. Nothing is wrapped, so parameter names, ``state_dict`` keys
and everything that addresses the model by name (FSDP, tensor parallelism, checkpoints)
see the same model as without AC. ``print(model)`` shows ``CheckpointedTransformerBlock``.

With FSDP, apply AC *before* ``fully_shard``: the checkpoint then sits inside each FSDP
unit, FSDP casts the block's inputs to bf16 before the checkpoint saves them, and the
recomputation sees exactly the dtypes of the original forward. The other order,
checkpoint(fsdp_block), recomputes from the saved fp32 inputs without that cast on
torch < 2.13 (pytorch issue 159359) and fails with a metadata mismatch.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

AC_MODES = ("none", "full", "selective", "selective-op")

aten = torch.ops.aten
# Selective AC keeps the outputs of these ops and recomputes everything else in the
# block: matrix multiplies and attention cost O(n * d^2) or O(n^2 * d) FLOPs to redo,
# while norms, RoPE, SiLU and the residual adds are cheap to redo but together hold as
# many bytes. ``selective-op`` is torchtitan's per-op policy: the same, but every second
# matmul of a block is recomputed too (wk, wo and w3 of our block's seven), which trades
# three matmuls of recomputation for their outputs' bytes.
_SAVE_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default}
for _name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"):
    if hasattr(aten, _name):  # which attention kernels exist depends on the torch version
        _SAVE_OPS.add(getattr(aten, _name).default)


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _every_second_mm_policy(counts, ctx, op, *args, **kwargs):
    """Keep what ``_selective_policy`` keeps, except the output of every second mm (the 2nd,
    4th, ...), counted apart in the forward and in the recomputation so both agree."""
    if op is aten.mm.default:
        key = "recompute" if ctx.is_recompute else "forward"
        counts[key] = counts.get(key, 0) + 1
        if counts[key] % 2 == 0:
            return CheckpointPolicy.PREFER_RECOMPUTE
    return _selective_policy(ctx, op)


def _every_second_mm_contexts():
    return create_selective_checkpoint_contexts(partial(_every_second_mm_policy, {}))  # fresh counts per forward


class _Checkpointed:
    """Mixin: run the block's own forward under non-reentrant activation checkpointing.

    Non-reentrant (``use_reentrant=False``) is the variant PyTorch recommends: it works
    with keyword arguments, with inputs that do not require grad and with
    ``torch.compile``, and it stops recomputing as soon as backward has what it needs.
    """

    _ac_context_fn = None

    def forward(self, *args, **kwargs):
        extra = {"context_fn": self._ac_context_fn} if self._ac_context_fn is not None else {}
        return checkpoint(super().forward, *args, use_reentrant=False, **extra, **kwargs)


_classes: dict[type, type] = {}


def checkpoint_module(module: nn.Module, selective: bool | str = False) -> nn.Module:
    """Make ``module`` recompute its forward in backward instead of keeping activations."""
    cls = type(module)
    if isinstance(module, _Checkpointed):
        raise ValueError(f"{cls.__name__} is already checkpointed")
    if cls not in _classes:
        _classes[cls] = type(f"Checkpointed{cls.__name__}", (_Checkpointed, cls), {})
    module.__class__ = _classes[cls]
    if selective == "selective-op":
        module._ac_context_fn = _every_second_mm_contexts
    elif selective:
        module._ac_context_fn = partial(create_selective_checkpoint_contexts, _selective_policy)
    return module


def apply_ac(model: nn.Module, mode: str, every: int = 1) -> list[str]:
    """Checkpoint every ``every``-th block of ``model.layers``; returns the names of those blocks.

    ``full`` keeps only each block's input and recomputes the whole block in backward;
    ``selective`` keeps the matmul and attention outputs and recomputes the cheap ops;
    ``selective-op`` recomputes every second matmul as well.
    """
    if mode not in AC_MODES:
        raise ValueError(f"unknown AC mode {mode!r}; choose one of {', '.join(AC_MODES)}")
    if mode == "none":
        return []
    done = []
    for i, (name, block) in enumerate(model.layers.items()):
        if i % every == 0:
            checkpoint_module(block, selective=mode if mode.startswith("selective") else False)
            done.append(name)
    return done
