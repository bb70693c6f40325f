"""Step 3a: fully sharded data parallelism (FSDP2): ZeRO-3, ZeRO-2 and HSDP.

As with DDP every rank trains on its own share of each global batch, but no rank holds
the whole model: each keeps 1/W of every parameter, of its gradient and of its AdamW
state, and all-gathers a block's parameters just before it runs. Launch one process per
rank (plain python runs it as a single rank):
    torchrun --nproc-per-node 4 step3_multi_gpu/train_fsdp.py                             # ZeRO-3
    torchrun --nproc-per-node 4 step3_multi_gpu/train_fsdp.py --no-reshard-after-forward  # ZeRO-2
    torchrun --nproc-per-node 4 step3_multi_gpu/train_fsdp.py --hsdp 2 2                  # HSDP
    torchrun --nproc-per-node 4 step3_multi_gpu/train_fsdp.py --mixed-precision --activation-checkpointing
runs/train_fsdp/memory_trace.png has one panel per rank: 16N/W bytes of model state, plus
the one or two blocks whose parameters are gathered at any moment.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # find common/

import torch
import torch.nn.functional as F

from common import cli, theory
from common.checkpoint import Checkpointer, skip_nonfinite_step
from common.comm import CommCounter
from common.data import Batches, load_corpus
from common.distributed import distributed
from common.errors import main_guard
from common.memory import MemoryTracer
from common.metrics import Metrics
from common.model import Transformer
from common.memory_savers import apply_ac
from common.parallel import (apply_fsdp, gather_comm, global_mean, launch_hint,
                             micro_batch_size, print_comm, trace_fsdp_memory)
from common.training import adamw, evaluate, lr_schedule


@main_guard
def main(argv=None):
    p = cli.parser(__doc__)
    p.add_argument("--grad-accum-steps", type=int, default=1,
                   help="micro-batches per optimizer step; gradients are reduce-scattered after the last only (default: 1)")
    p.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True,
                   help="free each block's gathered parameters after its forward and gather them again in "
                        "backward (ZeRO-3, the default); --no-reshard-after-forward keeps them (ZeRO-2)")
    p.add_argument("--hsdp", type=int, nargs=2, metavar=("REPLICAS", "SHARDS"),
                   help="hybrid sharding: shard each parameter over SHARDS ranks and replicate that over "
                        "REPLICAS groups (REPLICAS x SHARDS = the number of ranks)")
    p.add_argument("--mixed-precision", action="store_true",
                   help="compute in bf16 (gather parameters in bf16), keep fp32 shards, reduce gradients in fp32")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block's activations in backward instead of storing them")
    p.add_argument("--cpu-offload", action="store_true",
                   help="keep parameter shards, gradients and AdamW on the host (CUDA; a no-op on CPU)")
    args = cli.parse(p, argv)
    with distributed(args.device, timeout_s=args.pg_timeout) as ctx:
        launch_hint(ctx, "step3_multi_gpu/train_fsdp.py")
        # HSDP: a 2-D mesh; FSDP replicates across its first dimension, shards across the second.
        mesh = ctx.mesh(tuple(args.hsdp), ("replicate", "shard")) if args.hsdp else ctx.mesh()
        micro_batch_size(args.global_batch_size, ctx.world_size, args.grad_accum_steps)  # splits evenly?
        corpus = load_corpus(args.data, seed=args.seed)
        # Each rank draws its own slice of each batch (a DistributedSampler, whose set_epoch
        # reshuffles every pass over the data the same way on all ranks). One loader batch
        # is one micro-step of all ranks together.
        data = Batches(corpus.train, args.seq_len, args.global_batch_size // args.grad_accum_steps,
                       dp_rank=ctx.rank, dp_size=ctx.world_size, seed=args.seed)

        # Build on the meta device (shapes, no memory), shard, and only then allocate: each
        # rank materialises its own shards, so the full model never exists anywhere.
        with torch.device("meta"):
            model = Transformer(args.model_config)
        if args.activation_checkpointing:
            apply_ac(model, "full")  # before FSDP: the checkpoint sits inside each unit
        apply_fsdp(model, mesh, reshard_after_forward=args.reshard_after_forward,
                   param_dtype=torch.bfloat16 if args.mixed_precision else None, cpu_offload=args.cpu_offload)
        model.to_empty(device=ctx.device)
        model.init_weights(seed=args.seed)  # step 1's weights: every rank keeps its piece of each
        optimizer = adamw(model.parameters(), args)  # the parameters are shards: so is AdamW's state
        scheduler = lr_schedule(optimizer, args)
        skip_nonfinite_step(optimizer, ctx, enabled=args.on_nan == "skip")  # --on-nan skip
        # Each rank saves only its shards (DTensors); a run on another number of ranks
        # reads its new shards from whichever files hold them.
        ckpt = Checkpointer(args, ctx, [(model, optimizer)], scheduler, data,
                            parallel=dict(zip(mesh.mesh_dim_names, mesh.shape)))
        start = ckpt.resume()  # 0, or the step after the newest checkpoint with --resume
        batches = iter(data)

        tracer = MemoryTracer(model, optimizer, ctx.device, enabled=args.trace_memory,
                              start=args.trace_start, steps=args.trace_steps)
        trace_fsdp_memory(tracer, model)  # FSDP's gathered parameters count as parameters
        comm = CommCounter()
        metrics = Metrics(args, ctx, optimizer, parallel=dict(zip(mesh.mesh_dim_names, mesh.shape)),
                          dtype="bf16" if args.mixed_precision else "fp32")
        for step in metrics.progress(start):
            with tracer.record(step), comm:
                step_loss = torch.zeros((), device=ctx.device)
                for micro in range(args.grad_accum_steps):
                    x, y = next(batches)
                    x, y = x.to(ctx.device), y.to(ctx.device)
                    # Reduce-scatter once per optimizer step. The price: until then every
                    # block keeps its full-size gradient, the 4N bytes sharding saved.
                    model.set_requires_gradient_sync(micro == args.grad_accum_steps - 1)
                    logits = model(x)  # (micro-batch, seq, vocab); fp32 even under bf16 compute
                    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) / args.grad_accum_steps
                    loss.backward()  # per block: gather its parameters (ZeRO-3), reduce-scatter its gradients
                    step_loss += loss.detach()
                optimizer.step()
                # Unlike DDP's buckets, the sharded gradients are ordinary tensors: freeing
                # them keeps 4N/W bytes out of the next forward pass.
                optimizer.zero_grad(set_to_none=True)
            metrics.log(step, global_mean(step_loss), traced=tracer.will_record(step))
            scheduler.step()
            ckpt.end_step(step, metrics.last_loss)  # NaN check, --ckpt-every, --fail-at-step

        val_loss = evaluate(model, corpus.val, args, ctx.device)
        what = f"HSDP {args.hsdp[0]} x {args.hsdp[1]}" if args.hsdp else "FSDP"
        what += " ZeRO-3" if args.reshard_after_forward else " ZeRO-2"
        what += ", bf16" if args.mixed_precision else ""
        what += ", activation checkpointing" if args.activation_checkpointing else ""
        memory = tracer.save(args.out, ctx, title=f"Step 3a, {what} on {ctx.world_size} ranks: {args.model} model, "
                             f"batch {args.global_batch_size} x {args.seq_len} tokens, {ctx.device.type}")
        comm_by_rank = gather_comm(comm, ctx, args.steps)
        strategy = ("hsdp" if args.hsdp else "fsdp") + ("_zero3" if args.reshard_after_forward else "_zero2")
        metrics.finish(memory, val_loss=val_loss, strategy=strategy, comm=comm_by_rank, predicted=theory.report(
            args, ctx, memory, strategy, shard=args.hsdp and args.hsdp[1], accum=args.grad_accum_steps,
            dtype="bf16" if args.mixed_precision else "fp32", ac="full" if args.activation_checkpointing else "none"))
        print_comm(ctx, comm_by_rank, metrics.n_params)


if __name__ == "__main__":
    main()
