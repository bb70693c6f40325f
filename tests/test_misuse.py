"""Nothing lost, nothing silent: every case of tools/misuse.py ends within seconds, non-zero,
with its one sentence naming the flag or file at fault, and no traceback.

Cheap by design (the suite runs on 2 cores): the one-rank cases run in this process (each
script's main() with the case's argv), the two-rank ones together in one torchrun job that
starts first and runs while the others do.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import launch
from conftest import ROOT, hang_limit
from tools import misuse
from tools.docs import block

ONE = [n for n, c in misuse.CASES.items() if c.ranks == 1]
TWO = [n for n, c in misuse.CASES.items() if c.ranks == 2]
# A hang detector per case: the slowest (a checkpoint written, then refused) takes ~2 s on an idle
# machine; under pytest-xdist the cases share the cores with the other worker's launches (and
# the first case of a process once took 31 s in CI while both cores ran torchrun jobs).
LIMIT_S = hang_limit(30)


@pytest.fixture(scope="module")
def torchrun_job(tmp_path_factory):
    """The two-rank cases in one torchrun job, started now and collected by the tests at the end."""
    folder = tmp_path_factory.mktemp("misuse_torchrun")
    out = folder / "results.json"
    # into a file, not a pipe: nobody reads a pipe while the in-process cases run, and a
    # full one would stall the job
    with open(folder / "log.txt", "w") as log:
        proc = launch.Popen([sys.executable, "tools/misuse.py", "--two-rank-jobs", ",".join(TWO), "--json",
                             str(out)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    yield proc, out
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def shared(tmp_path_factory, torchrun_job):
    """One folder and one cache for the in-process cases (the checkpoint several start from);
    the scripts' own imports made first, so that no case's seconds hold them."""
    import common.checkpoint  # noqa: F401
    import common.run  # noqa: F401
    import common.training  # noqa: F401
    return tmp_path_factory.mktemp("misuse"), {}


def test_the_table_covers_every_script_and_tool():
    scripts = {c.argv[0] for c in misuse.CASES.values()}
    wanted = {"step1_single_gpu/train.py", *(f"step2_memory/{s}.py" for s in
                                             ("train_amp", "train_amp_ac", "train_accum", "bench_memory_savers")),
              *(f"step3_multi_gpu/{s}.py" for s in ("train_ddp", "train_fsdp", "train_tp", "train_pp", "train_2d",
                                                    "train_3d", "compare_comm_hooks", "bench_collectives",
                                                    "ring_allreduce", "dp_vs_ddp")),
              *(f"tools/{s}.py" for s in ("estimate", "compare", "multirun", "pipeline_bubble"))}
    assert wanted <= scripts, f"no misuse case for {sorted(wanted - scripts)}"
    assert len(misuse.CASES) >= 40
    for name, case in misuse.CASES.items():
        assert (ROOT / case.argv[0]).is_file(), name
        assert case.says and case.names and case.fix, name
        assert "--device" not in case.argv or case.argv[0].startswith("tools/") or \
            case.argv[case.argv.index("--device") + 1] in ("cpu", "cuda", "tpu"), name


@pytest.mark.parametrize("name", ONE)
def test_one_rank_misuse_is_one_sentence(name, shared):
    case = misuse.CASES[name]
    if not misuse.applicable(case):
        pytest.skip("a misuse only where no GPU is visible")
    root, cache = shared
    result = misuse.run_case(name, root, cache)
    assert not misuse.problems(case, result, LIMIT_S), (misuse.problems(case, result, LIMIT_S), result)
    lines = [line for line in result["stderr"].splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result["stderr"]  # one sentence, not one per check that failed


def test_a_checkpoint_that_cannot_be_written_keeps_the_last_good_one(tmp_path, monkeypatch):
    """A full disk during DCP's save (CheckpointException derives from BaseException, so a
    plain ``except Exception`` let it through as a traceback): one sentence, the partial
    folder removed, the previous checkpoint intact."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    real, calls = FileSystemWriter.write_data, []

    def write_data(self, *args, **kwargs):  # the disk fills up during the second checkpoint
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(FileSystemWriter, "write_data", write_data)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in misuse.T] + ["--steps", "3", "--ckpt-every", "1"]
    code, err = misuse.run_script(misuse.S1, argv)
    assert code == 2 and "Traceback" not in err, err
    kept = tmp_path / "out" / "checkpoints" / "step_00000000"
    assert (f"the checkpoint of step 1 could not be written to {kept.parent / 'step_00000001_partial'}" in err
            and "No space left on device" in err and f"the last good checkpoint, {kept}, is kept" in err), err
    assert sorted(p.name for p in kept.parent.iterdir()) == ["step_00000000"]
    assert (kept / "meta.json").is_file()


