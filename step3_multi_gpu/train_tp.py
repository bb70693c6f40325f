"""Step 3b: tensor parallelism. Every rank holds 1/W of each weight matrix and all ranks
work on the same batch together.

    torchrun --nproc-per-node 4 step3_multi_gpu/train_tp.py
    torchrun --nproc-per-node 4 step3_multi_gpu/train_tp.py --sequence-parallel

Attention heads and the MLP's hidden units are split across ranks (Megatron-LM's plan,
applied from outside by common/parallelize/tp.py:apply_tp). The price: the ranks must
combine their partial results twice per block in the forward pass and twice in the
backward pass, a (batch x seq x dim) activation each time, on the critical path. That is
why tensor parallelism lives inside a node, on NVLink, and not across the network.
Step 2's savers come along: bf16 autocast (the default; --amp off for fp32), --ac,
--compile, --fused-adamw, --grad-accum.
"""
import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # find common/

import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import loss_parallel

from common import cli
from common.data import Batches, load_corpus
from common.distributed import distributed_for
from common.errors import main_guard
from common.model import Transformer, set_doc_mask
from common.parallelize.ac import apply_ac
from common.parallelize.compile import apply_compile
from common.parallelize.tp import apply_tp, check_tp
from common.run import Run
from common.training import adamw, clip_grad_norm, evaluate, global_loss, lr_schedule


def parse(argv=None):
    p = cli.parser(__doc__)
    p.add_argument("--sequence-parallel", action="store_true",
                   help="also split the activations between blocks (norms, residual) along the sequence")
    p.add_argument("--loss-parallel", action=argparse.BooleanOptionalAction, default=True,
                   help="compute the cross entropy on vocabulary-sharded logits (default: on)")
    cli.add_dry_run_flags(p)
    cli.add_saver_flags(p)
    return cli.parse(p, argv)


def build(args, ctx, tp_mesh):
    """Build on meta, split, then allocate: no rank ever holds a full weight matrix."""
    with torch.device("meta"):
        model = Transformer(args.model_config)
    set_doc_mask(model, args.doc_eot)  # --doc-mask: the end-of-text id documents end at (None: off)
    apply_tp(model, tp_mesh, sequence_parallel=args.sequence_parallel, loss_parallel=args.loss_parallel)
    apply_ac(model, args.ac, every=args.ac_every)  # per block, around the split block's forward
    apply_compile(model, args.compile)  # per block, after the split: the graph holds the DTensor ops
    model.to_empty(device=ctx.device)
    model.init_weights(args.seed)  # each rank keeps its shard of the same full weights
    return model, adamw(model.parameters(), args)  # AdamW state is sharded like the weights


@main_guard
def main():
    args = parse()
    with distributed_for(args) as ctx:
        cli.check_memory_savers(args, ctx.device, fp16=False)  # every TP rank reads the whole batch
        check_tp(args.model_config, ctx.world_size, args.seq_len, args.sequence_parallel)
        tp_mesh = ctx.mesh((ctx.world_size,), ("tp",))
        corpus = load_corpus(args.data, seed=args.seed, vocab_size=args.model_config.vocab_size)
        # Not data parallel: every rank reads the same whole batch.
        data = Batches(corpus.train, args.seq_len, args.global_batch_size // args.grad_accum, seed=args.seed)
        # Each rank saves its shard of every weight (a DTensor) by name: 4 TP ranks' checkpoint loads on 2, or in FSDP.
        model, optimizer = build(args, ctx, tp_mesh)
        scheduler = lr_schedule(optimizer, args)
        # The logits are split over the vocabulary; cross entropy (and its backward) must
        # run under loss_parallel() to work on the shards.
        loss_context = loss_parallel if args.loss_parallel else contextlib.nullcontext
        run = Run(args, ctx, model, optimizer, scheduler, data, strategy="tp", parallel={"tp": ctx.world_size},
                  title="Tensor parallel" + (" + sequence parallel" if args.sequence_parallel else ""),
                  predict=dict(sequence_parallel=args.sequence_parallel, loss_parallel=args.loss_parallel),
                  evaluate=lambda: evaluate(model, corpus.val, args, ctx.device, loss_context))
        run.resume()  # --resume: the newest checkpoint's model, optimizer, schedule and data position
        batches = iter(data)
        for step in run.steps():
            with run.step(step):
                step_loss = torch.zeros((), device=ctx.device)
                for micro in range(args.grad_accum):  # micro-batches of the same batch on every rank
                    x, y = next(batches)
                    x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
                    # autocast casts each rank's weight slices to bf16 for the matmuls (DTensor
                    # runs under it like any tensor); the shards, gradients and AdamW stay fp32.
                    with torch.autocast(ctx.device.type, dtype=args.amp_dtype, enabled=args.amp != "off"):
                        logits = model(x)
                    with loss_context():
                        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()) / args.grad_accum
                        loss.backward()
                    step_loss += global_loss(loss)
                # The global norm (each weight's slices count once, the replicated norms' weights once).
                grad_norm = clip_grad_norm(model.parameters(), args.max_norm, local=args.clip_by == "local")
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            run.log(step, step_loss, grad_norm=grad_norm)  # every rank saw the whole batch: no averaging
            scheduler.step()  # the next step's learning rate
            run.evaluate_if_due(step)  # the held-out loss, every --eval-every steps and after the last
            run.save_if_due(step)  # --ckpt-every; after a stop signal every rank saves this step, then stops
        run.finish(sequence_parallel=args.sequence_parallel, loss_parallel=args.loss_parallel)


if __name__ == "__main__":
    main()
