"""Timing a pipeline: each stage's compute, and the bubble (the rest of the step) beside
its formula and the schedule's simulation."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from common.parallelize.pp import SIMULATED, bubble_formula, simulate_schedule


class ComputeTimer:
    """Time each stage's forward and backward micro-batch computations (the busy time).

    Wraps the stage methods every ``torch.distributed.pipelining`` schedule calls, and the
    schedule's ``step``. The bubble is the rest of the pipeline's step: waiting for the
    neighbours. Wall-clock timestamps (``time.time()``) let ``bubble_report`` line the
    ranks up on one shared time axis (the ranks of one machine share its clock; across
    machines, only as well as their clocks agree). The wall clock is read once a step, at its
    start; every time after it is that plus the monotonic clock's progress. The wall clock
    alone can step back (an NTP correction, a virtual machine's clock): read around each
    computation, it once put a computation's start 0.1 ms before the previous one's end.

    A GPU runs asynchronously: the host's clock around a computation would time its
    launches. On CUDA each computation is timed by two events on the GPU's stream, read
    once the step is over; the host waits for the GPU only at the step's two ends, not
    around every micro-batch (which would stop the host from queueing ahead and the
    transfers from overlapping the next computation: a slower pipeline than the real one).
    """

    def __init__(self, schedule, stages, device):
        self.busy_s, self.start, self.end = 0.0, None, None
        self._wall_minus_mono = time.time() - time.perf_counter()  # re-read at each step's start
        # CUDA path: no CPU test: CUDA's events and synchronize exist only with a GPU (the bubble is timed on
        # the host clock on a CPU); tools/gpu_check.py times a pipeline on a GPU
        self.cuda = torch.device(device).type == "cuda"
        self._sync = (lambda: torch.cuda.synchronize(device)) if self.cuda else (lambda: None)
        self._pending: list = []  # CUDA: this step's [kind, stage, micro-batch, start event, end event]
        step, forward_only = schedule.step, getattr(schedule, "eval", None)
        self._untimed = False  # in a validation pass (schedule.eval runs through step): not the step's work

        def timed_step(*args, **kwargs):
            if self._untimed:
                return step(*args, **kwargs)
            self._sync()
            self._wall_minus_mono = time.time() - time.perf_counter()
            self.start = self._wall()
            if self.cuda:
                self._origin = _event()
            try:
                return step(*args, **kwargs)
            finally:
                self._sync()
                self.end = self._wall()
                self._read_events()
        schedule.step = timed_step
        if forward_only is not None:
            def untimed_eval(*args, **kwargs):
                self._untimed = True
                try:
                    return forward_only(*args, **kwargs)
                finally:
                    self._untimed = False
            schedule.eval = untimed_eval
        self.actions: list[list] = []  # this step's [kind, stage, micro-batch, start, end]
        self.timelines: dict[float, list[list]] = {}  # every step's, by its pipeline_start
        for stage in stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                if hasattr(stage, name):
                    setattr(stage, name, self._timed(getattr(stage, name), name, stage.stage_index))

    def _timed(self, fn, name: str, stage_index: int):
        def run(*args, **kwargs):
            if self._untimed:
                return fn(*args, **kwargs)
            # What the schedule asked for: a forward "F"; a whole backward "B"; or, in the
            # zero-bubble schedules, its two halves: "I" (the gradient for the previous stage,
            # on the critical path) and "W" (the weights' gradients, which can wait).
            kind = "F" if name == "forward_one_chunk" else "W" if name == "backward_weight_one_chunk" else \
                "B" if kwargs.get("full_backward", True) else "I"
            mb = args[0] if args else kwargs.get("bwd_chunk_id", kwargs.get("fwd_chunk_id"))
            if self.cuda:
                begin = _event()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self._pending.append([kind, stage_index, mb, begin, _event()])
            begin = self._wall()
            try:
                return fn(*args, **kwargs)
            finally:
                end = self._wall()
                self.busy_s += end - begin
                self.actions.append([kind, stage_index, mb, begin, end])
        return run

    def _wall(self) -> float:
        """Now on the wall clock's scale, read off the monotonic clock: never before an earlier reading."""
        return time.perf_counter() + self._wall_minus_mono

    def _read_events(self):
        """CUDA, after the step's closing wait: each computation's start (from the step's own
        start) and length, by the GPU's clock, placed on the host's."""
        for kind, stage_index, mb, begin, end in self._pending:
            start = self.start + self._origin.elapsed_time(begin) / 1e3
            elapsed = begin.elapsed_time(end) / 1e3
            self.busy_s += elapsed
            self.actions.append([kind, stage_index, mb, start, start + elapsed])
        self._pending = []

    def take(self) -> dict[str, float]:
        """This step's compute seconds and the schedule step's start and end timestamps (its
        actions stay here, in ``timelines``, for ``bubble_report``'s figure)."""
        out = {"busy_s": self.busy_s, "pipeline_start": self.start, "pipeline_end": self.end}
        self.timelines[self.start] = self.actions
        self.busy_s, self.actions = 0.0, []
        return out


def _event():
    """A timing event recorded now on the current CUDA stream."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


def bubble_report(metrics, ctx, schedule: str, pp: int, microbatches: int, timer: ComputeTimer | None = None) -> dict:
    """Measured idle fraction per rank beside the formula and the schedule simulation.

    A step's window runs from the first rank entering the schedule's step to the last rank
    leaving it; a rank's idle time is the window minus its compute. Median over the
    untraced steps after the first (a median shrugs off a step where another program took
    the CPU). With the ``timer``, also the timeline of the median step: each rank's actions
    (kind, stage, micro-batch, start and end in seconds from the window's start) and its
    compute seconds by kind. Every rank must call this (it gathers each rank's timings); a
    dry run (``--fake-world-size``) reports its one rank.
    """
    rows = [r for r in metrics.rows[1:] if not r["traced"]] or metrics.rows
    # Only the steps this process ran have timings (after --resume, rank 0's rows also hold
    # the earlier steps, read back from metrics.jsonl, without them).
    rows = [r for r in rows if r.get("pipeline_start") is not None]
    mine = [(r["step"], r["pipeline_start"], r["pipeline_end"], r["busy_s"]) for r in rows]
    ranks, everyone = _everyone(ctx, mine)
    common = set.intersection(*({s[0] for s in steps} for steps in everyone))
    everyone = [[s for s in steps if s[0] in common] for steps in everyone]
    mine = everyone[ranks.index(ctx.rank)]
    if not mine:
        return {"window_s": None, "per_rank": [], "formula": bubble_formula(schedule, pp, microbatches)}
    windows = [max(rank[i][2] for rank in everyone) - min(rank[i][1] for rank in everyone)
               for i in range(len(mine))]
    per_rank = []
    for rank, steps in zip(ranks, everyone):
        busy = [s[3] for s in steps]
        per_rank.append({"rank": rank, "busy_s": _median(busy),
                         "idle_s": _median([w - b for w, b in zip(windows, busy)]),
                         "idle_fraction": _median([1 - b / w for w, b in zip(windows, busy)])})
    window = _median(windows)
    out = {"window_s": window, "per_rank": per_rank, "formula": bubble_formula(schedule, pp, microbatches)}
    if schedule in SIMULATED:
        try:
            out["simulated"] = simulate_schedule(schedule, pp, microbatches)[0]
        except (AttributeError, TypeError, ValueError):  # a PyTorch whose V schedule builds its lists otherwise
            pass
    if timer is not None:
        out["timeline"] = _median_timeline(timer, everyone, windows, ctx, ranks.index(ctx.rank))
        for rank, actions in zip(per_rank, out["timeline"]):
            rank["busy_by_kind_s"] = {k: sum(a[4] - a[3] for a in actions if a[0] == k) for k in "FBIW"}
    return out


def _median_timeline(timer: ComputeTimer, everyone, windows: list[float], ctx, me: int) -> list[list]:
    """Every rank's actions in the step whose window is the median one, in seconds from its start."""
    i = sorted(range(len(windows)), key=windows.__getitem__)[(len(windows) - 1) // 2]
    start = min(rank[i][1] for rank in everyone)
    mine = [[k, s, mb, a - start, b - start] for k, s, mb, a, b in timer.timelines.get(everyone[me][i][1], [])]
    return _everyone(ctx, mine)[1]


def _everyone(ctx, mine) -> tuple[list[int], list]:
    """(ranks, each one's ``mine``): every rank's where there are peers; else this rank's
    alone. A dry run's other ranks are imaginary: the fake process group would hand back
    this rank's own numbers as theirs, and stage the pickles on whatever device it offers
    (the host), which the dry run's device check would then report against the run."""
    if not ctx.has_peers:
        return [ctx.rank], [mine]
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    return list(range(ctx.world_size)), everyone
