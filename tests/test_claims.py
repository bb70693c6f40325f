"""Claims of the README's prose that a number can prove ("every claim right").

One 2-rank gloo launch (tests/drivers/claims.py) for the distributed facts; the rest run in
this process in a few seconds. Each test prints the number the README quotes (pytest -s).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from common.measure import formulas, splits, theory
from common.measure.plan import Plan
from common.measure.comm import RING_FACTOR
from tools.estimate import trace
from common.model import get_config
import launch
from conftest import ROOT

W = 4  # the README's chapter 3 runs on four ranks


@pytest.fixture(scope="module")
def gloo(tmp_path_factory):
    out = tmp_path_factory.mktemp("claims") / "claims.json"
    env = {k: v for k, v in os.environ.items() if k != "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
    r = launch.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
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


def test_sequence_parallel_norm_gains_are_summed_once_not_in_adamw(gloo):
    """Step 3's TP chapter: sequence parallelism leaves each norm gain's gradient Partial after
    backward, and AdamW's step then all-reduces each three times inside DTensor's operators;
    reduce_partial_grads (run before clipping) sums each once, and the step runs none."""
    got = gloo["sp_norm_gains"]
    print(got)
    gains = 2 * get_config("debug").n_layers + 1
    assert got["left"] == {"partial gains": gains, "in reduce_partial_grads": 0, "in AdamW's step": 3 * gains}
    assert got["reduced"] == {"partial gains": gains, "in reduce_partial_grads": gains, "in AdamW's step": 0}


def test_fsdp_casts_rope_passed_as_forward_input(gloo):
    """README ch. 3, the dtype bug: the root's RoPE buffers stay fp32, but passed to a block
    they are forward inputs, and FSDP2 casts those (cast_forward_inputs)."""
    assert gloo["root_buffer"] == "torch.float32"
    assert gloo["cos_in_block"] == gloo["x_in_block"] == "torch.bfloat16"


def test_tensor_parallel_embedding_gradient_is_replicated(gloo):
    """will_it_fit.md, model state: the token embedding is split by vocabulary, but DTensor's
    embedding backward returns its gradient replicated, the whole (V, d) on every TP rank;
    the formula (common/measure/theory.py:predict) counts that, not a 1/tp share."""
    e = gloo["tp_embedding"]
    assert e["weight"] == ["S(0)"] and e["weight_local"] == [e["full"][0] // gloo["world"], e["full"][1]]
    assert e["grad"] == ["R"] and e["grad_local"] == e["full"], e


def test_cpu_autocast_runs_norm_ops_in_bf16_and_our_rmsnorm_upcasts():
    """README 2.1: which ops autocast keeps in fp32 depends on the device. On the CPU
    softmax, sum, pow and rsqrt are on neither list: they run in their input's dtype, bf16
    or fp32 (CUDA's list runs them in fp32); cross-entropy is fp32 on both. Our RMSNorm
    (PyTorch's rms_norm) computes in fp32 whatever its input."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from common.model import RMSNorm
    def dtypes(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return {name: op().dtype for name, op in {
                "softmax": lambda: F.softmax(x, -1), "log_softmax": lambda: F.log_softmax(x, -1),
                "layer_norm": lambda: F.layer_norm(x, (8,)), "sum": lambda: x.sum(), "pow": lambda: x.pow(2),
                "rsqrt": lambda: x.abs().rsqrt()}.items()}
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    kept, given_fp32 = dtypes(x), dtypes(x.float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
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
    assert set(given_fp32.values()) == {torch.float32}, given_fp32  # not cast down either
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
    """(logical, on-the-wire) bytes a rank sends per step: common/measure/formulas.py's counts, and
    common/measure/comm.py's ring factors (a broadcast as given: each rank is root for 1/W)."""
    logical = formulas.comm_bytes(strategy, cfg, world)
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
        ddp, z1 = (sum(formulas.model_state(s, cfg, w).values()) for s in ("ddp", "zero1"))
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
        plan = Plan(cfg, "tp" if kw else "single", world=W if kw else 1, batch=8, seq_len=64, **kw)
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
        shapes = splits.param_shapes(get_config(name, vocab_size=128256))
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
    shapes = splits.param_shapes(get_config("small"))
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


# ---- the step-time model's numbers, and the facts the pages add ------------------------------
def _bytes_per_parameter(fused: bool) -> tuple[float, float, list[str]]:
    """(clipping's, AdamW's) bytes read and written per parameter, and AdamW's kernels, counted
    at the dispatcher on the real ops (foreach=True is CUDA's default path, fused=True
    --fused-adamw's): each op reads its tensor arguments and writes the ones its schema
    mutates, or the tensors it returns. Scalars (the step counters) are left out."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Bytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.total, self.kernels = 0, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            size = lambda v: sum(t.numel() * t.element_size() for t in tree_flatten(v)[0]  # noqa: E731
                                 if isinstance(t, torch.Tensor) and t.numel() > 1)
            values = list(args) + [kwargs.get(a.name) for a in func._schema.arguments[len(args):]]
            moved = 0
            for a, v in zip(func._schema.arguments, values):
                moved += size(v)
                written = a.alias_info is not None and a.alias_info.is_write
                # the fused kernel's schema lets it write the gradients (unscaling them for
                # GradScaler, given grad_scale); without one it only reads them
                if written and not (a.name == "grads" and kwargs.get("grad_scale") is None):
                    moved += size(v)
            if not any(r.alias_info is not None for r in func._schema.returns):
                moved += size(out)
            if moved:
                self.total += moved
                self.kernels.append(func.__name__)
            return out

    n = 4 * 2**20
    params = [torch.nn.Parameter(torch.randn(2**20)) for _ in range(4)]
    opt = torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=not fused or None,
                            fused=fused or None)
    for _ in range(2):  # the second step: the state exists
        for p in params:
            p.grad = torch.randn_like(p)
        with Bytes() as clip:
            torch.nn.utils.clip_grads_with_norm_(params, 1.0, torch.nn.utils.get_total_norm(
                [p.grad for p in params], 2.0))
        with Bytes() as adamw:
            opt.step()
    return clip.total / n, adamw.total / n, adamw.kernels


def test_clipping_and_adamw_bytes_per_parameter():
    """will_it_fit.md, the optimizer term: clipping reads every gradient for the norm and scales
    every one (12 bytes a parameter); AdamW's foreach path is eight multi-tensor kernels, 84
    bytes (96 with clipping); fused=True one kernel, 28 (40). steptime.ADAMW_BYTES holds these."""
    from common.measure.steptime import ADAMW_BYTES, CLIP_BYTES
    clip, foreach, kernels = _bytes_per_parameter(fused=False)
    _, fused, fused_kernels = _bytes_per_parameter(fused=True)
    print(f"clipping {clip:.1f}, foreach AdamW {foreach:.1f} in {len(kernels)} kernels ({', '.join(kernels)}), "
          f"fused {fused:.1f} in {len(fused_kernels)}: {clip + foreach:.0f} and {clip + fused:.0f} bytes a parameter")
    assert round(clip) == CLIP_BYTES == 12
    assert round(foreach) == ADAMW_BYTES["foreach"] == 84 and len(kernels) == 8
    assert round(fused) == ADAMW_BYTES["fused"] == 28 and fused_kernels == ["_fused_adamw_.default"]


def test_torchtitan_8b_in_the_models_flop_count():
    """will_it_fit.md: torchtitan's eager FSDP runs (5,762 and 5,605 tokens/s a GPU) are 33.7%
    and 32.8% of 989 TFLOP/s in MFU's usual count (attention whole, common/model.py's
    flops_per_token) and 30.0% and 29.2% in the step-time model's (causal attention halved)."""
    from common.measure.flops import model_flops_per_token
    from common.model import flops_per_token
    cfg = get_config("8b", vocab_size=128256)
    got = {tps: (tps * flops_per_token(cfg, 8192) / 989e12, tps * model_flops_per_token(cfg, 8192) / 989e12)
           for tps in (5762, 5605)}
    print({k: f"{a:.1%} whole, {b:.1%} causal" for k, (a, b) in got.items()})
    assert [f"{a:.1%}" for a, _ in got.values()] == ["33.7%", "32.8%"]
    assert [f"{b:.1%}" for _, b in got.values()] == ["30.0%", "29.2%"]


def test_torchtitan_per_op_sac_recompute():
    """will_it_fit.md: torchtitan's per-op selective AC (--ac selective-op) recomputes wk, wo and w3
    (every second matmul of a block): 36.5% of the 8b block's forward matmul FLOPs, 221 ms a step
    at 2 x 8192 tokens a GPU on the eager rate, where our selective AC's memory-bound passes cost
    47 ms; with its own passes over what it drops, 284 ms."""
    from dataclasses import replace

    from common.measure.flops import layer_matmul_params, per_op_sac_flops
    from common.measure.machines import GPUS
    from common.measure.steptime import step_time
    cfg = get_config("8b", vocab_size=128256)
    share = per_op_sac_flops(cfg) / (2 * layer_matmul_params(cfg))
    m = GPUS["torchtitan"]
    ms = 2 * 8192 * cfg.n_layers * per_op_sac_flops(cfg) / m.matmul_rate("bf16") * 1e3
    plan = Plan(cfg, "fsdp_zero3", world=8, batch=16, seq_len=8192, dtype="bf16", ac="selective",
                       device="cuda")
    ours = step_time(plan, m)["recompute"] * 1e3
    theirs = step_time(replace(plan, ac="selective-op"), m)["recompute"] * 1e3
    print(f"per-op SAC recomputes {share:.1%} of the forward matmul FLOPs: {ms:.0f} ms; our selective AC's "
          f"memory-bound passes {ours:.0f} ms; per-op SAC in all {theirs:.0f} ms")
    assert f"{share:.1%}" == "36.5%" and round(ms) == 221 and round(ours) == 47 and round(theirs) == 284


def test_torchtitan_fsdp_tp_row_at_its_published_settings():
    """will_it_fit.md: torchtitan's FSDP 8 x TP 8 run (benchmarks/asyncTP_llama3_h100_2025-06_
    torchtitan.md: compile, per-op SAC, local batch 12; sequence parallel, as torchtitan's TP runs)
    predicted at those settings (their per-op SAC: --ac selective-op): 5,841 tokens/s a GPU against
    their 4,378 (1.33x), 718 ms of its 2,104 ms step TP's exposed collectives (the eager,
    local-batch-2 guess printed beside it)."""
    from tools.plan import torchtitan_rows, torchtitan_tp_as_first_assumed
    (row,) = [r for r in torchtitan_rows() if "TP 8" in r["what"]]
    p = row["plan"]
    assert (p.world, p.tp, p.dp, p.batch, p.seq_len, p.ac, p.sequence_parallel) == (64, 8, 8, 96, 8192,
                                                                                   "selective-op", True)
    old = torchtitan_tp_as_first_assumed(p.cfg)
    t = row["time"]
    print(f"ours {row['ours']:,.0f} against {row['theirs']:,} ({row['ours'] / row['theirs']:.2f}x); exposed "
          f"communication {t['exposed communication'] * 1e3:,.0f} of {t['step'] * 1e3:,.0f} ms; the old assumption "
          f"{old['tokens_per_s_per_gpu']:,.0f}")
    assert f"{row['ours']:,.0f}" == "5,841" and f"{row['ours'] / row['theirs']:.2f}" == "1.33"
    assert (round(t["exposed communication"] * 1e3), round(t["step"] * 1e3)) == (718, 2104)


def test_kv_cache_size_and_grouped_query_attention():
    """step1_single_gpu/README.md: a KV cache holds 2 (k and v) x layers x kv heads x head_dim
    values a token: common/generate.py's KVCache for the small model at its 1,024-token context,
    fp32, is 4 MiB a sequence (4 KiB a token). Llama 3 8B's shape (our 8b preset: 32 layers, 8 kv
    heads of 128) in bf16: 128 KiB a token, 1 GiB for 8,192 tokens; with a kv head per query
    head (32) it would be 4x that."""
    from common.generate import KVCache
    from common.model import build_model
    small = get_config("small")
    cache = KVCache(build_model(small, "cpu"), batch=1, context=small.max_seq_len)
    held = sum(t.numel() * t.element_size() for d in (cache.k, cache.v) for t in d.values())
    formula = lambda c, tokens, width: 2 * c.n_layers * c.n_kv_heads * c.head_dim * tokens * width  # noqa: E731
    eight = get_config("8b")
    per_token, seq = formula(eight, 1, 2), formula(eight, 8192, 2)
    mha = 2 * eight.n_layers * eight.n_heads * eight.head_dim * 8192 * 2
    print(f"small: {held / 2**20:.0f} MiB a sequence ({held // small.max_seq_len} B a token); 8b bf16: "
          f"{per_token / 2**10:.0f} KiB a token, {seq / 2**30:.0f} GiB at 8,192 tokens, {mha / 2**30:.0f} GiB "
          f"with {eight.n_heads} kv heads")
    assert held == formula(small, small.max_seq_len, 4) == 4 * 2**20
    assert (eight.n_layers, eight.n_kv_heads, eight.head_dim, eight.n_heads) == (32, 8, 128, 32)
    assert per_token == 128 * 2**10 and seq == 2**30 and mha == 4 * seq


def test_exported_config_fields_that_change_the_numbers():
    """step1_single_gpu/README.md, export: rope_theta, rms_norm_eps and tie_word_embeddings are
    written from the model (10,000, 1e-5 and false for the small model; the 8b preset's theta is
    Llama 3's 500,000), and a wrong rope_theta changes the logits without an error."""
    pytest.importorskip("transformers")
    from common.hf import llama_config
    small, eight = get_config("small"), get_config("8b")
    c = llama_config(small)
    theta = (c.rope_parameters or {}).get("rope_theta") if hasattr(c, "rope_parameters") else c.rope_theta
    print(f"rope_theta {theta}, rms_norm_eps {c.rms_norm_eps}, tie_word_embeddings {c.tie_word_embeddings}; "
          f"8b theta {eight.rope_theta}")
    assert (theta, c.rms_norm_eps, c.tie_word_embeddings) == (10000.0, 1e-5, False)
    assert eight.rope_theta == 500000.0
    from dataclasses import replace

    from common.model import build_model
    torch.manual_seed(0)
    model = build_model(small, "cpu")
    x = torch.randint(0, 256, (1, 64))
    other = build_model(replace(small, rope_theta=500000.0), "cpu")
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert not torch.allclose(model(x), other(x), atol=1e-3)


def test_the_pytorch_apis_the_pages_name_for_gpus_and_checkpoints():
    """step4_multi_node/README.md and step1's export: DCP's async_save takes a process-based
    checkpointer and a stager with pinned host memory; DCP reads and writes Hugging Face
    safetensors (HuggingFaceStorageReader/Writer); ProcessGroupNCCL reads TORCH_NCCL_BLOCKING_WAIT
    and, for its watchdog's heartbeat monitor, TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC."""
    import inspect

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    assert AsyncCheckpointerType("process") is AsyncCheckpointerType.PROCESS
    assert {"async_checkpointer_type", "async_stager"} <= set(inspect.signature(dcp.async_save).parameters)
    assert StagingOptions().use_pinned_memory is True
    assert hasattr(dcp, "HuggingFaceStorageReader") and hasattr(dcp, "HuggingFaceStorageWriter")
    header = Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp"
    if not header.exists():
        pytest.skip("this torch installs no c10d headers")
    text = header.read_text()
    assert '"TORCH_NCCL_BLOCKING_WAIT"' in text and '"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"' in text


def test_step_time_numbers_will_it_fit_quotes():
    """will_it_fit.md's step-time prose: at 8b, 8 GPUs of torchtitan's cards, the optimizer term is
    40 ms foreach and 17 ms fused; MFU's usual count (attention whole) is 12.5% more FLOPs than
    the model's at 8192 tokens; the eager FSDP rows predict 33.2% of 989 (the model's count); the
    FSDP 8 x TP 8 row's formula peak under their per-op policy (77.1 GiB) fits the card's 95.6."""
    from common.measure.flops import model_flops_per_token
    from common.measure.machines import GPUS
    from common.measure.steptime import step_time
    from common.model import flops_per_token
    from tools.plan import torchtitan_rows
    cfg = get_config("8b", vocab_size=128256, max_seq_len=8192)
    ms = {k: step_time(Plan(cfg, "fsdp_zero3", world=8, batch=16, seq_len=8192, dtype="bf16", device="cuda",
                                   optimizer=k), GPUS["torchtitan"])["optimizer"] * 1e3 for k in ("foreach", "fused")}
    more = flops_per_token(cfg, 8192) / model_flops_per_token(cfg, 8192) - 1
    rows = {r["what"]: r for r in torchtitan_rows()}
    eager = rows["Table 1: FSDP, eager"]["time"]["mfu"]
    (tp,) = [r for r in rows.values() if "TP 8" in r["what"]]
    print(f"optimizer {ms}; whole attention +{more:.1%}; eager MFU {eager:.1%}; TP row peak {tp['our_gib']:.1f} GiB "
          f"of {GPUS['torchtitan'].memory_gib}")
    assert (round(ms["foreach"]), round(ms["fused"])) == (40, 17)
    assert f"{more:.1%}" == "12.5%" and f"{eager:.1%}" == "33.2%"
    assert f"{tp['our_gib']:.1f}" == "77.1" and tp["our_gib"] < GPUS["torchtitan"].memory_gib
