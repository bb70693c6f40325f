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

Beside it: preemption and Ctrl-C (common/checkpoint_signals.py, whose ``StopSignals`` the
Checkpointer inherits), meta.json (checkpoint_meta.py), the state dict's layout-free form
(checkpoint_state.py), the run folder's lock (run_folder.py), the weights as one file (weights.py).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from common.checkpoint_meta import PARTIAL, complete_checkpoints, config_differences, read_meta
from common.checkpoint_signals import GO_ON, STOP_UNSAVED, StopSignals
from common.checkpoint_state import _flatten_optim, _local_bytes, _stager, _unflatten_optim, _union, per_group
from common.errors import Preempted, UserError

# In --out, left by a resume refused for having nothing left to train: torchrun's restart of
# that attempt (--max-restarts) refuses too, instead of rewriting a finished run's outputs
NOTHING_LEFT = ".nothing_left_to_train"

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


class Checkpointer(StopSignals):
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
                "lr": self.args.lr, "warmup_steps": self.args.warmup_steps, "steps": self.args.steps,
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
            # CUDA path: no CPU test: CUDA's generator state exists only with a GPU; no GPU run has resumed
            # from it yet (tools/gpu_check.py trains, it does not resume)
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
            if self.ctx.is_main:  # so that torchrun's restart of this refused attempt refuses too
                with contextlib.suppress(OSError):
                    (Path(self.args.out) / NOTHING_LEFT).write_text(f"{meta['step']}\n")
            raise UserError(f"checkpoint {path} is at step {meta['step']}, the last of --steps {self.args.steps} "
                            f"or past it: nothing is left to train; raise --steps to continue.")
        if self.ctx.is_main:
            (Path(self.args.out) / NOTHING_LEFT).unlink(missing_ok=True)
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
            self._say_new_schedule(meta)
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

    def _say_new_schedule(self, meta: dict):
        """A resume with another --steps is how a finished run continues, but the cosine decays
        to --steps' last step: a new total reshapes the schedule from here on. Say how."""
        before = meta.get("steps")  # (checkpoints written before the key was saved: unknown)
        if before is None or before == self.args.steps or not getattr(self.scheduler, "lr_lambdas", None):
            return
        s = self.scheduler
        now, then = s.get_last_lr()[0], s.base_lrs[0] * s.lr_lambdas[0](s.last_epoch + 1)
        rates = f"{now:.3g} at step {meta['step'] + 1}, {then:.3g} at step {meta['step'] + 2}"
        if meta["step"] + 1 <= self.args.warmup_steps:  # every step so far was warm-up, alike in both
            self.ctx.print(f"--steps {self.args.steps} here, {before} in the checkpoint's run: every step so far was "
                           f"warm-up, the same in both, so the run continues as a {self.args.steps}-step run would "
                           f"({rates}).")
        else:
            self.ctx.print(f"--steps {self.args.steps} here, {before} in the checkpoint's run: the learning rate now "
                           f"decays to step {self.args.steps - 1}, from {now:.3g} at step {meta['step'] + 1} to "
                           f"{then:.3g} at step {meta['step'] + 2} (neither the {before}-step run nor a "
                           f"{self.args.steps}-step one).")

    def _outputs_missing(self) -> bool:
        """Whether the run in --out trained every step (metrics.jsonl has each one) but stopped
        before writing its outputs: summary.json, written last, is missing (a run that starts
        training removes an older one). A torchrun restart also finishes a run whose
        summary.json is there: it may have died between that file and its exit; but not a
        restart of an attempt that was refused for having nothing left to train (a deliberate
        --resume of a finished run under --max-restarts: it refuses again, the outputs kept)."""
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
        return (self.restart > 0 and not (out / NOTHING_LEFT).exists()) or not (out / "summary.json").exists()

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
            with self.busy():  # (the stuck-rank watch waits for a save, however long)
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


if __name__ == "__main__":
    from common.errors import main_guard
    from common.weights import export

    p = argparse.ArgumentParser(description="Turn a checkpoint into one torch.save file for inference.")
    p.add_argument("command", choices=["export"])
    p.add_argument("checkpoint")
    p.add_argument("dest")
    a = p.parse_args()
    main_guard(export)(a.checkpoint, a.dest)
