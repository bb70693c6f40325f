"""Step 3b: pipeline parallelism. Each rank holds a few consecutive layers (a stage) and
the batch flows through the ranks in micro-batches.

    torchrun --nproc-per-node 4 step3_multi_gpu/train_pp.py --schedule 1f1b --microbatches 8
    torchrun --nproc-per-node 4 step3_multi_gpu/train_pp.py --schedule gpipe
    torchrun --nproc-per-node 4 step3_multi_gpu/train_pp.py --schedule interleaved1f1b --n-layers 8
    torchrun --nproc-per-node 4 step3_multi_gpu/train_pp.py --schedule zbv --n-layers 8 --microbatches 8

Only activations cross rank boundaries, point to point, once per micro-batch: the cheapest
communication of any split, which is why pipelines span nodes. The cost is time: each rank
idles for a fraction (p-1)/(m+p-1) of a step (the bubble) with p stages and m micro-batches.
GPipe runs all forwards then all backwards (m micro-batches of activations alive); 1F1B starts
each backward as soon as it can (at most p alive); interleaved 1F1B gives each rank two smaller
stages, shrinking the bubble. The zero-bubble schedules (zbv, dualpipev) give each rank two
stages in a V (rank 0 holds the first and the last) and split each backward in two: the input's
gradient, which the previous stage waits for, at once; the weights', in the gaps. Savers: bf16
autocast (the default), --ac, --compile; --microbatches is a pipeline's --grad-accum.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # find common/

import torch
import torch.distributed as dist

from common import cli
from common.data import Batches, load_corpus
from common.distributed import distributed_for
from common.errors import main_guard
from common.measure.pipeline import ComputeTimer, bubble_report
from common.measure.splits import stage_layers
from common.parallelize.ac import apply_ac
from common.parallelize.compile import apply_compile
from common.parallelize.pp import (add_pp_flags, build_stage, check_no_accum, check_pp, last_stage_rank, loss_fn,
                                   make_schedule, pipeline_evaluate, pipeline_loss, pipeline_stages, stage_indices)
from common.run import Run
from common.training import adamw, autocast_forward, clip_grad_norm, lr_schedule


def parse(argv=None):
    p = cli.parser(__doc__)
    add_pp_flags(p, microbatches=4)  # --schedule, --microbatches
    cli.add_dry_run_flags(p)
    cli.add_saver_flags(p)
    return cli.parse(p, argv)


def build(args, ctx, my_stages, n_stages):
    models = [build_stage(args.model_config, s, n_stages, ctx.device, args.seed) for s in my_stages]
    for m in models:
        apply_ac(m, args.ac, every=args.ac_every)  # per block, then compile it
        apply_compile(m, args.compile)
        autocast_forward(m, ctx.device, args.amp_dtype)  # the schedule calls forward: autocast goes on it
    # one AdamW for the rank's stages; their layers keep the full model's names (so does the checkpoint)
    return models, adamw([p for m in models for p in m.parameters()], args)


@main_guard
def main():
    args = parse()
    check_no_accum(args)
    with distributed_for(args) as ctx:
        cli.check_memory_savers(args, ctx.device, fp16=False)
        pp = ctx.world_size
        check_pp(args.model_config, pp, args.schedule, args.microbatches, args.global_batch_size,
                 compile=args.compile, ac=args.ac)
        corpus = load_corpus(args.data, seed=args.seed, vocab_size=args.model_config.vocab_size)
        # Every stage reads the same batch: the first needs the inputs, the last the targets.
        data = Batches(corpus.train, args.seq_len, args.global_batch_size, seed=args.seed)
        # This rank's stages: one (gpipe, 1f1b), or two (interleaved: r and r + pp; a V: r and 2pp - 1 - r)
        my_stages = stage_indices(ctx.rank, pp, args.schedule)
        n_stages = pp * len(my_stages)
        models, optimizer = build(args, ctx, my_stages, n_stages)
        # PyTorch's PipelineStage sends and receives between ranks (a dry run's lone rank is told the shapes)
        stages = pipeline_stages(models, my_stages, n_stages, ctx, args.model_config,
                                 args.global_batch_size // args.microbatches, args.seq_len, args.amp_dtype or torch.float32)
        schedule = make_schedule(args.schedule, stages, args.microbatches, loss_fn)
        has_first, has_last, last = 0 in my_stages, n_stages - 1 in my_stages, last_stage_rank(pp, args.schedule)
        scheduler = lr_schedule(optimizer, args)
        run = Run(args, ctx, models, optimizer, scheduler, data, strategy="pp", parallel={"pp": pp},
                  title=f"Pipeline parallel ({args.schedule}, {args.microbatches} micro-batches)",
                  predict=dict(microbatches=args.microbatches, schedule=args.schedule), evaluate=lambda:
                  pipeline_evaluate(schedule, corpus.val, args, ctx.device, has_first, has_last, last, stages=stages))
        run.resume()  # --resume: the newest checkpoint's model, optimizer, schedule and data position
        batches = iter(data)
        timer = ComputeTimer(schedule, stages, ctx.device)  # the bubble: step time minus compute
        for step in run.steps():
            with run.step(step):
                x, y = (t.to(ctx.device, non_blocking=True) for t in next(batches))
                losses = []  # filled on the last stage: the schedule runs every micro-batch's forward and backward
                schedule.step(*([x] if has_first else []), target=y if has_last else None, losses=losses,
                              return_outputs=False)  # keep no micro-batch's logits: only the losses are read
                # Each stage holds other layers: their sums of squares add up along the pipeline.
                grad_norm = clip_grad_norm([p for m in models for p in m.parameters()], args.max_norm,
                                           pp_group=dist.group.WORLD, local=args.clip_by == "local")
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            # The last stage's loss (on rank 0 in a V), broadcast: every rank logs the same.
            run.log(step, pipeline_loss(losses, last, ctx.device), grad_norm=grad_norm, **timer.take())
            scheduler.step()  # the next step's learning rate
            run.evaluate_if_due(step)  # the held-out loss, every --eval-every steps and after the last
            run.save_if_due(step)  # --ckpt-every; after a stop signal every rank saves this step, then stops
        bubble = bubble_report(run.metrics, ctx, args.schedule, pp, args.microbatches, timer)
        run.finish(schedule=args.schedule, microbatches=args.microbatches,
                   stage_layers=stage_layers(args.model_config.n_layers, n_stages), bubble=bubble)


if __name__ == "__main__":
    main()
