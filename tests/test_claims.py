"""Claims of the README's prose that a number can prove (issue 26, "every claim right").

One 2-rank gloo launch (tests/drivers/claims.py) for the distributed facts; the rest run in
this process in a few seconds. Each test prints the number the README quotes (pytest -s).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from common.measure import theory
from common.measure.comm import RING_FACTOR
from tools.estimate import trace
from common.model import get_config
from conftest import ROOT

W = 4  # the README's chapter 3 runs on four ranks


@pytest.fixture(scope="module")
def gloo(tmp_path_factory):
    out = tmp_path_factory.mktemp("claims") / "claims.json"
    env = {k: v for k, v in os.environ.items() if k != "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(ROOT / "tests" / "drivers" / "claims.py"), str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


def test_gloo_has_avg(gloo):
    """README ch. 3, DDP: ReduceOp.AVG on gloo returns the mean on torch 2.13."""
    print(f"AVG on {gloo['world']} gloo ranks: {gloo['avg']} (mean {gloo['mean']})")
    assert gloo["avg"] == pytest.approx(gloo["mean"])


def test_nccl_async_error_handling(gloo):
    """README ch. 4: torchrun puts 1 in its workers' environment; ProcessGroupNCCL's own
    default (a process not started by torchrun) is 3, SkipCleanUp."""
    assert gloo["async_error_handling"] == "1"
    header = Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp"
    if not header.exists():
        pytest.skip("this torch installs no c10d headers")
    text = header.read_text()
    assert "default value (3 - SkipCleanUp)" in text and "SkipCleanUp = 3" in text


def test_fsdp_casts_rope_passed_as_forward_input(gloo):
    """README ch. 3, the dtype bug: the root's RoPE buffers stay fp32, but passed to a block
    they are forward inputs, and FSDP2 casts those (cast_forward_inputs)."""
    assert gloo["root_buffer"] == "torch.float32"
    assert gloo["cos_in_block"] == gloo["x_in_block"] == "torch.bfloat16"


def test_cpu_autocast_runs_norm_ops_in_bf16_and_our_rmsnorm_upcasts():
    """README 2.1: which ops autocast keeps in fp32 depends on the device. On the CPU
    softmax, sum, pow and rsqrt stay bf16 (CUDA's list runs them in fp32); cross-entropy is
    fp32 on both. Our RMSNorm (PyTorch's rms_norm) computes in fp32 whatever its input."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from common.model import RMSNorm
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kept = {name: op().dtype for name, op in {
            "softmax": lambda: F.softmax(x, -1), "log_softmax": lambda: F.log_softmax(x, -1),
            "layer_norm": lambda: F.layer_norm(x, (8,)), "sum": lambda: x.sum(), "pow": lambda: x.pow(2),
            "rsqrt": lambda: x.abs().rsqrt()}.items()}
        ce = F.cross_entropy(x, torch.randint(0, 8, (4,))).dtype

    class Dtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.rsqrt, torch.ops.aten.pow, torch.ops.aten.mean):
                self.seen.add(args[0].dtype)
            return func(*args, **(kwargs or {}))

    with torch.autocast("cpu", dtype=torch.bfloat16), Dtypes() as mode:
        RMSNorm(8, 1e-5)(x)
    assert set(kept.values()) == {torch.bfloat16}, kept
    assert ce == torch.float32
    assert mode.seen == {torch.float32}


def test_checkpoint_wrapper_renames_parameters_but_not_state_dict_keys():
    """README 2.2: PyTorch's checkpoint_wrapper adds `_checkpoint_wrapped_module` to module
    paths and parameter names, and strips it from state_dict keys; apply_ac changes neither."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from common.parallelize.ac import apply_ac
    from common.model import build_model
    m = torch.nn.Sequential(torch.nn.Linear(2, 2))
    m[0] = checkpoint_wrapper(m[0])
    assert [n for n, _ in m.named_parameters()] == ["0._checkpoint_wrapped_module.weight",
                                                    "0._checkpoint_wrapped_module.bias"]
    assert list(m.state_dict()) == ["0.weight", "0.bias"]
    model = build_model(get_config("debug"), "cpu")
    names, keys = [n for n, _ in model.named_parameters()], list(model.state_dict())
    apply_ac(model, "full")
    assert [n for n, _ in model.named_parameters()] == names and list(model.state_dict()) == keys


def _sent(strategy: str, cfg, world: int, broadcast_factor) -> tuple[int, float]:
    """(logical, on-the-wire) bytes a rank sends per step: common/measure/theory.py's counts, and
    common/measure/comm.py's ring factors (a broadcast as given: each rank is root for 1/W)."""
    logical = theory.comm_bytes(strategy, cfg, world)
    factors = dict(RING_FACTOR, broadcast=broadcast_factor)
    return sum(logical.values()), sum(v * factors[k.split(" (")[0]](world) for k, v in logical.items())


def test_logical_and_wire_ratios_to_ddp():
    """README ch. 3 and the comparison: ZeRO-3 sends 3x DDP's logical bytes (a little less:
    the root is gathered once) but 1.5x on the wire; FSDP's ZeRO-2 2x logical, 1x on the
    wire; PyTorch's ZeRO-1 (all-reduce + broadcast) 2x logical, 1.5x on the wire when each
    rank broadcasts its 1/W, 1 + W / (2(W - 1)) if the root's cost is put on every rank."""
    cfg = get_config("small")
    avg_root = lambda n: (n - 1) / n  # noqa: E731  each of the n - 1 others receives every byte once
    ddp = _sent("ddp", cfg, W, avg_root)
    ratios = {}
    for s in ("zero1", "fsdp_zero2", "fsdp_zero3"):
        logical, wire = _sent(s, cfg, W, avg_root)
        ratios[s] = (logical / ddp[0], wire / ddp[1])
    upper = _sent("zero1", cfg, W, lambda n: 1.0)[1] / ddp[1]
    print({k: f"{a:.3f}x logical, {b:.3f}x wire" for k, (a, b) in ratios.items()},
          f"zero1 with the root's cost on every rank {upper:.3f}x")
    assert 2.9 < ratios["fsdp_zero3"][0] <= 3.0 and 1.45 < ratios["fsdp_zero3"][1] <= 1.5
    assert ratios["fsdp_zero2"][0] == pytest.approx(2.0, rel=1e-3)
    assert ratios["fsdp_zero2"][1] == pytest.approx(1.0, rel=1e-3)
    assert ratios["zero1"] == pytest.approx((2.0, 1.5))
    assert upper == pytest.approx(1 + W / (2 * (W - 1))) and upper > ratios["zero1"][1]


def test_zero_savings_depend_on_what_a_parameter_holds():
    """README ch. 3, the ZeRO table: with fp32 weights and gradients (our recipe, 4 + 4 + 8
    bytes) ZeRO-1 saves under 2x however many ranks; with the paper's 2 + 2 + 12 it nears 4x."""
    cfg = get_config("small")
    for w in (4, 64, 1024):
        ddp, z1 = (sum(theory.model_state(s, cfg, w).values()) for s in ("ddp", "zero1"))
        paper = 16 / (2 + 2 + 12 / w)
        print(f"W={w}: ZeRO-1 saves {ddp / z1:.2f}x here, {paper:.2f}x with the paper's bytes")
        assert ddp / z1 < 2 and (w < 64 or paper > 3.7)


def test_sequence_parallel_activations_are_not_a_quarter():
    """README ch. 3b: PyTorch's SP keeps the all-gathered full-sequence input of the
    column-parallel layers, so 4-way TP + SP keeps 0.32 of one device's activations, not
    0.25 (traced under FakeTensorMode: 90.7 -> 41.8 -> 29.1 MiB, chapter 3b's run)."""
    cfg = get_config("small", n_layers=8)
    act = {}
    for name, kw in (("single", {}), ("tp", {"tp": W}), ("tp_sp", {"tp": W, "sequence_parallel": True})):
        plan = theory.Plan(cfg, "tp" if kw else "single", world=W if kw else 1, batch=8, seq_len=64, **kw)
        act[name] = trace(plan)["activations"]
        assert act[name] == pytest.approx(theory.predict(plan)["activations"], rel=0.01), name
    ratio = act["tp_sp"] / act["single"]
    print({k: f"{v / 2**20:.1f} MiB" for k, v in act.items()}, f"TP + SP / single = {ratio:.2f}")
    assert 0.30 < ratio < 0.34


def test_a_128k_vocabulary_output_layer_in_transformer_layers():
    """README ch. 3b, uneven pipeline splits: Llama 3's 128,256-token output projection weighs
    2.4 of the 8B's transformer layers and 4.3 of the 1B's."""
    got = {}
    for name in ("8b", "1b"):
        shapes = theory.param_shapes(get_config(name, vocab_size=128256))
        layer = sum(math.prod(s) for k, s in shapes.items() if k.startswith("layers.0."))
        got[name] = math.prod(shapes["output.weight"]) / layer
    print({k: f"{v:.2f} layers" for k, v in got.items()})
    assert got["8b"] == pytest.approx(2.4, abs=0.05) and got["1b"] == pytest.approx(4.3, abs=0.05)


def test_float8_default_recipe_casts_the_gradient_to_e5m2():
    """README 2.6: torchao's default Float8LinearConfig casts the input and the weight to e4m3
    (largest 448, rounding up to 1/16) and the incoming gradient to e5m2 (largest 57344,
    rounding up to 1/8), both in forward's matmul and in backward's two. (torchao's recipe:
    skipped where torchao is not installed, as tests/test_float8.py is.)"""
    pytest.importorskip("torchao")
    from common.parallelize.float8 import _torchao_float8
    config = _torchao_float8().Float8LinearConfig()
    dtypes = {name: getattr(config, f"cast_config_{name}").target_dtype for name in (
        "input", "weight", "grad_output", "input_for_grad_weight", "weight_for_grad_input",
        "grad_output_for_grad_weight")}
    rounding = {d: torch.finfo(d).eps / 2 for d in (torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16)}
    print(dtypes, {str(d): (torch.finfo(d).max, r) for d, r in rounding.items()})
    assert {dtypes[k] for k in ("input", "weight", "input_for_grad_weight", "weight_for_grad_input")} == {
        torch.float8_e4m3fn}
    assert dtypes["grad_output"] == dtypes["grad_output_for_grad_weight"] == torch.float8_e5m2
    assert (torch.finfo(torch.float8_e4m3fn).max, torch.finfo(torch.float8_e5m2).max) == (448, 57344)
    assert list(rounding.values()) == [1 / 16, 1 / 8, 1 / 256]


def test_moe_parameters_used_per_token():
    """expert_parallel.md: 1b-moe holds 3.39B parameters and a token uses 0.97B of them: two
    experts of half the width are the dense 1b's MLP, plus the router."""
    from common.model import count_params
    moe, dense = get_config("1b-moe"), get_config("1b")
    total, active = count_params(moe), count_params(moe, active=True)
    print(f"1b-moe: {active:,} of {total:,} per token; 1b: {count_params(dense):,}")
    assert (total, active) == (3_390_375_936, 974_456_832)
    assert active - count_params(dense) == moe.n_layers * moe.dim * moe.n_experts  # the routers


def test_1b_shape_at_llama_vocabulary():
    """will_it_fit.md: our 1b at Llama 3's 128,256-token vocabulary has 1,498,482,688 parameters,
    22.33 GiB at 16 bytes each: its embedding and output layer are separate matrices. Llama 3.2
    1B ties them (one matrix of 262.7M): 1,235,814,400 parameters, 18.42 GiB."""
    from common.model import count_params
    cfg = get_config("1b", vocab_size=128256)
    ours = count_params(cfg)
    tied = ours - cfg.vocab_size * cfg.dim
    print(f"ours {ours:,} = {16 * ours / 2**30:.2f} GiB; tied {tied:,} = {16 * tied / 2**30:.2f} GiB")
    assert ours == 1_498_482_688 and f"{16 * ours / 2**30:.2f}" == "22.33"
    assert tied == 1_235_814_400 and f"{16 * tied / 2**30:.2f}" == "18.42"


def test_deepspeed_persistence_threshold_leaves_the_mlp_sharded():
    """deepspeed.md: ZeRO-3 keeps parameters under stage3_param_persistence_threshold (1e5
    elements by default) whole on every rank. In `small` the twelve MLP matrices (w1, w2, w3
    of 4 blocks, 196,608 elements each, 72% of the parameters) are above it and sharded."""
    shapes = theory.param_shapes(get_config("small"))
    sizes = {k: math.prod(s) for k, s in shapes.items()}
    big = {k: n for k, n in sizes.items() if n >= 1e5}
    share = sum(big.values()) / sum(sizes.values())
    print(f"{len(big)} of {len(sizes)} tensors >= 1e5 elements: {sorted({k.split('.')[-2] for k in big})}, "
          f"{share:.1%} of the parameters")
    assert {k.split(".")[-2] for k in big} == {"w1", "w2", "w3"} and set(big.values()) == {196_608}
    assert len(big) == 12 and 0.71 < share < 0.73


def test_pytorch_defaults_the_pages_name():
    """FSDP2's MixedPrecisionPolicy returns its param_dtype unless output_dtype is set (our
    root sets fp32, will_it_fit.md); PyTorch's context_parallel all-gathers K/V unless
    set_rotate_method("alltoall") (context_parallel.md); fp32 matmuls are full fp32 until
    set_float32_matmul_precision("high") allows TF32 (README 2.1)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor.experimental._attention import _cp_options, _RotateMethod
    assert MixedPrecisionPolicy(param_dtype=torch.bfloat16).output_dtype is None
    assert _cp_options.rotate_method == _RotateMethod.ALL_GATHER
    assert torch.get_float32_matmul_precision() == "highest"


def test_autocast_keeps_one_weight_copy_per_region():
    """will_it_fit.md, pipelines: autocast caches a weight's bf16 copy until its outermost
    region ends. A region per micro-batch's forward (train_pp.py's, per stage) saves one copy
    per micro-batch for backward; one region around all four saves a single copy."""
    lin = torch.nn.Linear(64, 32)

    def copies(one_region: bool) -> int:
        seen, outs = set(), []

        def pack(t):
            if t.dtype == torch.bfloat16 and sorted(t.shape) == [32, 64]:
                seen.add(t.untyped_storage().data_ptr())
            return t
        x = torch.randn(8, 64, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16) if one_region else contextlib.nullcontext():
                for _ in range(4):
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        outs.append(lin(x))  # kept, as a pipeline keeps micro-batches in flight
        return len(seen)
    got = {"a region per forward": copies(False), "one region around all": copies(True)}
    print(got)
    assert got == {"a region per forward": 4, "one region around all": 1}
