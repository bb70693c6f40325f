"""Checkpoints: exact resume, elastic restarts, resharding across world sizes and strategies,
damaged checkpoints and bad input, from step 1 to 3-D parallelism (gloo on CPU).

Three parts, each launching as few processes as it can:
- step 1: an uninterrupted run and one killed at step 3 and restarted by torchrun;
- the data-parallel family (DDP, ZeRO-1, FSDP): two torchrun jobs (tests/drivers/resume.py
  runs many scripts' main() in each), two nodes on one machine, and misuse in this process;
- the model-parallel family: a 1F1B pipeline killed under ``torchrun --max-restarts 1`` and a
  TP run resumed from a copied checkpoint give the losses of runs never interrupted; the 2-D
  script on a real 2 x 2 mesh and the 3-D script as pipelines of TP pairs and of FSDP pairs
  resume bit for bit; a pipeline checkpoint loads into another number of stages.
Sizes: debug model, 32 tokens, global batch 4, a checkpoint every 2 steps.
"""
import contextlib
import importlib.util
import io
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from common.checkpoint import Checkpointer, skip_nonfinite_step
from common.checkpoint_meta import complete_checkpoints
from common.weights import export
from common.data import load_corpus
from common.distributed import distributed
from common.errors import UserError
from common.model import Transformer, get_config
import launch
from conftest import ROOT, hang_limit
from tests.tolerances import PARITY_RTOL, TIGHT_RTOL
from drivers import dp as _dp


# ==== step 1 ===================================================================================
STEP1_SCRIPT = str(ROOT / "step1_single_gpu" / "train.py")
STEP1_FLAGS = ["--model", "debug", "--steps", "6", "--seq-len", "32", "--global-batch-size", "4", "--device", "cpu",
         "--no-trace-memory", "--eval-batches", "0", "--ckpt-every", "2"]


def _losses(folder):
    return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _run(cmd, timeout=180):
    return launch.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def step1_runs(tmp_path_factory):
    """An uninterrupted run, and one that crashes at step 3 and is restarted by torchrun:
    here with a fresh store for each attempt (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as
    train.slurm runs on several nodes; so does the 2-rank pipeline job below, while the
    elastic job's 2-rank restarts share the agent's store, torchrun's default)."""
    tmp = tmp_path_factory.mktemp("ckpt")
    plain = launch.Popen([sys.executable, STEP1_SCRIPT, *STEP1_FLAGS, "--out", str(tmp / "plain")], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    elastic = launch.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                          "--max-restarts", "1", STEP1_SCRIPT, *STEP1_FLAGS, "--resume", "--fail-at-step", "3",
                          "--out", str(tmp / "elastic")], cwd=ROOT, capture_output=True, text=True, timeout=180,
                         env=dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"))
    out, err = plain.communicate(timeout=180)
    assert plain.returncode == 0, err[-2000:]
    return tmp, elastic


def test_elastic_restart_resumes_exactly(step1_runs):
    tmp, elastic = step1_runs
    assert elastic.returncode == 0, elastic.stderr[-3000:]
    assert "crashing on purpose" in elastic.stdout           # it really died once
    assert "resumed from" in elastic.stdout and "step_00000003" in elastic.stdout
    assert _losses(tmp / "elastic") == _losses(tmp / "plain")  # every step, bit for bit
    # keep the newest two complete checkpoints, nothing partial
    assert [p.name for p in complete_checkpoints(tmp / "elastic" / "checkpoints")] == \
        ["step_00000003", "step_00000005"]
    assert not list((tmp / "elastic" / "checkpoints").glob("*_partial"))


def test_a_partial_checkpoint_is_never_loaded(step1_runs, tmp_path):
    tmp, _ = step1_runs
    out = tmp_path / "run"
    shutil.copytree(tmp / "plain", out)
    ckpts = out / "checkpoints"
    # a crash in the middle of writing step 7: files there, but never renamed, no meta.json
    shutil.copytree(ckpts / "step_00000005", ckpts / "step_00000007_partial")
    (ckpts / "step_00000007_partial" / "meta.json").unlink()
    assert complete_checkpoints(ckpts)[-1].name == "step_00000005"


def test_export_gives_a_plain_file_with_the_trained_weights(step1_runs, tmp_path):
    tmp, _ = step1_runs
    dest = tmp_path / "model.pt"
    r = _run([sys.executable, "-m", "common.checkpoint", "export",
              str(tmp / "plain" / "checkpoints" / "step_00000005"), str(dest)])
    assert r.returncode == 0, r.stderr
    saved = torch.load(dest, weights_only=False)
    model = Transformer(get_config("debug"))
    model.load_state_dict(saved["model"])  # strict: every weight is there
    assert saved["step"] == 5
    assert not torch.equal(model.tok_embeddings.weight, torch.zeros_like(model.tok_embeddings.weight))


def test_damaged_or_mismatched_checkpoints_are_clear_errors(step1_runs, tmp_path):
    tmp, _ = step1_runs
    broken = tmp_path / "broken"
    shutil.copytree(tmp / "plain", broken)
    newest = broken / "checkpoints" / "step_00000005"
    data = next(newest.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])  # truncated, as a full disk leaves it
    before = {p.name: p.stat().st_size for p in newest.iterdir()}
    # one --out per process: a run holds its --out while it checks, so two runs in one folder race
    other_batch = tmp_path / "other_batch"
    shutil.copytree(tmp / "plain", other_batch)
    procs = {
        "truncated": launch.Popen([sys.executable, STEP1_SCRIPT, *STEP1_FLAGS, "--steps", "8", "--resume",
                                   "--out", str(broken)], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                                  stdout=subprocess.DEVNULL),
        "other model": launch.Popen([sys.executable, STEP1_SCRIPT, *STEP1_FLAGS, "--n-layers", "2", "--resume",
                                     "--out", str(tmp / "plain")], cwd=ROOT, stderr=subprocess.PIPE,
                                    text=True, stdout=subprocess.DEVNULL),
        "other batch": launch.Popen([sys.executable, STEP1_SCRIPT, *STEP1_FLAGS, "--global-batch-size", "8", "--resume",
                                     "--out", str(other_batch)], cwd=ROOT, stderr=subprocess.PIPE,
                                    text=True, stdout=subprocess.DEVNULL),
    }
    expected = {"truncated": "step_00000005 cannot be read",
                "other model": "holds a checkpoint of another run (step_00000005): --n-layers 4 there, 2 here.",
                "other batch": "holds a checkpoint of another run (step_00000005): --global-batch-size 4 there, 8 here."}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 2, f"{name}: {err[-2000:]}"
        lines = err.strip().splitlines()
        assert len(lines) == 1 and expected[name] in lines[0], f"{name}: {err[-2000:]}"
    # nothing already saved was touched
    assert {p.name: p.stat().st_size for p in newest.iterdir()} == before
    assert len(_losses(tmp / "plain")) == 6


def test_non_finite_loss_stops_with_the_step_and_rank(tmp_path):
    r = _run([sys.executable, STEP1_SCRIPT, *STEP1_FLAGS, "--lr", "1e6", "--ckpt-every", "0", "--out", str(tmp_path)])
    assert r.returncode == 2
    assert "error: the loss is nan at step" in r.stderr and "(rank 0)" in r.stderr


# ==== the data-parallel family ==================================================================
B = ["--global-batch-size", "4", "--steps", "6", "--no-trace-memory"]
B3 = B + ["--amp", "off"]  # the step-3 runs: fp32, to match step 1's losses (step 3 defaults to bf16)
C = ["--ckpt-every", "2", "--ckpt-keep", "3"]
STEPS = [str(s) for s in range(6)]

