"""Where the bytes go: a categorised timeline of live tensor memory, on CPU and CUDA alike.

How it works. During a few recorded steps a ``TorchDispatchMode`` sees the output of every
ATen op; each output storage that is new to us is an allocation, and a weak reference to
it tells us when it is freed. Each storage is then put in one category:

- parameters, gradients, optimizer state: found by walking ``model.parameters()``,
  ``p.grad`` and ``optimizer.state`` at phase boundaries (a gradient is recognised when
  backward hands it to ``p.grad``, and the whole life of its storage counts as gradient);
- activations: allocated in the forward pass and still alive when backward starts, i.e.
  what autograd kept for the backward pass;
- other: everything else: forward temporaries, gradients of activations, optimizer
  temporaries, communication buffers, rotary tables, the input batch;
- checkpoint staging, only in a run that has it: the copy of the state that
  ``--ckpt-async`` takes at a checkpoint step inside the traced window (DCP's stager
  makes it outside any op, so the checkpointer hands it over: ``tag``), from the copy
  until its background write ends. It is host memory: in the trace of a CPU run only.

Under FSDP's CPU offload (``offloaded_state``, set by common/parallelize/fsdp.py) the model
state the walk finds (parameter shards, their gradients, AdamW's state) is host memory. On a
GPU the trace never sees it (it follows the GPU's storages only): its bytes are read apart
when the optimizer step begins. On a CPU the host is the traced device: the categories hold
it as before, and the result also says what the device would hold without it.

The phase of each op is known without the training loop's help: backward ops run inside
an autograd graph task, optimizer ops between the optimizer's step hooks, and the rest is
forward, except what names its own phase (gradient clipping, between backward and the
optimizer step: ``named_phase``). The x axis of the figure counts allocation and free events, like
pytorch.org/memory_viz, so the picture is the same on a fast GPU and a slow CPU.

On CUDA the allocator's own history is recorded too (one pickle per rank, to open at
pytorch.org/memory_viz) and the figure states the allocator's peak beside ours. We count
tensor bytes; the allocator rounds each block up to 512 bytes and caches freed blocks, so
its ``max_memory_allocated`` is a little higher and ``nvidia-smi`` higher still.

We do not build on ``torch.profiler``'s ``export_memory_timeline``: it is deprecated and
mislabels optimizer temporaries.
"""
from __future__ import annotations

import contextlib
import gc
import json
import pickle
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

CATEGORIES = ("parameters", "gradients", "optimizer state", "activations", "other")
# A category a run has only if it has the thing: its key is absent from the traces (and
# figures) of every other run, which therefore stay as they were.
STAGING = "checkpoint staging"
EXTRA_CATEGORIES = (STAGING,)
COLORS = {"parameters": "#4C72B0", "gradients": "#DD8452", "optimizer state": "#55A868",
          "activations": "#C44E52", "other": "#8C8C8C", STAGING: "#8172B3"}
STACK_ORDER = ("parameters", "optimizer state", "gradients", "activations", "other")  # persistent at the bottom
# Not a category of the trace: what the allocator held beyond it (CUDA), drawn hatched on top
UNSEEN = "not seen by the trace"


def categories(*traces) -> tuple[str, ...]:
    """The categories these traces hold: the five, then any extra one some trace has."""
    return CATEGORIES + tuple(c for c in EXTRA_CATEGORIES if any(c in t.get("at_peak", {}) for t in traces))


def stack_order(*traces) -> tuple[str, ...]:
    """STACK_ORDER, then the extra categories these traces hold (on top)."""
    return STACK_ORDER + categories(*traces)[len(CATEGORIES):]
PHASE_COLORS = {"forward": "#D9D9D9", "backward": "#969696", "clipping": "#8172B3", "optimizer": "#404040"}
ALLOCATOR_COLOR = "#B8860B"  # the allocator's peak, drawn as a line beside the traced curve

# A phase the code names itself (``with named_phase("clipping"):``): outside backward and the
# optimizer step an op is forward by default, and gradient clipping, which runs between the
# two, would be drawn as an unlabelled second forward.
_NAMED: list[str] = []


@contextlib.contextmanager
def named_phase(name: str):
    """Ops run inside are drawn as phase ``name`` by any recording tracer (a no-op otherwise)."""
    _NAMED.append(name)
    try:
        yield
    finally:
        _NAMED.pop()
_SCANNED = CATEGORIES[:3]  # categories found by walking the model and the optimizer


