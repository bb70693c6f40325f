"""Step 3a beside DeepSpeed: the same model, data and optimizer trained by DeepSpeed's
ZeRO stages 1, 2 and 3, so that its numbers sit next to ours (train_ddp.py --zero1,
train_fsdp.py). DeepSpeed is not in requirements.txt: pip install deepspeed==0.19.8.
    torchrun --nproc-per-node 2 step3_multi_gpu/train_deepspeed.py --zero-stage 2 --amp off
DeepSpeed does the data-parallel work inside its engine: ``deepspeed.initialize`` takes
the plain model and our AdamW and returns an engine whose ``backward`` averages the
gradients over the ranks (all-reduce; reduce-scatter at stage 3) and whose ``step`` clips,
updates this rank's partition and, at stages 1 and 2, all-gathers the parameters again (stage 3 gathers
them in the next forward). On a CPU it runs with DS_ACCELERATOR=cpu
(set here) over gloo, in fp32 only: in bf16 both keep fp32 master weights but round in
different places (DeepSpeed reduces bf16 gradients in bf16, our FSDP policy in fp32), so
only fp32 compares loss for loss.
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
from common.model import build_model, set_doc_mask
from common.parallelize.deepspeed_zero import (comms_logged, comms_logger, forget_groups, import_deepspeed,
                                               refuse_deepspeed_flags, zero_config, zero_sources)
from common.run import Run
from common.training import adamw, evaluate, global_loss, lr_schedule, micro_batch_size


@main_guard
def main(argv=None):
    p = cli.parser(__doc__)
    p.add_argument("--zero-stage", type=int, default=2, choices=(1, 2, 3),
                   help="1: shard AdamW's state; 2: and the gradients; 3: and the parameters (default: 2)")
    p.add_argument("--amp", default="off", choices=("off",), help="fp32 only (see above)")
    cli.add_doc_mask_flags(p)
    args = cli.parse(p, argv)
    refuse_deepspeed_flags(args)  # it checkpoints its own way, and clips by the global norm only
    deepspeed = import_deepspeed(args.device)
    with distributed_for(args) as ctx:
        forget_groups()  # (a previous run's in this process)
        deepspeed.init_distributed(dist_backend=ctx.backend)  # adopts the process group already running
        micro_batch_size(args.global_batch_size, ctx.world_size, 1)  # splits evenly?
        corpus = load_corpus(args.data, seed=args.seed, vocab_size=args.model_config.vocab_size)
        data = Batches(corpus.train, args.seq_len, args.global_batch_size,
                       dp_rank=ctx.rank, dp_size=ctx.world_size, seed=args.seed)  # train_ddp.py's samples

        model = build_model(args.model_config, ctx.device, seed=args.seed)  # step 1's weights
        set_doc_mask(model, args.doc_eot)  # --doc-mask: the end-of-text id documents end at (None: off)
        optimizer = adamw(model.parameters(), args)  # our AdamW: ZeRO wraps it and feeds it its partition
        # ZeRO --zero-stage, one micro-batch per rank, clipping to --max-norm, buckets of DDP's size
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=zero_config(args, ctx.world_size))
        inner = engine.optimizer.optimizer  # the AdamW that updates this rank's partition
        scheduler = lr_schedule(inner, args)
        run = Run(args, ctx, engine.module, inner, scheduler, data, strategy=None,
                  title=f"DeepSpeed ZeRO-{args.zero_stage}", parallel={"dp": ctx.world_size},
                  sources=[zero_sources(engine)], checkpoints=False,  # SIGTERM: every rank stops, unsaved
                  evaluate=lambda: evaluate(engine, corpus.val, args, ctx.device))
        run.resume()  # --resume: the newest checkpoint's model, optimizer, schedule and data position
        logger = comms_logger(deepspeed)  # DeepSpeed's own count of the bytes ours counts
        batches = iter(data)
        for step in run.steps():
            logger.enabled = run.counts_comm(step)
            with run.step(step):
                x, y = next(batches)
                x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
                logits = engine(x)
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
                engine.backward(loss)  # stages 1 and 2: all-reduce (use_multi_rank_bucket_allreduce); 3: reduce-scatter
                engine.step()  # clip, update this rank's partition, all-gather the parameters
            grad_norm = torch.tensor(float(engine.get_global_grad_norm()))
            run.log(step, global_loss(loss, dp_size=ctx.world_size), grad_norm=grad_norm)
            scheduler.step()  # the next step's learning rate
            run.evaluate_if_due(step)  # the held-out loss, every --eval-every steps and after the last
            run.save_if_due(step)  # --ckpt-every; after a stop signal every rank saves this step, then stops
        run.finish(zero_stage=args.zero_stage, deepspeed_comms_logger=comms_logged(logger, run.comm_steps))


if __name__ == "__main__":
    main()