# Job 1, two "nodes" x 2 ranks (two torchrun launches, one c10d rendezvous on localhost).
TWO_NODES = {
    "reference": {"script": "step1", "flags": B},  # single-process step 1, on every rank
    "ddp4": {"script": "ddp", "flags": B3},
    "fsdp4": {"script": "fsdp", "flags": B3 + C},
    "zero1_4": {"script": "ddp", "flags": B3 + C + ["--zero1"]},
}
# Job 2, 2 ranks under torchrun --max-restarts 4: four runs crash once each.
R = B3 + C + ["--resume"]
# Steps 1 and 2 traced (the default window), with step 1's checkpoint inside it
TRACED = ["--trace-memory", "--trace-start", "1", "--trace-steps", "2"]
ELASTIC = {
    "ddp": {"script": "ddp", "flags": B3 + C + TRACED},
    "fsdp": {"script": "fsdp", "flags": B3 + C + ["--save-weights"]},  # (and its weights, for tools.generate)
    "ddp_fault": {"script": "ddp", "flags": R + ["--fail-at-step", "4"]},
    "fsdp_fault": {"script": "fsdp", "flags": R + ["--fail-at-step", "4", "--fail-rank", "1"]},
    # the default bf16 (FSDP's mixed-precision policy): resumed exactly too
    "fsdp_bf16": {"script": "fsdp", "flags": B + C},
    # ... killed after its last step's checkpoint, before its outputs: the restart writes them
    "fsdp_bf16_fault": {"script": "fsdp", "flags": B + C + ["--resume", "--fail-at-step", "5"]},
    # another world size
    "fsdp_from_fsdp4": {"script": "fsdp", "flags": R, "from": ["fsdp4", 3]},
    "zero1_from_zero1_4": {"script": "ddp", "flags": R + ["--zero1"], "from": ["zero1_4", 3]},
    # another strategy
    "fsdp_from_ddp": {"script": "fsdp", "flags": R, "from": ["ddp", 3]},
    "ddp_from_fsdp": {"script": "ddp", "flags": R, "from": ["fsdp", 3]},
    "ddp_from_zero1_4": {"script": "ddp", "flags": R, "from": ["zero1_4", 3]},
    "offload_from_fsdp": {"script": "fsdp", "flags": R + ["--cpu-offload"], "from": ["fsdp", 3]},
    # data that is not UTF-8: bytes are tokens, nothing to decode
    "non_utf8": {"script": "ddp", "flags": B3 + ["--steps", "2", "--data", "NON_UTF8"]},
    # NaN: stop with the step and rank, or skip the update
    "nan_stop": {"script": "ddp", "flags": B3 + ["--lr", "1e6"]},
    "nan_skip": {"script": "ddp", "flags": B3 + ["--steps", "3", "--lr", "1e6", "--on-nan", "skip"]},
    # preemption: a signal to one rank alone stops both at one step, which both save
    "ddp_sigterm_rank1": {"script": "ddp", "flags": R + ["--fail-at-step", "2", "--fail-rank", "1",
                                                         "--fail-how", "sigterm"]},
    "ddp_sigterm_resumed": {"script": "ddp", "flags": R, "from": ["ddp_sigterm_rank1", "latest"]},
    # ... one that arrives while step 3's checkpoint is being written
    "fsdp_sigusr1_in_save": {"script": "fsdp", "flags": R + ["--fail-at-step", "3", "--fail-how", "sigusr1"]},
    "fsdp_sigusr1_resumed": {"script": "fsdp", "flags": R, "from": ["fsdp_sigusr1_in_save", "latest"]},
    # ... one in the last step: nothing to stop before, the run completes (exit 0)
    "ddp_sigterm_last": {"script": "ddp", "flags": B3 + ["--steps", "2", "--ckpt-every", "1", "--fail-at-step", "1",
                                                         "--fail-rank", "1", "--fail-how", "sigterm"]},
    # ... and SIGTERM to torchrun itself (PREEMPT_TORCHRUN, a job of its own, before this one)
    "fsdp_torchrun_resumed": {"script": "fsdp", "flags": R, "from": ["fsdp_torchrun", "latest"]},
    # --ckpt-async: written in the background, resumed exactly (by --resume, and after a crash)
    "ddp_async": {"script": "ddp", "flags": B3 + C + ["--ckpt-async"] + TRACED},
    "ddp_async_resumed": {"script": "ddp", "flags": R + ["--ckpt-async"], "from": ["ddp_async", 3]},
    "fsdp_async_fault": {"script": "fsdp", "flags": R + ["--ckpt-async", "--fail-at-step", "4", "--fail-rank", "1"]},
    # misuse: each one sentence, exit 2, the checkpoint left as it was
    "bad_accum": {"script": "ddp", "flags": R + ["--grad-accum-steps", "2"], "from": ["ddp", 3]},
    "bad_preset": {"script": "fsdp", "flags": R + ["--n-layers", "1"], "from": ["fsdp4", 3]},
    "bad_truncated": {"script": "fsdp", "flags": R, "from": ["fsdp4", 3], "damage": "truncate"},
    "bad_meta": {"script": "ddp", "flags": R, "from": ["ddp", 3], "damage": "meta"},
    "bad_finished": {"script": "fsdp", "flags": R + ["--steps", "4"], "from": ["fsdp", 3]},
}
ERRORS = {
    "nan_stop": "error: the loss is nan at step",
    # skip goes on past every bad step, but a run still non-finite at its end has failed
    "nan_skip": "error: the run ended with a loss of nan (step 2): the model is not usable",
    "bad_accum": "holds a checkpoint of another run (step_00000003): --grad-accum 1 there, 2 here. Resume with",
    "bad_preset": "holds a checkpoint of another run (step_00000003): --n-layers 4 there, 1 here.",
    "bad_truncated": "step_00000003 cannot be read",
    "bad_meta": "meta.json cannot be read (UnicodeDecodeError)",
    "bad_finished": "is at step 3, the last of --steps 4 or past it: nothing is left to train",
}


PREEMPTED = ("ddp_sigterm_rank1", "fsdp_sigusr1_in_save")  # exit 75, with a checkpoint
# The real script under torchrun: rank 1 sends SIGTERM to torchrun at step 2, and torchrun
# forwards it to both ranks (while the job of the two nodes runs: its own processes).
PREEMPT_TORCHRUN = ["step3_multi_gpu/train_fsdp.py", *_dp.COMMON, *R, "--fail-at-step", "2", "--fail-rank", "1",
                    "--fail-how", "sigterm-torchrun"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _results(folder: Path, plan: dict) -> dict:
    return {name: json.loads((folder / f"{name}.json").read_text()) for name in plan}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("resume")
    env = dict(os.environ, PORT=str(_free_port()), NPROC="2",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")  # this python's torchrun
    # the real torchrun (not tests/launch.py's fork): what it does with a SIGTERM is the test
    preempt = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                "2", *PREEMPT_TORCHRUN, "--out", str(folder / "fsdp_torchrun")], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    r = launch.run(["bash", "step4_multi_node/two_nodes_on_one_machine.sh", "tests/drivers/resume.py",
                    str(folder), json.dumps(TWO_NODES)], cwd=ROOT, env=env, capture_output=True, text=True,
                   timeout=150)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    two_nodes = _results(folder, TWO_NODES)
    out, err = preempt.communicate(timeout=150)
    preempted = SimpleNamespace(returncode=preempt.returncode, stdout=out, stderr=err)

    data = folder / "non_utf8.txt"
    data.write_bytes(bytes(range(256)) * 64 + "caf\u00e9 na\u00efve".encode("latin-1") * 500)
    plan = json.loads(json.dumps(ELASTIC).replace("NON_UTF8", str(data)))
    r = launch.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    "--max-restarts", "4", "tests/drivers/resume.py", str(folder), json.dumps(plan)],
                   cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.count("crashing on purpose") == 4, r.stdout[-3000:]
    elastic = _results(folder, ELASTIC)
    for name, res in {**two_nodes, **elastic}.items():
        expected = 2 if name in ERRORS else 75 if name in PREEMPTED else 0
        assert res["code"] == expected, f"{name}: {res['stderr']}"
    return SimpleNamespace(folder=folder, two_nodes=two_nodes, elastic=elastic, preempted=preempted)


def _close(a: dict, b: dict, steps, rtol: float):
    for s in steps:
        assert a[s] == pytest.approx(b[s], rel=rtol), (s, a[s], b[s])


def test_two_nodes_on_one_machine_match_step1(jobs):
    """2 launches x 2 ranks = world 4 through c10d rendezvous; DDP's loss is step 1's."""
    ref = jobs.two_nodes["reference"]["losses"]
    assert list(ref) == STEPS
    for name in ("ddp4", "fsdp4", "zero1_4"):
        _close(jobs.two_nodes[name]["losses"], ref, STEPS, PARITY_RTOL)


