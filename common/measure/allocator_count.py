"""The suite's check on the memory tracer, not part of the lesson: the allocator's own count
over the recorded steps, which the trace is held to.

The tracer (common/measure/memory.py) counts the tensors the ops return; this module asks the
allocator what it handed out over the same steps (``_AllocatorView``): on CUDA the caching
allocator's counters, on a CPU PyTorch's profiler's record of every allocation and free
(``_cpu_count``), gloo's collective buffers kept apart. The result's ``allocator_*`` numbers
and the figure's dashed line come from here; tests/test_memory.py, tests/test_step2.py and
tests/tolerances.py hold the trace to them on a CPU, tools/gpu_check.py on CUDA. A reader
learning how the trace works can leave this module unread.
"""
from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path

import torch


@contextlib.contextmanager
def _quiet_stderr():
    """Hide what C++ writes to stderr meanwhile (the profiler's start and stop lines, and
    its one warning that blocks from before it started are freed unseen: expected here)."""
    import os
    import sys
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class _AllocatorView:
    """The allocator's own count over the recorded steps, to hold the trace to.

    CUDA: the caching allocator's counters (``memory_allocated``, its peak per recorded
    step), read at every event of the trace as well, so that what it holds and the trace
    does not see is drawn. CPU: PyTorch's CPU allocator keeps no count unless the profiler
    asks it to (``profile_memory``): the profiler runs over the recorded steps only and
    reports every allocation and free the steps make; the peak is the model state the
    tracer found at the start plus the highest running sum of those. Blocks from before
    the steps that the tracer does not know (the data set's tensor, say) are in neither.

    One thing on a CPU is counted apart: the blocks gloo allocates for a collective, inside
    the ``c10d::`` op on this thread (``_allgather_base_`` stages the whole gathered output
    in a buffer of its own) or on gloo's worker threads (which the profiler follows while
    they run a collective). No op returns them, so the trace cannot see them (NCCL keeps
    its buffers outside PyTorch's allocator); and a free gloo's worker makes after the
    collective, once the main thread has dropped the last reference, never reaches the
    count, a different number of them each run as the threads race. Every event carries
    its block's address: gloo's blocks are paired with their frees and kept out of the
    peak, and reported apart as ``collective_bytes`` (the largest such block). A block the
    trace knows that dies on another thread is told to the count with its address and the
    time (``freed_elsewhere``: the profiler's own record gives its size), and a block whose
    address comes back before any free was seen was freed unseen, and leaves the count there.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.peak = 0
        self.start_bytes = None  # CUDA: allocated when the window began
        self._prof = None
        self.collective_bytes = None  # CPU: the largest block gloo made inside a collective
        self.unseen_at_peak = None  # CPU: {"bytes", "by_op"} alive at the peak, unseen by the trace
        self._frees_elsewhere: list[tuple[int, int]] = []  # CPU: (time in ns, address)
        self._seeded_frees: list[tuple[int, int, int]] = []  # CPU: (time in ns, address, bytes)

    def freed_elsewhere(self, address: int):
        """A block the trace knows died on a thread the profiler does not record."""
        if self._prof is not None:
            self._frees_elsewhere.append((time.time_ns(), address))  # (list.append is atomic)

    def seeded_freed(self, address: int, nbytes: int):
        """A block from before the window (counted in ``seeded``) was freed: the profiler does
        not know its size and says nothing (DDP rebuilds its gradient buckets in its second
        step, for one: the old buckets go)."""
        if self._prof is not None:
            self._seeded_frees.append((time.time_ns(), address, nbytes))

    # CUDA path: no CPU test: the CUDA allocator's own counters exist only with a GPU (a CPU reads its allocator
    # through the profiler, the other branch, which tests/test_step2.py holds to the trace); tools/gpu_check.py
    # compares the CUDA ones with the trace
    def begin(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.start_bytes = torch.cuda.memory_allocated(self.device)
        else:
            from torch.profiler import ProfilerActivity, profile
            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._tid = threading.get_native_id()  # (the trace names a thread by its native id)
            before = torch.empty(16)
            with _quiet_stderr():
                self._prof.__enter__()
                del before  # the allocator's warning about a block from before the profiler: said here, unseen

    # CUDA path: no CPU test: as in begin()
    def step_begin(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    # CUDA path: no CPU test: as in begin()
    def step_end(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = max(self.peak, torch.cuda.max_memory_allocated(self.device))

    def now(self) -> int | None:
        """What the allocator holds now, where reading it costs nothing (CUDA)."""
        # CUDA path: no CPU test: as in begin()
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else None

    def end(self, seeded: int, seen=()) -> int:
        """The allocator's peak over the window. ``seen``: (address, time in ns) of every block
        the trace saw made in it. On a CPU, the blocks alive at the allocator's peak that the
        trace never saw are kept in ``unseen_at_peak``, by the op that allocated them: what
        the trace misses, and why (a matmul's workspace, say)."""
        if self._prof is not None:
            with _quiet_stderr():
                self._prof.__exit__(None, None, None)
            import tempfile  # (the addresses are in the exported trace only, not in its Python events)
            with tempfile.TemporaryDirectory() as tmp:
                self._prof.export_chrome_trace(f"{tmp}/trace.json")
                trace = json.loads(Path(f"{tmp}/trace.json").read_text())
            events, base = trace["traceEvents"], trace.get("baseTimeNanoseconds", 0)
            events += [{"name": "[memory]", "tid": None, "ts": (ns - base) / 1000,
                        "args": {"Addr": address, "Bytes": 0, "Device Type": 0}}
                       for ns, address in self._frees_elsewhere]  # (Bytes 0: whatever was there)
            events += [{"name": "[memory]", "tid": None, "ts": (ns - base) / 1000,
                        "args": {"Addr": address, "Bytes": -nbytes, "Device Type": 0, "seeded": True}}
                       for ns, address, nbytes in self._seeded_frees]
            self._prof = None
            seen_us = [(address, (ns - base) / 1000) for address, ns in seen]
            top, self.collective_bytes, self.unseen_at_peak = _cpu_count(events, self._tid, seen_us)
            self.peak = seeded + top
        return self.peak


class _NoAllocator(_AllocatorView):
    """No count: the steps allocate nothing (fake tensors)."""

    def begin(self):
        pass

    def step_begin(self):
        pass

    def step_end(self):
        pass

    def now(self):
        return None

    def end(self, seeded: int, seen=()):
        return None


def _cpu_count(events: list[dict], main: int, seen=()) -> tuple[int, int, dict | None]:
    """The highest running sum of a profiler trace's CPU allocations and frees, the blocks
    gloo allocates for a collective left out (see _AllocatorView); the largest of those; and
    the blocks alive at the highest sum that the trace never saw, by the innermost op of the
    main thread that allocated them. ``main``: the thread that ran the steps (its ``tid`` in
    the trace). ``seen``: (address, time in the trace's microseconds) of the blocks the trace
    saw: a block is the trace's if it saw that address while the block held it."""
    spans: list[tuple[float, float]] = []  # (start, end) of each c10d op the main thread called
    ops: list[tuple[float, float, str]] = []  # (start, end, name) of every op of the main thread
    memory = []
    for e in events:
        if e.get("ph") == "X" and e["tid"] == main:
            ops.append((e["ts"], e["ts"] + e.get("dur", 0), e["name"]))
            if e["name"].startswith("c10d::"):
                spans.append(ops[-1][:2])
        elif e.get("name") == "[memory]" and e["args"].get("Device Type") == 0:
            memory.append(e)
    memory.sort(key=lambda e: (e["ts"], e["args"].get("Ev Idx", 0)))

    def walk(stop: int = -1):
        live: dict[int, tuple[int, bool, float]] = {}  # address: (bytes, made inside a collective, when)
        running = top = largest = 0
        at = -1
        for i, e in enumerate(memory):
            addr, nbytes = e["args"]["Addr"], e["args"]["Bytes"]
            if nbytes > 0:
                old = live.pop(addr, None)
                if old is not None and not old[1]:
                    running -= old[0]  # freed where the profiler does not look: gone by now
                inside = e["tid"] != main or any(a <= e["ts"] <= b for a, b in spans)
                live[addr] = (nbytes, inside, e["ts"])
                if inside:
                    largest = max(largest, nbytes)
                else:
                    running += nbytes
                    if running > top:
                        top, at = running, i
            elif e["args"].get("seeded"):  # a block from before the window: it was in no running sum
                running += nbytes
            else:
                old = live.pop(addr, None)
                if old is not None and not old[1]:
                    running -= old[0]
            if i == stop:
                return {a: (b, ts) for a, (b, inside, ts) in live.items() if not inside}
        return top, largest, at

    top, largest, at = walk()
    if at < 0:
        return top, largest, None
    by_address: dict[int, list[float]] = {}
    for address, us in seen:
        by_address.setdefault(address, []).append(us)
    # when each block's address next changed hands after it was allocated (its free, or a new block)
    until: dict[tuple[int, float], float] = {}
    last: dict[int, float] = {}
    for e in reversed(memory):
        addr = e["args"]["Addr"]
        if e["args"]["Bytes"] > 0:
            until[(addr, e["ts"])] = last.get(addr, float("inf"))
        last[addr] = e["ts"]
    unseen: dict[str, int] = {}
    for addr, (nbytes, ts) in walk(stop=at).items():
        end = until.get((addr, ts), float("inf"))
        if any(ts <= us <= end for us in by_address.get(addr, ())):
            continue
        inner = [(b - a, name) for a, b, name in ops if a <= ts <= b]
        name = min(inner)[1] if inner else "(no op)"
        unseen[name] = unseen.get(name, 0) + nbytes
    return top, largest, {"bytes": sum(unseen.values()), "by_op": unseen}
