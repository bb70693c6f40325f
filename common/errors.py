"""Misuse is reported as one sentence and a non-zero exit, never as a traceback."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from functools import wraps


class UserError(Exception):
    """Something the person running the script can fix; the message says how."""


# Folders this process created for its run (--out and any parent it had to make, deepest
# first): a refused run removes those still empty, so a refusal leaves nothing behind.
MADE_FOR_THIS_RUN: list = []


def _remove_empty_folders_made():
    for folder in MADE_FOR_THIS_RUN:
        try:
            folder.rmdir()  # only if empty: nothing written is ever removed
        except OSError:
            pass
    MADE_FOR_THIS_RUN.clear()


EXIT_USER_ERROR = 2
# sysexits.h's EX_TEMPFAIL, "a temporary failure; the user is invited to retry": a run that
# was asked to stop (a cluster's SIGTERM or SIGUSR1), saved a checkpoint and left.
EXIT_PREEMPTED = 75


class Preempted(Exception):
    """Every rank stopped at one step after a signal and saved it; the message says where."""


# 128 + SIGINT: what a shell reports for a program a Ctrl-C stopped.
EXIT_INTERRUPTED = 128 + signal.SIGINT


class Interrupted(Exception):
    """Every rank stopped at one step after a Ctrl-C, unsaved; the message says where."""


# Whether this process has had a Ctrl-C (SIGINT). Under torchrun a Ctrl-C reaches torchrun
# alone (each rank runs in a session of its own), and torchrun passes it on to every rank,
# once. An error after it (a peer that stopped first closed its connections) is part of that
# stop, not a failure of its own.
CTRL_C: dict = {"seen": False}
CTRL_C_PATIENCE_S = 10.0  # outside the training steps: how long a Ctrl-C may take to end the process


def _rank_prefix() -> str:
    return f"[rank {os.environ.get('RANK', '0')}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""


def _say_now(line: str):
    """One line on stderr from inside a signal handler or a watch thread: os.write, because a
    print() that the signal interrupted would raise "reentrant call"."""
    os.write(2, (line + "\n").encode())


def note_ctrl_c():
    """Note a Ctrl-C. A second one ends the process at once, mid-step (rank 0 says so): the
    person asked twice. Checkpoints on disk stay what they are (a half-written one is never
    loaded)."""
    if CTRL_C["seen"]:
        if os.environ.get("RANK", "0") == "0":
            _say_now(f"{_rank_prefix()}second Ctrl-C: stopping at once, mid-step; the complete checkpoints in --out "
                     f"stay as they were.")
        os._exit(EXIT_INTERRUPTED)
    CTRL_C["seen"] = True


def _on_ctrl_c(signum, frame):
    """Outside the training steps (starting, tearing down) a Ctrl-C stops the process where it
    is, as Python's own handler does (KeyboardInterrupt); it is also noted, and a rank of
    several still alive CTRL_C_PATIENCE_S later (a teardown waiting for a rank that is gone)
    ends. (A process alone has no one to wait for: its cleanup takes what it takes.)"""
    note_ctrl_c()

    def give_up():
        time.sleep(CTRL_C_PATIENCE_S)
        _say_now(f"{_rank_prefix()}Ctrl-C: not stopped {CTRL_C_PATIENCE_S:.0f} s after it (waiting for another rank "
                 f"that is gone?); stopping at once.")
        os._exit(EXIT_INTERRUPTED)

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        threading.Thread(target=give_up, name="ctrl-c-watch", daemon=True).start()
    raise KeyboardInterrupt


def _say_interrupted(line: str = "interrupted (Ctrl-C): stopped where it was; what was complete before it (the "
                                 "checkpoints, the steps logged) stays usable."):
    if os.environ.get("RANK", "0") == "0":  # every rank got the Ctrl-C: said once
        print(line, file=sys.stderr, flush=True)


def tell_torchrun(line: str) -> None:
    """Leave ``line`` where torchrun looks when a rank fails: the error file it names in
    TORCHELASTIC_ERROR_FILE (what ``torch.distributed.elastic...errors.record`` writes). Its
    end-of-job summary ("Root Cause (first observed failure)") then shows the line in its
    ``traceback`` field, the last thing on screen, instead of "<N/A>" and a link. A string
    message is shown as it is. Nothing to do outside torchrun."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)
    except OSError:
        pass  # the summary falls back to "<N/A>": the line was printed above it all the same


