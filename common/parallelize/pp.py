"""Pipeline parallelism: which layers a stage owns, the stage modules, the schedules, and the
loss and validation through the pipeline.

Every stage keeps the full model's layer names (``layers.3``...) and its weights, built on
the meta device and pruned, so a rank never allocates the layers it does not own and any
split loads any other's checkpoint. ``check_pp`` refuses the shapes that cannot run, in
one sentence, before any rank starts to communicate.
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage

from common.errors import UserError
from common.measure.splits import stage_layers  # the layer split lives with the formulas
from common.parallelize.schedules import V_SCHEDULES, schedule_actions, schedule_order  # noqa: F401 (theirs too)
from common.model import ModelConfig, Transformer
from common.training import eval_batch_count, global_loss

SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b", "zbv", "dualpipev")
SIMULATED = ("gpipe", "1f1b", *V_SCHEDULES)  # the schedules simulate_schedule can play
# --doc-mask's refusal ("--doc-mask cannot be used with ...; drop --doc-mask."): common/cli.py says it
PP_DOC_MASK = ("pipeline parallelism: a stage after the first receives hidden states, not the tokens the document "
               "boundaries are read from")


def add_pp_flags(p: argparse.ArgumentParser, microbatches: int = 4, per: str = "step") -> None:
    """--schedule and --microbatches (a pipeline's --grad-accum)."""
    p.set_defaults(doc_mask_refused=PP_DOC_MASK)  # --doc-mask (common/cli.py's add_saver_flags) is refused
    p.add_argument("--schedule", default="1f1b", help=f"{', '.join(SCHEDULES)} (default: 1f1b)")
    p.add_argument("--microbatches", type=int, default=microbatches,
                   help=f"micro-batches per {per} (default: {microbatches})")


def add_3d_flags(p: argparse.ArgumentParser) -> None:
    """train_3d.py's degrees, outer to inner, then the pipeline's flags."""
    for dim, what in (("pp", "pipeline stages, the outer dimension"), ("dp", "FSDP degree, the middle dimension"),
                      ("tp", "tensor-parallel degree, the inner dimension")):
        p.add_argument(f"--{dim}", type=int, default=None, help=f"{what} (default: from the world size)")
    add_pp_flags(p, microbatches=2, per="step and replica")


def layout_3d(args: argparse.Namespace, world: int) -> None:
    """Fill in the degrees not given: tp 2, then pp 2, where the ranks left over are
    even, and dp the rest (8 ranks: 2 x 2 x 2; 4: pp 2 x tp 2; 1: 1 x 1 x 1); then check
    that they are positive and that the batch divides among the replicas."""
    for dim in ("tp", "pp", "dp"):
        if getattr(args, dim) is None:
            left = world // math.prod(d for d in (args.pp, args.dp, args.tp) if d)
            setattr(args, dim, max(1, left) if dim == "dp" else 2 if left % 2 == 0 else 1)
    if min(args.pp, args.dp, args.tp) <= 0:
        raise UserError(f"--pp, --dp and --tp must be positive (got {args.pp}, {args.dp}, {args.tp}).")
    if args.global_batch_size % args.dp:
        raise UserError(f"--global-batch-size {args.global_batch_size} does not divide among {args.dp} "
                        f"data-parallel replicas; use a multiple of {args.dp}.")


def loss_fn(logits, targets):
    """Applied by the last stage to each micro-batch; the schedule averages over them. In
    fp32: the schedule calls it outside the stage's autocast, on bf16 logits."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved1f1b": 2, "zbv": 2, "dualpipev": 2}


def stage_indices(rank: int, pp: int, schedule: str) -> list[int]:
    """The stages this rank runs: one; for the interleaved schedule one per loop (r, r + pp);
    for the V schedules r and 2p - 1 - r, so a micro-batch goes down the ranks and back up,
    and rank 0 holds both the embedding (stage 0) and the output layer (stage 2p - 1)."""
    if schedule in V_SCHEDULES:
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(STAGES_PER_RANK[schedule])]


def last_stage_rank(pp: int, schedule: str) -> int:
    """The rank that holds the last stage, which computes the loss: rank 0 in a V."""
    return 0 if schedule in V_SCHEDULES else pp - 1


def check_pp(cfg: ModelConfig, pp: int, schedule: str, microbatches: int, global_batch: int, compile: bool = False,
             ac: str = "none"):
    """Refuse pipeline shapes that cannot run (before any collective)."""
    if schedule not in SCHEDULES:
        raise UserError(f"--schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}.")
    if compile and schedule in V_SCHEDULES:  # PyTorch refuses it, with a traceback, once the stages exist
        raise UserError(f"--compile with --schedule {schedule}: the schedule splits each backward into an input "
                        f"half and a weight half, which PyTorch's pipelining cannot do through a compiled stage; "
                        f"drop --compile or use gpipe, 1f1b or interleaved1f1b.")
    if ac.startswith("selective") and schedule in V_SCHEDULES:  # and so does selective checkpointing, mid-step
        raise UserError(f"--ac {ac} with --schedule {schedule}: selective checkpointing lets each region run "
                        f"backward once, and the schedule runs it twice (input half, then weight half); use --ac "
                        f"full or another schedule.")
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
        # (PyTorch runs any count that splits into whole rounds of m // p; this tutorial keeps
        # multiples of p, where the bubble formula (p - 1)/(2m + p - 1) and the estimator hold)
        raise UserError(f"interleaved1f1b here takes a multiple of the {pp} pipeline ranks as its number of "
                        f"micro-batches (where its bubble formula holds); use --microbatches "
                        f"{pp * max(1, round(microbatches / pp))} (got {microbatches}).")
    if schedule == "dualpipev" and microbatches < 2 * pp:
        raise UserError(f"dualpipev needs at least as many micro-batches as its {2 * pp} stages (2 per rank); "
                        f"use --microbatches {2 * pp} or more (got {microbatches}).")
    if global_batch % microbatches:
        raise UserError(f"--global-batch-size {global_batch} does not split into {microbatches} equal "
                        f"micro-batches; use a multiple of {microbatches}.")


def plan_3d(args) -> dict:
    """What the memory formulas need of a train_3d.py run beyond the model and the batch (the
    ``predict`` of common/run.py's Run, with strategy "2d"): its degrees, schedule and micro-batches."""
    return dict(tp=args.tp, pp=args.pp, microbatches=args.microbatches, schedule=args.schedule)


def check_no_accum(args):
    """A pipeline's micro-batches already are gradient accumulation (each one's backward adds
    into the same gradients before one optimizer step): --grad-accum would only repeat it."""
    if args.grad_accum != 1:
        raise UserError(f"--grad-accum {args.grad_accum}: a pipeline already accumulates gradients over its "
                        f"micro-batches; raise --microbatches instead (now {args.microbatches}).")


def stage_shapes(cfg: ModelConfig, stage: int, n_stages: int, micro_batch: int, seq_len: int, device,
                 logits_dtype: torch.dtype) -> dict:
    """What a stage receives and sends, given up front (PipelineStage's input_args and
    output_args) instead of inferred. Without them the stages agree on shapes by messages
    before the first step, which a dry run's lone rank (--fake-world-size) never receives.
    The first stage reads token ids; the others receive the residual stream (fp32, as it
    crosses stages); the last sends nothing on but its logits, split by nobody here."""
    ids = torch.zeros(micro_batch, seq_len, dtype=torch.long, device=device)
    hidden = torch.zeros(micro_batch, seq_len, cfg.dim, device=device, requires_grad=True)  # its gradient goes back
    last = stage == n_stages - 1
    logits = torch.zeros(micro_batch, seq_len, cfg.vocab_size, dtype=logits_dtype, device=device) if last else None
    shapes = {"input_args": ids if stage == 0 else hidden, "output_args": logits if last else hidden,
              "input_grads": None if stage == 0 else hidden, "output_grads": None if last else hidden}
    # torch 2.13 takes the gradients' shapes too; older versions take only the activations'
    accepted = inspect.signature(PipelineStage.__init__).parameters
    return {k: v for k, v in shapes.items() if k in accepted}


def _one_graph_task():
    """One recomputation for all the autograd calls inside (``GraphExecGroup``; a PyTorch
    without it: none shared)."""
    from torch.utils import checkpoint
    group = getattr(checkpoint, "GraphExecGroup", None)
    return group() if group is not None else contextlib.nullcontext()


class Stage(PipelineStage):
    """A PipelineStage whose weight half (the V schedules split each backward into an input
    half, then a weight half) recomputes a checkpointed block once, not once per group of
    parameters. PyTorch's weight half calls ``torch.autograd.grad`` once per parameter group
    (nine for a dense block), each call a new graph task to ``torch.utils.checkpoint``, which
    recomputes the block for each and keeps what that call left unused until the micro-batch's
    graph is freed: under ``--ac full`` that held 1.2 to 1.5x the formula's peak (the memory
    tests). Run as one group, the calls share one recomputation; the gradients are the same
    (tests/test_model_parallel.py)."""

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
        with _one_graph_task():
            return super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)


class LoneStage(Stage):
    """A dry run's stage (--fake-world-size): its shapes are given (``stage_shapes``), and the
    warm-up vote by which torch 2.13's stages agree to trust given shapes (messages up and
    down the pipeline, which a lone rank never receives) is answered here: yes. Torch 2.11
    has no vote; given shapes are enough there."""

    def _warmup_forward_vote(self, has_backward, received_acc=None):
        return torch.ones(1, dtype=torch.int32, device=self.device)

    def _warmup_backward_result(self, received_result=None):
        return torch.ones(1, dtype=torch.int32, device=self.device)


def pipeline_stages(models, stage_ids, n_stages: int, ctx, cfg: ModelConfig, micro_batch: int, seq_len: int,
                    logits_dtype: torch.dtype, group=None) -> list[PipelineStage]:
    """This rank's PipelineStages. In a dry run (``ctx.fake``) each is a LoneStage, told its
    shapes (``stage_shapes``: the logits in ``logits_dtype``), since it has no neighbours."""
    if not ctx.fake:
        return [Stage(m, s, n_stages, ctx.device, group=group) for m, s in zip(models, stage_ids)]
    return [LoneStage(m, s, n_stages, ctx.device, group=group,
                      **stage_shapes(cfg, s, n_stages, micro_batch, seq_len, ctx.device, logits_dtype))
            for m, s in zip(models, stage_ids)]


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
    if schedule == "zbv":
        from torch.distributed.pipelining import ScheduleZBVZeroBubble
        return ScheduleZBVZeroBubble(stages, n_microbatches=microbatches, loss_fn=loss_fn)
    if schedule == "dualpipev":
        from torch.distributed.pipelining import ScheduleDualPipeV
        return ScheduleDualPipeV(stages, n_microbatches=microbatches, loss_fn=loss_fn)
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    return cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn)


