"""The run folder (--out): one live run at a time (``lock_out``, ``unlock_out``: rank 0's
``.run.lock``), and a finished run found there moved aside rather than replaced in silence
(``keep_finished_run``)."""
from __future__ import annotations

import atexit
import json
import os
import socket
import time
from pathlib import Path

import torch.distributed as dist

from common.checkpoint_meta import complete_checkpoints
from common.errors import UserError


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
    taken over; so is one of this very process (a harness running several scripts), and one
    of an earlier run of this Slurm job on another host: a requeued job keeps its
    SLURM_JOB_ID, raises SLURM_RESTART_COUNT and starts only once its earlier run has ended,
    perhaps on other nodes, where no pid can be checked (another run of the same allocation,
    with the same count, is refused like any other). A finished run found there is moved aside first
    (``keep_finished_run``)."""
    verdict, path = None, Path(args.out) / LOCK
    if ctx.is_main and not path.exists():
        keep_finished_run(args, ctx)
    if ctx.is_main:
        host = socket.gethostname()
        job = os.environ.get("SLURM_JOB_ID", "")
        requeues = os.environ.get("SLURM_RESTART_COUNT", "0")
        try:
            pid, owner, *rest = path.read_text().split()
            pid, owner_job = int(pid), (rest[0] if rest else "")
            owner_requeues = int(rest[1]) if len(rest) > 1 else 0
        except (OSError, ValueError):
            pid, owner, owner_job, owner_requeues = None, None, "", 0
        if pid is not None and pid != os.getpid():
            if owner != host and job and owner_job == job and owner_requeues < int(requeues or 0):
                pass  # this Slurm job's earlier run, requeued onto other nodes: it has ended
            elif owner != host:
                verdict = (f"--out {args.out} is locked by a run on {owner} (pid {pid}); give another --out, or "
                           f"delete {path} if that run is over.")
            elif _alive(pid):
                verdict = (f"another run (pid {pid}) is writing into --out {args.out}; wait for it to end, or give "
                           f"this run another --out.")
        if verdict is None:
            path.write_text(f"{os.getpid()} {host}" + (f" {job} {requeues}" if job else "") + "\n")
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
