"""Tensor parallelism (and sequence parallelism), applied to the model from outside.

The model (common/model.py) never knows about it: ``apply_tp`` gives ``parallelize_module``
Megatron-LM's plan for each block, the way torchtitan's ``parallelize_llama`` does, and
``check_tp`` refuses the shapes that cannot be split, in one sentence, before any rank
starts to communicate (a bad flag never leaves a rank hanging).
"""
from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from common.errors import UserError
from common.model import ModelConfig, Transformer


class EmbeddingParallel(RowwiseParallel):
    """``RowwiseParallel`` for the token embedding, with its all-reduce (or reduce-scatter)
    finished before the output leaves.

    The stock style starts the collective asynchronously and hands on an
    ``AsyncCollectiveTensor``, to be waited for where it is first used. Between eager layers
    that is harmless. But the embedding runs eagerly and its output is the input of the
    first compiled block (``--compile`` compiles block by block): the compiled graph waits
    for such an input itself, and its backward then delivers the input's gradient, a plain
    tensor, straight to the eager redistribution, past ``to_local``'s backward that would
    have made it a DTensor (``'Tensor' object has no attribute '_local_tensor'`` in step 0's
    backward). A finished tensor at that boundary keeps the backward chain whole, and
    waiting here costs nothing: the first block needs the result at once.
    """

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts)  # async_op=False: finished here
        return outputs.to_local() if use_local_output else outputs


def check_tp(cfg: ModelConfig, tp: int, seq_len: int, sequence_parallel: bool):
    """Refuse shapes that do not split evenly over ``tp`` ranks (before any collective)."""
    for what, n, unit in (("n_heads", cfg.n_heads, "attention heads"),
                          ("n_kv_heads", cfg.n_kv_heads, "key/value heads"),
                          ("ffn_dim", cfg.ffn_dim, "MLP hidden units"),
                          ("vocab_size", cfg.vocab_size, "tokens")):
        if n % tp:
            raise UserError(f"the model's {what} ({n}) is not divisible by the tensor-parallel degree {tp}; "
                            f"choose a degree that divides it (or a model with more {unit}).")
    if sequence_parallel and seq_len % tp:
        raise UserError(f"--seq-len {seq_len} is not divisible by the tensor-parallel degree {tp}, which "
                        f"sequence parallelism splits it over; use a multiple of {tp}.")


def apply_tp(model: Transformer, tp_mesh, sequence_parallel: bool = False, loss_parallel: bool = True):
    """Megatron-style tensor parallelism over ``tp_mesh``, in place.

    In each block the first matmuls (wq/wk/wv, w1/w3) are split by output columns, so each
    rank computes whole heads and a slice of the MLP's hidden units with no communication;
    the second ones (wo, w2) are split by input rows, so each rank produces a partial sum
    of the full output, which one all-reduce completes. Hence two all-reduces per block in
    forward and, mirrored, two in backward (the gradient of a replicated input is a sum of
    per-rank partials).

    ``sequence_parallel``: between blocks the activations (the residual stream and the
    norms' work) are split along the sequence instead of replicated; each all-reduce
    becomes a reduce-scatter (after wo/w2) and an all-gather (before the next
    column-split matmul): the same bytes on the wire, but 1/tp of the activations outside
    the matmuls.

    ``loss_parallel``: the output projection keeps its logits split over the vocabulary and
    the cross entropy is computed on the shards (use it under ``loss_parallel()``), so the
    (batch, seq, vocab) logits are never gathered on one rank.
    """
    between = Shard(1) if sequence_parallel else Replicate()  # layout of the residual stream
    norm = SequenceParallel() if sequence_parallel else None
    outer = {
        # Split by vocabulary rows: each rank looks up the tokens in its range and an
        # all-reduce (or reduce-scatter, with SP) fills in the rest, finished before the first
        # block (compiled or not) receives it.
        "tok_embeddings": EmbeddingParallel(input_layouts=Replicate(), output_layouts=between),
        **({"norm": norm} if norm else {}),
        "output": ColwiseParallel(input_layouts=between,
                                  output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    }
    # A pipeline stage may lack the embedding or the head (set to None): plan what is there.
    parallelize_module(model, tp_mesh, {k: v for k, v in outer.items() if getattr(model, k) is not None})
    for block in model.layers.values():
        plan = {
            # One redistribution of the block input for q, k and v together: without it each
            # of the three column-split matmuls would all-reduce its own input gradient.
            "attention": PrepareModuleInput(input_layouts=(between, None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=between),
            "feed_forward": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=between),
        }
        if norm:
            plan |= {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
        parallelize_module(block, tp_mesh, plan)
    return model
