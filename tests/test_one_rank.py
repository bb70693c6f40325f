"""Every step-3 training script runs at world size 1 and reproduces step 1's losses, and
the GPU check command (tools/gpu_check.py) works, in its CPU mode.

A learner with one GPU (or a laptop) runs the step-3 scripts as written: plain ``python``
(a process group of one) and ``torchrun --nproc-per-node 1`` must both work, for every
strategy, and train exactly what step 1 trains. Two launches run side by side: one plain
python process runs every variant in turn (tools/multirun.py); ``python -m
tools.gpu_check --cpu`` runs step 1, step 2 and every step-3 script at toy scale, the
step-3 ones under ``torchrun --nproc-per-node 1`` (as on a one-GPU machine), and each
step-3 script's dry run of a 4-rank layout with every collective's tensors recorded.
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
FP32 = ["--amp", "off"]  # step 3's default is bf16; step 1 is the fp32 baseline
RUNS = {
    "step1": ("step1_single_gpu/train.py", []),
    "ddp": (S3 + "train_ddp.py", FP32),
    "zero1": (S3 + "train_ddp.py", FP32 + ["--zero1"]),
    "fsdp": (S3 + "train_fsdp.py", FP32),
    "fsdp_zero2_accum": (S3 + "train_fsdp.py", FP32 + ["--no-reshard-after-forward", "--grad-accum-steps", "2"]),
    "tp": (S3 + "train_tp.py", FP32),
    "tp_sp": (S3 + "train_tp.py", FP32 + ["--sequence-parallel"]),
    "pp_1f1b": (S3 + "train_pp.py", FP32 + ["--schedule", "1f1b"]),
    "pp_gpipe": (S3 + "train_pp.py", FP32 + ["--schedule", "gpipe"]),
    "2d": (S3 + "train_2d.py", FP32),  # default degrees at one rank: 1 x 1
    "3d": (S3 + "train_3d.py", FP32),  # 1 x 1 x 1
}


GPU_CHECK_STEP3 = ("03_ddp", "03_zero1", "03_fsdp", "03_tp", "03_tp_sp", "03_pp", "03_2d", "03_3d", "03_cp")  # fp32
# What each dry run of 4 must be seen to send (at least): the recorder saw the strategy's own
# collectives, on the device of the run.
DRY4_SENDS = {"ddp": {"all_reduce"}, "fsdp": {"all_gather", "reduce_scatter", "all_reduce (grad norm)"},
              "tp": {"all_reduce", "all_reduce (grad norm)"}, "pp": {"send", "recv", "broadcast"},
              "2d": {"all_gather", "reduce_scatter", "all_reduce"}, "3d": {"send", "recv", "reduce_scatter"},
              "cp": {"send", "recv", "all_reduce"}, "ep": {"all_to_all", "all_to_all (expert counts)"}}


def _runs_json(out_dir, names) -> str:
    return json.dumps([{"name": name, "script": RUNS[name][0], "argv": FLAGS + RUNS[name][1] + ["--out", str(out_dir / name)]}
                       for name in names])


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one_rank")
    cmds = {
        "python": [sys.executable, "tools/multirun.py", "--runs", _runs_json(tmp / "python", RUNS)],
        "gpu_check": [sys.executable, "-m", "tools.gpu_check", "--cpu", "--report-dir", str(tmp / "gpu_check")],
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


def _same_losses(out, name, reference, steps, where):
    assert (out / name / "summary.json").exists(), f"{name} did not finish ({where})"
    assert json.loads((out / name / "summary.json").read_text())["world_size"] == 1
    got, ref = _losses(out / name), _losses(out / reference)
    assert len(got) == len(ref) == steps
    for step, (a, b) in enumerate(zip(got, ref)):
        assert math.isclose(a, b, rel_tol=1e-5), f"{name} ({where}), step {step}: {a} vs step 1's {b}"
    assert got[-1] < got[0]  # it trained


@pytest.mark.parametrize("name", [n for n in RUNS if n != "step1"])
def test_every_step3_script_trains_what_step1_trains_under_plain_python(launches, name):
    code, log, out = launches["python"]
    assert code == 0, log[-3000:]
    _same_losses(out, name, "step1", 4, "plain python")


def test_gpu_check_cpu_mode_runs_every_script_and_step3_under_torchrun_matches_step1(launches):
    code, log, _ = launches["gpu_check"]
    assert code == 0, log[-3000:]
    from tools.gpu_check import CHECKS
    report_dir = launches["gpu_check"][2].parent / "gpu_check"
    report = json.loads((report_dir / "gpu_check_cpu.json").read_text())
    expected = [c.name for c in CHECKS if c.toy]
    assert [r["name"] for r in report["runs"]] == expected and len(expected) >= 14
    assert all(r["ok"] for r in report["runs"]), [r for r in report["runs"] if not r["ok"]]
    assert {r["ranks"] for r in report["runs"]} == {1}
    md = (report_dir / "gpu_check_cpu.md").read_text()
    assert md.count("| yes |") == len(expected)  # one row per run
    assert f"{len(expected)} of {len(expected)} runs ran" in log
    runs = ROOT / "runs" / "gpu_check_cpu"
    for name in GPU_CHECK_STEP3:  # torchrun --nproc-per-node 1, the toy model of 01_baseline
        _same_losses(runs, name, "01_baseline", 3, "gpu_check --cpu, under torchrun")
    # every step-3 script, also as rank 0 of 4 alone, every collective's tensors on the run's device
    dry = {r["name"].removeprefix("03_dry4_"): r for r in report["runs"] if r.get("fake_world_size")}
    assert dry.keys() == DRY4_SENDS.keys() and all(r["fake_world_size"] == 4 for r in dry.values())
    for name, kinds in DRY4_SENDS.items():
        seen = dry[name]["collective_devices"]
        assert kinds <= seen.keys(), (name, seen)
        assert all(devices == ["cpu"] for devices in seen.values()), (name, seen)
        summary = json.loads((runs / f"03_dry4_{name}" / "summary.json").read_text())
        assert summary["dry_run"] == {"rank": 0, "world_size": 4}


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_gpu_check_without_a_gpu_says_so_in_one_sentence():
    r = subprocess.run([sys.executable, "-m", "tools.gpu_check"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["error: no CUDA GPU is visible here (or this torch has no CUDA); run "
                                             "this on a GPU machine, or pass --cpu for the same runs at toy scale "
                                             "on the CPU"]
