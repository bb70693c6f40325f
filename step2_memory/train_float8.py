"""Step 2.6: float8 training with torchao. Step 2.1 (bf16 autocast) plus one conversion.

``convert_float8`` swaps the model's Linear layers for torchao's ``Float8Linear``: every
matmul of forward and backward casts both operands to float8 with a per-tensor scale from
their current maximum (dynamic scaling) and runs on the float8 tensor cores, twice bf16's
rate on an H100. Weights, gradients and AdamW stay fp32, as under AMP.
    python step2_memory/train_float8.py                 (compute capability 8.9+: L4, L40, H100; on a CPU: emulated)
The output layer is kept in bf16, and so is any layer whose sides are not multiples of 16.
Small models gain little: the casts and amax reductions cost the same per element as the
matmul saves, and only wide matmuls are long enough for the saving to win.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # find common/

import torch
import torch.nn.functional as F

from common import cli
from common.data import Batches, load_corpus
from common.distributed import distributed_for
from common.errors import UserError, main_guard
from common.model import build_model, set_doc_mask
from common.parallelize.float8 import convert_float8, float8_unsupported
from common.run import Run
from common.training import adamw, clip_grad_norm, evaluate, lr_schedule


@main_guard
def main():
    p = cli.parser(__doc__)
    cli.add_amp_flags(p, fp16=False)
    cli.add_doc_mask_flags(p)
    args = cli.parse(p)
    if args.amp == "fp16":
        raise UserError("--amp fp16 is not offered with float8: the matmuls already scale their own operands, "
                        "and the rest trains in bf16; use --amp bf16 (the default).")
    with distributed_for(args) as ctx:
        cli.check_memory_savers(args, ctx.device)
        why = float8_unsupported(ctx.device)
        if why:
            raise UserError(why)
        corpus = load_corpus(args.data, seed=args.seed, vocab_size=args.model_config.vocab_size)
        data = Batches(corpus.train, args.seq_len, args.global_batch_size, seed=args.seed)

        model = build_model(args.model_config, ctx.device, seed=args.seed)
        set_doc_mask(model, args.doc_eot)  # --doc-mask: the end-of-text id documents end at (None: off)
        # In place, from outside the model: Float8Linear keeps the fp32 weight as its
        # parameter (same names, same state_dict) and casts it to float8 at each call.
        float8 = convert_float8(model, ctx.device)  # (on a CPU: emulated, common/parallelize/float8.py says why)
        ctx.print(f"float8: {len(float8['converted'])} Linear layers converted; kept in bf16: "
                  + ", ".join(f"{k} ({v})" for k, v in float8["skipped"].items())
                  + ("; on a CPU torchao emulates the float8 matmuls (the same casts and scales, the products in fp32)"
                     if float8["emulated"] else ""))
        optimizer = adamw(model.parameters(), args)  # --fused-adamw: one kernel for all parameters
        scheduler = lr_schedule(optimizer, args)
        if args.compile:
            model.compile()  # on a GPU float8 is only fast compiled: the casts fuse into one kernel

        run = Run(args, ctx, model, optimizer, scheduler, data, strategy="single", title="Step 2, float8",
                  evaluate=lambda: evaluate(model, corpus.val, args, ctx.device))
        run.resume()  # --resume: the newest checkpoint's model, optimizer, schedule and data position
        batches = iter(data)
        for step in run.steps():
            with run.step(step):
                x, y = next(batches)
                x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
                # Autocast still runs what is not a converted Linear (attention, the output
                # layer) in bf16; the Float8Linear layers take its bf16 input and cast it on.
                with torch.autocast(ctx.device.type, dtype=args.amp_dtype, enabled=args.amp != "off"):
                    logits = model(x)  # (batch, seq, vocab)
                    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
                loss.backward()  # the gradient's matmuls in float8 too: the incoming gradient e5m2, for its range
                grad_norm = clip_grad_norm(model.parameters(), args.max_norm, local=args.clip_by == "local")
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            run.log(step, loss, grad_norm=grad_norm)
            scheduler.step()  # the next step's learning rate
            run.evaluate_if_due(step)  # the held-out loss, every --eval-every steps and after the last
            run.save_if_due(step)  # --ckpt-every; after a stop signal every rank saves this step, then stops
        run.finish(float8=float8)


if __name__ == "__main__":
    main()