def test_each_rank_of_a_second_node_takes_its_local_gpu(jobs):
    """On the second "node", ranks 2 and 3 are local ranks 0 and 1: with two GPUs a node they
    take cuda:0 and cuda:1 (cuda:2 and cuda:3 do not exist there), and nodes of one GPU are
    refused in one sentence. Asked of the scripts' own device choice, in the real launch.
    The rehearsal itself hides the GPUs from its ranks (two pretend nodes would share them)."""
    choices = json.loads((jobs.folder / "devices_4.json").read_text())
    assert [(c["rank"], c["local_rank"]) for c in choices] == [(0, 0), (1, 1), (2, 0), (3, 1)]
    assert [c["visible_gpus"] for c in choices] == [""] * 4
    assert [c["device"] for c in choices] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert all(c["one_gpu"] == "2 ranks per node but only 1 visible GPU(s); NCCL needs one GPU per rank: use "
               "--nproc-per-node 1 or run on CPU with --device cpu." for c in choices)


def test_killed_and_restarted_runs_continue_exactly(jobs):
    """torchrun --max-restarts: rank 0 (DDP) / rank 1 (FSDP) dies after step 4; the job
    restarts, resumes from step 3's checkpoint, redoes step 4: every loss bit for bit. Rank 0
    of FSDP in bf16 dies after step 5, the last, once its checkpoint is written and before
    the run's outputs: the restart loads it, trains nothing, and writes summary.json as the
    uninterrupted run did (the same losses and validation loss), exit 0."""
    e = jobs.elastic
    for faulty, plain in (("ddp_fault", "ddp"), ("fsdp_fault", "fsdp"), ("fsdp_bf16_fault", "fsdp_bf16")):
        assert e[faulty]["restarted"] and e[faulty]["job_attempt"] >= 1  # it really died
        assert e[faulty]["losses"] == e[plain]["losses"]  # all six steps, no gap, no repeat
        assert e[faulty]["checkpoints"] == ["step_00000001", "step_00000003", "step_00000005"]
    assert "step 5 is the last of --steps 6: the run was stopped after its last checkpoint, before its outputs; " \
           "writing them now" in e["fsdp_bf16_fault"]["stdout"]
    done, plain = (json.loads((jobs.folder / n / "summary.json").read_text()) for n in ("fsdp_bf16_fault", "fsdp_bf16"))
    assert (done["final_loss"], done["first_loss"], done["steps"]) == (plain["final_loss"], plain["first_loss"], 6)


def _weights(checkpoint: Path, tmp: Path) -> dict:
    dest = tmp / f"{checkpoint.parent.parent.name}_{checkpoint.name}.pt"
    if not dest.exists():
        export(str(checkpoint), str(dest))
    return torch.load(dest, weights_only=False)["model"]


def test_preempted_runs_stop_together_save_and_resume_exactly(jobs, tmp_path):
    """A SIGTERM to torchrun (which forwards it to both ranks), a SIGTERM to rank 1 alone, a
    SIGUSR1 while a checkpoint is being written: both ranks finish the step after the one
    where the signal came, save it, exit 75 with one sentence; --resume then gives the
    uninterrupted run's losses and final weights, bit for bit (fp32)."""
    e, t = jobs.elastic, jobs.preempted
    assert t.returncode != 0 and "sending SIGTERM to torchrun" in t.stdout, t.stderr[-3000:]
    assert "Sending process" in t.stderr and "closing signal SIGTERM" in t.stderr  # torchrun forwarded it
    stopped = {"fsdp_torchrun": int(complete_checkpoints(jobs.folder / "fsdp_torchrun" / "checkpoints")[-1]
                                    .name.split("_")[1]),
               "ddp_sigterm_rank1": 3,  # the signal at step 2 is in step 2's vote, read at step 3
               "fsdp_sigusr1_in_save": 4}  # sent at step 3, before its checkpoint is written
    assert stopped["fsdp_torchrun"] in (3, 4)  # torchrun's forwarding takes its time: step 2's vote or 3's
    assert f"preempted at step {stopped['fsdp_torchrun']}: every rank saved" in t.stderr
    metrics = [json.loads(line) for line in (jobs.folder / "fsdp_torchrun" / "metrics.jsonl").read_text().splitlines()]
    torchrun_run = {"losses": {str(r["step"]): r["loss"] for r in metrics},
                    "checkpoints": sorted(p.name for p in (jobs.folder / "fsdp_torchrun" / "checkpoints").iterdir())}
    for name, ref in (("fsdp_torchrun", "fsdp"), ("ddp_sigterm_rank1", "ddp"), ("fsdp_sigusr1_in_save", "fsdp")):
        run, n = torchrun_run if name == "fsdp_torchrun" else e[name], stopped[name]
        if name != "fsdp_torchrun":
            assert f"preempted at step {n}: every rank saved" in run["stderr"] and "resume with --resume" in \
                run["stderr"], run["stderr"]
        # every step up to the agreed one, once, the same; that step saved whole, and nothing partial
        assert run["losses"] == {s: e[ref]["losses"][s] for s in map(str, range(n + 1))}, name
        assert run["checkpoints"][-1] == f"step_{n:08d}" and not any(c.endswith("_partial") for c in run["checkpoints"])
        resumed = e[name.replace("_rank1", "").replace("_in_save", "") + "_resumed"]
        assert resumed["losses"] == {s: e[ref]["losses"][s] for s in map(str, range(n + 1, 6))}, name
        final = _weights(jobs.folder / (name.replace("_rank1", "").replace("_in_save", "") + "_resumed")
                         / "checkpoints" / "step_00000005", tmp_path)
        expected = _weights(jobs.folder / ref / "checkpoints" / "step_00000005", tmp_path)
        assert all(torch.equal(final[k], v) for k, v in expected.items()), name
    # the checkpoint of step 3, written while the signal arrived, is complete and kept
    assert e["fsdp_sigusr1_in_save"]["checkpoints"] == ["step_00000001", "step_00000003", "step_00000004"]


def test_async_checkpoints_resume_exactly_and_stage_the_predicted_bytes(jobs, tmp_path):
    """--ckpt-async: the same checkpoints (declared only once written), a --resume from one and
    a restart after rank 1 crashed give the losses and final weights of the synchronous run,
    bit for bit; the host copy is this rank's state, as common/measure/formulas.py says."""
    from common.measure.formulas import ckpt_staging_bytes
    e = jobs.elastic
    assert e["ddp_async"]["losses"] == e["ddp"]["losses"]
    assert e["ddp_async"]["checkpoints"] == e["ddp"]["checkpoints"] == ["step_00000001", "step_00000003",
                                                                         "step_00000005"]
    assert list(e["ddp_async_resumed"]["losses"]) == ["4", "5"]
    assert e["ddp_async_resumed"]["losses"] == {s: e["ddp"]["losses"][s] for s in ("4", "5")}
    fault = e["fsdp_async_fault"]
    assert fault["restarted"] and fault["losses"] == e["fsdp"]["losses"]
    assert fault["checkpoints"] == ["step_00000001", "step_00000003", "step_00000005"]
    for run, ref in (("ddp_async", "ddp"), ("ddp_async_resumed", "ddp"), ("fsdp_async_fault", "fsdp")):
        final = _weights(jobs.folder / run / "checkpoints" / "step_00000005", tmp_path)
        expected = _weights(jobs.folder / ref / "checkpoints" / "step_00000005", tmp_path)
        assert all(torch.equal(final[k], v) for k, v in expected.items()), run
    cfg = get_config("debug")
    for run, strategy in (("ddp_async", "ddp"), ("fsdp_async_fault", "fsdp")):
        summary = json.loads((jobs.folder / run / "summary.json").read_text())
        assert summary["ckpt_staging_bytes"] == ckpt_staging_bytes(strategy, cfg, world=2, rank=0), run
    n = sum(p.numel() for p in Transformer(cfg).parameters())
    assert ckpt_staging_bytes("ddp", cfg, 2) == 12 * n + 4 * len(list(Transformer(cfg).parameters()))


