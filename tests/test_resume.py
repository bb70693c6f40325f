"""Chapter "survive faults and scale out": exact resume, elastic restarts, resharding,
two nodes on one machine, and bad input, for DDP / ZeRO-1 / FSDP (gloo on CPU).

Two torchrun jobs do the distributed work (tests/resume_driver.py runs many scripts
in each); everything else runs in this process. Sizes: debug model, 32 tokens, global
batch 4, 6 steps, a checkpoint every 2 steps (after steps 1, 3, 5).
"""
import contextlib
import importlib.util
import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from common.checkpoint import Checkpointer, export, skip_nonfinite_step
from common.data import load_corpus
from common.distributed import distributed
from common.errors import UserError
from common.model import Transformer, get_config
from conftest import ROOT

B = ["--global-batch-size", "4", "--steps", "6", "--no-trace-memory"]
C = ["--ckpt-every", "2", "--ckpt-keep", "3"]
STEPS = [str(s) for s in range(6)]

# Job 1, two "nodes" x 2 ranks (two torchrun launches, one c10d rendezvous on localhost).
TWO_NODES = {
    "reference": {"script": "step1", "flags": B},  # single-process step 1, on every rank
    "ddp4": {"script": "ddp", "flags": B},
    "fsdp4": {"script": "fsdp", "flags": B + C},
    "zero1_4": {"script": "ddp", "flags": B + C + ["--zero1"]},
}
# Job 2, 2 ranks under torchrun --max-restarts 2: two runs crash once each.
R = B + C + ["--resume"]
ELASTIC = {
    "ddp": {"script": "ddp", "flags": B + C},
    "fsdp": {"script": "fsdp", "flags": B + C},
    "ddp_fault": {"script": "ddp", "flags": R + ["--fail-at-step", "4"]},
    "fsdp_fault": {"script": "fsdp", "flags": R + ["--fail-at-step", "4", "--fail-rank", "1"]},
    # another world size
    "fsdp_from_fsdp4": {"script": "fsdp", "flags": R, "from": ["fsdp4", 3]},
    "zero1_from_zero1_4": {"script": "ddp", "flags": R + ["--zero1"], "from": ["zero1_4", 3]},
    # another strategy
    "fsdp_from_ddp": {"script": "fsdp", "flags": R, "from": ["ddp", 3]},
    "ddp_from_fsdp": {"script": "ddp", "flags": R, "from": ["fsdp", 3]},
    "ddp_from_zero1_4": {"script": "ddp", "flags": R, "from": ["zero1_4", 3]},
    "offload_from_fsdp": {"script": "fsdp", "flags": R + ["--cpu-offload"], "from": ["fsdp", 3]},
    # data that is not UTF-8: bytes are tokens, nothing to decode
    "non_utf8": {"script": "ddp", "flags": B + ["--steps", "2", "--data", "NON_UTF8"]},
    # NaN: stop with the step and rank, or skip the update
    "nan_stop": {"script": "ddp", "flags": B + ["--lr", "1e6"]},
    "nan_skip": {"script": "ddp", "flags": B + ["--steps", "3", "--lr", "1e6", "--on-nan", "skip"]},
    # misuse: each one sentence, exit 2, the checkpoint left as it was
    "bad_accum": {"script": "ddp", "flags": R + ["--grad-accum-steps", "2"], "from": ["ddp", 3]},
    "bad_preset": {"script": "fsdp", "flags": R + ["--n-layers", "1"], "from": ["fsdp4", 3]},
    "bad_truncated": {"script": "fsdp", "flags": R, "from": ["fsdp4", 3], "damage": "truncate"},
    "bad_meta": {"script": "ddp", "flags": R, "from": ["ddp", 3], "damage": "meta"},
    "bad_finished": {"script": "fsdp", "flags": R + ["--steps", "4"], "from": ["fsdp", 3]},
}
ERRORS = {
    "nan_stop": "error: the loss is nan at step",
    "bad_accum": "was trained with --grad-accum-steps 1, this run asks for 2; use the same value",
    "bad_preset": "holds a 'debug' model with a different shape than --model debug",
    "bad_truncated": "step_00000003 cannot be read",
    "bad_meta": "meta.json cannot be read (UnicodeDecodeError)",
    "bad_finished": "is at step 3, the last of --steps 4 or past it: nothing is left to train",
}


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
    r = subprocess.run(["bash", "step4_multi_node/two_nodes_on_one_machine.sh", "tests/resume_driver.py",
                        str(folder), json.dumps(TWO_NODES)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=150)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    two_nodes = _results(folder, TWO_NODES)

    data = folder / "non_utf8.txt"
    data.write_bytes(bytes(range(256)) * 64 + "caf\u00e9 na\u00efve".encode("latin-1") * 500)
    plan = json.loads(json.dumps(ELASTIC).replace("NON_UTF8", str(data)))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "--max-restarts", "2", "tests/resume_driver.py", str(folder), json.dumps(plan)],
                       cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.count("crashing on purpose") == 2, r.stdout[-3000:]
    elastic = _results(folder, ELASTIC)
    for name, res in {**two_nodes, **elastic}.items():
        expected = 2 if name in ERRORS else 0
        assert res["code"] == expected, f"{name}: {res['stderr']}"
    return SimpleNamespace(folder=folder, two_nodes=two_nodes, elastic=elastic)


