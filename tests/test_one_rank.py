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

from conftest import ROOT, hang_limit
from tests.tolerances import check_allocator, check_optimizer_path

TIMEOUT_S = hang_limit(240)  # a hang detector: both launches take about 40 s on an idle 2-core machine
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
    summary = json.loads((out / name / "summary.json").read_text())
    assert summary["world_size"] == 1
    if summary.get("optimizer_kernels") is not None:  # (DeepSpeed's optimizer is not torch.optim's)
        check_optimizer_path(summary)  # one rank of TP, 2-D, 3-D, EP: DTensor and plain parameters, foreach
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


def test_gpu_check_without_a_gpu_says_so_in_one_sentence():
    import os
    # CUDA_VISIBLE_DEVICES="": no GPU for the child, whatever this machine has
    r = subprocess.run([sys.executable, "-m", "tools.gpu_check"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["error: no CUDA GPU is visible here (or this torch has no CUDA); run "
                                             "this on a GPU machine, or pass --cpu for the same runs at toy scale "
                                             "on the CPU"]


# The GPU pass (tools/gpu_pass.py): what a developer with a lent GPU runs, in parts. No GPU
# here, so what can be checked is that every command it would run parses with its own
# tool's parser, that the parts cover every gpu_check run, and its budget and merge logic.
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


def test_every_gpu_pass_command_parses_and_its_checks_cover_gpu_check(monkeypatch):
    from tools import gpu_check, gpu_pass

    for big in (False, True):
        for part in gpu_pass.parts(big):
            for c in part.commands:
                if c[1:3] == ["-m", "pytest"]:
                    continue
                _parses(c[1:], monkeypatch)
    only = [c[c.index("--only") + 1] for p in gpu_pass.parts() for c in p.commands if "--only" in c]
    covered = [c.name for c in gpu_check.CHECKS if c.name.startswith(tuple(",".join(only).split(",")))]
    assert covered == [c.name for c in gpu_check.CHECKS]  # nothing of gpu_check is left out of the pass
    # the suite on a GPU machine's cores: one test file to a worker (its launches share folders)
    import importlib.util
    (suite,) = next(p for p in gpu_pass.parts() if p.name == "tests").commands
    assert suite == gpu_check.suite_command() and suite[1:3] == ["-m", "pytest"]
    assert (suite[-4:] == ["-n", "auto", "--dist", "loadfile"]) == bool(importlib.util.find_spec("xdist"))


def test_gpu_pass_budget_order_merge_and_refusals(tmp_path, monkeypatch, capsys):
    from tools import gpu_pass

    P = gpu_pass.Part
    a, b, c = P("a", 4, [], ""), P("b", 4, [], ""), P("c", 1, [], "")
    assert gpu_pass.fits([a, b, c], 9) == ([a, b, c], [])
    assert gpu_pass.fits([a, b, c], 8.5) == ([a, b], [c])
    assert gpu_pass.fits([a, b, c], 5) == ([a], [b, c])  # in order: c waits for b
    assert gpu_pass.fits([P("big", 12, [], ""), c], 9) == ([P("big", 12, [], "")], [c])  # progress every call
    names = [p.name for p in gpu_pass.parts()]
    for i, parts in enumerate([names[:2], [names[1], names[3]]]):  # a later call's part replaces an earlier one
        d = tmp_path / f"call{i}"
        d.mkdir()
        rows = [{"name": n, "targets": "t", "commands": [{"command": "x", "rc": 0, "seconds": 1.0, "tail": f"{n}{i}"}]}
                for n in parts]
        (d / "gpu_pass.json").write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3", "torch": "2.11", "date": "d",
                                                     "parts": rows, "left": []}))
    # the first call brought gpu_check's report back in its tarball; two of its one-rank runs
    import tarfile
    from common.measure.steptime import GPUS, step_time
    from common.measure.theory import Plan
    from common.model import get_config
    runs = [{"name": "02_amp", "ok": True, "step_time_s": 0.05, "dtype": "bf16"},
            {"name": "1b_amp_compile", "ok": True, "step_time_s": 0.2, "dtype": "bf16"},
            {"name": "1b_fp32", "ok": False, "error": "CUDA out of memory"}]
    (tmp_path / "gpu_check_h100.json").write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3", "runs": runs}))
    with tarfile.open(tmp_path / "call0" / "figs.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "gpu_check_h100.json", arcname="figs/gpu_check_h100.json")
    (tmp_path / "gpu_check_h100.json").unlink()
    figs = tmp_path / "figs"
    figs.mkdir()
    md = gpu_pass.merge([str(tmp_path / "call0"), str(tmp_path / "call1")], figs).read_text()
    assert (figs / "gpu_pass_h100.md").exists() and (figs / "gpu_check_h100.json").exists()  # unpacked
    rows = {r["name"]: r for r in gpu_pass.predicted_vs_measured(json.loads((figs / "gpu_check_h100.json").read_text()))}
    for name, model, batch, seq, compiled, measured in [("02_amp", "125m", 12, 1024, False, 0.05),
                                                         ("1b_amp_compile", "1b", 4, 2048, True, 0.2)]:
        t = step_time(Plan(get_config(model), "single", batch=batch, seq_len=seq, dtype="bf16", device="cuda"),
                      GPUS["h100"], compiled)  # gpu_check's scale for these runs, on the H100's sheet
        assert rows[name]["predicted_ms"] == pytest.approx(t["step"] * 1e3)
        assert rows[name]["ratio"] == pytest.approx(measured / t["step"])
        assert f"| {name} | {'yes' if compiled else 'no'} | {measured * 1e3:,.1f} | {t['step'] * 1e3:,.1f} |" in md
    assert rows["1b_fp32"] == {"name": "1b_fp32", "why": "CUDA out of memory"} and "| 1b_fp32 | - |" in md
    assert rows["01_baseline"]["why"] == "did not run"
    heads = [line[3:] for line in md.splitlines() if line.startswith("## ")]
    assert heads == [names[0], names[1], names[3], "One rank: the step-time model against the measured step"]
    assert f"{names[1]}1" in md and f"{names[1]}0" not in md
    assert f"left for another call: {', '.join(n for n in names if n not in heads)}" in md

    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv, sentence in [([], "error: no CUDA GPU is visible here; the GPU pass measures a GPU: run it on one "
                                "(--list shows what it would run)"),
                           (["--parts", "nope"], f"error: no part is called 'nope'; the parts are {', '.join(names)}"),
                           (["--budget", "10"], "error: --budget must be between 60 and 3600 seconds (got 10)")]:
        assert gpu_pass.main(argv) == 2
        assert capsys.readouterr().err.strip().splitlines() == [sentence]


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
    # runs gpu_check gained after that pass: 02_amp_ac_first (the AC retention's proof, issue 43)
    since = {"02_amp_ac_first"}
    assert [r["name"] for r in report["runs"]] == [c.name for c in gpu_check.CHECKS if c.name not in since]
    failed = [r for r in report["runs"] if not r["ok"]]
    assert len(failed) == 8 and all(r["error"] for r in failed)  # the foreach and pipeline timer bugs
    assert [m["prefixes"] for m in report["merged"]] == [["01", "02"], ["1b"], ["03"]]
    for c in gpu_check.CHECKS:
        if c.figure and any(r["name"] == c.name and r["ok"] for r in report["runs"]):
            assert (ROOT / "figs" / f"{c.figure}_cuda_h200.png").exists(), c.figure
