"""Which layout, and how fast? Every layout our scripts run, the ones that fit, ranked by speed.

    python -m tools.plan --model 8b --gpus 32 --gpus-per-node 8 --gpu h100 --global-batch-size 64 --seq-len 8192
    python -m tools.plan --model 8b --gpus 8 --gpu h100 --global-batch-size 16 --seq-len 8192 --vocab-size 128256
    python -m tools.plan --torchtitan
    python -m tools.plan --calibrate --gpus 2 --model small --seq-len 128 --global-batch-size 8

For each layout of the step-3 scripts (DDP, ZeRO-1, FSDP, HSDP with and without resharding after
forward, TP with and without SP, the pipeline schedules at several micro-batch counts, 2-D, 3-D
under every schedule, and CP), under each activation
checkpointing mode, the planner asks common/measure/theory.py (tools.estimate's formulas)
for the fullest rank's peak memory and drops what does not fit the card, saying why; asks
common/measure/steptime.py how long a step takes; and prints the fastest few: memory, the
step split into compute, recompute, exposed communication, bubble and optimizer, tokens/s,
MFU, and the command that runs it.

``--gpu`` describes a machine from its spec sheets (common/measure/machines.py: GPUS); ``--calibrate`` measures
this one (our model's block rate on one compute unit, a CPU core, with the other units busy;
the optimizer's time a parameter and DTensor's a block; memory bandwidth; and, every rank at
once, the collectives' bandwidth and latency with the communication lab's benchmark code) and
saves it to runs/calibration.json, which ``--calibration`` then reads: the CPU can be planned
for too, its cores shared when the ranks outnumber them.
``--torchtitan`` predicts torchtitan's published Llama 3.1 8B runs and prints ours beside theirs.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file: find common/

from common.layouts import layout_flags, script_of  # noqa: E402
from common.errors import UserError, main_guard  # noqa: E402
from common.prepared import take_vocab  # noqa: E402
from common.measure.machines import GPUS, Machine, load_calibration  # noqa: E402
from common.measure.steptime import DISPATCH, SHARED, TERMS, step_time  # noqa: E402
from common.measure.plan import Plan  # noqa: E402
from common.model import PRESETS, count_params, get_config  # noqa: E402
from common.figure_file import save_figure  # noqa: E402
from tools.estimate import HEADROOM_GIB, check_layouts, default_seq_len, label, model_config, worst_rank  # noqa: E402

GiB = 2**30
ROOT = Path(__file__).resolve().parent.parent
CALIBRATION = ROOT / "runs" / "calibration.json"
AC_MODES = ("none", "selective", "selective-op", "full")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m tools.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="8b", help=f"model preset: {', '.join(PRESETS)} (default: 8b)")
    p.add_argument("--n-layers", type=int, default=None, help="override the preset's number of layers")
    p.add_argument("--vocab-size", type=int, default=None, help="override the vocabulary (Llama 3's: 128256)")
    p.add_argument("--data", default=None, metavar="DIR",
                   help="a folder python -m tools.prepare_data wrote: the model takes its tokenizer's vocabulary, and "
                        "the commands train on it (default: --vocab-size on synthetic tokens, else 256 bytes)")
    p.add_argument("--gpus", type=int, default=8, help="GPUs (ranks) in all (default: 8)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPUs a node: rings that leave a node run at the NICs' speed (default: --gpus, one node)")
    p.add_argument("--gpu", default="h100", help=f"the machine, from spec sheets: {', '.join(GPUS)} (default: h100)")
    p.add_argument("--calibration", default=None,
                   help="a machine measured by --calibrate (a calibration.json) instead of --gpu")
    p.add_argument("--global-batch-size", type=int, default=None,
                   help="sequences per optimizer step (default: the number of GPUs)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per sequence (default: 2048, or the model's longest where that is shorter)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"), help="compute dtype (default: bf16 AMP)")
    p.add_argument("--ac", default="all", choices=("all", *AC_MODES),
                   help="activation checkpointing modes to consider (default: all of them)")
    p.add_argument("--loss-chunks", type=int, default=1, metavar="N",
                   help="the loss in N chunks of tokens where the script offers it (train_ddp.py, train_fsdp.py; "
                        "default: 1, the plain loss)")
    p.add_argument("--split-root-unit", action="store_true",
                   help="FSDP layouts with the embedding and the head in units of their own (train_fsdp.py)")
    p.add_argument("--compile", action="store_true",
                   help="predict with torch.compile's achieved matmul rate (the scripts' --compile)")
    p.add_argument("--headroom", type=float, default=HEADROOM_GIB,
                   help=f"GiB kept back for the CUDA context, NCCL and fragmentation (default: {HEADROOM_GIB:g})")
    p.add_argument("--top", type=int, default=5, help="how many of the fastest layouts to show (default: 5)")
    p.add_argument("--show-dropped", action="store_true", help="list every dropped layout and why")
    p.add_argument("--torchtitan", action="store_true",
                   help="predict torchtitan's published Llama 3.1 8B runs and print ours beside theirs")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine with --gpus ranks at --model's shapes and save it (--out)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="what --calibrate measures (default: cpu)")
    p.add_argument("--out", default=str(CALIBRATION), help=f"where --calibrate saves (default: {CALIBRATION.relative_to(ROOT)})")
    p.add_argument("--calibrate-worker", action="store_true", help=argparse.SUPPRESS)
    # the per-rank shapes to time our block at, as JSON [[tp, sequences], ...] (tools/bench_plan.py)
    p.add_argument("--shapes", default=None, help=argparse.SUPPRESS)
    p.add_argument("--repeats", type=int, default=7, help=argparse.SUPPRESS)
    return p


def check(args) -> None:
    if args.model not in PRESETS:
        raise UserError(f"unknown --model {args.model!r}; choose one of {', '.join(PRESETS)}.")
    default_seq_len(args)
    if args.gpu not in GPUS:
        raise UserError(f"unknown --gpu {args.gpu!r}; choose one of {', '.join(GPUS)}, or measure this machine "
                        f"with --calibrate.")
    for flag in ("gpus", "seq_len", "top"):
        if getattr(args, flag) <= 0:
            raise UserError(f"--{flag.replace('_', '-')} must be positive (got {getattr(args, flag)}).")
    for flag in ("gpus_per_node", "global_batch_size", "n_layers"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            raise UserError(f"--{flag.replace('_', '-')} must be positive (got {getattr(args, flag)}).")
    g = args.gpus_per_node or args.gpus
    if args.gpus > g and args.gpus % g:
        raise UserError(f"--gpus {args.gpus} does not fill whole nodes of --gpus-per-node {g}; use a multiple "
                        f"of {g}.")
    if not 0 <= args.headroom < 1e6 or not math.isfinite(args.headroom):
        raise UserError(f"--headroom must be a finite number of GiB, at least 0 (got {args.headroom:g}).")
    if args.calibration and not Path(args.calibration).is_file():
        raise UserError(f"--calibration {args.calibration}: no such file; make it with python -m tools.plan "
                        f"--calibrate.")
    take_vocab(args)  # --data DIR: its tokenizer's vocabulary
    cfg = model_config(args)
    if cfg.n_experts:
        raise UserError(f"--model {args.model} is a mixture of experts; the planner covers dense models (plan "
                        f"expert parallelism with python -m tools.estimate --strategy ep).")


def machine_of(args) -> Machine:
    m = load_calibration(args.calibration) if args.calibration else GPUS[args.gpu]
    return replace(m, gpus_per_node=args.gpus_per_node or (m.gpus_per_node if args.calibration else args.gpus))


# ---- the layouts our scripts run ----------------------------------------------------------------
def divisors(n: int) -> list[int]:
    return [d for d in range(2, n + 1) if n % d == 0]


def layouts(cfg, world: int, per_node: int, batch: int, seq_len: int, dtype: str, device: str,
            acs=AC_MODES, loss_chunks: int = 1, split_root: bool = False) -> list[Plan]:
    """Every layout of the step-3 scripts on ``world`` ranks, under each AC mode in ``acs``;
    ``loss_chunks`` and ``split_root`` where the layout's script takes them (--loss-chunks:
    train_ddp.py and train_fsdp.py; --split-root-unit: train_fsdp.py)."""
    return [replace(p, loss_chunks=loss_chunks if p.head_loss else 1,
                    split_root=split_root and p.strategy.startswith(("fsdp", "hsdp")))
            for p in _layouts(cfg, world, per_node, batch, seq_len, dtype, device, acs)]


def _layouts(cfg, world: int, per_node: int, batch: int, seq_len: int, dtype: str, device: str,
             acs=AC_MODES) -> list[Plan]:
    from common.parallelize.pp import SCHEDULES
    out = []
    for ac in acs:
        c = dict(world=world, batch=batch, seq_len=seq_len, dtype=dtype, device=device, ac=ac)
        if world == 1:
            out.append(Plan(cfg, "single", **c))
            continue
        out += [Plan(cfg, s, **c) for s in ("ddp", "zero1", "fsdp_zero2", "fsdp_zero3")]
        for shard in divisors(world)[:-1]:  # HSDP: shard inside a node, replicate across (or in) nodes
            if shard <= per_node:  # (hsdp_zero2: --no-reshard-after-forward)
                out += [Plan(cfg, s, shard=shard, **c) for s in ("hsdp", "hsdp_zero2")]
        for sp in (False, True):
            out.append(Plan(cfg, "tp", sequence_parallel=sp, **c))
            out += [Plan(cfg, "2d", tp=tp, sequence_parallel=sp, **c) for tp in divisors(world)[:-1] if tp <= per_node]
        for schedule in SCHEDULES:  # train_pp.py: every rank a stage
            out += [Plan(cfg, "pp", schedule=schedule, microbatches=m, **c) for m in (world, 2 * world, 4 * world)]
        for pp in divisors(world)[:-1]:  # train_3d.py: pp x dp x tp, every schedule
            for tp in divisors(world // pp):
                if tp <= per_node and world // pp // tp > 1:
                    out += [Plan(cfg, "2d", pp=pp, tp=tp, schedule=schedule, microbatches=m, **c)
                            for schedule in SCHEDULES for m in (pp, 2 * pp)]
        for cp in divisors(world):  # train_cp.py: dp groups of cp ranks, DDP or FSDP over every rank
            out += [Plan(cfg, s, cp=cp, **c) for s in ("cp", "cp_fsdp")]
    return out


def runnable(p: Plan, compiled: bool) -> str | None:
    """Why no script runs ``p`` (the scripts' own checks, via tools.estimate), or None."""
    from common.parallelize.pp import check_pp
    try:
        check_layouts([p])
        if p.pp > 1:
            check_pp(p.cfg, p.pp, p.schedule, p.microbatches or p.pp, max(1, p.batch // p.dp), compile=compiled,
                     ac=p.ac)
            if p.batch % (p.dp * (p.microbatches or p.pp)):
                raise UserError(f"the batch does not split into {p.dp} x {p.microbatches} micro-batches.")
        if compiled and p.strategy in ("cp", "cp_fsdp"):
            raise UserError("train_cp.py refuses --compile.")
    except UserError as e:
        return str(e)
    return None


def layout_name(p: Plan) -> str:
    name = label(p).rsplit(" on ", 1)[0]
    if p.strategy == "2d" and p.pp > 1:
        name = f"3d pp={p.pp} x dp={p.dp} x tp={p.tp} m={p.microbatches} {p.schedule}"
    if p.strategy in ("cp", "cp_fsdp"):
        name = f"{'fsdp' if p.strategy == 'cp_fsdp' else 'ddp'} dp={p.world // p.cp} x cp={p.cp}"
    if p.sequence_parallel:
        name += " +sp"
    return f"{name}, AC {p.ac}"


def command(p: Plan, args, per_node: int) -> str:
    """The step-3 command that runs ``p`` (flags its script accepts: tests/test_plan.py parses it)."""
    if p.strategy == "single":
        return _one_device_command(p, args)
    nodes = max(1, p.world // per_node)
    launch = f"torchrun --nproc-per-node {min(p.world, per_node)}" if nodes == 1 else \
        f"torchrun --nnodes {nodes} --nproc-per-node {per_node} --rdzv-backend c10d --rdzv-endpoint HEAD:29500"
    model = ["--model", args.model] + (["--n-layers", str(args.n_layers)] if args.n_layers else [])
    model += _data_flags(args)
    flags = [*model, *layout_flags(p)] + (["--compile"] if args.compile else [])
    return f"{launch} {script_of(p)} " + " ".join(flags)  # (the layout's script: common/layouts.py)


def _data_flags(args) -> list[str]:
    """What the commands train on: --data DIR as given (the scripts take its vocabulary), or
    random tokens of --vocab-size (the text has 256 byte values), or the default bytes."""
    if getattr(args, "data", None):
        return ["--data", args.data]
    return ["--vocab-size", str(args.vocab_size), "--data", "synthetic"] if args.vocab_size else []


def _one_device_command(p: Plan, args) -> str:
    """One GPU: the one-device chapters' scripts (step 1's fp32 baseline; step 2's bf16, with AC)."""
    flags = ["--model", args.model] + (["--n-layers", str(args.n_layers)] if args.n_layers else [])
    flags += _data_flags(args) + layout_flags(p) + (["--compile"] if args.compile else [])
    return f"python {script_of(p)} " + " ".join(flags)


def evaluate(ps: list[Plan], machine: Machine, compiled: bool, headroom: float) -> tuple[list[dict], list[dict]]:
    """(the layouts that fit, fastest first; the dropped ones with why), each a dict of plan,
    peak memory, the step's terms."""
    usable = (machine.memory_gib - headroom) * GiB
    fit, dropped = [], []
    for p in ps:
        why = runnable(p, compiled)
        if why:
            dropped.append({"plan": p, "why": f"no script runs it: {why}"})
            continue
        mem = worst_rank(p)
        if mem["peak"] > usable:
            dropped.append({"plan": p, "peak": mem["peak"],
                            "why": f"does not fit: peak {mem['peak'] / GiB:,.1f} GiB on rank {mem['rank']} "
                                   f"({mem['peak_at']}) > {usable / GiB:g} GiB usable"})
            continue
        fit.append({"plan": p, "peak": mem["peak"], "time": step_time(p, machine, compiled)})
    fit.sort(key=lambda r: (round(r["time"]["step"], 6), r["peak"]))  # equally fast: the smaller first
    return fit, dropped


def table(rows: list[dict]) -> str:
    # the CPU's term (ranks outnumbering cores) gets a column only where some row has it
    terms = TERMS + tuple(k for k in (DISPATCH, SHARED) if any(r["time"][k] for r in rows))
    head = "| # | layout | peak GiB | step ms | " + " | ".join(terms) + " | tokens/s | per GPU | MFU |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for i, r in enumerate(rows, 1):
        t = r["time"]
        lines.append(f"| {i} | {layout_name(r['plan'])} | {r['peak'] / GiB:.1f} | {t['step'] * 1e3:,.0f} | "
                     + " | ".join(f"{t[k] * 1e3:,.0f}" for k in terms)
                     + f" | {t['tokens_per_s']:,.0f} | {t['tokens_per_s_per_gpu']:,.0f} | "
                     + (f"{t['mfu']:.1%} |" if t["mfu"] is not None else "- |"))
    return "\n".join(lines)


def ties(rows: list[dict]) -> list[str]:
    """A line for each run of rows with the same predicted step: the model charges them
    alike (every term equal to the microsecond), so their order is the smaller peak first."""
    out, i = [], 0
    while i < len(rows):
        j = i
        while j + 1 < len(rows) and round(rows[j + 1]["time"]["step"], 6) == round(rows[i]["time"]["step"], 6):
            j += 1
        if j > i:
            out.append(f"rows {i + 1}-{j + 1} tie: the model predicts the same step for each (what tells them apart "
                       f"costs no time it charges), so the smaller peak comes first; measure them to choose.")
        i = j + 1
    return [""] + out if out else []


def plan_text(args) -> str:
    """What ``python -m tools.plan`` prints for ``args`` (the chapter's blocks are this text)."""
    cfg = get_config(args.model, n_layers=args.n_layers, vocab_size=args.vocab_size)
    machine = machine_of(args)
    per_node = machine.gpus_per_node
    batch = args.global_batch_size or args.gpus
    acs = AC_MODES if args.ac == "all" else (args.ac,)
    ps = layouts(cfg, args.gpus, per_node, batch, args.seq_len, args.dtype, "cuda" if not args.calibration else "cpu",
                 acs, args.loss_chunks, args.split_root_unit)
    fit, dropped = evaluate(ps, machine, args.compile, args.headroom)
    if not fit and not any("peak" in d for d in dropped):
        raise UserError(f"no step-3 script runs any layout of --gpus {args.gpus} with --global-batch-size {batch}; "
                        f"give at least one sequence per data-parallel rank (e.g. --global-batch-size {args.gpus}).")
    nodes = max(1, args.gpus // per_node)
    n = count_params(cfg)
    rate = machine.matmul_rate(args.dtype, args.compile)
    out = [f"{args.model} ({n / 1e9:.2f}B parameters)" if n >= 1e9 else f"{args.model} ({n / 1e6:.1f}M parameters)"]
    out[0] += (f", global batch {batch} x {args.seq_len} tokens, "
           f"{args.dtype}{', compiled' if args.compile else ''}, on {args.gpus} x {machine.name} "
           f"({nodes} node{'s' if nodes > 1 else ''} of {min(per_node, args.gpus)}); matmuls at "
           + (f"{rate / 1e12:,.1f} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:,.1f} GFLOP/s") + " a GPU, "
           f"{len(ps)} layouts: {len(fit)} fit, {len(dropped)} dropped")
    if not fit:
        out.append("none fits; the closest:")
    else:
        out += ["", table(fit[:args.top]), "", "what each costs, and the command that runs it:"]
        for i, r in enumerate(fit[:args.top], 1):
            from common.measure.steptime import explain
            out += [f"{i}. {layout_name(r['plan'])}: " + explain(r["time"]), f"   {command(r['plan'], args, per_node)}"]
        out += ties(fit[:args.top])
    closest = sorted((d for d in dropped if "peak" in d), key=lambda d: d["peak"])
    shown = dropped if args.show_dropped else closest[:3]
    if shown:
        out += ["", "dropped" + ("" if args.show_dropped else
                                 f" ({sum('peak' in d for d in dropped)} do not fit, "
                                 f"{sum('peak' not in d for d in dropped)} no script runs; the 3 closest to fitting, "
                                 f"--show-dropped lists all)") + ":"]
        out += [f"  {layout_name(d['plan'])}: {d['why']}" for d in shown]
    return "\n".join(out)


def layouts_figure(args, path: Path) -> None:
    """Every layout that fits, as a bar of its predicted step split into the model's terms,
    fastest at the top, with its tokens/s a GPU: where the time goes, at a glance."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cfg = get_config(args.model, n_layers=args.n_layers, vocab_size=args.vocab_size)
    machine = machine_of(args)
    batch = args.global_batch_size or args.gpus
    acs = AC_MODES if args.ac == "all" else (args.ac,)
    fit, _ = evaluate(layouts(cfg, args.gpus, machine.gpus_per_node, batch, args.seq_len, args.dtype, "cuda", acs,
                              args.loss_chunks, args.split_root_unit),
                      machine, args.compile, args.headroom)
    colors = dict(zip(TERMS, ("#4C72B0", "#8172B3", "#C44E52", "#CCB974", "#55A868")))
    fig, ax = plt.subplots(figsize=(11, 0.28 * len(fit) + 1.6))
    for i, r in enumerate(fit):
        left = 0.0
        for k in TERMS:
            v = r["time"][k]
            ax.barh(i, v, left=left, color=colors[k], label=k if i == 0 else None)
            left += v
        ax.text(left, i, f" {r['time']['tokens_per_s_per_gpu']:,.0f} tok/s/GPU, {r['peak'] / GiB:.0f} GiB",
                va="center", fontsize=7)
    ax.set_yticks(range(len(fit)), [layout_name(r["plan"]) for r in fit], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, max(r["time"]["step"] for r in fit) * 1.3)
    ax.set_xlabel("predicted seconds per step (common/measure/steptime.py)")
    nodes = max(1, args.gpus // machine.gpus_per_node)
    ax.set_title(f"{args.model}, batch {batch} x {args.seq_len} on {args.gpus} x {machine.name} ({nodes} node"
                 f"{'s' if nodes > 1 else ''}): the {len(fit)} layouts that fit, fastest first,\nand where each "
                 f"step goes (python -m tools.plan --gpus {args.gpus} ...)", fontsize=9)
    ax.legend(loc="upper right", fontsize=8)  # the fastest bars, at the top, are the shortest
    ax.grid(axis="x", alpha=0.3)
    save_figure(fig, path)
    plt.close(fig)


# ---- calibration: this machine, measured --------------------------------------------------------
def calibrate(args) -> dict:
    """Run the measuring job (torchrun, --gpus ranks) and return what it saved."""
    out = Path(args.out)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.gpus}",
           str(ROOT / "tools" / "plan.py"), "--calibrate-worker", "--model", args.model, "--seq-len",
           str(args.seq_len), "--global-batch-size", str(args.global_batch_size or args.gpus), "--device",
           args.device, "--out", str(out)] + (["--n-layers", str(args.n_layers)] if args.n_layers else [])
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode:
        raise UserError(f"the calibration job stopped: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(out.read_text())


def narrow_block(model, tp: int):
    """``model`` (one block) as one tensor-parallel rank holds it: 1/tp of the heads, of the MLP's
    hidden units and of the vocabulary's logits, at full width everywhere else (so its norms
    and residual adds run on every token, as each TP rank runs them). Same math, local shapes:
    the cost of the narrow matmuls without DTensor or the collectives."""
    import torch.nn as nn
    if tp == 1:
        return model
    for layer in model.layers.values() if hasattr(model.layers, "values") else model.layers:
        for mod, names in ((layer.attention, ("wq", "wk", "wv", "wo")), (layer.feed_forward, ("w1", "w3", "w2"))):
            for name in names:
                w = getattr(mod, name)
                rowwise = name in ("wo", "w2")  # split by input; the others by output
                setattr(mod, name, nn.Linear(w.in_features // tp if rowwise else w.in_features,
                                             w.out_features if rowwise else w.out_features // tp, bias=False,
                                             device=w.weight.device))
    model.output = nn.Linear(model.output.in_features, model.output.out_features // tp, bias=False,
                             device=model.output.weight.device)
    return model


def calibrate_worker(args) -> None:
    """One rank of the measuring job. The compute is measured per compute unit: on a CPU the
    first ``units`` ranks (one per core) time at once while the others wait, so a rank's rate is
    one core's with its neighbours busy, and steptime.py shares the cores among the ranks that
    have work; on a GPU every rank (one per GPU) times. Each timing is repeated (--repeats) and
    the median kept, its spread (min-max over median) saved beside it. Then, every rank at once
    as the job runs them, the communication lab's all-reduce sweep (step3_multi_gpu/bench_collectives.py)."""
    import contextlib
    import statistics
    import time

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from common.distributed import distributed
    from common.measure.bench import message_sizes
    from common.measure.flops import head_flops, layer_flops
    from common.measure.machines import shape_key
    from common.model import build_model
    from step3_multi_gpu.bench_collectives import run as bench_run
    cfg = get_config(args.model, n_layers=args.n_layers)
    with distributed(args.device) as ctx:
        dev = ctx.device
        units = len(os.sched_getaffinity(0)) if dev.type == "cpu" and hasattr(os, "sched_getaffinity") else \
            (os.cpu_count() or 1) if dev.type == "cpu" else ctx.world_size
        measuring = ctx.rank < min(units, ctx.world_size)

        def timed(fn, repeats: int = args.repeats) -> dict:
            """Seconds a call on the measuring ranks (the slowest of them), over repeats: median, min, max."""
            fn()  # warm-up: allocations, lazy init
            runs = []
            for _ in range(repeats):
                dist.barrier()
                t0 = time.perf_counter()
                if measuring:
                    fn()
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
                t = torch.tensor([time.perf_counter() - t0 if measuring else 0.0], dtype=torch.float64, device=dev)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                runs.append(t.item())
            return {"median": statistics.median(runs), "min": min(runs), "max": max(runs)}

        def block_rate(dtype: str, tp: int, seqs: int) -> dict:
            """FLOP/s of our model's own step one block deep (its matmuls, attention, norms and the
            rest, forward and backward) at one rank's shape: the calibrated counterpart of a GPU's
            achieved fraction, which was measured on a whole step too."""
            one = get_config(args.model, n_layers=1)
            model = narrow_block(build_model(one, dev), tp)
            x = torch.randint(0, one.vocab_size // tp, (seqs, args.seq_len), device=dev)

            def step():
                with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
                    loss = F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten())
                loss.backward()
            t = timed(step)
            flops = x.numel() * (layer_flops(one, args.seq_len) + head_flops(one)) / tp
            # rates: the median, the lowest (the slowest repeat) and the highest
            return {"median": flops / t["median"], "min": flops / t["max"], "max": flops / t["min"]}

        seqs = max(1, (args.global_batch_size or ctx.world_size) // ctx.world_size)
        tokens = seqs * args.seq_len
        rates, peaks, shapes = {}, {}, {}
        for dtype, torch_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            rates[dtype] = block_rate(dtype, 1, seqs)["median"]
            # a bare matmul of the model's MLP shape, the "spec sheet" of this machine
            a = torch.randn(tokens, cfg.dim, dtype=torch_dtype, device=dev)
            b = torch.randn(cfg.dim, cfg.ffn_dim, dtype=torch_dtype, device=dev)
            peaks[dtype] = 2 * tokens * cfg.dim * cfg.ffn_dim / timed(lambda: a @ b)["median"]
        for tp, n in json.loads(args.shapes or "[]"):
            shapes[shape_key("fp32", tp, n)] = block_rate("fp32", tp, n)
        # DTensor's own work: our whole model, forward and backward of one sequence, plain and
        # with tensor parallelism applied over a mesh of this rank alone (every op dispatched
        # through DTensor, its collectives over one rank: nothing), the difference a block
        from common.parallelize.tp import apply_tp
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.parallel import loss_parallel
        alone = [dist.new_group([r]) for r in range(ctx.world_size)][ctx.rank]
        # the whole model where it is small (a CPU's); one block of a large one (the 8b would not fit)
        whole = cfg if count_params(cfg) <= 200e6 else get_config(args.model, n_layers=1)
        seq = torch.randint(0, cfg.vocab_size, (1, args.seq_len), device=dev)

        def fwd_bwd(model, context):
            def go():
                with context():
                    F.cross_entropy(model(seq).flatten(0, 1).float(), seq.flatten()).backward()
            return go
        plain = timed(fwd_bwd(build_model(whole, dev), contextlib.nullcontext))["median"]
        dmodel = build_model(whole, dev)
        apply_tp(dmodel, DeviceMesh.from_group(alone, dev.type))
        dtensor_s = max(0.0, timed(fwd_bwd(dmodel, loss_parallel))["median"] - plain) / whole.n_layers
        # the optimizer as the scripts run it (common/training.py's AdamW options): clipping,
        # the step and zeroing the gradients, on our whole model's parameters
        from common.training import adamw_options
        full = build_model(whole, dev)
        params = list(full.parameters())
        for q in params:
            q.grad = torch.randn_like(q)
        opt = torch.optim.AdamW(params, **adamw_options(argparse.Namespace(lr=3e-4)))

        def optimizer_step():
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=False)
        adamw_s = timed(optimizer_step)["median"] / sum(q.numel() for q in params)
        x = torch.empty(2**24, device=dev)  # 64 MiB: a copy reads and writes it
        y = torch.empty_like(x)
        memory_bps = 2 * x.nbytes / timed(lambda: y.copy_(x))["median"]
        rows = bench_run(ctx, ["all_reduce"], message_sizes(4096, 16 * 2**20, 4), iters=10, budget_s=0.1, blocks=5)
        if ctx.is_main:
            from common.measure.metrics import cpu_name
            rows.sort(key=lambda r: r["bytes"])
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if dev.type == "cpu" else \
                torch.cuda.get_device_properties(dev).total_memory * ctx.world_size
            c = {"name": (cpu_name() if dev.type == "cpu" else torch.cuda.get_device_name(dev)) +
                 f", {ctx.world_size} ranks", "world_size": ctx.world_size, "backend": ctx.backend,
                 "units": units if dev.type == "cpu" else 0,
                 "date": datetime.date.today().isoformat(), "matmul_flops": rates, "bare_matmul_flops": peaks,
                 "shapes_flops": shapes, "repeats": args.repeats, "memory_Bps": memory_bps,
                 "adamw_s_per_param": adamw_s if dev.type == "cpu" else 0.0,
                 "dtensor_s_per_block": dtensor_s if dev.type == "cpu" else 0.0,
                 "memory_gib": total / ctx.world_size / GiB, "latency_s": rows[0]["time_s"],
                 "bandwidth_Bps": max(r["busbw_GBps"] for r in rows) * 1e9,
                 "shapes": f"({tokens} x {cfg.dim}) @ ({cfg.dim} x {cfg.ffn_dim})", "all_reduce": rows}
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(c, indent=1))


def calibration_text(c: dict) -> str:
    who = f"one core, {c['units']} timing at once" if c.get("units") else "every rank at once"
    return (f"{c['name']} ({c['backend']}), measured {c['date']}, {who}: the model's step (one "
            f"block) {c['matmul_flops']['fp32'] / 1e9:,.1f} GFLOP/s fp32 and {c['matmul_flops']['bf16'] / 1e9:,.1f} "
            f"bf16 a rank (a bare matmul {c['bare_matmul_flops']['fp32'] / 1e9:,.1f} and "
            f"{c['bare_matmul_flops']['bf16'] / 1e9:,.1f} at {c['shapes']}), memory {c['memory_Bps'] / 1e9:,.1f} GB/s, all-reduce busbw "
            f"{c['bandwidth_Bps'] / 1e9:,.2f} GB/s, latency {c['latency_s'] * 1e6:,.0f} us")


# ---- torchtitan's published runs, predicted ------------------------------------------------------
# Llama 3.1 8B (128256-token vocabulary), sequence 8192 unless stated, on torchtitan's H100s
# (GPUS["torchtitan"]). Tables 1-3: benchmarks/llama3_h100_202412_torchtitan.md in the torchtitan repository. The FSDP 8 x
# TP 8 row: benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md there, which publishes its
# settings beside the number: FSDP=8, TP=8, torch.compile, per-op SAC, local batch size 12 (per
# data-parallel rank); torchtitan's TP shards the norms along the sequence (sequence parallelism).
# Memory: the allocator's max reserved, GiB. "compiled": torch.compile. The CP rows also ran Float8
# (not modelled: bf16 predicted). torchtitan's selective AC is its per-op policy: our --ac
# selective-op (every second matmul recomputed, charged as it runs), with the plain loss, as theirs.
TORCHTITAN = [
    # (what, gpus, fsdp, tp, cp, local batch, seq, ac, compiled, tokens/s/GPU, GiB)
    ("Table 1: FSDP, eager", 8, 8, 1, 1, 2, 8192, "selective-op", False, 5762, 82.4),
    ("Table 1: FSDP + compile", 8, 8, 1, 1, 2, 8192, "selective-op", True, 6667, 77.0),
    ("Table 3: FSDP, eager", 128, 128, 1, 1, 2, 8192, "selective-op", False, 5605, 67.0),
    ("Table 3: FSDP + compile", 128, 128, 1, 1, 2, 8192, "selective-op", True, 6514, 62.0),
    ("Table 2: FSDP 8, CP 1 (+compile, float8)", 8, 8, 1, 1, 1, 32768, "full", True, 3890, 83.9),
    ("Table 2: FSDP 4, CP 2 (+compile, float8)", 8, 8, 1, 2, 1, 65536, "full", True, 2540, 84.2),
    ("Table 2: FSDP 2, CP 4 (+compile, float8)", 8, 8, 1, 4, 1, 131072, "full", True, 1071, 84.0),
    ("Table 2: FSDP 1, CP 8 (+compile, float8)", 8, 8, 1, 8, 1, 262144, "full", True, 548, 84.5),
    ("asyncTP benchmark: FSDP 8 x TP 8 (+compile, local batch 12)", 64, 8, 8, 1, 12, 8192, "selective-op", True, 4378,
     None),
]


def torchtitan_tp_as_first_assumed(cfg) -> dict:
    """The asyncTP row as an earlier version of this planner assumed it (eager, our selective AC,
    local batch 2 instead of compiled, per-op SAC and 12): step_time's answer, which the will-it-fit
    page quotes as the settings that once hid a miss."""
    return step_time(Plan(cfg, "2d", tp=8, world=64, batch=16, seq_len=8192, dtype="bf16", ac="selective",
                          device="cuda", optimizer="foreach"), GPUS["torchtitan"])


def torchtitan_rows() -> list[dict]:
    """Our prediction of each published run: tokens/s a GPU and the peak, beside theirs."""
    machine = GPUS["torchtitan"]
    out = []
    for what, gpus, fsdp, tp, cp, local, seq, ac, compiled, tps, gib in TORCHTITAN:
        cfg = get_config("8b", vocab_size=128256, max_seq_len=max(seq, 8192))
        dp = gpus // tp // cp
        c = dict(world=gpus, seq_len=seq, dtype="bf16", ac=ac, device="cuda")
        if cp > 1:
            p = Plan(cfg, "cp_fsdp", batch=local * gpus // cp, cp=cp, **c)
        elif tp > 1:
            p = Plan(cfg, "2d", tp=tp, batch=local * dp, sequence_parallel=True, **c)
        else:
            p = Plan(cfg, "fsdp_zero3", batch=local * gpus, **c)
        t = step_time(p, machine, compiled)
        mem = worst_rank(p)
        # train_cp.py's ring attention keeps one block's fp32 scores (a lesson on CPU); torchtitan's
        # runs a flash kernel per block, which keeps none: their peak is ours without that term
        scores = sum(v for k, v in mem["transient"].items() if "scores" in k)
        peak = (mem["peak"] - scores) / GiB
        out.append({"what": what, "gpus": gpus, "seq": seq, "ac": ac, "theirs": tps, "ours": t["tokens_per_s_per_gpu"],
                    "their_gib": gib, "our_gib": peak, "scores_gib": scores / GiB, "time": t, "plan": p})
    return out


def torchtitan_text(rows: list[dict] | None = None) -> str:
    m = GPUS["torchtitan"]
    lines = [f"torchtitan's Llama 3.1 8B runs (in the torchtitan repository: benchmarks/llama3_h100_202412_torchtitan.md's tables, and "
             f"benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md for FSDP 8 x TP 8) on {m.name}: matmuls at "
             f"{m.matmul_rate('bf16') / 1e12:.0f} TFLOP/s eager, {m.matmul_rate('bf16', True) / 1e12:.0f} compiled "
             f"(the fractions of 989 our 1b model reached on an H200: figs/gpu_check_h200.md), HBM {m.hbm / 1e12:.1f} TB/s, NVLink {m.intra.bandwidth / 1e9:.0f} "
             f"GB/s and {m.inter.bandwidth / 1e9:.0f} GB/s a GPU across hosts (busbw); AC selective-op is torchtitan's "
             f"selective (its per-op policy), its recompute charged as it runs (every second matmul again)", "",
             "| run | GPUs | seq | AC | tokens/s/GPU theirs | ours | ours/theirs | GiB theirs (reserved) | ours (peak) "
             "| ours/theirs | where our step goes (ms) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows or torchtitan_rows():
        t = r["time"]
        terms = ", ".join(f"{k} {t[k] * 1e3:,.0f}" for k in TERMS if t[k] * 1e3 >= 0.5)
        mem = f"{r['their_gib']:.1f} | {r['our_gib']:.1f} | {r['our_gib'] / r['their_gib']:.2f}" if r["their_gib"] \
            else f"- | {r['our_gib']:.1f} | -"
        if r["scores_gib"]:
            mem += f" (+{r['scores_gib']:,.0f} GiB of scores in train_cp.py)"
        lines.append(f"| {r['what']} | {r['gpus']} | {r['seq']:,} | {r['ac']} | {r['theirs']:,} | {r['ours']:,.0f} | "
                     f"{r['ours'] / r['theirs']:.2f} | {mem} | {terms} |")
    return "\n".join(lines)


@main_guard
def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.calibrate_worker:
        return calibrate_worker(args)
    if args.torchtitan:
        print(torchtitan_text())
        return
    check(args)
    if args.calibrate:
        print(calibration_text(calibrate(args)))
        print(f"saved to {args.out}; plan with it: python -m tools.plan --calibration {args.out} ...")
        return
    print(plan_text(args))


if __name__ == "__main__":
    sys.exit(main())