def _close(a: dict, b: dict, steps, rtol: float):
    for s in steps:
        assert a[s] == pytest.approx(b[s], rel=rtol), (s, a[s], b[s])


def test_two_nodes_on_one_machine_match_step1(jobs):
    """2 launches x 2 ranks = world 4 through c10d rendezvous; DDP's loss is step 1's."""
    ref = jobs.two_nodes["reference"]["losses"]
    assert list(ref) == STEPS
    for name in ("ddp4", "fsdp4", "zero1_4"):
        _close(jobs.two_nodes[name]["losses"], ref, STEPS, 1e-5)


def test_killed_and_restarted_runs_continue_exactly(jobs):
    """torchrun --max-restarts: rank 0 (DDP) / rank 1 (FSDP) dies after step 4; the job
    restarts, resumes from step 3's checkpoint, redoes step 4: every loss bit for bit."""
    e = jobs.elastic
    for faulty, plain in (("ddp_fault", "ddp"), ("fsdp_fault", "fsdp")):
        assert e[faulty]["restarted"] and e[faulty]["job_attempt"] >= 1  # it really died
        assert e[faulty]["losses"] == e[plain]["losses"]  # all six steps, no gap, no repeat
        assert e[faulty]["checkpoints"] == ["step_00000001", "step_00000003", "step_00000005"]


def test_checkpoints_reshard_across_world_sizes_and_strategies(jobs):
    e, four = jobs.elastic, jobs.two_nodes
    # FSDP 4 ranks -> 2 ranks, ZeRO-1 4 -> 2: the same global batch, so the same losses
    _close(e["fsdp_from_fsdp4"]["losses"], four["fsdp4"]["losses"], ["4", "5"], 1e-5)
    _close(e["zero1_from_zero1_4"]["losses"], four["zero1_4"]["losses"], ["4", "5"], 1e-5)
    assert list(e["fsdp_from_fsdp4"]["losses"]) == ["4", "5"]  # it started at step 4
    # DDP <-> FSDP, FSDP -> FSDP with CPU offload: one checkpoint format
    for name, src in (("fsdp_from_ddp", "ddp"), ("ddp_from_fsdp", "fsdp"), ("offload_from_fsdp", "fsdp")):
        _close(e[name]["losses"], e[src]["losses"], ["4", "5"], 1e-6)
    # ZeRO-1 on 4 ranks (each rank saved its quarter of AdamW's state) -> plain DDP on 2
    _close(e["ddp_from_zero1_4"]["losses"], four["zero1_4"]["losses"], ["4", "5"], 1e-5)


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
    for k, v in weights["ddp"].items():
        torch.testing.assert_close(weights["fsdp4"][k], v, rtol=1e-5, atol=1e-6)
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
    ("ddp", ["--grad-accum-steps", "0"], "--grad-accum-steps must be positive (got 0)."),
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
    (the real 2 -> 4 stage run is in tests/test_resume_mp.py)."""
    args = SimpleNamespace(out=tmp_path, model="debug", model_config=get_config("debug"), global_batch_size=4,
                           seq_len=32, seed=0, data="synthetic", grad_accum_steps=1, fail_at_step=None)
    ctx = SimpleNamespace(world_size=2, rank=0)
    ckpt = Checkpointer(args, ctx, [], parallel={"pp": 2, "stages": 2})
    meta = {"model": "debug", "model_config": get_config("debug").as_dict(), "global_batch_size": 4,
            "seq_len": 32, "seed": 0, "data": "synthetic", "grad_accum_steps": 1,
            "parallel": {"pp": 4, "stages": 4}}
    ckpt._check_compatible(tmp_path, meta)  # 4 stages -> 2: allowed
    meta["parallel"] = {"dp": 4}  # FSDP 4 -> 2 ranks: allowed
    Checkpointer(args, ctx, [], parallel={"dp": 2})._check_compatible(tmp_path, meta)
