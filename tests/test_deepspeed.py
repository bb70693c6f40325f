"""DeepSpeed beside our ZeRO (step3_multi_gpu/deepspeed.md).

DeepSpeed is not in requirements.txt and CI does not install it: the parity test skips
without it, and the other tests check, without it, that its absence costs one sentence
and never the rest of the tutorial.
"""
import json
import os
import runpy
import sys

import pytest

import launch
from common import ROOT
from common.model import count_params, get_config
from tools import deepspeed_compare

STEPS = ["--model", "debug", "--steps", "3", "--seq-len", "32", "--global-batch-size", "4", "--eval-batches", "0",
         "--trace-steps", "1", "--device", "cpu", "--data", str(ROOT / "common" / "model.py")]


def test_deepspeed_stages_match_ours_and_shard_what_zero_says(tmp_path):
    """One torchrun job, 2 ranks: our ZeRO-1 and DeepSpeed's stages 1-3 (fp32) give the same
    loss at every step (to 1e-5), our counter sees DeepSpeed's collectives (the calls its own
    comms logger sees, and the same bytes), and each rank
    holds the optimizer state ZeRO predicts: AdamW's 8N/W for ours, and for DeepSpeed 8N/W
    plus its fp32 master partition, 4N/W."""
    pytest.importorskip("deepspeed")
    names = ["ours_zero1", "ds_zero1", "ds_zero2", "ds_zero3"]
    deepspeed_compare.launch(names, 2, tmp_path, STEPS)
    ref = deepspeed_compare.losses(tmp_path / "ours_zero1")
    n, w = count_params(get_config("debug")), 2
    for name in names:
        s = json.loads((tmp_path / name / "summary.json").read_text())
        loss = deepspeed_compare.losses(tmp_path / name)
        assert len(loss) == 3 and max(abs(a - b) for a, b in zip(loss, ref)) < 1e-5, (name, loss, ref)
        assert deepspeed_compare.sent_per_step(s) > 2 * n, name  # at least the gradients' reduction, counted
        if name.startswith("ds"):  # DeepSpeed's own comms logger saw the calls our counter saw
            ours = {k.split(" ")[0]: v for k, v in s["comm"][0].items()}
            theirs = {k.replace("_into_tensor", "").replace("_tensor", ""): v
                      for k, v in s["deepspeed_comms_logger"].items()}
            assert {k: v["calls"] for k, v in ours.items()} == {k: v["calls"] for k, v in theirs.items()}, name
            for op, v in theirs.items():  # it logs an all-gather by each rank's input, we by the whole
                assert ours[op]["bytes"] == v["bytes"] * (w if op == "all_gather" else 1), (name, op)
        state = s["memory"][0]["peak_by_category"]["optimizer state"]
        want = (8 if name.startswith("ours") else 12) * n / w
        assert abs(state - want) / want < 0.01, (name, state, want)  # + AdamW's step counters
    params3 = json.loads((tmp_path / "ds_zero3" / "summary.json").read_text())["memory"][0]["at_peak"]["parameters"]
    assert params3 < 0.75 * 4 * n, "DeepSpeed ZeRO-3 kept whole parameters on a rank"


def test_without_deepspeed_the_comparer_says_so_and_compares_ours(monkeypatch, capsys, tmp_path):
    launched = []

    class Stop(BaseException):  # main_guard turns an Exception into exit 1
        pass

    def fake_launch(names, nproc, out, rest):
        launched.extend(names)
        raise Stop

    monkeypatch.setattr(deepspeed_compare, "have_deepspeed", lambda: False)
    monkeypatch.setattr(deepspeed_compare, "launch", fake_launch)
    with pytest.raises(Stop):
        deepspeed_compare.main(["--out", str(tmp_path)])
    assert deepspeed_compare.NO_DEEPSPEED in capsys.readouterr().out
    assert launched == ["ours_zero1", "ours_zero2", "ours_zero3"]


def test_without_deepspeed_the_script_is_one_sentence(monkeypatch, capsys, tmp_path):
    """Where `import deepspeed` fails: exit 2 and one line naming the install, no traceback."""
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed raises ImportError
    monkeypatch.setattr(sys, "argv", ["train_deepspeed.py", "--out", str(tmp_path), "--device", "cpu"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(ROOT / "step3_multi_gpu" / "train_deepspeed.py"), run_name="__main__")
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: DeepSpeed is not installed (the tutorial does not need it, only this comparison does); "
        "pip install deepspeed==0.19.8."]


def test_a_stop_signal_stops_deepspeed_at_one_step_unsaved(tmp_path):
    """SIGTERM to rank 1 alone at step 1 of ZeRO-3: train_deepspeed.py takes part in the stop
    vote (Run's), so both ranks stop after step 2, the same step, and exit 75 with one sentence
    from rank 0; it cannot save DeepSpeed's engine with common/checkpoint.py (it refuses
    --ckpt-every), so it writes no checkpoint and says the steps are lost. (Before, the stop
    tried a DCP save of ZeRO-3's emptied parameters and failed with a wrong sentence.)"""
    pytest.importorskip("deepspeed")
    r = launch.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    "step3_multi_gpu/train_deepspeed.py", *STEPS, "--steps", "4", "--zero-stage", "3",
                    "--no-trace-memory", "--fail-at-step", "1", "--fail-rank", "1", "--fail-how", "sigterm",
                    "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=180,
                   env=dict(os.environ, DS_ACCELERATOR="cpu"))
    # (torchrun names the first rank to leave with 75; the other may be stopped by it first)
    assert r.returncode != 0 and "exitcode  : 75" in r.stderr, r.stderr[-3000:]
    said = [line for line in r.stderr.splitlines() if line.startswith("preempted")]
    assert said == ["preempted at step 2: every rank stopped there, but train_deepspeed.py does not checkpoint, so "
                    "nothing was saved and the 3 steps trained are lost; run it again from the start."], r.stderr[-3000:]
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())
