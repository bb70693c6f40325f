"""Count the bytes each rank communicates, by collective, for any parallel strategy.

``CommCounter`` is a ``TorchDispatchMode`` that watches the c10d ops (what DDP's reducer,
``dist.*`` calls and pipeline send/recv dispatch to) and the functional collectives
(what DTensor, tensor parallelism and FSDP2 use). For each call it records the *logical*
size of the collective: the bytes of the whole tensor it works on, as the formulas in the
README count them:

- all_reduce, broadcast, send, recv, all_to_all: the tensor's bytes;
- all_gather: the gathered (output) bytes, i.e. the full unsharded tensor;
- reduce_scatter: the input bytes, i.e. the full tensor before scattering.

``wire_bytes`` adds what a ring algorithm actually sends per rank: 2(n-1)/n of the size
for all_reduce, (n-1)/n for all_gather and reduce_scatter, the size itself for
point-to-point and broadcast (what a ring broadcast's root sends; gloo's default binomial
tree has its root send it log2(n) times).

``torch.distributed``'s ``CommDebugMode`` counts calls but not bytes and fails under
pipeline parallelism, hence this small counter.

It also records the device of every tensor each collective is handed (``devices``). NCCL
takes GPU tensors only: a CPU scalar in a reduction works on gloo and every CPU test, then
fails on the first GPU node (or, in a dry run on a GPU, passes unnoticed: the fake process
group takes anything). ``CommCounter(expect=device)`` lists each collective handed a
tensor elsewhere, with the line of this repository that issued it (``off_device``).

A dispatch mode only sees its own thread, and ``torch.futures`` callbacks run on the
backend's worker thread without the caller's thread-local state. DDP communication hooks
such as PowerSGD issue collectives from such callbacks, so while a counter is open the
``torch.distributed`` collective functions (``dist.all_reduce`` and co., not send/recv)
also count the calls they get where the mode is not active.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_leaves

# op name (without overload) -> (collective, where its logical size is: an argument's
# index, or "out" for the op's result). c10d ops take (outputs, inputs, group, ...) where
# they have both, and a single tensor list first otherwise.
_OPS = {
    # c10d ops: ProcessGroup methods (DDP's reducer, dist.all_reduce(...), pipelining p2p)
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "allgather_": ("all_gather", 0),
    "_allgather_base_": ("all_gather", 0),
    "allgather_coalesced_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "reduce_scatter_": ("reduce_scatter", 1),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "broadcast_": ("broadcast", 0),
    "alltoall_": ("all_to_all", 1),
    "alltoall_base_": ("all_to_all", 1),
    "send": ("send", 0),
    "recv_": ("recv", 0),
    "recv_any_source_": ("recv", 0),
    "reduce_": ("reduce", 0),
    "gather_": ("gather", 1),
    "scatter_": ("scatter", 0),
    # functional collectives (DTensor, tensor parallel, FSDP2)
    "all_reduce": ("all_reduce", 0),
    "all_reduce_coalesced": ("all_reduce", 0),
    "all_gather_into_tensor": ("all_gather", "out"),
    "all_gather_into_tensor_out": ("all_gather", "out"),
    "all_gather_into_tensor_coalesced": ("all_gather", "out"),
    "reduce_scatter_tensor": ("reduce_scatter", 0),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "all_to_all_single": ("all_to_all", 0),
    "broadcast": ("broadcast", 0),
}
_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
RING_FACTOR = {  # bytes a rank sends in a ring algorithm, per logical byte
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,  # all but the rank's own share, when the splits are even
}


def _nbytes(obj) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(obj) if isinstance(t, torch.Tensor))


def _group_size(args) -> int:
    """The size of the process group an op runs on (its ProcessGroup or group name arg)."""
    for a in args:
        if isinstance(a, dist.ProcessGroup):
            return a.size()
        if isinstance(a, tuple) and len(a) == 2 and hasattr(a[0], "size") and isinstance(a[1], int):
            return a[0].size(a[1])  # (DeviceMesh, dimension): how DTensor names a group
        if isinstance(a, torch.ScriptObject):
            try:  # c10d ops receive the group boxed as a ScriptObject: unbox it first
                return dist.ProcessGroup.unbox(a).size()
            except Exception:  # noqa: BLE001 - not a process group
                pass
    for a in args:
        if isinstance(a, str):
            try:
                from torch.distributed.distributed_c10d import _resolve_process_group
                return _resolve_process_group(a).size()
            except Exception:  # noqa: BLE001
                pass
    return dist.get_world_size() if dist.is_initialized() else 1


def sent_per_step(comm: dict) -> tuple[float, float]:
    """(logical, wire) bytes a rank sends per step, from one rank's ``summary()``: every
    collective but ``recv`` (a point-to-point transfer counts once, at its sender)."""
    keep = [v for k, v in comm.items() if k != "recv"]
    return sum(v["bytes"] for v in keep), sum(v["wire_bytes"] for v in keep)


def _devices(obj) -> set[str]:
    return {str(t.device) for t in tree_leaves(obj) if isinstance(t, torch.Tensor)}


class CommCounter(TorchDispatchMode):
    """``with CommCounter() as comm: ...`` then ``comm.bytes`` = {collective: logical bytes}
    and ``comm.devices`` = {collective: the devices of the tensors it was handed}.
    ``expect``: the run's device; ``comm.off_device`` then lists every collective handed a
    tensor on another device, as "kind on device (file:line)"."""

    def __init__(self, expect: torch.device | str | None = None):
        super().__init__()
        self.expect = None if expect is None else str(torch.device(expect))
        self.reset()

    def reset(self):
        self.bytes: dict[str, int] = defaultdict(int)
        self.wire: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.devices: dict[str, set[str]] = defaultdict(set)
        self.off_device: list[str] = []

    def _record(self, kind: str, size: int, n: int, devices: set[str] = frozenset()):
        ring = RING_FACTOR.get(kind, lambda _: 1.0)(n)
        if getattr(_PURPOSE, "name", None):
            kind = f"{kind} ({_PURPOSE.name})"
        off = sorted(d for d in devices if self.expect is not None and not _same_device(d, self.expect))
        where = _caller() if off else ""
        with _LOCK:  # callbacks on other threads record too
            self.bytes[kind] += size
            self.wire[kind] += size * ring
            self.calls[kind] += 1
            self.devices[kind] |= devices
            self.off_device += [f"{kind} on {d} ({where})" for d in off]

    def __enter__(self):
        self._other_threads = _OtherThreads(self)
        self._other_threads.start()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._other_threads.stop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ns = func.namespace
        name = func._schema.name.split("::")[-1]
        if ns in _NAMESPACES and name in _OPS:
            kind, where = _OPS[name]
            if where == "out":
                size = _nbytes(out[0] if isinstance(out, tuple) and name.endswith("_out") else out)
            else:
                size = _nbytes(args[where])
            self._record(kind, size, _group_size(list(args) + list(kwargs.values())), _devices((args, kwargs)))
        return out

    def summary(self, per: int = 1) -> dict:
        """Per-collective {'calls', 'bytes', 'wire_bytes'}, divided by ``per`` (e.g. steps)."""
        return {k: {"calls": self.calls[k] / per, "bytes": self.bytes[k] / per, "wire_bytes": self.wire[k] / per}
                for k in sorted(self.bytes)}


def _same_device(found: str, expected: str) -> bool:
    """Whether a tensor on ``found`` is where ``expected`` says: cuda:1 is cuda:1, and
    "cuda" without an index matches any GPU."""
    a, b = torch.device(found), torch.device(expected)
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _caller() -> str:
    """The innermost line of this repository outside this file: who issued the collective."""
    import traceback
    from pathlib import Path

    from common import own_line
    for frame in reversed(traceback.extract_stack()):
        where = own_line(frame.filename, frame.lineno)
        if where and Path(frame.filename).name != "comm.py":
            return where
    return "elsewhere"


# torch.distributed function -> (collective, the argument holding its logical size), for
# calls made on threads the dispatch mode does not see (Future callbacks).
_ENTRY_POINTS = {
    "all_reduce": ("all_reduce", "tensor"),
    "all_reduce_coalesced": ("all_reduce", "tensors"),
    "broadcast": ("broadcast", "tensor"),
    "all_gather": ("all_gather", "tensor_list"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "all_gather_single": ("all_gather", "output_tensor"),
    "reduce_scatter": ("reduce_scatter", "input_list"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "all_to_all_single": ("all_to_all", "input"),
}  # not send/recv: P2POp and batch_isend_irecv check dist.isend/irecv by identity
# The functional collectives DTensor calls from inside an op, where no dispatch mode sees
# them: a sharded gradient's norm is reduced inside the norm op itself. Counted only under
# ``purpose`` (the norm); elsewhere, such as loss parallelism's per-token statistics, they
# stay uncounted, as formulas.tp_bytes_per_step says.
_FUNCTIONAL_ENTRY_POINTS = {"all_reduce": ("all_reduce", "self")}
_LOCK = threading.Lock()
_PURPOSE = threading.local()


@contextlib.contextmanager
def purpose(name: str):
    """Count the collectives issued inside as ``<kind> (<name>)``, apart from the step's
    others: ``with purpose("grad norm"): ...`` makes the clipping's all-reduce its own row."""
    saved, _PURPOSE.name = getattr(_PURPOSE, "name", None), name
    try:
        yield
    finally:
        _PURPOSE.name = saved


