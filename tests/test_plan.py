"""The step-time model's arithmetic on hand-computed cases, and the planner built on it
(common/measure/steptime.py, tools/plan.py). In-process, no launch: a few seconds.

The model against measured step times is tools/bench_plan.py's job (a benchmark, not a
timed test); against torchtitan's published runs, the ordering is held here.
"""
from __future__ import annotations

import math
import shlex

import pytest

from common.measure.flops import head_flops, layer_flops, layer_matmul_params
from common.measure.machines import Link, Machine
from common.measure.steptime import DDP_BUCKET_BYTES, collective_time, ring_factor, step_time
from common.measure.plan import Plan
from common import ROOT
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
    # the optimizer: clipping (12 bytes) and AdamW a tensor at a time (84: the foreach path's
    # kernels, one tensor each) over HBM, every matmul weight, norm and the embedding
    assert t["optimizer"] == pytest.approx(96 * count_params(cfg) / (100 * GB))
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
    from common.measure.machines import GPUS
    fit, dropped = evaluate(ps, GPUS["h100"], False, 4.0)
    why = {(d["plan"].strategy, d["plan"].ac): d["why"] for d in dropped if d["plan"].pp == 1 and d["plan"].tp == 1}
    assert why[("ddp", "none")].startswith("does not fit: peak 1")  # 16 bytes x 7B parameters, whole, > 100 GiB
    assert "> 75.65 GiB usable" in why[("ddp", "none")]
    assert fit and all(r["peak"] <= 75.65 * 2**30 for r in fit)
    assert [r["time"]["step"] for r in fit] == sorted(r["time"]["step"] for r in fit)
    # every kind of layout the scripts run is enumerated: HSDP with and without resharding after
    # forward, 3-D (pp x dp x tp) under every schedule train_3d.py takes
    from common.parallelize.pp import SCHEDULES
    assert {"hsdp", "hsdp_zero2"} <= {p.strategy for p in ps}
    assert {p.schedule for p in ps if p.strategy == "2d" and p.pp > 1 and p.dp > 1} == set(SCHEDULES)
    # every kind of layout's command names a real script and flags it accepts
    kinds = {}
    for p in ps:
        kinds.setdefault((p.strategy, p.pp > 1, p.sequence_parallel, p.schedule if p.pp > 1 else None), p)
    (z2,) = [p for p in kinds.values() if p.strategy == "hsdp_zero2"]
    assert {"--hsdp", "--no-reshard-after-forward"} <= set(shlex.split(command(z2, args, 4)))
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


# ---- the CPU's terms: ranks sharing cores, nothing overlapping, a rate per shape ---------------
def cpu_machine(flops=1e12, bw=10 * GB, latency=0.0, ranks=2, units=1, shape_rates=None) -> Machine:
    """toy_machine as a calibrated CPU: ``units`` cores for ``ranks`` ranks, gloo (no overlap)."""
    from dataclasses import replace
    return replace(toy_machine(flops, bw, latency, per_node=ranks), units_per_node=units, overlap=False,
                   shape_rates=shape_rates or {})


def test_processor_sharing_schedule_by_hand():
    """1F1B on 2 ranks, 2 micro-batches, forward 1, backward 2, on ONE unit, worked by hand:
    F(0,0) alone 0-1; F(0,1) and F(1,0) share the unit 1-3; B(1,0) alone 3-5; B(0,0) and F(1,1)
    share 5-7 (F(1,1) done, B(0,0) has 1 left); B(0,0) and B(1,1) share 7-9 (B(0,0) done,
    B(1,1) has 1 left); B(1,1) alone 9-10; B(0,1) alone 10-12. 12 = all the work on one unit:
    the bubble is free. With a unit each it is simulate_schedule's (m+p-1)(f+b) = 9."""
    from common.parallelize.pp import simulate_schedule, simulate_shared
    assert simulate_shared("1f1b", 2, 2, 1.0, 2.0, units=1) == pytest.approx(12.0)
    assert simulate_shared("1f1b", 2, 2, 1.0, 2.0, units=2) == pytest.approx(9.0)
    for p, m in ((2, 4), (4, 4), (4, 8)):
        free = simulate_schedule("1f1b", p, m)[1]
        assert simulate_shared("1f1b", p, m, units=p) == pytest.approx(free)
        shared = simulate_shared("1f1b", p, m, units=p / 2)
        assert 2 * m * 3 <= shared <= 2 * free  # at least the work over the units, at most twice the free step
    # 4 ranks, 4 micro-batches on 2 units: 27 (the work, 24, and 3 the sharing cannot fill)
    assert simulate_shared("1f1b", 4, 4, units=2) == pytest.approx(27.0)


