"""Step 1: the single-GPU baseline. Plain fp32 training with AdamW.

Every later script is a small diff of this one. Run it with
    python step1_single_gpu/train.py            (or: torchrun --nproc-per-node 1 ...)
and look at runs/train/memory_trace.png: 4 bytes per parameter of weights, 4 of
gradients, 8 of AdamW state, and activations that grow with batch and sequence length.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # find common/

import torch.nn.functional as F

from common import cli, theory
from common.checkpoint import Checkpointer, skip_nonfinite_step
from common.data import Batches, load_corpus
from common.distributed import distributed
from common.errors import main_guard
from common.memory import MemoryTracer
from common.metrics import Metrics
from common.model import build_model
from common.training import adamw, evaluate, lr_schedule


@main_guard
def main():
    args = cli.parse(cli.parser(__doc__))
    with distributed(args.device, timeout_s=args.pg_timeout) as ctx:
        corpus = load_corpus(args.data, seed=args.seed)
        data = Batches(corpus.train, args.seq_len, args.global_batch_size, seed=args.seed)

        model = build_model(args.model_config, ctx.device, seed=args.seed)
        optimizer = adamw(model.parameters(), args)
        scheduler = lr_schedule(optimizer, args)
        skip_nonfinite_step(optimizer, ctx, enabled=args.on_nan == "skip")  # --on-nan skip
        ckpt = Checkpointer(args, ctx, [(model, optimizer)], scheduler, data)
        start = ckpt.resume()  # 0, or the step after the newest checkpoint with --resume
        batches = iter(data)

        tracer = MemoryTracer(model, optimizer, ctx.device, enabled=args.trace_memory,
                              start=args.trace_start, steps=args.trace_steps)
        metrics = Metrics(args, ctx, optimizer)
        for step in metrics.progress(start):
            with tracer.record(step):
                x, y = next(batches)
                x, y = x.to(ctx.device), y.to(ctx.device)
                logits = model(x)  # (batch, seq, vocab)
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
                loss.backward()
                optimizer.step()
                # Free the gradients now, not at the start of the next step: they would
                # otherwise sit in memory through the next forward pass, on top of its
                # activations. set_to_none (the default) frees; zeroing would keep them.
                optimizer.zero_grad(set_to_none=True)
            metrics.log(step, loss, traced=tracer.will_record(step))
            scheduler.step()
            ckpt.end_step(step, metrics.last_loss)  # NaN check, --ckpt-every, --fail-at-step

        val_loss = evaluate(model, corpus.val, args, ctx.device)
        memory = tracer.save(args.out, ctx, title=f"Step 1, fp32 baseline: {args.model} model, "
                             f"batch {args.global_batch_size} x {args.seq_len} tokens, {ctx.device.type}")
        metrics.finish(memory, val_loss=val_loss, predicted=theory.report(args, ctx, memory, "single"))


if __name__ == "__main__":
    main()