def test_two_rank_misuse_ends_on_every_rank_with_one_sentence(torchrun_job):
    proc, out = torchrun_job
    try:
        proc.wait(timeout=240)  # a hang would end here, as a failure
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the two-rank misuse cases did not end within 240 s")
    err = (out.parent / "log.txt").read_text()
    assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]
    results = json.loads(out.read_text())
    assert sorted(results) == ["0", "1"]
    bad = {}
    for rank, cases in results.items():
        for name in TWO:
            if problems := misuse.problems(misuse.CASES[name], cases[name], LIMIT_S):
                bad[f"rank {rank}: {name}"] = (problems, cases[name]["stderr"][-500:])
            elif not cases[name]["stderr"].strip().splitlines()[-1].startswith(f"[rank {rank}] error: "):
                bad[f"rank {rank}: {name}"] = "not prefixed with its rank"
    assert not bad, bad


def test_the_troubleshooting_table_is_the_one_the_cases_make():
    found = block("misuse")
    assert found is not None and found[0].name == "README.md" and found[0].parent.name == "step4_multi_node"
    assert found[1].strip() == misuse.markdown_table(), \
        "step 4's troubleshooting table is stale: run python -m tools.figures --only misuse"


def test_tools_run_as_files_from_anywhere(tmp_path):
    """``python tools/estimate.py`` (not ``-m tools.estimate``), started from another folder:
    Python then puts tools/ on the path, not the repository, and ``import common`` failed."""
    procs = {tool: launch.Popen([sys.executable, str(ROOT / "tools" / f"{tool}.py"), *argv], cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for tool, argv in (("estimate", ["--n-layers", "0"]), ("compare", [str(tmp_path / "none")]))}
    for tool, proc in procs.items():
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2 and "Traceback" not in err, (tool, err)
        assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, (tool, err)


def test_every_script_with_pg_timeout_hands_it_to_its_process_group(monkeypatch, tmp_path):
    """--pg-timeout is a shared flag: a script that forgot to pass it on (compare_comm_hooks
    did) waits 300 s, not the seconds asked for, when a rank hangs."""
    import contextlib

    import common.distributed
    from common.errors import UserError
    seen = {}

    @contextlib.contextmanager
    def distributed(device="auto", backend=None, timeout_s=300.0, **dry_run):
        seen[script] = timeout_s
        raise UserError("stopped before any work")
        yield

    monkeypatch.setattr(common.distributed, "distributed", distributed)  # the scripts import it afresh
    scripts = [misuse.S1, *(f"step2_memory/{s}.py" for s in ("train_amp", "train_amp_ac", "train_accum",
                                                              "bench_memory_savers")),
               *(f"step3_multi_gpu/{s}.py" for s in ("train_ddp", "train_fsdp", "train_tp", "train_pp", "train_2d",
                                                     "train_3d", "compare_comm_hooks"))]
    for script in scripts:
        argv = [a.replace("{tmp}", str(tmp_path)) for a in misuse.T] + ["--pg-timeout", "7"]
        code, err = misuse.run_script(script, argv)
        assert code == 2 and "stopped before any work" in err, (script, err)
    assert seen == {s: 7.0 for s in scripts}


@pytest.mark.parametrize("script", ["step3_multi_gpu/compare_comm_hooks.py", "step3_multi_gpu/dp_vs_ddp.py",
                                    "step2_memory/bench_memory_savers.py"])
def test_scripts_without_a_run_refuse_what_only_a_run_does(script, tmp_path):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in misuse.T] + ["--profile"]
    code, err = misuse.run_script(script, argv)
    assert code == 2 and err.strip().splitlines()[-1] == (
        f"error: {script} does not take --profile (it compares or times runs of its own); use --profile with a "
        f"training script."), err
