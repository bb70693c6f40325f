"""Step 3b: pipeline parallelism. Each rank holds a few consecutive layers (a stage) and
the batch flows through the ranks in micro-batches.

    torchrun --nproc-per-node 4 step3_multi_gpu/train_pp.py --schedule 1f1b --microbatches 8
    torchrun --nproc-per-node 4 step3_multi_gpu/train_pp.py --schedule gpipe
    torchrun --nproc-per-node 4 step3_multi_gpu/train_pp.py --schedule interleaved1f1b --n-layers 8

Only activations cross rank boundaries, point to point, once per micro-batch: the
cheapest communication of any split, which is why pipelines span nodes. The cost is
time: the first stage waits for nothing but the last waits for everyone, so each rank
idles for a fraction (p-1)/(m+p-1) of a step (the bubble) with p stages and m
micro-batches. GPipe runs all forwards then all backwards (m micro-batches of
activations alive); 1F1B starts each backward as soon as it can (at most p alive);
interleaved 1F1B gives each rank two smaller stages, which shrinks the bubble further.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # find common/

import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage

from common import cli, theory
from common.checkpoint import Checkpointer, skip_nonfinite_step
from common.data import Batches, load_corpus
from common.distributed import distributed
from common.parallel import launch_hint
from common.errors import main_guard
from common.memory import MemoryTracer
from common.metrics import Metrics
from common.model_parallel import (SCHEDULES, ComputeTimer, StepComm, build_stage, bubble_report, check_pp,
                                   make_schedule, pipeline_evaluate, pipeline_loss, save_full_weights,
                                   stage_indices, stage_layers)
from common.training import adamw, lr_schedule


def loss_fn(logits, targets):
    """Applied by the last stage to each micro-batch; the schedule averages over them."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@main_guard
def main():
    p = cli.parser(__doc__)
    p.add_argument("--schedule", default="1f1b", help=f"{', '.join(SCHEDULES)} (default: 1f1b)")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step (default: 4)")
    p.add_argument("--save-weights", action="store_true", help="gather the trained weights into OUT/weights.pt")
    args = cli.parse(p)
    with distributed(args.device, timeout_s=args.pg_timeout) as ctx:
        launch_hint(ctx, "step3_multi_gpu/train_pp.py")
        pp = ctx.world_size
        check_pp(args.model_config, pp, args.schedule, args.microbatches, args.global_batch_size)
        corpus = load_corpus(args.data, seed=args.seed)
        # Every stage reads the same batch: the first needs the inputs, the last the targets.
        data = Batches(corpus.train, args.seq_len, args.global_batch_size, seed=args.seed)

        # This rank's stages: one (gpipe, 1f1b), or two for the interleaved schedule (stages
        # r and r + pp, so each micro-batch loops through the ranks twice).
        my_stages = stage_indices(ctx.rank, pp, args.schedule)
        n_stages = pp * len(my_stages)
        models = [build_stage(args.model_config, s, n_stages, ctx.device, args.seed) for s in my_stages]
        stages = [PipelineStage(m, s, n_stages, ctx.device) for m, s in zip(models, my_stages)]
        schedule = make_schedule(args.schedule, stages, args.microbatches, loss_fn)
        has_first, has_last = 0 in my_stages, n_stages - 1 in my_stages
        optimizer = adamw([p for m in models for p in m.parameters()], args)
        scheduler = lr_schedule(optimizer, args)
        skip_nonfinite_step(optimizer, ctx, enabled=args.on_nan == "skip")  # --on-nan skip
        # This rank's stages (two with interleaved1f1b) share one optimizer: one part. Their
        # layers keep the full model's names, so the checkpoint does not depend on the split.
        ckpt = Checkpointer(args, ctx, [(models, optimizer)], scheduler, data,
                            parallel={"pp": pp, "stages": n_stages})
        start = ckpt.resume()  # 0, or the step after the newest checkpoint with --resume
        batches = iter(data)

        tracer = MemoryTracer(models, optimizer, ctx.device, enabled=args.trace_memory,
                              start=args.trace_start, steps=args.trace_steps)
        metrics = Metrics(args, ctx, optimizer, parallel={"pp": pp})
        comm = StepComm()
        timer = ComputeTimer(schedule, stages, ctx.device)  # the bubble: step time minus compute
        for step in metrics.progress(start):
            with tracer.record(step), comm.count(step):
                x, y = next(batches)
                x, y = x.to(ctx.device), y.to(ctx.device)
                losses = []  # filled on the last stage, one loss per micro-batch
                # The schedule runs forward and backward of every micro-batch in its order.
                schedule.step(*([x] if has_first else []), target=y if has_last else None, losses=losses)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            metrics.log(step, pipeline_loss(losses, pp - 1, ctx.device), traced=tracer.will_record(step),
                        **timer.take())
            scheduler.step()
            # metrics.last_loss is the last stage's loss, broadcast along the pipeline: every
            # rank checks and records the same value.
            ckpt.end_step(step, metrics.last_loss)  # NaN check, --ckpt-every, --fail-at-step

        val_loss = pipeline_evaluate(schedule, corpus.val, args, ctx.device, has_first, has_last, pp - 1)
        memory = tracer.save(args.out, ctx, title=f"Pipeline parallel ({args.schedule}, {args.microbatches} "
                             f"micro-batches) on {pp} ranks: {args.model} model, batch {args.global_batch_size} "
                             f"x {args.seq_len} tokens, {ctx.device.type}")
        if args.save_weights:
            save_full_weights(models, ctx, args.out / "weights.pt", merge_ranks=True)
        bubble = bubble_report(metrics, ctx, args.schedule, pp, args.microbatches)
        metrics.finish(memory, val_loss=val_loss, schedule=args.schedule, microbatches=args.microbatches,
                       stage_layers=stage_layers(args.model_config.n_layers, n_stages),
                       comm=comm.summary(), bubble=bubble, predicted=theory.report(
                           args, ctx, memory, "pp", microbatches=args.microbatches, schedule=args.schedule))


if __name__ == "__main__":
    main()
