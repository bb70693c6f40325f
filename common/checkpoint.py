"""Checkpoints that survive crashes, with torch.distributed.checkpoint (DCP).

Layout: ``<out>/checkpoints/step_00000042/`` holds DCP's files (one or more per rank:
each rank writes only its own shards), ``rng_rank<r>.pt`` (each rank's random state) and
``meta.json`` (step, model, parallel layout, LR schedule, data position). A checkpoint is
written into ``step_..._partial/`` and renamed once every rank has finished, and a
folder without ``meta.json`` is never loaded: a crash in the middle of a write leaves a
``_partial`` folder that resume ignores, never one that looks complete.

``get_state_dict`` / ``set_state_dict`` give the model and optimizer state with keys by
parameter name (no DDP ``module.`` prefix, DTensor shards for FSDP and TP), which is what
lets a checkpoint written by 4 FSDP ranks load on 2: DCP reads each rank's new shard
from whichever files hold it.

The same holds for model parallelism. TP and 2-D save DTensor shards, resharded like
FSDP's. Pipeline stages keep the full model's layer names (``layers.3...``), and each
rank saves and loads only the names it owns, so a checkpoint from 2 stages resumes on 4
(interleaved) or on another strategy; tests/test_checkpoint.py checks the 2 -> 4 case
(the losses match bit for bit; 3-D from 1F1B to interleaved, pp 2 x dp 1 x tp 1,
was checked by hand the same way). The saved ``parallel`` layout is therefore not a
reason to refuse; the model shape, batch, sequence length, seed, data and gradient
accumulation are.

``--ckpt-async``: ``dcp.async_save`` copies the state to host memory (the step waits for
that), then a thread writes it, on a gloo group of its own; rank 0 declares the checkpoint
(meta.json, the rename) only once the write has ended everywhere. One write at a time.

Preemption: a SIGTERM or SIGUSR1 (a cluster taking the nodes back; torchrun forwards both
to every rank when told to) is only noted by the rank that gets it. At the end of every
step each rank puts its "stop?" flag into one all-reduce (MAX) on the device and copies
the result to the host without waiting; the next step reads it. So the ranks decide
together, at the same step, even when the signal reached one rank alone, and no step waits
for the vote. Then every rank saves that step and the run exits with EXIT_PREEMPTED (75)
and "preempted at step N ...; resume with --resume". A signal in the last step (no step is
left to stop before) lets the run complete: exit 0, and one line saying so (``Run.finish``).
A script whose state this module cannot save (DeepSpeed's engine, ``can_save=False``) stops
at the agreed step unsaved, exit 75, saying the steps are lost.

Ctrl-C (SIGINT: torchrun passes it on to every rank) is voted on the same way, but stops
without saving: the person wants the run to end now, and saving a large model takes minutes.
A checkpoint being written in the background is finished first; then every rank stops at the
agreed step, exit 130, and rank 0 says which checkpoint ``--resume`` would continue from (a
SIGTERM to torchrun is the way to stop with a checkpoint). A second Ctrl-C ends every rank at
once, mid-step (common/errors.py): under torchrun it reaches torchrun alone, which then sends
every rank SIGTERM, taken as that second Ctrl-C by a rank that had the first. A rank that
reaches no step end soon after the Ctrl-C stops by itself (``_give_up_if_stuck``), before
torchrun's SIGKILL 30 s after it.

The end of a run: a rank killed after the last step's checkpoint, before ``summary.json``
(written last), leaves a run whose training is done and whose outputs are not. ``--resume``
then finds the last step's checkpoint, every step in metrics.jsonl and no summary.json: it
loads the checkpoint, trains nothing and lets the run write its outputs (``finishing``).
With a summary.json there the run is complete and ``--resume`` refuses ("nothing is left to
train"), except in a torchrun restart, which writes the outputs again.

Also here, because they belong to the same "the run must survive" step: the non-finite
loss check and the fault injection (``--fail-at-step``, ``--fail-how``) used to test
elastic restarts and preemption.

``python -m common.checkpoint export <checkpoint folder> <file.pt>`` turns a checkpoint
into one plain ``torch.save`` file of full tensors for inference.
"""
from __future__ import annotations

import argparse
import atexit
import inspect
import json
import logging
import math
import os
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from common.errors import Interrupted, Preempted, UserError, note_ctrl_c
from common.measure.syncs import HostCopy

PARTIAL = "_partial"
# What a cluster sends before it takes the nodes back: Slurm's SIGTERM at the time limit or
# on preemption, and the early warning asked for with #SBATCH --signal=B:USR1@120.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# The vote: MAX over the ranks of each one's wish, so a stop signal's save wins over a Ctrl-C's
# stop where both came.
GO_ON, STOP_UNSAVED, STOP_SAVED = 0.0, 1.0, 2.0
CTRL_C_PATIENCE_S = 20.0  # at most, after a Ctrl-C, for a step to end: torchrun SIGKILLs every rank at 30
FAIL_HOW = ("exit", "sigterm", "sigusr1", "sigterm-torchrun")


def add_flags(p: argparse.ArgumentParser):
    g = p.add_argument_group("surviving failures")
    g.add_argument("--ckpt-every", type=int, default=0,
                   help="save a checkpoint every N steps into <out>/checkpoints (default: 0, never)")
    g.add_argument("--ckpt-keep", type=int, default=2, help="keep the newest K complete checkpoints (default: 2)")
    g.add_argument("--ckpt-async", action="store_true",
                   help="write checkpoints in the background (torch.distributed.checkpoint.async_save): the step waits "
                        "only for the copy of the state to host memory; one write at a time")
    g.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in <out>/checkpoints, if there is one")
    g.add_argument("--on-nan", choices=["stop", "skip"], default="stop",
                   help="a non-finite loss stops the run (default) or skips that step's update")
    g.add_argument("--fail-at-step", type=int, default=None,
                   help="testing: crash at this step, on the first attempt only (see --max-restarts)")
    g.add_argument("--fail-rank", type=int, default=0, help="testing: the rank --fail-at-step crashes (default: 0)")
    g.add_argument("--fail-how", choices=FAIL_HOW, default="exit",
                   help="testing: what --fail-at-step does to --fail-rank: exit (a hard crash, default), sigterm or "
                        "sigusr1 (that rank alone gets the signal, while its checkpoint of the step is written), "
                        "sigterm-torchrun (it sends SIGTERM to torchrun, which forwards it to every rank)")
    g.add_argument("--pg-timeout", type=float, default=600.0,
                   help="seconds a collective may wait before the run fails instead of hanging (default: 600)")


