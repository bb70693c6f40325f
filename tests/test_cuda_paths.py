"""CUDA's code paths, taken on a CPU.

A GPU node once found bugs that hundreds of green CPU tests never saw: code that
chooses its path by device, whose CUDA side no CPU run takes. Two defences live here:

- every place in the training code that branches on the device says, beside the branch,
  which test takes its CUDA side on a CPU, or why none can (a "CUDA path:" comment); a
  test below finds every such branch and holds each comment to a test that exists;
- the tests those comments name, for the branches a CPU can take with the CUDA runtime
  stood in for (monkeypatched): process-group setup, the refusals a GPU can make, PowerSGD's
  synchronise, grouped-query attention's fp32 kernel choice, the peak FLOP/s table.

The optimizer's path (foreach on CUDA, never on a CPU by default) is taken by every run of
the suite: tests/conftest.py sets TUTORIAL_CUDA_PATHS=1 (common/training.py).
"""
from __future__ import annotations

import re
import sys

import pytest
import torch
import torch.nn.functional as F

from common import ROOT

sys.path.insert(0, str(ROOT))

# A branch on the device: a device type compared with "cuda", or CUDA's presence asked.
BRANCH = re.compile(r'[!=]= "cuda"|torch\.cuda\.is_available\(\)|torch\.cuda\.is_initialized\(\)')
MARK = "CUDA path:"
TEST_REF = re.compile(r"(tests/\w+\.py)::(\w+)")
WHERE = ["common", "step1_single_gpu", "step2_memory", "step3_multi_gpu"]
LOOK_BACK = 6  # the comment stands on the branch's line or at most this many lines above


def device_branches():
    for top in WHERE:
        for path in sorted((ROOT / top).rglob("*.py")):
            lines = path.read_text().splitlines()
            for i, line in enumerate(lines):
                code = line.split("#", 1)[0]
                if BRANCH.search(code):
                    yield path.relative_to(ROOT), i + 1, lines[max(0, i - LOOK_BACK):i + 1]


def test_every_device_branch_names_the_test_that_takes_its_cuda_side():
    """A branch on the device without a "CUDA path:" comment fails here, and so does a
    comment naming a test that does not exist. The comment is the reviewer's checklist:
    "tests/test_x.py::test_name" takes the CUDA side on a CPU; "no CPU test" says why none
    can (the CUDA runtime itself: events, the allocator, the RNG), and tools/gpu_check.py is
    where a GPU runs it."""
    found, bad = 0, []
    for path, lineno, window in device_branches():
        found += 1
        comment = " ".join(line.split("#", 1)[1] if "#" in line else line for line in window)
        said = comment[comment.rfind(MARK):] if MARK in comment else ""
        refs = TEST_REF.findall(said)
        if not refs and "no CPU test" not in said:
            bad.append(f"{path}:{lineno}: no 'CUDA path:' comment naming a test, or 'no CPU test' and why")
        for test_path, name in refs:
            test_file = ROOT / test_path
            if not test_file.exists() or not re.search(rf"^def {name}\(", test_file.read_text(), re.M):
                bad.append(f"{path}:{lineno}: names {test_path}::{name}, which does not exist")
    assert found > 30, f"only {found} device branches found: is the pattern still right?"
    assert not bad, "\n".join(bad)


# ---- process-group setup on a GPU node -------------------------------------------------------
class _Stop(Exception):
    pass


def test_a_gpu_rank_binds_its_gpu_before_the_process_group(monkeypatch):
    """--device cuda under torchrun: the rank's GPU is made current before anything touches
    CUDA (else every rank opens a context on GPU 0), then NCCL is told the device
    (device_id), which on a CPU raises; LOCAL_RANK's GPU, not RANK's."""
    import torch.distributed as dist

    from common import distributed as d

    calls = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda dev: calls.append(("set_device", dev)))

    def init_process_group(backend, **kwargs):
        calls.append(("init_process_group", backend, kwargs.get("device_id")))
        raise _Stop

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    for k, v in {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(_Stop):
        with d.distributed("cuda"):
            pass
    gpu = torch.device("cuda", 1)
    assert calls == [("set_device", gpu), ("init_process_group", "nccl", gpu)]
    # and a CPU rank: gloo, no device_id (it would raise), no set_device
    calls.clear()
    with pytest.raises(_Stop):
        with d.distributed("cpu"):
            pass
    assert calls == [("init_process_group", "gloo", None)]


def test_a_dry_run_on_a_gpu_binds_it(monkeypatch):
    """--fake-world-size with --device cuda: the one process sets its GPU current first."""
    import torch.distributed as dist

    from common import distributed as d

    calls = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda dev: calls.append(("set_device", dev)))

    def init_process_group(backend, **kwargs):
        calls.append(("init_process_group", backend))
        raise _Stop

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(_Stop):
        next(d._dry_run("cuda", 8, 3))  # the generator the scripts' ``distributed()`` runs
    assert calls == [("set_device", torch.device("cuda", 0)), ("init_process_group", "fake")]


