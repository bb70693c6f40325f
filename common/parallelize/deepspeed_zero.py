"""DeepSpeed's ZeRO beside ours (step3_multi_gpu/train_deepspeed.py): getting DeepSpeed, its
configuration sized like our runs, and what its engine holds where our tools can see it.

DeepSpeed is optional (not in requirements.txt): only what imports it needs it.
"""
from __future__ import annotations

import argparse
import os

import torch

from common.errors import UserError

BUCKET = 25 * 2**20 // 4  # elements: DDP's default bucket_cap_mb of fp32


def refuse_deepspeed_flags(args: argparse.Namespace) -> None:
    """The shared flags DeepSpeed's engine cannot honour, refused before any work."""
    if args.ckpt_every or args.resume:  # (--ckpt-async needs --ckpt-every: refused with it)
        raise UserError("train_deepspeed.py does not checkpoint (DeepSpeed saves its own, engine.save_checkpoint); "
                        "drop --ckpt-every, --ckpt-async and --resume.")
    if args.clip_by == "local":
        raise UserError("--clip-by local is not offered with DeepSpeed: its engine always clips by the global norm; "
                        "drop --clip-by.")


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


def zero_config(args: argparse.Namespace, world_size: int) -> dict:
    """DeepSpeed's configuration for our run: one micro-batch per rank and step, the global
    norm clipped to --max-norm, and ZeRO --zero-stage with buckets sized like ours."""
    return {
        "train_batch_size": args.global_batch_size,
        "train_micro_batch_size_per_gpu": args.global_batch_size // world_size,
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


def comms_logger(deepspeed):
    """DeepSpeed's own count of its collectives (its comms logger), switched on by the caller
    for the steps whose bytes our counter counts: a second witness to the bytes in summary.json."""
    logger = deepspeed.comm.comms_logger
    deepspeed.comm.configure(enabled=False, prof_all=True)
    logger.reset_data()
    return logger


def comms_logged(logger, steps: int) -> dict:
    """{collective: calls and bytes per counted step} from DeepSpeed's comms logger, now stopped."""
    logger.enabled = False
    return {op: {"calls": sum(c[0] for c in sizes.values()) / max(1, steps),
                 "bytes": sum(size * c[0] for size, c in sizes.items()) / max(1, steps)}
            for op, sizes in logger.comms_dict.items()}
