"""Step 1 end to end, as a learner runs it: plain python and torchrun, then misuse."""
import json
import subprocess
import sys

import pytest

from common.model import count_params, get_config
import launch
from conftest import ROOT

SCRIPT = str(ROOT / "step1_single_gpu" / "train.py")
TINY = ["--model", "debug", "--steps", "12", "--seq-len", "64", "--global-batch-size", "8", "--lr", "1e-2",
        "--device", "cpu"]


def _start(cmd, **kw):
    return launch.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


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
    # the trace held to the CPU allocator's own count of the traced steps
    assert summary["memory"][0]["peak_bytes"] / summary["memory"][0]["allocator_peak_bytes"] == pytest.approx(1, abs=0.01)
    assert summary["gc"]["tensor_bytes"] == [0] * 12  # no step left a tensor in a reference cycle
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


def _main(monkeypatch, argv):
    """step 1's main() in this process: (exit code, the loaded script module)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("step1_train_in_process", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", [SCRIPT, *argv])
    try:
        module.main()
        code = 0
    except SystemExit as e:
        code = e.code
    return code, module


QUIET = ["--model", "debug", "--seq-len", "32", "--global-batch-size", "4", "--device", "cpu", "--no-trace-memory",
         "--eval-batches", "0"]


def test_flag_abbreviations_are_refused(monkeypatch, capsys):
    """argparse would take "--step 3" for --steps 3; every parser here refuses prefixes."""
    code, _ = _main(monkeypatch, ["--step", "3", *QUIET])
    assert code == 2 and "unrecognized arguments: --step 3" in capsys.readouterr().err


def test_a_torn_metrics_line_does_not_block_resume(monkeypatch, tmp_path, capsys):
    """A kill in the middle of writing metrics.jsonl leaves a torn last line: --resume drops
    it, says so, and keeps every complete line."""
    out = ["--out", str(tmp_path), "--steps", "4", "--ckpt-every", "2"]
    assert _main(monkeypatch, [*QUIET, *out])[0] == 0
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n" + lines[2][:17])  # step 2's line, torn
    import shutil
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000003")  # resume from step 1's checkpoint
    assert _main(monkeypatch, [*QUIET, *out, "--resume"])[0] == 0
    assert "dropped a torn last line" in capsys.readouterr().out
    again = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in again] == [0, 1, 2, 3]
    assert [json.dumps(r) for r in again[:2]] == lines[:2]


def test_a_run_that_ends_non_finite_exits_non_zero(monkeypatch, tmp_path, capsys):
    """--on-nan skip carries a run past bad steps; if its loss is still not finite at the end,
    the run has failed, and says so."""
    import torch.nn.functional as F
    real = F.cross_entropy
    monkeypatch.setattr(F, "cross_entropy", lambda *a, **k: real(*a, **k) * float("nan"))
    code, _ = _main(monkeypatch, [*QUIET, "--steps", "3", "--on-nan", "skip", "--out", str(tmp_path)])
    assert code == 2
    assert "the run ended with a loss of nan (step 2)" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_bad_max_norm_is_one_sentence(monkeypatch, capsys, value):
    code, _ = _main(monkeypatch, [*QUIET, "--max-norm", value])
    assert code == 2 and "--max-norm must be 0 (no clipping) or a positive number" in capsys.readouterr().err


def test_two_live_runs_cannot_share_an_out(monkeypatch, tmp_path, capsys):
    """A live run's lock in --out refuses a second run there; a dead run's lock does not."""
    import os
    import socket
    lock = tmp_path / ".run.lock"
    tmp_path.mkdir(exist_ok=True)
    lock.write_text(f"{os.getppid()} {socket.gethostname()}\n")  # a live process: pytest's parent
    code, _ = _main(monkeypatch, [*QUIET, "--steps", "2", "--out", str(tmp_path)])
    assert code == 2
    assert f"another run (pid {os.getppid()}) is writing into --out {tmp_path}" in capsys.readouterr().err
    assert not (tmp_path / "metrics.jsonl").exists()  # it wrote nothing
    dead = launch.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock.write_text(f"{dead.stdout.strip()} {socket.gethostname()}\n")  # a killed run's stale lock
    assert _main(monkeypatch, [*QUIET, "--steps", "2", "--out", str(tmp_path)])[0] == 0
    assert not lock.exists()  # released at the end
    # another host's lock: refused, unless it is this Slurm job's own earlier run (a requeue
    # onto other nodes keeps SLURM_JOB_ID and raises SLURM_RESTART_COUNT; that run has ended);
    # another run of the same allocation (the same count) is refused
    out = ["--steps", "2", "--out", str(tmp_path / "b")]
    (tmp_path / "b").mkdir()
    for owner, job, requeues, code in [("", "", "0", 2), ("41 0", "42", "1", 2), ("42 1", "42", "1", 2),
                                       ("42 0", "42", "1", 0)]:
        (tmp_path / "b" / ".run.lock").write_text(f"12345 node-a07 {owner}".rstrip() + "\n")
        monkeypatch.setenv("SLURM_JOB_ID", job)
        monkeypatch.setenv("SLURM_RESTART_COUNT", requeues)
        capsys.readouterr()
        assert _main(monkeypatch, [*QUIET, *out])[0] == code, (owner, job, requeues)
        if code:
            assert "is locked by a run on node-a07 (pid 12345)" in capsys.readouterr().err
    assert not (tmp_path / "b" / ".run.lock").exists()


def test_a_finished_run_is_moved_aside_not_overwritten(monkeypatch, tmp_path, capsys):
    """Running again into the same --out keeps the finished run, beside it with its date,
    and says where; the folder itself holds the newest run. --resume continues in place."""
    out = tmp_path / "train"
    assert _main(monkeypatch, [*QUIET, "--steps", "2", "--out", str(out)])[0] == 0
    first = (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert _main(monkeypatch, [*QUIET, "--steps", "3", "--out", str(out)])[0] == 0
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("train@")]
    said = capsys.readouterr().out
    assert (f"--out {out} held a finished run (train, 1 rank(s), 2 steps); moved it to {aside} so that "
            f"nothing is lost. This run writes into {out}.") in said
    assert (aside / "metrics.jsonl").read_text() == first and (aside / "summary.json").exists()
    assert json.loads((out / "summary.json").read_text())["steps"] == 3
    # --resume with no checkpoint to continue from starts from step 0: the finished run moves too
    assert _main(monkeypatch, [*QUIET, "--steps", "3", "--out", str(out), "--resume"])[0] == 0
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("train@")]) == 2
    # --resume from a checkpoint is the same run, continued: nothing moves (here: nothing left to train)
    assert _main(monkeypatch, [*QUIET, "--steps", "3", "--out", str(out), "--ckpt-every", "2"])[0] == 0
    capsys.readouterr()
    assert _main(monkeypatch, [*QUIET, "--steps", "3", "--out", str(out), "--ckpt-every", "2", "--resume"])[0] == 2
    assert "nothing is left to train" in capsys.readouterr().err
    # torchrun's restart of that refused attempt (--max-restarts, as train.slurm runs) refuses
    # again: it does not take the run for one that died after its outputs and rewrite them
    summary = (out / "summary.json").read_text()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert _main(monkeypatch, [*QUIET, "--steps", "3", "--out", str(out), "--ckpt-every", "2", "--resume"])[0] == 2
    assert "nothing is left to train" in capsys.readouterr().err and (out / "summary.json").read_text() == summary
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("train@")]) == 3


def test_a_resume_with_more_steps_says_how_the_schedule_changes(monkeypatch, tmp_path, capsys):
    """Raising --steps continues a finished run, but the cosine decays to the new last step:
    the resume says so, with the learning rates the run then logs."""
    import re
    out = ["--out", str(tmp_path / "run"), "--warmup-steps", "1", "--ckpt-every", "4"]
    assert _main(monkeypatch, [*QUIET, "--steps", "4", *out])[0] == 0
    capsys.readouterr()
    assert _main(monkeypatch, [*QUIET, "--steps", "6", *out, "--resume"])[0] == 0
    said = re.search(r"--steps 6 here, 4 in the checkpoint's run: the learning rate now decays to step 5, from "
                     r"(\S+) at step 4 to (\S+) at step 5 \(neither the 4-step run nor a 6-step one\)\.",
                     capsys.readouterr().out)
    assert said, "the resume did not say how the schedule changed"
    logged = {r["step"]: r["lr"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())}
    assert float(said[1]) == pytest.approx(logged[4], rel=1e-3) and float(said[2]) == pytest.approx(logged[5], rel=1e-3)
    assert logged[5] > logged[4]  # the decay restarted from higher
    capsys.readouterr()
    assert _main(monkeypatch, [*QUIET, "--steps", "6", *out, "--resume"])[0] == 2  # (done: nothing left)
    assert "--steps 6 here" not in capsys.readouterr().out
    # a run still in its warm-up continues as the longer run would: it says that instead
    warm = ["--out", str(tmp_path / "warm"), "--warmup-steps", "10", "--ckpt-every", "2"]
    assert _main(monkeypatch, [*QUIET, "--steps", "2", *warm])[0] == 0
    capsys.readouterr()
    assert _main(monkeypatch, [*QUIET, "--steps", "4", *warm, "--resume"])[0] == 0
    assert ("--steps 4 here, 2 in the checkpoint's run: every step so far was warm-up, the same in both, so the run "
            "continues as a 4-step run would (") in capsys.readouterr().out


def test_a_refused_run_leaves_no_empty_folder_behind(monkeypatch, tmp_path, capsys):
    """--out is made early (a folder that cannot be written is refused at once); a run refused
    after that removes the folders it made while they are still empty, and nothing else."""
    out, missing = tmp_path / "runs" / "train", str(tmp_path / "no_such_text.txt")
    code, _ = _main(monkeypatch, [*QUIET, "--steps", "2", "--data", missing, "--out", str(out)])
    assert code == 2 and "no_such_text.txt" in capsys.readouterr().err  # refused after --out was made
    assert not (tmp_path / "runs").exists()
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "keep.txt").write_text("mine")
    assert _main(monkeypatch, [*QUIET, "--steps", "2", "--data", missing, "--out", str(out)])[0] == 2
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["keep.txt"]


def test_a_model_no_machine_here_could_hold_is_refused_before_any_work(monkeypatch, capsys):
    """--n-layers 1000000 used to build until killed: 16 bytes a parameter is checked first."""
    code, _ = _main(monkeypatch, ["--n-layers", "1000000", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and "with 1000000 layers has 786.9B parameters" in err and "use fewer --n-layers" in err


def test_eval_batches_stop_after_one_pass_over_the_held_out_text(monkeypatch, tmp_path, capsys):
    """--eval-batches 1000000000 used to evaluate the same batches for hours."""
    from common.data import load_corpus
    from common.training import eval_batch_count
    args = type("A", (), {"seq_len": 32, "global_batch_size": 4, "eval_batches": 10**9})()
    val = load_corpus("synthetic").val
    assert eval_batch_count(val, args) == ((len(val) - 1) // 32) // 4
    assert "--eval-batches 1000000000: the held-out text holds" in capsys.readouterr().out
    args.eval_batches = 3
    assert eval_batch_count(val, args) == 3


def _scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """The TensorBoard scalars in folder/tensorboard, read back as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(folder / "tensorboard"), size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_and_the_validation_curve_follow_metrics_jsonl_through_a_resume(monkeypatch, tmp_path):
    """--tensorboard: metrics.jsonl's numbers as scalars (TensorBoard keeps float32), each
    step once; --eval-every 2: the held-out loss after steps 1 and 3, the last one the run's
    val_loss; at the end, the traced peak by category. A run resumed from step 1's checkpoint
    redoes steps 2 and 3: the event files again hold each step once, and the curve goes on
    as the uninterrupted run's, bit for bit."""
    import shutil

    import numpy as np
    f32 = lambda v: float(np.float32(v))  # noqa: E731
    argv = [*QUIET, "--steps", "4", "--ckpt-every", "2", "--tensorboard", "--eval-every", "2", "--eval-batches", "1",
            "--out", str(tmp_path)]

    def check(rows, traced):
        scalars = _scalars(tmp_path)
        for key in ("loss", "grad_norm", "lr", "tokens_per_s", "peak_mem_bytes"):
            assert scalars[key] == [(r["step"], f32(r[key])) for r in rows], key
        assert scalars["val_loss"] == [(r["step"], f32(r["val_loss"])) for r in rows if "val_loss" in r]
        if traced:
            assert scalars["peak_mem_bytes/rank0/parameters"] == [(3, 4 * count_params(get_config("debug")))]

    assert _main(monkeypatch, [*argv, "--trace-memory", "--trace-steps", "1"])[0] == 0
    first = _metrics(tmp_path)
    assert [r["step"] for r in first if "val_loss" in r] == [1, 3]
    assert json.loads((tmp_path / "summary.json").read_text())["val_loss"] == first[3]["val_loss"]
    check(first, traced=True)
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000003")  # resume from step 1's checkpoint
    assert _main(monkeypatch, [*argv, "--resume"])[0] == 0
    again = _metrics(tmp_path)
    assert [(r["loss"], r.get("val_loss")) for r in again] == [(r["loss"], r.get("val_loss")) for r in first]
    check(again, traced=False)


