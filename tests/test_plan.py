"""The step-time model's arithmetic on hand-computed cases, and the planner built on it
(common/measure/steptime.py, tools/plan.py). In-process, no launch: a few seconds.

The model against measured step times is tools/bench_plan.py's job (a benchmark, not a
timed test); against torchtitan's published runs, the ordering is held here.
"""
from __future__ import annotations

import math
import shlex

import pytest

from common.measure.steptime import (DDP_BUCKET_BYTES, Link, Machine, collective_time, head_flops, layer_flops,
                                     layer_matmul_params, ring_factor, step_time)
from common.measure.theory import Plan
from common.model import count_params, get_config

GB = 1e9


def toy_machine(flops=1e12, bw=10 * GB, latency=0.0, per_node=8, inter=None) -> Machine:
    """Round numbers: every time below can be worked out by hand."""
    return Machine("toy", {"fp32": flops, "bf16": flops}, {"eager": 1.0, "compiled": 1.0}, 100 * GB, 80.0,
                   Link(bw, latency), inter or Link(bw / 10, latency), gpus_per_node=per_node)


def test_ring_factors_and_links():
    assert ring_factor("all_reduce", 4) == 1.5 and ring_factor("all_gather", 4) == 0.75
    assert ring_factor("reduce_scatter", 8) == 7 / 8 and ring_factor("send", 2) == 1.0
    assert collective_time("all_reduce", 4 * GB, 4, Link(10 * GB, 1e-3), calls=3) == pytest.approx(0.003 + 0.6)
    m = toy_machine(bw=100 * GB, inter=Link(5 * GB, 0))
    assert m.link(8, 1)[0].bandwidth == 100 * GB                 # a node's 8 ranks: NVLink
    assert m.link(16, 1)[0].bandwidth == 40 * GB                 # 8 a node, one NIC each: 8 x 5
    assert m.link(4, 8)[0].bandwidth == 5 * GB                   # one rank a node: one NIC


def test_compute_and_recompute_by_hand():
    cfg = get_config("small")
    m = toy_machine()
    p = Plan(cfg, "single", batch=4, seq_len=128, dtype="fp32")
    d, kv, f = cfg.dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_dim
    assert layer_matmul_params(cfg) == 2 * d * d + 2 * d * kv + 3 * d * f
    tokens = 4 * 128
    flops = tokens * (cfg.n_layers * (6 * layer_matmul_params(cfg) + 6 * d * 128) + 6 * cfg.vocab_size * d)
    t = step_time(p, m)
    assert t["compute"] == pytest.approx(flops / 1e12)
    assert t["exposed communication"] == 0 and t["bubble"] == 0
    # the optimizer: 32 bytes a parameter over HBM (every matmul weight, norm and the embedding)
    assert t["optimizer"] == pytest.approx(32 * count_params(cfg) / (100 * GB))
    # full AC: every block's forward again, a third of its compute
    full = step_time(Plan(cfg, "single", batch=4, seq_len=128, dtype="fp32", ac="full"), m)
    assert full["recompute"] == pytest.approx(tokens * cfg.n_layers * layer_flops(cfg, 128) / 3 / 1e12)
    assert full["compute"] == t["compute"]
    # selective AC recomputes no matmul: only memory-bound passes, far cheaper than full
    sel = step_time(Plan(cfg, "single", batch=4, seq_len=128, dtype="fp32", ac="selective"), m)
    assert 0 < sel["recompute"] < full["recompute"]
    assert head_flops(cfg) == 6 * cfg.vocab_size * d


def test_ddp_exposes_its_last_bucket():
    """Backward is long enough to hide every bucket but the last: exposed = the last bucket's
    all-reduce (25 MiB here, the 125m model's gradients being 480 MB)."""
    cfg = get_config("125m")
    m = toy_machine(flops=1e9, bw=10 * GB, latency=1e-4)  # slow matmuls: a backward of many seconds
    t = step_time(Plan(cfg, "ddp", world=4, batch=4, seq_len=256, dtype="fp32"), m)
    (ar,) = [c for c in t["comm"] if c.name == "all_reduce"]
    assert ar.bytes == 4 * count_params(cfg)
    assert ar.time == pytest.approx(math.ceil(ar.bytes / DDP_BUCKET_BYTES) * 1e-4 + 1.5 * ar.bytes / (10 * GB))
    assert ar.exposed == pytest.approx(1e-4 + 1.5 * DDP_BUCKET_BYTES / (10 * GB))
    # a fast backward cannot hide it: what does not fit is exposed too
    fast = step_time(Plan(cfg, "ddp", world=4, batch=4, seq_len=256, dtype="fp32"), toy_machine(flops=1e15, bw=1 * GB))
    (ar,) = [c for c in fast["comm"] if c.name == "all_reduce"]
    backward = 2 * fast["compute"] / 3
    assert ar.exposed == pytest.approx(ar.time - backward)


