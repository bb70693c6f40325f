"""The step garbage collector: Python's cycle collector run before every training step over
what the steps made, counting the tensors only it could free (``StepCollector``, which Run
drives), and the full collection between two runs in one process (``collect_between_runs``,
tools/multirun.py)."""
from __future__ import annotations

import gc
import time

import torch

from common.measure.storages import _storage_bytes


class StepCollector:
    """Python's cycle collector, run before every step over what the steps made, counting the
    tensors that only it could free.

    Objects that refer to each other in a ring (a reference cycle: a closure and the object
    that holds it, an exception's traceback and the frames it names) are not freed when the
    last name for them goes, only when Python's cycle collector runs. That collector runs by
    itself after some hundreds of new container objects, and a training step makes few: a
    ring holding tensors would keep them for several steps, GPU memory included (torchtitan
    switches the automatic collection off and collects every N steps for this reason). Here
    everything that exists when the run starts (torch's modules, the model, the optimizer)
    is frozen out of collection (``gc.freeze``), so a full collection before each step looks
    only at what the steps made: a fraction of a millisecond. Whatever tensors it finds in
    rings are counted (``tensor_bytes``, one entry per step), then freed: 0 on every step is
    the sign that nothing of one step outlives it unless a collector runs.
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.objects: list[int] = []       # unreachable objects the collection found, per step
        self.tensor_bytes: list[int] = []  # bytes of the tensor storages among them, per step
        if enabled:
            # Collect first: freezing moves what exists now out of every later collection,
            # garbage included, and garbage frozen here (an earlier run's, in a process that
            # runs several) would outlive every run after it. A full collection looks at every
            # object of torch (0.1-0.3 s on a CPU): needed only when a run has ended in this
            # process since the last one; before a process's first run, or right after
            # collect_between_runs, only the young generations can hold new garbage.
            gc.collect(2 if _RUN_ENDED[0] else 1)
            _RUN_ENDED[0] = False
            gc.freeze()

    def collect(self):
        if not self.enabled:
            return
        started = time.perf_counter()
        flags = gc.get_debug()
        gc.set_debug(flags | gc.DEBUG_SAVEALL)  # keep what it finds in gc.garbage, to look at
        try:
            found = gc.collect()
        finally:
            gc.set_debug(flags)
        # (by type, not isinstance: a dead weakref.proxy among them raises when asked its class)
        nbytes = _storage_bytes([o for o in gc.garbage if issubclass(type(o), torch.Tensor)])
        gc.garbage.clear()
        gc.collect()  # now free them
        self.objects.append(found)
        self.tensor_bytes.append(nbytes)
        if time.perf_counter() - started > 0.002:
            # Many new objects that live on (torch.compile's graphs and guards, made in the first
            # step): freeze them too, so that the collections stay cheap. A step's cycles that are
            # alive just now would be frozen with them; this happens once or twice a run.
            gc.freeze()

    def close(self):
        """Collect what the run made and left in reference cycles (the frozen objects are not
        looked at: a fraction of a millisecond), then give the frozen ones back to the
        collector. Those (the model, the optimizer: the script still holds them) go with the
        next full collection: collect_between_runs when a process runs another run
        (tools/multirun.py), which the next run's start otherwise makes."""
        if self.enabled:
            gc.collect()
            gc.unfreeze()
            _RUN_ENDED[0] = True
            self.enabled = False


_RUN_ENDED = [False]  # a run has ended in this process since the last full collection
_BETWEEN_RUNS = [0]  # how many collect_between_runs this process has made (tools/multirun.py reads it)


def collect_between_runs():
    """Between two runs in one process: everything back to the collector, and a full
    collection, so that nothing of the run that ended is alive when the next one starts
    counting, and so that what it left in reference cycles goes now, on every rank at the same
    point. A process group in a cycle (DDP's Reducer holds one) must not be freed by whichever
    collection happens to run later: gloo's teardown waits for its peers, and a rank that
    freed it inside the next run's start, while the other rank made the next group, hung."""
    gc.unfreeze()
    gc.collect()
    _RUN_ENDED[0] = False
    _BETWEEN_RUNS[0] += 1
