"""Step 3b: tensor parallelism. Every rank holds 1/W of each weight matrix and all ranks
work on the same batch together.

    torchrun --nproc-per-node 4 step3_multi_gpu/train_tp.py
    torchrun --nproc-per-node 4 step3_multi_gpu/train_tp.py --sequence-parallel

Attention heads and the MLP's hidden units are split across ranks (Megatron-LM's plan,
applied from outside by common/model_parallel.py:apply_tp). The price: the ranks must
combine their partial results twice per block in the forward pass and twice in the
backward pass, a (batch x seq x dim) activation each time, on the critical path. That is
why tensor parallelism lives inside a node, on NVLink, and not across the network.
"""
import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # find common/

import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import loss_parallel

from common import cli, theory
from common.checkpoint import Checkpointer, skip_nonfinite_step
from common.data import Batches, load_corpus
from common.distributed import distributed
from common.parallel import launch_hint
from common.errors import main_guard
from common.memory import MemoryTracer
from common.metrics import Metrics
from common.model import Transformer
from common.model_parallel import StepComm, apply_tp, check_tp, global_loss, save_full_weights
from common.theory import tp_bytes_per_step
from common.training import adamw, evaluate, lr_schedule


@main_guard
def main():
    p = cli.parser(__doc__)
    p.add_argument("--sequence-parallel", action="store_true",
                   help="also split the activations between blocks (norms, residual) along the sequence")
    p.add_argument("--loss-parallel", action=argparse.BooleanOptionalAction, default=True,
                   help="compute the cross entropy on vocabulary-sharded logits (default: on)")
    p.add_argument("--save-weights", action="store_true", help="gather the trained weights into OUT/weights.pt")
    args = cli.parse(p)
    with distributed(args.device, timeout_s=args.pg_timeout) as ctx:
        launch_hint(ctx, "step3_multi_gpu/train_tp.py")
        check_tp(args.model_config, ctx.world_size, args.seq_len, args.sequence_parallel)
        tp_mesh = ctx.mesh((ctx.world_size,), ("tp",))
        corpus = load_corpus(args.data, seed=args.seed)
        # Not data parallel: every rank reads the same whole batch.
        data = Batches(corpus.train, args.seq_len, args.global_batch_size, seed=args.seed)

        # Build on meta, split, then allocate: no rank ever holds a full weight matrix.
        with torch.device("meta"):
            model = Transformer(args.model_config)
        apply_tp(model, tp_mesh, sequence_parallel=args.sequence_parallel, loss_parallel=args.loss_parallel)
        model.to_empty(device=ctx.device)
        model.init_weights(args.seed)  # each rank keeps its shard of the same full weights
        optimizer = adamw(model.parameters(), args)  # AdamW state is sharded like the weights
        scheduler = lr_schedule(optimizer, args)
        skip_nonfinite_step(optimizer, ctx, enabled=args.on_nan == "skip")  # --on-nan skip
        # Each rank saves its shard of every weight (a DTensor) by parameter name: a
        # checkpoint from 4 TP ranks loads on 2, or into DDP / FSDP, and back.
        ckpt = Checkpointer(args, ctx, [(model, optimizer)], scheduler, data, parallel={"tp": ctx.world_size})
        start = ckpt.resume()  # 0, or the step after the newest checkpoint with --resume
        batches = iter(data)
        # The logits are split over the vocabulary; cross entropy (and its backward) must
        # run under loss_parallel() to work on the shards.
        loss_context = loss_parallel if args.loss_parallel else contextlib.nullcontext

        tracer = MemoryTracer(model, optimizer, ctx.device, enabled=args.trace_memory,
                              start=args.trace_start, steps=args.trace_steps)
        metrics = Metrics(args, ctx, optimizer, parallel={"tp": ctx.world_size})
        comm = StepComm()
        for step in metrics.progress(start):
            with tracer.record(step), comm.count(step):
                x, y = next(batches)
                x, y = x.to(ctx.device), y.to(ctx.device)
                logits = model(x)
                with loss_context():
                    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
                    loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            metrics.log(step, global_loss(loss), traced=tracer.will_record(step))
            scheduler.step()
            ckpt.end_step(step, metrics.last_loss)  # NaN check, --ckpt-every, --fail-at-step

        with loss_context():
            val_loss = evaluate(model, corpus.val, args, ctx.device)
        sp = " + sequence parallel" if args.sequence_parallel else ""
        memory = tracer.save(args.out, ctx, title=f"Tensor parallel{sp} on {ctx.world_size} ranks: {args.model} "
                             f"model, batch {args.global_batch_size} x {args.seq_len} tokens, {ctx.device.type}")
        if args.save_weights:
            save_full_weights([model], ctx, args.out / "weights.pt")
        metrics.finish(memory, val_loss=val_loss, sequence_parallel=args.sequence_parallel,
                       loss_parallel=args.loss_parallel, comm=comm.summary(),
                       comm_expected=tp_bytes_per_step(args.model_config, args.global_batch_size, args.seq_len,
                                                       args.sequence_parallel),
                       predicted=theory.report(args, ctx, memory, "tp", sequence_parallel=args.sequence_parallel,
                                               loss_parallel=args.loss_parallel))


if __name__ == "__main__":
    main()