def main_guard(fn):
    """Run ``fn``; turn a UserError into one line on stderr and exit code 2.

    Under torchrun every rank prints, prefixed with its rank, so an error that only one
    rank hits is not hidden behind torchrun's summary; the same line ends that summary
    (``tell_torchrun``). A Ctrl-C ends the run with one line and exit code 130, whichever
    rank it reached first and wherever it found them.
    """

    @wraps(fn)
    def wrapper(*args, **kwargs):
        # A Ctrl-C: common/checkpoint_signals.py turns it into a stop agreed by every rank during the
        # training steps; elsewhere, this handler's KeyboardInterrupt.
        main = threading.current_thread() is threading.main_thread()
        before = signal.signal(signal.SIGINT, _on_ctrl_c) if main else None
        try:
            result = _guarded(fn, args, kwargs)
        except KeyboardInterrupt:  # raised in fn, or while one of _guarded's handlers reported
            _say_interrupted()
            sys.exit(EXIT_INTERRUPTED)
        finally:
            if main and before is not None:  # (None: a handler not set from Python, which cannot be put back)
                signal.signal(signal.SIGINT, before)
        # fn's frame is gone, and with it what held the run's process groups (after an error,
        # a traceback may still hold it: those groups are released at exit).
        if (distributed := sys.modules.get("common.distributed")) is not None:
            distributed.release_finished_groups()
        return result

    return wrapper


def _guarded(fn, args, kwargs):
    """main_guard's work: each way a run can end, said in one line (or shown whole)."""
    try:
        return fn(*args, **kwargs)
    except UserError as e:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        prefix = f"[rank {os.environ.get('RANK', '0')}] " if world > 1 else ""
        print(f"{prefix}error: {e}", file=sys.stderr, flush=True)
        tell_torchrun(f"error: {e}")
        _remove_empty_folders_made()
        sys.exit(EXIT_USER_ERROR)
    except Preempted as e:
        if os.environ.get("RANK", "0") == "0":  # the same sentence on every rank: said once
            print(str(e), file=sys.stderr, flush=True)
        sys.exit(EXIT_PREEMPTED)
    except Interrupted as e:
        _say_interrupted(str(e))
        sys.exit(EXIT_INTERRUPTED)
    except Exception as e:  # noqa: BLE001 - shown whole, then named in one line
        if CTRL_C["seen"]:
            # After a Ctrl-C, an error is that stop reaching this rank (gloo's "Connection
            # closed by peer": a rank that stopped first): the stop is the news.
            _say_interrupted()
            sys.exit(EXIT_INTERRUPTED)
        traceback.print_exc()
        msg = (str(e).strip().splitlines() or [""])[-1][:300]
        hint = ""
        if "Timed out" in msg or "timeout" in msg.lower():
            hint = (" (a collective waited longer than --pg-timeout: another rank is stuck, dead, or "
                    "not calling the same collective)")
            culprit = sys.modules.get("common.distributed")
            if culprit is not None and culprit.HANG["culprit"]:
                hint += f"; {culprit.HANG['culprit']}"  # from every rank's flight recorder
        print(f"[rank {os.environ.get('RANK', '0')}] failed: {type(e).__name__}: {msg}{hint}",
              file=sys.stderr, flush=True)
        tell_torchrun(f"failed: {type(e).__name__}: {msg}{hint} (the traceback is above)")
        sys.exit(1)


# What other libraries log while they load that is not ours to report: torchao's warning for
# each optional CUDA kernel library a CPU build cannot load ("Failed to load ..._C_mxfp8..."),
# and torch's deprecation notes for its enum registrations. Harmless, and easily read as our
# failure.
THEIR_NOISE = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def quiet_logs(*names: str):
    """Raise these loggers to ERROR for the block (their warnings dropped), then restore."""
    loggers = [logging.getLogger(n) for n in names or THEIR_NOISE]
    levels = [q.level for q in loggers]
    for q in loggers:
        q.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for q, level in zip(loggers, levels):
            q.setLevel(level)
