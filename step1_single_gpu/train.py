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

from common import cli
from common.data import Batches, load_corpus
from common.distributed import distributed_for
from common.errors import main_guard
from common.model import build_model, set_doc_mask
from common.run import Run
from common.training import adamw, clip_grad_norm, evaluate, lr_schedule


@main_guard
def main():
    p = cli.parser(__doc__)
    cli.add_moe_flags(p)  # it also trains the mixture-of-experts presets (--model small-moe)
    cli.add_doc_mask_flags(p)
    args = cli.parse(p)
    with distributed_for(args) as ctx:
        corpus = load_corpus(args.data, seed=args.seed, vocab_size=args.model_config.vocab_size)
        data = Batches(corpus.train, args.seq_len, args.global_batch_size, seed=args.seed)

        model = build_model(args.model_config, ctx.device, seed=args.seed)
        set_doc_mask(model, args.doc_eot)  # --doc-mask: the end-of-text id documents end at (None: off)
        optimizer = adamw(model.parameters(), args)
        scheduler = lr_schedule(optimizer, args)
        run = Run(args, ctx, model, optimizer, scheduler, data, strategy="single", title="Step 1, fp32 baseline",
                  evaluate=lambda: evaluate(model, corpus.val, args, ctx.device))
        run.resume()  # --resume: the newest checkpoint's model, optimizer, schedule and data position
        batches = iter(data)
        for step in run.steps():
            with run.step(step):
                x, y = next(batches)
                # non_blocking: the copy is queued like a kernel and the host goes on queuing
                # this step (the batch sits in pinned memory, common/data.py); a plain .to()
                # would first wait for the GPU to finish the previous step.
                x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
                logits = model(x)  # (batch, seq, vocab)
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
                # A mixture of experts adds its routers' load-balancing loss (0 for a dense model).
                (loss + model.moe_aux_loss()).backward()
                # Scale all gradients down together if their global norm exceeds --max-norm:
                # one bad batch then cannot throw the weights far. Returns the norm before.
                grad_norm = clip_grad_norm(model.parameters(), args.max_norm)
                optimizer.step()
                # Free the gradients now, not at the start of the next step: they would
                # otherwise sit in memory through the next forward pass, on top of its
                # activations. set_to_none (the default) frees; zeroing would keep them.
                optimizer.zero_grad(set_to_none=True)
            run.log(step, loss, grad_norm=grad_norm)
            scheduler.step()  # the next step's learning rate
            run.evaluate_if_due(step)  # the held-out loss, every --eval-every steps and after the last
            run.save_if_due(step)  # --ckpt-every; after a stop signal every rank saves this step, then stops
        run.finish()


if __name__ == "__main__":
    main()
