"""The harness asks the device for nothing in a steady-state step (host syncs were most of an 8.8% overhead).

Every ``.item()`` (``float(t)``, ``bool(t)``, ``.tolist()``) of a step's own result makes
the host wait for the GPU to finish that step before it can queue the next. The harness
reads a step's loss and gradient norm one step late instead (common/measure/metrics.py).
On this CPU the same reads are counted by common/measure/syncs.py's dispatch mode, in the
real scripts' training loops, run in this process (debug model, a few steps). The 2-rank
DDP run is counted in tests/test_step3a.py's job (``ddp_syncs``).
"""
import json
import sys

import pytest
import torch
import torch.nn.functional as F

from common import ROOT  # noqa: E402
sys.path.insert(0, str(ROOT))

from common.measure.syncs import SyncCounter  # noqa: E402
from common.run import Run  # noqa: E402
from tools.multirun import run_script  # noqa: E402

FLAGS = ["--model", "debug", "--seq-len", "32", "--global-batch-size", "4", "--device", "cpu", "--data", "synthetic",
         "--eval-batches", "0", "--no-trace-memory", "--steps", "6"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():  # the debug model's ops are too small to share (see tests/test_step2.py)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def counted(script, out, *flags):
    """(exit code, stderr, SyncCounter, metrics.jsonl rows) of one run in this process."""
    with SyncCounter("cpu") as syncs:
        code, err = run_script(script, [*FLAGS, "--out", str(out), *flags], capture_stderr=True)
    path = out / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return code, err, syncs, rows


def test_the_counter_sees_an_item_per_step_and_the_rows_are_the_steps_own(monkeypatch, tmp_path):
    """The old harness's reads, put back (loss and grad_norm .item() in Run.log): the counter
    finds them, 2 a step. The numbers those reads return, taken as the steps end, are the
    rows that metrics.jsonl holds one step later: same step numbers, same values."""
    real, seen = Run.log, []

    def old_log(self, step, loss, **extra):
        seen.append((step, loss.item(), extra["grad_norm"].item()))
        return real(self, step, loss, **extra)

    monkeypatch.setattr(Run, "log", old_log)
    code, err, syncs, rows = counted("step1_single_gpu/train.py", tmp_path)
    assert code == 0, err
    assert syncs.steady() == [2, 2, 2, 2], syncs.by_step
    assert set(syncs.where) >= {f"tests/{__name__.split('.')[-1]}.py:{old_log.__code__.co_firstlineno + 1}"}
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in rows] == seen
    assert all(r["step_time_s"] > 0 and r["tokens_per_s"] > 0 and r["lr"] > 0 for r in rows)


@pytest.mark.parametrize("script", ["step1_single_gpu/train.py", "step2_memory/train_amp.py"])
def test_no_sync_in_a_steady_state_step(script, tmp_path):
    """Step 1 (fp32) and step 2 (bf16 autocast, the GradScaler's bf16 pass-through) with a
    checkpoint every 3 steps: none in the steps between; a checkpoint step reads its own
    numbers before saving (a sync, once every --ckpt-every), and so does the last step."""
    code, err, syncs, rows = counted(script, tmp_path, "--ckpt-every", "3")
    assert code == 0, err
    assert syncs.steps == [0, 1, 2, 3, 4, 5]
    per = syncs.per_step()
    assert [per[s] for s in (0, 1, 3, 4)] == [0, 0, 0, 0], syncs.where
    assert per[2] >= 1 and per[5] >= 1
    assert [r["step"] for r in rows] == list(range(6))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_loss"] == rows[-1]["loss"] and summary["steps"] == 6


def test_a_non_finite_loss_is_named_and_never_checkpointed(monkeypatch, tmp_path):
    """Read one step late, a NaN is still pinned on its own step; and a checkpoint step's loss
    is read before saving, so a NaN there stops the run before the checkpoint is written."""
    calls = []

    def nan_at(step):
        def cross_entropy(*a, **k):
            calls.append(1)
            loss = real(*a, **k)
            return loss * float("nan") if len(calls) == step + 1 else loss
        return cross_entropy

    real = F.cross_entropy
    for step, flags in ((3, []), (2, ["--ckpt-every", "3"])):  # between checkpoints; at one
        calls.clear()
        monkeypatch.setattr(F, "cross_entropy", nan_at(step))
        out = tmp_path / str(step)
        code, err, _, rows = counted("step1_single_gpu/train.py", out, *flags)
        assert code == 2 and f"the loss is nan at step {step} (rank 0)" in err, err
        assert [r["step"] for r in rows] == list(range(step + 1))  # the NaN step's row is written
        assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
