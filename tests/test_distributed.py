import json
import os
import subprocess
import sys
import time

import pytest
import torch

from common.distributed import NAME_THE_DEVICE, resolve_device
from common.errors import UserError
import launch
from conftest import ROOT, hang_limit

DRIVER = str(ROOT / "tests" / "drivers" / "dist.py")


def _torchrun(n, *args, timeout=180):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), DRIVER, *args]
    return launch.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_more_ranks_than_gpus_is_a_clear_error(monkeypatch):
    monkeypatch.delenv(NAME_THE_DEVICE)  # "auto" itself is under test, on a pretended GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UserError, match="4 ranks per node but only 1 visible GPU"):
        resolve_device("auto", local_rank=2, local_world_size=4)
    assert resolve_device("cpu", 2, 4) == torch.device("cpu")


def test_cuda_without_a_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.delenv(NAME_THE_DEVICE)  # "auto" itself is under test, with no GPU pretended
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="no CUDA GPU is visible"):
        resolve_device("cuda", 0, 1)
    assert resolve_device("auto", 0, 1) == torch.device("cpu")


def test_the_suite_never_lets_auto_pick_the_device(tmp_path):
    """No test may depend on which device "auto" picks (on a GPU machine it picks the GPU, and
    a test of four gloo ranks lands on one GPU): tests/conftest.py sets NAME_THE_DEVICE for the
    suite and every process it starts, and "auto" then stops with one sentence whatever the
    machine has, so a launch without --device fails on this CPU machine too. Asking what "auto"
    would choose for a given GPU count (as the tests above do) stays possible."""
    assert os.environ.get(NAME_THE_DEVICE)
    with pytest.raises(UserError) as e:
        resolve_device("auto", 0, 1)
    assert str(e.value) == (f"--device auto: this process must name its device ({NAME_THE_DEVICE} is set, as the "
                            f"test suite sets it); pass --device cpu or --device cuda.")
    assert resolve_device("cpu", 0, 1) == torch.device("cpu")
    assert resolve_device("auto", 0, 1, device_count=1) == torch.device("cuda", 0)  # a question, not a choice
    # a launched script inherits it: the sentence, exit 2, no training
    r = launch.run([sys.executable, str(ROOT / "step1_single_gpu" / "train.py"), "--model", "debug", "--steps", "1",
                    "--seq-len", "32", "--global-batch-size", "2", "--no-trace-memory", "--eval-batches", "0",
                    "--data", "synthetic", "--device", "auto", "--out", str(tmp_path)],
                   cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == f"error: {e.value}", r.stderr[-2000:]


def test_hang_detectors_stretch_with_the_workers_sharing_the_cores(monkeypatch):
    """The module fixtures' time limits were set for one test process on 2 cores; under
    ``-n auto --dist loadfile`` every worker's launches share the cores with the others'."""
    from conftest import hang_limit
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    assert hang_limit(240) == 240  # one process: as set
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "15")
    assert hang_limit(240) == pytest.approx(450)  # the H200's 15 workers on 16 cores
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
    assert hang_limit(240) == 240  # cores to spare: never shorter
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    assert hang_limit(240) == 480


def test_ranks_take_their_local_gpu_given_a_gpu_count(monkeypatch):
    """rank_device reads what torchrun sets: the second node's ranks 4-7 are its local
    ranks 0-3, and take GPUs 0-3 (tests/test_checkpoint.py asks the same in a real launch
    of two "nodes")."""
    from common.distributed import rank_device
    for rank in range(8):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank % 4))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
        assert rank_device("cuda", device_count=4) == (rank % 4, torch.device("cuda", rank % 4))
        assert rank_device("auto", device_count=0) == (rank % 4, torch.device("cpu"))
    with pytest.raises(UserError, match="4 ranks per node but only 2 visible GPU"):
        rank_device("auto", device_count=2)


