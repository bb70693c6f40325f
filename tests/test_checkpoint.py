"""Checkpoints, exact resume, elastic restart and damaged checkpoints, on step 1."""
import json
import shutil
import subprocess
import sys

import pytest
import torch

from common.checkpoint import complete_checkpoints
from common.model import Transformer, get_config
from conftest import ROOT

SCRIPT = str(ROOT / "step1_single_gpu" / "train.py")
FLAGS = ["--model", "debug", "--steps", "6", "--seq-len", "32", "--global-batch-size", "4", "--device", "cpu",
         "--no-trace-memory", "--eval-batches", "0", "--ckpt-every", "2"]


def _losses(folder):
    return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _run(cmd, timeout=180):
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted run, and one that crashes at step 3 and is restarted by torchrun."""
    tmp = tmp_path_factory.mktemp("ckpt")
    plain = subprocess.Popen([sys.executable, SCRIPT, *FLAGS, "--out", str(tmp / "plain")], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    elastic = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                    "--max-restarts", "1", SCRIPT, *FLAGS, "--resume", "--fail-at-step", "3",
                    "--out", str(tmp / "elastic")])
    out, err = plain.communicate(timeout=180)
    assert plain.returncode == 0, err[-2000:]
    return tmp, elastic


def test_elastic_restart_resumes_exactly(runs):
    tmp, elastic = runs
    assert elastic.returncode == 0, elastic.stderr[-3000:]
    assert "crashing on purpose" in elastic.stdout           # it really died once
    assert "resumed from" in elastic.stdout and "step_00000003" in elastic.stdout
    assert _losses(tmp / "elastic") == _losses(tmp / "plain")  # every step, bit for bit
    # keep the newest two complete checkpoints, nothing partial
    assert [p.name for p in complete_checkpoints(tmp / "elastic" / "checkpoints")] == \
        ["step_00000003", "step_00000005"]
    assert not list((tmp / "elastic" / "checkpoints").glob("*_partial"))


def test_a_partial_checkpoint_is_never_loaded(runs, tmp_path):
    tmp, _ = runs
    out = tmp_path / "run"
    shutil.copytree(tmp / "plain", out)
    ckpts = out / "checkpoints"
    # a crash in the middle of writing step 7: files there, but never renamed, no meta.json
    shutil.copytree(ckpts / "step_00000005", ckpts / "step_00000007_partial")
    (ckpts / "step_00000007_partial" / "meta.json").unlink()
    assert complete_checkpoints(ckpts)[-1].name == "step_00000005"


def test_export_gives_a_plain_file_with_the_trained_weights(runs, tmp_path):
    tmp, _ = runs
    dest = tmp_path / "model.pt"
    r = _run([sys.executable, "-m", "common.checkpoint", "export",
              str(tmp / "plain" / "checkpoints" / "step_00000005"), str(dest)])
    assert r.returncode == 0, r.stderr
    saved = torch.load(dest, weights_only=False)
    model = Transformer(get_config("debug"))
    model.load_state_dict(saved["model"])  # strict: every weight is there
    assert saved["step"] == 5
    assert not torch.equal(model.tok_embeddings.weight, torch.zeros_like(model.tok_embeddings.weight))


def test_damaged_or_mismatched_checkpoints_are_clear_errors(runs, tmp_path):
    tmp, _ = runs
    broken = tmp_path / "broken"
    shutil.copytree(tmp / "plain", broken)
    newest = broken / "checkpoints" / "step_00000005"
    data = next(newest.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])  # truncated, as a full disk leaves it
    before = {p.name: p.stat().st_size for p in newest.iterdir()}
    procs = {
        "truncated": subprocess.Popen([sys.executable, SCRIPT, *FLAGS, "--steps", "8", "--resume",
                                       "--out", str(broken)], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                                      stdout=subprocess.DEVNULL),
        "other model": subprocess.Popen([sys.executable, SCRIPT, *FLAGS, "--n-layers", "2", "--resume",
                                         "--out", str(tmp / "plain")], cwd=ROOT, stderr=subprocess.PIPE,
                                        text=True, stdout=subprocess.DEVNULL),
        "other batch": subprocess.Popen([sys.executable, SCRIPT, *FLAGS, "--global-batch-size", "8", "--resume",
                                         "--out", str(tmp / "plain")], cwd=ROOT, stderr=subprocess.PIPE,
                                        text=True, stdout=subprocess.DEVNULL),
    }
    expected = {"truncated": "step_00000005 cannot be read",
                "other model": "holds a 'debug' model with a different shape",
                "other batch": "was trained with --global-batch-size 4, this run asks for 8"}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 2, f"{name}: {err[-2000:]}"
        lines = err.strip().splitlines()
        assert len(lines) == 1 and expected[name] in lines[0], f"{name}: {err[-2000:]}"
    # nothing already saved was touched
    assert {p.name: p.stat().st_size for p in newest.iterdir()} == before
    assert len(_losses(tmp / "plain")) == 6


def test_non_finite_loss_stops_with_the_step_and_rank(tmp_path):
    r = _run([sys.executable, SCRIPT, *FLAGS, "--lr", "1e6", "--ckpt-every", "0", "--out", str(tmp_path)])
    assert r.returncode == 2
    assert "error: the loss is nan at step" in r.stderr and "(rank 0)" in r.stderr
