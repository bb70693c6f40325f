"""Expert parallelism (step3_multi_gpu/train_ep.py) and the mixture-of-experts model.

Two torchrun jobs (2 and 4 ranks, gloo on the CPU) run every case through
tests/drivers/model_parallel.py, which also trains the single-process reference (step 1's
loop, router loss included) on the same seed, data and global batch. They assert:
- parity: every step's loss and gradient norm, and the final weights gathered into one
  state dict, equal one process's, fp32, with 2 and 4 ranks (4 and 2 experts per rank at
  2 ranks, 2 and 1 at 4), with accumulation too;
- the router: the logged tokens per expert count every token slot of the global batch;
- bytes: the all-to-all's logical bytes, rank by rank, equal 2 (kT + R) rows of dim values
  per MoE layer (R: the rows this rank's experts received, from the logged counts), and
  their mean over the ranks equals 4 kT exactly; FSDP gathers only the dense part;
- memory: each rank holds its n_experts / W experts whole and 1/W of the dense part;
- bad input: experts that do not split over the ranks, a dense model: one sentence, exit 2.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest

from common import ROOT
from common.measure.plan import Plan
from common.measure.theory import predict
from common.model import get_config
from common.parallelize.ep import ep_bytes_per_step
import launch
from conftest import hang_limit
from test_model_parallel import adam_drift_bound
from tests.tolerances import (PARITY_RTOL, TIGHT_RTOL, check_allocator, check_bf16_parity, check_optimizer_path,
                              check_weights, dry_runs)

TIMEOUT_S = hang_limit(240)  # a hang detector: both jobs together take about 40 s on an idle 2-core machine
STEPS, BATCH, SEQ = 4, 4, 32
EP = "step3_multi_gpu/train_ep.py"
COMMON = ["--model", "debug-moe", "--steps", str(STEPS), "--global-batch-size", str(BATCH), "--seq-len", str(SEQ),
          "--data", "synthetic", "--eval-batches", "0", "--save-weights", "--max-norm", "0.5", "--amp", "off",
          "--trace-start", "1", "--trace-steps", "1"]


def case(name, *flags, error=None):
    return {"name": name, "script": EP, "flags": [*COMMON, *flags], "expect_error": error is not None, "error": error}


CASES = {
    2: [case("ep2"),
        # accumulation: the router's counts are per micro-batch, one process's per batch, so
        # only the language-model loss can match: its weight 0 on both sides
        case("ep2_accum", "--grad-accum", "2", "--aux-loss-weight", "0", "--no-trace-memory",
             "--fused-adamw"),  # the experts on their mesh, the rest plain: fused AdamW takes both
        case("bf16_ep2", "--amp", "bf16", "--no-trace-memory"),
        case("err_ep_split", "--n-experts", "3",
             error="the model's 3 experts do not split evenly over 2 expert-parallel ranks; launch a number of "
                   "ranks that divides 3."),
        case("err_ep_dense", "--model", "debug",
             error="--model debug has no experts to spread over the ranks; use a mixture-of-experts preset")],
    4: [case("ep4"),
        case("ep4_one_expert_each", "--n-experts", "4", "--no-trace-memory"),
        # EP 2 inside 4 ranks: two groups, each holding every expert, copies of each other
        case("ep4_ep2", "--ep", "2"),
        case("err_ep_degree", "--ep", "3",
             error="--ep 3 does not divide the 4 ranks into groups that each hold every expert; use a divisor of 4.")],
}
OK = [(n, c["name"]) for n, cs in CASES.items() for c in cs if not c["expect_error"] and not c["name"].startswith("bf16")]
ERR = [(n, c["name"]) for n, cs in CASES.items() for c in cs if c["expect_error"]]


def torchrun(n, *args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *map(str, args)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ep")
    procs, start = {}, time.perf_counter()
    for n, cases in CASES.items():
        out = tmp / f"world{n}"
        out.mkdir()
        (out / "cases.json").write_text(json.dumps(cases))
        procs[n] = launch.Popen(torchrun(n, ROOT / "tests/drivers/model_parallel.py", out, out / "cases.json"),
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for n, proc in procs.items():
        try:
            log, _ = proc.communicate(timeout=max(1, TIMEOUT_S - (time.perf_counter() - start)))
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            pytest.fail(f"the {n}-rank job did not finish in {TIMEOUT_S} s (a hang?)")
        assert proc.returncode == 0, f"driver on {n} ranks failed:\n{log[-5000:]}"
    results = {n: json.loads((tmp / f"world{n}" / "results.json").read_text()) for n in CASES}
    for n, cases in CASES.items():
        for c in cases:
            results[n][c["name"]]["out"] = tmp / f"world{n}" / c["name"]
    return results


def metrics(r) -> list[dict]:
    return [json.loads(line) for line in (r["out"] / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("n,name", OK, ids=[f"{n}ranks-{name}" for n, name in OK])
def test_parity_with_single_process(runs, n, name):
    r = runs[n][name]
    assert r["exit_code"] == 0, r["stderr_tail"]
    check_optimizer_path(r["summary"], next(c["flags"] for c in CASES[n] if c["name"] == name))
    for step, (got, ref) in enumerate(zip(r["losses"], r["ref_losses"], strict=True)):
        assert math.isclose(got, ref, rel_tol=TIGHT_RTOL), f"step {step}: {got} vs single-process {ref}"
    assert r["losses"][-1] != r["losses"][0]
    assert min(r["ref_grad_norms"]) > 0.5, "every step must clip for the norms to be tested"
    for step, (got, ref) in enumerate(zip(r["grad_norms"], r["ref_grad_norms"], strict=True)):
        assert math.isclose(got, ref, rel_tol=PARITY_RTOL), f"step {step}: grad_norm {got} vs single-process {ref}"
    check_weights(r, adam_drift_bound(steps=STEPS))  # every case saves its final weights (--save-weights)


def test_bf16_follows_one_device_bf16(runs):
    r = runs[2]["bf16_ep2"]
    assert r["exit_code"] == 0, r["stderr_tail"]
    check_bf16_parity("bf16_ep2", r["losses"], r["ref_bf16_losses"], r["ref_losses"])


@pytest.mark.parametrize("n,name", [(2, "ep2"), (4, "ep4")])
def test_router_counts_and_loss(runs, n, name):
    cfg = get_config("debug-moe")
    for row in metrics(runs[n][name]):
        assert len(row["tokens_per_expert"]) == cfg.n_layers
        for layer in row["tokens_per_expert"]:  # every slot of the global batch, counted once
            assert len(layer) == cfg.n_experts and sum(layer) == cfg.top_k * BATCH * SEQ
        assert 1.0 <= row["aux_loss"] / (cfg.moe_aux_weight * cfg.n_layers) < cfg.n_experts  # 1: even load


@pytest.mark.parametrize("n,name", [(2, "ep2"), (4, "ep4"), (2, "ep2_accum"), (4, "ep4_one_expert_each"),
                                    (4, "ep4_ep2")])
def test_all_to_all_bytes_against_the_formula(runs, n, name):
    r = runs[n][name]
    experts = 4 if "one_expert" in name else 8
    ep = 2 if name.endswith("_ep2") else n
    cfg = get_config("debug-moe", n_experts=experts)
    accum = 2 if "accum" in name else 1
    tokens = BATCH // n // accum * SEQ
    comm = r["summary"]["comm"]
    rows = metrics(r)
    counted = [row for row in rows if 2 <= row["step"] < 4]  # Run counts steps 2 and 3 (after one-time work)
    per_rank = []
    for rank, c in enumerate(comm):
        # R: the slots this rank's experts received, per layer and step (the last micro-batch's
        # counts are logged: with accumulation the formula's mean is checked instead)
        mine = slice(rank * experts // ep, (rank + 1) * experts // ep)
        received = sum(sum(layer[mine]) for row in counted for layer in row["tokens_per_expert"]) / \
            (len(counted) * cfg.n_layers)
        got = c["all_to_all"]["bytes"]
        per_rank.append(got)
        if accum == 1 and ep == n:  # (with copies, the logged counts are the whole batch's, not one group's)
            assert got == ep_bytes_per_step(cfg, tokens, received), f"rank {rank}"
        assert c["all_to_all"]["calls"] == 4 * cfg.n_layers * accum  # dispatch, combine; both again in backward
        assert c["all_to_all (expert counts)"]["bytes"] == 8 * experts * cfg.n_layers * accum
    assert sum(per_rank) / n == ep_bytes_per_step(cfg, tokens, accum=accum)  # routing-independent: 4 kT rows


@pytest.mark.parametrize("n,name", [(2, "ep2"), (4, "ep4"), (4, "ep4_ep2")])
def test_memory_and_dense_traffic_as_predicted(runs, n, name):
    r = runs[n][name]
    cfg = get_config("debug-moe")
    plan = Plan(cfg, "ep", world=n, batch=BATCH, seq_len=SEQ, ep=2 if name.endswith("_ep2") else None)
    memory = r["summary"]["memory"]
    for m in memory:
        p = predict(plan, m["rank"])
        for c in ("parameters", "gradients", "optimizer state"):
            assert m["before_optimizer"][c] == p[c], (m["rank"], c)
    comm = r["summary"]["comm"]
    p = predict(plan, 0)["comm"]
    for kind in ("all_gather", "reduce_scatter", "all_reduce (expert grads)"):
        # the dense part only: no expert is gathered; copies of experts (--ep 2 of 4) all-reduce theirs
        assert comm[0].get(kind, {}).get("bytes") == p.get(kind), kind
    assert ("all_reduce (expert grads)" in p) == name.endswith("_ep2")


DRY = {"ep2": (2, 1), "ep4_ep2": (4, 3)}  # traced case -> (world, the rank a dry run plays)


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    """The DRY cases again, one rank each alone as a dry run (--fake-world-size), one plain
    python process for all (the weights are not saved: a dry run refuses that)."""
    cases = {c["name"]: c for cs in CASES.values() for c in cs}
    return dry_runs([{"name": name, "script": EP, "argv": [f for f in cases[name]["flags"] if f != "--save-weights"]
                      + ["--fake-world-size", str(n), "--fake-rank", str(r)]} for name, (n, r) in DRY.items()],
                    tmp_path_factory.mktemp("ep_dry"), TIMEOUT_S)


@pytest.mark.parametrize("name", sorted(DRY))
def test_a_dry_run_assumes_even_routing(runs, dry, name):
    """A dry run receives no routing from the other ranks and assumes an even one (each
    rank sends it what it sends that rank). Its model state and every collective that does
    not depend on the routing equal the real rank's; its all-to-all is the even-routing
    formula's 4 kT rows exactly. Its activations differ from the real rank's only by the
    rows the real rank's experts received beyond or short of the mean kT, each of which a
    layer keeps at most 4 times at dim (arrived, regrouped, the expert's output, restored
    to arrival order) and 4 times at ffn_dim (the SwiGLU's gate, up, activation, product)."""
    n, rank = DRY[name]
    got, real = dry[name], runs[n][name]
    assert got["dry_run"] == {"rank": rank, "world_size": n}
    cfg = get_config("debug-moe")
    (memory,) = got["memory"]
    assert memory["rank"] == rank
    real_memory = real["summary"]["memory"][rank]
    assert memory["before_optimizer"] == real_memory["before_optimizer"]
    (comm,) = got["comm"]
    sent = {k: v["bytes"] for k, v in comm.items()}
    tokens = BATCH // n * SEQ
    assert sent.pop("all_to_all") == ep_bytes_per_step(cfg, tokens)
    assert comm["all_to_all"]["calls"] == 4 * cfg.n_layers
    assert sent == {k: v["bytes"] for k, v in real["summary"]["comm"][rank].items() if k != "all_to_all"}
    ep = 2 if name.endswith("_ep2") else n
    if ep == n:  # (with copies of the experts the logged counts are the whole batch's, not one group's)
        traced = next(row for row in metrics(real) if row["step"] == 1)  # --trace-start 1
        mine = slice(rank * cfg.n_experts // ep, (rank + 1) * cfg.n_experts // ep)
        off_mean = sum(abs(sum(layer[mine]) - cfg.top_k * tokens) for layer in traced["tokens_per_expert"])
        assert off_mean > 0, "the real routing is uneven: the bound below is not trivially 0"
        bound = off_mean * 4 * (4 * cfg.dim + 4 * cfg.ffn_dim)
        gap = memory["peak_by_category"]["activations"] - real_memory["peak_by_category"]["activations"]
        assert abs(gap) <= bound, (gap, bound)


@pytest.mark.parametrize("n,name", [(2, "ep2"), (4, "ep4"), (4, "ep4_ep2")])
def test_every_rank_agrees_with_the_cpu_allocator(runs, dry, n, name):
    """The trace held to the CPU allocator's own count on every rank, and on the dry run
    of the case where there is one: the peaks within 1% (the all-to-alls' buffers inside
    gloo are counted apart: common/measure/allocator_count.py, _AllocatorView)."""
    mems = runs[n][name]["summary"]["memory"] + (dry[name]["memory"] if name in DRY else [])
    assert len(mems) == n + (name in DRY)
    for m in mems:
        check_allocator(m, (name, m["rank"]))


@pytest.mark.parametrize("n,name", ERR, ids=[f"{n}ranks-{name}" for n, name in ERR])
def test_bad_input_is_one_sentence(runs, n, name):
    r = runs[n][name]
    want = next(c["error"] for c in CASES[n] if c["name"] == name)
    assert r["exit_code"] == 2, r["stderr_tail"]
    assert want in r["stderr_tail"] and "Traceback" not in r["stderr_tail"]


# ---- the mixture of experts itself, in this process ----------------------------------------------
def test_moe_layer_equals_a_token_by_token_reference():
    """The grouped, sorted, dropless layer computes, for each token, the weighted sum of its
    top-k experts' SwiGLU outputs; the loop over experts gives the same as grouped_mm."""
    import torch
    import torch.nn.functional as F

    from common import model as M
    cfg = get_config("debug-moe")
    moe = M.build_model(cfg, "cpu", seed=1).layers["0"].feed_forward
    x = torch.randn(3, 5, cfg.dim, generator=torch.Generator().manual_seed(0))
    got = moe(x)
    flat = x.reshape(-1, cfg.dim)
    probs = moe.router(flat).softmax(-1)
    want = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        w, chosen = probs[t].topk(cfg.top_k)
        for weight, e in zip(w / w.sum(), chosen.tolist()):
            h = F.silu(flat[t] @ moe.experts.w1[e]) * (flat[t] @ moe.experts.w3[e])
            want[t] += weight * (h @ moe.experts.w2[e])
    torch.testing.assert_close(got.reshape(-1, cfg.dim), want, rtol=1e-5, atol=1e-6)
    counts = moe.tokens_per_expert
    assert counts.sum() == cfg.top_k * flat.shape[0]
    f, p = counts.float() / counts.sum(), probs.mean(0)
    torch.testing.assert_close(moe.aux_loss, cfg.n_experts * (f * p).sum())
    saved = dict(M._GROUPED_MM)
    try:  # the fallback: one matmul per expert
        M._GROUPED_MM.update({k: False for k in M._GROUPED_MM})
        torch.testing.assert_close(moe(x), got, rtol=0, atol=1e-6)
    finally:
        M._GROUPED_MM.clear()
        M._GROUPED_MM.update(saved)


def test_moe_counts_its_parameters_and_its_active_flops():
    from common.model import count_params, flops_per_token
    dense, moe = get_config("debug"), get_config("debug-moe")
    mlp = 3 * moe.dim * moe.ffn_dim
    assert count_params(moe) - count_params(dense) == moe.n_layers * (moe.n_experts * mlp + moe.dim * moe.n_experts
                                                                      - 3 * dense.dim * dense.ffn_dim)
    # FLOPs use the active parameters: top_k experts, not all of them
    assert flops_per_token(moe, 64) - flops_per_token(dense, 64) == 6 * moe.n_layers * (
        moe.top_k * mlp + moe.dim * moe.n_experts - 3 * dense.dim * dense.ffn_dim)


def test_one_rank_trains_what_step1_trains(tmp_path):
    """Plain python: a process group of one holds every expert and sends nothing; the
    losses are step 1's (the MoE preset, router loss included)."""
    from tools.multirun import run_script
    flags = [*COMMON, "--no-trace-memory", "--device", "cpu"]
    flags = [f for f in flags if f not in ("--save-weights",)]
    step1 = [f for i, f in enumerate(flags) if f != "--amp" and (i == 0 or flags[i - 1] != "--amp")]
    losses = {}
    for name, script, argv in (("ep", EP, flags), ("step1", "step1_single_gpu/train.py", step1)):
        code, err = run_script(script, argv + ["--out", str(tmp_path / name)], capture_stderr=True)
        assert code == 0, err[-3000:]
        losses[name] = [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert len(losses["ep"]) == STEPS
    for step, (a, b) in enumerate(zip(losses["ep"], losses["step1"], strict=True)):
        assert math.isclose(a, b, rel_tol=1e-6), f"step {step}: {a} vs step 1's {b}"