def test_the_collective_recorder_names_tensors_off_the_run_device():
    """CommCounter(expect=device) records the devices of every collective's tensors and names
    each one handed a tensor elsewhere, with the line that issued it: here a CUDA run's
    expectation against host tensors, on the fake process group (which, like a dry run on a
    GPU, takes them without a word where NCCL would refuse)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from common.measure.comm import CommCounter
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with CommCounter(expect="cuda") as cuda_run:
            dist.all_reduce(torch.zeros(2)); line = sys._getframe().f_lineno  # noqa: E702
            funcol.wait_tensor(funcol.all_reduce(torch.ones(2), "sum", dist.group.WORLD))
        with CommCounter(expect="cpu") as cpu_run:
            dist.broadcast(torch.zeros(3), src=0)
        with CommCounter(expect="cuda:1") as other_gpu:  # "cuda" alone would match any GPU
            dist.all_reduce(torch.zeros(2, device="meta"))
    finally:
        dist.destroy_process_group()
    assert dict(cuda_run.devices) == {"all_reduce": {"cpu"}}
    assert cuda_run.off_device == [f"all_reduce on cpu (tests/test_distributed.py:{line})",
                                   f"all_reduce on cpu (tests/test_distributed.py:{line + 1})"]
    assert dict(cpu_run.devices) == {"broadcast": {"cpu"}} and cpu_run.off_device == []
    assert other_gpu.off_device == [f"all_reduce on meta (tests/test_distributed.py:{line + 5})"]


def test_plain_python_is_world_size_one(tmp_path):
    r = launch.run([sys.executable, DRIVER, "ok", str(tmp_path / "r")], cwd=ROOT, capture_output=True,
                   text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads((tmp_path / "r.0.json").read_text())
    assert got["world"] == 1 and not got["launched"] and got["sum"] == 0


def test_a_run_ends_while_a_gloo_worker_still_frees_a_collective():
    """The run's end must not deadlock in PyTorch's teardown: DDP's Reducer, freed with the
    model, used to drop the last reference to its gloo group while holding Python's lock, and
    the group's destructor waited for a worker that was freeing a collective's tensor and
    needed that lock (seen beside a second suite; the 2-rank driver makes the race certain: without
    common/distributed.py's release_finished_groups this launch hangs, the main thread in
    ~Reducer -> ~ProcessGroupGloo, the worker in decref_pyobject)."""
    r = _torchrun(2, "teardown_race", timeout=hang_limit(90))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "main returned; the slow tensor was freed on a gloo worker" in r.stdout


def test_torchrun_ranks_meshes_and_misuse(tmp_path):
    ok = _torchrun(4, "ok", str(tmp_path / "r"))
    assert ok.returncode == 0, ok.stderr[-3000:]
    got = [json.loads((tmp_path / f"r.{i}.json").read_text()) for i in range(4)]
    assert [g["rank"] for g in got] == [0, 1, 2, 3]
    assert all(g["world"] == 4 and g["backend"] == "gloo" and g["sum"] == 6 for g in got)
    assert all(g["mesh"] == 4 and g["mesh2d"] == [2, 2] for g in got)
    assert ok.stdout.count("only rank 0 prints this") == 1

    bad = _torchrun(2, "bad_mesh")
    assert bad.returncode != 0
    assert "error: a 3 x 3 mesh (dp, tp) needs 9 ranks but 2 were launched" in bad.stderr

    fails = _torchrun(2, "one_rank_fails", timeout=120)  # a hang here would time out
    assert fails.returncode != 0
    assert "[rank 1] error: rank 1 cannot go on" in fails.stderr


def test_a_hang_becomes_an_error_that_names_the_rank():
    # rank 1 never joins rank 0's all_reduce; with a 4 s process-group timeout rank 0 must
    # fail, say so in one line, and torchrun must end the job (well before the test timeout)
    r = _torchrun(2, "hang", timeout=90)
    assert r.returncode != 0
    assert "[rank 0] failed: RuntimeError:" in r.stderr and "Timed out" in r.stderr
    assert "--pg-timeout" in r.stderr
    # and it names the culprit, from every rank's flight recorder: rank 1 is still at the
    # barrier that ends the set-up, while rank 0 waits in the all-reduce after it
    assert "rank 0 waited in all_reduce #2; rank 1 never got there: its last collective is barrier #1" in r.stderr


def test_workers_stop_when_their_launcher_is_killed(tmp_path):
    """kill -9 of torchrun must not leave its workers training (and writing into --out)."""
    import signal
    out = tmp_path / "orphans"
    launcher = launch.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "step1_single_gpu" / "train.py"), "--model", "debug", "--steps", "100000", "--seq-len", "32",
         "--global-batch-size", "2", "--device", "cpu", "--no-trace-memory", "--out", str(out)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 90
        while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text():
            assert time.time() < deadline and launcher.poll() is None, "the run did not start"
            time.sleep(0.5)
        workers = [int(p) for p in launch.run(["pgrep", "-P", str(launcher.pid)], capture_output=True,
                                              text=True).stdout.split()]
        assert len(workers) == 2, workers
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        deadline = time.time() + 15
        alive = workers
        while alive and time.time() < deadline:
            time.sleep(0.5)
            alive = [w for w in workers if os.path.exists(f"/proc/{w}") and
                     "zombie" not in open(f"/proc/{w}/status").read().lower()]
        assert not alive, f"workers {alive} still running 15 s after their launcher was killed"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launch.run(["pkill", "-9", "-f", str(out)])


def test_multirun_refuses_a_launch_without_the_shared_store(monkeypatch):
    """tools/multirun.py runs several process groups on torchrun's shared store; with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (train.slurm's) rank 0 would host a store that closes
    with its first group and every later group would wait 300 s: refused in one sentence."""
    from common.errors import UserError
    from tools import multirun
    monkeypatch.setitem(multirun._state, "store", None)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with pytest.raises(UserError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 turns that off"):
        multirun.allow_reinit()