def test_ranks_sharing_cores_by_hand():
    """2 ranks on 1 core: each rank's own work (compute, optimizer) takes twice as long while
    both work: "waiting for a core" = that work once more. 2 ranks on 2 cores: the GPU model."""
    cfg = get_config("small")
    p = Plan(cfg, "ddp", world=2, batch=4, seq_len=128, dtype="fp32")
    one, two = step_time(p, cpu_machine(units=1)), step_time(p, cpu_machine(units=2))
    assert two["waiting for a core"] == 0
    assert one["compute"] == two["compute"] and one["optimizer"] == two["optimizer"]
    assert one["waiting for a core"] == pytest.approx(one["compute"] + one["optimizer"])
    # on GPUs the unit is the GPU itself: never shared
    assert step_time(p, toy_machine(per_node=2))["waiting for a core"] == 0
    # a pipeline on shared cores: 1F1B, 2 stages, 2 micro-batches, 1 core: the step is the
    # schedule played on one unit (12 of 9 at f=1, b=2 above); bubble = that - the shared work
    pp = Plan(cfg, "pp", world=2, batch=4, seq_len=128, dtype="fp32", microbatches=2, schedule="1f1b")
    t = step_time(pp, cpu_machine(units=1))
    busy = t["compute"]
    assert t["waiting for a core"] == pytest.approx(busy + t["optimizer"])
    # f + b = busy / m = busy / 2, so the 12 above (4 (f + b)) is 2 busy = busy x 2 ranks / 1 core:
    # all of the bubble was filled by the other rank's work
    assert t["bubble"] == pytest.approx(0.0, abs=1e-12)
    free = step_time(pp, cpu_machine(units=2))
    assert free["bubble"] == pytest.approx(busy * 1 / 2)  # (p-1)/(m+p-1) = 1/3 idle: busy x 1/2


def test_gloo_hides_nothing_and_rates_per_shape():
    """gloo runs its collectives on the cores that compute: every collective is exposed whole
    (DDP's buckets included). A calibrated rate per shape (tp, sequences a micro-batch) replaces
    the single rate for the layouts that run that shape."""
    cfg = get_config("125m")
    p = Plan(cfg, "ddp", world=4, batch=4, seq_len=256, dtype="fp32")
    t = step_time(p, cpu_machine(flops=1e9, bw=10 * GB, latency=1e-4, ranks=4, units=4))
    (ar,) = [c for c in t["comm"] if c.name == "all_reduce"]
    assert ar.exposed == ar.time > 1.5 * DDP_BUCKET_BYTES / (10 * GB)  # a GPU would expose the last bucket only
    small = get_config("small")
    rates = {"fp32 tp=2 seqs=8": 5e11, "fp32 tp=1 seqs=4": 2.5e11}
    m = cpu_machine(ranks=2, units=2, shape_rates=rates)
    tp = step_time(Plan(small, "tp", world=2, batch=8, seq_len=64, dtype="fp32"), m)
    assert tp["rate"] == 5e11
    tokens = 8 * 64
    assert tp["compute"] == pytest.approx(tokens * (small.n_layers * layer_flops(small, 64) + head_flops(small))
                                          / 2 / 5e11)
    assert step_time(Plan(small, "ddp", world=2, batch=8, seq_len=64, dtype="fp32"), m)["rate"] == 2.5e11
    # the pipeline's micro-batch: 8 sequences over 2 micro-batches = 4 a micro-batch
    assert step_time(Plan(small, "pp", world=2, batch=8, seq_len=64, dtype="fp32", microbatches=2), m)["rate"] == 2.5e11
    # a shape nobody calibrated: the one rate
    assert step_time(Plan(small, "ddp", world=2, batch=16, seq_len=64, dtype="fp32"), m)["rate"] == 1e12


def test_zero1_broadcasts_as_one_all_gather():
    """ZeroRedundancyOptimizer broadcasts parameter by parameter from its owner, asynchronously,
    then waits for all: an all-gather's traffic, (n-1)/n x 4N into each rank, one latency."""
    cfg = get_config("small")
    m = toy_machine(bw=10 * GB, latency=1e-3)
    t = step_time(Plan(cfg, "zero1", world=4, batch=4, seq_len=128, dtype="fp32"), m)
    (bc,) = [c for c in t["comm"] if c.name == "broadcast"]
    n = count_params(cfg)
    assert bc.bytes == 4 * n
    assert bc.exposed == bc.time == pytest.approx(1e-3 + 0.75 * 4 * n / (10 * GB))
    # and ZeRO-1's AdamW updates a quarter of the parameters, while clipping reads and scales every gradient
    assert t["optimizer"] == pytest.approx((12 * n + 84 * n / 4) / (100 * GB))


