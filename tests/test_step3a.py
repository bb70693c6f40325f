"""Step 3a: DDP, ZeRO-1, FSDP (ZeRO-2/3) and HSDP against step 1 and against the formulas.

One torchrun job per world size (2, 3, 4 ranks, gloo on CPU) runs the single-process
reference and every strategy's real script in turn (tests/drivers/dp.py); the tests below
assert on what it wrote. Sizes are tiny: the debug model, 32 tokens, 4 steps.
"""
import json
import subprocess
import sys

import pytest

from common import ROOT  # noqa: E402
sys.path.insert(0, str(ROOT))

import launch  # noqa: E402

from common.measure.formulas import comm_bytes, model_state, unsharded_bytes  # noqa: E402
from common.measure.splits import padded_shard_numel, param_shapes  # noqa: E402
from common.model import count_params, get_config  # noqa: E402
from tests.tolerances import (PARITY_RTOL, TIGHT_RTOL, check_allocator, check_bf16_parity, check_dry_run,  # noqa: E402
                              check_optimizer_path)

CFG = get_config("debug")
N = count_params(CFG)
T = len(param_shapes(CFG))
FP32_RUNS = ("ddp", "ddp_accum", "zero1", "fsdp_zero3", "fsdp_zero2", "fsdp_accum", "hsdp", "hsdp_2x1", "hsdp_zero2",
             "ddp_ac", "fsdp_ac", "ddp_compile", "fsdp_compile", "fsdp_savers", "ddp_savers", "fsdp_offload")
BYTE_RUNS = FP32_RUNS[:9]  # the runs whose bytes the formulas are held to
SHARD = {"hsdp": 2, "hsdp_2x1": 1, "hsdp_zero2": 2}  # HSDP's shard group


def _plan(batch: int, *runs: str) -> dict:
    b = ["--global-batch-size", str(batch)]
    fp32 = b + ["--amp", "off"]  # step 3 computes in bf16 by default; parity to 1e-5 is an fp32 claim
    curve = ["--eval-every", "2", "--eval-batches", "2"]  # the validation loss after steps 1 and 3
    known = {
        "reference": ["step1", b + ["--no-trace-memory"] + curve],
        "reference_bf16": ["step2_amp", b + ["--no-trace-memory"]],  # one device, autocast bf16
        "ddp": ["ddp", fp32 + curve],
        "ddp_accum": ["ddp", fp32 + ["--grad-accum", "2", "--no-trace-memory"]],
        "zero1": ["ddp", fp32 + ["--zero1"]],
        "fsdp_zero3": ["fsdp", fp32 + curve],
        "fsdp_zero2": ["fsdp", fp32 + ["--no-reshard-after-forward"]],
        "fsdp_accum": ["fsdp", fp32 + ["--grad-accum", "2", "--no-trace-memory"]],
        "fsdp_offload": ["fsdp", fp32 + ["--cpu-offload"]],  # CPUOffloadPolicy, the host being the device
        "hsdp": ["fsdp", fp32 + ["--hsdp", "2", "2"]],
        "hsdp_2x1": ["fsdp", fp32 + ["--hsdp", "2", "1"]],
        "hsdp_zero2": ["fsdp", fp32 + ["--hsdp", "2", "2", "--no-reshard-after-forward"]],
        # activation checkpointing recomputes the same fp32 ops: the losses of AC off
        "ddp_ac": ["ddp", fp32 + ["--ac", "full", "--no-trace-memory"]],
        "fsdp_ac": ["fsdp", fp32 + ["--ac", "selective", "--no-trace-memory"]],
        # the savers of a 128K vocabulary: the same losses, gradient norms and weights
        "fsdp_savers": ["fsdp", fp32 + ["--loss-chunks", "3", "--split-root-unit", "--ac", "selective-op",
                                        "--no-trace-memory"]],
        "ddp_savers": ["ddp", fp32 + ["--loss-chunks", "5", "--ac", "selective-op", "--no-trace-memory"]],
        # torch.compile (inductor's C++ on CPU) against eager; fused AdamW along
        "ddp_compile": ["ddp", fp32 + ["--compile", "--fused-adamw", "--no-trace-memory"]],
        "fsdp_compile": ["fsdp", fp32 + ["--compile", "--no-trace-memory"]],
        # --profile: the profiler over the untraced, uncounted steps (here step 1)
        "ddp_profile": ["ddp", fp32 + ["--profile"]],
        "fsdp_profile": ["fsdp", fp32 + ["--profile"]],
        # the defaults: bf16 (autocast for DDP and ZeRO-1, FSDP's mixed-precision policy)
        "ddp_bf16": ["ddp", b + ["--no-trace-memory"]],
        "zero1_bf16": ["ddp", b + ["--zero1", "--no-trace-memory"]],
        "fsdp_bf16": ["fsdp", b + ["--ac", "full", "--no-trace-memory"]],
        # train_fsdp.py's old names for --amp bf16 and --ac full
        "bf16_ac": ["fsdp", b + ["--mixed-precision", "--activation-checkpointing"]],
        # host syncs counted per step (test_ddp_asks_the_device_for_nothing_in_a_steady_step)
        "ddp_syncs": ["ddp", fp32 + ["--no-trace-memory", "--steps", "6"]],
        "bad_batch": ["ddp", ["--global-batch-size", str(batch + 2)]],
        "bad_accum": ["fsdp", b + ["--grad-accum-steps", "2"]],
        "bad_hsdp": ["fsdp", b + ["--hsdp", "3", "3"]],
    }
    return {"reference": known["reference"], **{r: known[r] for r in runs}}


