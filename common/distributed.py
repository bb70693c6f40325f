"""Process-group setup shared by every script: torchrun or plain python, GPU or CPU.

torchrun starts one process per rank and tells each who it is through environment
variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT). Under plain
``python`` none are set and we are world size 1. NCCL drives GPUs; gloo drives CPUs, which
is how this tutorial runs several "GPUs" on a laptop.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from common.errors import UserError


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    launched: bool  # started by torchrun (else plain python, world size 1)
    meshes: dict = field(default_factory=dict)
    fake: bool = False  # a dry run: one rank of a larger layout, alone (--fake-world-size)

    @property
    def is_main(self) -> bool:
        """The rank that prints and writes the run's files: rank 0, or the one rank of a dry run."""
        return self.rank == 0 or self.fake

    @property
    def has_peers(self) -> bool:
        """Whether other processes are there to talk to (a dry run's ranks are imaginary)."""
        return self.world_size > 1 and not self.fake

    def print(self, *args, **kwargs):
        """print() on rank 0 only: four ranks saying the same thing is noise."""
        if self.is_main:
            print(*args, **kwargs, flush=True)

    def mesh(self, shape: tuple[int, ...] = (), names: tuple[str, ...] = ()) -> DeviceMesh:
        """A DeviceMesh over all ranks: 1-D (``dp``) by default, or the given shape."""
        shape, names = shape or (self.world_size,), names or ("dp",)
        key = (shape, names)
        if key not in self.meshes:
            check_mesh(shape, names, self.world_size)
            self.meshes[key] = init_device_mesh(self.device.type, shape, mesh_dim_names=names)
        return self.meshes[key]


def check_mesh(shape: tuple[int, ...], names: tuple[str, ...], world_size: int, launched: str = "were launched"):
    """A mesh must tile the ranks exactly. One function, so that tools/estimate.py refuses
    the layouts the scripts refuse with the same sentence (``launched`` says where the
    world size came from)."""
    if any(s < 1 for s in shape):
        raise UserError(f"a {' x '.join(map(str, shape))} mesh ({', '.join(names)}): every size must be "
                        f"at least 1.")
    size = 1
    for s in shape:
        size *= s
    if size != world_size:
        raise UserError(f"a {' x '.join(map(str, shape))} mesh ({', '.join(names)}) needs {size} ranks "
                        f"but {world_size} {launched}; make the product equal the world size.")


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


# Set (to anything), "auto" asks the hardware nothing and stops the run: tests/conftest.py sets
# it for the suite and every process it starts, because "auto" picks a GPU wherever one is
# visible, and a test written for gloo ranks on a CPU (four ranks, one GPU) then fails or, worse,
# passes while checking something else. Every test names its device.
NAME_THE_DEVICE = "TUTORIAL_NAME_THE_DEVICE"


def resolve_device(device: str, local_rank: int, local_world_size: int, device_count: int | None = None) -> torch.device:
    """The device of the rank that is ``local_rank`` of ``local_world_size`` on its node.

    CUDA: GPU ``local_rank`` (never the global rank: on the second node of two, rank 5 is
    local rank 1, and there is no GPU 5). ``device_count``: the GPUs visible, by default
    the real count; a test passes one to ask what a rank would choose on a GPU node."""
    if device_count is None:
        if device == "auto" and os.environ.get(NAME_THE_DEVICE):
            raise UserError(f"--device auto: this process must name its device ({NAME_THE_DEVICE} is set, as the "
                            f"test suite sets it); pass --device cpu or --device cuda.")
        # CUDA path: tests/test_distributed.py::test_ranks_take_their_local_gpu_given_a_gpu_count,
        # tests/test_distributed.py::test_cuda_without_a_gpu_is_a_clear_error
        device_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "auto":
        device = "cuda" if device_count else "cpu"
    if device == "cuda":
        if not device_count:
            raise UserError("--device cuda was asked for but no CUDA GPU is visible; use --device cpu.")
        if local_world_size > device_count:
            raise UserError(f"{local_world_size} ranks per node but only {device_count} visible GPU(s); NCCL needs "
                            f"one GPU per rank: use --nproc-per-node {device_count} or run on CPU with --device cpu.")
        return torch.device("cuda", local_rank)
    if device == "cpu":
        return torch.device("cpu")
    raise UserError(f"--device {device!r}: choose auto, cpu or cuda.")