PG_TIMEOUT_RANGE = (1, 30 * 24 * 3600)


def check_flags(args):
    if args.ckpt_every < 0:
        raise UserError(f"--ckpt-every cannot be negative (got {args.ckpt_every}); 0 turns checkpoints off.")
    if not args.pg_timeout > 0:
        raise UserError(f"--pg-timeout must be positive seconds (got {args.pg_timeout}).")
    if getattr(args, "ckpt_async", False) and not args.ckpt_every:
        raise UserError("--ckpt-async says how checkpoints are written, and --ckpt-every is 0 (none are); give "
                        "--ckpt-every N too.")
    if args.ckpt_keep < 1:
        raise UserError(f"--ckpt-keep must be at least 1 (got {args.ckpt_keep}).")
    if not math.isfinite(args.pg_timeout):
        raise UserError(f"--pg-timeout must be a finite number of seconds (got {args.pg_timeout}).")
    if not PG_TIMEOUT_RANGE[0] <= args.pg_timeout <= PG_TIMEOUT_RANGE[1]:
        # Below a second every collective "times out" while the ranks are still starting;
        # far above, the timedelta overflows inside c10d (1e300 s was a deep traceback).
        raise UserError(f"--pg-timeout {args.pg_timeout:g} is out of range: give between {PG_TIMEOUT_RANGE[0]} and "
                        f"{PG_TIMEOUT_RANGE[1]} seconds (30 days).")
    if args.fail_at_step is not None and not 0 <= args.fail_at_step < args.steps:
        raise UserError(f"--fail-at-step {args.fail_at_step} is not a step of this run (0 to {args.steps - 1}).")
    if args.fail_rank < 0:
        raise UserError(f"--fail-rank cannot be negative (got {args.fail_rank}).")
    if args.fail_how != "exit" and args.fail_at_step is None:
        raise UserError(f"--fail-how {args.fail_how} says what happens at --fail-at-step; give that step too.")
    if args.fail_how == "sigterm-torchrun" and "TORCHELASTIC_RUN_ID" not in os.environ:
        raise UserError("--fail-how sigterm-torchrun signals the torchrun that started this run, and there is none; "
                        "launch with torchrun, or use --fail-how sigterm.")
    # torchrun says the world size before any group exists: refuse here, on every rank alike.
    # (Refused later, after DDP's first collectives, the ranks' gloo teardown could hang.)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.fail_at_step is not None and args.fail_rank >= world and not getattr(args, "fake_world_size", None):
        raise UserError(f"--fail-rank {args.fail_rank} does not exist: this run has ranks 0 to {world - 1}.")


META_KEYS = ("step", "model", "model_config", "world_size", "parallel", "global_batch_size", "seq_len", "seed",
             "data", "scheduler", "data_position")


