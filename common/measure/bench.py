"""Timing collectives the way nccl-tests does, for the communication benchmarks.

A collective is finished when its slowest rank is, so each measurement is the slowest
rank's mean time per call over a block of back-to-back calls. Shared machines are noisy
(a CPU run with more ranks than cores above all), so a size is measured in a few blocks
and the fastest block is kept: noise only ever adds time.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from common.measure.byte_units import fmt_bytes

GB = 1e9  # nccl-tests' GB/s are 10^9 bytes per second


def message_sizes(min_bytes: int, max_bytes: int, factor: int = 2, align: int = 4) -> list[int]:
    """min, min*factor, ... up to max, each rounded down to a multiple of ``align`` bytes."""
    if min_bytes < align or max_bytes < min_bytes or factor < 2:
        raise ValueError(f"need {align} <= min <= max and factor >= 2 (got {min_bytes}, {max_bytes}, {factor})")
    sizes, s = [], min_bytes
    while s <= max_bytes:
        sizes.append(max(align, s // align * align))
        s *= factor
    return sorted(set(sizes))


def check_message_size(max_bytes: int | None, buffers: int = 4):
    """Refuse a --max-size the machine cannot hold before any rank allocates it: every rank
    keeps a few buffers of the largest message (in, out, an all-gather's world of them),
    and all the ranks of this node share its memory. A huge size was an out-of-memory kill."""
    import os

    from common.errors import UserError
    if max_bytes is None:
        return
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None
    if max_bytes < 4 or (ram and max_bytes * buffers * ranks > ram):
        most = (ram // (buffers * ranks)) if ram else 2**30
        raise UserError(f"--max-size {max_bytes} bytes: {ranks} rank(s) with {buffers} buffers of that size each do "
                        f"not fit in this machine's {fmt_bytes(ram or 0)}; give at most {fmt_bytes(most)} "
                        f"({most} bytes).")


def fmt_size(b: float) -> str:
    """A message size without trailing zeros: "1 MiB", "4 KiB"."""
    return fmt_bytes(b, ".4g")


# CUDA path: no CPU test: CUDA's runtime (events, synchronize) does not exist on a CPU; tools/gpu_check.py runs
# it
def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest(seconds: float, device: torch.device) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def time_collective(fn, device: torch.device, max_iters: int = 20, warmup: int = 2, budget_s: float = 0.3,
                    blocks: int = 3) -> tuple[float, int]:
    """(seconds per call of the slowest rank, calls per block) for ``fn()``, a collective every rank calls.

    The number of calls per block comes from a timed probe call (the slowest rank's, so all
    ranks agree on it): as many as fit in ``budget_s``, between 2 and ``max_iters``.
    """
    for _ in range(warmup):  # connections, buffers, NCCL communicators are set up lazily
        fn()
    _sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    _sync(device)
    probe = _slowest(time.perf_counter() - t0, device)
    iters = max(2, min(max_iters, int(budget_s / max(probe, 1e-7))))
    best = float("inf")
    for _ in range(blocks):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync(device)
        best = min(best, _slowest((time.perf_counter() - t0) / iters, device))
    return best, iters
