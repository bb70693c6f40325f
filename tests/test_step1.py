"""Step 1 end to end, as a learner runs it: plain python and torchrun, then misuse."""
import json
import subprocess
import sys

import pytest

from common.model import count_params, get_config
from conftest import ROOT

SCRIPT = str(ROOT / "step1_single_gpu" / "train.py")
TINY = ["--model", "debug", "--steps", "12", "--seq-len", "64", "--global-batch-size", "8", "--lr", "1e-2",
        "--device", "cpu"]


def _start(cmd, **kw):
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _finish(proc, timeout=240):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One plain-python run and one torchrun run, launched side by side."""
    tmp = tmp_path_factory.mktemp("step1")
    procs = {
        "python": _start([sys.executable, SCRIPT, *TINY, "--out", str(tmp / "python")]),
        "torchrun": _start([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                            SCRIPT, *TINY, "--out", str(tmp / "torchrun")]),
    }
    results = {k: _finish(p) for k, p in procs.items()}
    for k, (rc, out, err) in results.items():
        assert rc == 0, f"{k} run failed:\n{out}\n{err[-3000:]}"
    return tmp, results


def _metrics(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_training_lowers_the_loss_and_writes_every_output(runs):
    tmp, results = runs
    out = tmp / "python"
    rows = _metrics(out)
    assert [r["step"] for r in rows] == list(range(12))
    for key in ("loss", "tokens_per_s", "peak_mem_bytes", "step_time_s", "lr"):
        assert all(key in r for r in rows), key
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0
    summary = json.loads((out / "summary.json").read_text())
    n = count_params(get_config("debug"))
    assert summary["n_params"] == n and summary["world_size"] == 1
    assert summary["final_loss"] == rows[-1]["loss"]
    assert summary["mfu"] is None  # CPU: no made-up peak
    mem = summary["memory"][0]["peak_by_category"]
    assert mem["parameters"] == 4 * n and mem["gradients"] == 4 * n
    assert (out / "memory_trace.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "memory_trace.json").exists()
    assert "step/s" in results["python"][2] or "it/s" in results["python"][2] or "s/step" in results["python"][2]
    assert "peak memory" in results["python"][1]  # the end-of-run table


def test_torchrun_with_one_process_is_the_same_run(runs):
    tmp, _ = runs
    a, b = _metrics(tmp / "python"), _metrics(tmp / "torchrun")
    assert [r["loss"] for r in a] == [r["loss"] for r in b]


BAD = {
    "unknown preset": (["--model", "huge"], "unknown --model 'huge'"),
    "missing data": (["--data", "/no/such/place"], "no such file or folder"),
    "zero steps": (["--steps", "0"], "--steps must be positive"),
    "sequence too long": (["--model", "debug", "--seq-len", "4096"], "longer than model 'debug' supports (256)"),
}


def test_bad_input_is_one_clear_sentence_and_a_nonzero_exit():
    procs = {k: _start([sys.executable, SCRIPT, *flags, "--device", "cpu"]) for k, (flags, _) in BAD.items()}
    for k, proc in procs.items():
        rc, out, err = _finish(proc, timeout=120)
        expected = BAD[k][1]
        assert rc == 2, f"{k}: exit {rc}\n{err}"
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), f"{k}: {err}"
        assert expected in lines[0], f"{k}: {lines[0]}"