def test_the_memory_trace_counts_the_async_host_copy(jobs):
    """Steps 1 and 2 traced, a checkpoint after step 1: with --ckpt-async each rank's trace has
    a category "checkpoint staging" whose peak is exactly the formula's bytes (DCP's stager
    copies each tensor's whole storage, and under DDP a storage is a tensor), and theory's
    report holds it to them; the same run written synchronously has no such category."""
    from common.measure.memory_categories import CATEGORIES, STAGING
    from common.measure.formulas import ckpt_staging_bytes
    async_run, sync_run = (json.loads((jobs.folder / n / "summary.json").read_text()) for n in ("ddp_async", "ddp"))
    assert [m["rank"] for m in async_run["memory"]] == [0, 1]
    for m, p in zip(async_run["memory"], async_run["predicted"]["per_rank"]):
        want = ckpt_staging_bytes("ddp", get_config("debug"), world=2, rank=m["rank"])
        assert m["peak_by_category"][STAGING] == want == p[STAGING] == p[f"measured {STAGING}"], m["rank"]
        assert list(m["at_peak"]) == [*CATEGORIES, STAGING]
    assert [m["rank"] for m in sync_run["memory"]] == [0, 1]
    for m in sync_run["memory"]:
        assert list(m["peak_by_category"]) == list(m["at_peak"]) == list(CATEGORIES), m["rank"]
    assert STAGING not in sync_run["predicted"]["per_rank"][0]
    trace = json.loads((jobs.folder / "ddp_async" / "memory_trace.json").read_text())
    assert max(trace[0]["series"][STAGING]) == async_run["memory"][0]["peak_by_category"][STAGING]
    assert STAGING not in json.loads((jobs.folder / "ddp" / "memory_trace.json").read_text())[0]["series"]


def test_a_signal_in_the_last_step_lets_the_run_complete(jobs):
    """SIGTERM to rank 1 in the last step: no step is left to stop before, so the run ends as
    it would have (exit 0, its checkpoint and summary.json written) and says so in one line."""
    run = jobs.elastic["ddp_sigterm_last"]
    assert run["code"] == 0 and list(run["losses"]) == ["0", "1"], run["stderr"]
    assert run["checkpoints"] == ["step_00000000", "step_00000001"]
    assert ("SIGTERM came with no step left to stop before: the run completed all 2 steps and wrote its outputs and "
            "its checkpoint of step 1; nothing is lost and nothing is left to resume.") in run["stdout"]
    assert (jobs.folder / "ddp_sigterm_last" / "summary.json").exists()


# ---- Ctrl-C under torchrun ---------------------------------------------------------------------
# A terminal's Ctrl-C sends SIGINT to its foreground process group: torchrun's (torchrun starts
# every rank in a session of its own and passes the SIGINT on to each, once).
CTRL_C_FLAGS = ["--device", "cpu", "--model", "debug", "--steps", "100000", "--seq-len", "32", "--global-batch-size",
                "8", "--eval-batches", "0", "--no-trace-memory"]


def _proc_stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # state, ppid, ...
    except OSError:
        return None


def _ranks_of(pid: int) -> list[int]:
    """torchrun's children: its ranks."""
    stats = {int(d.name): _proc_stat(int(d.name)) for d in Path("/proc").iterdir() if d.name.isdigit()}
    return [p for p, st in stats.items() if st and int(st[1]) == pid]


def _gone(pid: int) -> bool:
    st = _proc_stat(pid)
    return st is None or st[0] == "Z"  # (a zombie has ended: torchrun has yet to reap it)


def _ctrl_c(tmp_path, script: str, nproc: int, flags: list[str], after_steps: int, presses: list[float]):
    """Start torchrun in a session of its own, wait until ``after_steps`` steps are logged,
    then press Ctrl-C (SIGINT to torchrun's process group) once per entry of ``presses``, that
    many seconds after the one before. Returns the seconds from the last press until every
    rank was gone (None: still there after 30 s), and what torchrun and the ranks printed."""
    out, log = tmp_path / "run", tmp_path / "log.txt"
    with open(log, "w") as f:  # the real torchrun: what it does with a Ctrl-C is the test
        p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                              str(nproc), script, *flags, "--out", str(out)], cwd=ROOT, stdout=f,
                             stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + hang_limit(150)
        while not (out / "metrics.jsonl").exists() or \
                len((out / "metrics.jsonl").read_text().splitlines()) < after_steps:
            assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        ranks = _ranks_of(p.pid)
        assert len(ranks) == nproc, ranks
        # press just after a step ended (its line appears): the presses then fall early in
        # the next step, however quick this machine's steps are, instead of at a random point
        # of one (CI once saw the ranks agree on the first before the second arrived)
        logged = len((out / "metrics.jsonl").read_text().splitlines())
        while len((out / "metrics.jsonl").read_text().splitlines()) == logged:
            assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.005)
        for wait in presses:
            time.sleep(wait)
            os.killpg(p.pid, signal.SIGINT)
        pressed, took = time.monotonic(), None
        while time.monotonic() - pressed < 30:
            if all(_gone(r) for r in ranks):
                took = time.monotonic() - pressed
                break
            time.sleep(0.05)
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return took, log.read_text().replace("\r", "\n"), out


def _not_ours(output: str):
    """No traceback through this repository's code (torchrun's own, in torch, is not ours), and
    none of the lines a rank that ended badly prints."""
    files = re.findall(r'^\s*File "([^"]+)"', output, re.M)
    ours = [f for f in files if not f.startswith("<") and "site-packages" not in f
            and (not os.path.isabs(f) or f.startswith(str(ROOT)))]  # (torchrun's is in torch and the stdlib)
    assert not ours, "\n".join(ours) + "\n" + output[-4000:]
    for bad in ("failed:", "Exception ignored", "terminate called", "KeyboardInterrupt", "error:"):
        assert bad not in output, output[-4000:]


def test_a_ctrl_c_outside_the_steps_is_one_line_and_exit_130(capsys, monkeypatch):
    """Outside the training steps (starting, tearing down) a Ctrl-C stops the process where it
    is, as Python's KeyboardInterrupt does, and main_guard ends it with one line and exit 130.
    An error after a Ctrl-C (gloo's "Connection closed by peer": a rank that stopped first) is
    that stop, said the same way, without a traceback. main_guard's handler is its own while
    the script runs and the one before it afterwards."""
    from common import errors

    monkeypatch.setitem(errors.CTRL_C, "seen", False)
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    before = signal.getsignal(signal.SIGINT)

    @errors.main_guard
    def pressed():
        assert signal.getsignal(signal.SIGINT) is errors._on_ctrl_c
        signal.raise_signal(signal.SIGINT)  # the real handler: noted, then KeyboardInterrupt
        raise AssertionError("a Ctrl-C outside the steps must stop the script")

    @errors.main_guard
    def peer_gone():
        raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:13232")

    line = ("interrupted (Ctrl-C): stopped where it was; what was complete before it (the checkpoints, the steps "
            "logged) stays usable.")
    for script in (pressed, peer_gone):
        with pytest.raises(SystemExit) as stop:
            script()
        err = capsys.readouterr().err
        assert stop.value.code == 130 and err.splitlines() == [line], err
        assert errors.CTRL_C["seen"] and signal.getsignal(signal.SIGINT) is before


def test_ctrl_c_stops_every_rank_within_seconds_at_one_step_with_one_line(tmp_path):
    """Ctrl-C in the middle of a 4-rank DDP run: every rank stops after the same step (the one
    whose vote carried the Ctrl-C), well before torchrun's SIGKILL 30 s later, unsaved; rank 0
    alone says so, naming the checkpoint --resume continues from; no traceback of ours. The
    run's folder is one a --resume continues: every step up to the stop logged once, complete
    checkpoints only, no lock, no summary.json (the run did not finish)."""
    took, output, out = _ctrl_c(tmp_path, "step3_multi_gpu/train_ddp.py", 4, CTRL_C_FLAGS + ["--ckpt-every", "2"],
                                after_steps=4, presses=[0])
    assert took is not None and took < 15, f"ranks still there 30 s after the Ctrl-C\n{output[-4000:]}"
    said = [line for line in output.splitlines() if "Ctrl-C" in line]
    assert len(said) == 1, said
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = steps[-1]
    assert steps == list(range(last + 1)) and last >= 4, steps  # stopped mid-training, each step logged once
    kept = complete_checkpoints(out / "checkpoints")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [p.name for p in kept]  # nothing half-written
    saved = int(kept[-1].name.split("_")[1])
    # --ckpt-every 2 saves steps 1, 3, 5...: the newest before the stop (a Ctrl-C skips the stop step's save)
    assert saved == last - 1 - last % 2, (saved, last)
    again = f"step {last} is" if saved + 1 == last else f"steps {saved + 1}-{last} are"
    assert said[0] == (f"interrupted (Ctrl-C): every rank stopped after step {last}, unsaved; --resume continues from "
                       f"{kept[-1]} (step {saved}), so {again} trained again; a SIGTERM (to torchrun, if it launched "
                       f"the run) stops with a checkpoint."), said
    assert not (out / ".run.lock").exists() and not (out / "summary.json").exists()
    _not_ours(output)


