"""The model's parameter shapes, and how a layout splits them among the ranks.

Which parameters a rank holds is a product of three splits (torchtitan's order: pipeline
stage, then tensor parallel, then data parallel over what is left):
- PP: its stage's layers (``stage_layers``), the embedding on the first stage, the final
  norm and the output on the last;
- TP: 1/tp of each projection (Megatron's column/row split), norms replicated;
- DP: all of it (single, DDP), all but 1/dp of AdamW's state (ZeRO-1), or a dim-0 chunk of
  each tensor, padded to ceil(rows/dp) rows (FSDP ZeRO-2/3, HSDP over its shard group).

``rank_shapes`` is the product for one rank of a ``Plan`` (common/measure/plan.py); the
formulas (common/measure/formulas.py) count bytes on the shapes these return.
"""
from __future__ import annotations

import functools
import math

import torch

from common.measure.plan import Plan
from common.model import ModelConfig, Transformer
from common.parallelize.schedules import V_SCHEDULES

COLWISE = ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "feed_forward.w1.weight",
           "feed_forward.w3.weight")
ROWWISE = ("attention.wo.weight", "feed_forward.w2.weight")


# ---- shapes and splits -----------------------------------------------------------------------
@functools.lru_cache(maxsize=32)
def _shapes(cfg: ModelConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
    with torch.device("meta"):
        model = Transformer(cfg)
    return tuple((name, tuple(p.shape)) for name, p in model.named_parameters())


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return dict(_shapes(cfg))


def _rows(shape) -> tuple[int, int]:
    return shape[0], math.prod(shape[1:])


def shard_numel(shape, w: int, rank: int) -> int:
    """Elements of rank's chunk of a parameter sharded in w along dim 0 (torch.chunk)."""
    rows, rest = _rows(shape)
    chunk = math.ceil(rows / w)
    return max(0, min(chunk, rows - rank * chunk)) * rest


def padded_shard_numel(shape, w: int) -> int:
    rows, rest = _rows(shape)
    return math.ceil(rows / w) * rest


def is_root(name: str) -> bool:
    return not name.startswith("layers.")


def stage_layers(n_layers: int, n_stages: int) -> list[list[int]]:
    """The layer indices each pipeline stage owns: contiguous, sizes differing by at most one.

    When ``n_layers`` does not divide, the *last* ``n_layers % n_stages`` stages get one
    layer more. Why the last: under 1F1B stage s keeps up to (stages - s) micro-batches of
    activations alive, the first stage the most and the last only one, so extra layers
    cost least memory at the end. (The last stage also runs the output projection and the
    loss: cheap with our 256-byte vocabulary, worth about two layers with a 128K one, where
    you would give it fewer layers instead.)
    """
    base, extra = divmod(n_layers, n_stages)
    sizes = [base + (1 if s >= n_stages - extra else 0) for s in range(n_stages)]
    starts = [sum(sizes[:s]) for s in range(n_stages)]
    return [list(range(a, a + n)) for a, n in zip(starts, sizes)]


def stage_shapes(cfg: ModelConfig, stage: int, n_stages: int) -> dict[str, tuple[int, ...]]:
    """The parameters pipeline stage ``stage`` holds (build_stage's pruning, by name)."""
    mine = {f"layers.{i}." for i in stage_layers(cfg.n_layers, n_stages)[stage]}
    keep = {}
    for name, shape in param_shapes(cfg).items():
        if name.startswith("layers."):
            ok = name[: name.index(".", 7) + 1] in mine
        elif name.startswith("tok_embeddings."):
            ok = stage == 0
        else:  # norm, output
            ok = stage == n_stages - 1
        if ok:
            keep[name] = shape
    return keep


def tp_shapes(shapes: dict[str, tuple[int, ...]], tp: int) -> dict[str, tuple[int, ...]]:
    """Each parameter's local shape under common/parallelize/tp.py:apply_tp (even splits)."""
    if tp == 1:
        return dict(shapes)
    out = {}
    for name, (a, *rest) in shapes.items():
        if name.endswith(COLWISE) or name in ("output.weight", "tok_embeddings.weight"):
            out[name] = (a // tp, *rest)  # split by output rows (the embedding: by vocabulary)
        elif name.endswith(ROWWISE):
            out[name] = (a, rest[0] // tp)
        else:
            out[name] = (a, *rest)  # norms: replicated
    return out


# ---- one rank of a Plan (common/measure/plan.py) -----------------------------------------------
def _loops(plan: Plan) -> int:
    return 2 if plan.schedule in ("interleaved1f1b", *V_SCHEDULES) and plan.pp > 1 else 1


def _rank_stages(plan: Plan, stage: int) -> list[int]:
    """The pipeline stages of the rank at position ``stage``: looped (s, s + p) or in a V (s, 2p - 1 - s)."""
    if plan.schedule in V_SCHEDULES and plan.pp > 1:
        return [stage, 2 * plan.pp - 1 - stage]
    return [stage + k * plan.pp for k in range(_loops(plan))]


def rank_shapes(plan: Plan, rank: int) -> dict[str, tuple[int, ...]]:
    stage, _, _ = plan.coords(rank)
    loops = _loops(plan)
    shapes = {}
    for s in _rank_stages(plan, stage):
        shapes |= stage_shapes(plan.cfg, s, plan.pp * loops)
    return tp_shapes(shapes, plan.tp)
