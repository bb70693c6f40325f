"""Splitting the model itself: tensor, sequence and pipeline parallelism, and FSDP on a mesh.

The model (common/model.py) never knows about any of this. Each function here applies one
kind of parallelism from the outside, the way torchtitan's ``parallelize_llama`` does:

- ``apply_tp``: the tensor-parallel plan (Megatron-LM's split, with optional sequence
  parallelism for the norms and loss parallelism for the output), via
  ``parallelize_module``;
- FSDP over one mesh dimension is common/parallel.py's ``apply_fsdp`` (chapter 3a);
- ``stage_layers`` / ``build_stage``: which layers a pipeline stage owns, and the stage
  module holding only those (plus the embedding on the first stage and the norm and
  output on the last);
- ``check_tp`` / ``check_pp``: the shapes that cannot be split, refused with one sentence
  before any rank starts to communicate, so that a bad flag never leaves a rank hanging.

Plus the plumbing the model-parallel scripts share: the global loss, gathering the trained
weights back into one state dict, counting bytes per step and timing pipeline compute.
"""
from __future__ import annotations

import contextlib
import logging
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from common.comm import CommCounter, sent_per_step
from common.errors import UserError
from common.model import ModelConfig, Transformer
from common.theory import stage_layers  # the formulas live in theory.py

SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b")
STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved1f1b": 2}


# ---- tensor parallelism ------------------------------------------------------------------
def check_tp(cfg: ModelConfig, tp: int, seq_len: int, sequence_parallel: bool):
    """Refuse shapes that do not split evenly over ``tp`` ranks (before any collective)."""
    for what, n, unit in (("n_heads", cfg.n_heads, "attention heads"),
                          ("n_kv_heads", cfg.n_kv_heads, "key/value heads"),
                          ("ffn_dim", cfg.ffn_dim, "MLP hidden units"),
                          ("vocab_size", cfg.vocab_size, "tokens")):
        if n % tp:
            raise UserError(f"the model's {what} ({n}) is not divisible by the tensor-parallel degree {tp}; "
                            f"choose a degree that divides it (or a model with more {unit}).")
    if sequence_parallel and seq_len % tp:
        raise UserError(f"--seq-len {seq_len} is not divisible by the tensor-parallel degree {tp}, which "
                        f"sequence parallelism splits it over; use a multiple of {tp}.")