def test_a_second_ctrl_c_stops_every_rank_at_once(tmp_path):
    """Two Ctrl-Cs 0.15 s apart, just after a step ended, each step taking several times
    longer than that (every forward sleeps 1.5 s first: tests/drivers/slow_steps.py): the
    first asks the ranks to stop at the next agreed step; torchrun answers the second with
    SIGTERM to every rank, which a rank that had the first Ctrl-C takes as the second: it
    ends there, mid-step, without the save a SIGTERM alone asks for. Rank 0 says so."""
    took, output, out = _ctrl_c(tmp_path, "tests/drivers/slow_steps.py", 2,
                                ["1.5", "step3_multi_gpu/train_ddp.py", *CTRL_C_FLAGS], after_steps=1, presses=[0, 0.15])
    assert took is not None and took < 10, f"ranks still there {took} s after the second Ctrl-C\n{output[-4000:]}"
    assert "second Ctrl-C: stopping at once, mid-step" in output, output[-4000:]
    assert "every rank stopped after step" not in output and not (out / "checkpoints").exists()
    _not_ours(output)


def test_checkpoints_reshard_across_world_sizes_and_strategies(jobs):
    e, four = jobs.elastic, jobs.two_nodes
    # FSDP 4 ranks -> 2 ranks, ZeRO-1 4 -> 2: the same global batch, so the same losses
    _close(e["fsdp_from_fsdp4"]["losses"], four["fsdp4"]["losses"], ["4", "5"], PARITY_RTOL)
    _close(e["zero1_from_zero1_4"]["losses"], four["zero1_4"]["losses"], ["4", "5"], PARITY_RTOL)
    assert list(e["fsdp_from_fsdp4"]["losses"]) == ["4", "5"]  # it started at step 4
    # DDP <-> FSDP, FSDP -> FSDP with CPU offload: one checkpoint format
    for name, src in (("fsdp_from_ddp", "ddp"), ("ddp_from_fsdp", "fsdp"), ("offload_from_fsdp", "fsdp")):
        _close(e[name]["losses"], e[src]["losses"], ["4", "5"], TIGHT_RTOL)
    # ZeRO-1 on 4 ranks (each rank saved its quarter of AdamW's state) -> plain DDP on 2
    _close(e["ddp_from_zero1_4"]["losses"], four["zero1_4"]["losses"], ["4", "5"], PARITY_RTOL)


def test_a_checkpoint_holds_the_same_tensor_bytes_in_every_layout(jobs):
    """step4_multi_node/README.md: DDP, ZeRO-1 and FSDP (2 and 4 ranks) write the same tensor
    bytes, 12N plus a 4-byte step counter per parameter tensor (FSDP's shards unpadded); what
    else is in the .distcp files is per item, and FSDP writes each weight and moment as W
    shards: 3T(W - 1) items more than DDP."""
    from step4_multi_node.tables import checkpoint_row
    rows = {name: checkpoint_row(jobs.folder / name) for name in ("ddp", "fsdp", "fsdp4", "zero1_4")}
    n, tensors = rows["ddp"]["n_params"], len(list(Transformer(get_config("debug")).parameters()))
    print({k: (r["tensor_bytes"], r["items"], r["data_bytes"]) for k, r in rows.items()})
    assert {r["tensor_bytes"] for r in rows.values()} == {12 * n + 4 * tensors}
    assert rows["fsdp"]["items"] - rows["ddp"]["items"] == 3 * tensors * (2 - 1)
    assert rows["fsdp4"]["items"] - rows["ddp"]["items"] == 3 * tensors * (4 - 1)
    assert all(0 < (r["data_bytes"] - r["tensor_bytes"]) / r["items"] < 2048 for r in rows.values())


def test_export_gives_one_plain_file(jobs, tmp_path):
    """Sharded by 4 FSDP ranks or whole on 2 DDP ranks: the same weights, one torch.save file."""
    weights = {}
    for run in ("fsdp4", "ddp"):
        dest = tmp_path / f"{run}.pt"
        export(str(jobs.folder / run / "checkpoints" / "step_00000005"), str(dest))
        saved = torch.load(dest, weights_only=False)
        model = Transformer(get_config("debug"))
        model.load_state_dict(saved["model"])  # strict: every weight, full shapes
        assert saved["step"] == 5 and saved["model_config"] == get_config("debug").as_dict()
        weights[run] = saved["model"]
    # The two layouts sum each gradient in another order (a reduce-scatter, an all-reduce), and
    # AdamW's normalised step turns a rounding in a near-zero gradient into far more than fp32's
    # epsilon: up to 1.2e-6 apart after 5 steps on AVX2 kernels. 1e-5 is a thousandth of the
    # weights' scale (~1e-2), which a shard exported in the wrong place misses by whole.
    for k, v in weights["ddp"].items():
        torch.testing.assert_close(weights["fsdp4"][k], v, rtol=1e-5, atol=1e-5)
    # export never overwrites, and a damaged checkpoint is one sentence
    before = (tmp_path / "ddp.pt").read_bytes()
    with pytest.raises(UserError, match="already exists"):
        export(str(jobs.folder / "ddp" / "checkpoints" / "step_00000005"), str(tmp_path / "ddp.pt"))
    assert (tmp_path / "ddp.pt").read_bytes() == before
    with pytest.raises(UserError, match="cannot be read"):
        export(str(jobs.folder / "bad_truncated" / "checkpoints" / "step_00000003"), str(tmp_path / "x.pt"))
    with pytest.raises(UserError, match="not a complete checkpoint"):
        export(str(jobs.folder / "ddp"), str(tmp_path / "y.pt"))
    assert not list(tmp_path.glob("x.pt*")) and not list(tmp_path.glob("y.pt*"))


def test_a_sharded_checkpoint_loads_whole_in_one_process_for_generation(jobs):
    """python -m tools.generate on a 2-rank FSDP run: its last checkpoint, each rank's shards,
    read into one process with no process group (common/generate.py), holds the weights that
    --save-weights gathered at the run's end, bit for bit, and continues a prompt alike; the
    run folder itself gives the newer of the two."""
    from common.generate import encode, find_weights, generate, load_trained
    run = jobs.folder / "fsdp"
    sharded, plain = load_trained(run / "checkpoints" / "step_00000005"), load_trained(run)
    assert plain.source == run / "weights.pt" and find_weights(run).context == sharded.context == 32
    a, b = sharded.model.state_dict(), plain.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    prompt = torch.tensor([encode("def fib(")])
    assert torch.equal(generate(sharded.model, prompt, 20, 32, 0.8, 50)[0],
                       generate(plain.model, prompt, 20, 32, 0.8, 50)[0])


def test_non_utf8_data_trains(jobs):
    assert list(jobs.elastic["non_utf8"]["losses"]) == ["0", "1"]


def test_nan_stop_names_step_and_rank_and_skip_goes_on(jobs):
    stop = jobs.elastic["nan_stop"]
    lines = [line for line in stop["stderr"].splitlines() if "error:" in line]
    assert lines and all("(rank " in line and "--on-nan skip" in line for line in lines), stop["stderr"]
    skip = jobs.elastic["nan_skip"]
    assert list(skip["losses"]) == ["0", "1", "2"]
    assert "non-finite gradients: skipping this step's update" in skip["stdout"]


