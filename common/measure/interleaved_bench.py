"""Step-time ratios that survive a busy machine.

Runs that follow one another minutes apart on a shared machine see different loads, and
their step times cannot be compared. Here several training set-ups live in one process
and take turns, one step each, in a new random order every round; each set-up's median
step time then comes from the same stretch of time as the others'.
"""
from __future__ import annotations

import random
import statistics
import time
from types import SimpleNamespace
from typing import Callable

import torch
import torch.nn.functional as F

from common.model import build_model, get_config
from common.parallelize.ac import apply_ac
from common.training import AMP_DTYPES, adamw


# CUDA path: no CPU test: CUDA's runtime (events, synchronize) does not exist on a CPU; tools/gpu_check.py runs
# it
def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_saver_step(model_name: str, batch: int, seq_len: int, device, amp: str = "off", ac: str = "none",
                      grad_accum: int = 1, fused_adamw: bool = False, compile: bool = False, seed: int = 0,
                      lr: float = 3e-3) -> Callable[[], None]:
    """One optimizer step of the step-2 scripts (autocast, AC, K micro-batches), as a closure.

    The training loop is the scripts' own, without the data loader, gradient clipping, the
    scaler (bf16 and fp32 need none) and the tracer, none of which changes from one set-up
    to the next.
    """
    device = torch.device(device)
    model = build_model(get_config(model_name), device, seed=seed)
    apply_ac(model, ac)
    optimizer = adamw(model.parameters(), SimpleNamespace(lr=lr), fused=fused_adamw or None)
    if compile:
        model.compile()
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (batch, seq_len), generator=g).to(device)
    y = torch.randint(0, 256, (batch, seq_len), generator=g).to(device)
    dtype = AMP_DTYPES[amp]

    def step():
        for xm, ym in zip(x.chunk(grad_accum), y.chunk(grad_accum)):
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = F.cross_entropy(model(xm).flatten(0, 1), ym.flatten()) / grad_accum
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)

    return step


def matmul_flops(step: Callable[[], None]) -> int:
    """FLOPs of the matrix multiplies one call of ``step`` runs (forward, backward and any
    recomputation), and of attention where FlopCounterMode has a formula for its kernel (not
    the CPU's), counted by PyTorch's FlopCounterMode from shapes.

    Activation checkpointing shows here: full AC runs each block's forward again (about a
    third more), selective AC replays only the cheap ops, whose FLOPs are not counted."""
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops()


def interleaved(steps: dict[str, Callable[[], None]], rounds: int, warmup: int = 2,
                seed: int = 0) -> dict[str, dict]:
    """Time each callable ``rounds`` times, taking turns; {name: {min_s, median_s, times_s}}.

    On a shared machine other jobs only ever add time to a step, so the fastest of the
    rounds (``min_s``) is the best estimate of what the step itself costs."""
    rng = random.Random(seed)
    names = list(steps)
    for _ in range(warmup):  # first calls allocate, pick kernels, fill caches
        for name in names:
            steps[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        rng.shuffle(names)
        for name in names:
            t = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - t)
    return {name: {"min_s": min(ts), "median_s": statistics.median(ts), "times_s": ts} for name, ts in times.items()}

