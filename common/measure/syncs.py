"""Count the host-device synchronisations of a training loop, step by step.

A GPU runs what the host queues, in order, while the host goes on queuing. Anything
that needs a device value on the host (``loss.item()``, ``float(t)``, ``if t:``, a
blocking copy) makes the host wait until the GPU has run everything queued so far; the
GPU then idles while the host queues the next step's first kernels. One such wait per
step was most of the harness's 8.8% overhead over a bare loop on an H100.

``SyncCounter`` counts them, per optimizer step (the progress loop marks the steps):
- on CUDA, with ``torch.cuda.set_sync_debug_mode("warn")``: every synchronising CUDA call
  (``.item()``, blocking copies, ``torch.cuda.synchronize``) warns, and is counted;
  compiled code runs as usual;
- on CPU there is nothing to wait for, but the calls that would wait on a GPU still show:
  ``.item()``, ``float(t)``, ``bool(t)`` and ``.tolist()`` of a tensor all reach
  ``aten._local_scalar_dense`` (or, for tolist, a copy to the host), which a dispatch mode
  sees. Blocking host-to-device copies do not show on CPU (they are no-ops there), and
  reads of tensors that live on the host in a CUDA run too are left out (see _HOST_SIDE).
  Under a dispatch mode torch.compile runs eagerly: count eager runs.

    with SyncCounter(device) as syncs:
        ...train...
    syncs.by_step   # {step: syncs from its start to the next's (its log and checkpoint included)}
    syncs.where     # {"file:line": count}, the lines of this repository that synchronised
"""
from __future__ import annotations

import collections
import os
import traceback
import warnings
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from common import own_line
_ACTIVE: list["SyncCounter"] = []  # the counters open now (step_begins tells each)


def step_begins(step: int | None):
    """Called by the progress loop (Metrics.progress) as each step begins, and with None
    once the last one is over; no-op when no counter is open."""
    for counter in _ACTIVE:
        counter._collect_warnings()
        counter.step = "after" if step is None else step
        if step is not None:
            counter.steps.append(step)


def _caller() -> str:
    """The innermost line of this repository in the current stack (where the sync was asked for)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        where = own_line(frame.filename, frame.lineno)
        if where and Path(frame.filename).name != "syncs.py":
            return where
    return "elsewhere"


class _ScalarReads(TorchDispatchMode):
    """Counts the ops that hand a tensor's value to the host (see the module's notes)."""

    def __init__(self, counter: "SyncCounter"):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and not _host_by_design():
            self.counter._count(_caller())
        return func(*args, **(kwargs or {}))


# Reads that stay on the host in a CUDA run too: AdamW keeps its step counts in CPU tensors
# (unless fused or capturable) precisely so that reading them never waits for the GPU, and
# the data loader's sampler draws its seeds and its order on the CPU (PyTorch's, and ours in
# common/data.py, whose tensors are all the host's: a batch goes to the device in the script).
_HOST_SIDE = (f"{os.sep}torch{os.sep}optim{os.sep}", f"{os.sep}torch{os.sep}utils{os.sep}data{os.sep}",
              f"{os.sep}common{os.sep}data.py")


_PLUMBING = (f"utils{os.sep}_python_dispatch", "_compile.py", f"_dynamo{os.sep}")  # wrappers, not askers


def _host_by_design() -> bool:
    """Whether the innermost Python line asking for the value (past this module and
    PyTorch's dispatch plumbing) is one of those."""
    for frame in reversed(traceback.extract_stack()):
        name = frame.filename
        if (name == __file__ or frame.name == "__torch_dispatch__"  # another mode (the comm counter's)
                or any(f"{os.sep}torch{os.sep}{p}" in name for p in _PLUMBING)):
            continue
        return any(part in name for part in _HOST_SIDE)
    return False


class HostCopy:
    """Device tensors copied to the host without waiting; their values read later.

    The copies are queued behind the work that makes the tensors (pinned host memory, so
    the GPU's copy engine does them), then a CUDA event. ``values()`` waits for that event
    only, not for the work queued after it: called one step later, it waits for the
    previous step while the GPU runs the current one. On a CPU the work is done already;
    the copies keep the values as they were (a script may reuse a tensor in place)."""

    def __init__(self, tensors: dict, device: torch.device):
        self.host = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach()
                     .to("cpu", non_blocking=True, copy=True) for k, v in tensors.items()}
        global _newest
        _newest += 1
        self.number = _newest
        self.event = None
        # CUDA path: no CPU test: CUDA's runtime (events, synchronize) does not exist on a CPU;
        # tools/gpu_check.py runs it
        if device.type == "cuda":  # timed: Metrics measures the step time between two of them
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()

    def values(self) -> dict:
        """The Python numbers (lists for tensors with dimensions); waits for the copies."""
        global _reading
        if self.number == _newest:
            # Nothing queued since these copies: waiting for them is waiting for the GPU to
            # run dry, a sync like .item() (done on purpose at a checkpoint and the last step).
            for counter in _ACTIVE:
                counter._count(_caller())
        if self.event is not None:
            self.event.synchronize()
        _reading += 1
        try:
            return {k: v.tolist() for k, v in self.host.items()}
        finally:
            _reading -= 1


_reading = 0  # inside HostCopy.values: reads of host copies, counted there (or not) by their age
_newest = 0  # the number of the newest HostCopy


class SyncCounter:
    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.by_step: dict = {}  # step (or "before" the first, "after" the last) -> syncs
        self.where: collections.Counter = collections.Counter()
        self.step = "before"
        self.steps: list[int] = []  # the steps begun, in order
        self._seen = 0  # CUDA warnings already counted
        self._mode = self._warnings = self._records = None

    def _count(self, where: str):
        self.by_step[self.step] = self.by_step.get(self.step, 0) + 1
        self.where[where] += 1

    def _collect_warnings(self):
        if self._records is None:
            return
        for w in self._records[self._seen:]:
            if "synchronizing" in str(w.message):
                self._count(own_line(w.filename, w.lineno) or "elsewhere")
        self._seen = len(self._records)

    def per_step(self, steps=None) -> list[int]:
        """The counts of these steps (default: every step begun), 0 where none was counted."""
        return [self.by_step.get(s, 0) for s in (self.steps if steps is None else steps)]

    def steady(self) -> list[int]:
        """The counts of the steps but the first (warm-up) and the last (the training loop
        reads its last step's numbers at once, on purpose)."""
        return self.per_step(self.steps[1:-1])

    # CUDA path: no CPU test: set_sync_debug_mode watches CUDA's synchronising calls; a CPU has none, so its
    # scalar reads are counted instead (tests/test_syncs.py); tools/gpu_check.py counts on a GPU
    def __enter__(self):
        if self.device.type == "cuda":
            self._warnings = warnings.catch_warnings(record=True)
            self._records = self._warnings.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        else:
            self._mode = _ScalarReads(self)
            self._mode.__enter__()
            real = torch.Tensor.tolist

            def tolist(t):  # invisible to a dispatch mode on CPU (a copy to the host on CUDA)
                if not _reading and not _host_by_design():
                    self._count(_caller())
                return real(t)
            torch.Tensor.tolist = tolist
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        if self._mode is not None:
            del torch.Tensor.tolist  # back to TensorBase's
            self._mode.__exit__(*exc)
        else:
            torch.cuda.set_sync_debug_mode("default")
            self._collect_warnings()
            self._warnings.__exit__(*exc)
        return False
