"""Misuse is reported as one sentence and a non-zero exit, never as a traceback."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
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
    (``tell_torchrun``).
    """

    @wraps(fn)
    def wrapper(*args, **kwargs):
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
        except KeyboardInterrupt:
            sys.exit(130)
        except Exception as e:  # noqa: BLE001 - shown whole, then named in one line
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

    return wrapper


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
