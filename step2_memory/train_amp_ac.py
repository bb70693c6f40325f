"""Step 2.2: activation checkpointing (AC) on top of AMP. train_amp.py plus one call.

A checkpointed block keeps only its input for backward and runs its forward a second time
in backward to rebuild the rest: activations shrink from every block's intermediates to
the block boundaries plus one block's worth at a time, for about one extra forward pass
of compute per step (a third more FLOPs). Selective AC keeps the matmul and attention
outputs (expensive to redo) and recomputes only the cheap ops.
    python step2_memory/train_amp_ac.py                      (bf16 + full AC)
    python step2_memory/train_amp_ac.py --ac selective
    python step2_memory/train_amp_ac.py --ac full --ac-every 2   (every second block)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # find common/

import torch
import torch.nn.functional as F

from common import cli
from common.data import Batches, load_corpus
from common.distributed import distributed_for
from common.errors import main_guard
from common.parallelize.ac import apply_ac
from common.model import build_model, set_doc_mask
from common.run import Run
from common.training import adamw, clip_grad_norm, evaluate, lr_schedule


@main_guard
def main():
    p = cli.parser(__doc__)
    cli.add_amp_flags(p)
    cli.add_ac_flags(p)
    cli.add_doc_mask_flags(p)
    args = cli.parse(p)
    with distributed_for(args) as ctx:
        cli.check_memory_savers(args, ctx.device)
        corpus = load_corpus(args.data, seed=args.seed, vocab_size=args.model_config.vocab_size)
        data = Batches(corpus.train, args.seq_len, args.global_batch_size, seed=args.seed)

        model = build_model(args.model_config, ctx.device, seed=args.seed)
        set_doc_mask(model, args.doc_eot)  # --doc-mask: the end-of-text id documents end at (None: off)
        # Per transformer block, from outside the model, and before torch.compile (which
        # then sees the recomputation and can fuse it).
        apply_ac(model, args.ac, every=args.ac_every)
        optimizer = adamw(model.parameters(), args)  # --fused-adamw: one kernel for all parameters
        scheduler = lr_schedule(optimizer, args)
        if args.compile:
            model.compile()  # in place: parameter names and state_dict keys do not change
        # fp16 has 5 exponent bits: small gradients underflow to zero. The scaler multiplies
        # the loss by a large factor before backward, divides the gradients by it before the
        # step, and skips any step whose gradients overflowed (halving the factor). bf16 has
        # fp32's 8 exponent bits, so its gradients neither underflow nor overflow: no scaler.
        scaler = torch.amp.GradScaler(ctx.device.type, enabled=args.amp == "fp16")

        run = Run(args, ctx, model, optimizer, scheduler, data, strategy="single", title="Step 2",
                  evaluate=lambda: evaluate(model, corpus.val, args, ctx.device))
        run.resume()  # --resume: the newest checkpoint's model, optimizer, schedule and data position
        batches = iter(data)
        for step in run.steps():
            with run.step(step):
                x, y = next(batches)
                x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
                # Only the forward pass and the loss go under autocast; backward runs each op
                # in the dtype its forward used. The weights stay fp32: autocast casts a bf16
                # copy of each for its matmul (and caches it for the rest of the forward).
                with torch.autocast(ctx.device.type, dtype=args.amp_dtype, enabled=args.amp != "off"):
                    logits = model(x)  # (batch, seq, vocab), bf16
                    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())  # autocast does this in fp32
                scaler.scale(loss).backward()  # scale() and step() pass through when disabled
                # Clip the true gradients: divide the fp16 loss scale out first (a no-op for bf16).
                scaler.unscale_(optimizer)
                grad_norm = clip_grad_norm(model.parameters(), args.max_norm, local=args.clip_by == "local")
                scaler.step(optimizer)
                scaler.update()
                # Free the gradients now, not at the start of the next step: they would
                # otherwise sit in memory through the next forward pass, on top of its
                # activations. set_to_none (the default) frees; zeroing would keep them.
                optimizer.zero_grad(set_to_none=True)
            run.log(step, loss, grad_norm=grad_norm, loss_scale=scaler.get_scale())
            scheduler.step()  # the next step's learning rate
            run.evaluate_if_due(step)  # the held-out loss, every --eval-every steps and after the last
            run.save_if_due(step)  # --ckpt-every; after a stop signal every rank saves this step, then stops
        run.finish()


if __name__ == "__main__":
    main()