def test_pipeline_bubble_and_tp_on_the_critical_path():
    cfg = get_config("small", n_layers=8)
    m = toy_machine()
    t = step_time(Plan(cfg, "pp", world=4, batch=8, seq_len=64, dtype="fp32", microbatches=4, schedule="1f1b"), m)
    # 1F1B: idle (p-1)/(m+p-1) = 3/7 of the step, so 3/4 of the busy time
    assert t["bubble"] == pytest.approx((t["compute"] + t["recompute"]) * 3 / 4)
    more = step_time(Plan(cfg, "pp", world=4, batch=16, seq_len=64, dtype="fp32", microbatches=16), m)
    assert more["bubble"] / more["compute"] == pytest.approx(3 / 16)
    tp = step_time(Plan(cfg, "tp", world=2, batch=8, seq_len=64, dtype="fp32"), m)
    assert [c.name for c in tp["comm"]] == ["all_reduce"]
    assert tp["comm"][0].exposed == tp["comm"][0].time > 0  # nothing hides TP's all-reduces
    # expert parallelism: 4 k T rows of dim a layer (dispatch, combine, both ways back), all exposed
    moe = get_config("small-moe")
    ep = step_time(Plan(moe, "ep", world=4, batch=8, seq_len=64, dtype="fp32"), m)
    (a2a,) = [c for c in ep["comm"] if c.name == "all_to_all"]
    assert a2a.bytes == moe.n_layers * 4 * moe.top_k * (8 // 4 * 64) * moe.dim * 4
    assert a2a.exposed == a2a.time == pytest.approx(0.75 * a2a.bytes / (10 * GB))


def test_planner_drops_what_does_not_fit_and_its_commands_parse(capsys):
    from tests.test_readme import parse_only, split
    from tools.plan import build_parser, command, evaluate, layouts, plan_text
    args = build_parser().parse_args(["--model", "8b", "--gpus", "8", "--global-batch-size", "16",
                                      "--seq-len", "4096", "--ac", "full", "--top", "2"])
    cfg = get_config("8b")
    ps = layouts(cfg, 8, 4, 16, 4096, "bf16", "cuda", acs=("none", "full"))
    from common.measure.steptime import GPUS
    fit, dropped = evaluate(ps, GPUS["h100"], False, 4.0)
    why = {(d["plan"].strategy, d["plan"].ac): d["why"] for d in dropped if d["plan"].pp == 1 and d["plan"].tp == 1}
    assert why[("ddp", "none")].startswith("does not fit: peak 1")  # 16 bytes x 7B parameters, whole, > 100 GiB
    assert "> 75.65 GiB usable" in why[("ddp", "none")]
    assert fit and all(r["peak"] <= 75.65 * 2**30 for r in fit)
    assert [r["time"]["step"] for r in fit] == sorted(r["time"]["step"] for r in fit)
    # every kind of layout's command names a real script and flags it accepts
    kinds = {}
    for p in ps:
        kinds.setdefault((p.strategy, p.pp > 1, p.sequence_parallel), p)
    for p in kinds.values():
        cmd = shlex.split(command(p, args, 4))
        _, target, argv = split(cmd)
        assert parse_only(target, argv) == 0, (" ".join(cmd), capsys.readouterr().err)
    text = plan_text(args)
    assert "step3_multi_gpu/train_" in text and "dropped (" in text


def test_torchtitan_ordering():
    """torchtitan's published Llama 3.1 8B runs: 128 GPUs hold less per GPU than 8, and
    tokens/s falls as CP grows (the shape of their table); the eager FSDP rows within 20%."""
    from tools.docs import block
    from tools.plan import torchtitan_rows, torchtitan_text
    computed = torchtitan_rows()
    assert block("plan-torchtitan")[1].strip() == torchtitan_text(computed), \
        "will_it_fit.md's torchtitan table is stale: run python -m tools.figures --only plan"
    rows = {r["what"]: r for r in computed}
    eight, many = rows["Table 1: FSDP, eager"], rows["Table 3: FSDP, eager"]
    assert many["our_gib"] < eight["our_gib"]
    for r in (eight, many):
        assert abs(r["ours"] / r["theirs"] - 1) < 0.2, r["what"]
    cp = [r["ours"] for w, r in rows.items() if w.startswith("Table 2")]
    assert len(cp) == 4 and cp == sorted(cp, reverse=True)