def rank_device(device: str = "auto", device_count: int | None = None) -> tuple[int, torch.device]:
    """(local rank, device) of this process, from what torchrun sets: LOCAL_RANK and
    LOCAL_WORLD_SIZE (under plain python: 0 of 1)."""
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world = _env_int("LOCAL_WORLD_SIZE", _env_int("WORLD_SIZE", 1))
    return local_rank, resolve_device(device, local_rank, local_world, device_count)


def _restart_store(timeout: timedelta):
    """After a torchrun restart (--max-restarts), a store view whose keys are fresh.

    Workers meet in the agent's TCPStore, which outlives a restart; on torch 2.13 the
    restarted ranks find the dead attempt's keys there (gloo: the old ranks' addresses,
    "Gloo connectFullMesh failed ... Connection refused"). A prefix per attempt gives
    each attempt its own keys. None on the first attempt: the default path is used.

    Only where the workers share the agent's store (TORCHELASTIC_USE_AGENT_STORE, torchrun's
    default): with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 each attempt's rank 0 hosts a fresh
    store at MASTER_PORT, which needs no prefix and which every rank connecting as a client
    would leave unhosted. That is the setting for several nodes (train.slurm sets it): the
    prefix comes from each node's own TORCHELASTIC_RESTART_COUNT, and torchrun does not
    count a restart caused by another node's failure, so nodes could disagree on it.
    """
    attempt = _env_int("TORCHELASTIC_RESTART_COUNT", 0)
    if attempt == 0 or "MASTER_ADDR" not in os.environ or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], _env_int("MASTER_PORT", 29500), is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"restart_{attempt}", store)


