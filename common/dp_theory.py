"""What the data-parallel family should cost, per rank, and the chapter's table.

The formulas of the chapter (N parameters in fp32, W ranks, AdamW):

                 model state per rank          communicated per rank per step
  DDP            4N + 4N + 8N = 16N            all-reduce 4N (gradients)
  ZeRO-1         4N + 4N + 8N/W                all-reduce 4N + broadcast 4N (updated weights)
  FSDP ZeRO-2    16N/W (+ all 4N gathered      all-gather 4N, reduce-scatter 4N
                 from forward to backward)
  FSDP ZeRO-3    16N/W (+ one or two blocks    all-gather 4N in forward + 4N in backward,
                 gathered at a time)           reduce-scatter 4N
  HSDP R x S     16N/S                         as FSDP over S ranks, + all-reduce 4N/S

The functions here make them exact for the tests, to the byte:
- AdamW's ``step`` counter is a 4-byte fp32 tensor per parameter tensor (on the CPU;
  on CUDA it stays on the host unless ``capturable``), so the state is 8N + 4T bytes;
- FSDP shards each parameter along dim 0 in W chunks of ceil(rows / W) rows (the last
  ones shorter or empty) and pads its own storage, so parameters, gradients and the
  all-gathers are counted with the padded chunk, the AdamW state with the real one;
- FSDP keeps the root (embedding, final norm, output) gathered from forward to backward
  (gathering it again right away would be waste), so ZeRO-3's backward all-gather is
  4(N - N_root), not 4N.
"""
from __future__ import annotations

import math

import torch

from common.model import ModelConfig, Transformer


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = Transformer(cfg)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


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


def model_state(strategy: str, cfg: ModelConfig, world: int, rank: int = 0, shard: int | None = None,
                adam_step_bytes: int = 4) -> dict[str, int]:
    """Predicted bytes of parameters, gradients and AdamW state on one rank at the
    optimizer step (``shard``: the FSDP shard group size, the world size by default;
    ZeRO-1's partition is ZeroRedundancyOptimizer's own, so its state is the average)."""
    shapes = param_shapes(cfg)
    n, t = sum(math.prod(s) for s in shapes.values()), len(shapes)
    if strategy == "ddp":
        return {"parameters": 4 * n, "gradients": 4 * n, "optimizer state": 8 * n + adam_step_bytes * t}
    if strategy == "zero1":
        return {"parameters": 4 * n, "gradients": 4 * n,
                "optimizer state": round((8 * n + adam_step_bytes * t) / world)}
    s = shard or world
    r = rank % s  # HSDP: ranks are laid out (replicate, shard), the shard index varies fastest
    padded = sum(padded_shard_numel(sh, s) for sh in shapes.values())
    local = sum(shard_numel(sh, s, r) for sh in shapes.values())
    return {"parameters": 4 * padded, "gradients": 4 * padded, "optimizer state": 8 * local + adam_step_bytes * t}


def unsharded_bytes(cfg: ModelConfig, world: int = 1, bytes_per_param: int = 4) -> dict[str, int]:
    """Gathered size of each FSDP unit, 'root' and one 'block' (padded chunks x world)."""
    shapes = param_shapes(cfg)
    root = sum(padded_shard_numel(s, world) * world for k, s in shapes.items() if is_root(k))
    block = sum(padded_shard_numel(s, world) * world for k, s in shapes.items() if k.startswith("layers.0."))
    return {"root": bytes_per_param * root, "block": bytes_per_param * block}


def comm_bytes(strategy: str, cfg: ModelConfig, world: int, shard: int | None = None,
               param_bytes: int = 4, accum: int = 1) -> dict[str, int]:
    """Logical bytes per rank per optimizer step, by collective (``param_bytes`` 2 for
    bf16 all-gathers; gradients are always reduced in fp32). With ``accum`` micro-batches
    the gradients are still reduced once, but FSDP gathers the parameters for each."""
    shapes = param_shapes(cfg)
    n = sum(math.prod(s) for s in shapes.values())
    if strategy == "ddp":
        return {"all_reduce": 4 * n}
    if strategy == "zero1":
        return {"all_reduce": 4 * n, "broadcast": 4 * n}
    s = shard or world
    if s == 1:  # nothing sharded: HSDP degenerates into DDP
        return {"all_reduce": 4 * n} if world > 1 else {}
    gathered = {k: padded_shard_numel(sh, s) * s for k, sh in shapes.items()}  # padded full size
    full = sum(gathered.values())
    no_root = sum(v for k, v in gathered.items() if not is_root(k))
    out = {"all_gather": accum * param_bytes * (full + (no_root if strategy.endswith("zero3") else 0)),
           "reduce_scatter": 4 * full}
    if strategy.startswith("hsdp") and world > s:
        out["all_reduce"] = 4 * full // s  # each rank's reduced shard, across the replicas
    return out


def formula(strategy: str) -> dict[str, str]:
    """The chapter's formulas, as text for the table."""
    return {
        "ddp": {"memory": "16N", "comm": "all-reduce 4N"},
        "zero1": {"memory": "8N + 8N/W", "comm": "all-reduce 4N + broadcast 4N"},
        "fsdp_zero2": {"memory": "16N/W", "comm": "all-gather 4N + reduce-scatter 4N"},
        "fsdp_zero3": {"memory": "16N/W", "comm": "all-gather 4N + 4(N - N_root) + reduce-scatter 4N"},
        "hsdp_zero3": {"memory": "16N/S", "comm": "as ZeRO-3 over S + all-reduce 4N/S"},
        "hsdp_zero2": {"memory": "16N/S", "comm": "as ZeRO-2 over S + all-reduce 4N/S"},
    }[strategy]