def test_misuse_is_one_sentence_and_leaves_checkpoints_alone(jobs):
    for name, text in ERRORS.items():
        res = jobs.elastic[name]
        lines = [line for line in res["stderr"].splitlines() if "step/s" not in line and line.strip()]
        assert lines and all(line.startswith("[rank ") for line in lines), (name, res["stderr"])
        assert text in lines[-1], (name, res["stderr"])
    for name, src in (("bad_accum", "ddp"), ("bad_preset", "fsdp4"), ("bad_finished", "fsdp")):
        mine = jobs.folder / name / "checkpoints" / "step_00000003"
        theirs = jobs.folder / src / "checkpoints" / "step_00000003"
        assert sorted(p.name for p in mine.iterdir()) == sorted(p.name for p in theirs.iterdir())
        for p in mine.iterdir():
            assert p.read_bytes() == (theirs / p.name).read_bytes(), (name, p.name)
        assert jobs.elastic[name]["checkpoints"] == ["step_00000003"]  # nothing new, nothing removed


# ---- in this process: argument checks, the NaN-skip hook, resharding limits --------------

def _load(path: str):
    spec = importlib.util.spec_from_file_location(Path(path).stem + "_flags", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BASE = ["--model", "debug", "--seq-len", "32", "--steps", "2", "--global-batch-size", "2", "--device", "cpu",
        "--no-trace-memory", "--eval-batches", "0", "--data", "synthetic"]
MISUSE = [  # (script, flags, the sentence)
    ("ddp", ["--lr", "-1"], "--lr must be a positive number (got -1.0)."),
    ("ddp", ["--lr", "inf"], "--lr must be a positive number (got inf)."),
    ("ddp", ["--trace-memory", "--trace-steps", "0"], "--trace-steps must be positive (got 0)."),
    ("ddp", ["--grad-accum", "0"], "--grad-accum must be positive (got 0)."),
    ("ddp", ["--ckpt-keep", "0"], "--ckpt-keep must be at least 1 (got 0)."),
    ("ddp", ["--ckpt-every", "-2"], "--ckpt-every cannot be negative (got -2)"),
    ("ddp", ["--pg-timeout", "0"], "--pg-timeout must be positive seconds (got 0.0)."),
    ("ddp", ["--pg-timeout", "inf"], "--pg-timeout must be a finite number of seconds (got inf)."),
    ("ddp", ["--fail-at-step", "2"], "--fail-at-step 2 is not a step of this run (0 to 1)."),
    ("ddp", ["--fail-at-step", "0", "--fail-rank", "1"], "--fail-rank 1 does not exist: this run has ranks 0 to 0."),
    ("ddp", ["--seed", "-1"], "--seed must be between 0 and 2**63 - 1 (got -1)."),
    ("ddp", ["--steps", "0"], "--steps must be positive (got 0)."),
    ("ddp", ["--model", "13b"], "unknown --model '13b'"),
    ("ddp", ["--seq-len", "4096"], "--seq-len 4096 is longer than model 'debug' supports (256)"),
    ("ddp", ["--data", "/no/such/file"], "--data /no/such/file: no such file or folder"),
    ("ddp", ["--device", "cuda"] if not torch.cuda.is_available() else ["--device", "tpu"], "--device"),
    ("ddp", ["--on-nan", "ignore"], "argument --on-nan: invalid choice: 'ignore'"),
    ("ddp", ["--comm-hook", "powersgd", "--powersgd-rank", "0"], "--powersgd-rank must be at least 1 (got 0)."),
    ("fsdp", ["--hsdp", "0", "1"], "a 0 x 1 mesh (replicate, shard): every size must be at least 1."),
    ("fsdp", ["--hsdp", "-1", "-1"], "a -1 x -1 mesh (replicate, shard): every size must be at least 1."),
    ("fsdp", ["--hsdp", "2", "2"], "a 2 x 2 mesh (replicate, shard) needs 4 ranks but 1 were launched"),
    ("fsdp", ["--hsdp", "2"], "argument --hsdp: expected 2 arguments"),
    ("fsdp", ["--global-batch-size", "3", "--grad-accum-steps", "2"], "--global-batch-size 3 does not divide"),
]


@pytest.fixture(scope="module")
def scripts():
    return {"ddp": _load("step3_multi_gpu/train_ddp.py"), "fsdp": _load("step3_multi_gpu/train_fsdp.py")}


def _main(module, argv) -> tuple[int, list[str]]:
    err, code = io.StringIO(), 0
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            module.main(argv)
        except SystemExit as e:
            code = e.code
    return code, [line for line in err.getvalue().splitlines() if line.strip()]


def test_out_of_range_flags_are_one_sentence(scripts, tmp_path):
    for script, flags, sentence in MISUSE:
        code, lines = _main(scripts[script], BASE + flags + ["--out", str(tmp_path / "out")])
        assert code == 2 and len(lines) == 1 and sentence in lines[0], (script, flags, lines)
    # --out naming a file: refused, and the file is left as it was
    precious = tmp_path / "notes.txt"
    precious.write_text("keep me")
    code, lines = _main(scripts["ddp"], BASE + ["--out", str(precious)])
    assert code == 2 and lines == [f"error: --out {precious} is a file, not a folder; give a folder "
                                   f"(it is created if missing)."]
    assert precious.read_text() == "keep me"


def test_unreadable_data_file(tmp_path):
    if sys.platform.startswith("linux"):  # a read that fails whoever we are: /proc/self/mem at offset 0
        with pytest.raises(UserError, match=r"^--data: cannot read /proc/self/mem \("):
            load_corpus("/proc/self/mem")
    f = tmp_path / "locked.txt"
    f.write_text("hello " * 100)
    f.chmod(0)
    try:
        if os.access(f, os.R_OK):
            pytest.skip("running as root: chmod 000 does not stop reads here (the /proc case above did run)")
        with pytest.raises(UserError, match="cannot read .*locked.txt .Permission denied."):
            load_corpus(str(f))
    finally:
        f.chmod(0o644)


def test_on_nan_skip_leaves_weights_and_adamw_state_alone():
    with distributed("cpu") as ctx:
        layer = torch.nn.Linear(3, 2)
        opt = torch.optim.AdamW(layer.parameters(), lr=0.1)
        skip_nonfinite_step(opt, ctx, enabled=True)
        layer(torch.ones(1, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
        before = [p.detach().clone() for p in layer.parameters()]
        state = {k: v.clone() for k, v in opt.state[layer.weight].items()}
        layer(torch.full((1, 3), float("nan"))).sum().backward()
        opt.step()  # skipped: one NaN gradient is enough
        assert all(torch.equal(a, b) for a, b in zip(before, layer.parameters()))
        assert all(torch.equal(v, opt.state[layer.weight][k]) for k, v in state.items())
        opt.zero_grad()
        layer(torch.ones(1, 3)).sum().backward()
        opt.step()  # finite again: trains
        assert not torch.equal(before[0], layer.weight)


def test_any_parallel_layout_may_resume(tmp_path):
    """DCP reshards by parameter name: another number of pipeline stages, or ranks, is allowed
    (the real 2 -> 4 stage run is in tests/test_checkpoint.py); what changes the numbers is not."""
    args = SimpleNamespace(out=tmp_path, model="debug", model_config=get_config("debug"), global_batch_size=4,
                           seq_len=32, seed=0, data="synthetic", grad_accum=1, fail_at_step=None, lr=3e-3,
                           warmup_steps=10)
    ctx = SimpleNamespace(world_size=2, rank=0)
    meta = {"model": "debug", "model_config": get_config("debug").as_dict(), "global_batch_size": 4,
            "seq_len": 32, "seed": 0, "data": "synthetic", "grad_accum": 1}
    for saved, now in (({"pp": 4, "stages": 4}, {"pp": 2, "stages": 2}),  # 4 stages -> 2
                       ({"dp": 4}, {"dp": 2}),                            # FSDP 4 -> 2 ranks
                       ({"tp": 2}, {"pp": 2, "stages": 2})):              # TP -> pipeline
        assert Checkpointer(args, ctx, [], parallel=now)._check_compatible(tmp_path, meta | {"parallel": saved}) is None
    # The same check does refuse what would change the run: here, the batch.
    with pytest.raises(UserError, match="--global-batch-size 8 there, 4 here"):
        Checkpointer(args, ctx, [], parallel={"dp": 2})._check_compatible(
            tmp_path, meta | {"parallel": {"dp": 4}, "global_batch_size": 8})
    # --resume --lr X used to keep the saved learning rate without a word: now it is refused,
    # and every differing setting is named in the one sentence, not the first one found
    with pytest.raises(UserError) as e:
        Checkpointer(args, ctx, [], parallel={"dp": 2})._check_compatible(
            tmp_path / "checkpoints" / "step_00000003",
            meta | {"parallel": {"dp": 2}, "lr": 1e-3, "warmup_steps": 10, "seed": 5, "global_batch_size": 8})
    assert str(e.value) == (
        f"--out {tmp_path} holds a checkpoint of another run (step_00000003): --global-batch-size 8 there, 4 here; "
        f"--lr 0.001 there, 0.003 here; --seed 5 there, 0 here. Resume with the same flags, or use another --out, "
        f"or delete {tmp_path / 'checkpoints'} to start over.")
    assert "--warmup-steps" not in str(e.value) and "--data" not in str(e.value)  # the same: not named


# ==== the model-parallel family (tensor, pipeline, 2-D, 3-D) ===================================
MP_B = ["--global-batch-size", "4", "--steps", "4", "--no-trace-memory"]
MP_C = ["--ckpt-every", "2", "--ckpt-keep", "3"]
MP_R = MP_B + MP_C + ["--resume"]
MP_PP = ["--schedule", "1f1b", "--microbatches", "2"]
MP_STEPS = ["0", "1", "2", "3"]
MP_FP32 = ["--amp", "off"]  # TP and DDP add in other orders: fp32 keeps them within 1e-5 of each other
MP_PLAN = {
    "tp": {"script": "tp", "flags": MP_B + MP_C + MP_FP32},
    # the driver's restart, without a crash: copy step 1's checkpoint and --resume there
    "tp_resumed": {"script": "tp", "flags": MP_R + MP_FP32, "from": ["tp", 1]},
    # across layouts: TP's optimizer has two parameter groups (DTensor slices, the plain
    # norms: common/training.py), DDP's one; the state moves by parameter name both ways
    "ddp": {"script": "ddp", "flags": MP_B + MP_C + MP_FP32},
    "ddp_from_tp": {"script": "ddp", "flags": MP_R + MP_FP32, "from": ["tp", 1]},
    "tp_from_ddp": {"script": "tp", "flags": MP_R + MP_FP32, "from": ["ddp", 1]},
    # the 2-D script on 2 ranks (dp 1 x tp 2: its FSDP dimension has nothing to shard)
    "2d": {"script": "2d", "flags": MP_B + MP_C + ["--tp", "2"]},
    "2d_resumed": {"script": "2d", "flags": MP_R + ["--tp", "2"], "from": ["2d", 1]},
    "pp": {"script": "pp", "flags": MP_B + MP_C + MP_PP},
    # rank 1 holds the last stage, the one that computes the loss
    "pp_fault": {"script": "pp", "flags": MP_R + MP_PP + ["--fail-at-step", "2", "--fail-rank", "1"]},
    # 2 stages -> 4 (interleaved: two per rank): the layers keep their names, DCP reshards
    "pp4_from_pp": {"script": "pp", "flags": MP_R + ["--schedule", "interleaved1f1b", "--microbatches", "2"],
                    "from": ["pp", 1]},
}


@pytest.fixture(scope="module")
def mp_job(tmp_path_factory):
    folder = tmp_path_factory.mktemp("resume_mp")
    t0 = time.perf_counter()
    # a fresh store for each attempt, as train.slurm runs several nodes (the 2-rank restarts of
    # the elastic job above share the agent's store, torchrun's default)
    r = launch.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    "--max-restarts", "1", "tests/drivers/resume.py", str(folder), json.dumps(MP_PLAN)],
                   cwd=ROOT, capture_output=True, text=True, timeout=120,
                   env=dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.count("crashing on purpose") == 1, r.stdout[-3000:]
    res = {name: json.loads((folder / f"{name}.json").read_text()) for name in MP_PLAN}
    for name, run in res.items():
        assert run["code"] == 0, f"{name}: {run['stderr']}"
    print(f"torchrun job: {time.perf_counter() - t0:.1f} s")
    return res


def test_killed_and_restarted_pipeline_continues_exactly(mp_job):
    """1F1B, rank 1 (the last stage, which alone computes the loss) dies after step 2."""
    plain, faulty = mp_job["pp"], mp_job["pp_fault"]
    assert list(plain["losses"]) == MP_STEPS
    assert faulty["restarted"] and faulty["job_attempt"] >= 1  # it really died
    assert faulty["losses"] == plain["losses"]  # fp32, bit for bit: no gap, no repeat
    assert faulty["checkpoints"] == ["step_00000001", "step_00000003"]


def test_tensor_parallel_resumes_exactly(mp_job):
    plain, resumed = mp_job["tp"], mp_job["tp_resumed"]
    assert list(plain["losses"]) == MP_STEPS
    assert list(resumed["losses"]) == ["2", "3"]  # started after step 1's checkpoint
    assert all(resumed["losses"][s] == plain["losses"][s] for s in ("2", "3"))  # bit for bit


def test_tensor_parallel_and_ddp_resume_each_other(mp_job):
    """A TP checkpoint resumed by DDP, and a DDP one by TP: step 3's loss, which follows an
    update made with the loaded AdamW state, is the uninterrupted run's (to fp32's
    reduction order); a state lost or mapped to the wrong parameters would move it."""
    tp, ddp = mp_job["tp"], mp_job["ddp"]
    assert all(math.isclose(tp["losses"][s], ddp["losses"][s], rel_tol=PARITY_RTOL) for s in MP_STEPS)
    for resumed, plain in ((mp_job["ddp_from_tp"], tp), (mp_job["tp_from_ddp"], ddp)):
        assert list(resumed["losses"]) == ["2", "3"]
        assert all(math.isclose(resumed["losses"][s], plain["losses"][s], rel_tol=PARITY_RTOL) for s in ("2", "3"))


def test_two_d_script_resumes_exactly(mp_job):
    plain, resumed = mp_job["2d"], mp_job["2d_resumed"]
    assert list(plain["losses"]) == MP_STEPS
    assert list(resumed["losses"]) == ["2", "3"]
    assert all(resumed["losses"][s] == plain["losses"][s] for s in ("2", "3"))  # bit for bit


# The 2-D script on 4 ranks, where both dimensions are real: dp 2 (FSDP shards each TP
# slice over 2 ranks) x tp 2; and the 3-D script on 4 ranks, one dimension at a time left
# at 1 (2 x 2 x 2 needs 8 ranks): pipelines of TP pairs, and pipelines of FSDP pairs. One
# job of 4 processes (2-D and 3-D meshes meet in it: common.distributed.release_finished_groups
# makes DTensor forget the earlier run's plans).
_PP_TP, _PP_FSDP = ["--pp", "2", "--dp", "1", "--tp", "2"], ["--pp", "2", "--dp", "2", "--tp", "1"]
PLAN_2D_3D = {
    "2d_2x2": {"script": "2d", "flags": MP_B + MP_C + ["--dp", "2", "--tp", "2"]},
    "2d_2x2_resumed": {"script": "2d", "flags": MP_R + ["--dp", "2", "--tp", "2"], "from": ["2d_2x2", 1]},
    "3d_pp_tp": {"script": "3d", "flags": MP_B + MP_C + _PP_TP},
    "3d_pp_tp_resumed": {"script": "3d", "flags": MP_R + _PP_TP, "from": ["3d_pp_tp", 1]},
    "3d_pp_fsdp": {"script": "3d", "flags": MP_B + MP_C + _PP_FSDP},
    "3d_pp_fsdp_resumed": {"script": "3d", "flags": MP_R + _PP_FSDP, "from": ["3d_pp_fsdp", 1]},
}


def test_two_d_and_three_d_on_four_ranks_resume_exactly(tmp_path):
    plan = PLAN_2D_3D
    r = launch.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                    "tests/drivers/resume.py", str(tmp_path), json.dumps(plan)],
                   cwd=ROOT, capture_output=True, text=True, timeout=hang_limit(300))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    res = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in plan}
    for name, run in res.items():
        assert run["code"] == 0, f"{name}: {run['stderr']}"
    for name in [n for n in plan if "from" not in plan[n]]:
        plain, resumed = res[name], res[name + "_resumed"]
        assert list(plain["losses"]) == MP_STEPS and list(resumed["losses"]) == ["2", "3"], name
        assert all(resumed["losses"][s] == plain["losses"][s] for s in ("2", "3")), name  # bit for bit


