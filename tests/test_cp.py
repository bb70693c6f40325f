"""Context parallelism (step3_multi_gpu/train_cp.py, common/parallelize/cp.py).

Two torchrun jobs (2 and 4 ranks, tests/drivers/cp.py), started together once per module:
- the hand-written ring against SDPA on the whole sequence: outputs and the gradients of
  q, k and v, load-balanced and contiguous slices, grouped-query and plain heads;
- parity: every step's loss and gradient norm, and the final weights, match the
  single-process step 1 loop on the same global batch (fp32); bf16 against one device's bf16;
- bytes: the ring's sends and receives, the gradients' all-reduce and the loss's, per step,
  equal formulas.cp_bytes_per_step (activation checkpointing and accumulation included);
- memory: each rank's traced activations are theory's (activations of seq/cp tokens) and
  fall with the degree;
- bad input: one sentence on every rank and exit code 2.
"""
from __future__ import annotations

import json
import math
import subprocess
import time

import pytest

from common import ROOT
from common.model import count_params, get_config
from common.measure.formulas import cp_bytes_per_step
from common.measure.plan import Plan
from common.measure.theory import predict
from common.parallelize.cp import positions
from test_model_parallel import adam_drift_bound, torchrun
import launch
from conftest import hang_limit
from tests.tolerances import (PARITY_RTOL, TIGHT_RTOL, check_allocator, check_bf16_parity, check_dry_run,
                              check_optimizer_path, check_weights, dry_runs)

TIMEOUT_S = hang_limit(240)  # a hang detector: both jobs take about 30 s on an idle 2-core machine
STEPS, BATCH, SEQ = 3, 4, 32
CP = "step3_multi_gpu/train_cp.py"
COMMON = ["--model", "debug", "--steps", str(STEPS), "--global-batch-size", str(BATCH), "--seq-len", str(SEQ),
          "--data", "synthetic", "--eval-batches", "0", "--max-norm", "0.5", "--amp", "off"]
QUIET = COMMON + ["--no-trace-memory", "--save-weights"]
TRACED = COMMON + ["--trace-start", "1", "--trace-steps", "1", "--save-weights"]


def case(name, *flags, base=QUIET, error=None):
    return {"name": name, "script": CP, "flags": [*base, *flags], "expect_error": error is not None, "error": error}


