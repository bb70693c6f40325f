"""common/layouts.py: one build per layout. The estimator's fake-tensor trace builds each
layout with its script's own ``build`` (tools/estimate.py:fake_build); here each script's
``main`` builds it too, as a learner's run does (its own flags, parsed from the planner's
table, its own mesh, real tensors, a dry run of one rank), and the two models must be the
same: every parameter's name, global and local shape, dtype, mesh and placements, every
module's class (FSDP's and checkpointing's wrappers among them), and AdamW's groups. DDP's
wrapper is the one difference the estimator states (its Reducer cannot be faked)."""
import importlib
import sys

import pytest

from common import layouts
from common.measure.plan import Plan
from common.model import get_config
from tools import estimate

DEBUG = get_config("debug")


class Built(BaseException):
    """Raised by the stand-in for Run: the script's build is done (a BaseException, so that the
    script's own error handling, which reports Exceptions, lets it through)."""


def described(model, optimizer) -> dict:
    from torch.distributed.tensor import DTensor
    model = getattr(model, "module", model)  # DDP's wrapper (see the docstring)
    names = {id(q): n for n, q in model.named_parameters()}
    params = {}
    for name, q in model.named_parameters():
        local = q.to_local() if isinstance(q, DTensor) else q
        where = (q.device_mesh.mesh_dim_names, tuple(map(str, q.placements))) if isinstance(q, DTensor) else None
        params[name] = (tuple(q.shape), tuple(local.shape), str(q.dtype), q.requires_grad, where)
    inner = getattr(optimizer, "optim", optimizer)
    return {"parameters": params, "modules": {n: type(m).__name__ for n, m in model.named_modules()},
            "groups": [[names[id(q)] for q in g["params"]] for g in inner.param_groups],
            "optimizer": type(inner).__name__}


CASES = {
    "single": Plan(DEBUG, "single", batch=4, seq_len=64),
    "single-bf16-sac": Plan(DEBUG, "single", batch=4, seq_len=64, dtype="bf16", ac="selective"),
    "ddp-chunks": Plan(DEBUG, "ddp", world=2, batch=4, seq_len=64, dtype="bf16", ac="full", loss_chunks=2),
    "fsdp": Plan(DEBUG, "fsdp_zero3", world=2, batch=4, seq_len=64, dtype="bf16"),
    "fsdp-zero2-split-root": Plan(DEBUG, "fsdp_zero2", world=2, batch=4, seq_len=64, split_root=True,
                                  ac="selective-op"),
    "hsdp": Plan(DEBUG, "hsdp", world=4, shard=2, batch=4, seq_len=64, dtype="bf16"),
    "tp-sp": Plan(DEBUG, "tp", world=2, batch=4, seq_len=64, dtype="bf16", sequence_parallel=True, ac="full"),
    "2d": Plan(DEBUG, "2d", world=4, tp=2, batch=4, seq_len=64, dtype="bf16", ac="full"),
    "pp-last": Plan(DEBUG, "pp", world=2, batch=4, seq_len=64, dtype="bf16", ac="selective", microbatches=2),
    "cp": Plan(DEBUG, "cp", world=2, batch=4, seq_len=64, dtype="bf16", ac="full"),
    "cp-fsdp": Plan(DEBUG, "cp_fsdp", world=2, batch=4, seq_len=64, dtype="bf16"),
}


def script_built(p: Plan, rank: int, tmp_path, monkeypatch) -> dict:
    """What the layout's script builds when a learner runs it (rank ``rank`` of a dry run)."""
    script = layouts.script_of(p)
    module = importlib.import_module(script.removesuffix(".py").replace("/", "."))
    got = {}

    def stand_in_for_run(args, ctx, model, optimizer, *rest, **kwargs):
        got["built"] = described(model[0] if isinstance(model, list) else model, optimizer)
        raise Built

    monkeypatch.setattr(module, "Run", stand_in_for_run)
    argv = [*layouts.model_flags(p.cfg), *layouts.layout_flags(p), "--device", "cpu", "--data", "synthetic",
            "--steps", "1", "--eval-batches", "0", "--no-trace-memory", "--out", str(tmp_path)]
    if p.world > 1:
        argv += ["--fake-world-size", str(p.world), "--fake-rank", str(rank)]
    monkeypatch.setattr(sys, "argv", [script, *argv])
    with pytest.raises(Built):
        module.main()
    return got["built"]


@pytest.mark.parametrize("name", CASES)
def test_the_estimator_builds_each_layout_with_its_scripts_build(name, tmp_path, monkeypatch):
    p = CASES[name]
    rank = p.pp - 1 if p.pp > 1 else 0  # a pipeline's last stage: the head and the loss
    with estimate.fake_build(p, rank) as (model, optimizer, rank):
        traced = described(model, optimizer)
    real = script_built(p, rank, tmp_path, monkeypatch)
    assert traced == real
    # what the comparison rests on: the layouts really are sharded, wrapped and checkpointed
    kinds = real["modules"]
    if p.strategy.startswith(("fsdp", "hsdp")) or p.strategy in ("2d", "cp_fsdp"):
        assert kinds[""].startswith("FSDP"), kinds[""]
    if p.ac != "none":
        assert any("Checkpoint" in m for m in kinds.values()), kinds
    placed = [w for *_, w in real["parameters"].values() if w]
    assert bool(placed) == (p.strategy not in ("single", "ddp", "pp", "cp")), placed


def test_the_table_names_each_strategys_script(tmp_path):
    """Every strategy the planner and the estimator name has a script, and the commands they
    print pass that script's own parser."""
    from common.measure.plan import STRATEGIES
    for s in STRATEGIES:
        p = Plan(DEBUG, s, world=1 if s == "single" else 2, batch=4, seq_len=64)
        script = layouts.script_of(p)
        module = importlib.import_module(script.removesuffix(".py").replace("/", "."))
        assert hasattr(module, "main"), script
        if hasattr(module, "parse"):
            args = module.parse([*layouts.model_flags(DEBUG), *layouts.layout_flags(p), "--data", "synthetic",
                                 "--device", "cpu", "--out", str(tmp_path / s)])
            assert args.global_batch_size == 4 and args.seq_len == 64
    assert layouts.script_of(Plan(DEBUG, "2d", world=4, tp=2, pp=2)) == "step3_multi_gpu/train_3d.py"
    plain = Plan(DEBUG, "tp", world=2, batch=4, seq_len=64, loss_parallel=False)  # the plan's loss reaches the script
    assert not layouts.build_args(plain, [*layouts.model_flags(DEBUG), "--data", "synthetic",
                                                        "--out", str(tmp_path / "plain")]).loss_parallel
    with pytest.raises(ValueError, match="no traced build for zero1"):
        layouts.build_module(Plan(DEBUG, "zero1", world=2))