def test_pipeline_checkpoint_loads_into_another_stage_count(mp_job):
    resumed, src = mp_job["pp4_from_pp"], mp_job["pp"]
    assert list(resumed["losses"]) == ["2", "3"]  # started after step 1's checkpoint
    for s in ("2", "3"):
        assert resumed["losses"][s] == pytest.approx(src["losses"][s], rel=PARITY_RTOL), s


# ==== random kills ==============================================================================
def test_random_kills_end_where_an_uninterrupted_run_ends(tmp_path):
    """python -m tools.chaos: 3 SIGKILLs of random ranks at random moments under torchrun
    --max-restarts 3 --resume; seed 7 draws one while a checkpoint is being written, one in a
    step, and the last once the final checkpoint is written, before summary.json (the restart
    must write it). The job still ends with the uninterrupted DDP run's losses, final weights,
    AdamW state and summary's final loss, bit for bit. The tool runs the reference itself
    (24 steps: room for 2 kills before the last checkpoint begins)."""
    t0 = time.perf_counter()
    r = _run([sys.executable, "-m", "tools.chaos", "--kills", "3", "--seed", "7", "--steps", "24", "--ckpt-every", "2",
              "--out", str(tmp_path), "--json", str(tmp_path / "chaos.json")], timeout=240)
    print(r.stdout, f"chaos: {time.perf_counter() - t0:.1f} s")
    assert (tmp_path / "chaos.json").exists(), f"tools.chaos exited {r.returncode} with no report: {r.stderr[-3000:]}"
    res = json.loads((tmp_path / "chaos.json").read_text())
    assert r.returncode == 0 and res["match"], r.stdout + r.stderr[-3000:]
    assert len(res["kills"]) == 3 and res["restarts"] == 3, r.stdout
    assert any(k["during"] == "checkpoint write" for k in res["kills"]), r.stdout
    assert res["kills"][-1]["during"] == "after the last checkpoint" and res["kills"][-1]["resumed_at"] == 24, r.stdout
    assert "3 kills, 3 restarts" in r.stdout and "result: same" in r.stdout


