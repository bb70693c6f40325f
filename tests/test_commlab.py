"""The communication lab: busbw formulas, the ring all-reduce, DDP comm hooks, DP vs DDP.

Distributed checks launch real processes (torchrun, gloo on CPU) once per script and
assert on the JSON they write; the formulas are checked in-process.
"""
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common import ROOT  # noqa: E402
sys.path.insert(0, str(ROOT))

import launch  # noqa: E402

from common.parallelize.comm_hooks import (BF16_REFUSED, all_reduce_bytes, bf16_hook_supported,  # noqa: E402
                               check_comm_hook, register_comm_hook)
from common.errors import UserError  # noqa: E402
from common.model import build_model, count_params, get_config  # noqa: E402


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "step3_multi_gpu" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _torchrun(nproc: int, script: str, *args, timeout: int = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(ROOT / "step3_multi_gpu" / script), "--device", "cpu", *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = launch.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, f"{script} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return r


# ---- formulas, in-process --------------------------------------------------------------
def test_busbw_formulas_match_nccl_tests():
    bench = _load("bench_collectives")
    for n in (1, 2, 3, 4, 8):
        assert bench.bus_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
        assert bench.bus_factor("all_gather", n) == pytest.approx((n - 1) / n)
        assert bench.bus_factor("reduce_scatter", n) == pytest.approx((n - 1) / n)
        assert bench.bus_factor("broadcast", n) == 1.0
        assert bench.bus_factor("send_recv", n) == 1.0
    # 1 GB in 0.5 s on 4 ranks: algbw 2 GB/s; a ring all-reduce moved 1.5x that per link
    assert bench.alg_bandwidth(1e9, 0.5) == pytest.approx(2.0)
    assert bench.bus_bandwidth("all_reduce", 1e9, 0.5, 4) == pytest.approx(3.0)
    assert bench.bus_bandwidth("all_gather", 1e9, 0.5, 4) == pytest.approx(1.5)
    assert bench.bus_bandwidth("send_recv", 1e9, 0.5, 4) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        bench.bus_factor("all_to_all", 4)
    # the alpha-beta fit recovers a synthetic t = alpha + S / B
    alpha, bw = 50e-6, 10e9
    rows = [{"bytes": s, "time_s": alpha + s / bw, "algbw_GBps": s / (alpha + s / bw) / 1e9}
            for s in (2 ** k for k in range(10, 31))]
    model = bench.latency_bandwidth_model(rows)
    assert model["alpha_s"] == pytest.approx(alpha, rel=0.05)
    assert model["bandwidth_Bps"] == pytest.approx(bw, rel=0.01)
    assert model["crossover_bytes"] == pytest.approx(alpha * bw, rel=0.06)


def test_ring_byte_formula():
    ring = _load("ring_allreduce")
    for n in (2, 3, 4, 5, 8):
        for numel in (1, 2, n - 1, n, 7, 1001, 4096, 65537):
            c = ring.chunk_numels(numel, n)
            assert sum(c) == numel and max(c) - min(c) <= 1
            assert c == [t.numel() for t in torch.empty(numel).tensor_split(n)]
            sent = [ring.expected_sent_bytes(numel, 4, n, r) for r in range(n)]
            # over the ring, exactly 2(n-1)/n of the tensor per rank on average ...
            assert sum(sent) == 2 * (n - 1) * numel * 4
            # ... each rank within two elements of it, and exactly it when n divides numel
            assert all(abs(s - 2 * (n - 1) / n * numel * 4) <= 2 * 4 for s in sent)
            if numel % n == 0:
                assert all(s == 2 * (n - 1) * numel * 4 // n for s in sent)


def _powersgd_bytes_by_hand(model, rank: int) -> int:
    """PowerSGD's bytes for the Transformer, from its shapes (min_compression_rate 2)."""
    total = 0
    for p in model.parameters():
        if p.dim() == 1:  # norm gains: never worth compressing
            total += p.numel()
            continue
        rows, cols = p.shape
        r = min(rows, cols, rank)
        total += r * (rows + cols) if 2 * r * (rows + cols) < rows * cols else rows * cols
    return 4 * total


def test_comm_hook_byte_formulas_and_errors():
    cfg = get_config("debug")
    model = build_model(cfg, "cpu")
    n = count_params(cfg)
    assert all_reduce_bytes(model.parameters(), "none") == 4 * n
    assert all_reduce_bytes(model.parameters(), "fp16") == 2 * n
    assert all_reduce_bytes(model.parameters(), "bf16") == 2 * n
    assert all_reduce_bytes(model.parameters(), "powersgd", compressing=False) == 4 * n
    for r in (1, 2, 4):
        expected = _powersgd_bytes_by_hand(model, r)
        assert all_reduce_bytes(model.parameters(), "powersgd", matrix_approximation_rank=r) == expected
        assert expected < 4 * n / 8
    # what cannot work says so in one line, before any DDP is touched
    with pytest.raises(UserError, match="at least 2"):
        register_comm_hook(object(), "powersgd", start_powerSGD_iter=1)
    with pytest.raises(UserError, match="--powersgd-rank must be at least 1"):
        check_comm_hook("powersgd", matrix_approximation_rank=0)
    with pytest.raises(UserError, match="choose one of none, fp16, bf16, powersgd"):
        check_comm_hook("int8")
    if not bf16_hook_supported():  # CPU-only builds: DDP refuses bf16_compress_hook
        with pytest.raises(UserError) as e:
            register_comm_hook(object(), "bf16")
        assert str(e.value) == BF16_REFUSED and "use --comm-hook fp16" in str(e.value)


# ---- distributed -----------------------------------------------------------------------
def test_ring_allreduce_equals_library_on_2_3_4_ranks(tmp_path):
    _torchrun(4, "ring_allreduce.py", "--out", tmp_path, "--min-size", 4096, "--max-size", 16384, "--iters", 2)
    res = json.loads((tmp_path / "ring_allreduce.json").read_text())
    checks = res["checks"]
    assert {c["ring_size"] for c in checks} == {2, 3, 4}
    assert {c["dtype"] for c in checks} == {"float32", "float64", "bfloat16", "float16", "int32", "int64"}
    assert any(c["numel"] % c["ring_size"] for c in checks)  # awkward sizes were there
    bad = [c for c in checks if not c["ok"]]
    assert not bad, bad[:3]
    for c in checks:
        assert c["sent_bytes"] == c["expected_sent_bytes"], c
        assert c["received_bytes"] == c["sent_bytes"] or c["numel"] % c["ring_size"], c
        if not c["dtype"].startswith(("float", "bfloat")):
            assert c["equal_to_library"], c  # integer sums do not depend on the order
    # averaged over the ring, exactly 2(n-1)/n of the tensor's bytes per rank
    groups = {}
    for c in checks:
        groups.setdefault((c["ring_size"], c["dtype"], c["numel"]), []).append(c)
    for (k, _, _), cs in groups.items():
        assert len(cs) == k
        assert sum(c["sent_bytes"] for c in cs) / k == pytest.approx(cs[0]["two_n_minus_1_over_n_bytes"], abs=1e-9)
    assert len(res["timings"]) == 2 and (tmp_path / "ring_vs_allreduce.png").stat().st_size > 10_000


def test_bench_collectives_tiny_run(tmp_path):
    r = _torchrun(2, "bench_collectives.py", "--out", tmp_path, "--min-size", 1024, "--max-size", 4096,
                  "--iters", 3, "--budget", 0.01, "--blocks", 1)
    res = json.loads((tmp_path / "collectives.json").read_text())
    rows = res["rows"]
    assert {(row["op"], row["bytes"]) for row in rows} == {
        (op, s) for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv")
        for s in (1024, 2048, 4096)}
    for row in rows:
        assert row["time_s"] > 0
        assert row["algbw_GBps"] == pytest.approx(row["bytes"] / row["time_s"] / 1e9)
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * res["bus_factor"][row["op"]])
    assert res["bus_factor"] == {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5,
                                 "broadcast": 1.0, "send_recv": 1.0}
    assert "# all_reduce: busbw = algbw x 1" in r.stdout
    assert (tmp_path / "collectives.png").stat().st_size > 10_000
    assert "| 4 KiB |" in (tmp_path / "collectives.md").read_text()


def test_comm_hooks_cut_bytes_and_still_train(tmp_path):
    text = tmp_path / "text.txt"  # real text, small enough to load fast on every rank
    import sysconfig
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text.write_bytes(b"".join((stdlib / f).read_bytes() for f in ("argparse.py", "textwrap.py", "dataclasses.py")))
    # 8 layers: over DDP's 1 MiB first bucket, so PowerSGD runs on two buckets (the case
    # where gloo needs common/parallelize/comm_hooks.py to keep the collectives in order)
    steps, start, rank, layers = 5, 2, 2, 8
    _torchrun(2, "compare_comm_hooks.py", "--model", "debug", "--n-layers", layers, "--steps", steps, "--seq-len", 32,
              "--global-batch-size", 4, "--lr", 1e-2, "--warmup-steps", 1, "--data", text, "--eval-batches", 0,
              "--powersgd-rank", rank, "--powersgd-start-iter", start, "--out", tmp_path / "out", timeout=150)
    res = json.loads((tmp_path / "out" / "comm_hooks.json").read_text())
    hooks = res["hooks"]
    cfg = get_config("debug", n_layers=layers)
    full = 4 * count_params(cfg)
    low_rank = _powersgd_bytes_by_hand(build_model(cfg, "cpu"), rank)

    assert hooks["none"]["bytes"] == [full] * steps  # DDP: 4 bytes per parameter per step
    assert hooks["fp16"]["bytes"] == [full // 2] * steps  # exactly 2x less
    # PowerSGD: plain all-reduce until start_powerSGD_iter, then P and Q (counted although
    # PowerSGD sends them from Future callbacks on gloo's thread) plus the 1-D tensors
    assert hooks["powersgd"]["bytes"] == [full] * start + [low_rank] * (steps - start)
    assert full / low_rank > 15

    for hook, h in hooks.items():
        assert h["all_match"], hook
        assert h["losses"][-1] < h["losses"][0] - 1.0, (hook, h["losses"])  # still trains
    # same seed and batches: the first step is identical, fp16 stays within rounding of fp32
    assert hooks["fp16"]["losses"][0] == hooks["none"]["losses"][0] == hooks["powersgd"]["losses"][0]
    assert hooks["fp16"]["losses"] == pytest.approx(hooks["none"]["losses"], rel=1e-3)
    assert hooks["powersgd"]["losses"] == pytest.approx(hooks["none"]["losses"], rel=5e-2)
    if bf16_hook_supported():
        assert hooks["bf16"]["bytes"] == [full // 2] * steps
    else:
        assert res["skipped"] == {"bf16": BF16_REFUSED} and "bf16" not in hooks
    assert (tmp_path / "out" / "comm_hooks.png").stat().st_size > 10_000
    assert math.isfinite(hooks["powersgd"]["final_loss"])


def test_dp_vs_ddp_explains_and_exits_cleanly_without_gpus():
    # --device cpu: what it says without GPUs, whatever this machine has (with 2+ it would time them)
    r = launch.run([sys.executable, str(ROOT / "step3_multi_gpu" / "dp_vs_ddp.py"), "--model", "small",
                    "--device", "cpu"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    out = r.stdout
    assert out.startswith("dp_vs_ddp compares nn.DataParallel with DDP on 2 or more CUDA GPUs; this run is on CPU, ")
    assert "so there is nothing to time here." in out.splitlines()[0]
    w = 4 * count_params(get_config("small"))
    from common.measure.byte_units import fmt_bytes
    assert f"W = {fmt_bytes(w)} of fp32 weights) on n = 4 GPUs" in out
    assert f"(n-1) W = {fmt_bytes(3 * w)}" in out and f"2(n-1) W = {fmt_bytes(6 * w)}" in out
    assert "python step3_multi_gpu/dp_vs_ddp.py" in out


def test_powersgd_on_cpu_ranks_of_a_machine_with_a_gpu(monkeypatch):
    """PowerSGD calls torch.cuda.synchronize(bucket device) whenever CUDA is available; on a
    GPU machine whose ranks train on the CPU that raised "Expected a cuda device, but got:
    cpu". Simulated here: CUDA reported present, and a CUDA sync of a CPU device raises as it
    does there. The hook must compress (after start_powerSGD_iter) and never sync a CPU device."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from common.parallelize.comm_hooks import register_comm_hook

    synced = []

    def fake_sync(device=None):
        if device is not None and torch.device(device).type == "cpu":
            raise ValueError("Expected a cuda device, but got: cpu")
        synced.append(device)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", fake_sync)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)))
        state = register_comm_hook(model, "powersgd", start_powerSGD_iter=2, matrix_approximation_rank=1)
        x = torch.randn(8, 32)
        for _ in range(4):
            model(x).square().mean().backward()
        assert state.iter >= 3  # past start_powerSGD_iter: the compressing path (and its sync) ran
        assert torch.cuda.synchronize is fake_sync  # the shim is gone again
        # Drain gloo's queue (the hook's last all-reduce) and drop DDP's reducer while its group
        # is alive: freeing it after destroy_process_group once left gloo's destructor joining a
        # busy worker thread forever.
        dist.barrier()
        del model, state
    finally:
        dist.destroy_process_group()