def _plain_tensors(obj):
    """The plain tensors behind obj, looking inside DTensor and other wrapper subclasses."""
    for t in tree_leaves(obj):
        if not isinstance(t, torch.Tensor):
            continue
        if is_traceable_wrapper_subclass(t):
            attrs, _ = t.__tensor_flatten__()
            yield from _plain_tensors([getattr(t, a) for a in attrs])
        else:
            yield t


def _storage_key(t: torch.Tensor):
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _eager():
    """torch.compile'd code runs eagerly inside (torch >= 2.6; a no-op before)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


def _storage_bytes(tensors) -> int:
    """The bytes of the distinct storages behind ``tensors`` (meta tensors hold none, nor do
    the fake tensors torch.compile leaves behind, whose sizes may be symbolic)."""
    from torch._subclasses.fake_tensor import FakeTensor
    storages = {}
    for t in _plain_tensors(tensors):
        if t.is_meta or isinstance(t, FakeTensor):
            continue
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        storages[st._cdata] = st.nbytes()
    return sum(storages.values())


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


class _Record:
    __slots__ = ("nbytes", "alloc", "free", "category", "activation", "ref", "address", "pre", "ns", "host")

    def __init__(self, nbytes, alloc, address=None, pre=False):
        self.nbytes, self.alloc, self.free, self.address, self.pre = nbytes, alloc, None, address, pre
        self.category, self.activation, self.ref = None, False, None
        # when the trace first saw the block (the CPU count matches its blocks to the trace's by address and time)
        self.ns = 0 if pre else time.time_ns()
        self.host = False  # offloaded model state (offloaded_state): host memory


class _Mode(TorchDispatchMode):
    """The tracer's eyes on every op. It holds its tracer by a weak reference: the tracer
    holds the mode, and a strong reference back would make the two a reference cycle that
    keeps the run's model and optimizer (which the tracer names) alive after the run ends,
    until Python's cycle collector happens to run. In a process that runs several trainings
    one after another, the next run's device memory would then start with this run's."""

    def __init__(self, tracer):
        super().__init__()
        self.on_op = weakref.WeakMethod(tracer._on_op)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.on_op()(out, (args, kwargs))
        return out


class MemoryTracer:
    """Records steps ``start .. start+steps-1`` of a training loop; does nothing otherwise.

    Use: ``with tracer.record(step): <one optimizer step>`` and, after the loop,
    ``tracer.save(out_dir, ctx)``. ``tag(tensors, category)`` classifies tensors the
    default walk cannot know about (FSDP's unsharded parameters, for example).

    ``sources``: extra callables, each returning ``(category, tensors)`` pairs, walked
    with the model and the optimizer (for state the optimizer object does not hold
    itself, such as ZeroRedundancyOptimizer's local optimizer). ``watch(tensors,
    category)`` is for storages that are freed and re-allocated in place with
    ``untyped_storage().resize_()`` (FSDP2's unsharded parameters): no weakref fires for
    those, so their size is re-read after every op.
    """

    def __init__(self, models, optimizers, device, enabled=True, start=1, steps=2, sources=(), count_allocator=True):
        # count_allocator=False: steps under FakeTensorMode (tools/estimate.py's trace) allocate
        # nothing, so there is no count to hold the trace to (and the CPU's profiler cost a
        # quarter of an 8B trace's time)
        self.count_allocator = count_allocator
        self.models = list(models) if isinstance(models, (list, tuple)) else [models]
        self.optimizers = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
        self.sources = list(sources)
        self._watched: dict[int, tuple[weakref.ref, str]] = {}
        self._resized = False  # a storage was resized since the watched ones were last looked at
        self._unpatch = None
        self.device = torch.device(device)
        self.enabled, self.start, self.steps = enabled, start, steps
        self.first_step: int | None = None  # the run's first step here (a --resume starts past 0)
        self.active = False
        self.result: dict | None = None
        self._hooks = []
        self._live: dict[int, _Record] = {}
        self._records: list[_Record] = []
        self._seeded = 0  # bytes alive when recording began (the records made then)
        self._t = 0
        self._phase = None
        self._in_optimizer = False
        self._forward_start = 0
        self.phases: list[tuple[int, str]] = []
        self.step_marks: list[tuple[int, int]] = []
        self._mode = None
        self._cuda_history = False
        self._cuda_snapshot = None
        self._until_done = []
        # A checkpoint's host copy freed by its writer thread: the recording thread takes the
        # free at its next event. (Other frees are recorded where they happen, as always: on
        # CUDA, backward's in autograd's device thread, which is then the one recording.)
        self._thread = threading.main_thread()
        self._freed_elsewhere: list = []
        self._allocator = None  # _AllocatorView, while recording
        self._samples: list[tuple[int, int]] = []  # (event, bytes the CUDA allocator held then)
        # FSDP's CPU offload: the walked model state lives on the host (see the module notes)
        self.offloaded_state = False
        self._host_state: dict[str, int] = {}  # its bytes by category when the optimizer step began

    # ---- what the training loop calls -------------------------------------------------
    def will_record(self, step: int) -> bool:
        return self.enabled and self.start <= step < self.start + self.steps

    @contextlib.contextmanager
    def record(self, step: int):
        if self.first_step is None:
            self.first_step = step
        if not self.will_record(step):
            yield
            return
        if not self.active:
            self._begin()
        self.step_marks.append((self._t, step))
        self._allocator.step_begin()
        # Traced steps run eagerly, on purpose: dynamo cannot run compiled code under a
        # TorchDispatchMode, and when it meets one it gives up on the frame for good, so
        # every later step of a --compile run ran eagerly too. The "force_eager" stance
        # keeps dynamo away from these steps and its compiled code for the others.
        try:
            with _eager(), self._mode:
                yield
        except BaseException:
            self._abandon()  # a step that raised: nothing of the tracer stays hooked into torch
            raise
        self._set_phase(None)
        self._allocator.step_end()
        if step == self.start + self.steps - 1:
            self._end()

    def tag(self, tensors, category: str, follow_resizes: bool = False):
        """Put the storages of ``tensors`` in ``category`` (while recording)."""
        if self.active:
            for t in _plain_tensors(tensors):
                rec = self._track(t)
                if rec is not None:
                    rec.category = category
                    if follow_resizes:
                        self._watched[self._key(t)] = (weakref.ref(t.untyped_storage()), category)
                        self._resized = True

    def staged(self, tensors):
        """The host copy a background checkpoint took of the state (``--ckpt-async``):
        counted as "checkpoint staging" from now until it is freed, if recording. One copy,
        one event: every tensor of it enters at the same point of the timeline."""
        self._take_frees()
        if not self.active:
            return
        at = self._t
        for t in _plain_tensors(tensors):
            rec = self._track(t)
            if rec is not None and rec.alloc >= at:  # (new: not a storage seen before)
                rec.category, rec.alloc = STAGING, at
        self._t = at + 1 if self._t > at else at

    def watch(self, tensors, category: str):
        """Like ``tag``, and keep following the storages' size (see the class notes)."""
        self.tag(tensors, category, follow_resizes=True)

    def until_done(self, handle):
        """Remove this hook ``handle`` when recording ends: the untraced steps (compiled ones
        above all, whose guards would see the tracer's state change) run without it."""
        self._until_done.append(handle)

    # ---- recording ----------------------------------------------------------------------
    def _begin(self):
        self.active = True
        for opt in self.optimizers:
            self._hooks.append(opt.register_step_pre_hook(self._optimizer_pre))
            self._hooks.append(opt.register_step_post_hook(self._optimizer_post))
        # CUDA path: no CPU test: the allocator's history (the snapshot pickle) exists only with a GPU;
        # tools/gpu_check.py writes one per run
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            if hasattr(torch.cuda.memory, "_record_memory_history"):
                torch.cuda.memory._record_memory_history(max_entries=200_000)
                self._cuda_history = True
        self._allocator = (_AllocatorView if self.count_allocator else _NoAllocator)(self.device)
        self._allocator.begin()
        # Everything alive now (weights, optimizer state, buffers) enters at t = 0.
        for cat, tensors in [*self._scanned_tensors(), ("other", _plain_tensors(
                [b for m in self.models for b in m.buffers()]))]:
            for t in tensors:
                rec = self._track(t, preexisting=True)
                if rec is not None and rec.category is None:
                    rec.category = cat
                if rec is not None and self.offloaded_state and cat in _SCANNED:
                    rec.host = True
        # (what was alive before the window: the first block the window allocates enters at t = 0 too)
        self._seeded = sum(r.nbytes for r in self._records)
        self._mode = _Mode(self)
        # A storage resized in place (FSDP2 gathers into and frees its unsharded parameters
        # that way) calls no op: the resize itself says so, and the next op looks at the
        # watched storages (looking at every op cost a quarter of an 8B trace's time).
        resize, tracer = torch.UntypedStorage.resize_, self

        def resize_(storage, *args, **kwargs):
            tracer._resized = True
            return resize(storage, *args, **kwargs)

        torch.UntypedStorage.resize_ = resize_
        self._unpatch = lambda: setattr(torch.UntypedStorage, "resize_", resize)

    def _unhook(self):
        """Take every hook, patch and reference cycle of the recording out of torch and the
        optimizers (each hook is a bound method of the tracer: optimizer -> tracer -> optimizer)."""
        self.active = False
        for h in self._hooks + self._until_done:
            h.remove()
        self._hooks.clear()
        self._until_done.clear()
        if self._unpatch is not None:
            self._unpatch()
            self._unpatch = None
        self._mode = None
        for rec in self._live.values():
            rec.ref = None  # stop listening for frees (each callback names the tracer)
        self._live.clear()
        self._watched.clear()

    def _abandon(self):
        """A traced step raised: stop recording, keep nothing."""
        self._unhook()
        self._records.clear()
        self._samples.clear()
        if self._cuda_history:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._cuda_history = False
        self._allocator = None

    def close(self):
        """Let go of the run: its models, optimizers and sources (a tracer kept by whoever holds
        the run's results must not keep its model and optimizer state alive)."""
        if self.active:
            self._abandon()
        self.models, self.optimizers, self.sources = [], [], []

    def _end(self):
        self._take_frees()
        end = self._t
        self._unhook()
        allocator_peak = self._allocator.end(self._seeded, [(r.address, r.ns) for r in self._records if r.ns])
        if self._cuda_history:
            # Take the allocator's history now and stop recording: left on, it records a
            # stack trace for every allocation of every later step (compiled steps ran 2.3x
            # slower on an H100 that way). save() writes it out.
            self._cuda_snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            self._cuda_history = False
        self.result = self._timeline(end, allocator_peak)
        # What the allocator holds from the device, freed blocks it caches included: the
        # number torchtitan logs as "memory", and what decides an out-of-memory error.
        # CUDA path: no CPU test: reserved memory is the CUDA caching allocator's (a CPU reserves nothing
        # beyond)
        self.result["allocator_reserved_bytes"] = (torch.cuda.max_memory_reserved(self.device)
                                                   if self.device.type == "cuda" else None)
        self.result["allocator_collective_bytes"] = self._allocator.collective_bytes
        self.result["allocator_unseen_at_peak"] = self._allocator.unseen_at_peak
        self._records.clear()
        self._samples.clear()
        self._allocator = None

    def _scanned_tensors(self):
        params = [p for m in self.models for p in m.parameters()]
        yield "parameters", _plain_tensors(params)
        yield "gradients", _plain_tensors([p.grad for p in params if p.grad is not None])
        yield "optimizer state", _plain_tensors([list(s.values()) for opt in self.optimizers
                                                 for s in opt.state.values()])
        for source in self.sources:
            for cat, tensors in source():
                yield cat, _plain_tensors(tensors)

    def _scan(self):
        """Classify the live storages that belong to the model or the optimizer."""
        for cat, tensors in self._scanned_tensors():
            for t in tensors:
                rec = self._live.get(self._key(t))
                if rec is not None and rec.category is None:
                    rec.category = cat
                if rec is not None and self.offloaded_state:
                    rec.host = True

    def _key(self, t):
        return t.untyped_storage()._cdata

    def _track(self, t: torch.Tensor, preexisting: bool = False):
        if t.device.type != self.device.type or t.is_meta:
            return None
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        key = st._cdata
        rec = self._live.get(key)
        if rec is None:
            if st.nbytes() == 0 and key in self._watched:  # freed in place: holds nothing now
                return None
            rec = _Record(st.nbytes(), 0 if preexisting else self._t, st.data_ptr(), preexisting)
            self._t += 0 if preexisting else 1
            rec.ref = weakref.ref(st, lambda _, k=key: self._on_dead(k))
            if key in self._watched:
                rec.category = self._watched[key][1]
            self._live[key] = rec
            self._records.append(rec)
        return rec

    def _check_watched(self):
        """Turn in-place resizes of watched storages into frees and allocations."""
        for key, (ref, cat) in list(self._watched.items()):
            st = ref()
            if st is None:
                del self._watched[key]
                continue
            rec = self._live.get(key)
            if rec is not None and rec.nbytes != st.nbytes():
                self._on_free(key)  # the old size is gone, a new one (if any) starts now
                rec = None
            if rec is None and st.nbytes() > 0:
                rec = _Record(st.nbytes(), self._t, st.data_ptr())
                self._t += 1
                rec.category = cat
                rec.ref = weakref.ref(st, lambda _, k=key: self._on_dead(k))
                self._live[key] = rec
                self._records.append(rec)

    def _on_dead(self, key):
        rec = self._live.get(key)
        elsewhere = threading.current_thread() is not self._thread
        if rec is not None and elsewhere and not rec.pre and self._allocator is not None:
            self._allocator.freed_elsewhere(rec.address)
        if rec is not None and rec.category == STAGING and elsewhere:
            self._freed_elsewhere.append(key)  # (list.append is atomic; the counters are not)
            return
        self._watched.pop(key, None)  # its address may be reused by another storage
        self._on_free(key)

    def _take_frees(self):
        """The frees another thread made since the last event, as one event (a write's end
        drops its whole copy at once)."""
        if not self._freed_elsewhere:
            return
        at, freed = self._t, False
        while self._freed_elsewhere:
            key = self._freed_elsewhere.pop(0)
            self._watched.pop(key, None)
            rec = self._live.pop(key, None)
            if rec is not None and self.active:
                rec.free, freed = at, True
        self._t = at + 1 if freed else at

    def _on_free(self, key):
        rec = self._live.pop(key, None)
        if rec is not None and rec.pre and self._allocator is not None:
            self._allocator.seeded_freed(rec.address, rec.nbytes)
        if rec is not None and self.active:
            rec.free = self._t
            self._t += 1
            self._sample()

    def _sample(self):
        """What the CUDA allocator holds after the newest event (nothing to read on a CPU: _AllocatorView)."""
        held = self._allocator.now() if self._allocator is not None else None
        if held is not None and self._t > 0:
            self._samples.append((self._t - 1, held))

    def _optimizer_pre(self, *_):
        self._scan()  # backward is over: gradients are in p.grad now
        if self.offloaded_state:  # the host's share, traced or not (a GPU run traces the GPU only)
            self._host_state = dict.fromkeys(_SCANNED, 0)
            for cat, tensors in self._scanned_tensors():
                self._host_state[cat] += _storage_bytes([t for t in tensors if t.device.type == "cpu"])
        self._in_optimizer = True
        self._set_phase("optimizer")

    def _optimizer_post(self, *_):
        self._scan()  # optimizer state appears in the first step
        self._in_optimizer = False

    def _set_phase(self, phase):
        if phase == self._phase:
            return
        if phase == "backward":  # what the forward pass left alive is kept for backward
            for rec in self._live.values():
                if rec.alloc >= self._forward_start:
                    rec.activation = True
        if self._phase == "backward":
            self._scan()
        if phase == "forward":
            self._forward_start = self._t
        self._phase = phase
        if self.phases and self.phases[-1][0] == self._t:
            self.phases.pop()  # the previous phase saw no allocation: drop the empty span
        self.phases.append((self._t, phase))  # None: between steps

    def _on_op(self, out, inputs=()):
        if self._freed_elsewhere:
            self._take_frees()
        tensors = list(_plain_tensors(out))
        if not tensors:  # profiler markers and the like: no memory, no phase change
            return
        if self._in_optimizer:
            phase = "optimizer"
        elif torch._C._current_graph_task_id() != -1:
            phase = "backward"
        else:
            phase = _NAMED[-1] if _NAMED else "forward"
        self._set_phase(phase)
        if self._watched and self._resized:
            self._resized = False
            self._check_watched()
        new = [t for t in tensors if _storage_key(t) not in self._live]
        if new:
            # An output that shares its storage with an input (a view, an in-place or out=
            # op) allocated nothing: a slice of the data set is not a new tensor.
            aliased = {_storage_key(t) for t in _plain_tensors(inputs)}
            for t in new:
                if _storage_key(t) not in aliased:
                    self._track(t)
            self._sample()

    # ---- the result ---------------------------------------------------------------------
    def _timeline(self, end: int, allocator_peak) -> dict:
        n = end + 1
        cats = CATEGORIES + tuple(c for c in EXTRA_CATEGORIES if any(r.category == c for r in self._records))
        deltas = np.zeros((len(cats), n + 1), dtype=np.int64)
        host = np.zeros_like(deltas)  # the offloaded model state's share (a CPU run's), apart
        for rec in self._records:
            cat = rec.category or ("activations" if rec.activation else "other")
            i = cats.index(cat)
            for d in (deltas, host) if rec.host else (deltas,):
                d[i, rec.alloc] += rec.nbytes
                if rec.free is not None:
                    d[i, rec.free] -= rec.nbytes
        live = np.cumsum(deltas[:, :n], axis=1)
        total = live.sum(0)
        peak_at = int(total.argmax())
        # The model state when it is complete: the last optimizer step about to begin.
        opt_start = [t for t, ph in self.phases if ph == "optimizer"]
        before_opt = max(opt_start[-1] - 1, 0) if opt_start else None
        series = _downsample(live, peak_at, cats)
        unseen = self._unseen(total, series["event"])
        offloaded = None
        if self.offloaded_state:  # what the device holds: the trace less the host's share
            # CUDA path: no CPU test: a GPU run's trace follows the GPU's storages only, so the host's share is
            # never in it (host_in_trace False, and the walk's sum is all there is of it); the report's use of
            # either case is tests/test_estimate.py::test_report_holds_an_offloaded_run_to_the_device_and_the_host
            device = live - np.cumsum(host[:, :n], axis=1)
            offloaded = {"host_in_trace": self.device.type == "cpu", "host_before_optimizer": self._host_state,
                         "device_before_optimizer": None if before_opt is None else
                         {c: int(device[i, before_opt]) for i, c in enumerate(cats)},
                         "device_peak_by_category": {c: int(device[i].max()) for i, c in enumerate(cats)},
                         "device_peak_bytes": int(device.sum(0).max())}
        return {
            "device": str(self.device),
            "events": n,
            "peak_bytes": int(total[peak_at]),
            "peak_event": peak_at,
            "at_peak": {c: int(live[i, peak_at]) for i, c in enumerate(cats)},
            "peak_by_category": {c: int(live[i].max()) for i, c in enumerate(cats)},
            "before_optimizer": None if before_opt is None else
            {c: int(live[i, before_opt]) for i, c in enumerate(cats)},
            "allocator_peak_bytes": allocator_peak,
            "phases": self.phases,
            "steps": self.step_marks,
            "series": series | ({UNSEEN: unseen.pop("series")} if unseen else {}),
            **({"unseen": unseen} if unseen else {}),
            **({"offloaded": offloaded} if offloaded else {}),
        }

    def _unseen(self, total: np.ndarray, events: list[int]) -> dict | None:
        """CUDA: what the allocator held beyond the traced total at each event (memory the
        trace does not see: blocks alive before the window that are no parameter, gradient,
        optimizer state or buffer, communication buffers, a kernel's workspace...), with the
        part alive when the window began. None on a CPU (see _AllocatorView)."""
        view = self._allocator
        if view is None or view.start_bytes is None:
            return None
        n = len(total)
        held = np.full(n, -1, dtype=np.int64)
        held[0] = view.start_bytes
        for t, b in self._samples:
            if 0 <= t < n:
                held[t] = b
        have = np.where(held >= 0, np.arange(n), 0)
        held = held[np.maximum.accumulate(have)]  # each event: the newest reading at or before it
        gap = np.maximum(held - total, 0)
        return {"alive_before_bytes": max(view.start_bytes - self._seeded, 0), "at_peak": int(gap[int(total.argmax())]),
                "max_bytes": int(gap.max()), "series": gap[np.asarray(events)].tolist()}

    # ---- output -------------------------------------------------------------------------
    def save(self, out_dir, ctx, title: str, ymax: float | None = None, name: str = "memory_trace"):
        """Gather every rank's timeline to rank 0; write the figure and the JSON there.

        On CUDA each rank also writes its own allocator snapshot pickle.
        Returns the list of per-rank results on rank 0 (None elsewhere, or if nothing was
        recorded).
        """
        if not self.enabled:
            return None
        say = getattr(ctx, "print", print) if getattr(ctx, "is_main", True) else (lambda *_: None)
        last = self.start + self.steps - 1
        if self.active:  # the window reaches past the run's last step: keep the steps that ran
            done = [s for _, s in self.step_marks]
            self._end()
            say(f"memory trace: steps {self.start}-{last} were asked for (--trace-start {self.start}, --trace-steps "
                f"{self.steps}) but the run ended at step {done[-1]}; the trace holds step"
                f"{'s' if len(done) > 1 else ''} {', '.join(map(str, done))}.")
        elif self.result is None and self.first_step is not None and self.first_step > last:
            # a --resume past the window: those steps ran, before the checkpoint it resumed from
            say(f"memory trace: nothing recorded, this run resumed at step {self.first_step}: steps "
                f"{self.start}-{last} (--trace-start, --trace-steps) ran before the resume; a --trace-start of "
                f"{self.first_step} or later traces a step of this run.")
        elif self.result is None:
            say(f"memory trace: nothing recorded, the run never reached step {self.start} (--trace-start); "
                f"lower --trace-start or train longer to see its memory.")
        out_dir = Path(out_dir)
        if self._cuda_snapshot is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            with open(out_dir / f"memory_snapshot_rank{ctx.rank}.pickle", "wb") as f:
                pickle.dump(self._cuda_snapshot, f)  # what torch.cuda.memory._dump_snapshot writes
            self._cuda_snapshot = None
        mine = dict(self.result or {}, rank=ctx.rank)
        if dist.is_initialized() and ctx.has_peers:
            gathered = [None] * ctx.world_size if ctx.is_main else None
            dist.gather_object(mine, gathered, dst=0)
        else:
            gathered = [mine]
        if not ctx.is_main:
            return None
        if any("series" not in g for g in gathered):
            return None  # the run ended before the recorded steps
        (out_dir / f"{name}.json").write_text(json.dumps(
            [{k: v for k, v in g.items() if k != "series"} | {"series": g["series"]} for g in gathered]))
        render(gathered, out_dir / f"{name}.png", title=title, ymax=ymax)
        return gathered


def _downsample(live: np.ndarray, peak_at: int, cats=CATEGORIES, max_points: int = 3000) -> dict:
    """At most max_points events, keeping each bucket's highest point and the peak."""
    n = live.shape[1]
    if n <= max_points:
        idx = np.arange(n)
    else:
        total = live.sum(0)
        edges = np.linspace(0, n, max_points + 1).astype(int)
        idx = np.array([a + int(total[a:b].argmax()) for a, b in zip(edges[:-1], edges[1:]) if b > a])
        idx = np.union1d(np.union1d(idx, [0, n - 1]), [peak_at])
    return {"event": idx.tolist(), **{c: live[i, idx].tolist() for i, c in enumerate(cats)}}


def byte_unit(n: float) -> tuple[int, str]:
    """The binary unit a byte count reads best in (at least KiB: for axes and tables)."""
    return (2**30, "GiB") if abs(n) >= 2**30 else (2**20, "MiB") if abs(n) >= 2**20 else (2**10, "KiB")


def fmt_bytes(n: float, spec: str = ".2f") -> str:
    """``n`` bytes in its unit: "1.50 MiB"; ``spec=".4g"`` drops trailing zeros ("1 MiB")."""
    if abs(n) < 2**10:
        return f"{n:{'.0f' if spec == '.2f' else 'g'}} B"
    scale, unit = byte_unit(n)
    return f"{n / scale:{spec}} {unit}"


def render(traces: list[dict], path, title: str, ymax: float | None = None) -> list[dict]:
    """A stacked-area figure, one panel per rank, phases shaded, the peak annotated.

    All panels share one y scale (the highest peak, or ``ymax``), so several runs' traces
    can be compared by eye; a trace's ``label`` key, if any, names its panel, and its
    ``other_ranks`` key, if any (traces of the same run's other ranks), adds each of those
    ranks' total as a line over the stacked areas (tools/compare.py draws runs this way).
    The allocator's own peak over the same steps, where it was measured, is a dashed line:
    the gap between it and the traced curve is memory the trace does not see.

    Returns each panel's layout in pixels ({"box", "peak", "label", "allocator"}: the "at
    the peak" box, the peak marker, its label and the allocator line's height, None without
    one), for the tests: the box never covers the marker.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    def allocator(t):
        return t.get("allocator_peak_bytes") or 0

    peak = max([max(t["peak_bytes"], allocator(t)) for t in traces]
               + [o["peak_bytes"] for t in traces for o in t.get("other_ranks", ())])
    order = stack_order(*traces)
    top = ymax or peak
    scale, unit = byte_unit(top)
    fig, axes = plt.subplots(len(traces), 1, figsize=(12.5, 2.2 + 2.6 * len(traces)), squeeze=False, sharex=False)
    panels = []
    for ax, t in zip(axes[:, 0], traces):
        s = t["series"]
        x = np.asarray(s["event"])
        ys = [np.asarray(s.get(c, np.zeros(len(x)))) / scale for c in order]
        ax.stackplot(x, ys, colors=[COLORS[c] for c in order], step="post", linewidth=0)
        if UNSEEN in s:  # what the allocator held beyond the trace (CUDA), hatched on top of it
            base = np.sum(ys, axis=0)
            ax.fill_between(x, base, base + np.asarray(s[UNSEEN]) / scale, step="post", facecolor="none",
                            hatch="////", edgecolor=ALLOCATOR_COLOR, linewidth=0)
        end = t["events"] - 1
        for o in t.get("other_ranks", ()):
            end = max(end, o["events"] - 1)
        pk, pe = t["peak_bytes"], t["peak_event"]
        # The "at the peak" box stands beside the panel, where it hides nothing (inside, a box
        # away from the peak covered the other step's peak); the peak's label faces the roomier side.
        box_right = pe < 0.5 * end
        for o, ls in zip(t.get("other_ranks", ()), ("-", "--", "-.", ":") * 64):
            so = o["series"]
            ax.plot(so["event"], np.sum([so[c] for c in categories(o)], axis=0) / scale, color="k", linewidth=0.9,
                    linestyle=ls, drawstyle="steps-post", label=f"rank {o['rank']} total", alpha=0.75)
        if t.get("other_ranks"):
            ax.legend(loc="upper left", fontsize=7, frameon=False, bbox_to_anchor=(0, 0.86))
        spans = t["phases"] + [(end, None)]
        for (a, ph), (b, _) in zip(spans[:-1], spans[1:]):
            if ph is None:
                continue
            ax.axvspan(a, b, ymin=0.955, ymax=1.0, color=PHASE_COLORS.get(ph, "#404040"), linewidth=0)
            if b - a > 0.06 * end:
                ax.text((a + b) / 2, 0.977, ph, transform=ax.get_xaxis_transform(), fontsize=7, ha="center",
                        va="center", color="white" if ph not in ("forward",) else "black")
        for ev, step in t["steps"]:
            ax.axvline(ev, color="k", linestyle=":", linewidth=0.8)
            ax.text(ev, 0.93, f" step {step}", transform=ax.get_xaxis_transform(), fontsize=8, va="top")
        alloc = allocator(t)
        alloc_line = ax.axhline(alloc / scale, color=ALLOCATOR_COLOR, linestyle="--", linewidth=1.2) if alloc else None
        (marker,) = ax.plot([pe], [pk / scale], marker="v", color="k", markersize=6)
        label = ax.text(pe, pk / scale, f" peak {fmt_bytes(pk)}", fontsize=8, va="bottom",
                        ha="left" if box_right else "right")
        lines = [f"at the peak ({fmt_bytes(pk)}):"] + [f"{c}: {fmt_bytes(b)}" for c, b in t["at_peak"].items() if b]
        if alloc:
            lines += [f"allocator's peak (dashed): {fmt_bytes(alloc)}", f"traced / allocator: {pk / alloc:.3f}"]
        if t.get("unseen"):
            u = t["unseen"]
            lines += [f"{UNSEEN} (hatched):", f"  {fmt_bytes(u['at_peak'])} here, {fmt_bytes(u['max_bytes'])} at most,",
                      f"  {fmt_bytes(u['alive_before_bytes'])} alive before the step"]
        box = ax.text(1.01, 1.0, "\n".join(lines), transform=ax.transAxes, ha="left", va="top", fontsize=8,
                      bbox=dict(boxstyle="round", fc="white", ec="0.7", alpha=0.9))
        ax.set_xlim(0, end)
        ax.set_ylim(0, top / scale * 1.25)
        ax.set_ylabel(f"live memory ({unit})")
        name = t.get("label") or (f"rank {t['rank']}" if len(traces) > 1 else t["device"])
        ax.set_title(name, fontsize=9, loc="left")
        panels.append((box, marker, label, ax, alloc_line))
    axes[-1, 0].set_xlabel("allocation / free events")
    handles = [Patch(color=COLORS[c], label=c) for c in reversed(order)]
    if any(allocator(t) for t in traces):
        handles.append(Line2D([], [], color=ALLOCATOR_COLOR, linestyle="--", label="allocator's peak"))
    if any(UNSEEN in t["series"] for t in traces):
        handles.append(Patch(facecolor="none", hatch="////", edgecolor=ALLOCATOR_COLOR, label=UNSEEN))
    # The phase bands along the top, every phase named (a short one, like clipping, has no room for its name)
    seen = {ph for t in traces for _, ph in t["phases"] if ph}
    handles += [Patch(color=c, label=f"{ph} (band)") for ph, c in PHASE_COLORS.items() if ph in seen]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=11)
    rows = -(-len(handles) // 6)
    fig.tight_layout(rect=(0, (0.06 if len(traces) > 1 else 0.1) * (1 + 0.5 * (rows - 1)), 1, 0.97))
    fig.savefig(path, dpi=110)
    renderer = fig.canvas.get_renderer()
    layout = []
    for box, marker, label, ax, line in panels:
        mx, my = ax.transData.transform(marker.get_xydata()[0])
        layout.append({"box": box.get_bbox_patch().get_window_extent(renderer).extents.tolist(),
                       "peak": [float(mx), float(my)],
                       "label": label.get_window_extent(renderer).extents.tolist(),
                       "allocator": None if line is None else float(ax.transData.transform((0, line.get_ydata()[0]))[1])})
    plt.close(fig)
    return layout