def simulate_schedule(schedule: str, pp: int, microbatches: int, f: float = 1.0, b: float = 2.0):
    """Idle fraction per rank of a schedule's action lists (``schedule_actions``), with uniform stages.

    Each rank runs its actions in order, each as soon as its input has arrived: the forward
    of micro-batch i on stage s after stage s-1's; its backward after stage s+1's (the last
    stage: after its own forward); "W" after the same stage's "I". A whole stage's forward
    costs ``f`` and its backward ``b``; a V schedule's stages are half a rank's layers, so
    f/2 and b/2; "I" and "W" split a backward in equal halves. Communication is free.
    Returns (per-rank idle fraction of the step, step length). For GPipe and 1F1B this gives
    (p-1)/(m+p-1) on every rank, whatever f and b: 1F1B changes the memory, not the bubble.
    """
    total = simulate_shared(schedule, pp, microbatches, f, b)  # a unit per rank: nobody shares
    busy = microbatches * (f + b)
    return [1 - busy / total] * pp, total


def _dependency(kind: str, stage: int, i: int, last: int):
    """The action that must finish before this one can start (None: the first stage's forward)."""
    if kind == "F":
        return ("F", stage - 1, i) if stage > 0 else None
    if kind == "W":
        return ("I", stage, i)
    return ("B", stage + 1, i) if stage < last else ("F", stage, i)


