"""Step 3a: data parallelism. DDP on every rank, or ZeRO-1 with --zero1.

Every rank holds the whole model and the whole optimizer and trains on its own share of
each global batch; after backward, DDP all-reduces (averages) the gradients so that every
copy takes the same step and stays identical. Launch one process per rank:
    torchrun --nproc-per-node 4 step3_multi_gpu/train_ddp.py
    torchrun --nproc-per-node 4 step3_multi_gpu/train_ddp.py --zero1
    torchrun --nproc-per-node 4 step3_multi_gpu/train_ddp.py --ac full --compile
(plain python runs it as a single rank). Step 2's savers come along: bf16 autocast (the
default; --amp off for fp32), --ac, --compile, --fused-adamw, --grad-accum. runs/train_ddp/memory_trace.png has one panel per
rank: 16 bytes per parameter on each (4 weights, 4 gradients, 8 AdamW state); --zero1
keeps 8 + 8/W, the optimizer state being split over the W ranks.
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
from common.distributed import distributed
from common.errors import main_guard
from common.model import build_model, set_loss_chunks
from common.parallelize import comm_hooks
from common.parallelize.ac import apply_ac
from common.parallelize.compile import apply_compile
from common.parallelize.ddp import ddp_no_buffer_sync
from common.run import Run
from common.training import adamw, adamw_options, clip_grad_norm, evaluate, global_loss, lr_schedule, micro_batch_size


@main_guard
def main(argv=None):
    p = cli.parser(__doc__)
    cli.add_dry_run_flags(p)
    cli.add_saver_flags(p, accum_what="; gradients are all-reduced after the last only")
    cli.add_loss_flags(p)
    p.add_argument("--zero1", action="store_true", help="shard the AdamW state over the ranks (ZeRO stage 1)")
    comm_hooks.add_comm_hook_flag(p)
    args = cli.parse(p, argv)
    comm_hooks.check_comm_hook(args.comm_hook, **comm_hooks.powersgd_options(args))
    with distributed(args.device, timeout_s=args.pg_timeout, fake_world_size=args.fake_world_size,
                     fake_rank=args.fake_rank) as ctx:
        cli.check_memory_savers(args, ctx.device, dp_size=None, fp16=False)
        mesh = ctx.mesh()  # 1-D: every rank is a data-parallel replica
        micro_batch_size(args.global_batch_size, ctx.world_size, args.grad_accum)  # splits evenly?
        corpus = load_corpus(args.data, seed=args.seed, vocab_size=args.model_config.vocab_size)
        # Each rank draws its own slice of each batch (a DistributedSampler, whose set_epoch
        # reshuffles every pass over the data the same way on all ranks). One loader batch
        # is one micro-step of all ranks together.
        data = Batches(corpus.train, args.seq_len, args.global_batch_size // args.grad_accum,
                       dp_rank=ctx.rank, dp_size=ctx.world_size, seed=args.seed)

        model = build_model(args.model_config, ctx.device, seed=args.seed)
        apply_ac(model, args.ac, every=args.ac_every)  # per block, before compiling it
        set_loss_chunks(model, args.loss_chunks)
        apply_compile(model, args.compile)  # per block: DDP's all-reduces stay outside the graphs
        # gradient_as_bucket_view: p.grad *is* a slice of the buckets DDP all-reduces, not a
        # second copy of 4 bytes per parameter. The buffers (RoPE tables) are constants: no
        # need to broadcast them before every forward.
        model = DDP(model, device_mesh=mesh, gradient_as_bucket_view=True, **ddp_no_buffer_sync())
        # --comm-hook fp16/powersgd: compress each gradient bucket before it is all-reduced
        comm_hooks.register_comm_hook(model, args.comm_hook, **comm_hooks.powersgd_options(args))
        if args.zero1:
            # Each rank keeps AdamW state for 1/W of the parameters, updates only those and
            # broadcasts them to the others: 8N/W bytes of state instead of 8N.
            optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, **adamw_options(args))
        else:
            optimizer = adamw(model.parameters(), args)
        scheduler = lr_schedule(optimizer, args)
        strategy = "zero1" if args.zero1 else "ddp"
        # ZeRO-1's AdamW state lives in an inner optimizer over this rank's partition: each
        # rank checkpoints its own part (by parameter name, so any world size can load it),
        # and the memory tracer is shown where it is.
        run = Run(args, ctx, model, optimizer, scheduler, data, strategy=strategy,
                  title="Step 3a, " + ("DDP + ZeRO-1" if args.zero1 else "DDP"),
                  parallel={"dp": mesh.size()},
                  ckpt_optimizer=optimizer.optim if args.zero1 else None,
                  sources=[lambda: [("optimizer state", optimizer.optim.state)]] if args.zero1 else [],
                  evaluate=lambda: evaluate(model, corpus.val, args, ctx.device))
        batches = iter(data)
        for step in run.steps():
            with run.step(step):
                step_loss = torch.zeros((), device=ctx.device)
                for micro in range(args.grad_accum):
                    x, y = next(batches)
                    x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
                    # All-reduce once per optimizer step: the other micro-batches just add
                    # into p.grad (no_sync must cover the forward as well as the backward).
                    last = micro == args.grad_accum - 1
                    with contextlib.nullcontext() if last else model.no_sync():
                        # Every rank holds whole fp32 weights: autocast casts bf16 copies for the
                        # matmuls, as on one device; the gradients (and DDP's all-reduce) stay fp32.
                        with torch.autocast(ctx.device.type, dtype=args.amp_dtype, enabled=args.amp != "off"):
                            loss = model(x, targets=y) / args.grad_accum  # the mean cross entropy, fp32
                        loss.backward()  # on the last micro-batch: all-reduce, bucket by bucket
                    step_loss += loss.detach()
                # The global norm (the all-reduced gradients are the same on every rank).
                grad_norm = clip_grad_norm(model.parameters(), args.max_norm, local=args.clip_by == "local")
                optimizer.step()
                # p.grad are views of DDP's buckets, which live as long as the model: setting
                # them to None would free nothing, only hide where the 4N bytes are (from the
                # memory trace too). Zero them instead.
                optimizer.zero_grad(set_to_none=False)
            run.log(step, global_loss(step_loss, dp_size=ctx.world_size), grad_norm=grad_norm)  # each rank saw its own data

        run.finish()


if __name__ == "__main__":
    main()
