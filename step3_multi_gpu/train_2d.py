"""Step 3b: 2-D parallelism. Tensor parallel inside a group of ranks, FSDP across groups.

    torchrun --nproc-per-node 4 step3_multi_gpu/train_2d.py --tp 2              (a 2 x 2 mesh)
    torchrun --nproc-per-node 4 step3_multi_gpu/train_2d.py --dp 2 --tp 2 --sequence-parallel

The ranks form a (dp, tp) grid. Along tp, ranks split every weight matrix and work on the
same batch (train_tp.py): chatty, so on a real cluster the GPUs of one node, on NVLink.
Along dp, FSDP shards those shards again and each group reads its own slice of the batch
(train_fsdp.py): a block's all-gather and reduce-scatter overlap with compute and tolerate
the slower network between nodes. Each rank holds 1/(dp x tp) of the model state. Step 2's
savers come along: --amp bf16 (the default: FSDP's policy), --ac, --compile, --grad-accum.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # find common/

import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import loss_parallel

from common import cli
from common.data import Batches, load_corpus
from common.distributed import distributed_for
from common.errors import UserError, main_guard
from common.model import Transformer, set_doc_mask
from common.parallelize.ac import apply_ac
from common.parallelize.compile import apply_compile
from common.parallelize.fsdp import apply_fsdp
from common.parallelize.tp import apply_tp, check_tp
from common.run import Run
from common.training import adamw, clip_grad_norm, evaluate, global_loss, lr_schedule, micro_batch_size


def parse(argv=None):
    p = cli.parser(__doc__)
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel degree, the inner mesh dimension (default: 2, or 1 on an odd world size)")
    p.add_argument("--dp", type=int, default=None, help="FSDP degree, the outer dimension (default: world size / tp)")
    p.add_argument("--sequence-parallel", action="store_true", help="sequence parallelism inside the TP groups")
    cli.add_dry_run_flags(p)
    cli.add_saver_flags(p)
    return cli.parse(p, argv)


def build(args, ctx, mesh):
    """Tensor parallel first (inside the node), then FSDP over the result (across nodes)."""
    with torch.device("meta"):
        model = Transformer(args.model_config)
    set_doc_mask(model, args.doc_eot)  # --doc-mask: the end-of-text id documents end at (None: off)
    apply_tp(model, mesh["tp"], sequence_parallel=args.sequence_parallel)
    apply_ac(model, args.ac, every=args.ac_every)  # per block, inside each FSDP unit
    apply_fsdp(model, mesh["dp"], param_dtype=args.amp_dtype)  # bf16 gathers, fp32 shards and reduction
    apply_compile(model, args.compile)  # per block, last
    model.to_empty(device=ctx.device).init_weights(args.seed)  # each rank allocates and fills its shards
    return model, adamw(model.parameters(), args)


@main_guard
def main():
    args = parse()
    with distributed_for(args) as ctx:
        cli.check_memory_savers(args, ctx.device, dp_size=None, fp16=False)
        if (args.tp is not None and args.tp <= 0) or (args.dp is not None and args.dp <= 0):
            raise UserError(f"--dp and --tp must be positive (got --dp {args.dp} --tp {args.tp}).")
        args.tp = args.tp or (2 if ctx.world_size % 2 == 0 else 1)
        dp = args.dp or max(1, ctx.world_size // args.tp)
        check_tp(args.model_config, args.tp, args.seq_len, args.sequence_parallel)
        mesh = ctx.mesh((dp, args.tp), ("dp", "tp"))  # tp inner: consecutive ranks, one node's GPUs
        corpus = load_corpus(args.data, seed=args.seed, vocab_size=args.model_config.vocab_size)
        # The data is split along dp only: the ranks of one TP group read the same samples.
        micro_batch_size(args.global_batch_size, dp, args.grad_accum)  # splits evenly?
        data = Batches(corpus.train, args.seq_len, args.global_batch_size // args.grad_accum,
                       dp_rank=mesh["dp"].get_local_rank(), dp_size=dp, seed=args.seed)
        model, optimizer = build(args, ctx, mesh)
        scheduler = lr_schedule(optimizer, args)
        # FSDP x TP shards are DTensors on a 2-D mesh; DCP reshards them to any other mesh.
        run = Run(args, ctx, model, optimizer, scheduler, data, fsdp=True, strategy="2d",
                  title=f"2-D parallel, FSDP {dp} x TP {args.tp}", parallel={"dp": dp, "tp": args.tp},
                  predict=dict(tp=args.tp, sequence_parallel=args.sequence_parallel),
                  evaluate=lambda: evaluate(model, corpus.val, args, ctx.device, loss_parallel))
        run.resume()  # --resume: the newest checkpoint's model, optimizer, schedule and data position
        batches = iter(data)
        for step in run.steps():
            with run.step(step):
                step_loss = torch.zeros((), device=ctx.device)
                for micro in range(args.grad_accum):
                    x, y = next(batches)
                    x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
                    if hasattr(model, "set_requires_gradient_sync"):  # not FSDP-wrapped where dp is 1
                        model.set_requires_gradient_sync(micro == args.grad_accum - 1)  # reduce-scatter once
                    logits = model(x)  # split over the vocabulary along tp
                    with loss_parallel():
                        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()) / args.grad_accum
                        loss.backward()  # FSDP averages the gradients over dp
                    step_loss += global_loss(loss)  # made whole along tp
                # The global norm (FSDP x TP shards, reduced over both dimensions of the mesh).
                grad_norm = clip_grad_norm(model.parameters(), args.max_norm, local=args.clip_by == "local")
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            # Each TP group's loss is the mean over its share of the batch; average over dp.
            run.log(step, global_loss(step_loss, mesh["dp"].get_group(), dp), grad_norm=grad_norm)
            scheduler.step()  # the next step's learning rate
            run.evaluate_if_due(step)  # the held-out loss, every --eval-every steps and after the last
            run.save_if_due(step)  # --ckpt-every; after a stop signal every rank saves this step, then stops
        run.finish(sequence_parallel=args.sequence_parallel)


if __name__ == "__main__":
    main()