def simulate_shared(schedule: str, pp: int, microbatches: int, f: float = 1.0, b: float = 2.0,
                    units: float | None = None) -> float:
    """The step's length when ``units`` compute units serve the ``pp`` ranks (processor sharing).

    simulate_schedule's action lists and costs (``f``, ``b``: a stage's forward and backward of
    one micro-batch on a whole unit), but the ranks that have an action ready share the units
    equally: each runs at min(1, units / ready). A rank that waits (the bubble) uses no unit,
    so on 4 ranks over 2 CPU cores the others run faster meanwhile. With units >= pp (the
    default) every rank runs an action as soon as its input has arrived: simulate_schedule;
    it is never shorter than the total work / units."""
    order = schedule_actions(schedule, pp, microbatches)
    v = STAGES_PER_RANK[schedule]
    last = pp * v - 1
    cost = {"F": f / v, "B": b / v, "I": b / v / 2, "W": b / v / 2}
    units = pp if units is None else units
    done: set[tuple[str, int, int]] = set()
    pos, left, now = [0] * pp, [None] * pp, 0.0
    while any(pos[r] < len(order[r]) for r in range(pp)):
        ready = []
        for r in range(pp):
            if pos[r] < len(order[r]):
                dep = _dependency(*order[r][pos[r]], last)
                if dep is None or dep in done:
                    ready.append(r)
        if not ready:
            raise RuntimeError("schedule deadlocks")
        speed = min(1.0, units / len(ready))
        for r in ready:
            if left[r] is None:
                left[r] = cost[order[r][pos[r]][0]]
        dt = min(left[r] for r in ready) / speed
        now += dt
        for r in ready:
            left[r] -= dt * speed
            kind, stage, i = order[r][pos[r]]
            if left[r] <= 1e-9 * max(cost[kind], 1e-30):
                done.add((kind, stage, i))
                done.add(("B" if kind == "I" else kind, stage, i))
                pos[r], left[r] = pos[r] + 1, None
    return now