PLANS = {
    2: _plan(4, "ddp", "ddp_accum", "zero1", "fsdp_zero3", "fsdp_zero2", "fsdp_accum", "hsdp_2x1", "ddp_ac", "fsdp_ac",
             "ddp_compile", "fsdp_compile", "reference_bf16", "ddp_bf16", "fsdp_bf16", "ddp_profile", "fsdp_profile",
             "ddp_syncs", "fsdp_savers", "ddp_savers", "fsdp_offload"),
    3: _plan(6, "ddp", "fsdp_zero3"),
    4: _plan(4, "ddp", "zero1", "fsdp_zero3", "fsdp_zero2", "hsdp", "hsdp_zero2", "bf16_ac", "reference_bf16", "ddp_bf16",
             "zero1_bf16", "fsdp_bf16", "bad_batch", "bad_accum", "bad_hsdp"),
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    """The 2-, 3- and 4-rank jobs, started together (much of a job is waiting: start-up,
    rendezvous, ranks waiting on each other) and collected as the tests ask for them."""
    procs = {}
    for world in sorted(PLANS):
        out = tmp_path_factory.mktemp(f"dp{world}") / "results.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
               "tests/drivers/dp.py", str(out), json.dumps(PLANS[world])]
        procs[world] = (launch.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
                        out)
    yield procs
    for proc, _ in procs.values():
        proc.kill()


def _launch(world: int, launched: dict) -> dict:
    proc, out = launched[world]
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the {world}-rank job did not finish in 240 s (a hang?)")
    assert proc.returncode == 0, stdout[-2000:] + stderr[-4000:]
    results = json.loads(out.read_text())
    for name, entry in results.items():
        if isinstance(entry, dict) and not name.startswith("bad_"):
            assert entry["code"] == 0, f"{name}: {entry['stderr']}"
    return results


@pytest.fixture(scope="module")
def job2(launched):
    return _launch(2, launched)


@pytest.fixture(scope="module")
def job3(launched):
    return _launch(3, launched)


@pytest.fixture(scope="module")
def job4(launched):
    return _launch(4, launched)


@pytest.fixture(params=sorted(PLANS), ids=lambda w: f"{w}ranks")
def job(request):
    """Each world size's results (one torchrun job each, shared by the tests)."""
    return request.getfixturevalue(f"job{request.param}")


def _runs(job, names=FP32_RUNS):
    return [(name, job[name]) for name in names if name in job]


def test_fsdp_meta_init_gives_step1_weights_bitwise(job):
    assert job["fsdp_init_bitwise"]


