"""Will it fit? Per-GPU memory of a training configuration, without a GPU.

    python -m tools.estimate --model 8b --world-size 4 --strategy fsdp
    python -m tools.estimate --model 8b --world-size 4 --strategy all --gpu-mem 79.65 --headroom 4
    python -m tools.estimate --model debug --world-size 4 --strategy fsdp --trace
    python -m tools.estimate --model 1b --world-size 8 --strategy fsdp --seq-len 256 --batch 8 --device cpu --trace --dry-run

From the formulas of common/measure/formulas.py (added up by theory.py), and with ``--trace`` also from a real forward,
backward and optimizer step of the model run under ``FakeTensorMode``: every tensor has
a shape, a dtype and a device but no memory, and a fake process group (``backend="fake"``,
whose collectives do nothing) lets each layout's own script build it (its ``build``, found
through common/layouts.py: FSDP2, tensor, context and pipeline parallelism as on
``--world-size`` GPUs; DDP's wrapper left out, see ``_traceable_build``). common/measure/memory.py's tracer, which only looks at storages' sizes,
measures rank 0 by category. Pipeline parallelism (``--strategy pp``, GPipe or 1F1B) is
traced on the rank the formulas find fullest: that rank's stage replays the schedule's
textbook order of micro-batch forwards and backwards (common/parallelize/pp.py's
``schedule_order``), with fake tensors standing in for what its neighbours would send.
PyTorch's own schedule cannot run on fake tensors (its start-up handshake reads values).

``--dry-run`` runs the real thing for one rank: the step-3 script of the layout started with
``--fake-world-size`` (plain python, PyTorch's fake process group: real tensors on
``--device``, the collectives skipped), three steps, the second traced and the third
byte-counted (the first two do one-time work: DDP rebuilds its buckets in the second). Its
bytes by category are what that rank of a real run holds (tests/test_step3a.py holds dry runs to real ones),
measured by the device's own allocations rather than derived: the third column beside the
formula and the fake-tensor trace. Under ``--strategy ep`` the rank assumes an even routing,
as the formula does (its peers' token counts never arrive), and ``--trace`` runs the dry run
instead: a fake tensor has no values, and the router's counts decide the MoE layer's shapes.

"Fits" compares the peak with the *usable* memory: what the card reports (nvidia-smi shows
an "80 GB" H100 as 81,559 MiB = 79.65 GiB; PyTorch's total_memory is about 79.1 GiB of it)
less a headroom for what no formula here counts: that gap, the CUDA context and kernels, NCCL's communicator buffers, and the caching allocator's
fragmentation and rounding. A peak that lands within the headroom of the total is an
out-of-memory error in practice.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file (python tools/x.py): find common/

from common import ROOT, layouts
from common.errors import UserError, main_guard
from common.prepared import take_vocab
from common.measure.byte_units import fmt_bytes
from common.model import PRESETS, get_config
from common.measure.plan import ALIASES, HEAD_LOSS_STRATEGIES, STRATEGIES, Plan
from common.measure.theory import (CATEGORIES, FORWARD_GATHER, ROOT_REDUCE, SPLIT_HEAD_REDUCE, SPLIT_LOSS_FORWARD,
                                   predict)
from common.parallelize.ac import AC_MODES

GiB = 2**30
H100_80GB_GIB = 79.65   # total memory an "80 GB" H100 reports (nvidia-smi: 81559 MiB)
HEADROOM_GIB = 4.0      # CUDA context + kernels (~1), NCCL buffers (~1-2), allocator fragmentation
TRACEABLE = ("single", "ddp", "fsdp_zero2", "fsdp_zero3", "hsdp", "hsdp_zero2", "tp", "2d", "pp", "cp", "cp_fsdp")
# What --trace cannot follow under fake tensors, and runs the dry run for instead (saying so).
DRY_TRACED = {"ep": "a mixture of experts cannot be traced under fake tensors (the router's token counts decide "
                    "the shapes, and a fake tensor has no values)"}
# The 1b model at batch 4 x 2048 on one GPU (torch 2.11, CUDA 13, eager), from the H200's report
# in figs/ (tools/gpu_check.py's runs 1b_fp32: step1_single_gpu/train.py; 1b_amp:
# step2_memory/train_amp.py --amp bf16; 1b_amp_sac and 1b_amp_ac: step2_memory/train_amp_ac.py
# --amp bf16 --ac selective / full). Keys: (dtype, ac); values: the run's name.
GPU_1B_RUNS = {("fp32", "none"): "1b_fp32", ("bf16", "none"): "1b_amp", ("bf16", "selective"): "1b_amp_sac",
               ("bf16", "full"): "1b_amp_ac"}
GPU_1B_REPORT = "figs/gpu_check_h200.json"
OWN_MEMORY = 0.02  # a run whose allocator peak is within this of its traced peak held only its own memory


def gpu_1b_peaks() -> dict[tuple[str, str], tuple[float, str]]:
    """(dtype, ac) -> (GiB, what measured it), from the GPU report in figs/: the allocator's
    peak (``max_memory_allocated``) where the run held only its own memory; the memory
    tracer's peak where the allocator's also held an earlier run of the same process (the
    H200's eager AC runs: the report's note says why). The tracer reads a little under the
    allocator (0.2% on the two 1b runs that held only their own memory, up to 3.8% on the
    report's compiled checkpointed 125m runs). tests/test_estimate.py holds the formulas
    to these."""
    import json
    report = json.loads((ROOT / GPU_1B_REPORT).read_text())
    gpu = report["device"].removeprefix("NVIDIA ").split()[0]
    runs = {r["name"]: r for r in report["runs"]}
    out = {}
    for key, name in GPU_1B_RUNS.items():
        allocated, traced = runs[name]["allocator_peak_bytes"], runs[name]["traced_peak_bytes"]
        own = abs(allocated / traced - 1) <= OWN_MEMORY
        out[key] = ((allocated if own else traced) / GiB, f"{gpu} {'allocator' if own else 'tracer'}")
    return out


def traceable(p: Plan) -> str | None:
    """Why ``--trace`` cannot run plan ``p``, or None when it can."""
    if p.strategy not in TRACEABLE:
        return f"--trace cannot run {p.strategy}; it traces {', '.join(TRACEABLE)}"
    if p.pp > 1 and (p.strategy != "pp" or p.tp > 1 or p.dp > 1):
        return "--trace runs pipeline parallelism alone (--strategy pp), not combined with tp or data parallelism"
    if p.tp > 1 and p.pp == 1 and p.strategy not in ("tp", "2d"):
        return (f"--trace runs tensor parallelism with --strategy tp or 2d, not {p.strategy} with --tp {p.tp} "
                f"(its script has no tensor parallelism; FSDP over TP is --strategy 2d)")
    if p.pp > 1 and p.schedule not in ("gpipe", "1f1b"):
        return f"--trace replays the gpipe and 1f1b schedules, not {p.schedule}"
    if p.accum > 1:
        return f"--trace traces one batch in one step, not {p.accum} micro-batches; --dry-run runs --grad-accum"
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m tools.estimate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="8b", help=f"model preset: {', '.join(PRESETS)} (default: 8b)")
    p.add_argument("--n-layers", type=int, default=None, help="override the preset's number of layers")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="override the vocabulary (default: 256 bytes; Llama 3's is 128256)")
    p.add_argument("--data", default=None, metavar="DIR",
                   help="a folder python -m tools.prepare_data wrote: the model takes its tokenizer's vocabulary, as the "
                        "training scripts do (default: --vocab-size, else the preset's 256 bytes)")
    p.add_argument("--world-size", type=int, default=1, help="number of GPUs (default: 1)")
    p.add_argument("--strategy", default="fsdp",
                   help=f"{', '.join(STRATEGIES)} (fsdp = fsdp_zero3), or 'all' for a table (default: fsdp)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default: 1; 'tp' uses the world size)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (default: 1; 'pp' uses the world size)")
    p.add_argument("--hsdp-shard", type=int, default=None, help="HSDP's shard group size (default: world / 2)")
    p.add_argument("--cp", type=int, default=None,
                   help="context-parallel degree of --strategy cp / cp_fsdp (default: the world size)")
    p.add_argument("--ep", type=int, default=None,
                   help="expert-parallel degree under --strategy ep (train_ep.py --ep; default: the world size)")
    p.add_argument("--batch", type=int, default=None, help="global batch in sequences (default: the world size)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per sequence (default: 2048, or the model's longest where that is shorter)")
    p.add_argument("--dtype", default="bf16", choices=("fp32", "bf16"), help="compute dtype (default: bf16 AMP)")
    p.add_argument("--ac", default="none", choices=AC_MODES,
                   help="activation checkpointing; selective-op also recomputes every second matmul (default: none)")
    p.add_argument("--loss-chunks", type=int, default=1, metavar="N",
                   help="the output layer and the loss in N chunks of tokens (train_ddp.py and train_fsdp.py "
                        "--loss-chunks; default: 1, the plain loss)")
    p.add_argument("--split-root-unit", action="store_true",
                   help="FSDP: the embedding and the head in units of their own (train_fsdp.py --split-root-unit)")
    p.add_argument("--expandable-segments", action="store_true",
                   help="--dry-run on CUDA: the allocator's expandable segments (the scripts' --expandable-segments); "
                        "what is allocated is the same, what is reserved comes closer to it")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="whose kernels the formulas assume: attention's saved tensors and AdamW's "
                        "temporaries differ (default: cuda)")
    p.add_argument("--grad-accum", type=int, default=1, metavar="K",
                   help="gradient accumulation: K micro-batches a step, as the scripts' --grad-accum (default: 1; "
                        "a pipeline's micro-batches are --microbatches)")
    p.add_argument("--microbatches", type=int, default=None, help="pipeline micro-batches (default: pp)")
    p.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "interleaved1f1b", "zbv", "dualpipev"))
    p.add_argument("--sequence-parallel", action="store_true", help="sequence parallelism with tp")
    p.add_argument("--gpu-mem", type=float, default=H100_80GB_GIB,
                   help=f"memory one GPU reports, in GiB (default: {H100_80GB_GIB:g}, an 80 GB H100)")
    p.add_argument("--headroom", type=float, default=HEADROOM_GIB,
                   help=f"GiB kept back for the CUDA context, NCCL's buffers and allocator fragmentation; "
                        f"fits = peak <= gpu-mem - headroom (default: {HEADROOM_GIB:g})")
    p.add_argument("--dry-run", action="store_true",
                   help="also run rank 0 of the layout for real, alone (the step-3 script with --fake-world-size), "
                        "on --device: its measured bytes beside the formula's")
    p.add_argument("--trace", action="store_true",
                   help="also trace a real step under FakeTensorMode and a fake process group (rank 0; "
                        "under --strategy pp the fullest stage)")
    return p


def check(args) -> None:
    if args.model not in PRESETS:
        raise UserError(f"unknown --model {args.model!r}; choose one of {', '.join(PRESETS)}.")
    default_seq_len(args)
    strategy = ALIASES.get(args.strategy, args.strategy)
    if strategy != "all" and strategy not in STRATEGIES:
        raise UserError(f"unknown --strategy {args.strategy!r}; choose one of {', '.join(STRATEGIES)}, fsdp or all.")
    for flag in ("world_size", "tp", "pp", "seq_len"):
        if getattr(args, flag) <= 0:
            raise UserError(f"--{flag.replace('_', '-')} must be positive (got {getattr(args, flag)}).")
    if not args.gpu_mem > 0:
        raise UserError(f"--gpu-mem must be a positive number of GiB (got {args.gpu_mem:g}).")
    if not 0 <= args.headroom < args.gpu_mem:
        raise UserError(f"--headroom must be at least 0 and less than --gpu-mem {args.gpu_mem:g} GiB "
                        f"(got {args.headroom:g}).")
    if args.world_size % (args.tp * args.pp):
        raise UserError(f"--world-size {args.world_size} is not divisible by --tp {args.tp} x --pp {args.pp}; "
                        f"use a world size that is a multiple of {args.tp * args.pp}.")
    for d in ("tp", "pp"):  # train_tp.py and train_pp.py run their degree over every rank
        if strategy == d and getattr(args, d) not in (1, args.world_size):
            raise UserError(f"--strategy {d} runs {d} over every rank (train_{d}.py): give --{d} {args.world_size} "
                            f"or leave it out; {d} with data parallelism is --strategy 2d.")
    if args.sequence_parallel and not (strategy == "tp" or (strategy == "2d" and args.pp == 1)):
        raise UserError(f"--sequence-parallel is TP's (train_tp.py, train_2d.py); --strategy {strategy}"
                        + (" with --pp" if strategy == "2d" else "") + " runs no sequence parallelism: drop it.")
    # a degree only the script of another strategy runs (train_cp.py's own sentence comes later)
    takes = {"tp": ("tp",), "pp": ("pp",), "2d": ("tp", "pp")}.get(strategy, ())
    extra = [f"--{d} {getattr(args, d)}" for d in ("tp", "pp") if getattr(args, d) > 1 and d not in takes]
    if extra and strategy not in ("all", "cp", "cp_fsdp"):
        raise UserError(f"--strategy {strategy} with {' '.join(extra)}: no script runs that layout; tensor "
                        f"parallelism is --strategy tp, a pipeline --strategy pp, and FSDP with either (both: "
                        f"train_3d.py) --strategy 2d.")
    if args.batch is not None and args.batch <= 0:
        raise UserError(f"--batch must be positive (got {args.batch}).")
    # Zero or negative is a mistake to name, not a "use the default" (``x or default`` would take it).
    if args.grad_accum <= 0:
        raise UserError(f"--grad-accum must be positive (got {args.grad_accum}); 1 is no accumulation.")
    if args.grad_accum > 1 and (args.pp > 1 or ALIASES.get(args.strategy, args.strategy) == "pp"):
        raise UserError("--grad-accum with --pp: a pipeline's micro-batches already are gradient accumulation; "
                        "give --microbatches instead.")
    for flag in ("n_layers", "hsdp_shard", "microbatches", "cp"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            raise UserError(f"--{flag.replace('_', '-')} must be positive (got {getattr(args, flag)}).")
    for flag in ("gpu_mem", "headroom"):
        if not math.isfinite(getattr(args, flag)):
            raise UserError(f"--{flag.replace('_', '-')} must be a finite number of GiB (got {getattr(args, flag)}).")
    if args.loss_chunks < 1:
        raise UserError(f"--loss-chunks must be positive (got {args.loss_chunks}); 1 is the plain loss.")
    if strategy != "all" and args.loss_chunks > 1 and strategy not in HEAD_LOSS_STRATEGIES:
        raise UserError(f"--loss-chunks: the {strategy} script computes its loss on logits it holds; the chunked "
                        f"loss is offered under {', '.join(HEAD_LOSS_STRATEGIES)} (train_ddp.py, train_fsdp.py).")
    if strategy != "all" and args.split_root_unit and not strategy.startswith(("fsdp", "hsdp")):
        raise UserError(f"--split-root-unit places FSDP's units (train_fsdp.py); {strategy} has none: drop it.")
    if args.vocab_size is not None and not 2 <= args.vocab_size <= 2**31 - 1:
        raise UserError(f"--vocab-size must be between 2 and 2**31 - 1 (got {args.vocab_size}).")
    take_vocab(args)  # --data DIR: its tokenizer's vocabulary
    model_config(args)


def default_seq_len(args, usual: int = 2048) -> None:
    """--seq-len when none is given: 2048, or the model's longest where that is shorter (the
    tutorial's small model takes 1024); a length given is held to the model (model_config)."""
    if args.seq_len is None:
        args.seq_len = min(usual, get_config(args.model).max_seq_len)


def model_config(args):
    """The model of --model, --n-layers and --vocab-size, refused in one sentence when no such
    model exists or --seq-len is longer than it supports (the estimator's and the planner's)."""
    try:
        cfg = get_config(args.model, n_layers=args.n_layers, vocab_size=args.vocab_size)
    except ValueError as e:
        raise UserError(str(e)) from None
    if args.seq_len > cfg.max_seq_len:
        raise UserError(f"--seq-len {args.seq_len} is longer than model {args.model!r} supports ({cfg.max_seq_len}).")
    return cfg


def check_layouts(ps) -> None:
    """Refuse a layout no script runs, with the sentence that script would give: the
    scripts' own checks (the HSDP mesh of train_fsdp.py, check_tp, check_pp), not copies."""
    from common.distributed import check_mesh
    from common.parallelize.pp import check_pp
    from common.parallelize.tp import check_tp
    for p in ps:
        if p.strategy.startswith("hsdp"):
            check_mesh((max(1, p.world // p.shard), p.shard), ("replicate", "shard"), p.world,
                       launched="are in --world-size")
        if p.tp > 1:
            check_tp(p.cfg, p.tp, p.seq_len, p.sequence_parallel)
        if p.pp > 1:
            check_pp(p.cfg, p.pp, p.schedule, p.microbatches or p.pp, max(1, p.batch // p.dp))
        if p.strategy in ("cp", "cp_fsdp"):  # train_cp.py's checks (load-balanced, its default)
            from common.parallelize.cp import check_cp
            if p.tp > 1 or p.pp > 1:
                raise UserError("train_cp.py splits the ranks into data-parallel groups of context-parallel ranks, "
                                "nothing else; drop --tp and --pp with --strategy cp.")
            cp = p.cp or p.world
            if p.world % cp:
                raise UserError(f"--cp {cp} does not divide --world-size {p.world} into data-parallel groups; use a "
                                f"divisor of {p.world}.")
            check_cp(p.cfg, cp, p.seq_len, load_balance=True, ac=p.ac)
            if p.batch % (p.world // cp):
                raise UserError(f"--batch {p.batch} does not split over {p.world // cp} data-parallel groups; use a "
                                f"multiple of that.")
            continue
        m = p.microbatches or p.pp if p.pp > 1 else p.accum
        if p.batch % max(1, p.dp) or (p.batch // max(1, p.dp)) % m:
            raise UserError(f"--batch {p.batch} does not split over {p.dp} data-parallel ranks"
                            + (f" and {m} micro-batches" if m > 1 else "") + "; use a multiple of that.")


def check_moe_layouts(ps, model: str) -> None:
    """Expert parallelism's layouts (check_ep, train_ep.py's check) and mixture-of-experts
    presets under the strategies that cannot train them (cli's sentence)."""
    from common import cli
    from common.parallelize.ep import check_ep
    for p in ps:
        if p.strategy == "ep":
            check_ep(p.cfg, model, p.ep or p.world, p.world)
        elif p.cfg.n_experts and p.strategy != "single":
            # (refused in the words of the script that trains the layout: common/layouts.py)
            raise UserError(cli.moe_unsupported(model, os.path.basename(layouts.script_of(p))))


def plans(args) -> list[Plan]:
    """The configurations to estimate: one, or with --strategy all every one the world size allows."""
    cfg = get_config(args.model, n_layers=args.n_layers, vocab_size=args.vocab_size)
    w = args.world_size
    batch = args.batch or w
    common = dict(world=w, batch=batch, seq_len=args.seq_len, dtype=args.dtype, ac=args.ac, device=args.device,
                  accum=args.grad_accum,
                  microbatches=args.microbatches, schedule=args.schedule, sequence_parallel=args.sequence_parallel)
    strategy = ALIASES.get(args.strategy, args.strategy)
    if strategy != "all":
        shard = args.hsdp_shard or (max(1, w // 2) if strategy.startswith("hsdp") else None)
        return [Plan(cfg, strategy, tp=args.tp, pp=args.pp, shard=shard, cp=args.cp, **common,
                     loss_chunks=args.loss_chunks, split_root=args.split_root_unit,
                     **({"ep": args.ep} if strategy == "ep" else {}))]
    return [with_savers(p, args) for p in all_plans(args, cfg, common)]


def with_savers(p: Plan, args) -> Plan:
    """--loss-chunks and --split-root-unit where the layout's script offers them (the table's rows)."""
    from dataclasses import replace
    return replace(p, loss_chunks=args.loss_chunks if p.head_loss else 1,
                   split_root=args.split_root_unit and p.strategy.startswith(("fsdp", "hsdp")))


def all_plans(args, cfg, common) -> list[Plan]:
    """--strategy all: every layout the world size allows."""
    w, batch = args.world_size, args.batch or args.world_size
    out = [Plan(cfg, "single", **(common | {"world": 1, "batch": max(1, batch // w)}))]
    if cfg.n_experts:  # a mixture of experts: one device, or the experts spread over the ranks
        out += [Plan(cfg, "ep", **common)] if w > 1 and cfg.n_experts % w == 0 else []
        return [p for p in out if p.batch % max(1, p.dp) == 0]
    if w > 1:
        out += [Plan(cfg, s, **common) for s in ("ddp", "zero1", "fsdp_zero2", "fsdp_zero3")]
        if w % 2 == 0 and w > 2:
            out.append(Plan(cfg, "hsdp", shard=w // 2, **common))
        tp = 2 if w % 2 == 0 else w
        if cfg.n_heads % w == 0 and cfg.n_kv_heads % w == 0:
            out.append(Plan(cfg, "tp", **common))
        if cfg.n_layers >= w and batch % w == 0:
            # (its micro-batches are its accumulation: --microbatches, not --grad-accum)
            out.append(Plan(cfg, "pp", **(common | {"microbatches": args.microbatches or w, "accum": 1})))
        if w > 2 and w % 2 == 0:
            out.append(Plan(cfg, "2d", tp=tp, **common))
    return [p for p in out if p.batch % max(1, p.dp) == 0]


def label(p: Plan) -> str:
    if p.strategy == "single":
        return "single device"
    deg = {"tp": f" tp={p.tp}", "pp": f" pp={p.pp} m={p.microbatches or p.pp} {p.schedule}",
           "2d": f" dp={p.dp} x tp={p.tp}" + (f" x pp={p.pp} m={p.microbatches or p.pp} {p.schedule}" if p.pp > 1 else ""), "cp": f" cp={p.cp or p.world}", "cp_fsdp": f" cp={p.cp or p.world}",
           "ep": f" ep={p.ep or p.world} (dense part fsdp)", "hsdp": f" {p.dp // (p.shard or p.dp)}x{p.shard}"}.get(
               "hsdp" if p.strategy.startswith("hsdp") else p.strategy, "")
    extra = f" (tp={p.tp} pp={p.pp})" if p.strategy not in ("tp", "pp", "2d") and (p.tp > 1 or p.pp > 1) else ""
    return f"{p.strategy}{deg}{extra} on {p.world}"


def worst_rank(p: Plan) -> dict:
    """The rank with the highest predicted peak (ranks differ under PP and uneven FSDP chunks)."""
    ranks = range(p.world) if p.pp > 1 else [0]
    return max((dict(predict(p, r), rank=r) for r in ranks), key=lambda x: x["peak"])


# ---- tracing under fake tensors -----------------------------------------------------------------
_TRACED: dict[str, dict] = {}  # repr((plan, rank)) -> trace: a plan is traced once per process


def trace(p: Plan, rank: int | None = None) -> dict:
    """One rank's memory by category in one real training step of plan ``p``, traced without
    allocating: rank 0, or under pipeline parallelism ``rank`` (default: the rank the
    formulas find fullest; the result's ``rank``). One steady step is measured: AdamW's
    state is made before it, as a first step would make it (``_adamw_state``). The trace is deterministic: a process that
    asks again for the same plan (the README's 8B table and its test, say) gets a copy."""
    import copy
    key = repr((p, rank))
    if key not in _TRACED:
        _TRACED[key] = _trace(p, rank)
    return copy.deepcopy(_TRACED[key])


def _trace(p: Plan, rank: int | None) -> dict:
    import torch
    import torch.nn.functional as F

    if why := traceable(p):
        raise UserError(f"{why}; drop --trace for the formula alone.")
    with fake_build(p, rank) as (model, optimizer, rank):
        optimizer = _plan_kernels(p, optimizer)
        out = _trace_stage(p, rank, model, optimizer, torch, F) if p.pp > 1 else \
            _trace_step(p, model, optimizer, torch, F)
    return dict(out, rank=rank)


@contextlib.contextmanager
def fake_build(p: Plan, rank: int | None = None):
    """Plan ``p``'s model (under PP, stage ``rank``'s: by default the rank the formulas find
    fullest) and AdamW, built by the layout's own script (common/layouts.py: its flags, its
    ``build``) on fake tensors, on a fake process group of ``p.world`` ranks. Yields (model,
    optimizer, rank); tests/test_layouts.py holds it equal to what the script builds."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from common.distributed import Dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=p.world)
    try:
        module, args = layouts.build_module(p), trace_args(p)
        ctx = Dist(0, p.world, 0, torch.device("cpu"), "fake", launched=False, fake=True)
        mesh = _mesh(p, ctx)  # before faking: building a mesh reads real tensors
        with FakeTensorMode(allow_non_fake_inputs=True), _real_meshes(), _traceable_build(module):
            if p.pp > 1:
                rank = worst_rank(p)["rank"] if rank is None else rank
                models, optimizer = module.build(args, ctx, [rank], p.pp)  # one stage per rank
                yield models[0], optimizer, rank
            else:
                model, optimizer = module.build(args, ctx, mesh)
                yield model, optimizer, 0
    finally:
        if created:
            dist.destroy_process_group()


def trace_args(p: Plan):
    """The flags the layout's script parses for plan ``p`` (common/layouts.py), on the CPU, with
    the plan's model, the AdamW kernels it names, and no check of this machine (nothing is
    allocated and nothing written: common/cli.py's ``for_a_trace``)."""
    import torch

    from common import cli
    extra = [*layouts.model_flags(p.cfg), "--device", "cpu", "--data", "synthetic"]
    extra += ["--fused-adamw"] if p.optimizer == "fused" else []
    with cli.for_a_trace():
        args = layouts.build_args(p, extra)
    cli.check_memory_savers(args, torch.device("cpu"), dp_size=None, fp16=False)  # (as each script's main: args.amp_dtype)
    args.model_config = p.cfg  # (the same config: model_flags names its preset, layers and vocabulary)
    return args


def _plan_kernels(p: Plan, optimizer):
    """The plan's AdamW kernels (``Plan.optimizer``: CUDA's foreach by default for --device cuda,
    the CPU's one-tensor loop for cpu), whatever this process would pick: the foreach step's
    temporaries are then traced where the formula counts them. The groups are the build's
    (one per kind of parameter, common/training.py), so foreach never mixes DTensors and
    plain tensors. AdamW's state is made first (``_adamw_state``): the traced step is a
    steady one."""
    import torch
    for group in optimizer.param_groups:
        if not group.get("fused"):
            group["foreach"] = p.optimizer == "foreach"
    if p.strategy not in ("cp", "cp_fsdp"):  # (CP's trace takes a first step of its own: _trace_step)
        _adamw_state(optimizer, torch, set_to_none=p.strategy != "ddp")
    return optimizer


@contextlib.contextmanager
def _traceable_build(module):
    """What the script's build needs to run under fake tensors:

    - DDP itself cannot be faked: its C++ Reducer checks and buckets real storage. One DDP
      replica holds exactly what one device holds at batch / W (its gradients are views of
      the buckets, which the trace keeps between steps instead of freeing them), so the build
      runs with DDP's wrapper, and the comm hook it registers, left out.
    - A model built on the meta device is built with real meta tensors. A fake one could not
      be materialised: ``to_empty`` swaps a fake parameter for its storage in place, which
      PyTorch refuses ("it has a weakref associated with it"); a real meta parameter is
      replaced by a fake one on the CPU, as a real run replaces it by real storage.
    """
    from unittest import mock

    from torch._subclasses.fake_tensor import unset_fake_temporarily

    import common.model
    import common.parallelize.pp
    from common.parallelize import comm_hooks
    from common.model import Transformer

    def on_real_meta(*args, **kwargs):
        with unset_fake_temporarily():  # (the script's torch.device("meta") still applies)
            return Transformer(*args, **kwargs)

    with contextlib.ExitStack() as stack:
        for owner in (module, common.model, common.parallelize.pp):
            if hasattr(owner, "Transformer"):
                stack.enter_context(mock.patch.object(owner, "Transformer", on_real_meta))
        if hasattr(module, "DDP"):
            stack.enter_context(mock.patch.object(module, "DDP", lambda model, **kwargs: model))
        for owner in (module, comm_hooks):
            if hasattr(owner, "register_comm_hook"):
                stack.enter_context(mock.patch.object(owner, "register_comm_hook", lambda *a, **k: None))
        yield


@contextlib.contextmanager
def _real_meshes():
    """Device meshes built while tracing (FSDP over TP joins its dp and tp meshes into one)
    compute their ranks' coordinates from a small integer tensor; under FakeTensorMode that
    tensor would be fake and the lookup data-dependent, so meshes are built with real ones."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh
    init = DeviceMesh.__init__

    def real_init(self, *args, **kwargs):
        with unset_fake_temporarily():
            init(self, *args, **kwargs)

    DeviceMesh.__init__ = real_init
    try:
        yield
    finally:
        DeviceMesh.__init__ = init


def _trace_stage(p: Plan, rank: int, model, optimizer, torch, F) -> dict:
    """Pipeline stage ``rank`` of plan ``p`` (one stage per rank, as train_pp.py's build makes
    it: AC and autocast on its forward): its forwards and backwards in the schedule's order.
    Its inputs, unless it is the first stage, and the gradients of its outputs, unless it is
    the last, are fake tensors of the shapes its neighbours send."""
    from common.measure.memory import MemoryTracer
    from common.parallelize.pp import schedule_order

    tracer = MemoryTracer(model, optimizer, torch.device("cpu"), start=0, steps=1, count_allocator=False)
    m = p.microbatches or p.pp
    first, last = rank == 0, rank == p.pp - 1
    shape = (p.batch // m, p.seq_len)
    with tracer.record(0):
        in_flight = {}
        for kind, i in schedule_order(p.schedule, p.pp, m)[rank]:
            if kind == "F":
                x = (torch.randint(0, p.cfg.vocab_size, shape) if first
                     else torch.randn(*shape, p.cfg.dim, requires_grad=True))  # the residual stream, fp32
                out = model(x)  # (an autocast region per forward: each micro-batch keeps its own bf16 copies)
                if last:  # the loss of this micro-batch, scaled as the schedule scales it
                    out = F.cross_entropy(out.flatten(0, 1).float(), torch.randint(
                        0, p.cfg.vocab_size, shape).flatten()) / m
                in_flight[i] = out
            else:
                out = in_flight.pop(i)
                out.backward(None if last else torch.empty_like(out))  # the next stage's gradient
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return _traced(tracer)


def _adamw_state(optimizer, torch, set_to_none: bool):
    """AdamW's state, made as its first step makes it (two moments of each parameter's shape,
    placement and dtype, and a step count), from zero gradients instead of a forward and
    backward: the traced step is then a steady one, as the second of two would be, for half
    the tracing. The gradients go as the script's zero_grad leaves them (DDP's and CP's stay,
    zeroed in their buckets, which a steady step starts with)."""
    for group in optimizer.param_groups:
        for q in group["params"]:
            q.grad = torch.zeros_like(q)
    optimizer.step()
    optimizer.zero_grad(set_to_none=set_to_none)


def _mesh(p: Plan, ctx):
    """The mesh each script's main builds for its layout and hands to its build."""
    if p.strategy in ("cp", "cp_fsdp"):  # train_cp.py's (dp, cp) mesh, and the one its build asks for
        cp = p.cp or p.world
        ctx.mesh((p.world,), ("dp_cp",))  # (made here, outside the fake mode; the build finds it made)
        return ctx.mesh((p.world // cp, cp), ("dp", "cp"))
    if p.strategy == "tp":
        return ctx.mesh((p.world,), ("tp",))
    if p.strategy == "2d":
        return ctx.mesh((p.dp, p.tp), ("dp", "tp"))
    if p.strategy.startswith("hsdp"):
        return ctx.mesh((p.world // p.shard, p.shard), ("replicate", "shard"))
    return ctx.mesh() if p.pp == 1 else None


def _trace_step(p: Plan, model, optimizer, torch, F) -> dict:
    """One steady step of the model ``model`` its script built, as its script's loop runs it."""
    from common.measure.memory import MemoryTracer
    from common.parallelize.fsdp import trace_fsdp_memory

    device = torch.device("cpu")
    cp = p.strategy in ("cp", "cp_fsdp")
    fsdp = p.strategy.startswith(("fsdp", "hsdp")) or p.strategy in ("2d", "cp_fsdp")
    # CP's ring builds small masks at its first forward and keeps them, which a steady step
    # starts with: it takes a first step, untraced; every other layout starts steady at once
    first = 1 if cp else 0
    tracer = MemoryTracer(model, optimizer, device, start=first, steps=1, count_allocator=False)
    if fsdp:
        trace_fsdp_memory(tracer, model)
    # autocast is the bf16 recipe of one device, DDP, TP and CP; FSDP's is its MixedPrecisionPolicy
    amp = p.dtype == "bf16" and not fsdp
    seqs = p.batch // (p.world // (p.cp or p.world) if cp else p.dp)
    loss_ctx = contextlib.nullcontext
    if p.strategy in ("tp", "2d"):
        from torch.distributed.tensor.parallel import loss_parallel
        loss_ctx = loss_parallel
    for step in range(first + 1):
        with tracer.record(step):
            x = torch.randint(0, p.cfg.vocab_size, (seqs, p.seq_len), device=device)
            y = torch.randint(0, p.cfg.vocab_size, (seqs, p.seq_len), device=device)
            if cp:  # this rank's slice of every sequence
                from common.parallelize.cp import local_tokens
                x, y = local_tokens(x, model.cp_ring), local_tokens(y, model.cp_ring)
            if p.head_loss:  # the script asks the model for the loss (train_ddp.py, train_fsdp.py: --loss-chunks)
                with torch.autocast("cpu", torch.bfloat16, enabled=amp):
                    loss = model(x, targets=y)
                loss.backward()
            else:  # the script holds the logits (under TP split over the vocabulary)
                with torch.autocast("cpu", torch.bfloat16, enabled=amp):
                    logits = model(x)
                with loss_ctx():
                    loss = F.cross_entropy(logits.flatten(0, 1).float() if amp or cp else logits.flatten(0, 1),
                                           y.flatten())
                    loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=p.strategy not in ("ddp", "cp"))
    return _traced(tracer)


def _traced(tracer) -> dict:
    """The traced step's bytes by category: model state before the optimizer step (AdamW's
    state exists by then), activations, temporaries and the peak."""
    r = tracer.result
    state = r["before_optimizer"] or r["peak_by_category"]
    return {**{c: state[c] for c in CATEGORIES[:3]}, "activations": r["peak_by_category"]["activations"],
            "other": r["peak_by_category"]["other"], "peak": r["peak_bytes"], "at_peak": r["at_peak"]}


# ---- a dry run: the layout's own script, one rank, real tensors ---------------------------------
def dry_run_command(p: Plan, args) -> list[str]:
    """The command that runs rank 0 of plan ``p`` alone: what a learner would type."""
    if p.world < 2:
        raise UserError("--dry-run plays one rank of a multi-rank layout; with --world-size 1 there is none: "
                        "run the step-2 script itself.")
    if p.strategy == "single" or (p.pp > 1 and p.strategy == "pp" and (p.tp > 1 or p.dp > 1)):
        raise UserError(f"--dry-run runs the layouts the step-3 scripts run with --fake-world-size (ddp, zero1, "
                        f"fsdp, hsdp, hsdp_zero2, tp, 2d, 3-D as 2d with --pp, pp alone, cp, cp_fsdp, ep), not "
                        f"{label(p)}.")
    extra = layouts.layout_flags(p)
    if p.pp > 1:  # the rank the formulas find fullest (the first, under 1F1B)
        extra += ["--fake-rank", str(worst_rank(p)["rank"])]
    if getattr(args, "expandable_segments", False):
        extra.append("--expandable-segments")
    model = ["--model", args.model] + (["--n-layers", str(args.n_layers)] if args.n_layers else [])
    model += ["--vocab-size", str(args.vocab_size)] if args.vocab_size else []
    return [layouts.script_of(p), *model, *extra, "--device", p.device, "--data", "synthetic", "--steps", "3",
            "--trace-steps", "1", "--eval-batches", "0", "--fake-world-size", str(p.world)]


def dry_run(p: Plan, args) -> dict:
    """Rank 0 of plan ``p`` run by its script alone; its bytes by category (model state when the
    optimizer step begins, activations and temporaries at the peak, as the trace reports them)."""
    import json
    import subprocess
    import tempfile

    import torch
    cmd = [sys.executable, *dry_run_command(p, args)]
    if p.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--dry-run --device cuda needs a GPU on this machine; pass --device cpu to run the rank "
                        "on the CPU (its kernels save a little more for attention).")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    with tempfile.TemporaryDirectory() as out:
        cmd += ["--out", out]
        r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            why = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise UserError(f"the dry run ({' '.join(cmd[1:-2])}) stopped: {why}")
        s = json.loads((Path(out) / "summary.json").read_text())
    (mem,), (pred,) = s["memory"], s["predicted"]["per_rank"]
    return {**{c: pred[f"measured {c}"] for c in CATEGORIES[:4]}, "other": mem["peak_by_category"]["other"],
            "peak": mem["peak_bytes"], "rank": mem["rank"], "script": cmd[1], "device_name": s["device_name"],
            "allocator_peak": mem.get("allocator_peak_bytes"), "allocator_reserved": mem.get("allocator_reserved_bytes"),
            "allocator_unseen": mem.get("allocator_unseen_at_peak"),
            "comm": {k: v["bytes"] for k, v in s["comm"][0].items()}}


# ---- output -------------------------------------------------------------------------------------
UNIT = [GiB, "GiB"]


def usable_bytes(gpu_mem: float, headroom: float) -> float:
    """What a training step may use of a GPU that reports ``gpu_mem`` GiB."""
    return (gpu_mem - headroom) * GiB


def memory_text(gpu_mem: float, headroom: float) -> str:
    return f"{gpu_mem - headroom:g} GiB usable ({gpu_mem:g} GiB less {headroom:g} GiB headroom)"


def gib(n: float) -> str:
    return f"{n / UNIT[0]:,.2f}"


def _unit(peak: float):
    UNIT[:] = [GiB, "GiB"] if peak >= GiB / 4 else [2**20, "MiB"]


def gpu_text(gpu_mem: float) -> str:
    """The GPU an answer assumes (--gpu-mem; its default is an 80 GB H100)."""
    return f"an 80 GB H100 ({gpu_mem:g} GiB)" if gpu_mem == H100_80GB_GIB else f"a {gpu_mem:g} GiB GPU"


def header(p: Plan, gpu_mem: float) -> str:
    """The first line of a one-layout answer: what it assumed (batch, sequence, GPU; the
    scripts' own defaults are smaller) and whose rank it shows. Printed before a trace or a dry
    run starts, so the wait says what it is for."""
    est = worst_rank(p)
    _unit(est["peak"])
    return (f"{label(p)}: {p.cfg.n_layers} layers, batch {p.batch} x {p.seq_len} tokens"
            + (f" in {p.accum} micro-batches" if p.accum > 1 else "") + f", {p.dtype}, AC {p.ac}, "
            f"{p.device} kernels, on {gpu_text(gpu_mem)}; rank {est['rank']}, {UNIT[1]}")


def print_one(p: Plan, gpu_mem: float, headroom: float, traced: dict | None, dry: dict | None = None):
    """The rows of a one-layout answer (``header`` printed its first line)."""
    est = worst_rank(p)
    _unit(est["peak"])
    measured = [(name, m) for name, m in (("trace", traced), ("dry run", dry)) if m]
    rows = [(c, est[c], [m[c] for _, m in measured]) for c in CATEGORIES]
    rows += [(k, v, [None] * len(measured)) for k, v in est["transient"].items()]
    if est["optimizer temporaries"]:
        rows.append((f"AdamW temporaries ({p.optimizer})", est["optimizer temporaries"], [None] * len(measured)))
    if measured:
        rows.append(("other (measured: temporaries)", None, [m["other"] for _, m in measured]))
    for k in (FORWARD_GATHER, SPLIT_LOSS_FORWARD, SPLIT_HEAD_REDUCE):
        if est["peak_at"] == k:  # a moment of FSDP's own: what it adds to the shards and the state
            rows.append((f"  at peak: {k}", est[k], [None] * len(measured)))
    root = est.get(ROOT_REDUCE, {})
    if est["peak_at"] == "end of backward" and est["peak"] == est["parameters"] + est["optimizer state"] + sum(root.values()):
        # the peak is that moment: say what is alive in it besides the shards and AdamW's state
        rows += [(f"  at peak: {k}", v, [None] * len(measured)) for k, v in root.items()]
    rows.append((f"peak ({est['peak_at']})", est["peak"], [m["peak"] for _, m in measured]))
    w = max(len(r[0]) for r in rows)
    print(f"  {'':<{w}}  {'formula':>10}" + "".join(f"  {name:>10}  {name + '/formula':>17}" for name, _ in measured))
    for name, f, ms in rows:
        line = f"  {name:<{w}}  {gib(f) if f is not None else '':>10}"
        for m in ms:
            line += f"  {gib(m) if m is not None else '':>10}"
            line += f"  {m / f:>17.3f}" if (m is not None and f) else f"  {'':>17}"
        print(line.rstrip())
    fits = est["peak"] <= usable_bytes(gpu_mem, headroom)
    print(f"  {'fits' if fits else 'does NOT fit'} in {memory_text(gpu_mem, headroom)} per GPU "
          f"(formula peak {fmt_bytes(est['peak'])}"
          + "".join(f", {name} peak {fmt_bytes(m['peak'])}" for name, m in measured) + ")")
    if traced and p.device == "cuda":  # the fake tensors run this machine's (CPU) kernels, which save a little more
        from dataclasses import replace
        cpu = predict(replace(p, device="cpu"), est["rank"])
        print(f"  the trace runs the CPU's kernels; the formula with them: activations {gib(cpu['activations'])}, "
              f"peak {gib(cpu['peak'])} {UNIT[1]} (trace/formula {traced['peak'] / cpu['peak']:.3f})")
    if dry and dry.get("allocator_peak") is not None:  # (a CPU's allocator reserves nothing beyond: no count)
        reserved = dry.get("allocator_reserved")
        unseen = dry.get("allocator_unseen") or {}
        ops = sorted((unseen.get("by_op") or {}).items(), key=lambda kv: -kv[1])[:2]
        print(f"  the dry run's allocator: peak {fmt_bytes(dry['allocator_peak'])} allocated"
              + (f", {fmt_bytes(reserved)} reserved" if reserved is not None else "")
              + (f"; {fmt_bytes(unseen['bytes'])} of it in blocks no op handed the trace ("
                 + ", ".join(f"{op} {fmt_bytes(b)}" for op, b in ops) + ")" if unseen.get("bytes") else ""))
    if saved := saver_savings(p, est["rank"]):
        print("  the savers' share of the formula's peak: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in saved.items()))
    sent = sum(v for k, v in est["comm"].items() if k != "recv")
    if est["comm"]:
        print("  sent per step per rank: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in est["comm"].items())
              + f" (total {fmt_bytes(sent)})")
    if dry:
        print("  the dry run's collectives per step: "
              + (", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(dry["comm"].items())) or "none"))


def saver_savings(p: Plan, rank: int = 0) -> dict[str, int]:
    """What each saver of plan ``p`` takes off the formula's peak: the peak with that one saver
    off, less the peak with all of them (--loss-chunks, --split-root-unit, --ac selective-op)."""
    from dataclasses import replace
    off = {}
    if p.loss_chunks > 1:
        off[f"--loss-chunks {p.loss_chunks}"] = replace(p, loss_chunks=1)
    if p.split_root:
        off["--split-root-unit"] = replace(p, split_root=False)
    if p.ac == "selective-op":
        off["--ac selective-op (not selective)"] = replace(p, ac="selective")
    peak = predict(p, rank)["peak"]
    return {k: predict(q, rank)["peak"] - peak for k, q in off.items()}


def print_table(ps: list[Plan], gpu_mem: float, headroom: float, traced: dict):
    p0, pn = ps[0], ps[-1]
    _unit(worst_rank(p0)["peak"])
    print(f"model: {p0.cfg.n_layers} layers, dim {p0.cfg.dim}, {_n_params(p0) / 1e9:.3f}B parameters; global batch "
          f"{pn.batch} x {p0.seq_len} tokens on {pn.world} GPUs ({p0.batch} on one), each {gpu_text(gpu_mem)}, "
          f"{p0.dtype}, AC {p0.ac}; "
          f"{UNIT[1]} per GPU on the fullest rank; fits = peak <= {memory_text(gpu_mem, headroom)}")
    head = ("| strategy | parameters | gradients | AdamW state | activations | transient | peak | peak at | fits | "
            "sent/step/rank |")
    if traced:
        head += " traced peak |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for p in ps:
        e = worst_rank(p)
        sent = sum(v for k, v in e["comm"].items() if k != "recv")
        line = (f"| {label(p)} | {gib(e['parameters'])} | {gib(e['gradients'])} | {gib(e['optimizer state'])} | "
                f"{gib(e['activations'])} | {gib(sum(e['transient'].values()))} | {gib(e['peak'])} | {e['peak_at']} | "
                f"{'yes' if e['peak'] <= usable_bytes(gpu_mem, headroom) else 'no'} | {fmt_bytes(sent)} |")
        if traced:
            t = traced.get(id(p))
            line += f" {gib(t['peak']) if isinstance(t, dict) else t} |"
        print(line)


def gpu_1b_comparison() -> str:
    """Markdown: the formulas beside what a GPU measured for the four 1b runs of
    ``gpu_1b_peaks``, the CUDA formula against the GPU and the CPU formula against this
    machine's tracer (a fake-tensor trace of the same step with CPU kernels: about 20 s)."""
    from common.model import get_config
    cfg = get_config("1b")
    rows = ["| 1b, batch 4 x 2048, one device | GPU | formula (cuda) | off | CPU trace | "
            "formula (cpu) | off | formula's peak (cuda / cpu) |", "|---|---|---|---|---|---|---|---|"]
    for (dtype, ac), (measured, how) in gpu_1b_peaks().items():
        cuda, cpu = (Plan(cfg, "single", batch=4, seq_len=2048, dtype=dtype, ac=ac, device=d) for d in ("cuda", "cpu"))
        fc, fp, t = predict(cuda), predict(cpu), trace(cpu)["peak"] / GiB
        name = {"none": dtype if dtype == "fp32" else "bf16 autocast"}.get(ac, f"bf16 + {ac} AC")
        rows.append(f"| {name} | {measured:.2f} GiB ({how}) | {fc['peak'] / GiB:.2f} GiB | "
                    f"{fc['peak'] / GiB / measured - 1:+.1%} | {t:.2f} GiB | {fp['peak'] / GiB:.2f} GiB | "
                    f"{fp['peak'] / GiB / t - 1:+.1%} | {fc['peak_at']} / {fp['peak_at']} |")
    return "\n".join(rows)


# torchtitan's Llama 3.1 8B on 8 H100s (96 GB): FSDP, local batch 2 x 8192, selective AC (its per-op
# policy), bf16; the max reserved memory it logs (benchmarks/llama3_h100_202412_torchtitan.md), GiB.
TORCHTITAN_8B_GIB = {"eager": 82.4, "compiled": 77.0}
TORCHTITAN_8B = ["--model", "8b", "--vocab-size", "128256", "--world-size", "8", "--strategy", "fsdp", "--batch",
                 "16", "--seq-len", "8192", "--dtype", "bf16", "--device", "cuda"]
TORCHTITAN_SAVERS = {"the layout alone": ["--ac", "selective"],
                     "+ chunked loss, own head unit": ["--ac", "selective", "--loss-chunks", "16", "--split-root-unit"],
                     "+ per-op selective AC": ["--ac", "selective-op", "--loss-chunks", "16", "--split-root-unit"]}


def torchtitan_comparison() -> str:
    """Markdown: rank 0 of torchtitan's 8B layout with our savers added one by one, the formula
    beside the fake-tensor trace (what is alive at the trace's peak, by category), against the
    memory torchtitan logs. Three traces of the whole model: about 90 s on two cores."""
    cols = []
    for name, flags in TORCHTITAN_SAVERS.items():
        args = build_parser().parse_args(TORCHTITAN_8B + flags)
        check(args)
        (p,) = plans(args)
        f, t = predict(p), trace(p)
        cols.append((name, " ".join(flags), f, t))
    def row(name, cells):
        return f"| {name} | " + " | ".join(cells) + " |"

    out = [row("rank 0 of 8, GiB", [f"{n}: formula" if i % 2 == 0 else "trace" for n, *_ in cols for i in (0, 1)]),
           "|---|" + "---:|" * 2 * len(cols),
           row("flags", [x for _, fl, *_ in cols for x in (f"`{fl}`", "")])]
    transient = []
    for *_, f, _ in cols:
        transient += [k for k in f["transient"] if k not in transient]
    for c in CATEGORIES:
        out.append(row(c, [x for *_, f, t in cols for x in (gib(f[c]), gib(t["at_peak"][c]))]))
    for k in transient:
        out.append(row(k, [x for *_, f, t in cols for x in (gib(f["transient"][k]) if k in f["transient"] else "", "")]))
    out.append(row("other (traced: temporaries, gathered blocks)", [x for *_, f, t in cols
                                                                     for x in ("", gib(t["at_peak"]["other"]))]))
    out.append(row("**peak**", [x for *_, f, t in cols for x in (
        f"**{gib(f['peak'])}** ({f['peak_at']})", f"**{gib(t['peak'])}** ({t['peak'] / f['peak'] - 1:+.1%})")]))
    tt = ", ".join(f"{v} GiB {k}" for k, v in TORCHTITAN_8B_GIB.items())
    return "\n".join(out) + f"\n\ntorchtitan logs {tt} (max reserved, its own per-op selective AC, plain loss)."


def _n_params(p: Plan) -> int:
    from common.model import count_params
    return count_params(p.cfg)


@main_guard
def main(argv=None):
    args = build_parser().parse_args(argv)
    check(args)
    ps = plans(args)
    if not ps:
        raise UserError(f"--batch {args.batch} does not split over the data-parallel ranks; use a multiple of "
                        f"{args.world_size}.")
    check_layouts(ps)
    check_moe_layouts(ps, args.model)
    if len(ps) == 1 and args.strategy != "all":
        print(header(ps[0], args.gpu_mem), flush=True)
        traced = None
        if args.trace and (why := DRY_TRACED.get(ps[0].strategy)):
            print(f"(--trace: {why}; the dry run stands in for the trace: rank 0 run for real, alone)")
            args.dry_run = True
        elif args.trace:
            t0 = time.perf_counter()
            traced = trace(ps[0])
            print(f"(traced rank {traced['rank']} under FakeTensorMode in {time.perf_counter() - t0:.1f} s)")
        dry = None
        if args.dry_run:
            t0 = time.perf_counter()
            dry = dry_run(ps[0], args)
            print(f"(dry run of rank {dry['rank']}: {dry['script']} --fake-world-size {ps[0].world} on "
                  f"{dry['device_name']} in {time.perf_counter() - t0:.1f} s"
                  + ("; like the formula, it assumes the router spreads the tokens evenly" if ps[0].strategy == "ep"
                     else "") + ")")
        print_one(ps[0], args.gpu_mem, args.headroom, traced, dry)
        return
    if args.dry_run:
        raise UserError("--dry-run runs one layout; pick it with --strategy (not 'all').")
    traced = {}
    if args.trace:
        for p in ps:
            traced[id(p)] = trace(p) if traceable(p) is None else "not traced"
    print_table(ps, args.gpu_mem, args.headroom, traced)


if __name__ == "__main__":
    sys.exit(main())
