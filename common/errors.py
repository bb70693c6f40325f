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
        except Exception:
            if int(os.environ.get("WORLD_SIZE", "1")) > 1:
                print(f"[rank {os.environ.get('RANK', '?')}] failed:", file=sys.stderr)
            traceback.print_exc()
            sys.exit(1)

    return wrapper