def test_calibrated_optimizer_seconds_per_parameter():
    """A calibrated CPU times clipping + AdamW + zeroing: seconds a parameter x the parameters
    this rank updates (all under DDP), instead of bytes over memory; under ZeRO-1 the rank
    clips every gradient (12 of the 96 bytes) and updates 1/W of the parameters (84)."""
    from dataclasses import replace
    cfg = get_config("small")
    m = replace(cpu_machine(ranks=4, units=4), adamw_s_per_param=1e-8)
    n = count_params(cfg)
    ddp = step_time(Plan(cfg, "ddp", world=4, batch=4, seq_len=128, dtype="fp32"), m)
    zero1 = step_time(Plan(cfg, "zero1", world=4, batch=4, seq_len=128, dtype="fp32"), m)
    assert ddp["optimizer"] == pytest.approx(n * 1e-8)
    assert zero1["optimizer"] == pytest.approx((12 * n + 84 * n / 4) / 96 * 1e-8)


def test_dtensor_dispatch_by_hand():
    """A calibrated CPU's DTensor work under TP: seconds a block x the blocks x micro-batches;
    none without TP, none on a GPU description (0 there)."""
    from dataclasses import replace
    cfg = get_config("small")  # 4 layers
    m = replace(cpu_machine(ranks=4, units=4), dtensor_s_per_block=0.01)
    tp = step_time(Plan(cfg, "tp", world=4, batch=8, seq_len=64, dtype="fp32"), m)
    assert tp["DTensor dispatch"] == pytest.approx(4 * 0.01)
    two_d = step_time(Plan(cfg, "2d", world=4, tp=2, batch=8, seq_len=64, dtype="fp32", accum=2), m)
    assert two_d["DTensor dispatch"] == pytest.approx(4 * 0.01 * 2)  # two micro-batches a step
    assert step_time(Plan(cfg, "ddp", world=4, batch=8, seq_len=64, dtype="fp32"), m)["DTensor dispatch"] == 0
    assert step_time(Plan(cfg, "tp", world=4, batch=8, seq_len=64, dtype="fp32"), toy_machine())["DTensor dispatch"] == 0
    # on 4 ranks sharing 2 cores, it is the rank's own work too: shared like compute
    shared = step_time(Plan(cfg, "tp", world=4, batch=8, seq_len=64, dtype="fp32"), replace(m, units_per_node=2))
    assert shared["waiting for a core"] == pytest.approx(shared["compute"] + shared["optimizer"] + 0.04)


def test_other_processes_cores_by_hand():
    """The bench's load column: between two samples, (machine busy - ours) / wall time."""
    from common.measure.cpuload import OtherLoad
    load = OtherLoad.__new__(OtherLoad)  # no sampling thread: samples given by hand
    load.samples = [(0.0, 100.0, 10.0), (1.0, 101.5, 10.5), (2.0, 103.0, 11.0), (3.0, 103.0, 11.0)]
    assert load.cores(0.0, 2.0) == pytest.approx(((103 - 100) - (11 - 10)) / 2)  # 1 core the others'
    assert load.cores(2.0, 3.0) == 0.0          # nobody busy
    assert load.cores(0.5, 0.9) is None          # fewer than two samples: unknown


def test_one_gpu_plans_name_the_one_device_scripts(capsys):
    """--gpus 1 (the learner's one GPU, and tools/gpu_pass.py's prediction of one rank): the
    layouts are the one-device chapters' scripts, and their commands parse."""
    from tests.test_readme import parse_only, split
    from tools.plan import build_parser, command, layouts
    seen = set()
    for dtype in ("bf16", "fp32"):
        args = build_parser().parse_args(["--model", "1b", "--gpus", "1", "--global-batch-size", "4", "--dtype", dtype])
        for p in layouts(get_config("1b"), 1, 1, 4, 2048, dtype, "cuda", acs=("none", "selective", "full")):
            cmd = command(p, args, 1)
            seen.add(cmd.split()[1])
            _, target, argv = split(shlex.split(cmd))
            assert parse_only(target, argv) == 0, (cmd, capsys.readouterr().err)
            assert ("--amp bf16" in cmd) == (dtype == "bf16") and (f"--ac {p.ac}" in cmd) == (p.ac != "none")
    assert seen == {"step1_single_gpu/train.py", "step2_memory/train_amp.py", "step2_memory/train_amp_ac.py"}