def read_meta(path: Path) -> dict:
    """meta.json of a checkpoint, or one sentence saying why it cannot be used."""
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"checkpoint {path}: meta.json cannot be read ({type(e).__name__}); move the folder "
                        f"aside to resume from the one before it.") from None
    missing = [k for k in META_KEYS if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise UserError(f"checkpoint {path}: meta.json lacks {', '.join(missing)}; it was not written by this "
                        f"tutorial's checkpointer (or was edited); move the folder aside.")
    return meta


# What a checkpoint's numbers depend on, as (meta.json key, flag, default for checkpoints
# written before the key was saved). The parallel layout, --steps (raising it is how a finished
# run continues) and the pipeline schedule are not here: DCP reshards by parameter name, and
# none of them changes the numbers already trained.
RUN_SETTINGS = (("model", "--model", None), ("n_layers", "--n-layers", None),
                ("global_batch_size", "--global-batch-size", None), ("seq_len", "--seq-len", None),
                ("lr", "--lr", None), ("warmup_steps", "--warmup-steps", None), ("data", "--data", None),
                ("seed", "--seed", None), ("grad_accum", "--grad-accum", 1),
                ("data_id", "--data's contents (prepared folder's meta.json hash)", None),
                ("doc_mask", "--doc-mask", False))


def config_differences(meta: dict, args) -> list[str]:
    """'--lr 0.001 there, 0.003 here' for every setting the checkpoint's run had otherwise."""
    saved = dict(meta)
    saved.setdefault("n_layers", (meta.get("model_config") or {}).get("n_layers"))
    saved.setdefault("grad_accum", meta.get("grad_accum_steps", 1))  # the data position counts micro-batches
    here = {"n_layers": args.model_config.n_layers, "grad_accum": getattr(args, "grad_accum", 1),
            "doc_mask": getattr(args, "doc_mask", False)}
    diff = []
    for key, flag, default in RUN_SETTINGS:
        there, now = saved.get(key, default), here.get(key, getattr(args, key, None))
        if there is not None and there != now:
            diff.append(f"{flag} {there} there, {now} here")
    if not diff and meta.get("model_config") not in (None, args.model_config.as_dict()):
        diff.append(f"--model {meta.get('model')} there had another shape than --model {args.model} here")
    return diff


def complete_checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints in ``folder``, oldest first."""
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith("step_")
             and not p.name.endswith(PARTIAL) and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: p.name)


class Checkpointer:
    """Saves and restores everything a run needs to continue exactly where it stopped.

    ``parts`` is a list of (model, optimizer) pairs: one for most strategies, one per
    pipeline stage this rank holds. Their state dicts are merged by parameter name, so
    the checkpoint does not depend on how layers were split among ranks.
    """

    def __init__(self, args, ctx, parts, scheduler=None, batches=None, parallel: dict | None = None,
                 can_save: bool = True):
        self.args, self.ctx = args, ctx
        # False: a script whose state this checkpointer cannot save (DeepSpeed's engine, which
        # refuses --ckpt-every and --resume); a stop signal then stops every rank unsaved
        self.can_save = can_save
        # A part may name several modules that share one optimizer (the two stages of an
        # interleaved pipeline rank): DCP maps an optimizer's parameters through one module.
        self.parts = [(_union(m) if isinstance(m, (list, tuple)) else m, o) for m, o in parts]
        self.scheduler, self.batches = scheduler, batches
        self.parallel = parallel or {"dp": ctx.world_size}
        self.folder = Path(args.out) / "checkpoints"
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if args.fail_at_step is not None and args.fail_rank >= ctx.world_size:
            raise UserError(f"--fail-rank {args.fail_rank} does not exist: this run has ranks 0 to "
                            f"{ctx.world_size - 1}.")
        self.signalled: str | None = None  # the stop signal this rank received, if any
        self.ctrl_c = False  # this rank received a Ctrl-C (SIGINT)
        self.stopping = GO_ON  # what the ranks agreed at the last vote read
        self.finishing = False  # resumed from the last step's checkpoint: only the outputs are left to write
        self._vote = None  # the HostCopy of the last step's vote, read one step late
        self._flag = None  # the vote's device tensor, reused: filling it queues no host wait
        self._handlers, self._closed = {}, threading.Event()  # set by close(): the watch below ends
        self._watch = None  # the thread of _give_up_if_stuck, once a signal has started it
        # --ckpt-async: the write in flight (thread, step, folder), its error, its host copy's bytes
        self._writing, self._write_error, self.staging_bytes, self.write_seconds = None, None, 0, []
        self.on_staged = None  # called with each background checkpoint's host copy (Run: the memory tracer)
        self._write_group = None
        if getattr(args, "ckpt_async", False) and dist.is_initialized() and not getattr(ctx, "fake", False):
            # every rank, at once (a collective); on GPUs it is also the CPU backend async_save requires
            self._write_group = dist.new_group(backend="gloo")
        self._progress, self._longest = time.monotonic(), 0.0  # step ends and saves, for _give_up_if_stuck

    # ---- preemption ---------------------------------------------------------------------
    def listen(self):
        """From now until ``close``, SIGTERM and SIGUSR1 ask every rank to save and stop, and
        Ctrl-C (SIGINT) to stop."""
        if not getattr(self.ctx, "fake", False) and threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._handlers[sig] = signal.signal(sig, self._on_signal)
            self._handlers[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_ctrl_c)

    def _on_signal(self, signum, frame):
        if self.ctrl_c and signum == signal.SIGTERM:
            # torchrun answers a second Ctrl-C (it alone gets them) with SIGTERM to every rank:
            # the person asked twice, so this is that second Ctrl-C, not a cluster's "save".
            note_ctrl_c()  # (ends the process)
        # Only a note: the step goes on, and nothing is printed here (a print inside a print
        # that the signal interrupted raises "reentrant call").
        first, self.signalled = self.signalled is None and not self.ctrl_c, signal.Signals(signum).name
        if first:
            self._start_watch(signum)

    def _on_ctrl_c(self, signum, frame):
        # A note too, instead of Python's KeyboardInterrupt: raised wherever the step happens to
        # be, it left a rank mid-collective and its peers with a gloo traceback, and raised in a
        # finalizer (the memory tracer's) it was swallowed and the rank trained on.
        note_ctrl_c()  # a second Ctrl-C ends the process there
        first, self.ctrl_c = self.signalled is None and not self.ctrl_c, True
        if first:
            self._start_watch(signum)

    def _start_watch(self, signum: int):
        self._watch = threading.Thread(target=self._give_up_if_stuck, args=(signum,), name="stop-watch", daemon=True)
        self._watch.start()

    def mark_progress(self):
        now = time.monotonic()
        self._longest = max(self._longest, now - self._progress)
        self._progress = now

    def _give_up_if_stuck(self, signum: int):
        """torchrun sends the same SIGTERM when it stops the job because another rank died:
        then the step in flight waits for a rank that is gone (NCCL waits until --pg-timeout)
        and would hold up the restart until torchrun's SIGKILL. A rank that reaches no step
        end (nor a checkpoint's start or end) in 3 times the longest step or save seen so far,
        and at least 10 s, after the signal stops at once; after a Ctrl-C, in at most
        CTRL_C_PATIENCE_S, so that the rank says why it stopped before torchrun kills it."""
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        while not self._closed.wait(0.2):
            idle, patience = time.monotonic() - self._progress, max(10.0, 3 * self._longest)
            if signum == signal.SIGINT:
                patience = min(patience, CTRL_C_PATIENCE_S)
            if idle > patience and not self._closed.is_set():
                print(f"[rank {self.ctx.rank}] {name}: no step ended in {idle:.0f} s since the signal "
                      f"(another rank is gone?); stopping without a checkpoint.", file=sys.stderr, flush=True)
                os._exit(128 + signum)

    def signal_at_the_end(self) -> str | None:
        """At the end of a run that finished every step: the stop signal any rank received and
        no vote turned into a stop (it came in the last step, or after it), else None. Every
        rank calls this (one reduction, once a run)."""
        if getattr(self.ctx, "fake", False):
            return None
        got = signal.Signals[self.signalled] if self.signalled else signal.SIGINT if self.ctrl_c else None
        code = torch.tensor([float(got.value if got else 0)], device=self.ctx.device)
        if self.ctx.has_peers:
            dist.all_reduce(code, op=dist.ReduceOp.MAX)
        return signal.Signals(int(code.item())).name if code.item() else None

    def close(self):
        """Give the signals back to whoever had them (a harness running several runs), and end
        the watch on a stuck step."""
        for sig, old in self._handlers.items():
            signal.signal(sig, old)
        self._handlers = {}
        self._closed.set()
        if self._watch is not None:
            # Joined here, while the run is alive: a watch thread that ended during Python's exit
            # let go of this checkpointer (its target) there, freeing the model's tensors from a
            # thread that may no longer run, and the rank aborted ("terminate called without an
            # active exception").
            self._watch.join()
            self._watch = None

    def _cast_vote(self):
        """This rank's "stop?" into one all-reduce (MAX), read by the next step's
        ``stop_agreed``. On a GPU the reduction and the copy to the host are queued behind
        the step's work and nothing waits for them now."""
        if self._flag is None:
            self._flag = torch.zeros(1, device=self.ctx.device)
        self._flag.fill_(STOP_SAVED if self.signalled else STOP_UNSAVED if self.ctrl_c else GO_ON)
        if self.ctx.has_peers:
            dist.all_reduce(self._flag, op=dist.ReduceOp.MAX)
        self._vote = HostCopy({"stop": self._flag}, self.ctx.device)

    def stop_agreed(self) -> bool:
        """Whether any rank got a stop signal by the end of the previous step. The same
        answer on every rank, from the same reduction: they all stop after this step."""
        if self._vote is None:
            return False
        self.stopping, self._vote = float(self._vote.values()["stop"][0]), None
        return self.stopping > GO_ON

    def _stop_after_ctrl_c(self, step: int):
        """Every rank stops after ``step``, unsaved; rank 0's line says what --resume would do."""
        self.wait()  # a background write under way: finished and declared, the newest checkpoint
        self.close()
        kept = complete_checkpoints(self.folder)
        if kept:
            saved = int(kept[-1].name.split("_")[1])
            again = f"step {step} is" if saved + 1 == step else f"steps {saved + 1}-{step} are"
            told = (f"--resume continues from {kept[-1]} (step {saved}), so {again} trained again" if saved < step
                    else f"--resume continues from {kept[-1]}: nothing is lost")
        else:
            told = f"no checkpoint was written, so the {step + 1} steps trained are lost"
        hint = "; a SIGTERM (to torchrun, if it launched the run) stops with a checkpoint" if self.can_save else ""
        raise Interrupted(f"interrupted (Ctrl-C): every rank stopped after step {step}, unsaved; {told}{hint}.")

    def _send_fault_signal(self):
        """--fail-how sigterm/sigusr1/sigterm-torchrun: what a cluster does, on cue."""
        how = self.args.fail_how
        sig = signal.SIGUSR1 if how == "sigusr1" else signal.SIGTERM
        target = os.getppid() if how == "sigterm-torchrun" else os.getpid()  # torchrun started this worker
        print(f"[rank {self.ctx.rank}] --fail-at-step {self.args.fail_at_step}: sending {sig.name} to "
              f"{'torchrun' if target != os.getpid() else 'this rank alone'}", flush=True)
        os.kill(target, sig)

    # ---- state --------------------------------------------------------------------------
    def _state(self) -> dict:
        model, optim = {}, {}
        for m, o in self.parts:
            model.update(get_model_state_dict(m))
            if o is not None:
                optim.update(_flatten_optim(get_optimizer_state_dict(m, o)))
        return {"model": model, "optim": optim}

    def _load_state(self, state: dict):
        for m, o in self.parts:
            names = set(get_model_state_dict(m))
            set_model_state_dict(m, {k: v for k, v in state["model"].items() if k in names})
            if o is not None:
                mine = _flatten_optim(get_optimizer_state_dict(m, o))
                # Each parameter's state and hyperparameters by its name; which group it sits
                # in is this layout's (common/training.py: one group per kind of parameter),
                # not the saving layout's: TP's two groups resume DDP's one, and back.
                loaded = {k: state["optim"][k] if k.startswith("state.") else
                          dict(state["optim"][k], _group=mine[k]["_group"]) for k in mine}
                set_optimizer_state_dict(m, o, _unflatten_optim(loaded))

    def _meta(self, step: int) -> dict:
        return {"step": step, "script": self.args.script, "model": self.args.model,
                "model_config": self.args.model_config.as_dict(), "world_size": self.ctx.world_size,
                "parallel": self.parallel, "global_batch_size": self.args.global_batch_size,
                "seq_len": self.args.seq_len, "seed": self.args.seed, "data": self.args.data,
                "data_id": getattr(self.args, "data_id", None),
                "lr": self.args.lr, "warmup_steps": self.args.warmup_steps,
                "grad_accum": getattr(self.args, "grad_accum", 1), "doc_mask": getattr(self.args, "doc_mask", False),
                "scheduler": self.scheduler.state_dict() if self.scheduler else None,
                "data_position": self.batches.state_dict() if self.batches else None}

    # ---- save ---------------------------------------------------------------------------
    def save(self, step: int, blocking: bool = False) -> Path:
        """Write the checkpoint of ``step``. With --ckpt-async (and not ``blocking``), this
        returns once the state is copied to host memory; a thread writes the files, and
        rank 0 declares the checkpoint (meta.json, the rename) once every rank's files are
        written. One save at a time: the next one (and the run's end) waits for this one."""
        self.wait()
        final = self.folder / f"step_{step:08d}"
        partial = final.with_name(final.name + PARTIAL)
        error = None
        if self.ctx.is_main:
            try:
                shutil.rmtree(partial, ignore_errors=True)  # left by a crash: never complete
                partial.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                error = e
        self._all_ok(error, partial, step)
        background = self.args.ckpt_async and not blocking
        try:
            # CUDA path: no CPU test: CUDA's generator state exists only with a GPU; tools/gpu_check.py resumes
            # a CUDA run
            torch.save({"cpu": torch.get_rng_state(),
                        "cuda": torch.cuda.get_rng_state() if self.ctx.device.type == "cuda" else None},
                       partial / f"rng_rank{self.ctx.rank}.pt")
            state = self._state()
            if background:
                self.staging_bytes = _local_bytes(state)  # what the stager copies to host memory
                # async_save copies every tensor to host memory now (the training waits for
                # that), then writes from the copy in a thread, on a gloo group of its own: a
                # thread's collectives must never interleave with the training's on one group.
                stager = _stager(self.on_staged)
                future = dcp.async_save(state, checkpoint_id=str(partial), process_group=self._write_group,
                                        **({"async_stager": stager} if stager is not None else {}))
            else:
                dcp.save(state, checkpoint_id=str(partial))
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - a full disk, a folder gone read-only
            # (DCP's CheckpointException derives from BaseException, not Exception)
            error = e
        self._all_ok(error, partial, step)  # staged (async) or written (sync) on every rank
        meta = self._meta(step)  # now: the LR schedule and data position move on while a write runs
        if background:
            self._writing = (threading.Thread(target=self._finish_write, args=(future, meta, partial, final, stager),
                                              name="checkpoint-write"), step, partial)
            self._writing[0].start()
            return final
        error = self._declare(meta, partial, final) if self.ctx.is_main else None
        self._all_ok(error, partial, step)
        dist.barrier()
        return final

    def _declare(self, meta: dict, partial: Path, final: Path) -> OSError | None:
        """Rank 0, once every rank's files are on disk: meta.json, the atomic rename, then the
        oldest checkpoints go. Returns the error, if any."""
        try:
            (partial / "meta.json").write_text(json.dumps(meta, indent=1))
            if final.exists():  # the same step again (a resumed run): replace it whole
                shutil.rmtree(final)
            os.replace(partial, final)  # atomic: complete or absent, never half
        except OSError as e:
            return e
        for old in complete_checkpoints(self.folder)[:-self.args.ckpt_keep]:
            shutil.rmtree(old, ignore_errors=True)
        return None

    def _finish_write(self, future, meta: dict, partial: Path, final: Path, stager=None):
        """The write's thread: wait for DCP's write; on rank 0, declare the checkpoint. DCP's
        write ends on rank 0 after it has gathered every rank's result (and written
        .metadata), so every rank's files are there by then. Then the host copy goes."""
        t0 = time.perf_counter()
        try:
            future.result()
            self.write_seconds.append(time.perf_counter() - t0)
            if self.ctx.is_main:
                self._write_error = self._declare(meta, partial, final)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - said by wait(), on every rank
            self._write_error = e
        finally:
            if stager is not None:
                stager.close()  # a stager we give async_save is ours to close: it frees its copy

    def wait(self):
        """Wait for the checkpoint being written in the background, if any; every rank then
        agrees it is complete (or stops with one sentence if a rank's write failed)."""
        if self._writing is None:
            return
        thread, step, partial = self._writing
        thread.join()
        error, self._writing, self._write_error = self._write_error, None, None
        self._all_ok(error, partial, step)

    def _all_ok(self, error: BaseException | None, partial: Path, step: int):
        """A barrier that also agrees on failure: a rank that could not write must not leave
        the others waiting for it until --pg-timeout. Every rank then stops with one sentence;
        the half-written folder goes, the complete checkpoints before it stay."""
        failed = torch.tensor([0.0 if error is None else 1.0], device=self.ctx.device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if not failed.item():
            return
        if self.ctx.is_main:
            shutil.rmtree(partial, ignore_errors=True)
        kept = complete_checkpoints(self.folder)
        why = (str(error).strip().splitlines() or [type(error).__name__])[-1][:200] if error is not None \
            else "another rank could not write its part"
        raise UserError(f"the checkpoint of step {step} could not be written to {partial} ({why}); "
                        + (f"the last good checkpoint, {kept[-1]}, is kept" if kept else "no earlier checkpoint exists")
                        + "; free some space or make the folder writable, then --resume.")

    # ---- resume -------------------------------------------------------------------------
    def resume(self) -> int:
        """Load the newest complete checkpoint if ``--resume``; return the first step to run."""
        found = complete_checkpoints(self.folder)
        if not self.args.resume:
            if self.args.ckpt_every and found:
                # This run's checkpoints would sit beside another run's, and a later --resume
                # would pick whichever is newest: refuse a mix before anything is written.
                self._check_compatible(found[-1], read_meta(found[-1]))
            return 0
        if not found:
            self.ctx.print(f"--resume: no complete checkpoint in {self.folder} yet, starting from step 0")
            return 0
        path = found[-1]
        meta = read_meta(path)
        self._check_compatible(path, meta)
        if self.ctx.is_main:  # writes a crash cut short: never loaded, and in the way of nobody
            for left in self.folder.glob(f"step_*{PARTIAL}"):
                shutil.rmtree(left, ignore_errors=True)
        self.finishing = meta["step"] + 1 == self.args.steps and self._outputs_missing()
        if dist.is_initialized() and self.ctx.has_peers:
            # rank 0's reading of the files, on every rank: were two ranks to see summary.json
            # differently (a file system's cached view), one would refuse while the others load
            box = [self.finishing]
            dist.broadcast_object_list(box, src=0)
            self.finishing = box[0]
        if meta["step"] + 1 >= self.args.steps and not self.finishing:
            raise UserError(f"checkpoint {path} is at step {meta['step']}, the last of --steps {self.args.steps} "
                            f"or past it: nothing is left to train; raise --steps to continue.")
        state = self._state()
        try:
            dcp.load(state, checkpoint_id=str(path))
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - a damaged checkpoint, said plainly
            # (DCP's CheckpointException derives from BaseException, not Exception)
            reason = str(e).strip().splitlines()[-1][:200] if str(e).strip() else type(e).__name__
            raise UserError(f"checkpoint {path} cannot be read ({reason}); move it aside to resume from "
                            f"the one before it, or start without --resume.") from None
        self._load_state(state)
        if self.scheduler and meta["scheduler"]:
            self.scheduler.load_state_dict(per_group(meta["scheduler"], len(self.scheduler.optimizer.param_groups)))
            # load_state_dict restores the schedule's position but not the optimizer's
            # current lr; the saved param_groups may hold a stale one (ZeRO-1's inner
            # optimizer only learns the lr at its next step). Set it from the schedule.
            for group, lr in zip(self.scheduler.optimizer.param_groups, self.scheduler.get_last_lr()):
                group["lr"] = lr
        if self.batches and meta["data_position"]:
            self.batches.load_state_dict(meta["data_position"])
        rng = path / f"rng_rank{self.ctx.rank}.pt"
        if rng.exists() and meta["world_size"] == self.ctx.world_size:
            saved = torch.load(rng, map_location="cpu", weights_only=False)  # RNG states are host tensors
            torch.set_rng_state(saved["cpu"])
            # CUDA path: no CPU test: as at the save, CUDA's generator exists only with a GPU
            if saved["cuda"] is not None and self.ctx.device.type == "cuda":
                torch.cuda.set_rng_state(saved["cuda"])
        self.ctx.print(f"resumed from {path} (step {meta['step']}, saved by {meta['world_size']} rank(s))")
        if self.finishing:
            self.ctx.print(f"step {meta['step']} is the last of --steps {self.args.steps}: the run was stopped after "
                           f"its last checkpoint, before its outputs; writing them now (nothing to train).")
        return meta["step"] + 1

    def _outputs_missing(self) -> bool:
        """Whether the run in --out trained every step (metrics.jsonl has each one) but stopped
        before writing its outputs: summary.json, written last, is missing (a run that starts
        training removes an older one). A torchrun restart also finishes a run whose
        summary.json is there: it may have died between that file and its exit."""
        out = Path(self.args.out)
        try:
            lines = (out / "metrics.jsonl").read_text().splitlines()
        except OSError:
            return False  # a checkpoint copied here alone: not this folder's run
        logged = set()
        for line in lines:
            try:
                logged.add(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                continue  # a torn line: its step is not counted
        if not set(range(self.args.steps)) <= logged:
            return False
        return self.restart > 0 or not (out / "summary.json").exists()

    def _check_compatible(self, path: Path, meta: dict):
        """Refuse a checkpoint of another run, naming every setting that differs in one
        sentence: one at a time, a person fixes a flag, reruns, and meets the next."""
        diff = config_differences(meta, self.args)
        if diff:
            out = Path(self.args.out)
            raise UserError(f"--out {out} holds a checkpoint of another run ({path.name}): {'; '.join(diff)}. "
                            f"Resume with the same flags, or use another --out, or delete {out / 'checkpoints'} "
                            f"to start over.")
        # No check on the parallel layout: every part is saved by parameter name (pipeline
        # stages keep the full model's layer names), so any split loads into any other.

    # ---- called once per step by the training loop ---------------------------------------
    def saves_at(self, step: int) -> bool:
        """Whether ``end_step`` saves a checkpoint after this step."""
        return bool(self.args.ckpt_every) and ((step + 1) % self.args.ckpt_every == 0 or step == self.args.steps - 1)

    def check_finite(self, step: int, loss: float, grad_norm: float | None = None):
        """Stop on a non-finite loss or gradient norm (--on-nan stop). The training loop
        learns a step's numbers one step late, except at a checkpoint step, which is checked
        before ``end_step`` saves it."""
        if getattr(self.ctx, "fake", False):
            return  # a dry run: its numbers are built from data that never arrived
        if not math.isfinite(loss) and self.args.on_nan == "stop":
            raise UserError(f"the loss is {loss} at step {step} (rank {self.ctx.rank}); lower --lr, or pass "
                            f"--on-nan skip to skip such steps.")
        # (fp16's GradScaler skips an overflowing step by itself and lowers its scale: not an error)
        if (grad_norm is not None and not math.isfinite(grad_norm) and self.args.on_nan == "stop"
                and getattr(self.args, "amp", None) != "fp16"):
            raise UserError(f"the gradient norm is {grad_norm} at step {step} (rank {self.ctx.rank}); lower --lr, "
                            f"or pass --on-nan skip to skip such steps.")

    def end_step(self, step: int, stop: bool = False):
        """After an optimizer step (and its ``check_finite``): save, inject a test fault,
        vote on stopping. ``stop`` (from ``stop_agreed``): save this step and leave."""
        if getattr(self.ctx, "fake", False):
            return
        self.mark_progress()
        fault = self.args.fail_at_step == step and self.restart == 0 and self.ctx.rank == self.args.fail_rank
        if fault and self.args.fail_how != "exit":
            self._send_fault_signal()  # before the save: it arrives while the checkpoint is written
        last = step == self.args.steps - 1  # a stop asked at the last step: the run is over anyway
        if stop and not last and self.stopping == STOP_UNSAVED:
            self._stop_after_ctrl_c(step)
        if stop and not last and not self.can_save:
            self.close()
            raise Preempted(f"preempted at step {step}: every rank stopped there, but {self.args.script}.py does not "
                            f"checkpoint, so nothing was saved and the {step + 1} steps trained are lost; run it "
                            f"again from the start.")
        if self.saves_at(step) or (stop and not last):
            path = self.save(step, blocking=stop and not last)  # a preempted run must not leave mid-write
            self.mark_progress()
            if stop and not last:
                self.close()
                raise Preempted(f"preempted at step {step}: every rank saved {path}; resume with --resume "
                                f"(the same command line with --resume continues from step {step + 1}).")
        if fault and self.args.fail_how == "exit":
            # A hard crash, as a dying node gives: no cleanup, no exception handling.
            print(f"[rank {self.ctx.rank}] --fail-at-step {step}: crashing on purpose", flush=True)
            os._exit(17)
        if not last:
            self._cast_vote()


def _stager(on_staged):
    """DCP's default stager for async_save (a plain copy to host memory, made before
    async_save returns), which also hands the copy to ``on_staged`` (the memory tracer's
    "checkpoint staging"). None where this torch has no such class: async_save's own then."""
    if on_staged is None or "async_stager" not in inspect.signature(dcp.async_save).parameters:
        return None
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:  # an older torch (the GPU machines run 2.11): async_save's own stager, untraced
        return None

    class Stager(DefaultStager):
        def stage(self, state_dict, **kwargs):
            staged = super().stage(state_dict, **kwargs)
            on_staged(staged)
            return staged

    return Stager(StagingOptions(False, False, False, False))  # what async_save builds when given none


def _local_bytes(state) -> int:
    """Bytes of the tensors this rank holds in a state dict (its shards of DTensors)."""
    if isinstance(state, dict):
        return sum(_local_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_local_bytes(v) for v in state)
    if isinstance(state, DTensor):
        state = state.to_local()
    return state.numel() * state.element_size() if isinstance(state, torch.Tensor) else 0


def _union(modules) -> torch.nn.Module:
    """One module whose parameters are those of ``modules``, under their own names.

    Pipeline stages keep the full model's names (``layers.5...``), and one rank's stages
    own disjoint layers, so their children merge without a clash (ModuleDicts by key).
    """
    if len(modules) == 1:
        return modules[0]
    union = torch.nn.Module()
    for m in modules:
        for name, child in m.named_children():
            if child is None:
                continue
            have = getattr(union, name, None)
            if isinstance(child, torch.nn.ModuleDict) and isinstance(have, torch.nn.ModuleDict):
                have.update(child)
            elif have is None:
                setattr(union, name, torch.nn.ModuleDict(child) if isinstance(child, torch.nn.ModuleDict) else child)
            else:
                raise ValueError(f"two stages of one rank both hold {name!r}")
    return union


LOCK = ".run.lock"


def keep_finished_run(args, ctx) -> str | None:
    """A finished run's folder is never replaced in silence. Running a script again with the
    same --out (the default runs/<script> too) moves the finished run (its summary.json
    says it finished) aside, to ``<out>@<when it finished>``, and says so; the new run
    writes into ``<out>``, which thus always holds the latest run, and the older ones sit
    beside it with their dates. Not with --resume from a checkpoint there (it continues the
    run in place, or says why it cannot), nor in a torchrun restart (the same run, started
    again). Rank 0 moves; returns the line it printed, or None."""
    out = Path(args.out)
    summary = out / "summary.json"
    resumes = getattr(args, "resume", False) and complete_checkpoints(out / "checkpoints")
    if not ctx.is_main or resumes or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")):
        return None
    if not summary.exists():
        return None
    when = time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(summary.stat().st_mtime))
    aside = out.with_name(f"{out.name}@{when}")
    n = 1
    while aside.exists():
        n += 1
        aside = out.with_name(f"{out.name}@{when}.{n}")
    try:
        about = json.loads(summary.read_text())
        what = f"{about.get('script', '?')}, {about.get('world_size', '?')} rank(s), {about.get('steps', '?')} steps"
    except (OSError, ValueError):
        what = "its summary unreadable"
    out.rename(aside)
    out.mkdir(parents=True)
    line = (f"--out {out} held a finished run ({what}); moved it to {aside} so that nothing is lost. This run "
            f"writes into {out}.")
    print(line, flush=True)
    return line


def lock_out(args, ctx) -> Path | None:
    """One live run per --out: two runs writing into one folder would mix their metrics and
    overwrite each other's checkpoints. Rank 0 writes ``<out>/.run.lock`` (its pid and host)
    and every rank gets its verdict. A lock whose process is gone (a killed run) is stale and
    taken over; so is one of this very process (a harness running several scripts). A
    finished run found there is moved aside first (``keep_finished_run``)."""
    verdict, path = None, Path(args.out) / LOCK
    if ctx.is_main and not path.exists():
        keep_finished_run(args, ctx)
    if ctx.is_main:
        host = socket.gethostname()
        try:
            pid, owner = path.read_text().split()[:2]
            pid = int(pid)
        except (OSError, ValueError):
            pid, owner = None, None
        if pid is not None and pid != os.getpid():
            if owner != host:
                verdict = (f"--out {args.out} is locked by a run on {owner} (pid {pid}); give another --out, or "
                           f"delete {path} if that run is over.")
            elif _alive(pid):
                verdict = (f"another run (pid {pid}) is writing into --out {args.out}; wait for it to end, or give "
                           f"this run another --out.")
        if verdict is None:
            path.write_text(f"{os.getpid()} {host}\n")
            atexit.register(unlock_out, path)
    if dist.is_initialized() and ctx.has_peers:
        box = [verdict]
        dist.broadcast_object_list(box, src=0)
        verdict = box[0]
    if verdict:
        raise UserError(verdict)
    return path if ctx.is_main else None


def unlock_out(path: Path | None):
    """Remove the lock if this process holds it."""
    try:
        if path is not None and path.read_text().split()[0] == str(os.getpid()):
            path.unlink()
    except (OSError, IndexError):
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def skip_nonfinite_step(optimizer, ctx, enabled: bool):
    """--on-nan skip: drop the gradients of a step whose gradients are not all finite.

    Registered as an optimizer pre-hook; with every gradient set to None the optimizer
    leaves every parameter (and its state) alone. The verdict is all-reduced so that
    ranks holding different shards agree to skip together.
    """
    if not enabled:
        return None

    def hook(opt, *_):
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        # One verdict on the device, then one wait for it (not one per gradient)
        finite = (torch.stack([torch.isfinite(g).all() for g in local]).all() if local
                  else torch.ones((), dtype=torch.bool, device=ctx.device))
        bad = (~finite).float().reshape(1)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if bad.item():
            ctx.print("non-finite gradients: skipping this step's update")
            for g in opt.param_groups:
                for p in g["params"]:
                    p.grad = None

    return optimizer.register_step_pre_hook(hook)


def per_group(scheduler_state: dict, groups: int) -> dict:
    """A learning-rate schedule's saved state with one entry a group for ``groups`` groups.
    The schedule keeps a list per parameter group (base_lrs, the last lrs, the lambdas'
    state), and layouts have different numbers of groups (common/training.py: one per kind of
    parameter; TP two, DDP one). Every group runs the same schedule, so the first entry
    serves them all; a list left at the saving layout's length would leave a group's
    learning rate behind, or fail."""
    state = dict(scheduler_state)
    for key in ("base_lrs", "_last_lr", "lr_lambdas"):
        if isinstance(state.get(key), list) and state[key] and len(state[key]) != groups:
            state[key] = state[key][:1] * groups
    return state


def _flatten_optim(sd: dict) -> dict:
    """{'state': {fqn: {...}}, 'param_groups': [...]} -> flat keys, mergeable across parts."""
    flat = {f"state.{fqn}.{k}": v for fqn, st in sd["state"].items() for k, v in st.items()}
    for i, group in enumerate(sd["param_groups"]):
        for fqn in group["params"]:
            flat[f"param_groups.{fqn}"] = {k: v for k, v in group.items() if k != "params"} | {"_group": i}
    return flat


def _unflatten_optim(flat: dict) -> dict:
    state, groups = {}, {}
    for key, v in flat.items():
        if key.startswith("state."):
            fqn, k = key[len("state."):].rsplit(".", 1)
            state.setdefault(fqn, {})[k] = v
        else:
            fqn = key[len("param_groups."):]
            g = dict(v)
            i = g.pop("_group")
            groups.setdefault(i, dict(g, params=[]))["params"].append(fqn)
    return {"state": state, "param_groups": [groups[i] for i in sorted(groups)]}


def export(checkpoint: str, dest: str):
    """One plain torch.save file of the model's full weights (no optimizer), for inference."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path, dest = Path(checkpoint), Path(dest)
    if not (path / "meta.json").is_file():
        raise UserError(f"{path} is not a complete checkpoint (no meta.json); give a step_... folder.")
    if dest.exists():
        raise UserError(f"{dest} already exists; give a new file name (export never overwrites).")
    if not dest.parent.is_dir():
        raise UserError(f"cannot write {dest}: the folder {dest.parent} does not exist.")
    meta = read_meta(path)
    tmp = dest.with_name(dest.name + ".tmp")
    try:
        dcp_to_torch_save(str(path), str(tmp))
        full = torch.load(tmp, map_location="cpu", weights_only=False)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - a damaged checkpoint, said plainly
        reason = str(e).strip().splitlines()[-1][:200] if str(e).strip() else type(e).__name__
        raise UserError(f"checkpoint {path} cannot be read ({reason}); export an older one.") from None
    finally:
        tmp.unlink(missing_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    torch.save({"model_config": meta["model_config"], "step": meta["step"], "model": full["model"]}, partial)
    os.replace(partial, dest)  # a crash mid-write leaves no half file under the real name
    print(f"wrote {dest}: {len(full['model'])} tensors of the {meta['model']!r} model at step {meta['step']}")


if __name__ == "__main__":
    from common.errors import main_guard

    p = argparse.ArgumentParser(description="Turn a checkpoint into one torch.save file for inference.")
    p.add_argument("command", choices=["export"])
    p.add_argument("checkpoint")
    p.add_argument("dest")
    a = p.parse_args()
    main_guard(export)(a.checkpoint, a.dest)


# ---- one plain file of full weights, for inference ---------------------------------------
# The sending rank's bytes gathered for rank 0 and not yet known to have arrived there, at
# their highest during the last full_state_dict (0 on the ranks that send nothing). The
# handshake below keeps it to one tensor; tests/drivers/model_parallel.py reads it.
IN_FLIGHT = {"bytes": 0, "peak_bytes": 0}


def _ready_for_next(ctx):
    """The sender waits for rank 0's "ready": rank 0 has received every tensor before this one."""
    ready = torch.zeros(1, dtype=torch.int32, device=ctx.device)
    dist.recv(ready, src=0)
    ready.item()  # on a GPU, recv only queues the wait; the host waits here, before the next gather
    IN_FLIGHT["bytes"] = 0


def full_state_dict(modules: list[torch.nn.Module], ctx, pp: int = 1) -> dict[str, torch.Tensor] | None:
    """Gather the trained weights back into one plain state dict in rank 0's host memory
    (None elsewhere), one tensor at a time.

    DTensor shards (TP, FSDP) are gathered with ``full_tensor()`` by the ranks that share
    them. ``pp``: pipeline stages, the outermost dimension of the mesh (ranks s * W/pp to
    (s + 1) * W/pp - 1 hold stage s, as their data- and tensor-parallel copies). Only the
    first rank of each stage sends, tensor by tensor, in step with rank 0: rank 0 says
    "ready" for each tensor once the one before has arrived and moved to its host memory,
    and the sender gathers a tensor only after that, so it never holds more than one
    gathered tensor that rank 0 has not received. Every stage keeps the full model's
    parameter names, so the parts merge by name. Every rank must call this.
    """
    per_stage = ctx.world_size // pp if pp > 1 and ctx.has_peers else ctx.world_size
    sends = ctx.rank % per_stage == 0 and not ctx.is_main  # the one copy of its stage, to rank 0
    out = {} if ctx.is_main else None
    IN_FLIGHT.update(bytes=0, peak_bytes=0)
    # 2-D (FSDP over TP) shards gather in two steps and DTensor logs that this is slow;
    # once per checkpoint it does not matter.
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level, log.level = log.level, logging.ERROR
    try:
        mine = [(k, v) for m in modules for k, v in getattr(m, "module", m).state_dict().items()]  # (DDP's wrapper)
        if sends:
            dist.send_object_list([[(k, tuple(v.shape), v.dtype) for k, v in mine]], dst=0)
        for k, v in mine:
            if sends:
                # CUDA path: tests/test_model_parallel.py::test_save_weights_sends_one_tensor_at_a_time takes this
                # handshake on CPU. It is for NCCL: there dist.send returns at once and the sent tensor stays
                # allocated until rank 0's matching recv, which comes only after rank 0 has gathered its own
                # stage; a sender that did not wait held its whole stage gathered (8b over 2 stages: ~14 GB
                # more). gloo's send blocks until received, which hid it on CPU.
                _ready_for_next(ctx)
            v = v.full_tensor() if isinstance(v, DTensor) else v  # every rank of the stage takes part
            if out is not None:
                out[k] = v.detach().cpu()
            elif sends:
                v = v.detach().to(ctx.device).contiguous()
                IN_FLIGHT["bytes"] += v.numel() * v.element_size()
                IN_FLIGHT["peak_bytes"] = max(IN_FLIGHT["peak_bytes"], IN_FLIGHT["bytes"])
                dist.send(v, dst=0)
            del v
    finally:
        log.setLevel(level)
    if out is not None:
        ready = torch.ones(1, dtype=torch.int32, device=ctx.device)
        for src in range(per_stage, ctx.world_size, per_stage):
            box = [None]
            dist.recv_object_list(box, src=src)
            for k, shape, dtype in box[0]:
                dist.send(ready, dst=src)
                buf = torch.empty(shape, dtype=dtype, device=ctx.device)
                dist.recv(buf, src=src)
                out[k] = buf.cpu()  # (on a GPU, waits for the data: only then is the next "ready" sent)
    return out


def save_full_weights(modules: list[torch.nn.Module], ctx, path, pp: int = 1):
    """``full_state_dict`` then ``torch.save`` on rank 0: the checkpoint a single process can load."""
    state = full_state_dict(modules, ctx, pp)
    if state is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)