# ==== Slurm's requeue (step4_multi_node/train.slurm, with srun and scontrol stubbed) ============
def test_train_slurm_requeues_a_warned_job_only_if_the_run_is_not_complete(tmp_path):
    """The batch script gets USR1 (Slurm's warning) while srun runs; torchrun exits 1 after
    any forwarded signal, so the script looks at the run's summary.json: absent, the ranks
    were preempted and the job is requeued; present, the run completed (a warning in its
    last step) and the job ends without a requeue. Both exit 0.
    The same two jobs check what the script hands srun: --shutdown-timeout only from a
    torchrun whose --help lists it (torch 2.11's rejects it), and GLOO_SOCKET_IFNAME: the
    person's, else the interface that reaches the second node."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    # srun: note its environment's gloo interface and its arguments, warn the batch shell as
    # Slurm's --signal=B:USR1 does, then end as torchrun does after it
    (bin_ / "srun").write_text(f"#!/bin/bash\necho \"${{GLOO_SOCKET_IFNAME:-unset}} $*\" >> {tmp_path}/srun\n"
                               "trap 'exit 1' USR1\nsleep 0.3\nkill -USR1 $PPID\n"
                               "for i in $(seq 100); do sleep 0.05; done\nexit 1\n")
    (bin_ / "scontrol").write_text(f"#!/bin/bash\n[ \"$1\" = requeue ] && echo \"$2\" >> {tmp_path}/requeued\n"
                                   "[ \"$1\" = show ] && printf 'node1\\nnode2\\n'\nexit 0\n")
    (bin_ / "torchrun").write_text("#!/bin/bash\necho \"usage: torchrun [--max-restarts MAX_RESTARTS] $TORCHRUN_HAS\"\n")
    (bin_ / "getent").write_text("#!/bin/bash\n[ \"$2\" = node2 ] && echo '10.1.2.3 STREAM node2'\n")
    (bin_ / "ip").write_text("#!/bin/bash\n[ \"$4\" = 10.1.2.3 ] && echo '10.1.2.3 dev ib0 src 10.1.2.2 uid 0'\n")
    for f in bin_.iterdir():
        f.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_NODELIST="node[1-2]",
               SLURM_JOB_NUM_NODES="2", SLURM_JOB_ID="42", SLURM_CPUS_PER_TASK="2")
    env.pop("GLOO_SOCKET_IFNAME", None)
    out = tmp_path / "run"
    out.mkdir()
    for complete in (False, True):
        if complete:
            (out / "summary.json").write_text("{}")
        # torch 2.13's torchrun and no interface set; then torch 2.11's, and the person's interface
        env |= {"TORCHRUN_HAS": "[--shutdown-timeout SHUTDOWN_TIMEOUT]"} if not complete else \
            {"TORCHRUN_HAS": "", "GLOO_SOCKET_IFNAME": "eth7"}
        r = launch.run(["bash", str(ROOT / "step4_multi_node" / "train.slurm"), "step3_multi_gpu/train_fsdp.py",
                        "--steps", "5", "--out", str(out)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        gloo, *args = (tmp_path / "srun").read_text().splitlines()[-1].split()
        assert gloo == ("eth7" if complete else "ib0"), gloo
        assert ("--shutdown-timeout" in args) != complete and "--signals-to-handle" in args, args
        assert args[args.index("--shutdown-timeout") + 1] == "100" if not complete else True
        requeued = (tmp_path / "requeued").read_text().split() if (tmp_path / "requeued").exists() else []
        assert requeued == ["42"], (complete, r.stderr)  # once: by the first (incomplete) job only
        assert ("not requeued" in r.stderr) == complete, r.stderr


def test_the_stuck_rank_watch_waits_for_a_save_in_flight(monkeypatch):
    """After a signal, a rank that makes no progress for max(10 s, 3 x the longest step or
    save seen) stops at once (a peer is gone); a save in flight is progress, however long
    (a run's first checkpoint of a large model, taken at preemption, can outlast every step
    seen: it was cut off at 10 s). The watch itself, in this process: time is moved, not waited."""
    import signal
    import threading
    import time

    from common import checkpoint_signals

    exits = []

    class Watched(checkpoint_signals.StopSignals):
        def __init__(self):
            self.ctx = type("Ctx", (), {"rank": 0})()
            self._closed, self._progress, self._longest = threading.Event(), time.monotonic() - 100, 0.0

    def fake_exit(code):
        exits.append(code)
        watched._closed.set()

    monkeypatch.setattr(checkpoint_signals.os, "_exit", fake_exit)
    watched = Watched()
    with watched.busy():  # 100 s idle, but a save is in flight: the watch waits
        thread = threading.Thread(target=watched._give_up_if_stuck, args=(signal.SIGTERM,), daemon=True)
        thread.start()
        time.sleep(0.7)
        assert exits == [] and thread.is_alive()
    thread.join(5)  # the save ended with nothing marked since: stuck, so it stops
    assert exits == [128 + signal.SIGTERM] and not thread.is_alive()
    # an evaluation and the run's outputs count as busy too (a long --eval-batches, or
    # --save-weights' gather of a large model, cut a signalled run off before its save)
    from common.run import Run
    seen = []
    run = Run.__new__(Run)
    run.ckpt, run.evaluates = watched, lambda step: True
    run.metrics = type("M", (), {"evaluated": lambda self, step, fn: seen.append(watched._saving) or []})()
    run._validate = None
    run.evaluate_if_due(3)
    run._finish = lambda extra: seen.append(watched._saving)
    watched.mark_progress = lambda: None
    run.args, run.ctx = None, None
    run.finish()
    assert seen == [True, True] and not watched._saving
