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
