"""Step 3b: 3-D parallelism. Pipeline stages across groups of nodes, FSDP across the
nodes of a stage, tensor parallel inside a node: how the largest models train.

    torchrun --nproc-per-node 8 step3_multi_gpu/train_3d.py --pp 2 --dp 2 --tp 2 --n-layers 4

(Degrees left out: tp 2 and pp 2 where they divide the world size, dp the rest.) Rank r
sits at (pp, dp, tp) in a grid, tp varying fastest: a TP group's ranks are consecutive, on
one node. Every pipeline stage is a 2-D (FSDP x TP) model of its own layers (train_2d.py),
and each data-parallel replica of the pipeline reads its slice of the batch and runs the
schedule on it (train_pp.py): TP's all-reduces on NVLink, FSDP's gathers and reduce-scatters
between a stage's nodes, PP's activations between stages. --amp bf16 is FSDP's policy (autocast at dp 1).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # find common/

import torch

from common import cli
from common.data import Batches, load_corpus
from common.distributed import distributed_for
from common.errors import main_guard
from common.measure.splits import stage_layers
from common.parallelize.ac import apply_ac
from common.parallelize.compile import apply_compile
from common.parallelize.fsdp import apply_fsdp
from common.parallelize.pp import (add_3d_flags, build_stage, check_no_accum, check_pp, last_stage_rank, layout_3d,
                                   loss_fn, make_schedule, pipeline_evaluate, pipeline_loss, pipeline_stages,
                                   plan_3d, stage_indices)
from common.parallelize.tp import apply_tp, check_tp
from common.run import Run
from common.training import adamw, clip_grad_norm, global_loss, lr_schedule


def parse(argv=None):
    p = cli.parser(__doc__)
    add_3d_flags(p)  # --pp, --dp, --tp (outer to inner), --schedule, --microbatches
    cli.add_dry_run_flags(p)
    cli.add_saver_flags(p)
    return cli.parse(p, argv)


def build(args, ctx, mesh, my_stages, n_stages):
    def parallelize(stage_model):  # inside each stage: train_2d.py's recipe
        apply_tp(stage_model, mesh["tp"], loss_parallel=False)
        apply_ac(stage_model, args.ac, every=args.ac_every)
        # Gathered weights kept through the schedule (else gathered again for every micro-batch); bf16 gathers.
        apply_fsdp(stage_model, mesh["dp"], reshard_after_forward=False, param_dtype=args.amp_dtype)
        apply_compile(stage_model, args.compile)
    models = [build_stage(args.model_config, s, n_stages, ctx.device, args.seed, parallelize) for s in my_stages]
    return models, adamw([p for m in models for p in m.parameters()], args)  # one AdamW (full-model names)


@main_guard
def main():
    args = parse()
    check_no_accum(args)
    with distributed_for(args) as ctx:
        cli.check_memory_savers(args, ctx.device, dp_size=None, fp16=False)
        layout_3d(args, ctx.world_size)  # the degrees not given: tp 2, then pp 2 where they divide, dp the rest
        check_tp(args.model_config, args.tp, args.seq_len, sequence_parallel=False)
        check_pp(args.model_config, args.pp, args.schedule, args.microbatches, args.global_batch_size // args.dp,
                 compile=args.compile, ac=args.ac)
        mesh = ctx.mesh((args.pp, args.dp, args.tp), ("pp", "dp", "tp"))
        pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
        corpus = load_corpus(args.data, seed=args.seed, vocab_size=args.model_config.vocab_size)
        data = Batches(corpus.train, args.seq_len, args.global_batch_size, dp_rank=dp_rank, dp_size=args.dp,
                       seed=args.seed)
        my_stages = stage_indices(pp_rank, args.pp, args.schedule)
        n_stages = args.pp * len(my_stages)
        models, optimizer = build(args, ctx, mesh, my_stages, n_stages)  # each stage 2-D (TP, then FSDP)
        # (a dry run's rank is told its stages' shapes, as in train_pp.py: fp32 residual stream, fp32 logits)
        stages = pipeline_stages(models, my_stages, n_stages, ctx, args.model_config,
                                 args.global_batch_size // args.dp // args.microbatches, args.seq_len, torch.float32,
                                 group=mesh["pp"].get_group())
        schedule = make_schedule(args.schedule, stages, args.microbatches, loss_fn)
        has_first, has_last = 0 in my_stages, n_stages - 1 in my_stages
        last, pp_group = last_stage_rank(args.pp, args.schedule), mesh["pp"].get_group()  # the loss's stage
        scheduler = lr_schedule(optimizer, args)
        run = Run(args, ctx, models, optimizer, scheduler, data, strategy="2d", fsdp=True, predict=plan_3d(args),
                  title=f"3-D parallel, PP {args.pp} x FSDP {args.dp} x TP {args.tp} ({args.schedule})",
                  parallel={"pp": args.pp, "dp": args.dp, "tp": args.tp, "stages": n_stages},
                  evaluate=lambda: pipeline_evaluate(schedule, corpus.val, args, ctx.device, has_first, has_last, last,
                                                     pp_group, mesh["dp"].get_group(), dp_rank, args.dp, stages=stages))
        run.resume()  # --resume: the newest checkpoint's model, optimizer, schedule and data position
        batches = iter(data)
        for step in run.steps():
            with run.step(step):
                x, y = (t.to(ctx.device, non_blocking=True) for t in next(batches))
                losses = []
                schedule.step(*([x] if has_first else []), target=y if has_last else None, losses=losses,
                              return_outputs=False)  # keep no micro-batch's logits: only the losses are read
                # Each stage holds other layers: their sums of squares add up along the pipeline.
                grad_norm = clip_grad_norm([p for m in models for p in m.parameters()], args.max_norm,
                                           pp_group=pp_group, local=args.clip_by == "local")
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            # The last stage's loss, shared along the pipeline, then averaged over the replicas.
            loss = global_loss(pipeline_loss(losses, last, ctx.device, pp_group), mesh["dp"].get_group(), args.dp)
            run.log(step, loss, grad_norm=grad_norm)
            scheduler.step()  # the next step's learning rate
            run.evaluate_if_due(step)  # the held-out loss, every --eval-every steps and after the last
            run.save_if_due(step)  # --ckpt-every; after a stop signal every rank saves this step, then stops
        run.finish(schedule=args.schedule, microbatches=args.microbatches,
                   stage_layers=stage_layers(args.model_config.n_layers, n_stages))


if __name__ == "__main__":
    main()