# ---- what a GPU refuses ---------------------------------------------------------------------
def test_what_an_older_gpu_refuses(monkeypatch):
    """bf16 autocast on a GPU without bf16, --compile without Triton, --float8 below compute
    capability 8.9: one sentence each, naming the GPU. A CPU refuses none of them."""
    from common.parallelize.float8 import float8_unsupported
    from common.training import amp_unsupported, compile_unsupported

    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    # as PyTorch answers on a V100: bf16 "supported" by emulation, not by the hardware
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100-SXM2-16GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 0))
    assert amp_unsupported(gpu, "bf16") == ("--amp bf16: Tesla V100-SXM2-16GB has no bf16 support (it needs an "
                                            "Ampere or newer GPU); use --amp fp16, which adds loss scaling.")
    assert amp_unsupported(gpu, "fp16") is None and amp_unsupported(cpu, "bf16") is None
    assert amp_unsupported(cpu, "fp16").startswith("--amp fp16 needs a CUDA GPU")
    assert float8_unsupported(gpu) == ("--float8 needs a GPU with float8 tensor cores (compute capability 8.9 or "
                                       "newer: L4, L40, H100, ...); this Tesla V100-SXM2-16GB has none: drop --float8.")
    assert float8_unsupported(cpu) is None
    import torch.utils._triton as triton_utils
    monkeypatch.setattr(triton_utils, "has_triton", lambda: False)
    assert compile_unsupported(gpu) == "--compile on CUDA needs Triton (pip install triton); install it or drop --compile."
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert float8_unsupported(gpu) is None


def test_peak_flops_by_gpu_name(monkeypatch):
    """MFU's denominator: the dense peak by the GPU's exact name (an H100 PCIe or NVL is not an
    SXM part, an H200 NVL not an H200), with the sheet it comes from; TF32's for fp32 when TF32
    matmuls are on; none for a CPU or a GPU we have no sheet for."""
    from common.measure.metrics import peak_flops

    gpu = torch.device("cuda", 0)
    for name, want in {"NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100 PCIe": 756e12, "NVIDIA H100 NVL": 835e12,
                       "NVIDIA H200": 989e12, "NVIDIA H200 NVL": 835e12, "NVIDIA A100-SXM4-80GB": 312e12,
                       "NVIDIA GeForce RTX 4090": None}.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, n=name: n)
        peak, got_name, source = peak_flops(gpu, "bf16")
        assert (peak, got_name) == (want, name)
        assert (source is None) == (want is None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200 NVL")
    assert peak_flops(gpu, "bf16")[2] == "835 TFLOP/s, bf16 dense, H200 NVL data sheet"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    # (set and restored by hand: the flag is a property of torch's cuBLAS module, which
    # monkeypatch's undo would delete, being no attribute of the object's own)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        assert peak_flops(gpu, "fp32")[0] == 494.5e12
        torch.backends.cuda.matmul.allow_tf32 = False
        assert peak_flops(gpu, "fp32")[0] == 67e12
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    assert peak_flops(torch.device("cpu"), "bf16")[0] is None


def test_expandable_segments_reach_a_running_allocator(monkeypatch):
    """--expandable-segments in a process whose CUDA allocator has started (a shared process
    running one run after another): set on the running allocator, and an earlier run's setting
    undone for a run without the flag; before the allocator starts, the variable alone."""
    import os

    from common import cli
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append)
    monkeypatch.setattr(cli, "_EXPANDABLE", {"set": False})
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    cli.use_expandable_segments(True)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64,expandable_segments:True" and calls == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    cli.use_expandable_segments(False)  # the next run in the same process, without the flag
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64" and calls == ["expandable_segments:False"]
    cli.use_expandable_segments(False)  # never set by us: nothing to undo
    assert calls == ["expandable_segments:False"]
    cli.use_expandable_segments(True)
    assert calls[-1] == "expandable_segments:True"


# ---- PowerSGD on a GPU machine whose ranks train on the CPU ----------------------------------
def test_powersgd_skips_cudas_synchronize_for_a_cpu_bucket(monkeypatch):
    from common.parallelize import comm_hooks

    synced = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: synced.append(d))
    real = torch.cuda.synchronize
    with comm_hooks._no_cuda_sync_on_cpu(torch.device("cpu")):
        torch.cuda.synchronize(torch.device("cpu"))  # skipped: a CPU bucket
        torch.cuda.synchronize(torch.device("cuda", 0))  # passed on
    assert synced == [torch.device("cuda", 0)] and torch.cuda.synchronize is real
    with comm_hooks._no_cuda_sync_on_cpu(torch.device("cuda", 0)):  # a GPU bucket: untouched
        assert torch.cuda.synchronize is real


# ---- grouped-query attention's fp32 kernel on CUDA -------------------------------------------
def test_fp32_grouped_attention_takes_the_expanded_heads_on_cuda():
    """CUDA's flash kernel does grouped-query attention in half precision only: in fp32 the
    model repeats each k/v head for its q heads (so the memory-efficient kernel runs, not the
    math one that stores seq x seq scores). The same numbers either way; only CUDA in fp32
    expands."""
    from common.model import kv_for_kernel

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 16, h, 8, generator=g) for h in (4, 2, 2))
    k2, v2, grouped = kv_for_kernel(q, k, v, "cuda")
    assert not grouped and k2.shape == v2.shape == q.shape
    assert kv_for_kernel(q, k, v, "cpu")[2] and kv_for_kernel(q.bfloat16(), k.bfloat16(), v.bfloat16(), "cuda")[2]
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    expanded = F.scaled_dot_product_attention(t(q), t(k2), t(v2), is_causal=True)
    gqa = F.scaled_dot_product_attention(t(q), t(k), t(v), is_causal=True, enable_gqa=True)
    assert torch.allclose(expanded, gqa, atol=1e-6)