def test_tensorboard_missing_is_one_sentence(monkeypatch, tmp_path, capsys):
    """Only --tensorboard needs the package: without it, the sentence with the pip command, before any work."""
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed: importing it fails
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    code, _ = _main(monkeypatch, [*QUIET, "--steps", "2", "--tensorboard", "--out", str(tmp_path)])
    assert code == 2
    assert capsys.readouterr().err.strip() == ("error: --tensorboard needs the tensorboard package, which is not "
                                               "installed; run pip install tensorboard, or drop --tensorboard.")
    assert not (tmp_path / "metrics.jsonl").exists()
    assert _main(monkeypatch, [*QUIET, "--steps", "2", "--out", str(tmp_path)])[0] == 0  # the tutorial runs without it


def test_an_out_another_rank_removed_is_made_anew(tmp_path, monkeypatch):
    """Ranks make --out side by side; one that meets an error of its own removes the empty
    folder it made. A rank that finds the folder gone between making it and writing its probe
    makes it anew (and goes on to say its own error), instead of blaming --out."""
    from pathlib import Path

    from common.cli import check_writable
    out, real, gone = tmp_path / "run", Path.write_text, []

    def write_text(self, *args, **kwargs):
        if not gone:  # the other rank's removal, between this rank's mkdir and its probe
            gone.append(True)
            self.parent.rmdir()
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    check_writable(out)
    assert gone and out.is_dir() and not list(out.iterdir())
    # ... or between the other rank's mkdir and this one's: mkdir meets the folder (EEXIST), and
    # the folder is gone when mkdir looks whether it is one (a race the 4-rank suite met)
    monkeypatch.setattr(Path, "write_text", real)
    again, real_mkdir, raced = tmp_path / "again", Path.mkdir, []

    def mkdir(self, *args, **kwargs):
        if self == again and not raced:
            raced.append(True)
            raise FileExistsError(17, "File exists")
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    check_writable(again)
    assert raced and again.is_dir()
