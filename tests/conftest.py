import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Many tests start several torch processes at once on a 2-core machine. Each plain python one
# would run an OpenMP thread per core, and threads spin-waiting on each other's share of an op
# slow every process several times over (measured here: step 1's plain python and torchrun
# runs side by side took 22.6 s with two threads each, 6.7 s with one). torchrun already
# gives each of several workers one thread; every child of the suite gets one here. This
# process keeps its own count (read first, so the variable no longer changes it).
torch.get_num_threads()
os.environ.setdefault("OMP_NUM_THREADS", "1")

# CUDA's optimizer path on a CPU (common/training.py: take_cuda_paths): every process the suite
# starts (and this one) runs AdamW's multi-tensor kernels, as every CUDA run does by default,
# instead of the CPU's one-tensor-at-a-time loop, where DTensor and plain parameters never
# meet in one kernel. tests/test_readme.py runs the README's commands as a user's CPU does
# (0). Set before anything imports common.training.
os.environ.setdefault("TUTORIAL_CUDA_PATHS", "1")
CUDA_PATHS = os.environ["TUTORIAL_CUDA_PATHS"] == "1"

# Every test names the device it means (--device cpu, or cuda where it is about a GPU): "auto"
# picks a GPU wherever one is visible, and a test written for gloo ranks on a CPU then runs
# somewhere else. Set here, for this process and every one it starts, "auto" stops the run with
# one sentence on any machine, so a launch that forgets --device fails here too, not only on a
# GPU machine (common/distributed.py:resolve_device; tests/test_distributed.py checks it).
from common.distributed import NAME_THE_DEVICE  # noqa: E402

os.environ[NAME_THE_DEVICE] = "1"


def hang_limit(seconds: float) -> float:
    """A hang detector's limit, set for a launch on an idle 2-core machine, stretched when
    pytest-xdist runs test files side by side: each worker's launches then share the cores with
    the others' (15 workers on 16 cores: about 2x). A module fixture that outlives its limit
    fails every test of its file, as errors at the end of the run."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return seconds * max(1.0, workers * 2 / (os.cpu_count() or 2))


# Each test file's time (setup, call and teardown of its tests, fixtures' launches included),
# written at the end of a run of the whole suite to runs/test_times.json, from which
# `python -m tools.test_times` writes the README's table of them.
_FILE_SECONDS: dict[str, float] = {}
_FAILED: set[str] = set()
_STARTED = [0.0]


def pytest_sessionstart(session):
    import time
    _STARTED[0] = time.time()


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration
    if report.failed:
        _FAILED.add(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    import json
    import time
    if os.environ.get("PYTEST_XDIST_WORKER") or not _FILE_SECONDS:
        return  # (a worker: the controller, which sees every report, writes it)
    every = sorted(p.name for p in (ROOT / "tests").glob("test_*.py"))
    if sorted(Path(p).name for p in _FILE_SECONDS) != every:
        return  # a part of the suite: the table is of the whole
    (ROOT / "runs").mkdir(exist_ok=True)
    (ROOT / "runs" / "test_times.json").write_text(json.dumps({
        "wall_s": round(time.time() - _STARTED[0], 1), "exit_status": int(exitstatus),
        "workers": _workers(session), "cpu": _cpu(), "failed": sorted(_FAILED), "commit": _commit(),
        "date": time.strftime("%Y-%m-%d"),
        "files": {p: round(s, 1) for p, s in sorted(_FILE_SECONDS.items())}}, indent=1))


def _commit() -> str | None:
    """The commit the suite ran on (a short hash, '+changes' where the tree differed), or None
    outside a git checkout."""
    import subprocess
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=30)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def _workers(session) -> int:
    """pytest-xdist's workers (the controller's -n, resolved: 'auto' is the cores), or 1."""
    return int(getattr(session.config.option, "numprocesses", None) or 1)


def _cpu() -> str:
    from common.measure.metrics import cpu_name
    return f"{cpu_name()}, {os.cpu_count()} cores"
