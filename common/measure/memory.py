"""Where the bytes go: a categorised timeline of live tensor memory, on CPU and CUDA alike.

How it works. During a few recorded steps a ``TorchDispatchMode`` sees the output of every
ATen op; each output storage that is new to us is an allocation, and a weak reference to
it tells us when it is freed. Each storage is then put in one category:

- parameters, gradients, optimizer state: found by walking ``model.parameters()``,
  ``p.grad`` and ``optimizer.state`` at phase boundaries (a gradient is recognised when
  backward hands it to ``p.grad``, and the whole life of its storage counts as gradient);
- activations: allocated in the forward pass and still alive when backward starts, i.e.
  what autograd kept for the backward pass (and the input batch, which the step makes or
  moves to the device);
- other: everything else: forward temporaries, gradients of activations, optimizer
  temporaries, communication buffers, rotary tables;
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

This module records; the rest lives beside it: the categories (memory_categories.py), the
timeline and the files a recording becomes (memory_result.py), the figure (memory_figure.py),
and, apart, the allocator's own count the tests hold the trace to (allocator_count.py).
"""
from __future__ import annotations

import contextlib
import threading
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from common.measure.allocator_count import _AllocatorView, _NoAllocator
from common.measure.memory_categories import CATEGORIES, STAGING
from common.measure.memory_result import TraceResult
from common.measure.storages import _plain_tensors, _storage_bytes, _storage_key

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


def _eager():
    """torch.compile'd code runs eagerly inside (torch >= 2.6; a no-op before)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


def _address(st) -> int | None:
    """Where a storage lives, for the CPU allocator's count; None for a fake tensor's, whose
    storage is a meta one with no address (the estimator's traces: PyTorch warns on asking)."""
    return None if st.device.type == "meta" else st.data_ptr()


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


class MemoryTracer(TraceResult):
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
        self.trained = False  # a step ran in this run (one resumed after its last step trains none)
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
        self.trained = True
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
            rec = _Record(st.nbytes(), 0 if preexisting else self._t, _address(st), preexisting)
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
                rec = _Record(st.nbytes(), self._t, _address(st))
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