@pytest.mark.parametrize("cpu_offload", [True, False])
def test_cpu_offload_materialises_the_shards_on_the_host_and_the_buffers_on_the_device(cpu_offload):
    """train_fsdp.py --cpu-offload on a GPU: FSDP2 refuses shards materialised anywhere but
    the host, and the forward reads the RoPE tables (buffers, never offloaded) on the GPU.
    The meta device stands in for the GPU here: any device that is not the host."""
    import torch

    from common.model import Transformer
    from common.parallelize.fsdp import materialize
    with torch.device("meta"):
        model = Transformer(CFG)
    materialize(model, torch.device("meta"), cpu_offload=cpu_offload)
    shards = "cpu" if cpu_offload else "meta"
    assert {p.device.type for p in model.parameters()} == {shards}
    assert {name: b.device.type for name, b in model.named_buffers()} == {"rope_cos": "meta", "rope_sin": "meta"}


def test_cpu_offload_moves_the_formulas_sharded_state_to_the_host_and_the_trace_agrees(job2):
    """--cpu-offload on gloo, where the host is the device: the trace holds what the plain ZeRO-3
    run's does (the model state before the optimizer step and every category's peak but
    "other", byte for byte: when gloo's asynchronous collectives drop their buffers depends on
    the threads, so the total peak may move by those), and the tracer tells apart the storages
    FSDP would keep on the host (the parameter shards, their gradients, AdamW's state). The
    formula's split is held to that: the host's 16N/W exactly, the device's model state 0 at
    the optimizer step, the device's parameters the gathered units alone, and its peak (the
    end of forward, before any gradient) the run's less the host's parameters and AdamW state,
    in both."""
    w = job2["world"]
    gathered = unsharded_bytes(CFG, w)
    for rank in range(w):
        run, plain = job2["fsdp_offload"]["summary"], job2["fsdp_zero3"]["summary"]
        row, mem, plain_mem = run["predicted"]["per_rank"][rank], run["memory"][rank], plain["memory"][rank]
        assert mem["before_optimizer"] == plain_mem["before_optimizer"]
        same = lambda m: {c: b for c, b in m["peak_by_category"].items() if c != "other"}  # noqa: E731
        assert same(mem) == same(plain_mem)
        want = model_state("fsdp_zero3", CFG, w, rank)
        assert row["host"] == row["measured host"] == want
        assert all(row[c] == row[f"measured {c}"] == 0 for c in want)
        device = row["measured device peak_by_category"]
        assert gathered["root"] + gathered["block"] <= device["parameters"] <= gathered["root"] + 2 * gathered["block"]
        assert device["optimizer state"] == 0
        host_at_peak = want["parameters"] + want["optimizer state"]
        assert row["peak_at"] == plain["predicted"]["per_rank"][rank]["peak_at"] == "start of backward"
        assert row["peak"] == plain["predicted"]["per_rank"][rank]["peak"] - host_at_peak
        assert row["measured peak"] == mem["peak_bytes"] - host_at_peak


def test_every_strategy_matches_the_single_process_run(job):
    ref = job["reference"]["losses"]
    assert len(ref) == 4
    ref_norms = job["reference"]["grad_norms"]
    assert min(ref_norms) > 0.5, "every step must clip (--max-norm 0.5) for the norms to be tested"
    for name, run in _runs(job):
        assert run["losses"] == pytest.approx(ref, rel=PARITY_RTOL, abs=0), name
        # the global norm, from shards (FSDP, HSDP) or all-reduced copies (DDP, ZeRO-1)
        assert run["grad_norms"] == pytest.approx(ref_norms, rel=PARITY_RTOL, abs=0), name
        # AdamW normalises every update, so fp32 rounding in a near-zero gradient can move
        # a weight by up to ~lr; all else agrees to ~1e-7.
        assert run["weights"]["max_abs"] < 1e-5, (name, run["weights"])
        assert run["summary"]["world_size"] == job["world"]
        check_optimizer_path(run["summary"], PLANS[job["world"]][name][1])  # CUDA's kernels


