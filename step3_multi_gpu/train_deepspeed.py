"""Step 3a beside DeepSpeed: the same model, data and optimizer trained by DeepSpeed's
ZeRO stages 1, 2 and 3, so that its numbers sit next to ours (train_ddp.py --zero1,
train_fsdp.py). DeepSpeed is not in requirements.txt: pip install deepspeed==0.19.8.
    torchrun --nproc-per-node 2 step3_multi_gpu/train_deepspeed.py --zero-stage 2 --amp off
DeepSpeed does the data-parallel work inside its engine: ``deepspeed.initialize`` takes
the plain model and our AdamW and returns an engine whose ``backward`` averages the
gradients over the ranks (all-reduce; reduce-scatter at stage 3) and whose ``step`` clips,
updates this rank's partition and all-gathers the parameters again. On a CPU it runs with DS_ACCELERATOR=cpu
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
from common.distributed import distributed
from common.errors import UserError, main_guard
from common.model import build_model
from common.run import Run
from common.training import adamw, evaluate, global_loss, lr_schedule, micro_batch_size


BUCKET = 25 * 2**20 // 4  # elements: DDP's default bucket_cap_mb of fp32


def import_deepspeed(device: str):
    """deepspeed, or one sentence saying how to get it. Its accelerator is chosen when it is
    first imported: CPU unless a GPU is asked for and present."""
    # CUDA path: no CPU test: DeepSpeed's CUDA accelerator needs a GPU (tests/test_deepspeed.py runs its CPU
    # one)
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError:
        raise UserError("DeepSpeed is not installed (the tutorial does not need it, only this comparison does); "
                        "pip install deepspeed==0.19.8.") from None
    return deepspeed


def forget_groups():
    """DeepSpeed caches the process groups it derives in module globals. A second run in the
    same process (tools/multirun.py runs several in one job) would find the first run's
    destroyed groups there: start each run without them."""
    from deepspeed.utils import groups
    groups._WORLD_GROUP = groups._DATA_PARALLEL_GROUP = groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None
    for cache in (groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_PARALLEL_GROUP_RANKS,
                  groups._EXPERT_DATA_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP_RANKS, groups._ALL_TO_ALL_GROUP):
        cache.clear()


def zero_sources(engine):
    """What DeepSpeed's ZeRO optimizer holds outside ``model.parameters()`` and the AdamW
    state, for the memory tracer: its fp32 master partition (ZeRO counts it as optimizer
    state, with the moments), the gradients of that partition, and at stage 3 each
    parameter's own shard (``ds_tensor``: the module's ``p.data`` is emptied)."""
    opt = engine.optimizer

    def walk():
        masters = list(getattr(opt, "single_partition_of_fp32_groups", None)
                       or getattr(opt, "fp32_partitioned_groups_flat", None) or [])
        return [("parameters", [p.ds_tensor for p in engine.module.parameters() if hasattr(p, "ds_tensor")]),
                ("optimizer state", masters),
                ("gradients", [m.grad for m in masters if m.grad is not None]
                 + list(getattr(opt, "averaged_gradients", {}).values()))]
    return walk


@main_guard
def main(argv=None):
    p = cli.parser(__doc__)
    p.add_argument("--zero-stage", type=int, default=2, choices=(1, 2, 3),
                   help="1: shard AdamW's state; 2: and the gradients; 3: and the parameters (default: 2)")
    p.add_argument("--amp", default="off", choices=("off",), help="fp32 only (see above)")
    args = cli.parse(p, argv)
    if args.ckpt_every or args.resume:  # (--ckpt-async needs --ckpt-every: refused with it)
        raise UserError("train_deepspeed.py does not checkpoint (DeepSpeed saves its own, engine.save_checkpoint); "
                        "drop --ckpt-every, --ckpt-async and --resume.")
    if args.clip_by == "local":
        raise UserError("--clip-by local is not offered with DeepSpeed: its engine always clips by the global norm; "
                        "drop --clip-by.")
    deepspeed = import_deepspeed(args.device)
    with distributed(args.device, timeout_s=args.pg_timeout) as ctx:
        forget_groups()
        deepspeed.init_distributed(dist_backend=ctx.backend)  # adopts the process group already running
        micro_batch_size(args.global_batch_size, ctx.world_size, 1)  # splits evenly?
        corpus = load_corpus(args.data, seed=args.seed, vocab_size=args.model_config.vocab_size)
        data = Batches(corpus.train, args.seq_len, args.global_batch_size,
                       dp_rank=ctx.rank, dp_size=ctx.world_size, seed=args.seed)  # train_ddp.py's samples

        model = build_model(args.model_config, ctx.device, seed=args.seed)  # step 1's weights
        optimizer = adamw(model.parameters(), args)  # our AdamW: ZeRO wraps it and feeds it its partition
        config = {
            "train_batch_size": args.global_batch_size,
            "train_micro_batch_size_per_gpu": args.global_batch_size // ctx.world_size,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": args.max_norm,  # the global norm, as clip_grad_norm
            # Buckets of DDP's 25 MiB: DeepSpeed's defaults (5e8 elements, 1.9 GiB in fp32) are
            # sized for billions of parameters and would dwarf this model in the memory trace.
            # Stage 3 as FSDP2 does it: every parameter sharded (by default those of at most 1e5
            # elements stay whole: small's norms, attention and embedding, 28% of it), and each
            # module's gathered parameters freed after use (by default up to 1e9 elements stay
            # gathered for reuse, which at this size frees nothing between forward and backward).
            "zero_optimization": {"stage": args.zero_stage, "overlap_comm": False,
                                  "reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET,
                                  "stage3_prefetch_bucket_size": BUCKET, "stage3_param_persistence_threshold": 0,
                                  "stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0},
            "zero_allow_untested_optimizer": True,  # a client optimizer: DeepSpeed prefers its own kernels
            "steps_per_print": 1 << 30, "wall_clock_breakdown": False,
        }
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        inner = engine.optimizer.optimizer  # the AdamW that updates this rank's partition
        scheduler = lr_schedule(inner, args)
        run = Run(args, ctx, engine.module, inner, scheduler, data, strategy=None,
                  title=f"DeepSpeed ZeRO-{args.zero_stage}", parallel={"dp": ctx.world_size},
                  sources=[zero_sources(engine)], checkpoints=False,  # SIGTERM: every rank stops, unsaved
                  evaluate=lambda: evaluate(engine, corpus.val, args, ctx.device))
        # DeepSpeed's own count of its collectives (its comms logger), on the steps whose
        # bytes our counter counts: a second witness to the bytes in summary.json.
        logger = deepspeed.comm.comms_logger
        deepspeed.comm.configure(enabled=False, prof_all=True)
        logger.reset_data()
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

        logger.enabled = False
        logged = {op: {"calls": sum(c[0] for c in sizes.values()) / max(1, run.comm_steps),
                       "bytes": sum(size * c[0] for size, c in sizes.items()) / max(1, run.comm_steps)}
                  for op, sizes in logger.comms_dict.items()}
        run.finish(zero_stage=args.zero_stage,
                   deepspeed_comms_logger=logged)


if __name__ == "__main__":
    main()
