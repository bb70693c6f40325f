"""Step 3b: context parallelism. Every rank holds the whole model and a slice of every
sequence; attention, the one place where tokens meet, passes keys and values around a ring.

    torchrun --nproc-per-node 4 step3_multi_gpu/train_cp.py --seq-len 1024  # --no-load-balance: the naive split
    torchrun --nproc-per-node 4 step3_multi_gpu/train_cp.py --seq-len 1024 --dp 2 --fsdp

Activations are per token, so each rank keeps 1/W of them: a W times longer sequence fits. The
cost: per block, keys and values travel the ring forward, and backward with their gradients
((W-1) + (W-1) + W hops of a batch x seq/W x kv-width block), behind attention's compute. The
ring (common/parallelize/cp.py:apply_cp) is the lesson; DDP averages the gradients over every
rank, or --fsdp shards the weights over every rank (--dp N: N groups of world/N ranks each).
"""
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # find common/

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common import cli
from common.data import Batches, load_corpus
from common.distributed import distributed_for
from common.errors import main_guard
from common.model import Transformer
from common.parallelize.ac import apply_ac
from common.parallelize.comm_hooks import register_comm_hook
from common.parallelize.cp import (add_cp_flags, apply_cp, check_cp, cp_degree, cp_evaluate, cp_title, local_tokens,
                                   refuse_cp_compile)
from common.parallelize.ddp import ddp_no_buffer_sync
from common.parallelize.fsdp import apply_fsdp
from common.run import Run
from common.training import adamw, clip_grad_norm, global_loss, lr_schedule, micro_batch_size


def parse(argv=None):
    p = cli.parser(__doc__)
    add_cp_flags(p)  # --no-load-balance, --dp, --fsdp
    cli.add_dry_run_flags(p)
    cli.add_saver_flags(p)
    return cli.parse(p, argv)


def build(args, ctx, mesh):
    with torch.device("meta"):
        model = Transformer(args.model_config)
    apply_cp(model, mesh["cp"], load_balance=args.load_balance)
    apply_ac(model, args.ac, every=args.ac_every)  # a recomputed block runs its ring again
    every_rank = ctx.mesh((ctx.world_size,), ("dp_cp",))  # the weights' group: FSDP's, or DDP's
    if args.fsdp:  # over every rank: each holds 1/world of the model state
        apply_fsdp(model, every_rank, param_dtype=args.amp_dtype)
    model.to_empty(device=ctx.device).init_weights(args.seed)
    if not args.fsdp:  # whole weights everywhere: DDP averages their gradients over every rank
        model = DDP(model, device_mesh=every_rank, gradient_as_bucket_view=True, **ddp_no_buffer_sync())
        register_comm_hook(model, "none")  # DDP's own all-reduce (in a dry run: issued, never waited on)
    return model, adamw(model.parameters(), args)


@main_guard
def main():
    args = parse()
    refuse_cp_compile(args)  # the ring sends and receives inside every block's attention
    with distributed_for(args) as ctx:
        cp = cp_degree(ctx.world_size, args.dp)
        cli.check_memory_savers(args, ctx.device, dp_size=args.dp, fp16=False)
        check_cp(args.model_config, cp, args.seq_len, args.load_balance, args.ac)
        micro_batch_size(args.global_batch_size, args.dp, args.grad_accum)  # splits evenly?
        mesh = ctx.mesh((args.dp, cp), ("dp", "cp"))  # cp inner: a sequence's ranks are neighbours
        corpus = load_corpus(args.data, seed=args.seed, vocab_size=args.model_config.vocab_size)
        # The ranks of a cp group read the same sequences (like TP) and each keeps its slice.
        data = Batches(corpus.train, args.seq_len, args.global_batch_size // args.grad_accum,
                       dp_rank=mesh["dp"].get_local_rank(), dp_size=args.dp, seed=args.seed)
        model, optimizer = build(args, ctx, mesh)
        ring = getattr(model, "module", model).cp_ring  # (inside DDP's wrapper) whose slice of each sequence
        scheduler = lr_schedule(optimizer, args)
        run = Run(args, ctx, model, optimizer, scheduler, data, strategy="cp_fsdp" if args.fsdp else "cp",
                  parallel={"dp": args.dp, "cp": cp}, fsdp=args.fsdp, predict=dict(cp=cp), title=cp_title(args, cp),
                  evaluate=lambda: cp_evaluate(model, corpus.val, args, ctx.device, ring))
        run.resume()  # --resume: the newest checkpoint's model, optimizer, schedule and data position
        batches = iter(data)
        for step in run.steps():
            with run.step(step):
                step_loss = torch.zeros((), device=ctx.device)
                for micro in range(args.grad_accum):
                    x, y = (local_tokens(t, ring, ctx.device) for t in next(batches))  # to the device, then my positions
                    last = micro == args.grad_accum - 1  # reduce the gradients once per optimizer step
                    if args.fsdp:
                        model.set_requires_gradient_sync(last)
                    with contextlib.nullcontext() if last or args.fsdp else model.no_sync():
                        with torch.autocast(ctx.device.type, dtype=args.amp_dtype,  # (FSDP's policy: no autocast)
                                            enabled=args.amp != "off" and not args.fsdp):
                            logits = model(x)
                        # the mean over my tokens; the ranks' equal slices average to the batch's mean
                        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()) / args.grad_accum
                        loss.backward()  # DDP's all-reduce (or FSDP's reduce-scatter) averages over every rank
                    step_loss += loss.detach()
                grad_norm = clip_grad_norm(model.parameters(), args.max_norm, local=args.clip_by == "local")
                optimizer.step()
                optimizer.zero_grad(set_to_none=args.fsdp)  # (DDP's gradients are views of its buckets)
            run.log(step, global_loss(step_loss, dp_size=ctx.world_size), grad_norm=grad_norm)
            scheduler.step()  # the next step's learning rate
            run.evaluate_if_due(step)  # the held-out loss, every --eval-every steps and after the last
            run.save_if_due(step)  # --ckpt-every; after a stop signal every rank saves this step, then stops
        run.finish(load_balance=args.load_balance, fsdp=args.fsdp)


if __name__ == "__main__":
    main()
