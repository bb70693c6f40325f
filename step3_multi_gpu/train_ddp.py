"""Step 3a: data parallelism. DDP on every rank, or ZeRO-1 with --zero1.

Every rank holds the whole model and the whole optimizer and trains on its own share of
each global batch; after backward, DDP all-reduces (averages) the gradients so that every
copy takes the same step and stays identical. Launch one process per
rank (plain python runs it as a single rank):
    torchrun --nproc-per-node 4 step3_multi_gpu/train_ddp.py
    torchrun --nproc-per-node 4 step3_multi_gpu/train_ddp.py --zero1
    torchrun --nproc-per-node 4 step3_multi_gpu/train_ddp.py --ac full --compile
runs/train_ddp/memory_trace.png has one panel per rank: 16 bytes per parameter on each (4
weights, 4 gradients, 8 AdamW state); --zero1 keeps 8 + 8/W (the AdamW state split W ways).

Step 2's savers come along (--amp bf16, the default, or off; --ac, --compile, --fused-adamw,
--grad-accum), each applied the way the strategy wants it: DDP autocasts its whole fp32
weights, FSDP gathers them already cast (its mixed-precision policy).
"""
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # find common/

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from common import cli
from common.data import Batches, load_corpus
from common.distributed import distributed_for
from common.errors import main_guard
from common.model import build_model, set_doc_mask, set_loss_chunks
from common.parallelize import comm_hooks
from common.parallelize.ac import apply_ac
from common.parallelize.compile import apply_compile
from common.parallelize.ddp import ddp_no_buffer_sync, ddp_run_labels
from common.run import Run
from common.training import adamw, adamw_options, clip_grad_norm, evaluate, global_loss, lr_schedule, micro_batch_size


def parse(argv=None):
    p = cli.parser(__doc__)
    cli.add_dry_run_flags(p)
    cli.add_saver_flags(p, accum_what="; gradients are all-reduced after the last only")
    cli.add_loss_flags(p)
    p.add_argument("--zero1", action="store_true", help="shard the AdamW state over the ranks (ZeRO stage 1)")
    comm_hooks.add_comm_hook_flag(p)  # --comm-hook: compress each gradient bucket before it is all-reduced
    return cli.parse(p, argv)


def build(args, ctx, mesh):
    model = build_model(args.model_config, ctx.device, seed=args.seed)  # all of step 1's weights, on every rank
    set_doc_mask(model, args.doc_eot)  # --doc-mask: the end-of-text id documents end at (None: off)
    apply_ac(model, args.ac, every=args.ac_every)  # per block, before wrapping and compiling it
    set_loss_chunks(model, args.loss_chunks)
    apply_compile(model, args.compile)  # per block: the strategy's hooks stay outside the graphs
    # gradient_as_bucket_view: p.grad *is* a slice of the buckets DDP all-reduces, not a second
    # copy of 4N bytes. The buffers (RoPE tables) are constants: no broadcast before every forward.
    model = DDP(model, device_mesh=mesh, gradient_as_bucket_view=True, **ddp_no_buffer_sync())
    comm_hooks.register_comm_hook(model, args.comm_hook, **comm_hooks.powersgd_options(args))
    # --zero1: each rank updates 1/W of the parameters (AdamW state 8N/W, not 8N), then broadcasts them
    return model, ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, **adamw_options(args)) \
        if args.zero1 else adamw(model.parameters(), args)


@main_guard
def main(argv=None):
    args = parse(argv)
    comm_hooks.check_comm_hook(args.comm_hook, **comm_hooks.powersgd_options(args))
    with distributed_for(args) as ctx:
        cli.check_memory_savers(args, ctx.device, dp_size=None, fp16=False)
        mesh = ctx.mesh()  # 1-D: every rank is a data-parallel replica
        micro_batch_size(args.global_batch_size, ctx.world_size, args.grad_accum)  # splits evenly?
        corpus = load_corpus(args.data, seed=args.seed, vocab_size=args.model_config.vocab_size)
        # Each rank draws its own slice of each batch (a DistributedSampler, whose set_epoch
        # reshuffles every pass over the data the same way on all ranks). One loader batch
        # is one micro-step of all ranks together.
        data = Batches(corpus.train, args.seq_len, args.global_batch_size // args.grad_accum,
                       dp_rank=ctx.rank, dp_size=ctx.world_size, seed=args.seed)
        model, optimizer = build(args, ctx, mesh)  # step 1's model, AC, compile, DDP
        scheduler = lr_schedule(optimizer, args)
        run = Run(args, ctx, model, optimizer, scheduler, data, **ddp_run_labels(args, mesh, optimizer),
                  evaluate=lambda: evaluate(model, corpus.val, args, ctx.device))
        run.resume()  # --resume: the newest checkpoint's model, optimizer, schedule and data position
        batches = iter(data)
        for step in run.steps():
            with run.step(step):
                step_loss = torch.zeros((), device=ctx.device)
                for micro in range(args.grad_accum):
                    x, y = next(batches)
                    x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
                    # All-reduce once per optimizer step (no_sync covers the forward and the backward).
                    with contextlib.nullcontext() if micro == args.grad_accum - 1 else model.no_sync():
                        # autocast casts bf16 copies of the fp32 weights for the matmuls, as on one device
                        with torch.autocast(ctx.device.type, dtype=args.amp_dtype, enabled=args.amp != "off"):
                            loss = model(x, targets=y) / args.grad_accum  # the mean cross entropy, fp32
                        loss.backward()  # on the last micro-batch: all-reduce, bucket by bucket
                    step_loss += loss.detach()
                # The global norm (the all-reduced gradients are the same on every rank).
                grad_norm = clip_grad_norm(model.parameters(), args.max_norm, local=args.clip_by == "local")
                optimizer.step()
                optimizer.zero_grad(set_to_none=False)  # p.grad are views of DDP's buckets: None frees nothing
            run.log(step, global_loss(step_loss, dp_size=ctx.world_size), grad_norm=grad_norm)  # each rank saw its own data
            scheduler.step()  # the next step's learning rate
            run.evaluate_if_due(step)  # the held-out loss, every --eval-every steps and after the last
            run.save_if_due(step)  # --ckpt-every; after a stop signal every rank saves this step, then stops
        run.finish()


if __name__ == "__main__":
    main()