def test_optimizer_bytes_follow_the_kernels():
    """Clipping (12 bytes a parameter) + AdamW: CUDA's default foreach kernels 84, --fused-adamw 28
    (tests/test_claims.py counts both on the real optimizer); a plan's kernels pick them."""
    from common.measure.steptime import ADAMW_BYTES, CLIP_BYTES, optimizer_bytes
    assert (CLIP_BYTES, ADAMW_BYTES["foreach"], ADAMW_BYTES["fused"]) == (12, 84, 28)
    assert optimizer_bytes("foreach") == 96 and optimizer_bytes("fused") == 40
    cfg = get_config("small")
    m = toy_machine()
    n = count_params(cfg)
    for kernels, b in (("foreach", 96), ("fused", 40)):
        t = step_time(Plan(cfg, "single", batch=4, seq_len=128, dtype="fp32", device="cuda", optimizer=kernels), m)
        assert t["optimizer"] == pytest.approx(b * n / (100 * GB)), kernels
    fsdp = step_time(Plan(cfg, "fsdp", world=4, batch=4, seq_len=128, device="cuda", optimizer="fused"), m)
    assert fsdp["optimizer"] == pytest.approx(40 * n / 4 / (100 * GB), rel=0.01)  # its shard (padded rows)


def test_one_flop_count_mfu_and_the_share_of_the_rate():
    """The model counts causal attention as run (half of flops_per_token's 12 x dim x seq), and
    the planner's MFU and "% of the rate assumed" count the same FLOPs: the latter is the share
    of the step spent at the matmul rate (it could pass 100% when it divided flops_per_token by
    a rate the model applies to fewer FLOPs)."""
    from common.measure.flops import model_flops_per_token
    from common.measure.machines import GPUS
    from common.model import flops_per_token
    cfg = get_config("1b")
    assert model_flops_per_token(cfg, 2048) == cfg.n_layers * layer_flops(cfg, 2048) + head_flops(cfg)
    assert flops_per_token(cfg, 2048) - model_flops_per_token(cfg, 2048) == 6 * cfg.n_layers * cfg.dim * 2048
    for p in (Plan(cfg, "single", batch=1, seq_len=2048, dtype="bf16", device="cuda"),
              Plan(cfg, "single", batch=4, seq_len=2048, dtype="bf16", device="cuda", ac="full"),
              Plan(get_config("8b"), "fsdp", world=8, batch=16, seq_len=8192, dtype="bf16", device="cuda", ac="full"),
              Plan(cfg, "single", batch=4, seq_len=2048, dtype="fp32", device="cuda")):
        t = step_time(p, GPUS["h100"])
        assert t["mfu_of_rate"] == pytest.approx(t["compute"] / t["step"]) and t["mfu_of_rate"] < 1
        assert t["mfu"] == pytest.approx(t["mfu_of_rate"] * t["rate"] / GPUS["h100"].peak_flops[p.dtype])


def test_per_op_sac_recomputes_every_second_matmul():
    """torchtitan's per-op selective AC (--ac selective-op) saves the 1st, 3rd, 5th and 7th matmul
    of a block (wq, wv, w1, w2) and recomputes wk, wo and w3: 2 (d kv + d^2 + d f) FLOPs a token
    and block, charged at the matmul rate, on top of memory-bound passes over what it drops."""
    from common.measure.flops import per_op_sac_flops, recompute_flops
    from common.measure.formulas import layer_activation_bytes
    cfg = get_config("8b")
    d, kv, f = cfg.dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_dim
    assert per_op_sac_flops(cfg) == recompute_flops(cfg, 8192, "selective-op") == 2 * (d * kv + d * d + d * f)
    m = toy_machine()
    p = Plan(cfg, "fsdp", world=8, batch=16, seq_len=8192, device="cuda", ac="selective")
    theirs = step_time(replace_ac(p, "selective-op"), m)
    tokens = 16 // 8 * 8192
    flops = tokens * cfg.n_layers * per_op_sac_flops(cfg) / 1e12  # the toy machine's rate

    def passes(ac):  # each dropped tensor written and read again, over the toy HBM
        dropped = layer_activation_bytes(cfg, tokens, "fp32", "none") - layer_activation_bytes(cfg, tokens, "fp32", ac)
        return cfg.n_layers * 2 * dropped / m.hbm

    assert step_time(p, m)["recompute"] == pytest.approx(passes("selective"))
    assert theirs["recompute"] == pytest.approx(flops + passes("selective-op"))
    assert theirs["compute"] == step_time(p, m)["compute"]
    # no recompute where nothing is checkpointed
    assert step_time(replace_ac(p, "none"), m)["recompute"] == 0