@contextlib.contextmanager
def distributed(device: str = "auto", backend: str | None = None, timeout_s: float = 300.0,
                fake_world_size: int | None = None, fake_rank: int = 0, cpu_collectives: bool = False):
    """Set up this process's rank, device and process group; always tear them down.

    Yields a ``Dist``. Under plain ``python`` the process group has one rank (an
    in-process store instead of torchrun's rendezvous), so the same code runs. If a
    process group already exists (a harness that runs several scripts' ``main()`` in one
    job, as the tests' drivers do), the script joins it and leaves it for the harness.

    ``fake_world_size``: a dry run. This one process is rank ``fake_rank`` of that many,
    on PyTorch's fake process group: every collective returns at once without moving a
    byte, so the rank builds its real shards, activations and optimizer state (its memory
    is the real rank's), its byte counts are what it would send, and its losses mean
    nothing (what it would have received is never filled in).

    ``cpu_collectives``: on GPUs, give the process group gloo for the collectives of CPU
    tensors beside NCCL for the GPU's (FSDP's --cpu-offload keeps the gradients on the
    host, and the global gradient norm reduces them there); NCCL alone refuses them.
    """
    if fake_world_size is not None:
        yield from _dry_run(device, fake_world_size, fake_rank)
        return
    if dist.is_initialized():
        local_rank, dev = rank_device(device)
        yield Dist(dist.get_rank(), dist.get_world_size(), local_rank, dev, dist.get_backend(),
                   launched="RANK" in os.environ)
        return
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank, dev = rank_device(device)  # LOCAL_RANK's GPU, not RANK's: see resolve_device
    # CUDA path: tests/test_cuda_paths.py::test_a_gpu_rank_binds_its_gpu_before_the_process_group
    backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
    if backend == "nccl" and dev.type != "cuda":
        raise UserError("--backend nccl needs CUDA GPUs; use gloo on CPU.")
    if dev.type == "cuda":
        # Before anything touches the GPU: otherwise every rank's first CUDA call makes a
        # context on GPU 0 (about 500 MiB each, and 4 ranks crowding one GPU).
        torch.cuda.set_device(dev)
    # device_id binds NCCL to this GPU at once (its barrier and the meshes' groups know it);
    # on a CPU device it raises.
    # CUDA path: tests/test_cuda_paths.py::test_a_gpu_rank_binds_its_gpu_before_the_process_group
    kwargs = {"device_id": dev} if dev.type == "cuda" else {}
    if not launched:  # plain python: a process group of one, so meshes and DDP still work
        kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
    elif (store := _restart_store(timedelta(seconds=timeout_s))) is not None:
        kwargs.update(store=store, rank=rank, world_size=world)
    if launched and world > 1:
        keep_flight_recorder()
    group_backend = f"cuda:{backend},cpu:gloo" if cpu_collectives and backend == "nccl" else backend
    dist.init_process_group(group_backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    if launched:
        _exit_with_launcher(rank)
        _answer_hang_questions(rank)
        # Every rank finishes connecting before any may fail a check and exit: a rank that
        # leaves while another is still inside init_process_group turns a one-line error
        # into a gloo connection traceback on the other rank.
        dist.barrier()
    ctx = Dist(rank, world, local_rank, dev, backend, launched)
    try:
        yield ctx
    except Exception as e:
        if launched and world > 1 and "timed out" in str(e).lower():
            HANG["culprit"] = name_the_stuck_rank(rank, world)  # main_guard adds it to its one line
        raise
    finally:
        if dist.is_initialized():
            # On success every rank gets here; on error, skip the barrier (it would hang
            # on the ranks that did not fail) and just drop the process group.
            if sys.exc_info()[0] is None:
                with contextlib.suppress(Exception):
                    # Drain every group first, not only the default one: gloo's barrier waits
                    # for the work queued before it, and a rank whose peer has left would
                    # otherwise join its group's threads forever when the last object holding
                    # the group (DDP's reducer, at the script's return) lets go of it.
                    for mesh in ctx.meshes.values():
                        for dim in range(mesh.ndim):
                            dist.barrier(group=mesh.get_group(dim))
                    dist.barrier()
                _stop_answering()
                _keep_until_released()
                dist.destroy_process_group()
            else:
                _stop_answering()
                _keep_until_released()
                _drop_after_error(backend)


# The process groups of runs that have ended, held here until release_finished_groups. A gloo
# group's destructor joins its worker threads; when the last reference to it is C++'s (DDP's
# Reducer, freed by a garbage collection after the run), that destructor runs holding Python's
# lock, and a worker still freeing a collective whose tensors have Python objects needs that
# lock: both wait for ever (seen beside a second suite: ~Reducer -> ~ProcessGroupGloo ->
# thread::join on the main thread, ~AsyncAllreduceWork -> decref_pyobject on the worker).
# PyTorch's Python handle to a group lets go of the lock while the group is destroyed, so
# keeping one handle makes the last reference a Python one.
_FINISHED_GROUPS: list = []


def _keep_until_released():
    if not _FINISHED_GROUPS:
        import atexit
        atexit.register(release_finished_groups)  # (registered here, not at import: a forked child clears them)
    _FINISHED_GROUPS.extend(dist.distributed_c10d._world.pg_map)


def release_finished_groups():
    """After a run's objects are gone (main_guard calls this when main returns, tools/multirun
    between runs, and at exit): collect what the run left in reference cycles, DDP's Reducer
    among it (step_gc's full collection between runs: the next run in this process, or
    tools/multirun, need not make another), then drop the groups' last references, without
    the lock. And forget DTensor's
    sharding decisions and redistribution plans: they are cached by meshes that compare equal
    by shape and ranks, not by process group, so a later run in this process whose mesh
    equals this one's (two 3-D dry runs of different ranks did) would reach for its destroyed
    groups."""
    if _FINISHED_GROUPS:
        from common.measure.step_gc import collect_between_runs
        collect_between_runs()
        _FINISHED_GROUPS.clear()
    from torch.distributed.tensor import DTensor, _redistribute
    torch._C._clear_DTensor_sharding_propagator_cache()
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    _redistribute.clear_redistribute_planner_cache()


def distributed_for(args, **kwargs):
    """``distributed`` set up from a script's parsed flags: --device, --pg-timeout and, where
    the script offers a dry run, --fake-world-size and --fake-rank (``kwargs``: the rest)."""
    return distributed(args.device, timeout_s=args.pg_timeout, fake_world_size=getattr(args, "fake_world_size", None),
                       fake_rank=getattr(args, "fake_rank", 0), **kwargs)


def _drop_after_error(backend: str):
    """The process group of a rank that failed (an out-of-memory error in backward, a check).

    NCCL's destroy_process_group waits for this rank's queued collectives to finish, and
    they wait for ranks that are themselves waiting for this one: the failed rank would
    hang until --pg-timeout instead of exiting, and torchrun would not stop the job. Abort
    instead: NCCL's kernels are cancelled and the rank exits at once. (gloo's destroy does
    not wait; PyTorch's abort is NCCL-only.)"""
    if backend == "nccl":
        with contextlib.suppress(Exception):  # (an older torch without it: destroy, below)
            from torch.distributed.distributed_c10d import _abort_process_group
            _abort_process_group()
            return
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


# The flight recorder's buffer: torch reads TORCH_FR_BUFFER_SIZE first, then its old name,
# TORCH_NCCL_TRACE_BUFFER_SIZE. PyTorch's own default is 2000 entries (gloo and NCCL alike,
# recent versions; older ones kept none for gloo).
FR_BUFFER_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


def keep_flight_recorder(entries: int = 2000):
    """Each rank's last collectives in a ring buffer (gloo and NCCL alike): read when a
    collective times out, to name the rank that is stuck. Set only where the person has set
    neither name: setting the new name would silently override their old-named setting."""
    if not any(v in os.environ for v in FR_BUFFER_VARS):
        os.environ[FR_BUFFER_VARS[0]] = str(entries)


def _dry_run(device: str, world: int, rank: int):
    from torch.testing._internal.distributed.fake_pg import FakeStore  # the fake backend registers on import

    if "RANK" in os.environ or dist.is_initialized():
        raise UserError("--fake-world-size runs one rank in one process: start it with plain python, not torchrun.")
    if world < 1 or not 0 <= rank < world:
        raise UserError(f"--fake-rank {rank} is not a rank of --fake-world-size {world}; use 0 to {world - 1}.")
    # CUDA path: tests/test_cuda_paths.py::test_a_dry_run_on_a_gpu_binds_it
    dev = resolve_device(device, 0, 1)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    ctx = Dist(rank, world, 0, dev, "fake", launched=False, fake=True)
    print(f"dry run: rank {rank} of {world} in this one process; collectives are skipped, so its memory and "
          f"bytes are rank {rank}'s and its losses mean nothing.", flush=True)
    try:
        yield ctx
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def require_launcher(ctx: Dist, script: str, min_world: int = 2):
    """For the multi-rank lessons: say how to launch them instead of running alone."""
    if ctx.world_size < min_world:
        raise UserError(f"{script} needs at least {min_world} ranks; launch it with "
                        f"torchrun --nproc-per-node 4 {script}")


def launch_hint(ctx, script: str):
    """Plain ``python`` runs these scripts as one rank (a process group of one); say so."""
    if not ctx.launched and not ctx.fake:
        ctx.print(f"note: plain python runs a single rank; for four, launch "
                  f"torchrun --nproc-per-node 4 {script}")


_watching: set[int] = set()


def _exit_with_launcher(rank: int, every_s: float = 1.0):
    """Stop this worker within seconds if torchrun dies (kill -9 of the launcher): without
    this the workers train on, orphans writing into --out. The launcher is our parent; once
    it is gone the process is handed to another, and our parent pid changes."""
    parent = os.getppid()
    if parent in _watching or parent <= 1:
        return  # already watched (several scripts in one job), or no launcher to lose
    _watching.add(parent)

    def watch():
        while os.getppid() == parent:
            time.sleep(every_s)
        print(f"[rank {rank}] error: the launcher (pid {parent}) is gone; stopping this worker.",
              file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-launcher", daemon=True).start()


# ---- who is stuck: when a collective times out ----------------------------------------------
# A timed-out rank knows only that *it* waited. Every rank keeps its last collectives in the
# flight recorder (TORCH_FR_BUFFER_SIZE); a small thread per rank waits for a question on
# torchrun's store and answers with its last one. The rank whose last collective is behind
# the others' never joined: that is the one to look at. (Under NCCL a timed-out collective
# raises nothing in Python: NCCL's watchdog ends the process and writes each rank's recorder
# to a file; step4_multi_node/README.md says how to read those.)
HANG: dict = {"culprit": ""}
_answering: dict[int, threading.Thread] = {}


def _hang_store():
    """The job's store, under a key prefix of this attempt's: the agent's store outlives a
    restart (a prefix per restart count); a fresh store per attempt needs none."""
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], _env_int("MASTER_PORT", 29500), is_master=False,
                          timeout=timedelta(seconds=10))
    return dist.PrefixStore(f"hang_{_env_int('TORCHELASTIC_RESTART_COUNT', 0)}" if shared else "hang", store)


