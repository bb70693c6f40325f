"""Every dense step-3 training script runs at world size 1 and reproduces step 1's losses,
and the GPU check command (tools/gpu_check.py) works, in its CPU mode.

A learner with one GPU (or a laptop) runs the step-3 scripts as written: plain ``python``
(a process group of one) and ``torchrun --nproc-per-node 1`` must both work, for every
strategy, and train exactly what step 1 trains (EP trains a mixture of experts, which
step 1 does not: tests/test_ep.py holds its one rank to step 1 on the same model). Two launches run side by side: one plain
python process runs every variant in turn (tools/multirun.py), and the GPU pass rehearsed on
the CPU (``python -m tools.gpu_pass --rehearse``), whose gpu_check launches (``--cpu``) run
step 1, step 2 and every step-3 script at toy scale, the step-3 ones under ``torchrun
--nproc-per-node 1`` (as on a one-GPU machine), and each step-3 script's dry run of a 4-rank
layout with every collective's tensors recorded; ``--keep-runs`` keeps their run folders.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest

import launch
from conftest import ROOT, hang_limit
from tests.tolerances import PARITY_RTOL, check_allocator, check_optimizer_path

TIMEOUT_S = hang_limit(420)  # a hang detector: the two launches take about 80 s on an idle 2-core machine
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
    "cp": (S3 + "train_cp.py", FP32),  # a ring of one: the whole sequence on the rank
}
# (train_ep.py trains a mixture of experts, which step 1 does not: tests/test_ep.py holds its
# one-rank run to step 1's on the same --model)


GPU_CHECK_STEP3 = ("03_ddp", "03_zero1", "03_fsdp", "03_tp", "03_tp_sp", "03_pp", "03_2d", "03_3d", "03_cp")  # fp32
# What each dry run of 4 must be seen to send (at least): the recorder saw the strategy's own
# collectives, on the device of the run.
DRY4_SENDS = {"ddp": {"all_reduce"}, "fsdp": {"all_gather", "reduce_scatter", "all_reduce (grad norm)"},
              "tp": {"all_reduce", "all_reduce (grad norm)"}, "pp": {"send", "recv", "broadcast"},
              "2d": {"all_gather", "reduce_scatter", "all_reduce"}, "3d": {"send", "recv", "reduce_scatter"},
              "cp": {"send", "recv", "all_reduce"}, "ep": {"all_to_all", "all_to_all (expert counts)"}}
# ... and what it must send nothing beyond. A rank alone has no peers to gather numbers from: the
# fake group stages all_gather_object's pickles on the host, which on a GPU reads as a collective
# handed tensors off the run's device (the pipeline's bubble report did, a false alarm).
DRY4_ONLY = {"pp": {"send", "recv", "broadcast", "all_reduce (grad norm)"}}


def _runs_json(out_dir, names) -> str:
    return json.dumps([{"name": name, "script": RUNS[name][0], "argv": FLAGS + RUNS[name][1] + ["--out", str(out_dir / name)]}
                       for name in names])


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one_rank")
    cmds = {
        "python": [sys.executable, "tools/multirun.py", "--runs", _runs_json(tmp / "python", RUNS)],
        # the GPU pass rehearsed on this CPU (its streams run in copies of the tree, removed after
        # it: --keep-runs copies its gpu_check launches' run folders out first)
        "rehearse": [sys.executable, "-m", "tools.gpu_pass", "--rehearse", "--report-dir", str(tmp / "rehearse"),
                     "--keep-runs", str(tmp / "kept")],
    }
    procs = {k: launch.Popen(c, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for k, c in cmds.items()}
    start, logs, took = time.perf_counter(), {}, {}
    for key, proc in procs.items():
        try:
            logs[key] = proc.communicate(timeout=max(1, TIMEOUT_S - (time.perf_counter() - start)))[0]
            took[key] = time.perf_counter() - start
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            pytest.fail(f"the {key} launch did not finish in {TIMEOUT_S} s: {proc.communicate()[0][-3000:]}")
    print({key: f"{t:.0f} s" for key, t in took.items()})
    return {key: (procs[key].returncode, logs[key], tmp / key) for key in cmds}


def _losses(folder) -> list[float]:
    return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _same_losses(out, name, reference, steps, where):
    assert (out / name / "summary.json").exists(), f"{name} did not finish ({where})"
    summary = json.loads((out / name / "summary.json").read_text())
    assert summary["world_size"] == 1
    if summary.get("optimizer_kernels") is not None:  # (DeepSpeed's optimizer is not torch.optim's)
        check_optimizer_path(summary)  # one rank of TP, 2-D, 3-D, EP: DTensor and plain parameters, foreach
    got, ref = _losses(out / name), _losses(out / reference)
    assert len(got) == len(ref) == steps
    for step, (a, b) in enumerate(zip(got, ref)):
        assert math.isclose(a, b, rel_tol=PARITY_RTOL), f"{name} ({where}), step {step}: {a} vs step 1's {b}"
    assert got[-1] < got[0]  # it trained


@pytest.mark.parametrize("name", [n for n in RUNS if n != "step1"])
def test_every_step3_script_trains_what_step1_trains_under_plain_python(launches, name):
    code, log, out = launches["python"]
    assert code == 0, log[-3000:]
    _same_losses(out, name, "step1", 4, "plain python")


def test_gpu_check_cpu_mode_runs_every_script_and_step3_under_torchrun_matches_step1(launches):
    """gpu_check --cpu, as the rehearsed GPU pass launches it (its parts' reports joined, each
    part's log saying all of its runs ran: the rehearsal's test below)."""
    code, log, report_dir = launches["rehearse"]
    assert code == 0, log[-3000:]
    from tools.gpu_check import CHECKS
    report = json.loads((report_dir / "gpu_check_cpu.json").read_text())
    expected = [c.name for c in CHECKS if c.toy]
    assert [r["name"] for r in report["runs"]] == expected and len(expected) >= 14
    assert all(r["ok"] for r in report["runs"]), [r for r in report["runs"] if not r["ok"]]
    assert {r["ranks"] for r in report["runs"]} == {1}
    md = (report_dir / "gpu_check_cpu.md").read_text()
    assert md.count("| yes |") == len(expected)  # one row per run
    runs = report_dir.parent / "kept" / "gpu_check_cpu"
    for name in GPU_CHECK_STEP3:  # torchrun --nproc-per-node 1, the toy model of 01_baseline
        _same_losses(runs, name, "01_baseline", 3, "gpu_check --cpu, under torchrun")
    # every step-3 script, also as rank 0 of 4 alone, every collective's tensors on the run's device
    dry = {r["name"].removeprefix("03_dry4_"): r for r in report["runs"] if r["name"].startswith("03_dry4_")}
    assert dry.keys() == DRY4_SENDS.keys() and all(r["fake_world_size"] == 4 for r in dry.values())
    for name, kinds in DRY4_SENDS.items():
        seen = dry[name]["collective_devices"]
        assert kinds <= seen.keys() <= DRY4_ONLY.get(name, seen.keys()), (name, seen)
        assert all(devices == ["cpu"] for devices in seen.values()), (name, seen)
        summary = json.loads((runs / f"03_dry4_{name}" / "summary.json").read_text())
        assert summary["dry_run"] == {"rank": 0, "world_size": 4}
    # every run's trace against the CPU allocator's count of the same steps: within 1% of what
    # the trace could see, the rest named by the count (one rank of TP, TP+SP and 2-D, and the
    # bf16 dry runs: temporaries inside DTensor's dispatch and the bf16 matmul's workspace)
    traced = [r for r in report["runs"] if r["traced_peak_bytes"]]
    assert len(traced) == len(expected)
    for r in traced:
        check_allocator({"peak_bytes": r["traced_peak_bytes"], "allocator_peak_bytes": r["allocator_peak_bytes"],
                         "allocator_unseen_at_peak": r["allocator_unseen_at_peak"]}, r["name"])
    assert all(r.get("cycle_tensor_bytes_max") == 0 for r in report["runs"] if r["ok"])  # nothing held by a cycle
    # a layout the formula once missed (common/measure/missed_layouts.py), rank R of W alone: the
    # formula's peak for that rank beside the allocator's, as a GPU's report holds every one of them
    (missed,) = [r for r in report["runs"] if r["name"].startswith("03_missed_")]
    assert missed["allocator_peak_bytes"] == pytest.approx(missed["formula_peak_bytes"], rel=0.03)
    assert f"| {missed['name']} | " in md.split("The memory formula")[1]


def test_gpu_check_without_a_gpu_says_so_in_one_sentence():
    import os
    # CUDA_VISIBLE_DEVICES="": no GPU for the child, whatever this machine has
    r = launch.run([sys.executable, "-m", "tools.gpu_check"], cwd=ROOT, capture_output=True, text=True,
                   timeout=60, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["error: no CUDA GPU is visible here (or this torch has no CUDA); run "
                                             "this on a GPU machine, or pass --cpu for the same runs at toy scale "
                                             "on the CPU"]


# The GPU pass (tools/gpu_pass.py): what a developer with a lent GPU runs, in one command of
# streams side by side. No GPU here, so what can be checked is that every command it would run
# parses with its own tool's parser, that its gpu_check launches cover every gpu_check run once,
# its memory gate, how it stops a command, its merge and refusals, and the same streams run on
# the CPU (--rehearse) end to end.
class _Parsed(BaseException):  # not Exception: main_guard turns those into exit 1
    pass


def _parses(argv: list[str], monkeypatch) -> None:
    """Hand ``argv`` (python's arguments) to its tool's argparse parser and stop right after."""
    import argparse
    import importlib
    import runpy

    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)  # an unknown flag or a bad value exits 2 here
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    if argv[0] == "-m":
        main = importlib.import_module(argv[1]).main
        with pytest.raises(_Parsed):
            main(argv[2:])
    else:
        monkeypatch.setattr(sys, "argv", argv)
        with pytest.raises(_Parsed):
            runpy.run_path(str(ROOT / argv[0]), run_name="__main__")


def _matched(argv: list[str]) -> list[str]:
    """The gpu_check runs one gpu_check command launches: --only's prefixes, toy runs under --cpu."""
    from tools.gpu_check import CHECKS
    prefixes = tuple(argv[argv.index("--only") + 1].split(","))
    return [c.name for c in CHECKS if c.name.startswith(prefixes) and (c.toy or "--cpu" not in argv)]


def test_every_gpu_pass_command_parses_and_its_checks_cover_gpu_check(monkeypatch):
    from tools import gpu_check, gpu_pass

    for rehearse, big in [(False, False), (False, True), (True, False)]:
        table = gpu_pass.streams(rehearse, big)
        for stream in table:
            for c in stream.commands:
                if c.argv[:2] != ["-m", "pytest"]:
                    _parses(c.argv, monkeypatch)
        # gpu_check's launches: each of its runs exactly once (none twice: a lent GPU's minutes),
        # every launch with a report folder of its own (merged at the end), in a gpu_check stream
        launched = [(s.name, c.argv) for s in table for c in s.commands if c.argv[:2] == ["-m", "tools.gpu_check"]]
        assert {name for name, _ in launched} == set(gpu_pass.CHECK_STREAMS)
        names = [n for _, argv in launched for n in _matched(argv)]
        assert sorted(names) == sorted(c.name for c in gpu_check.CHECKS if c.toy or not rehearse)
        folders = [argv[argv.index("--report-dir") + 1] for _, argv in launched]
        assert len(set(folders)) == len(folders) and all(f.startswith(gpu_pass.PARTS + "/") for f in folders)
        assert all(("--cpu" in argv) == rehearse for _, argv in launched)
        if rehearse:  # nothing of a rehearsal asks for the GPU (or for one by default: "auto")
            assert all(c.gib == 0 for s in table for c in s.commands)
            assert all("cuda" not in c.argv and "auto" not in c.argv for s in table for c in s.commands)
    # one table: both modes have the same streams in the same phases
    assert [(s.name, s.phase) for s in gpu_pass.streams(True)] == [(s.name, s.phase) for s in gpu_pass.streams()]
    # the suite on the GPU machine's spare cores: gpu_check's command with the worker count set
    (suite,) = next(s for s in gpu_pass.streams() if s.name == "tests").commands
    if "-n" not in gpu_check.suite_command():  # no pytest-xdist here: gpu_check's command as it is
        assert suite.argv == gpu_check.suite_command()[1:]
    monkeypatch.setattr(gpu_check, "suite_command", lambda: [sys.executable, "-m", "pytest", "-q", "-n", "auto",
                                                             "--dist", "loadfile"])
    (suite,) = next(s for s in gpu_pass.streams(cores=16) if s.name == "tests").commands
    others = sum(s.phase == 2 for s in gpu_pass.streams()) - 1
    assert suite.argv == ["-m", "pytest", "-q", "-n", str(16 - others), "--dist", "loadfile"]


def test_gpu_pass_memory_gate_and_stopping_a_command_with_all_it_started(tmp_path):
    import os
    import re
    import threading
    from pathlib import Path

    from tools import gpu_pass

    gate = gpu_pass.MemoryGate(10)
    assert gate.acquire(6, time.monotonic() + 1)
    assert not gate.acquire(6, time.monotonic() + 0.2)  # would not fit beside the 6 held: waits, then gives up
    order = []
    waiter = threading.Thread(target=lambda: order.append(("second", gate.acquire(6, time.monotonic() + 30))))
    waiter.start()
    time.sleep(0.3)
    order.append(("released", None))
    gate.release(6)
    waiter.join(10)
    assert order == [("released", None), ("second", True)] and gate.held == 6
    gate.release(6)
    assert gate.acquire(25, time.monotonic())  # more than the whole GPU: it runs when nothing else holds any
    assert gpu_pass.MemoryGate(None).acquire(1e9, 0)  # the CPU: no gate

    # A command past its deadline is stopped with what it started, even a child in a session of
    # its own that ignores SIGINT (as torchrun's workers are started), and its output is kept.
    child = ("import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); print('child up', flush=True); "
             "time.sleep(120)")
    code = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {child!r}], "
            "start_new_session=True); print('grandchild', p.pid, flush=True); time.sleep(120)")
    t = time.monotonic()
    # (12 s: both Pythons have started and spoken by then, even on a loaded machine)
    row = gpu_pass.run_command(gpu_pass.Command(["-c", code]), tmp_path, dict(os.environ), time.monotonic() + 12,
                               tmp_path / "log", "the test's deadline")
    assert time.monotonic() - t < 12 + gpu_pass.GRACE_S + 5
    assert (row["status"], row["rc"]) == ("stopped", None)
    assert "stopped after" in row["tail"] and row["tail"].rstrip().endswith("the test's deadline")
    pid = int(re.search(r"grandchild (\d+)", row["tail"]).group(1))
    time.sleep(0.5)
    stat = Path(f"/proc/{pid}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] in "ZX"  # gone (or a zombie)


def test_gpu_pass_unpacks_a_carried_wheel_only_where_its_package_does_not_import(tmp_path):
    """The lent machine reaches no registry: a wheel carried in .carry/ (torchao's, for the
    float8 row) is unpacked and put on the commands' PYTHONPATH, so that they import it;
    a wheel whose packages import here already is left alone."""
    import os
    import subprocess
    import sys
    import zipfile

    from tools import gpu_pass
    carry = tmp_path / "carry"
    carry.mkdir()
    with zipfile.ZipFile(carry / "carried_pkg_xyz-1.0-py3-none-any.whl", "w") as z:
        z.writestr("carried_pkg_xyz/__init__.py", "WHERE = 'carried'\n")
        z.writestr("test/__init__.py", "")  # (torchao's wheel ships one: it would shadow the stdlib's)
        z.writestr("carried_pkg_xyz-1.0.dist-info/METADATA", "Name: carried_pkg_xyz\n")
    with zipfile.ZipFile(carry / "pytest-0.0-py3-none-any.whl", "w") as z:  # (importable here)
        z.writestr("pytest/__init__.py", "raise ImportError('the carried copy was used')\n")
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": "/elsewhere"}
    done = gpu_pass.unpack_carried(tmp_path / "site", env, carry)
    assert done == ["carried_pkg_xyz-1.0-py3-none-any.whl: unpacked (carried_pkg_xyz)",
                    "pytest-0.0-py3-none-any.whl: already importable here, not unpacked"], done
    assert env["PYTHONPATH"] == os.pathsep.join([str(tmp_path / "site"), "/elsewhere"])
    got = subprocess.run([sys.executable, "-c", "import carried_pkg_xyz; print(carried_pkg_xyz.WHERE)"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert got.stdout.strip() == "carried", got.stderr
    assert not (tmp_path / "site" / "pytest").exists() and not (tmp_path / "site" / "test").exists()
    none = {"PYTHONPATH": "/elsewhere"}
    assert gpu_pass.unpack_carried(tmp_path / "site2", none, tmp_path / "absent") == [] and none["PYTHONPATH"] == "/elsewhere"


def test_gpu_pass_on_a_gpu_stops_what_overruns_waits_for_memory_and_joins_gpu_check(tmp_path, monkeypatch):
    """The branches a rehearsal does not take, run here with a pretend 24 GiB GPU and commands
    standing in for the tools: the memory gate (two 14 GiB commands, one after the other), a
    command stopped at phase 2's end and the one after it not run, gpu_check's own --merge
    joining the part reports the streams wrote, and the files that come back."""
    import argparse
    import tarfile

    from tools import gpu_pass

    device = "NVIDIA H100 80GB HBM3"
    monkeypatch.setattr(gpu_pass, "probe_gpu", lambda: {"name": device, "bytes": 24 * 2**30, "torch": "2.11.0+cu130"})
    # A 60 s pass: phase 1 until 6 s, phase 2 until 25 s (room for two launches one after the other
    # on a loaded machine), then 35 s for the stop (SIGINT, SIGKILL 2 s later) and gpu_check's join
    monkeypatch.setattr(gpu_pass, "TIMINGS_SHARE", 0.1)
    monkeypatch.setattr(gpu_pass, "RESERVE_S", 35)
    monkeypatch.setattr(gpu_pass, "GRACE_S", 2)
    monkeypatch.setattr(gpu_pass, "MIN_START_S", 1)
    ok = {"ok": True, "step_time_s": 0.1, "tokens_per_s": 1000.0, "mfu": 0.3, "dtype": "bf16", "flags": [],
          "allocator_peak_bytes": 2**30, "traced_peak_bytes": 2**30, "final_loss": 5.0, "scale": "125m", "ranks": 1,
          "fake_world_size": None, "script": "s.py"}

    def launch(part: str, run: str, figure: str) -> gpu_pass.Command:  # a gpu_check launch's files, as it writes them
        report = json.dumps({"device": device, "gpus": 1, "torch": "2.11.0+cu130", "date": "2026-11-28",
                             "runs": [{**ok, "name": run}], "tests": None, "wall_s": 1.0})
        code = (f"import pathlib, time; time.sleep(1); d = pathlib.Path({gpu_pass.PARTS + '/' + part!r}); "
                f"d.mkdir(parents=True); (d / 'gpu_check_h100.json').write_text({report!r}); "
                f"(d / '{figure}_cuda_h100.png').write_bytes(b'png')")
        return gpu_pass.Command(["-c", code], 14)

    table = [gpu_pass.Stream("throughput", 1, "t", [gpu_pass.Command(["-c", "print('timed alone')"])]),
             gpu_pass.Stream("check_a", 2, "t", [launch("check_a-1", "02_amp", "02_memory_trace_amp")]),
             gpu_pass.Stream("check_b", 2, "t", [launch("check_b-1", "01_baseline", "01_memory_trace_baseline")]),
             gpu_pass.Stream("dry8b", 2, "t", [gpu_pass.Command(["-c", "import time; print('up', flush=True); "
                                                                       "time.sleep(60)"], 2),
                                               gpu_pass.Command(["-c", "print('never')"], 2)])]
    monkeypatch.setattr(gpu_pass, "streams", lambda rehearse=False, big=False: table)
    out = tmp_path / "out"
    args = argparse.Namespace(budget=60, report_dir=str(out), argv=["--report-dir", "OUT"], keep_runs=None)
    assert gpu_pass.run_pass(args, rehearse=False) == 1  # not everything ran
    assert sorted(p.name for p in out.iterdir()) == ["figs.tar.gz", "gpu_check_h100.json", "gpu_check_h100.md",
                                                     "gpu_pass.json", "gpu_pass.md"]
    report = json.loads((out / "gpu_pass.json").read_text())
    assert (report["mode"], report["device"], report["gpu_memory_gib"]) == ("gpu", device, 24.0)
    rows = {s["name"]: s["commands"] for p in report["phases"] for s in p["streams"]}
    assert rows["throughput"][0]["tail"].strip() == "timed alone"
    (a,), (b,) = rows["check_a"], rows["check_b"]
    first, second = sorted([a, b], key=lambda c: c["at_s"])
    assert second["waited_s"] > 0 and second["at_s"] >= first["at_s"] + first["seconds"] - 0.1  # 14 + 14 > 20 GiB
    assert [c["status"] for c in rows["dry8b"]] == ["stopped", "not run"]
    stopped = rows["dry8b"][0]["tail"]
    assert stopped.startswith("up") and "phase 2's end (25 s into the budget)" in stopped
    assert report["gpu_check_merge"]["status"] == "ok"
    check = json.loads((out / "gpu_check_h100.json").read_text())
    assert [r["name"] for r in check["runs"]] == ["01_baseline", "02_amp"] and check["note"] == gpu_pass.CONTENTION_NOTE
    with tarfile.open(out / "figs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"figs/02_memory_trace_amp_cuda_h100.png", "figs/01_memory_trace_baseline_cuda_h100.png",
            "trees/check_a/figs/gpu_check_parts/check_a-1/gpu_check_h100.json", "logs/dry8b_1.log",
            "logs/gpu_check_merge.log"} <= names
    assert "### dry8b: stopped" in (out / "gpu_pass.md").read_text()
    # ... and what came back joins into figs/ here: the figures, gpu_check's parts, the pass's report
    figs = tmp_path / "figs"
    md = gpu_pass.merge([str(out)], figs).read_text()
    assert (figs / "01_memory_trace_baseline_cuda_h100.png").read_bytes() == b"png"
    assert [r["name"] for r in json.loads((figs / "gpu_check_h100.json").read_text())["runs"]] == ["01_baseline",
                                                                                                  "02_amp"]
    assert "### dry8b: stopped" in md and "| 01_baseline | no |" in md  # its predicted step beside the measured


def _pass_folder(folder, device, streams, rehearse=False, tar_files=()):
    """A pass's report folder as a lent machine sends it back: gpu_pass.json and the tarball."""
    import io
    import tarfile
    folder.mkdir()
    phases = [{"phase": n, "what": f"phase {n}", "until_s": 200 * n, "seconds": 10.0,
               "streams": [{"name": name, "phase": n, "targets": "t", "state": "ok", "seconds": 1.0,
                            "commands": [{"command": f"python {name}", "rc": 0, "status": "ok", "seconds": 1.0,
                                          "gib": 0, "tail": f"{name} said {text}"}]}
                           for name, phase, text in streams if phase == n]} for n in (1, 2)]
    (folder / "gpu_pass.json").write_text(json.dumps({
        "mode": "rehearse" if rehearse else "gpu", "device": device, "torch": "2.11.0+cu130", "date": "2026-11-28",
        "commit": "abc1234", "budget_s": 570, "wall_s": 500.0, "phases": phases}))
    with tarfile.open(folder / "figs.tar.gz", "w:gz") as tar:
        for name, data in tar_files:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_gpu_pass_merge_and_refusals(tmp_path, monkeypatch, capsys):
    from common.measure.machines import GPUS
    from common.measure.steptime import step_time
    from common.measure.plan import Plan
    from common.model import get_config
    from tools import gpu_pass

    device = "NVIDIA H100 80GB HBM3"
    ok = {"ok": True, "tokens_per_s": 1000.0, "mfu": 0.3, "dtype": "bf16", "allocator_peak_bytes": 2**30,
          "traced_peak_bytes": 2**30, "final_loss": 5.0, "flags": [], "ranks": 1, "fake_world_size": None,
          "script": "s.py"}

    def part(runs: list[dict]) -> bytes:
        return json.dumps({"device": device, "gpus": 1, "torch": "2.11.0+cu130", "date": "2026-11-28",
                           "runs": runs, "tests": None, "wall_s": 60.0}).encode()

    parts = "trees/{}/figs/gpu_check_parts/{}/gpu_check_h100.json"
    _pass_folder(tmp_path / "p1", device, [("throughput", 1, "first"), ("check_a", 2, "first"), ("dry8b", 2, "first")],
                 tar_files=[("figs/01_memory_trace_baseline_cuda_h100.png", b"png"),
                            ("../evil.png", b"outside"), ("trees/../../evil.json", b"{}"),
                            (parts.format("check_a", "check_a-1"), part([
                                {**ok, "name": "02_amp", "step_time_s": 0.05, "scale": "125m"}])),
                            (parts.format("check_b", "check_b-1"), part([
                                {**ok, "name": "1b_amp_compile", "step_time_s": 0.2, "scale": "1b"},
                                {"name": "1b_fp32", "ok": False, "error": "CUDA out of memory", "flags": [],
                                 "scale": "1b", "ranks": 1, "fake_world_size": None, "script": "t.py"}]))])
    _pass_folder(tmp_path / "p2", device, [("check_a", 2, "second")])  # a later pass's stream replaces the first's
    figs = tmp_path / "figs"
    md = gpu_pass.merge([str(tmp_path / "p1"), str(tmp_path / "p2")], figs).read_text()
    assert (figs / "01_memory_trace_baseline_cuda_h100.png").read_bytes() == b"png"
    assert not (tmp_path / "evil.png").exists() and not (tmp_path / "evil.json").exists()
    check = json.loads((figs / "gpu_check_h100.json").read_text())  # gpu_check's own merge of the part reports
    assert [r["name"] for r in check["runs"]] == ["02_amp", "1b_fp32", "1b_amp_compile"]
    assert check["note"] == gpu_pass.CONTENTION_NOTE
    rows = {r["name"]: r for r in gpu_pass.predicted_vs_measured(check)}
    for name, model, batch, seq, compiled, measured in [("02_amp", "125m", 12, 1024, False, 0.05),
                                                         ("1b_amp_compile", "1b", 4, 2048, True, 0.2)]:
        t = step_time(Plan(get_config(model), "single", batch=batch, seq_len=seq, dtype="bf16", device="cuda"),
                      GPUS["h100"], compiled)  # gpu_check's scale for these runs, on the H100's sheet
        assert rows[name]["predicted_ms"] == pytest.approx(t["step"] * 1e3)
        assert rows[name]["ratio"] == pytest.approx(measured / t["step"])
        assert f"| {name} | {'yes' if compiled else 'no'} | {measured * 1e3:,.1f} | {t['step'] * 1e3:,.1f} |" in md
    assert rows["1b_fp32"] == {"name": "1b_fp32", "why": "CUDA out of memory"} and "| 1b_fp32 | - |" in md
    assert rows["01_baseline"]["why"] == "did not run"
    heads = [line for line in md.splitlines() if line.startswith("#")]
    assert heads == [f"# GPU pass on {device}", "## Phase 1: phase 1 (until 200 s; took 10.0 s)",
                     "### throughput: ok, 1.0 s", "## Phase 2: phase 2 (until 400 s; took 10.0 s)",
                     "### check_a: ok, 1.0 s", "### dry8b: ok, 1.0 s",
                     "## One rank: the step-time model against the measured step"]
    assert "check_a said second" in md and "check_a said first" not in md and "dry8b said first" in md
    assert (figs / "gpu_pass_h100.md").read_text() == md

    _pass_folder(tmp_path / "toy", "CPU (rehearsal: tiny models)", [("check_a", 2, "toy")], rehearse=True)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv, sentence in [
            ([], "error: no CUDA GPU is visible here; the GPU pass measures a GPU: run it on one, or pass --rehearse "
                 "for the same streams on the CPU (--list shows what it would run)"),
            (["--budget", "10"], "error: --budget must be between 60 and 3600 seconds (got 10)"),
            (["--budget", "nan", "--rehearse"], "error: --budget must be between 60 and 3600 seconds (got nan)"),
            (["--rehearse"], "error: --report-dir is missing: name the empty or new folder the pass's files (at most "
                             "8) go to"),
            (["--rehearse", "--report-dir", str(tmp_path / "full")],
             f"error: --report-dir {tmp_path / 'full'} is not an empty folder: give a new one (the pass writes at "
             f"most 8 files, and no others may be mistaken for them)"),
            (["--merge", str(tmp_path / "toy")], f"error: --merge: {tmp_path / 'toy'} holds a rehearsal's report (the "
                                                 f"CPU, tiny models): only GPU passes are merged into figs/"),
            (["--merge", str(tmp_path / "nope")], f"error: --merge: no gpu_pass.json in {tmp_path / 'nope'} (give the "
                                                  f"folders --report-dir filled)")]:
        assert gpu_pass.main(argv) == 2
        assert capsys.readouterr().err.strip().splitlines() == [sentence]


def test_gpu_pass_rehearsal_runs_every_stream_and_brings_back_at_most_8_files(launches):
    """The pass on this CPU (--rehearse): both phases, every stream, every command exiting 0, at
    most the 8 files a lent machine sends back, gpu_check's reports joined with a row for each
    of its toy runs, and a tarball that opens (the figures, the part reports, every log)."""
    import re
    import shlex
    import tarfile

    from tools import gpu_check, gpu_pass

    code, log, out = launches["rehearse"]
    assert code == 0, log[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["figs.tar.gz", "gpu_check_cpu.json", "gpu_check_cpu.md", "gpu_pass.json", "gpu_pass.md"]
    assert len(list(out.rglob("*"))) <= gpu_pass.MAX_FILES
    report = json.loads((out / "gpu_pass.json").read_text())
    assert report["mode"] == "rehearse" and report["commit"] and report["torch"] and report["date"]
    table = gpu_pass.streams(rehearse=True)
    assert [p["phase"] for p in report["phases"]] == [1, 2]
    for p in report["phases"]:
        assert [s["name"] for s in p["streams"]] == [s.name for s in table if s.phase == p["phase"]]
        for s, stream in zip(p["streams"], (s for s in table if s.phase == p["phase"])):
            assert [c["command"] for c in s["commands"]] == [f"python {shlex.join(c.argv)}" for c in stream.commands]
            assert all(c["rc"] == 0 and c["status"] == "ok" for c in s["commands"]), s
    # phase 1's commands ran alone, one after another; phase 2's side by side, after them
    # (the report rounds each start and length to 0.1 s: an end read back from two rounded
    # numbers may pass the next start, also rounded, by up to 0.15 s)
    one, two = ([c for s in p["streams"] for c in s["commands"]] for p in report["phases"])
    assert all(a["at_s"] + a["seconds"] <= b["at_s"] + 0.15 for a, b in zip(one, one[1:]))
    assert max(c["at_s"] + c["seconds"] for c in one) <= min(c["at_s"] for c in two) + 0.15
    firsts = [s["commands"][0] for s in report["phases"][1]["streams"]]
    assert max(c["at_s"] for c in firsts) < min(c["at_s"] + c["seconds"] for c in two)  # every stream at once
    check = json.loads((out / "gpu_check_cpu.json").read_text())
    assert [row["name"] for row in check["runs"]] == [c.name for c in gpu_check.CHECKS if c.toy]
    with tarfile.open(out / "figs.tar.gz") as tar:  # each gpu_check part said all of its runs ran
        said = [re.findall(r"^(\d+) of (\d+) runs ran", tar.extractfile(m).read().decode(), re.M)
                for m in tar.getmembers() if re.match(r"logs/check_\w+_\d+\.log$", m.name)]
    assert all(len(x) == 1 and x[0][0] == x[0][1] for x in said) and sum(int(x[0][0]) for x in said) == len(
        check["runs"]), said
    assert all(row["ok"] for row in check["runs"]), [row for row in check["runs"] if not row["ok"]]
    with tarfile.open(out / "figs.tar.gz") as tar:
        names = tar.getnames()
    logs = {n for n in names if n.startswith("logs/")}
    assert logs == {f"logs/{s.name}_{k}.log" for s in table for k in range(1, len(s.commands) + 1)}
    assert {f"figs/{c.figure}_cpu_toy.png" for c in gpu_check.CHECKS if c.figure and c.toy} <= set(names)
    assert len([n for n in names if n.endswith("/gpu_check_cpu.json")]) == len(gpu_pass.check_groups(True))


def test_gpu_check_merge_keeps_every_row_and_refuses_another_gpu(tmp_path, capsys):
    """Reports made in parts (``--only``, in copies of the tree) join into one: every row of
    each, a failed one with its error, in CHECKS order (a later report's row of the same name
    wins), the figures beside the reports copied in, the note carried. Another GPU's or torch's
    report is refused in one sentence. The H200's report in figs/ was made this way."""
    from tools import gpu_check

    head = {"device": "NVIDIA H200", "gpus": 1, "torch": "2.11.0+cu130", "date": "2026-11-26", "tests": None}
    ok = {"ok": True, "step_time_s": 0.1, "tokens_per_s": 1000.0, "mfu": 0.3, "dtype": "bf16",
          "allocator_peak_bytes": 2**30, "traced_peak_bytes": 2**30, "final_loss": 5.0, "flags": [], "scale": "125m",
          "ranks": 1, "fake_world_size": None, "script": "s.py"}
    parts = {"a": [{**ok, "name": "1b_amp"}, {**ok, "name": "02_amp", "step_time_s": 0.5}],
             "b": [{"name": "03_tp", "ok": False, "error": "RuntimeError: mixed torch.Tensor and DTensor",
                    "flags": [], "scale": "125m", "ranks": 1, "fake_world_size": None, "script": "t.py"},
                   {**ok, "name": "02_amp", "step_time_s": 0.04}, {**ok, "name": "01_baseline"}]}
    paths = []
    for key, runs in parts.items():
        (tmp_path / key / "figs").mkdir(parents=True)
        (tmp_path / key / "figs" / f"0{len(key)}_x_{key}_cuda_h200.png").write_bytes(b"png")
        (tmp_path / key / "figs" / "01_other_cuda_h100.png").write_bytes(b"another GPU's")
        paths.append(tmp_path / key / f"gpu_check_{key}.json")
        paths[-1].write_text(json.dumps({**head, "runs": runs, "wall_s": 10.0}))
    out = tmp_path / "out"
    md = gpu_check.merge([str(p) for p in paths], out, note="measured side by side").read_text()
    report = json.loads((out / "gpu_check_h200.json").read_text())
    assert [r["name"] for r in report["runs"]] == ["01_baseline", "02_amp", "1b_amp", "03_tp"]
    assert {r["name"]: r.get("step_time_s") for r in report["runs"]}["02_amp"] == 0.04
    assert "| 03_tp | `t.py` (125m) | 1 | no: RuntimeError: mixed torch.Tensor and DTensor |" in md
    assert "| 02_amp | `s.py` (125m) | 1 | yes | 40.0 ms |" in md
    assert ("--merge REPORT.json REPORT.json --note NOTE` from 2 reports of that machine, one a part: 02, 1b (2 runs, "
            "10 s); 01, 02, 03 (3 runs, 10 s).") in md  # what each part ran, not the files: they are not here
    assert "NOTE: measured side by side" in md and report["note"] == "measured side by side"
    assert sorted(p.name for p in out.glob("*.png")) == ["01_x_a_cuda_h200.png", "01_x_b_cuda_h200.png"]
    assert gpu_check.markdown({**report, "merged": None, "note": None}).splitlines()[1:3] == ["", "| run | " + md.split(
        "| run | ", 1)[1].split("\n", 1)[0]]  # a report not merged reads as before
    # merged again with another note: the same rows and parts, the note replaced
    again = tmp_path / "again"
    md2 = gpu_check.merge([str(out / "gpu_check_h200.json")], again, note="a corrected note").read_text()
    report2 = json.loads((again / "gpu_check_h200.json").read_text())
    assert {k: v for k, v in report2.items() if k != "note"} == {k: v for k, v in report.items() if k != "note"}
    assert md2 == md.replace("NOTE: measured side by side", "NOTE: a corrected note")

    (tmp_path / "c.json").write_text(json.dumps({**head, "torch": "2.13.0", "runs": []}))
    assert gpu_check.main(["--merge", str(paths[0]), str(tmp_path / "c.json"), "--report-dir", str(out)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --merge: c.json was made with torch '2.13.0', gpu_check_a.json with '2.11.0+cu130': merge one "
        "GPU's reports from one torch"]
    assert gpu_check.main(["--merge", str(tmp_path / "nope.json")]) == 2
    assert "no report at" in capsys.readouterr().err


def test_the_h200_report_in_figs_keeps_every_run_and_its_errors():
    """figs/gpu_check_h200.json is the H200's three reports joined (01/02, 1b, 03): every run
    gpu_check has, the failures with their error lines, and the figures it names beside it."""
    from tools import gpu_check
    report = json.loads((ROOT / "figs" / "gpu_check_h200.json").read_text())
    assert (report["device"], report["torch"], report["date"]) == ("NVIDIA H200", "2.11.0+cu130", "2026-11-26")
    # runs gpu_check gained after that pass: 02_amp_ac_first (a first traced step: nothing of an earlier step alive in it)
    # and 03_missed_* (the layouts the memory formula once missed, dry-run on CUDA)
    since = {"02_amp_ac_first"} | {c.name for c in gpu_check.CHECKS if c.name.startswith("03_missed_")}
    assert [r["name"] for r in report["runs"]] == [c.name for c in gpu_check.CHECKS if c.name not in since]
    failed = [r for r in report["runs"] if not r["ok"]]
    assert len(failed) == 8 and all(r["error"] for r in failed)  # the foreach and pipeline timer bugs
    assert [m["prefixes"] for m in report["merged"]] == [["01", "02"], ["1b"], ["03"]]
    for c in gpu_check.CHECKS:
        if c.figure and any(r["name"] == c.name and r["ok"] for r in report["runs"]):
            assert (ROOT / "figs" / f"{c.figure}_cuda_h200.png").exists(), c.figure
