"""Step 2.6: float8 training with torchao. The forward and backward of Float8Linear run on
the CPU (emulated: correct, a few times slower than bf16), so what float8 does to the loss is tested here; its
speed needs an H100 and is not.

Tolerance. e4m3 keeps 3 mantissa bits: each forward operand of a float8 matmul is rounded
by up to 1/16 of its value, against bf16's 1/256; the gradient backward multiplies is e5m2
(2 bits, up to 1/8). The rounding errors of a K-term dot product
are independent and mostly cancel, and the loss is a mean over batch x sequence tokens,
so over the first steps the float8 loss stays within a small fraction of the bf16 one:
measured on the debug model (32 tokens a sequence), at most 0.09% in 6 steps. We allow 1%: room for another CPU
or torchao version, while an unscaled cast (operands flushed to zero or saturated at
448) or a layer trained in the wrong dtype moves the loss by far more.
"""
import pytest
import torch

pytest.importorskip("torchao")

from tests.test_step2 import TINY, _script, run_main  # noqa: E402,F401

STEPS = 6
REL_TOL = 0.01


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("kernels", ["this CPU's", "emulated"])
def test_float8_loss_follows_bf16_over_the_first_steps(kernels, monkeypatch, tmp_path):
    """In torchao's emulation (what the script runs on any CPU: float8.emulates) and on the
    CPU's float8 matmuls (oneDNN's, where it has them; emulated again where it has none)."""
    from common.parallelize import float8 as f8
    emulated = kernels == "emulated" or not f8.cpu_float8_matmul()
    if not emulated:
        monkeypatch.setattr(f8, "emulates", lambda device: False)
    # 32 tokens a sequence, not TINY's 64: float8 on a CPU is slow, and half the tokens still
    # show the rounding (the losses differ) and the learning
    flags = ("--no-trace-memory", "--eval-batches", "0", "--seq-len", "32")
    bf16, _ = run_main(monkeypatch, "train_amp", tmp_path / "bf16", "--amp", "bf16", *flags, steps=STEPS)
    f8, _ = run_main(monkeypatch, "train_float8", tmp_path / "f8", *flags, steps=STEPS)
    a, b = [r["loss"] for r in bf16], [r["loss"] for r in f8]
    rel = [abs(x - y) / x for x, y in zip(a, b)]
    print(f"float8 against bf16: largest gap {max(rel):.4%} over {STEPS} steps")
    assert max(rel) < REL_TOL, f"float8 left bf16's loss by {max(rel):.2%} (bf16 {a}, float8 {b})"
    assert any(x != y for x, y in zip(a, b)), "float8 gave bf16's losses bit for bit: were the layers converted?"
    assert b[-1] < b[0] - 0.1, f"float8 did not learn: {b}"  # it trains, not just agrees at step 0
    import json
    summary = json.loads((tmp_path / "f8" / "summary.json").read_text())
    assert len(summary["float8"]["converted"]) == 7 * 4 and list(summary["float8"]["skipped"]) == ["output"]
    assert summary["float8"]["emulated"] == emulated


def test_the_linear_layers_really_become_float8linear():
    from torchao.float8.float8_linear import Float8Linear

    from common.model import build_model, get_config
    from common.parallelize.float8 import convert_float8
    model = build_model(get_config("debug", ffn_dim=200), "cpu")  # 200: not a multiple of 16
    names = {n for n, p in model.named_parameters()}
    info = convert_float8(model, "cpu")  # (emulated, as on every CPU)
    kinds = {n: type(m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert {n for n, k in kinds.items() if k is Float8Linear} == set(info["converted"])
    assert all(n.endswith(("wq", "wk", "wv", "wo")) for n in info["converted"])  # w1, w2, w3 are 64 x 200
    assert set(info["skipped"]) == {"output"} | {f"layers.{i}.feed_forward.w{j}" for i in range(4) for j in (1, 2, 3)}
    assert "200 is not a multiple of 16" in info["skipped"]["layers.0.feed_forward.w1"]
    assert {n for n, _ in model.named_parameters()} == names  # checkpoints keep their keys
    x = torch.randint(0, 256, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x).float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def test_float8_misuse_is_one_sentence(monkeypatch, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, "train_float8", tmp_path, "--amp", "fp16")
    assert e.value.code == 2
    assert "--amp fp16 is not offered with float8" in capsys.readouterr().err


def test_a_cpu_run_emulates_float8_as_the_kernels_compute_it():
    """On a CPU ``convert_float8`` turns on torchao's emulation (never on a GPU): oneDNN's CPU
    float8 matmuls exist only with AVX-512 FP16 and run a step of the small model in minutes.
    The emulation casts and scales as the kernels do and multiplies in fp32: its loss is the
    real kernels' to fp32's rounding where this CPU has them (the gradients' bf16 products
    round apart: the loss test above holds both runs to bf16)."""
    import copy

    from common.model import build_model, get_config
    from common.parallelize import float8 as f8
    torch.manual_seed(0)
    model = build_model(get_config("debug"), "cpu", seed=0)
    twin = copy.deepcopy(model)
    kernels = f8.cpu_float8_matmul()  # (an AVX2-only CPU has none: both emulate)
    real = f8.convert_float8(model, "cpu", emulate=not kernels)
    emulated = f8.convert_float8(twin, "cpu")
    assert emulated["emulated"] and twin.layers["0"].attention.wq.config.emulate
    assert model.layers["0"].attention.wq.config.emulate is real["emulated"] is (not kernels)
    assert f8.emulates("cpu") and not f8.emulates("cuda") and not f8.emulates(None)
    assert not f8.convert_float8(build_model(get_config("debug"), "cpu"), "cuda")["emulated"]
    x, y = torch.randint(0, 256, (2, 64)), torch.randint(0, 256, (2, 64))
    losses = []
    for m in (model, twin):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = m(x)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        assert all(q.grad is not None and torch.isfinite(q.grad).all() for q in m.parameters())
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