def apply_tp(model: Transformer, tp_mesh, sequence_parallel: bool = False, loss_parallel: bool = True):
    """Megatron-style tensor parallelism over ``tp_mesh``, in place.

    In each block the first matmuls (wq/wk/wv, w1/w3) are split by output columns, so each
    rank computes whole heads and a slice of the MLP's hidden units with no communication;
    the second ones (wo, w2) are split by input rows, so each rank produces a partial sum
    of the full output, which one all-reduce completes. Hence two all-reduces per block in
    forward and, mirrored, two in backward (the gradient of a replicated input is a sum of
    per-rank partials).

    ``sequence_parallel``: between blocks the activations (the residual stream and the
    norms' work) are split along the sequence instead of replicated; each all-reduce
    becomes a reduce-scatter (after wo/w2) and an all-gather (before the next
    column-split matmul): the same bytes on the wire, but 1/tp of the activations outside
    the matmuls.

    ``loss_parallel``: the output projection keeps its logits split over the vocabulary and
    the cross entropy is computed on the shards (use it under ``loss_parallel()``), so the
    (batch, seq, vocab) logits are never gathered on one rank.
    """
    between = Shard(1) if sequence_parallel else Replicate()  # layout of the residual stream
    norm = SequenceParallel() if sequence_parallel else None
    outer = {
        # Split by vocabulary rows: each rank looks up the tokens in its range and an
        # all-reduce (or reduce-scatter, with SP) fills in the rest.
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        **({"norm": norm} if norm else {}),
        "output": ColwiseParallel(input_layouts=between,
                                  output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    }
    # A pipeline stage may lack the embedding or the head (set to None): plan what is there.
    parallelize_module(model, tp_mesh, {k: v for k, v in outer.items() if getattr(model, k) is not None})
    for block in model.layers.values():
        plan = {
            # One redistribution of the block input for q, k and v together: without it each
            # of the three column-split matmuls would all-reduce its own input gradient.
            "attention": PrepareModuleInput(input_layouts=(between, None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=between),
            "feed_forward": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=between),
        }
        if norm:
            plan |= {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
        parallelize_module(block, tp_mesh, plan)
    return model


# ---- FSDP over one dimension of a mesh --------------------------------------------------------
# ---- pipeline parallelism -----------------------------------------------------------------
def stage_indices(rank: int, pp: int, schedule: str) -> list[int]:
    """The stages this rank runs: one, or for the interleaved schedule one per loop (r, r + pp)."""
    return [rank + k * pp for k in range(STAGES_PER_RANK[schedule])]


def check_pp(cfg: ModelConfig, pp: int, schedule: str, microbatches: int, global_batch: int):
    """Refuse pipeline shapes that cannot run (before any collective)."""
    if schedule not in SCHEDULES:
        raise UserError(f"--schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}.")
    n_stages = pp * STAGES_PER_RANK[schedule]
    if cfg.n_layers < n_stages:
        raise UserError(f"{n_stages} pipeline stages ({pp} ranks x {STAGES_PER_RANK[schedule]} with {schedule}) "
                        f"but the model has only {cfg.n_layers} layers; use fewer ranks or more --n-layers.")
    if microbatches <= 0:
        raise UserError(f"--microbatches must be positive (got {microbatches}).")
    if schedule == "1f1b" and microbatches < pp:
        raise UserError(f"1f1b needs at least as many micro-batches as pipeline ranks; use --microbatches {pp} "
                        f"or more (got {microbatches}).")
    if schedule == "interleaved1f1b" and microbatches % pp:
        raise UserError(f"interleaved1f1b needs the number of micro-batches to be a multiple of the {pp} "
                        f"pipeline ranks; use --microbatches {pp * max(1, round(microbatches / pp))} "
                        f"(got {microbatches}).")
    if global_batch % microbatches:
        raise UserError(f"--global-batch-size {global_batch} does not split into {microbatches} equal "
                        f"micro-batches; use a multiple of {microbatches}.")


def build_stage(cfg: ModelConfig, stage: int, n_stages: int, device, seed: int = 0, parallelize=None) -> Transformer:
    """The part of the model that pipeline stage ``stage`` owns, with the full model's weights.

    Built on the meta device, pruned, then materialised: a rank never allocates the layers
    it does not own. ``parallelize(module)``, if given, runs before materialising (tensor
    parallelism or FSDP inside the stage, for 3-D). Layer names keep their global index
    and ``init_weights`` seeds each parameter by its name, so the weights equal the
    single-process model's. The RoPE tables are buffers of the model, so every stage has them.
    """
    with torch.device("meta"):
        model = prune_to_stage(Transformer(cfg), stage, n_stages)
    if parallelize is not None:
        parallelize(model)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model


def prune_to_stage(model: Transformer, stage: int, n_stages: int) -> Transformer:
    """Keep only what pipeline stage ``stage`` of ``n_stages`` owns: its layers, plus the
    embedding on the first stage and the final norm and output layer on the last."""
    mine = {str(i) for i in stage_layers(model.cfg.n_layers, n_stages)[stage]}
    for name in [n for n in model.layers if n not in mine]:
        del model.layers[name]
    if stage != 0:
        model.tok_embeddings = None
    if stage != n_stages - 1:
        model.norm = None
        model.output = None
    return model


def make_schedule(schedule: str, stages, microbatches: int, loss_fn):
    """The ``torch.distributed.pipelining`` schedule for ``stages`` (this rank's)."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
    if schedule == "interleaved1f1b":
        return ScheduleInterleaved1F1B(stages, n_microbatches=microbatches, loss_fn=loss_fn)
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    return cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn)


def schedule_order(schedule: str, pp: int, microbatches: int) -> list[list[tuple[str, int]]]:
    """Each rank's textbook order of forward ("F", i) and backward ("B", i) micro-batch
    steps: GPipe runs every forward first; 1F1B starts backwards after p - 1 - rank
    warm-up forwards, so stage s has at most p - s micro-batches in flight."""
    order = []
    for r in range(pp):
        if schedule == "gpipe":
            ops = [("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)]
        elif schedule == "1f1b":
            warm = min(pp - 1 - r, microbatches)
            ops = [("F", i) for i in range(warm)]
            for i in range(microbatches - warm):
                ops += [("F", warm + i), ("B", i)]
            ops += [("B", i) for i in range(microbatches - warm, microbatches)]
        else:
            raise ValueError(schedule)
        order.append(ops)
    return order


def simulate_schedule(schedule: str, pp: int, microbatches: int, f: float = 1.0, b: float = 2.0):
    """Idle fraction per rank of the textbook GPipe / 1F1B order, with uniform stages.

    Each rank runs its forward (cost ``f``) and backward (cost ``b``) micro-batch steps in
    the schedule's order, each as soon as its input has arrived (forward of micro-batch i
    on stage s after stage s-1's; backward after stage s+1's). Communication is free.
    Returns (per-rank idle fraction of the step, step length). For both schedules this
    gives (p-1)/(m+p-1) on every rank, whatever f and b: 1F1B changes the memory, not the
    bubble.
    """
    order = schedule_order(schedule, pp, microbatches)
    done: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * pp
    pos = [0] * pp
    while any(pos[r] < len(order[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while pos[r] < len(order[r]):
                kind, i = order[r][pos[r]]
                dep = ("F", r - 1, i) if kind == "F" and r > 0 else ("B", r + 1, i) if kind == "B" and r < pp - 1 \
                    else ("F", r, i) if kind == "B" else None
                if dep is not None and dep not in done:
                    break
                start = max(clock[r], done.get(dep, 0.0))
                clock[r] = done[(kind, r, i)] = start + (f if kind == "F" else b)
                pos[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("schedule deadlocks")
    total = max(clock)
    busy = microbatches * (f + b)
    return [1 - busy / total] * pp, total


class ComputeTimer:
    """Time each stage's forward and backward micro-batch computations (the busy time).

    Wraps the stage methods every ``torch.distributed.pipelining`` schedule calls, and the
    schedule's ``step``. The bubble is the rest of the pipeline's step: waiting for the
    neighbours. Wall-clock timestamps (``time.time()``) let ``bubble_report`` line the
    ranks up on one shared time axis (the ranks of one machine share its clock).
    """

    def __init__(self, schedule, stages, device):
        self.busy_s, self.start, self.end = 0.0, None, None
        # A GPU runs asynchronously: wait for it around each timed piece, or the host's
        # clock measures kernel launches rather than kernels. (That wait removes a little
        # overlap of communication with compute, so the GPU bubble is slightly overstated.)
        self._sync = (lambda: torch.cuda.synchronize(device)) if torch.device(device).type == "cuda" else (lambda: None)
        step = schedule.step

        def timed_step(*args, **kwargs):
            self._sync()
            self.start = time.time()
            try:
                return step(*args, **kwargs)
            finally:
                self._sync()
                self.end = time.time()
        schedule.step = timed_step
        for stage in stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                if hasattr(stage, name):
                    setattr(stage, name, self._timed(getattr(stage, name)))

    def _timed(self, fn):
        def run(*args, **kwargs):
            self._sync()
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._sync()
                self.busy_s += time.perf_counter() - t
        return run

    def take(self) -> dict[str, float]:
        """This step's compute seconds and the schedule step's start and end timestamps."""
        out = {"busy_s": self.busy_s, "pipeline_start": self.start, "pipeline_end": self.end}
        self.busy_s = 0.0
        return out


def bubble_formula(schedule: str, pp: int, microbatches: int) -> float:
    """The idle fraction of a step: (p-1)/(m+p-1); interleaving v stages per rank: (p-1)/(v*m+p-1)."""
    v = STAGES_PER_RANK[schedule]
    return (pp - 1) / (v * microbatches + pp - 1)


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


def bubble_report(metrics, ctx, schedule: str, pp: int, microbatches: int) -> dict:
    """Measured idle fraction per rank beside the formula and the schedule simulation.

    A step's window runs from the first rank entering the schedule's step to the last rank
    leaving it; a rank's idle time is the window minus its compute. Median over the
    untraced steps after the first (a median shrugs off a step where another program took
    the CPU). Every rank must call this (it gathers each rank's timings).
    """
    rows = [r for r in metrics.rows[1:] if not r["traced"]] or metrics.rows
    # Only the steps this process ran have timings (after --resume, rank 0's rows also hold
    # the earlier steps, read back from metrics.jsonl, without them).
    rows = [r for r in rows if r.get("pipeline_start") is not None]
    mine = [(r["step"], r["pipeline_start"], r["pipeline_end"], r["busy_s"]) for r in rows]
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    common = set.intersection(*({s[0] for s in steps} for steps in everyone))
    everyone = [[s for s in steps if s[0] in common] for steps in everyone]
    mine = everyone[ctx.rank]
    if not mine:
        return {"window_s": None, "per_rank": [], "formula": bubble_formula(schedule, pp, microbatches)}
    windows = [max(rank[i][2] for rank in everyone) - min(rank[i][1] for rank in everyone)
               for i in range(len(mine))]
    per_rank = []
    for rank, steps in enumerate(everyone):
        busy = [s[3] for s in steps]
        per_rank.append({"rank": rank, "busy_s": _median(busy),
                         "idle_s": _median([w - b for w, b in zip(windows, busy)]),
                         "idle_fraction": _median([1 - b / w for w, b in zip(windows, busy)])})
    window = _median(windows)
    out = {"window_s": window, "per_rank": per_rank, "formula": bubble_formula(schedule, pp, microbatches)}
    if schedule in ("gpipe", "1f1b"):
        out["simulated"] = simulate_schedule(schedule, pp, microbatches)[0]
    return out


def pipeline_loss(losses: list[torch.Tensor], last_rank: int, device, group=None) -> torch.Tensor:
    """The batch loss on every rank of the pipeline: the last stage's mean over micro-batches,
    broadcast from ``last_rank`` (its rank within ``group``)."""
    loss = torch.stack(losses).mean().detach() if losses else torch.zeros((), device=device)
    src = last_rank if group is None else dist.get_global_rank(group, last_rank)
    dist.broadcast(loss, src=src, group=group)
    return loss


@torch.no_grad()
def pipeline_evaluate(schedule, tokens, args, device, has_first: bool, has_last: bool, last_rank: int,
                      pp_group=None, dp_group=None, dp_rank: int = 0, dp_size: int = 1):
    """Validation loss through the pipeline: forward-only passes of the schedule.

    With data parallelism too (3-D), each pipeline evaluates its share of every batch and
    the losses are averaged over ``dp_group``.
    """
    if args.eval_batches == 0 or len(tokens) <= args.seq_len * args.global_batch_size or not hasattr(schedule, "eval"):
        return None
    from common.data import Batches
    batches = iter(Batches(tokens, args.seq_len, args.global_batch_size, dp_rank, dp_size, shuffle=False))
    total = 0.0
    for _ in range(args.eval_batches):
        x, y = next(batches)
        x, y = x.to(device), y.to(device)
        losses = []
        schedule.eval(*([x] if has_first else []), target=y if has_last else None, losses=losses)
        total += global_loss(pipeline_loss(losses, last_rank, device, pp_group), dp_group, dp_size).item()
    return total / args.eval_batches


# ---- shared plumbing ----------------------------------------------------------------------------
def global_loss(loss: torch.Tensor, dp_group=None, dp_size: int = 1) -> torch.Tensor:
    """The global-batch mean from this rank's loss (a DTensor under TP: it is replicated)."""
    loss = loss.detach()
    if isinstance(loss, DTensor):
        loss = loss.full_tensor()
    if dp_size > 1:
        loss = loss.clone()
        dist.all_reduce(loss, group=dp_group)
        loss /= dp_size
    return loss


def full_state_dict(modules: list[nn.Module], ctx, merge_ranks: bool = False) -> dict[str, torch.Tensor] | None:
    """Gather the trained weights back into one plain state dict on rank 0 (None elsewhere).

    DTensor shards (TP, FSDP) are gathered with ``full_tensor()``. ``merge_ranks``: the
    ranks hold different parameters (pipeline stages); rank 0 collects and merges them,
    which works because every stage keeps the full model's parameter names. Every rank
    must call this.
    """
    mine = {}
    # 2-D (FSDP over TP) shards gather in two steps and DTensor logs that this is slow;
    # once per checkpoint it does not matter.
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level, log.level = log.level, logging.ERROR
    try:
        for m in modules:
            for k, v in m.state_dict().items():
                v = v.full_tensor() if isinstance(v, DTensor) else v
                mine[k] = v.detach().cpu()
    finally:
        log.setLevel(level)
    if not merge_ranks or ctx.world_size == 1:
        return mine if ctx.is_main else None
    parts = [None] * ctx.world_size if ctx.is_main else None
    dist.gather_object(mine, parts, dst=0)
    if not ctx.is_main:
        return None
    return {k: v for part in parts for k, v in part.items()}


def save_full_weights(modules: list[nn.Module], ctx, path, merge_ranks: bool = False):
    """``full_state_dict`` then ``torch.save`` on rank 0: the checkpoint a single process can load."""
    state = full_state_dict(modules, ctx, merge_ranks)
    if state is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)


class StepComm:
    """Count communicated bytes per optimizer step, leaving out the first (warm-up) step.

    The first step of a pipeline exchanges tensor shapes between stages once; counting
    from the second gives the steady-state bytes per step.
    """

    def __init__(self, skip: int = 1):
        self.counter, self.skip, self.steps = CommCounter(), skip, 0

    @contextlib.contextmanager
    def count(self, step: int):
        if step < self.skip:
            yield
            return
        self.steps += 1
        with self.counter:
            yield

    def summary(self) -> list[dict]:
        """Every rank's {collective: {calls, bytes, wire_bytes}} per step (call it on every rank)."""
        mine = self.counter.summary(per=max(1, self.steps))
        if not dist.is_initialized():
            return [mine]
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return everyone


# ---- the chapter's table -------------------------------------------------------------------
_LABELS = {
    "single": "one device (step 1)",
    "tp": "TP {tp}", "tp_sp": "TP {tp} + sequence parallel", "pp_gpipe": "PP {pp}, GPipe",
    "pp_1f1b": "PP {pp}, 1F1B", "pp_interleaved": "PP {pp}, interleaved 1F1B (2 stages/rank)",
    "2d": "2-D: FSDP {dp} x TP {tp}", "fsdp_via_2d": "FSDP {dp} (train_2d.py --tp 1)", "ddp": "DDP {dp}",
    "fsdp": "FSDP {dp} (train_fsdp.py)",
}


def chapter3b_table(runs_dir, names: list[str], single=None) -> str:
    """One row per strategy from its summary.json: per-rank memory, bytes sent, step time.

    ``single``: the step 1 run with the same flags, the first row."""
    import json
    from pathlib import Path

    from common.memory import fmt_bytes
    from common.model import count_params

    def span(values, fmt=fmt_bytes):
        lo, hi = min(values), max(values)
        return fmt(lo) if abs(hi - lo) <= 0.005 * max(hi, 1) else f"{fmt(lo)} – {fmt(hi)}"

    head = ("| strategy | parameters / rank | gradients / rank | AdamW state / rank | activations / rank "
            "(peak) | peak / rank | sent per step / rank (logical) | on the wire / rank | step time |")
    lines = [head, "|" + "---|" * 9]
    s = None
    paths = [(name, Path(runs_dir) / name / "summary.json") for name in names]
    if single is not None:
        paths.insert(0, ("single", Path(single) / "summary.json"))
    for name, path in paths:
        if not path.exists():
            continue
        s = json.loads(path.read_text())
        par = {"tp": 1, "pp": 1, "dp": 1, **s.get("parallel", {})}
        mem = s["memory"]
        cat = lambda c: [m["peak_by_category"][c] for m in mem]  # noqa: E731
        comm = s.get("comm") or [{}]
        sent = [sent_per_step(c) for c in comm]
        label = _LABELS.get(name, name).format(**par)
        if "microbatches" in s:
            label += f", m={s['microbatches']}"
        star = ""
        lines.append(f"| {label} | {span(cat('parameters'))} | {span(cat('gradients'))} | "
                     f"{span(cat('optimizer state'))} | {span(cat('activations'))}{star} | "
                     f"{span([m['peak_bytes'] for m in mem])}{star} | {span([a for a, _ in sent])} | "
                     f"{span([b for _, b in sent])} | {s['step_time_s'] * 1e3:,.0f} ms |")
    if s is None:
        return "(no runs found)"
    cfg = s["model_config"]
    n = s["n_params"]
    world = s["world_size"]
    if not any((Path(runs_dir) / d / "summary.json").exists() for d in ("ddp",)):
        tensors = 9 * cfg["n_layers"] + 3
        lines.append(f"| DDP {world} (formula, not run in this checkout) | {fmt_bytes(4 * n)} | {fmt_bytes(4 * n)} | "
                     f"{fmt_bytes(8 * n + 4 * tensors)} | as one device at batch/{world} | | {fmt_bytes(4 * n)} | "
                     f"{fmt_bytes(2 * (world - 1) / world * 4 * n)} | |")
    assert n == count_params(ModelConfig(**cfg))
    lines += ["", f"Measured on {s['device_name']} ({s['backend']}), {world} ranks, fp32: the {s['model']} preset with "
              f"{cfg['n_layers']} layers (N = {n:,} parameters, {fmt_bytes(4 * n)} of fp32 weights), global batch "
              f"{s['global_batch_size']} x {s['seq_len']} tokens. Memory: the tracer's peak per category "
              f"(a range where the ranks differ). Bytes: per optimizer step, as common/comm.py counts them; "
              f"'on the wire' is what a ring algorithm makes each rank send. Step time: rank 0's mean "
              f"over the untraced steps after the first."]
    return "\n".join(lines)