CASES = {
    2: [case("cp2", base=TRACED),
        case("cp2_contiguous", "--no-load-balance"),
        case("cp2_ac_accum", "--ac", "full", "--grad-accum", "2"),
        case("bf16_cp2", "--amp", "bf16")],
    4: [case("cp4", base=TRACED),
        # 2 data-parallel groups of 2 CP ranks, FSDP over all four (torchtitan's layout)
        case("cp2x2_fsdp", "--dp", "2", "--fsdp", base=TRACED),
        case("err_cp_seq", "--seq-len", "36",
             error="--seq-len 36 does not split into 8 equal chunks; use a multiple of 2 x the context-parallel "
                   "degree 4 (load balancing gives each rank two chunks).")],
}
OK = [(n, c["name"]) for n, cs in CASES.items() for c in cs if not c["expect_error"]]
FP32 = [(n, name) for n, name in OK if not name.startswith("bf16")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cp")
    procs = {}
    for n, cases in CASES.items():
        out = tmp / f"world{n}"
        out.mkdir()
        (out / "cases.json").write_text(json.dumps(cases))
        procs[n] = launch.Popen(torchrun(n, "tests/drivers/cp.py", out, out / "cases.json"), cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    start = time.perf_counter()
    logs = {}
    for n, proc in procs.items():
        try:
            logs[n] = proc.communicate(timeout=max(1, TIMEOUT_S - (time.perf_counter() - start)))[0]
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            pytest.fail(f"the {n}-rank job did not finish in {TIMEOUT_S} s (a hang?):\n{proc.communicate()[0][-4000:]}")
        assert proc.returncode == 0, f"driver on {n} ranks failed:\n{logs[n][-5000:]}"
    return {n: {"results": json.loads((tmp / f"world{n}" / "results.json").read_text()),
                "others": {r: json.loads((tmp / f"world{n}" / f"results_rank{r}.json").read_text()) for r in range(1, n)},
                "ring": [json.loads((tmp / f"world{n}" / f"ring_rank{r}.json").read_text()) for r in range(n)]}
            for n in CASES}


@pytest.mark.parametrize("n", sorted(CASES))
def test_ring_attention_is_full_attention(runs, n):
    """Values and gradients of q, k, v on every rank's slice: fp32 against float64 SDPA."""
    for rank, configs in enumerate(runs[n]["ring"]):
        assert set(configs) == {"hkv2_lb", "hkv2_contiguous", "hkv4_lb", "hkv4_contiguous"}
        for name, d in configs.items():
            for what in ("out", "dq", "dk", "dv"):
                assert d[what] <= 1e-5 * d["scale"], (rank, name, what, d)


@pytest.mark.parametrize("n,name", FP32, ids=[f"{n}ranks-{name}" for n, name in FP32])
def test_parity_with_single_process(runs, n, name):
    r = runs[n]["results"][name]
    assert r["exit_code"] == 0, r["stderr_tail"]
    check_optimizer_path(r["summary"], next(c for c in CASES[n] if c["name"] == name)["flags"])
    assert len(r["losses"]) == STEPS and r["losses"][-1] != r["losses"][0]
    for step, (got, ref) in enumerate(zip(r["losses"], r["ref_losses"])):
        assert math.isclose(got, ref, rel_tol=TIGHT_RTOL), f"step {step}: {got} vs single-process {ref}"
    assert min(r["ref_grad_norms"]) > 0.5, "every step must clip for the norms to be tested"
    for step, (got, ref) in enumerate(zip(r["grad_norms"], r["ref_grad_norms"])):
        assert math.isclose(got, ref, rel_tol=PARITY_RTOL), f"step {step}: grad_norm {got} vs {ref}"
    check_weights(r, adam_drift_bound(steps=STEPS))  # every case saves its final weights (--save-weights)


def test_bf16_matches_the_one_device_bf16_run(runs):
    r = runs[2]["results"]["bf16_cp2"]
    assert r["exit_code"] == 0, r["stderr_tail"]
    check_bf16_parity("bf16_cp2", r["losses"], r["ref_bf16_losses"], r["ref_losses"])


def plan_of(n: int, name: str) -> Plan:
    """The Plan (common/measure/plan.py) of a case, read from its flags."""
    flags = next(c for c in CASES[n] if c["name"] == name)["flags"]
    value = {a: b for a, b in zip(flags, flags[1:])}  # the last value of each flag wins, as in argparse
    dp = int(value.get("--dp", 1))
    return Plan(get_config("debug"), "cp_fsdp" if "--fsdp" in flags else "cp", world=n, cp=n // dp, batch=BATCH,
                seq_len=SEQ, dtype="fp32" if value["--amp"] == "off" else "bf16", ac=value.get("--ac", "none"),
                accum=int(value.get("--grad-accum", 1)))


@pytest.mark.parametrize("n,name", OK, ids=[f"{n}ranks-{name}" for n, name in OK])
def test_bytes_are_the_formula(runs, n, name):
    """Per step, every rank: the ring's sends and receives, and the gradients' all-reduce of
    4N (or FSDP's all-gathers and reduce-scatter, and the norm's all-reduce of the shards);
    nothing else (the loss is averaged after the counted step)."""
    r = runs[n]["results"][name]
    plan = plan_of(n, name)
    cfg = plan.cfg
    want = predict(plan)["comm"]
    # by hand, the ring of the plain fp32 cases: L layers x [(cp-1) K/V blocks forward, (cp-1) back, cp gradients back]
    cp, dp = plan.cp, n // plan.cp
    block = 2 * (BATCH // dp) * (SEQ // cp) * cfg.n_kv_heads * cfg.head_dim
    if plan.dtype == "fp32" and plan.ac == "none":
        assert want["send"] == want["recv"] == cfg.n_layers * (2 * (cp - 1) + cp) * block * 4
        assert want == {**cp_bytes_per_step(cfg, BATCH // dp, SEQ, cp),
                        **({"all_reduce": 4 * count_params(cfg)} if plan.strategy == "cp" else
                           {k: v for k, v in want.items() if k in ("all_gather", "reduce_scatter", "all_reduce (grad norm)")})}
    recomputed = cfg.n_layers if plan.ac == "full" else 0
    for rank, comm in enumerate(r["summary"]["comm"]):
        got = {k: v["bytes"] for k, v in comm.items()}
        assert got == want, (rank, got, want)
        assert comm["send"]["calls"] == (cfg.n_layers * (2 * (cp - 1) + cp) + recomputed * (cp - 1)) * plan.accum
    assert r["summary"]["predicted"]["per_rank"][0]["comm"] == want


TRACED_CASES = [(2, "cp2"), (4, "cp4"), (4, "cp2x2_fsdp")]


@pytest.mark.parametrize("n,name", TRACED_CASES, ids=[f"{n}ranks-{name}" for n, name in TRACED_CASES])
def test_memory_is_the_formula_and_activations_fall_with_the_degree(runs, n, name):
    """Each rank's model state to the byte (whole, or FSDP's 1/world shards) and its
    activations within 2%, at (batch / dp) x (seq / cp) tokens a rank."""
    memory = runs[n]["results"][name]["summary"]["memory"]
    plan = plan_of(n, name)
    want = predict(plan)
    assert len(memory) == n
    for m in memory:
        state = m["before_optimizer"] or m["peak_by_category"]
        for c in ("parameters", "gradients", "optimizer state"):
            assert state[c] == want[c], (m["rank"], c)
        assert m["peak_by_category"]["activations"] == pytest.approx(want["activations"], rel=0.02), m["rank"]
    one = predict(Plan(get_config("debug"), "cp", world=1, batch=BATCH, seq_len=SEQ))["activations"]
    assert want["activations"] < one / n * 1.2  # all but the few per-sequence bytes are 1/(dp x cp)


DRY = {"cp2": (2, [0, 1]), "cp4": (4, [3]), "cp2x2_fsdp": (4, [2])}  # traced case -> (world, ranks a dry run plays)


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    """The traced cases again, each rank of DRY alone as a dry run (--fake-world-size), one
    plain python process for all (the weights are not saved: a dry run refuses that)."""
    cases = {c["name"]: c for cs in CASES.values() for c in cs}
    return dry_runs([{"name": f"{name}_rank{r}", "script": CP,
                      "argv": [f for f in cases[name]["flags"] if f != "--save-weights"]
                      + ["--fake-world-size", str(n), "--fake-rank", str(r)]}
                     for name, (n, ranks) in DRY.items() for r in ranks], tmp_path_factory.mktemp("cp_dry"), TIMEOUT_S)


@pytest.mark.parametrize("name", sorted(DRY))
def test_a_dry_run_holds_and_sends_what_its_rank_does(runs, dry, name):
    """--fake-world-size N --fake-rank R in one process: rank R's memory by category and its
    ring's bytes (sizes are static: no rank needs another's to size its blocks), exactly
    those of rank R of the real N-rank run, and the formula's."""
    n, ranks = DRY[name]
    for r in ranks:
        got = dry[f"{name}_rank{r}"]
        check_dry_run(got, runs[n]["results"][name]["summary"], r, n)
        assert {k: v["bytes"] for k, v in got["comm"][0].items()} == predict(plan_of(n, name), r)["comm"]


@pytest.mark.parametrize("n,name", TRACED_CASES, ids=[f"{n}ranks-{name}" for n, name in TRACED_CASES])
def test_every_rank_agrees_with_the_cpu_allocator(runs, dry, n, name):
    """The trace held to the CPU allocator's own count, every rank of the ring and its dry
    runs: the peaks within 1% (the ring's DDP over the dp ranks rebuilds its gradient buckets
    in the traced step: the old ones, from before the window, leave the count when freed)."""
    mems = runs[n]["results"][name]["summary"]["memory"] + [m for r in DRY[name][1] for m in dry[f"{name}_rank{r}"]["memory"]]
    assert len(mems) == n + len(DRY[name][1])
    for m in mems:
        check_allocator(m, (name, m["rank"]))


def test_bad_sequence_length_is_one_sentence_on_every_rank(runs):
    expected = CASES[4][-1]["error"]
    ranks = {0: runs[4]["results"]["err_cp_seq"]} | {r: got["err_cp_seq"] for r, got in runs[4]["others"].items()}
    for rank, r in ranks.items():
        assert r["exit_code"] == 2, (rank, r["stderr_tail"])
        assert [line for line in r["stderr_tail"].splitlines() if line.strip()] == [f"[rank {rank}] error: {expected}"]


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_load_balancing_gives_every_rank_the_same_work(cp):
    """The causal (query, key) pairs each rank computes: equal with load balancing; without
    it rank r's n = seq/cp queries see r whole blocks and its own triangle, so the last
    rank does 1 + 2(cp-1)n/(n+1) times the first's work and the ring waits for it."""
    n = 16
    seq = n * cp

    def work(rank, lb):
        q = positions(seq, cp, rank, lb)
        return sum(int((positions(seq, cp, src, lb)[None, :] <= q[:, None]).sum()) for src in range(cp))

    balanced, plain = [work(r, True) for r in range(cp)], [work(r, False) for r in range(cp)]
    assert len(set(balanced)) == 1 and sum(balanced) == sum(plain) == seq * (seq + 1) // 2
    assert plain[-1] / plain[0] == pytest.approx(1 + 2 * (cp - 1) * n / (n + 1))
    held = sorted(int(i) for r in range(cp) for i in positions(seq, cp, r, True))
    assert held == list(range(seq))  # every token on exactly one rank


def test_the_pinned_batch_itself_is_copied_to_the_device_then_sliced(monkeypatch):
    """A CUDA run's batch arrives in pinned memory (common/data.py); local_tokens copies that
    tensor itself to the device, without waiting (only a copy from pinned memory lets the
    host go on), and slices it there. Sliced on the host first, it was a new, pageable tensor
    whose copy made the host wait every step. Pinning needs an accelerator, so on a CPU the
    copies are watched instead: the one non-blocking copy reads the batch's own memory, whole,
    on the meta device (a stand-in for the GPU) as on the host, and the tokens are the host
    slice's, bit for bit."""
    import torch

    from common.parallelize.cp import Ring, local_tokens
    ring = Ring.__new__(Ring)  # no process group: the slice needs only the ring's shape
    ring.size, ring.rank, ring.load_balance, ring._on_device = 2, 1, True, {}
    batch = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))
    copies, to = [], torch.Tensor.to

    def watched(t, *args, **kwargs):
        if kwargs.get("non_blocking"):
            copies.append((t.data_ptr(), tuple(t.shape)))
        return to(t, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", watched)
    for device in (torch.device("meta"), torch.device("cpu")):
        copies.clear()
        got = local_tokens(batch, ring, device)
        assert copies == [(batch.data_ptr(), (3, 16))], device
        assert got.device == device and got.shape == (3, 8)
    assert torch.equal(got, batch[:, positions(16, 2, 1, True)])