def last_collective() -> dict | None:
    """This rank's newest flight-recorder entry: {seq, op, sizes, done}, or None.

    Two recorders: NCCL writes to its own (``_dump_nccl_trace``, builds with CUDA), every
    other backend to the generic one (``_dump_fr_trace``, newer torch); a CUDA run reads
    the first, a gloo run the second. Both are read and the newest entry wins."""
    import pickle
    c10d = torch._C._distributed_c10d
    entries = []
    for name in ("_dump_nccl_trace", "_dump_fr_trace"):
        dump = getattr(c10d, name, None)
        try:
            entries += pickle.loads(dump())["entries"] if dump is not None else []
        except Exception:  # noqa: BLE001 - no recorder in this build, or nothing recorded
            continue
    if not entries:
        return None
    e = max(entries, key=lambda e: e.get("collective_seq_id", 0))
    return {"seq": e.get("collective_seq_id"), "op": str(e.get("profiling_name", "?")).split(":")[-1],
            "sizes": e.get("input_sizes"), "done": bool(e.get("retired"))}


def _answer_hang_questions(rank: int):
    if rank in _answering or "MASTER_ADDR" not in os.environ:
        return
    def answer():
        try:
            store = _hang_store()
            while True:
                try:
                    store.wait([f"wake_{rank}"], timedelta(hours=1))
                    break
                except Exception as e:  # noqa: BLE001 - an hour without a question: wait on
                    if "timeout" not in str(e).lower():
                        return  # the store is gone: the job is over
            if store.get(f"wake_{rank}") == b"stop":
                return  # the run is over (_stop_answering)
            store.set(f"rank_{rank}", json.dumps(last_collective()))
        except Exception:  # noqa: BLE001 - a helper for a failure report must never fail a run
            return

    thread = threading.Thread(target=answer, name="hang-answers", daemon=True)
    thread.start()
    _answering[rank] = thread


