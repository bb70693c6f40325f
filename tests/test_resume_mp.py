"""Checkpoints for tensor and pipeline parallelism (issue 7): a 1F1B pipeline run killed by
``--fail-at-step`` under ``torchrun --max-restarts 1`` and a TP run resumed from a copied
checkpoint give the same losses as runs never interrupted (a second real crash would
cost another restart, ~7 s here), and a pipeline checkpoint loads into another number
of stages.

One torchrun job of 2 ranks (tests/resume_driver.py runs the scripts' main() one after
another on one process group), and two of 4 ranks: the 2-D script on a real 2 x 2 mesh, and
the 3-D script as pipelines of TP pairs and of FSDP pairs. Sizes: debug model, 32 tokens, global batch 4, 4 steps,
a checkpoint every 2 steps (after steps 1 and 3); the faults strike at step 2, so the
restarted run loads step 1's checkpoint and redoes step 2.
"""
import json
import subprocess
import sys
import time

import pytest

from conftest import ROOT

B = ["--global-batch-size", "4", "--steps", "4", "--no-trace-memory"]
C = ["--ckpt-every", "2", "--ckpt-keep", "3"]
R = B + C + ["--resume"]
PP = ["--schedule", "1f1b", "--microbatches", "2"]
STEPS = ["0", "1", "2", "3"]
PLAN = {
    "tp": {"script": "tp", "flags": B + C},
    # the driver's restart, without a crash: copy step 1's checkpoint and --resume there
    "tp_resumed": {"script": "tp", "flags": R, "from": ["tp", 1]},
    # the 2-D script on 2 ranks (dp 1 x tp 2: its FSDP dimension has nothing to shard)
    "2d": {"script": "2d", "flags": B + C + ["--tp", "2"]},
    "2d_resumed": {"script": "2d", "flags": R + ["--tp", "2"], "from": ["2d", 1]},
    "pp": {"script": "pp", "flags": B + C + PP},
    # rank 1 holds the last stage, the one that computes the loss
    "pp_fault": {"script": "pp", "flags": R + PP + ["--fail-at-step", "2", "--fail-rank", "1"]},
    # 2 stages -> 4 (interleaved: two per rank): the layers keep their names, DCP reshards
    "pp4_from_pp": {"script": "pp", "flags": R + ["--schedule", "interleaved1f1b", "--microbatches", "2"],
                    "from": ["pp", 1]},
}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    folder = tmp_path_factory.mktemp("resume_mp")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "--max-restarts", "1", "tests/resume_driver.py", str(folder), json.dumps(PLAN)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.count("crashing on purpose") == 1, r.stdout[-3000:]
    res = {name: json.loads((folder / f"{name}.json").read_text()) for name in PLAN}
    for name, run in res.items():
        assert run["code"] == 0, f"{name}: {run['stderr']}"
    print(f"torchrun job: {time.perf_counter() - t0:.1f} s")
    return res


def test_killed_and_restarted_pipeline_continues_exactly(job):
    """1F1B, rank 1 (the last stage, which alone computes the loss) dies after step 2."""
    plain, faulty = job["pp"], job["pp_fault"]
    assert list(plain["losses"]) == STEPS
    assert faulty["restarted"] and faulty["job_attempt"] >= 1  # it really died
    assert faulty["losses"] == plain["losses"]  # fp32, bit for bit: no gap, no repeat
    assert faulty["checkpoints"] == ["step_00000001", "step_00000003"]


def test_tensor_parallel_resumes_exactly(job):
    plain, resumed = job["tp"], job["tp_resumed"]
    assert list(plain["losses"]) == STEPS
    assert list(resumed["losses"]) == ["2", "3"]  # started after step 1's checkpoint
    assert all(resumed["losses"][s] == plain["losses"][s] for s in ("2", "3"))  # bit for bit


def test_two_d_script_resumes_exactly(job):
    plain, resumed = job["2d"], job["2d_resumed"]
    assert list(plain["losses"]) == STEPS
    assert list(resumed["losses"]) == ["2", "3"]
    assert all(resumed["losses"][s] == plain["losses"][s] for s in ("2", "3"))  # bit for bit


# The 2-D script on 4 ranks, where both dimensions are real: dp 2 (FSDP shards each TP
# slice over 2 ranks) x tp 2. Its own job: 4 processes.
PLAN_2D = {
    "2d_2x2": {"script": "2d", "flags": B + C + ["--dp", "2", "--tp", "2"]},
    "2d_2x2_resumed": {"script": "2d", "flags": R + ["--dp", "2", "--tp", "2"], "from": ["2d_2x2", 1]},
}
# The 3-D script on 4 ranks, one dimension at a time left at 1 (2 x 2 x 2 needs 8 ranks):
# pipelines of TP pairs, and pipelines of FSDP pairs. Another job: 3-D and 2-D meshes
# must not meet in one (common/multirun.py).
_PP_TP, _PP_FSDP = ["--pp", "2", "--dp", "1", "--tp", "2"], ["--pp", "2", "--dp", "2", "--tp", "1"]
PLAN_3D = {
    "3d_pp_tp": {"script": "3d", "flags": B + C + _PP_TP},
    "3d_pp_tp_resumed": {"script": "3d", "flags": R + _PP_TP, "from": ["3d_pp_tp", 1]},
    "3d_pp_fsdp": {"script": "3d", "flags": B + C + _PP_FSDP},
    "3d_pp_fsdp_resumed": {"script": "3d", "flags": R + _PP_FSDP, "from": ["3d_pp_fsdp", 1]},
}


@pytest.mark.parametrize("plan", [PLAN_2D, PLAN_3D], ids=["2d-2x2", "3d-pp2xtp2-and-pp2xdp2"])
def test_two_d_and_three_d_on_four_ranks_resume_exactly(tmp_path, plan):
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                        "tests/resume_driver.py", str(tmp_path), json.dumps(plan)],
                       cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    res = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in plan}
    for name, run in res.items():
        assert run["code"] == 0, f"{name}: {run['stderr']}"
    for name in [n for n in plan if "from" not in plan[n]]:
        plain, resumed = res[name], res[name + "_resumed"]
        assert list(plain["losses"]) == STEPS and list(resumed["losses"]) == ["2", "3"], name
        assert all(resumed["losses"][s] == plain["losses"][s] for s in ("2", "3")), name  # bit for bit


def test_pipeline_checkpoint_loads_into_another_stage_count(job):
    resumed, src = job["pp4_from_pp"], job["pp"]
    assert list(resumed["losses"]) == ["2", "3"]  # started after step 1's checkpoint
    for s in ("2", "3"):
        assert resumed["losses"][s] == pytest.approx(src["losses"][s], rel=1e-5), s