def test_the_validation_curve_is_the_single_process_one(job):
    """--eval-every 2: the held-out loss after steps 1 and 3, measured by every rank on the
    same held-out batches whatever the split, the one process's to fp32 parity; the last
    one is the run's val_loss. The same runs' bytes and memory (tests above) show that
    evaluating between steps leaves the traced and counted steps as they were (FSDP's root,
    left gathered by a forward without backward, is sharded again)."""
    ref = job["reference"]["val_losses"]
    assert sorted(ref) == ["1", "3"] and ref["3"] == job["reference"]["summary"]["val_loss"]
    for name in ("ddp", "fsdp_zero3"):
        got = job[name]["val_losses"]
        assert sorted(got) == ["1", "3"], name
        assert [got[s] for s in ("1", "3")] == pytest.approx([ref[s] for s in ("1", "3")], rel=1e-5, abs=0), name
        assert job[name]["summary"]["val_loss"] == got["3"], name


def test_every_traced_rank_agrees_with_the_cpu_allocator(job):
    """The trace held to the CPU allocator's own count on every rank of every traced run
    (DDP, ZeRO-1, FSDP as ZeRO-2 and ZeRO-3, HSDP, bf16 with AC): the peaks within 1% of what
    the trace could see (bf16 + AC's peak falls inside a backward bf16 matmul, whose workspace
    no op returns: tolerances.check_allocator). gloo's all-gather stages the gathered output in
    a buffer of its own, counted apart: one FSDP unit's gathered bytes."""
    mems = {name: run["summary"]["memory"] for name, run in job.items()
            if isinstance(run, dict) and (run.get("summary") or {}).get("memory")}
    assert mems
    for name, ranks in mems.items():
        for m in ranks:
            check_allocator(m, (name, m["rank"]))
    gathered = max(unsharded_bytes(CFG, job["world"]).values())
    for name, run in _runs(job, ["fsdp_zero3", "fsdp_zero2"]):
        assert [m["allocator_collective_bytes"] for m in run["summary"]["memory"]] == [gathered] * job["world"], name


def test_the_trace_has_every_rank(job):
    assert job["ddp"]["figure"], "the per-rank memory figure"
    assert [m["rank"] for m in job["ddp"]["summary"]["memory"]] == list(range(job["world"]))


def _state(run, rank):
    return run["summary"]["memory"][rank]["before_optimizer"]


def test_model_state_per_rank_is_the_formula(job):
    w = job["world"]
    for name, run in _runs(job, ["ddp", "fsdp_zero3", "fsdp_zero2", "hsdp", "hsdp_zero2"]):
        shard = SHARD.get(name, w)
        strategy = {"hsdp": "hsdp_zero3"}.get(name, name)
        assert len(run["summary"]["memory"]) == w, "every rank's trace"
        for rank in range(w):
            want = model_state(strategy, CFG, w, rank, shard=shard)
            assert {k: _state(run, rank)[k] for k in want} == want, (name, rank)
    # DDP: 16 bytes per parameter on every rank, + 4 per parameter tensor (AdamW's step)
    assert sum(_state(job["ddp"], 0)[c] for c in ("parameters", "gradients", "optimizer state")) == 16 * N + 4 * T


@pytest.mark.parametrize("world", [2, 4])
def test_zero1_shards_only_the_optimizer_state(world, request):
    job = request.getfixturevalue(f"job{world}")
    w = job["world"]
    states = [_state(job["zero1"], r) for r in range(w)]
    assert all(s["parameters"] == 4 * N and s["gradients"] == 4 * N for s in states)
    # ZeroRedundancyOptimizer gives whole tensors to ranks: the split is near, not exactly, even
    assert sum(s["optimizer state"] for s in states) == 8 * N + 4 * T
    for s in states:
        assert s["optimizer state"] == pytest.approx((8 * N + 4 * T) / w, rel=0.02)


