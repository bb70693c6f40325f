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
the root unit (gathered from forward to backward) and the one or two blocks gathered at a time.

Step 2's savers come along (--amp bf16, the default, or off; --ac, --compile, --fused-adamw,
--grad-accum), each applied the way the strategy wants it: DDP autocasts its whole fp32
weights, FSDP gathers them already cast (its mixed-precision policy).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # find common/

import torch

from common import cli
from common.data import Batches, load_corpus
from common.distributed import distributed_for
from common.errors import main_guard
from common.model import Transformer, set_doc_mask, set_loss_chunks
from common.parallelize.ac import apply_ac
from common.parallelize.compile import apply_compile
from common.parallelize.float8 import convert_float8, precompute_fsdp_scales
from common.parallelize.fsdp import add_fsdp_flags, apply_fsdp, check_fsdp_float8, fsdp_run_labels, materialize
from common.run import Run
from common.training import adamw, clip_grad_norm, evaluate, global_loss, lr_schedule, micro_batch_size


def parse(argv=None):
    p = cli.parser(__doc__)
    cli.add_dry_run_flags(p)
    cli.add_saver_flags(p, accum_what="; gradients are reduce-scattered after the last only")
    cli.add_loss_flags(p)
    add_fsdp_flags(p)  # --no-reshard-after-forward (ZeRO-2), --hsdp, --cpu-offload, --split-root-unit, --float8
    return cli.parse(p, argv)


def build(args, ctx, mesh):
    with torch.device("meta"):  # shapes, no memory: the full model never exists anywhere
        model = Transformer(args.model_config)
    set_doc_mask(model, args.doc_eot)  # --doc-mask: the end-of-text id documents end at (None: off)
    model.float8 = args.float8 and convert_float8(model, ctx.device, fsdp_float8_all_gather=True)  # before FSDP
    apply_ac(model, args.ac, every=args.ac_every)  # per block, before wrapping and compiling it
    set_loss_chunks(model, args.loss_chunks)
    # --amp bf16 is FSDP's mixed-precision policy: bf16 gathers (half the bytes autocast's fp32
    # gathers would send), fp32 shards and AdamW, fp32 reduce-scatters.
    apply_fsdp(model, mesh, reshard_after_forward=args.reshard_after_forward,
               param_dtype=args.amp_dtype, cpu_offload=args.cpu_offload, split_root=args.split_root_unit)
    apply_compile(model, args.compile)  # per block: the strategy's hooks stay outside the graphs
    materialize(model, ctx.device, cpu_offload=args.cpu_offload)  # each rank allocates its own shards
    model.init_weights(seed=args.seed)  # step 1's weights: every rank keeps its piece of each
    return model, adamw(model.parameters(), args)  # the parameters are shards: so is AdamW's state


@main_guard
def main(argv=None):
    args = parse(argv)
    with distributed_for(args, cpu_collectives=args.cpu_offload) as ctx:  # (offloaded gradients: gloo beside NCCL)
        cli.check_memory_savers(args, ctx.device, dp_size=None, fp16=False)
        check_fsdp_float8(args.float8, ctx)  # FSDP2 all-gathers float8 weights through NCCL only
        mesh = ctx.mesh(tuple(args.hsdp), ("replicate", "shard")) if args.hsdp else ctx.mesh()  # HSDP: 2-D
        micro_batch_size(args.global_batch_size, ctx.world_size, args.grad_accum)  # splits evenly?
        corpus = load_corpus(args.data, seed=args.seed, vocab_size=args.model_config.vocab_size)
        # Each rank draws its own slice of each batch (a DistributedSampler, whose set_epoch
        # reshuffles every pass over the data the same way on all ranks). One loader batch
        # is one micro-step of all ranks together.
        data = Batches(corpus.train, args.seq_len, args.global_batch_size // args.grad_accum,
                       dp_rank=ctx.rank, dp_size=ctx.world_size, seed=args.seed)
        model, optimizer = build(args, ctx, mesh)  # on meta, float8, AC, FSDP, compile, then each rank's shards
        scheduler = lr_schedule(optimizer, args)
        run = Run(args, ctx, model, optimizer, scheduler, data, **fsdp_run_labels(args, mesh),
                  evaluate=lambda: evaluate(model, corpus.val, args, ctx.device))
        run.resume()  # --resume: the newest checkpoint's model, optimizer, schedule and data position
        batches = iter(data)
        for step in run.steps():
            with run.step(step):
                step_loss = torch.zeros((), device=ctx.device)
                for micro in range(args.grad_accum):
                    x, y = next(batches)
                    x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
                    # Reduce-scatter once per optimizer step: until then each block keeps its full gradient.
                    model.set_requires_gradient_sync(micro == args.grad_accum - 1)
                    loss = model(x, targets=y) / args.grad_accum  # no autocast: the policy computes in bf16
                    loss.backward()  # per block: gather its parameters (ZeRO-3), reduce-scatter its gradients
                    step_loss += loss.detach()
                # The global norm (each rank holds shards: the norm's squares are summed over the ranks).
                grad_norm = clip_grad_norm(model.parameters(), args.max_norm, local=args.clip_by == "local")
                optimizer.step()
                precompute_fsdp_scales(model, args.float8)  # the next gathers' float8 scales, in one all-reduce
                optimizer.zero_grad(set_to_none=True)  # plain sharded tensors: freeing them saves 4N/W bytes
            run.log(step, global_loss(step_loss, dp_size=ctx.world_size), grad_norm=grad_norm)  # each rank saw its own data
            scheduler.step()  # the next step's learning rate
            run.evaluate_if_due(step)  # the held-out loss, every --eval-every steps and after the last
            run.save_if_due(step)  # --ckpt-every; after a stop signal every rank saves this step, then stops
        run.finish(**({"float8": model.float8} if model.float8 else {}))


if __name__ == "__main__":
    main()
