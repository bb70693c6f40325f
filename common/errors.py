"""Misuse is reported as one sentence and a non-zero exit, never as a traceback."""
from __future__ import annotations

import os
import sys
import traceback
from functools import wraps


class UserError(Exception):
    """Something the person running the script can fix; the message says how."""


EXIT_USER_ERROR = 2


def main_guard(fn):
    """Run ``fn``; turn a UserError into one line on stderr and exit code 2.

    Under torchrun every rank prints, prefixed with its rank, so an error that only one
    rank hits is not hidden behind torchrun's summary.
    """

    @wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            world = int(os.environ.get("WORLD_SIZE", "1"))
            prefix = f"[rank {os.environ.get('RANK', '0')}] " if world > 1 else ""
            print(f"{prefix}error: {e}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USER_ERROR)
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
            sys.exit(1)

    return wrapper