def bubble_formula(schedule: str, pp: int, microbatches: int) -> float:
    """The idle fraction of a step: (p-1)/(m+p-1); interleaving v stages per rank: (p-1)/(v*m+p-1).

    The V schedules: (p-1)/(6m+p-1), with a stage's forward, input-backward and
    weight-backward of one micro-batch taking the same time t (the zero-bubble papers'
    assumption). A rank runs 2 stages x m micro-batches x 3 actions = 6m of them, and
    (p-1) t of idle remains: the last rank waits that long for micro-batch 0 to come down
    the V. Derived by simulating PyTorch's action lists (``simulate_schedule``); exact from
    m >= 2p - 1 micro-batches (DualPipeV demands m >= 2p anyway), a lower bound below.
    """
    if schedule in V_SCHEDULES:
        return (pp - 1) / (6 * microbatches + pp - 1)
    v = STAGES_PER_RANK[schedule]
    return (pp - 1) / (v * microbatches + pp - 1)


def pipeline_loss(losses: list[torch.Tensor], last_rank: int, device, group=None) -> torch.Tensor:
    """The batch loss on every rank of the pipeline: the last stage's mean over micro-batches,
    broadcast from ``last_rank`` (its rank within ``group``)."""
    loss = torch.stack(losses).mean().detach() if losses else torch.zeros((), device=device)
    src = last_rank if group is None else dist.get_global_rank(group, last_rank)
    dist.broadcast(loss, src=src, group=group)
    return loss


def _forward_through_v(stages, x, y, dim: int, pp_group=None) -> list[torch.Tensor]:
    """The whole batch through a V's stages in order, forward only; the loss on the rank with
    the last stage. (PyTorch 2.13's ``eval()`` of the V schedules runs into their backward
    actions, so validation takes this plain path: one message per rank boundary.)"""
    import torch.nn.functional as F
    pp, me = dist.get_world_size(pp_group), dist.get_rank(pp_group)
    owner = [s if s < pp else 2 * pp - 1 - s for s in range(2 * pp)]
    rank = (lambda r: r) if pp_group is None else (lambda r: dist.get_global_rank(pp_group, r))
    mine = {stage.stage_index: stage.submod for stage in stages}
    h, losses = x, []
    for s in sorted(mine):
        if s > 0 and owner[s - 1] != me:  # the activation comes from the neighbour that ran stage s-1
            h = torch.empty(*x.shape, dim, device=x.device)
            dist.recv(h, src=rank(owner[s - 1]), group=pp_group)
        h = mine[s](h)
        if s == 2 * pp - 1:
            losses.append(F.cross_entropy(h.flatten(0, 1).float(), y.flatten()))
        elif owner[s + 1] != me:
            dist.send(h.float().contiguous(), dst=rank(owner[s + 1]), group=pp_group)
    return losses


@torch.no_grad()
def pipeline_evaluate(schedule, tokens, args, device, has_first: bool, has_last: bool, last_rank: int,
                      pp_group=None, dp_group=None, dp_rank: int = 0, dp_size: int = 1, stages=None):
    """Validation loss through the pipeline: forward-only passes of the schedule (for the V
    schedules, of this rank's ``stages`` in order: ``_forward_through_v``).

    With data parallelism too (3-D), each pipeline evaluates its share of every batch and
    the losses are averaged over ``dp_group``.
    """
    if args.eval_batches == 0 or len(tokens) <= args.seq_len * args.global_batch_size or not hasattr(schedule, "eval"):
        return None
    from common.data import Batches
    batches = iter(Batches(tokens, args.seq_len, args.global_batch_size, dp_rank, dp_size, shuffle=False))
    total = 0.0
    n = eval_batch_count(tokens, args)
    for _ in range(n):
        x, y = next(batches)
        x, y = x.to(device), y.to(device)
        losses = []
        if args.schedule in V_SCHEDULES:
            losses = _forward_through_v(stages, x, y, args.model_config.dim, pp_group)
        else:
            schedule.eval(*([x] if has_first else []), target=y if has_last else None, losses=losses)
        total += global_loss(pipeline_loss(losses, last_rank, device, pp_group), dp_group, dp_size).item()
    return total / n
