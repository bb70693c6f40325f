"""Preemption and Ctrl-C: the stop signals a rank notes, the vote every rank takes on stopping,
and the watch on a step that never ends. ``StopSignals`` is that half of the Checkpointer
(common/checkpoint.py), which inherits it; its state is set in ``Checkpointer.__init__``.

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

The fault injection that sends these signals on cue (``--fail-how``) is here too
(``_send_fault_signal``); common/checkpoint.py's ``end_step`` calls it.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from common.checkpoint_meta import complete_checkpoints
from common.errors import Interrupted, note_ctrl_c
from common.measure.syncs import HostCopy

# What a cluster sends before it takes the nodes back: Slurm's SIGTERM at the time limit or
# on preemption, and the early warning asked for with #SBATCH --signal=B:USR1@120.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# The vote: MAX over the ranks of each one's wish, so a stop signal's save wins over a Ctrl-C's
# stop where both came.
GO_ON, STOP_UNSAVED, STOP_SAVED = 0.0, 1.0, 2.0
CTRL_C_PATIENCE_S = 20.0  # at most, after a Ctrl-C, for a step to end: torchrun SIGKILLs every rank at 30


class StopSignals:
    """The preemption half of Checkpointer (see the module notes)."""

    _saving = False  # a save, an evaluation or the run's outputs are under way: the watch waits (``busy``)

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

    @contextlib.contextmanager
    def busy(self):
        """Around a save, a held-out evaluation or the run's outputs (the last validation,
        --save-weights' gather, the figure and summary): the stuck-rank watch waits for it
        however long it takes. A run's first checkpoint of a large model, a long evaluation or
        a large gather can take longer than any step seen, and a save a signal asked for is
        the point of the signal; torchrun's shutdown timeout still ends one that hangs (a peer
        gone mid-way)."""
        self._saving = True
        try:
            yield
        finally:
            self._saving = False

    def mark_progress(self):
        now = time.monotonic()
        self._longest = max(self._longest, now - self._progress)
        self._progress = now

    def _give_up_if_stuck(self, signum: int):
        """torchrun sends the same SIGTERM when it stops the job because another rank died:
        then the step in flight waits for a rank that is gone (NCCL waits until --pg-timeout)
        and would hold up the restart until torchrun's SIGKILL. A rank that reaches no step
        end (nor a checkpoint's start or end) in 3 times the longest step or save seen so far,
        and at least 10 s, after the signal stops at once, unless a save is in flight; after a Ctrl-C, in at most
        CTRL_C_PATIENCE_S, so that the rank says why it stopped before torchrun kills it."""
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        while not self._closed.wait(0.2):
            if self._saving:  # a save, evaluation or the outputs (a save's end marks progress)
                continue
            idle, patience = time.monotonic() - self._progress, max(10.0, 3 * self._longest)
            if signum == signal.SIGINT:
                patience = min(patience, CTRL_C_PATIENCE_S)
            if idle > patience and not self._closed.is_set():
                print(f"[rank {self.ctx.rank}] {name}: no step ended in the {idle:.0f} s since the last step end or save "
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
