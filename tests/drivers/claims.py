"""One 2-rank gloo launch for the README's distributed claims (tests/test_claims.py).

Rank 0 writes OUT as JSON: what ReduceOp.AVG returned, the TORCH_NCCL_ASYNC_ERROR_HANDLING
torchrun gave the worker, the dtypes RoPE's tables have inside an FSDP2 unit under
MixedPrecisionPolicy(param_dtype=bf16), the placement of tensor parallelism's embedding
gradient, and the all-reduces of sequence parallelism's norm gains.
"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from common.model import Transformer, get_config  # noqa: E402
from common.parallelize.fsdp import apply_fsdp  # noqa: E402


def main(out):
    dist.init_process_group("gloo")
    rank, w = dist.get_rank(), dist.get_world_size()
    # 5 elements on 2 ranks: a divisor mixed up with numel() would show
    t = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]) * (rank + 1) + 10 * rank
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    want = sum(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]) * (r + 1) + 10 * r for r in range(w)) / w

    cfg = get_config("debug")
    with torch.device("meta"):
        model = Transformer(cfg)
    apply_fsdp(model, init_device_mesh("cpu", (w,), mesh_dim_names=("dp",)), param_dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    seen = {}
    # attention is inside block 0's unit: it sees the (cos, sin) the block's forward received
    model.layers["0"].attention.register_forward_pre_hook(
        lambda m, args: seen.update(cos_in_block=str(args[1].dtype), x_in_block=str(args[0].dtype)))
    model(torch.randint(0, cfg.vocab_size, (2, 16)))
    seen["root_buffer"] = str(model.rope_cos.dtype)
    # tensor parallelism's embedding: the weight split by vocabulary, its gradient as
    # DTensor's embedding backward returns it
    from common.parallelize.tp import apply_tp
    tp_model = Transformer(cfg)
    tp_model.init_weights(seed=0)
    apply_tp(tp_model, init_device_mesh("cpu", (w,), mesh_dim_names=("tp",)))
    tp_model(torch.randint(0, cfg.vocab_size, (2, 16))).float().sum().backward()
    weight = tp_model.tok_embeddings.weight
    seen["tp_embedding"] = {"weight": [str(p) for p in weight.placements], "weight_local": list(weight.to_local().shape),
                            "grad": [str(p) for p in weight.grad.placements],
                            "grad_local": list(weight.grad.to_local().shape), "full": [cfg.vocab_size, cfg.dim]}
    seen["sp_norm_gains"] = sequence_parallel_all_reduces(cfg, w)
    if rank == 0:
        Path(out).write_text(json.dumps({
            "avg": t.tolist(), "mean": want.tolist(), "world": w,
            "async_error_handling": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"), **seen}))
    # Both ranks past FSDP's last collective before the group goes: tearing gloo down while
    # the other rank still works aborted both ranks once on a loaded machine.
    dist.barrier()
    dist.destroy_process_group()


def sequence_parallel_all_reduces(cfg, w) -> dict:
    """Under sequence parallelism, the all-reduces of the norm gains' (Partial) gradients:
    in AdamW's step as backward leaves them, and in reduce_partial_grads then AdamW's step
    (functional all-reduces, which DTensor's operators issue below any dispatch mode)."""
    import torch.distributed._functional_collectives as funcol
    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import loss_parallel

    from common.parallelize.tp import apply_tp
    from common.training import reduce_partial_grads
    calls, real = [], funcol.all_reduce

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    funcol.all_reduce = counted
    try:
        got = {}
        for reduce_first in (False, True):
            model = Transformer(cfg)
            model.init_weights(seed=0)
            apply_tp(model, init_device_mesh("cpu", (w,), mesh_dim_names=("tp",)), sequence_parallel=True)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
            tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
            with loss_parallel():
                F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
            gains = sum(1 for p in model.parameters() if p.grad.placements[0].is_partial())
            calls.clear()
            if reduce_first:
                reduce_partial_grads(model.parameters())
            reduced = len(calls)
            calls.clear()
            optimizer.step()
            got["reduced" if reduce_first else "left"] = {"partial gains": gains, "in reduce_partial_grads": reduced,
                                                         "in AdamW's step": len(calls)}
        return got
    finally:
        funcol.all_reduce = real


if __name__ == "__main__":
    main(sys.argv[1])
