"""tools/scaling.py: strong and weak scaling from real torchrun launches, and its arithmetic."""
from __future__ import annotations

import json

import pytest

from tools.scaling import efficiency, main


def test_efficiency_is_the_textbook_ratio():
    assert efficiency("strong", 4, t1=1.0, tn=0.25) == 1.0  # four times as fast on four ranks: perfect
    assert efficiency("strong", 4, t1=1.0, tn=0.5) == 0.5
    assert efficiency("weak", 4, t1=1.0, tn=1.25) == 0.8  # four times the work in 1.25x the time


def test_a_study_on_one_and_two_ranks_writes_its_table_and_figure(tmp_path, capsys):
    """DDP on 1 and 2 ranks (three launches: the 1-rank run is both modes' baseline): the
    efficiencies are those of the runs' own step times, and the files are written."""
    points = main(["--strategies", "ddp", "--ranks", "1,2", "--global-batch-size", "4", "--model", "debug",
                   "--seq-len", "32", "--steps", "5", "--data", "synthetic", "--device", "cpu",
                   "--out", str(tmp_path)])
    assert [(p["mode"], p["ranks"], p["global_batch"]) for p in points] == [
        ("strong", 1, 4), ("strong", 2, 4), ("weak", 1, 4), ("weak", 2, 8)]
    t = {(p["mode"], p["ranks"]): json.loads((tmp_path / (f"ddp_{p['mode']}_{p['ranks']}" if p["ranks"] > 1
                                                           else "ddp_1") / "summary.json").read_text())["step_time_s"]
         for p in points}
    assert points[1]["efficiency"] == pytest.approx(t["strong", 1] / (2 * t["strong", 2]))
    assert points[3]["efficiency"] == pytest.approx(t["weak", 1] / t["weak", 2])
    assert points[0]["comm_share"] == 0 and 0 < points[1]["comm_share"] < 1
    for f in ("scaling.md", "scaling.png", "scaling.json"):
        assert (tmp_path / f).exists(), f
    assert "| DDP | weak | 2 | 8 |" in capsys.readouterr().out


@pytest.mark.parametrize("argv,sentence", [
    (["--ranks", "2,4"], "--ranks 2,4: start at 1 (the baseline every efficiency divides by) and add at least one more."),
    (["--ranks", "1,3", "--global-batch-size", "8"],
     "--global-batch-size 8 does not split over 3 ranks for strong scaling; use a multiple of 3."),
    (["--strategies", "tp"], "--strategies tp: choose from ddp, fsdp."),
    (["--ranks", "1,two"], "--ranks 1,two: give world sizes separated by commas, e.g. 1,2,4."),
])
def test_misuse_is_one_sentence(argv, sentence, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == f"error: {sentence}"


def test_lr_scaling_runs_spend_the_same_tokens_with_each_rule():
    from tools.lr_scaling import plan
    runs = plan(k=4, batch=8, steps=200, lr=1e-3, warmup=20)
    assert [r["name"] for r in runs] == ["baseline", "keep", "keep_no_warmup", "linear", "linear_no_warmup", "sqrt",
                                         "sqrt_no_warmup"]
    assert {r["batch"] * r["steps"] for r in runs} == {1600}  # one token budget
    lrs = {r["name"]: r["lr"] for r in runs}
    assert lrs["keep"] == 1e-3 and lrs["linear"] == pytest.approx(4e-3) and lrs["sqrt"] == pytest.approx(2e-3)
    assert {r["name"]: r["warmup"] for r in runs if r["rule"] != "-"} == {
        "keep": 5, "keep_no_warmup": 0, "linear": 5, "linear_no_warmup": 0, "sqrt": 5, "sqrt_no_warmup": 0}


def test_lr_scaling_trains_every_run_and_writes_the_table(tmp_path, capsys):
    """Seven short runs of step 2's script in this process (debug model, synthetic data)."""
    from tools.lr_scaling import main as lr_main
    results = lr_main(["--k", "2", "--steps", "4", "--warmup-steps", "2", "--model", "debug", "--seq-len", "32",
                       "--data", "synthetic", "--device", "cpu", "--eval-batches", "1", "--out", str(tmp_path)])
    assert len(results) == 7 and all(r["val_loss"] is not None for r in results)
    for r in results:  # the curve's last point: all the tokens of the budget, the run's last loss
        assert r["curve"][-1][0] == 8 * 4 * 32 and r["curve"][-1][1] == pytest.approx(r["final_loss"])
    table = (tmp_path / "lr_scaling.md").read_text()
    assert table.count("\n| ") == 7 and "| linear | 16 | 2 | 2.00e-03 | 1 |" in table
    assert (tmp_path / "lr_scaling.png").exists()


@pytest.mark.parametrize("argv,sentence", [
    (["--k", "1"], "--k must be at least 2 (got 1): the batch has to grow."),
    (["--k", "3", "--steps", "200", "--warmup-steps", "20"],
     "--steps 200 and --warmup-steps 20 must be multiples of --k 3, so that every run sees the same tokens and "
     "warms up over the same ones."),
])
def test_lr_scaling_misuse_is_one_sentence(argv, sentence, capsys):
    from tools.lr_scaling import main as lr_main
    with pytest.raises(SystemExit) as e:
        lr_main(argv)
    assert e.value.code == 2 and capsys.readouterr().err.strip() == f"error: {sentence}"
