"""The order a pipeline schedule runs its micro-batches in, rank by rank: plain lists, no
process group, no model. Its own module so that the memory formulas (common/measure/theory.py and
splits.py, which common/parallelize/pp.py imports) can read the same orders the schedules run
without importing pp.py back."""
from __future__ import annotations

V_SCHEDULES = ("zbv", "dualpipev")  # two stages per rank, placed in a V


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


def schedule_actions(schedule: str, pp: int, microbatches: int) -> list[list[tuple[str, int, int]]]:
    """Each rank's compute actions in order, as (kind, stage, micro-batch): "F" forward, "B"
    full backward, "I" backward for the input only, "W" backward for the weights only.

    GPipe and 1F1B: ``schedule_order``. The V schedules: the very lists PyTorch's schedule
    builds for each rank (its ``_calculate_single_rank_operations``, run on a stand-in with
    the few attributes it reads), DualPipeV's overlapped pairs unpacked into their two actions.
    """
    if schedule in ("gpipe", "1f1b"):
        return [[(kind, r, i) for kind, i in ops] for r, ops in enumerate(schedule_order(schedule, pp, microbatches))]
    if schedule not in V_SCHEDULES:
        raise ValueError(f"no action list for {schedule}")
    from types import SimpleNamespace

    from torch.distributed import pipelining
    cls = pipelining.ScheduleZBVZeroBubble if schedule == "zbv" else pipelining.ScheduleDualPipeV
    stand_in = SimpleNamespace(pp_group_size=pp, _n_microbatches=microbatches, num_stages=2 * pp, _num_stages=2 * pp)
    out = []
    for r in range(pp):
        ops = []
        for a in cls._calculate_single_rank_operations(stand_in, r):
            for sub in (a.sub_actions or (a,)) if a is not None else ():
                ops.append((str(sub.computation_type.value if hasattr(sub.computation_type, "value")
                                else sub.computation_type), sub.stage_index, sub.microbatch_index))
        out.append(ops)
    return out