def replace_ac(p: Plan, ac: str) -> Plan:
    from dataclasses import replace
    return replace(p, ac=ac)


def test_the_tutorials_own_model_plans_with_its_own_length_and_ties_are_said(capsys):
    """--model small with no --seq-len plans at the model's 1024 (it once refused a 2048 nobody
    gave), as does the estimator; rows the model predicts alike say that they tie, and a CP
    ring's hops are named as a ring of cp ranks, not "over 2"."""
    from tools import estimate
    from tools.plan import build_parser, plan_text
    from tools.plan import main as plan_main

    args = build_parser().parse_args(["--model", "small", "--gpus", "4"])
    plan_main(["--model", "small", "--gpus", "4"])
    text = capsys.readouterr().out
    assert "global batch 4 x 1024 tokens" in text
    tie = next(line for line in text.splitlines() if " tie: " in line)
    first, last = map(int, tie.split()[1].split("-"))
    rows = {int(line.split("|")[1]): line.split("|")[4].strip() for line in text.splitlines()
            if line.startswith("| ") and line.split("|")[1].strip().isdigit()}
    assert last > first and len({rows[i] for i in range(first, last + 1)}) == 1  # the same step ms
    estimate.main(["--model", "small", "--world-size", "4", "--strategy", "fsdp"])
    assert "fits in" in capsys.readouterr().out
    args = build_parser().parse_args(["--model", "8b", "--gpus", "8", "--global-batch-size", "16", "--seq-len",
                                      "8192", "--vocab-size", "128256", "--top", "40"])
    text = plan_text(args)
    assert "send/recv (CP ring) around a ring of 8, each rank to its neighbour" in text
    assert "(CP ring) over " not in text


def test_the_achieved_fractions_are_the_h200_reports_and_give_its_steps_back():
    """machines.ACHIEVED is what figs/gpu_check_h200.json measured: for each of its 1b runs (eager
    bf16, compiled bf16, fp32), the fraction of the sheet that makes the model's step the measured
    one, counted with the FLOPs the model counts (causal attention halved), one count for every
    dtype; with them the model gives those steps back. fp32 reaches its own sheet at 1.7 times
    bf16's share: one fraction for both put fp32 at 1.7 times its time."""
    import json

    from common.measure.machines import ACHIEVED, GPUS
    from common.measure.steptime import fraction_from_step
    from common.model import flops_per_token
    report = json.loads((ROOT / "figs" / "gpu_check_h200.json").read_text())
    runs = {r["name"]: r for r in report["runs"]}
    h200 = GPUS["h200"]
    for name, dtype, compiled, key in [("1b_amp", "bf16", False, "eager"), ("1b_amp_compile", "bf16", True, "compiled"),
                                       ("1b_fp32", "fp32", False, "fp32 eager")]:
        plan = Plan(get_config("1b"), "single", batch=4, seq_len=2048, dtype=dtype, device="cuda")
        measured = runs[name]["step_time_s"]
        assert ACHIEVED[key] == pytest.approx(fraction_from_step(plan, measured, h200, compiled), abs=5e-4), name
        assert step_time(plan, h200, compiled)["step"] == pytest.approx(measured, rel=2e-3), name  # given back
        # the report's MFU column counts 12 x dim x seq for attention (not halved) over the whole
        # step, the optimizer's time included: its own number, which the fraction is not
        mfu = flops_per_token(get_config("1b"), 2048) * 4 * 2048 / measured / h200.peak_flops[dtype]
        assert mfu == pytest.approx(runs[name]["mfu"], rel=1e-3)
    assert ACHIEVED["fp32 compiled"] == ACHIEVED["fp32 eager"]  # no compiled fp32 step was measured
    assert ACHIEVED["fp32 eager"] > 1.5 * ACHIEVED["eager"]
    for gpu in ("h100", "a100", "torchtitan"):  # the same fractions, unmeasured there
        assert GPUS[gpu].achieved is ACHIEVED