class _OtherThreads:
    """While open, wrap the ``torch.distributed`` entry points to count the calls made where
    the counter's dispatch mode is not active (it is on the autograd threads, which inherit
    it; not in Future callbacks, nor inside an op that DTensor runs, which issues its own
    collectives while the mode is set aside)."""

    def __init__(self, counter: CommCounter):
        self.counter = counter
        self.inside = threading.local()  # count the outermost call only (entry points call each other)
        self.saved = []

    def start(self):
        import torch.distributed._functional_collectives as funcol
        wrapped = {}  # dist.all_reduce is c10d.all_reduce: give both names the same wrapper
        for module, entry_points in ((dist, _ENTRY_POINTS), (c10d, _ENTRY_POINTS), (funcol, _FUNCTIONAL_ENTRY_POINTS)):
            for name, (kind, arg) in entry_points.items():
                fn = getattr(module, name, None)
                if fn is not None:
                    self.saved.append((module, name, fn))
                    if id(fn) not in wrapped:
                        wrapped[id(fn)] = self._wrap(fn, kind, arg)
                    setattr(module, name, wrapped[id(fn)])

    def stop(self):
        for module, name, fn in reversed(self.saved):
            setattr(module, name, fn)
        self.saved = []

    def _wrap(self, fn, kind, arg):
        sig = inspect.signature(fn)

        functional = fn.__module__.endswith("_functional_collectives")

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if functional and not getattr(_PURPOSE, "name", None):
                return fn(*args, **kwargs)
            if getattr(self.inside, "depth", 0) or any(m is self.counter for m in _get_current_dispatch_mode_stack()):
                return fn(*args, **kwargs)  # the dispatch mode counts it (or an outer wrapper does)
            bound = sig.bind_partial(*args, **kwargs).arguments
            self.inside.depth = 1
            try:
                out = fn(*args, **kwargs)
            finally:
                self.inside.depth = 0
            group = bound.get("group")
            self.counter._record(kind, _nbytes(bound.get(arg)), _group_size([group] if group is not None else []),
                                 _devices([v for k, v in bound.items() if k != "group"]))
            return out

        return wrapper


def print_comm(ctx, comm_by_rank: list[dict] | None, n_params: int):
    """One line per collective: what rank 0 sent per step, against 4N (N fp32 parameters)."""
    from common.measure.byte_units import fmt_bytes
    if not ctx.is_main or not comm_by_rank:
        return
    for kind, c in comm_by_rank[0].items():
        print(f"  {kind + ' per step':<18}  {c['calls']:g} calls, {fmt_bytes(c['bytes'])} logical "
              f"= {c['bytes'] / (4 * n_params):.3f} x 4N, {fmt_bytes(c['wire_bytes'])} sent by a ring", flush=True)
