"""Step 3b: expert parallelism. A mixture-of-experts model with its experts spread over
the ranks, and the dense part (attention, norms, routers, embedding) sharded by FSDP.

    torchrun --nproc-per-node 4 step3_multi_gpu/train_ep.py                       # small-moe
    torchrun --nproc-per-node 2 step3_multi_gpu/train_ep.py --model debug-moe

Every rank trains on its own share of each global batch, as under FSDP. In each MoE layer
the router picks top_k experts per token; an all-to-all sends every token to the ranks
that own its experts (dispatch), each rank runs its n_experts / W experts, and a second
all-to-all brings the results home (combine). The training loss adds the router's
load-balancing loss. A dry run (--fake-world-size 8 --fake-rank R) plays one rank alone,
assuming an even routing (the other ranks' never arrives): its all-to-all bytes and expert
shapes are those of a rank in a balanced real run.
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
from common.model import Transformer, set_doc_mask
from common.parallelize.ac import apply_ac
from common.parallelize.compile import apply_compile
from common.parallelize.ep import (add_ep_flag, apply_ep, check_ep, expert_params, moe_layers, reduce_expert_grads,
                                   say_even_routing)
from common.parallelize.fsdp import apply_fsdp
from common.run import Run
from common.training import adamw, clip_grad_norm, evaluate, global_loss, lr_schedule, micro_batch_size


def parse(argv=None):
    p = cli.parser(__doc__)
    p.set_defaults(model="small-moe")
    cli.add_moe_flags(p)
    cli.add_dry_run_flags(p)
    cli.add_saver_flags(p, accum_what="; gradients are reduced after the last only")
    add_ep_flag(p)  # --ep: the expert-parallel degree (default: every rank)
    return cli.parse(p, argv)


def build(args, ctx, mesh):
    with torch.device("meta"):
        model = Transformer(args.model_config)
    set_doc_mask(model, args.doc_eot)  # --doc-mask: the end-of-text id documents end at (None: off)
    apply_ep(model, mesh, even_routing=ctx.fake)  # each rank its experts, which tokens reach by all-to-all
    apply_ac(model, args.ac, every=args.ac_every)
    # The dense part: FSDP over all the ranks, the experts left out (their copies: reduce_expert_grads, below).
    apply_fsdp(model, ctx.mesh(), param_dtype=args.amp_dtype, ignored_params=expert_params(model))
    apply_compile(model, args.compile)
    model.to_empty(device=ctx.device).init_weights(seed=args.seed)  # every rank its experts and its shards
    return model, adamw(model.parameters(), args)


@main_guard
def main(argv=None):
    args = parse(argv)
    with distributed_for(args) as ctx:
        cli.check_memory_savers(args, ctx.device, dp_size=None, fp16=False)
        ep = args.ep or ctx.world_size
        check_ep(args.model_config, args.model, ep, ctx.world_size, ctx.fake)  # n_experts / ep experts per rank
        micro_batch_size(args.global_batch_size, ctx.world_size, args.grad_accum)  # splits evenly?
        # The same ranks are data parallel (all of them) and expert parallel (groups of ep).
        mesh = ctx.mesh((ctx.world_size,), ("ep",)) if ep == ctx.world_size else \
            ctx.mesh((ctx.world_size // ep, ep), ("replicate", "ep"))
        corpus = load_corpus(args.data, seed=args.seed, vocab_size=args.model_config.vocab_size)
        data = Batches(corpus.train, args.seq_len, args.global_batch_size // args.grad_accum,
                       dp_rank=ctx.rank, dp_size=ctx.world_size, seed=args.seed)
        model, optimizer = build(args, ctx, mesh)  # experts split over mesh's "ep", the dense part FSDP
        say_even_routing(ctx)
        scheduler = lr_schedule(optimizer, args)
        run = Run(args, ctx, model, optimizer, scheduler, data, fsdp=True, strategy="ep", predict=dict(ep=ep),
                  parallel={"dp": ctx.world_size, "ep": ep}, title=f"Expert parallel {ep} (dense part FSDP)",
                  evaluate=lambda: evaluate(model, corpus.val, args, ctx.device))
        run.resume()  # --resume: the newest checkpoint's model, optimizer, schedule and data position
        batches = iter(data)
        for step in run.steps():
            with run.step(step):
                step_loss, aux_loss = torch.zeros((), device=ctx.device), torch.zeros((), device=ctx.device)
                for micro in range(args.grad_accum):
                    x, y = next(batches)
                    x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
                    model.set_requires_gradient_sync(micro == args.grad_accum - 1)
                    logits = model(x)  # two all-to-alls per MoE layer
                    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) / args.grad_accum
                    aux = model.moe_aux_loss() / args.grad_accum  # keeps the experts' loads even
                    (loss + aux).backward()  # the all-to-alls again, reversed
                    step_loss += loss.detach()
                    aux_loss += aux.detach()
                reduce_expert_grads(model, mesh)  # with --ep below the world: copies of an expert average
                grad_norm = clip_grad_norm(model.parameters(), args.max_norm, local=args.clip_by == "local")
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            # Logged apart: the language-model loss (a dense model's), the router's, each layer's load.
            run.log(step, global_loss(step_loss, dp_size=ctx.world_size), grad_norm=grad_norm,
                    aux_loss=global_loss(aux_loss, dp_size=ctx.world_size),
                    tokens_per_expert=torch.stack([moe.tokens_per_expert for moe in moe_layers(model)]))
            scheduler.step()  # the next step's learning rate
            run.evaluate_if_due(step)  # the held-out loss, every --eval-every steps and after the last
            run.save_if_due(step)  # --ckpt-every; after a stop signal every rank saves this step, then stops
        run.finish()


if __name__ == "__main__":
    main()
