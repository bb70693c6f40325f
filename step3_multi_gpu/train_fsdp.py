"""Step 3a: fully sharded data parallelism (FSDP2): ZeRO-3, ZeRO-2 and HSDP.

As with DDP every rank trains on its own share of each global batch, but no rank holds
the whole model: each keeps 1/W of every parameter, of its gradient and of its AdamW
state, and all-gathers a block's parameters just before it runs. Launch one process per
rank (plain python runs it as a single rank):
    torchrun --nproc-per-node 4 step3_multi_gpu/train_fsdp.py                             # ZeRO-3
    torchrun --nproc-per-node 4 step3_multi_gpu/train_fsdp.py --no-reshard-after-forward  # ZeRO-2
    torchrun --nproc-per-node 4 step3_multi_gpu/train_fsdp.py --hsdp 2 2                  # HSDP
    torchrun --nproc-per-node 4 step3_multi_gpu/train_fsdp.py --ac full --compile
runs/train_fsdp/memory_trace.png has one panel per rank: 16N/W bytes of model state, plus
the one or two blocks whose parameters are gathered at any moment. Step 2's savers come
along (--amp bf16, the default, or off; --ac, --compile, --fused-adamw, --grad-accum), each
applied the way FSDP wants it.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # find common/

import torch

from common import cli
from common.data import Batches, load_corpus
from common.distributed import distributed
from common.errors import UserError, main_guard
from common.model import Transformer, set_loss_chunks
from common.parallelize.ac import apply_ac
from common.parallelize.compile import apply_compile
from common.parallelize.float8 import convert_float8, float8_unsupported, precompute_fsdp_scales
from common.parallelize.fsdp import apply_fsdp, materialize
from common.run import Run
from common.training import adamw, clip_grad_norm, evaluate, global_loss, lr_schedule, micro_batch_size


@main_guard
def main(argv=None):
    p = cli.parser(__doc__)
    cli.add_dry_run_flags(p)
    cli.add_saver_flags(p, accum_what="; gradients are reduce-scattered after the last only")
    cli.add_loss_flags(p)
    p.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True,
                   help="free each block's gathered parameters after its forward and gather them again in "
                        "backward (ZeRO-3, the default); --no-reshard-after-forward keeps them (ZeRO-2)")
    p.add_argument("--hsdp", type=int, nargs=2, metavar=("REPLICAS", "SHARDS"),
                   help="hybrid sharding: shard each parameter over SHARDS ranks and replicate that over "
                        "REPLICAS groups (REPLICAS x SHARDS = the number of ranks)")
    p.add_argument("--cpu-offload", action="store_true",
                   help="keep parameter shards, gradients and AdamW on the host (CUDA; a no-op on CPU)")
    p.add_argument("--split-root-unit", action="store_true",
                   help="the embedding, and the final norm with the output layer, in FSDP units of their own, "
                        "gathered only around their own forward and backward (default: both in the root unit, "
                        "gathered all step)")
    p.add_argument("--float8", action="store_true",
                   help="float8 matmuls (torchao, step 2d) and float8 all-gather of the weights: NCCL on "
                        "H100-class GPUs only")
    args = cli.parse(p, argv)
    # --cpu-offload keeps the gradients on the host: their norm is reduced there, which
    # NCCL cannot do (cpu_collectives: gloo beside it for CPU tensors)
    with distributed(args.device, timeout_s=args.pg_timeout, fake_world_size=args.fake_world_size,
                     fake_rank=args.fake_rank, cpu_collectives=args.cpu_offload) as ctx:
        cli.check_memory_savers(args, ctx.device, dp_size=None, fp16=False)
        if args.float8:  # FSDP2 all-gathers float8 weights through NCCL only: gloo has no float8 type
            why = float8_unsupported(ctx.device) or (ctx.backend != "nccl" and (
                f"--float8 all-gathers float8 weights, which {ctx.backend} cannot send (NCCL only); drop --float8, "
                f"or train float8 on one device with step2_memory/train_float8.py."))
            if why:
                raise UserError(why)
        # HSDP: a 2-D mesh; FSDP replicates across its first dimension, shards across the second.
        mesh = ctx.mesh(tuple(args.hsdp), ("replicate", "shard")) if args.hsdp else ctx.mesh()
        micro_batch_size(args.global_batch_size, ctx.world_size, args.grad_accum)  # splits evenly?
        corpus = load_corpus(args.data, seed=args.seed, vocab_size=args.model_config.vocab_size)
        # Each rank draws its own slice of each batch (a DistributedSampler, whose set_epoch
        # reshuffles every pass over the data the same way on all ranks). One loader batch
        # is one micro-step of all ranks together.
        data = Batches(corpus.train, args.seq_len, args.global_batch_size // args.grad_accum,
                       dp_rank=ctx.rank, dp_size=ctx.world_size, seed=args.seed)

        # Build on the meta device (shapes, no memory), shard, and only then allocate: each
        # rank materialises its own shards, so the full model never exists anywhere.
        with torch.device("meta"):
            model = Transformer(args.model_config)
        # --float8: before fully_shard, so each shard is gathered already cast (half of bf16's bytes)
        float8 = args.float8 and convert_float8(model, fsdp_float8_all_gather=True)
        apply_ac(model, args.ac, every=args.ac_every)  # before FSDP: the checkpoint sits inside each unit
        set_loss_chunks(model, args.loss_chunks)
        # --amp bf16 is FSDP's mixed-precision policy, not autocast: it gathers the parameters
        # in bf16 (half the all-gather bytes; autocast would gather fp32 and then cast),
        # keeps the shards and AdamW in fp32, and reduce-scatters the gradients in fp32.
        apply_fsdp(model, mesh, reshard_after_forward=args.reshard_after_forward,
                   param_dtype=args.amp_dtype, cpu_offload=args.cpu_offload, split_root=args.split_root_unit)
        apply_compile(model, args.compile)  # per block, after fully_shard: its hooks stay outside the graphs
        # (--cpu-offload: the shards on the host, where FSDP keeps them; the RoPE tables on the device)
        materialize(model, ctx.device, cpu_offload=args.cpu_offload)
        model.init_weights(seed=args.seed)  # step 1's weights: every rank keeps its piece of each
        optimizer = adamw(model.parameters(), args)  # the parameters are shards: so is AdamW's state
        scheduler = lr_schedule(optimizer, args)
        what = (f"HSDP {args.hsdp[0]} x {args.hsdp[1]}" if args.hsdp else "FSDP") + \
            (" ZeRO-3" if args.reshard_after_forward else " ZeRO-2")
        # Each rank checkpoints only its shards (DTensors); a run on another number of ranks
        # reads its new shards from whichever files hold them.
        run = Run(args, ctx, model, optimizer, scheduler, data, fsdp=True, title=f"Step 3a, {what}",
                  strategy=("hsdp" if args.hsdp else "fsdp") + ("_zero3" if args.reshard_after_forward else "_zero2"),
                  parallel=dict(zip(mesh.mesh_dim_names, mesh.shape)), predict=dict(shard=args.hsdp and args.hsdp[1]),
                  evaluate=lambda: evaluate(model, corpus.val, args, ctx.device))
        batches = iter(data)
        for step in run.steps():
            with run.step(step):
                step_loss = torch.zeros((), device=ctx.device)
                for micro in range(args.grad_accum):
                    x, y = next(batches)
                    x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
                    # Reduce-scatter once per optimizer step. The price: until then every
                    # block keeps its full-size gradient, the 4N bytes sharding saved.
                    model.set_requires_gradient_sync(micro == args.grad_accum - 1)
                    # the mean cross entropy (fp32 even under bf16 compute), from the model's own head:
                    # an FSDP unit, so the output layer is gathered for the loss (--loss-chunks)
                    loss = model(x, targets=y) / args.grad_accum
                    loss.backward()  # per block: gather its parameters (ZeRO-3), reduce-scatter its gradients
                    step_loss += loss.detach()
                # The global norm (each rank holds shards: the norm's squares are summed over the ranks).
                grad_norm = clip_grad_norm(model.parameters(), args.max_norm, local=args.clip_by == "local")
                optimizer.step()
                precompute_fsdp_scales(model, args.float8)  # the next gathers' float8 scales, in one all-reduce
                # Unlike DDP's buckets, the sharded gradients are ordinary tensors: freeing
                # them keeps 4N/W bytes out of the next forward pass.
                optimizer.zero_grad(set_to_none=True)
            run.log(step, global_loss(step_loss, dp_size=ctx.world_size), grad_norm=grad_norm)  # each rank saw its own data

        run.finish(**({"float8": float8} if float8 else {}))


if __name__ == "__main__":
    main()