def test_fsdp_gathers_one_or_two_blocks_at_a_time(job):
    """ZeRO-3 holds the root and at most two blocks gathered; ZeRO-2 holds everything."""
    w = job["world"]
    gathered = unsharded_bytes(CFG, w)
    full = 4 * sum(padded_shard_numel(s, w) * w for s in param_shapes(CFG).values())
    for rank in range(w):
        sharded = _state(job["fsdp_zero3"], rank)["parameters"]
        extra = job["fsdp_zero3"]["summary"]["memory"][rank]["peak_by_category"]["parameters"] - sharded
        assert gathered["root"] + gathered["block"] <= extra <= gathered["root"] + 2 * gathered["block"]
        if "fsdp_zero2" in job:
            peak = job["fsdp_zero2"]["summary"]["memory"][rank]["peak_by_category"]["parameters"]
            assert peak == _state(job["fsdp_zero2"], rank)["parameters"] + full


def test_bytes_communicated_per_step_are_the_formula(job):
    w = job["world"]
    for name, run in _runs(job, BYTE_RUNS):
        strategy = {"ddp_accum": "ddp", "fsdp_accum": "fsdp_zero3"}.get(name, name)
        strategy = {"hsdp": "hsdp_zero3", "hsdp_2x1": "hsdp_zero3"}.get(name, strategy)
        want = comm_bytes(strategy, CFG, w, shard=SHARD.get(name),
                          accum=2 if name == "fsdp_accum" else 1)
        for rank, got in enumerate(run["summary"]["comm"]):
            # The bytes of the traced step, step 2: after DDP's one-time bucket rebuild in
            # step 1 (a broadcast of the new order), so exactly the formula's.
            got = {k: v["bytes"] for k, v in got.items()}
            # The clipping's all-reduce: PyTorch reduces one fp32 norm per sharded tensor; with
            # uneven shards (W = 3, 4) it reduces a few more. Tiny either way, and FSDP's only.
            mine = dict(want)  # each rank compares with its own copy
            norm, want_norm = got.pop("all_reduce (grad norm)", 0), mine.pop("all_reduce (grad norm)", 0)
            assert want_norm <= norm <= 2 * want_norm, (name, norm, want_norm)  # none where nothing is sharded
            assert (norm > 0) == (strategy.startswith(("fsdp", "hsdp")) and name != "hsdp_2x1"), (name, norm)
            assert got == mine, (name, rank)
        calls = run["summary"]["comm"][0]
        # what a ring sends: 2(n-1)/n of an all-reduce, (n-1)/n of the others, n = the group's size
        groups = {"all_reduce": w // 2, "all_gather": 2, "reduce_scatter": 2} if SHARD.get(name) == 2 else {}
        for kind, c in calls.items():
            kind = kind.split(" (")[0]  # "all_reduce (grad norm)" is an all-reduce
            g = groups.get(kind, w)
            factor = {"all_reduce": 2 * (g - 1) / g, "all_gather": (g - 1) / g, "reduce_scatter": (g - 1) / g}
            assert c["wire_bytes"] == pytest.approx(c["bytes"] * factor.get(kind, 1.0)), (name, kind)
        if name == "ddp_accum":  # no_sync: one all-reduce per optimizer step, not per micro-batch
            assert calls["all_reduce"]["calls"] == 1
        if name == "fsdp_accum":  # one reduce-scatter per unit (4 blocks + root) per step
            assert calls["reduce_scatter"]["calls"] == CFG.n_layers + 1


def test_fsdp_pads_uneven_shards_on_the_odd_world_size(job3):
    """W = 3 does not divide the 64-row parameters: FSDP pads each rank's shard."""
    job = job3
    states = [_state(job["fsdp_zero3"], r)["optimizer state"] for r in range(3)]
    assert states[0] == states[1] > states[2]  # the last rank holds the short chunks


def test_bf16_compute_fp32_shards_fp32_reduction_with_checkpointing(job4):
    job = job4
    run, w = job["bf16_ac"], job["world"]
    # trained, close to fp32 but not bitwise (it really computed in bf16), no dtype error
    ref = job["reference"]["losses"]
    assert run["losses"] == pytest.approx(ref, rel=2e-3) and run["losses"] != ref
    for rank in range(w):
        want = model_state("fsdp_zero3", CFG, w, rank)  # fp32 shards, fp32 gradients, fp32 AdamW
        assert {k: _state(run, rank)[k] for k in want} == want
    got = {k: v["bytes"] for k, v in run["summary"]["comm"][0].items()}
    want = comm_bytes("fsdp_zero3", CFG, w, param_bytes=2)  # bf16 all-gathers, fp32 reduce-scatter
    assert 0 < got.pop("all_reduce (grad norm)") <= 2 * want.pop("all_reduce (grad norm)")
    assert got == want
    assert run["summary"]["dtype"] == "bf16"
    # checkpointing keeps only block inputs: far fewer activation bytes than without
    assert (run["summary"]["memory"][0]["peak_by_category"]["activations"]
            < 0.3 * job["fsdp_zero3"]["summary"]["memory"][0]["peak_by_category"]["activations"])


def test_savers_change_nothing_in_fp32(job2):
    """AC recomputes the very ops it dropped, compile fuses them: the losses of the eager,
    uncheckpointed run of the same strategy, to 1e-6 (not bitwise: inductor may fuse and
    reorder the float sums)."""
    job = job2
    for name, plain in [("ddp_ac", "ddp"), ("fsdp_ac", "fsdp_zero3"), ("ddp_compile", "ddp"),
                        ("fsdp_compile", "fsdp_zero3")]:
        assert job[name]["losses"] == pytest.approx(job[plain]["losses"], rel=TIGHT_RTOL, abs=0), name
        assert job[name]["grad_norms"] == pytest.approx(job[plain]["grad_norms"], rel=TIGHT_RTOL, abs=0), name
    assert job["ddp_compile"]["summary"]["dtype"] == "fp32"


@pytest.mark.parametrize("world", [2, 4])
def test_bf16_runs_match_the_one_device_bf16_run(world, request):
    """Each split's bf16 losses against one device's (tests/tolerances.py says why 4 bf16 gaps)."""
    job = request.getfixturevalue(f"job{world}")
    for name in ("ddp_bf16", "zero1_bf16", "fsdp_bf16"):
        if name in job:  # ZeRO-1 at 4 ranks only
            check_bf16_parity(name, job[name]["losses"], job["reference_bf16"]["losses"], job["reference"]["losses"])
            assert job[name]["summary"]["dtype"] == "bf16"


def test_profile_shows_each_ranks_compute_and_communication(job2):
    """--profile: a Chrome trace per rank with gloo's collectives in it, the timeline figure,
    and per rank the communication time and the share of it that ran under compute."""
    # (gloo has no reduce-scatter of its own: FSDP's runs as a gloo all-reduce)
    for name, kinds in (("ddp_profile", {"gloo:all_reduce"}), ("fsdp_profile", {"gloo:all_gather", "gloo:all_reduce"})):
        run = job2[name]
        assert run["profile_traces"] == ["trace_rank0.json", "trace_rank1.json"] and run["profile_figure"], name
        assert kinds <= set(run["profile_comm_names"]), (name, run["profile_comm_names"])
        per_rank = run["summary"]["profile"]
        assert [r["rank"] for r in per_rank] == [0, 1]
        for r in per_rank:
            assert r["comm_s"] > 0 and r["compute_s"] > 0 and 0 <= r["overlapped_fraction"] <= 1, (name, r)
        # the profiled step is left out of the throughput, like the traced ones
        assert run["losses"] == pytest.approx(job2[name.replace("_profile", "" if name == "ddp_profile" else "_zero3")]
                                              ["losses"], rel=1e-6)


def test_overlap_is_the_communication_time_under_compute():
    """The arithmetic of common/measure/profile.py on a made-up CPU trace: compute on the
    training thread (a collective's launch excluded), communication on gloo's thread."""
    from common.measure.profile import intervals_from_trace, overlap
    ev = [{"ph": "X", "tid": 1, "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100},
          {"ph": "X", "tid": 1, "cat": "cpu_op", "name": "aten::mm", "ts": 50, "dur": 100},  # overlaps: a union
          {"ph": "X", "tid": 1, "cat": "cpu_op", "name": "c10d::allreduce_", "ts": 160, "dur": 10},
          {"ph": "X", "tid": 1, "cat": "cpu_op", "name": "aten::add", "ts": 200, "dur": 50},
          {"ph": "X", "tid": 7, "cat": "user_annotation", "name": "gloo:all_reduce", "ts": 120, "dur": 100}]
    iv = intervals_from_trace(ev, main_tid=1)
    assert iv == {"compute": [(0, 150), (200, 250)], "comm": [(120, 220)]}
    o = overlap(iv)
    assert o["comm_s"] == pytest.approx(100e-6) and o["overlapped_s"] == pytest.approx(50e-6)
    assert o["overlapped_fraction"] == pytest.approx(0.5)
    # A CUDA trace: the GPU's kernels, NCCL's against the others. The host's span of the
    # collective (its launch, on the CPU's time line) is not communication: counted, it
    # would look overlapped with the matmul it sits beside.
    ev = [{"ph": "X", "tid": 1, "cat": "cpu_op", "name": "nccl:all_reduce", "ts": 0, "dur": 300},
          {"ph": "X", "tid": 9, "cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": 0, "dur": 100},
          {"ph": "X", "tid": 10, "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "ts": 80,
           "dur": 120}]
    iv = intervals_from_trace(ev, main_tid=1)
    assert iv == {"compute": [(0, 100)], "comm": [(80, 200)]}
    assert overlap(iv)["overlapped_fraction"] == pytest.approx(20 / 120)


DRY = {"ddp": 1, "zero1": 3, "fsdp_zero3": 2, "hsdp": 3}  # run -> the rank a dry run plays, at 4 ranks


@pytest.fixture(scope="module")
def dry4(tmp_path_factory):
    """Each DRY run again as a dry run of one rank of the 4-rank layout, in one plain python
    process (the fake process group: tools/multirun.py runs them one after another)."""
    from tests.drivers.dp import COMMON, SCRIPTS
    tmp = tmp_path_factory.mktemp("dry4")
    runs = [{"name": name, "script": SCRIPTS[PLANS[4][name][0]],
             "argv": COMMON + PLANS[4][name][1] + ["--fake-world-size", "4", "--fake-rank", str(rank),
                                                   "--out", str(tmp / name)]}
            for name, rank in DRY.items()]
    r = launch.run([sys.executable, "tools/multirun.py", "--runs", json.dumps(runs)], cwd=ROOT,
                   capture_output=True, text=True, timeout=150)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.count("collectives are skipped") == len(DRY), r.stdout[-2000:]
    return {name: json.loads((tmp / name / "summary.json").read_text()) for name in DRY}


@pytest.mark.parametrize("name", sorted(DRY))
def test_a_dry_run_holds_and_sends_what_its_rank_does(job4, dry4, name):
    """--fake-world-size 4 --fake-rank R in one process: rank R's memory by category (model
    state before the optimizer step, and every category's peak) and its bytes per
    collective, exactly those of rank R in the real 4-rank run; marked as a dry run."""
    rank, dry, real = DRY[name], dry4[name], job4[name]["summary"]
    assert dry["world_size"] == 4
    check_dry_run(dry, real, rank, 4)


def test_bad_input_is_one_clear_sentence(job4):
    job = job4
    bad, accum, mesh = job["bad_batch"], job["bad_accum"], job["bad_hsdp"]
    assert bad["code"] == accum["code"] == mesh["code"] == 2
    assert bad["stderr"].strip() == ("[rank 0] error: --global-batch-size 6 does not divide among 4 "
                                     "data-parallel ranks; use a multiple of 4.")
    assert accum["stderr"].strip() == ("[rank 0] error: --global-batch-size 4 does not divide into 2 "
                                       "micro-batches on each of 4 data-parallel ranks; use a multiple of 8.")
    assert mesh["stderr"].strip() == ("[rank 0] error: a 3 x 3 mesh (replicate, shard) needs 9 ranks but 4 "
                                      "were launched; make the product equal the world size.")


def test_a_real_process_exits_2_with_the_sentence():
    r = launch.run([sys.executable, "step3_multi_gpu/train_fsdp.py", "--model", "debug", "--data", "synthetic",
                    "--hsdp", "2", "2", "--device", "cpu"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip() == ("error: a 2 x 2 mesh (replicate, shard) needs 4 ranks but 1 were launched; "
                                "make the product equal the world size.")


def test_plain_python_runs_one_rank_and_says_how_to_launch(tmp_path):
    r = launch.run([sys.executable, "step3_multi_gpu/train_ddp.py", "--model", "debug", "--data", "synthetic",
                    "--device", "cpu", "--steps", "2", "--seq-len", "32", "--global-batch-size", "2", "--eval-batches", "0",
                    "--no-trace-memory", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                   timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert ("note: plain python runs a single rank; for four, launch torchrun --nproc-per-node 4 "
            "step3_multi_gpu/train_ddp.py") in r.stdout
    assert json.loads((tmp_path / "summary.json").read_text())["world_size"] == 1


@pytest.mark.parametrize("script,flags,sentence", [
    ("step3_multi_gpu/train_fsdp.py", ["--fake-world-size", "4", "--fake-rank", "4"],
     "error: --fake-rank 4 is not a rank of --fake-world-size 4; use 0 to 3."),
    ("step3_multi_gpu/train_ddp.py", ["--fake-world-size", "4", "--save-weights"],
     "error: --save-weights cannot be used in a dry run (--fake-world-size): its weights are not trained (the "
     "other ranks' parts never arrive); drop --save-weights."),
    ("step3_multi_gpu/train_tp.py", ["--fake-rank", "1"],
     "error: --fake-rank needs --fake-world-size (the layout the rank belongs to)."),
    ("step3_multi_gpu/train_ddp.py", ["--fake-world-size", "2", "--comm-hook", "fp16"],
     "error: --comm-hook fp16 cannot run in a dry run (--fake-world-size): it computes with what the other ranks "
     "send, which never arrives; drop --comm-hook."),
])
def test_dry_run_misuse_is_one_sentence(script, flags, sentence, tmp_path):
    """Each in this process (no torch start-up per case): exit 2 and exactly the sentence."""
    from tools.multirun import run_script
    code, err = run_script(script, ["--model", "debug", "--data", "synthetic", "--device", "cpu", "--steps", "2",
                                    "--seq-len", "32", "--global-batch-size", "4", *flags, "--out", str(tmp_path)],
                           capture_stderr=True)
    assert code == 2 and err.strip().splitlines()[-1] == sentence, err


def test_a_dry_run_refuses_torchrun(monkeypatch, tmp_path):
    from tools.multirun import run_script
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    code, err = run_script("step3_multi_gpu/train_fsdp.py", ["--model", "debug", "--data", "synthetic", "--device",
                                                              "cpu", "--fake-world-size", "4", "--out", str(tmp_path)],
                           capture_stderr=True)
    assert code == 2
    assert err.strip() == ("error: --fake-world-size runs one rank in one process: start it with plain python, not "
                           "torchrun.")


def test_profile_without_a_step_to_profile_is_one_sentence(tmp_path):
    from tools.multirun import run_script
    code, err = run_script("step3_multi_gpu/train_ddp.py", ["--model", "debug", "--data", "synthetic", "--device",
                                                             "cpu", "--steps", "2", "--seq-len", "32",
                                                             "--global-batch-size", "4", "--profile",
                                                             "--out", str(tmp_path)], capture_stderr=True)
    assert code == 2
    assert err.strip().splitlines()[-1] == ("error: --profile needs a step after the first that is not memory-traced "
                                            "or byte-counted; train longer than --steps 2, or pass --no-trace-memory.")


def test_ddp_asks_the_device_for_nothing_in_a_steady_step(job2):
    """tests/test_syncs.py's claim on 2 DDP ranks, the global loss's all-reduce included: no
    host sync in steps 1 and 4 (2 and 3 are byte-counted, under a dispatch mode, and left out
    of the throughput); the last step reads its numbers at once."""
    per = job2["ddp_syncs"]["syncs"]
    assert len(per) == 6 and per[1] == per[4] == 0 and per[5] >= 1, per
