"""Run a step script's ``main()`` several times inside one torchrun job.

Starting four processes that import torch and join a process group costs 5 to 10 seconds
on a 2-core machine; sweeps (the pipeline-bubble figure), ``python -m tools.figures`` and
the tests run many short trainings, so they launch once and call the scripts one after
another. Each ``main()`` sets up and tears down its own process group. Re-initialising
on torchrun's store would reuse the previous group's keys (gloo then connects to stale
addresses and fails), so ``allow_reinit()`` gives every new group a fresh key prefix on
the launcher's store.

DTensor caches sharding decisions and redistribution plans keyed by meshes that compare
equal by shape and ranks, not by process group: after each run
``common.distributed.release_finished_groups()`` empties those caches, or a later run with
an equal mesh (two 3-D dry runs of different ranks in one process did) would reach for the
earlier run's destroyed group.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent  # run as a script: common/ is not on the path yet
sys.path.insert(0, str(ROOT))

from common.distributed import release_finished_groups  # noqa: E402
from common.errors import UserError, main_guard  # noqa: E402
from common.measure import step_gc  # noqa: E402
_state = {"count": 0, "store": None}


def allow_reinit():
    """Make ``dist.init_process_group`` safe to call again after ``destroy_process_group``."""
    if _state["store"] is not None or "MASTER_ADDR" not in os.environ:
        return  # already done, or plain python: each group gets a store of its own (common/distributed.py)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        from common.errors import UserError
        raise UserError("tools/multirun.py runs several process groups on torchrun's shared store, and "
                        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 turns that off (rank 0 would host a store that closes "
                        "with its first group): unset it for this launch.")
    _state["store"] = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    init = dist.init_process_group

    def fresh_init(backend=None, **kwargs):
        _state["count"] += 1
        store = dist.PrefixStore(f"multirun_{_state['count']}", _state["store"])
        return init(backend, store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                    **kwargs)

    dist.init_process_group = fresh_init


def run_script(script: str, argv: list[str], capture_stderr: bool = False) -> tuple[int, str]:
    """``python script argv...`` in this process: (exit code, captured stderr or '')."""
    allow_reinit()
    spec = importlib.util.spec_from_file_location(Path(script).stem, ROOT / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    saved, sys.argv = sys.argv, [str(ROOT / script), *argv]
    err = io.StringIO()
    code = None  # (None: an exception other than SystemExit left main)
    threads = torch.get_num_threads()  # a script may set it (the step 2 benchmark does); the next one starts afresh
    collections = step_gc._BETWEEN_RUNS[0]
    try:
        with contextlib.redirect_stderr(err) if capture_stderr else contextlib.nullcontext():
            module.main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    finally:
        sys.argv = saved
        torch.set_num_threads(threads)
        # Nothing of this run may reach into the next: a run that failed half-way leaves Python's
        # collector frozen (common/measure/step_gc.py's StepCollector) and its objects to a
        # collection; on a GPU the next run's allocator counters would start with them. A run whose
        # main_guard released its process groups made that full collection already, after main.
        if code != 0 or step_gc._BETWEEN_RUNS[0] == collections:
            step_gc.collect_between_runs()
        release_finished_groups()  # (main_guard's already, unless the script's main has none)
    return code, err.getvalue()


@main_guard
def main():
    """``torchrun --nproc-per-node N tools/multirun.py --runs JSON``: runs one after another
    in this job. JSON is a list of {"name", "script", "argv"}; ``python -m tools.figures``
    writes it. Rank 0 prints ``[multirun] start NAME`` and ``[multirun] done NAME`` around
    each, which the figures command reads to move its progress bar."""
    import argparse
    import json
    p = argparse.ArgumentParser(allow_abbrev=False, description=main.__doc__)
    p.add_argument("--runs", required=True, help='[{"name": ..., "script": ..., "argv": [...]}, ...]')
    args = p.parse_args()
    main_rank = os.environ.get("RANK", "0") == "0"
    try:
        runs = json.loads(args.runs)
    except json.JSONDecodeError as e:
        raise UserError(f"--runs is not JSON ({e}); give a list of {{\"name\", \"script\", \"argv\"}}.") from None
    for run in runs if isinstance(runs, list) else [None]:
        if not (isinstance(run, dict) and {"name", "script", "argv"} <= run.keys()):
            raise UserError(f"--runs: {run!r} is not a {{\"name\", \"script\", \"argv\"}} object; give a list of them.")
        if not (ROOT / run["script"]).is_file():
            raise UserError(f"--runs: script {run['script']!r} is not a file of this repository (give it relative "
                            f"to {ROOT}).")
    for run in runs:
        if main_rank:
            print(f"[multirun] start {run['name']}", flush=True)
        code, _ = run_script(run["script"], run["argv"])
        if code:
            sys.exit(code)
        if main_rank:
            print(f"[multirun] done {run['name']}", flush=True)


if __name__ == "__main__":
    from tools import multirun  # this file again, as tools.multirun: scripts that import it share its state
    multirun.main()
