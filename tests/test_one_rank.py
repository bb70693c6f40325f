"""Every step-3 training script runs at world size 1 and reproduces step 1's losses.

A learner with one GPU (or a laptop) runs the step-3 scripts as written: plain ``python``
(a process group of one) and ``torchrun --nproc-per-node 1`` must both work, for every
strategy, and train exactly what step 1 trains. One launch of each kind runs every
script in turn (common/multirun.py); the two launches run side by side. The torchrun
launch runs each script once (the launch is what differs there), plain python every variant.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest

from conftest import ROOT

TIMEOUT_S = 240  # a hang detector: both launches take about 40 s on an idle 2-core machine
FLAGS = ["--model", "debug", "--steps", "4", "--seq-len", "32", "--global-batch-size", "4", "--data", "synthetic",
         "--eval-batches", "0", "--no-trace-memory", "--device", "cpu"]
S3 = "step3_multi_gpu/"
RUNS = {
    "step1": ("step1_single_gpu/train.py", []),
    "ddp": (S3 + "train_ddp.py", []),
    "zero1": (S3 + "train_ddp.py", ["--zero1"]),
    "fsdp": (S3 + "train_fsdp.py", []),
    "fsdp_zero2_accum": (S3 + "train_fsdp.py", ["--no-reshard-after-forward", "--grad-accum-steps", "2"]),
    "tp": (S3 + "train_tp.py", []),
    "tp_sp": (S3 + "train_tp.py", ["--sequence-parallel"]),
    "pp_1f1b": (S3 + "train_pp.py", ["--schedule", "1f1b"]),
    "pp_gpipe": (S3 + "train_pp.py", ["--schedule", "gpipe"]),
    "2d": (S3 + "train_2d.py", []),  # default degrees at one rank: 1 x 1
    "3d": (S3 + "train_3d.py", []),  # 1 x 1 x 1
}


UNDER_TORCHRUN = ("step1", "ddp", "fsdp", "tp", "pp_1f1b", "2d", "3d")
CASES = [(launcher, name) for launcher in ("python", "torchrun") for name in RUNS
         if name != "step1" and (launcher == "python" or name in UNDER_TORCHRUN)]


def _runs_json(out_dir, names) -> str:
    return json.dumps([{"name": name, "script": RUNS[name][0], "argv": FLAGS + RUNS[name][1] + ["--out", str(out_dir / name)]}
                       for name in names])


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one_rank")
    cmds = {
        "python": [sys.executable, "common/multirun.py", "--runs", _runs_json(tmp / "python", RUNS)],
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                     "common/multirun.py", "--runs", _runs_json(tmp / "torchrun", UNDER_TORCHRUN)],
    }
    procs = {k: subprocess.Popen(c, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for k, c in cmds.items()}
    start, logs = time.perf_counter(), {}
    for key, proc in procs.items():
        try:
            logs[key] = proc.communicate(timeout=max(1, TIMEOUT_S - (time.perf_counter() - start)))[0]
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            pytest.fail(f"the {key} launch did not finish in {TIMEOUT_S} s: {proc.communicate()[0][-3000:]}")
    return {key: (procs[key].returncode, logs[key], tmp / key) for key in cmds}


def _losses(folder) -> list[float]:
    return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("launcher,name", CASES, ids=[f"{a}-{b}" for a, b in CASES])
def test_every_step3_script_trains_what_step1_trains_on_one_rank(launches, launcher, name):
    code, log, out = launches[launcher]
    assert (out / name / "summary.json").exists(), f"{name} did not finish under {launcher}:\n{log[-3000:]}"
    assert code == 0, log[-3000:]
    summary = json.loads((out / name / "summary.json").read_text())
    assert summary["world_size"] == 1
    got, ref = _losses(out / name), _losses(out / "step1")
    assert len(got) == len(ref) == 4
    for step, (a, b) in enumerate(zip(got, ref)):
        assert math.isclose(a, b, rel_tol=1e-5), f"{name} under {launcher}, step {step}: {a} vs step 1's {b}"
    assert got[-1] < got[0]  # it trained