def _stop_answering():
    """End this rank's answering thread before the process group and its store go: where rank
    0 hosts the store itself (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), a thread still waiting in
    it at exit aborted the process ("terminate called without an active exception")."""
    for rank, thread in _answering.items():
        store = None
        with contextlib.suppress(Exception):  # (the store may be gone already: so is the wait)
            store = _hang_store()
            store.set(f"wake_{rank}", "stop")
        thread.join(timeout=5)
        with contextlib.suppress(Exception):  # a later run of the same job (a harness) waits afresh
            if store is not None:
                store.delete_key(f"wake_{rank}")
    _answering.clear()


def _describe(c: dict | None) -> str:
    if c is None:
        return "no collective yet"
    return f"{c['op']} #{c['seq']} ({'finished' if c['done'] else 'not finished'})"


def name_the_stuck_rank(rank: int, world: int, wait_s: float = 8.0) -> str:
    """One clause naming the rank(s) the others wait for, from every rank's last collective
    ("" when it cannot be known: no store, no recorder)."""
    try:
        mine = last_collective()
        store = _hang_store()
        for r in range(world):  # wake every rank's answering thread
            if r != rank:
                store.set(f"wake_{r}", "1")
        answers, deadline = {rank: mine}, time.time() + wait_s
        while len(answers) < world and time.time() < deadline:
            for r in range(world):
                if r not in answers and store.check([f"rank_{r}"]):
                    answers[r] = json.loads(store.get(f"rank_{r}"))
            time.sleep(0.1)
    except Exception:  # noqa: BLE001 - the report is a bonus; the timeout error stands alone
        return ""
    seqs = {r: (c or {}).get("seq") or 0 for r, c in answers.items()}
    if mine is None or not seqs:
        return ""
    silent = [r for r in range(world) if r not in answers]
    behind = [r for r, q in seqs.items() if q < max(seqs.values())]
    parts = [f"rank {rank} waited in {mine['op']} #{mine['seq']}"]
    parts += [f"rank {r} never got there: its last collective is {_describe(answers[r])}" for r in behind]
    parts += [f"rank {r} did not answer (dead, or stuck outside Python)" for r in silent]
    if not behind and not silent:
        parts.append("every rank reached that collective; one of them called another one or with other sizes")
    return "; ".join(parts)
