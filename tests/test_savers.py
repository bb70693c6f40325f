"""The savers that make a 128K-vocabulary 8B model fit where torchtitan fits it, in process:
the chunked loss against the plain one, the every-second-matmul checkpointing policy against
no checkpointing, the allocator flag, and the 8B layout's bytes under the fake-tensor trace.
(The same savers in real FSDP and DDP runs on 2 ranks: tests/test_step3a.py's "*_savers" runs.)"""
import copy
import os

import pytest
import torch

from common import cli
from common.measure import theory
from common.measure.plan import Plan
from common.model import build_model, get_config, set_loss_chunks
from common.parallelize.ac import apply_ac

CFG = get_config("debug", vocab_size=300)
GiB = 2**30


def _model_and_batch(seq=37):
    torch.manual_seed(0)
    model = build_model(CFG, "cpu", seed=1)
    x, y = torch.randint(0, CFG.vocab_size, (3, seq)), torch.randint(0, CFG.vocab_size, (3, seq))
    return model, x, y


def _loss_and_grads(model, x, y, amp=False):
    with torch.autocast("cpu", torch.bfloat16, enabled=amp):
        loss = model(x, targets=y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("chunks", [2, 4, 111, 500])  # 111 tokens: uneven chunks, one token each, more chunks than tokens
def test_chunked_loss_is_the_plain_loss_fp32(chunks):
    model, x, y = _model_and_batch()
    plain, chunked = copy.deepcopy(model), copy.deepcopy(model)
    set_loss_chunks(chunked, chunks)
    ref_loss, ref = _loss_and_grads(plain, x, y)
    loss, got = _loss_and_grads(chunked, x, y)
    # the plain loss is F.cross_entropy of the whole logits: the scripts' loss, on the model's logits
    assert ref_loss == torch.nn.functional.cross_entropy(plain(x).flatten(0, 1), y.flatten())
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    for name in ref:
        assert torch.allclose(got[name], ref[name], rtol=1e-5, atol=1e-7), name


def test_chunked_loss_under_autocast_is_the_plain_loss_to_bf16_rounding():
    model, x, y = _model_and_batch()
    plain, chunked = copy.deepcopy(model), copy.deepcopy(model)
    set_loss_chunks(chunked, 5)
    ref_loss, ref = _loss_and_grads(plain, x, y, amp=True)
    loss, got = _loss_and_grads(chunked, x, y, amp=True)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-4)
    for name in ref:  # both compute in bf16: the same products, summed in another order
        scale = ref[name].abs().max()
        assert (got[name] - ref[name]).abs().max() <= 1e-2 * scale, name
        assert got[name].dtype == ref[name].dtype == torch.float32


def test_every_second_matmul_policy_recomputes_to_the_same_gradients_and_keeps_the_formulas_bytes():
    """--ac selective-op: the losses and gradients of no checkpointing, and per block what
    formulas.layer_activation_bytes says, measured by the tracer under FakeTensorMode (the
    activations of selective-op, less those of selective, are exactly the three matmul
    outputs it drops: wk, wo and w3)."""
    from tools.estimate import trace
    model, x, y = _model_and_batch()
    ref_loss, ref = _loss_and_grads(copy.deepcopy(model), x, y)
    op = copy.deepcopy(model)
    apply_ac(op, "selective-op")
    loss, got = _loss_and_grads(op, x, y)
    assert loss == ref_loss
    for name in ref:
        assert torch.allclose(got[name], ref[name], rtol=1e-6, atol=1e-8), name
    cfg = get_config("small")
    plans = {ac: Plan(cfg, "single", batch=2, seq_len=64, ac=ac) for ac in ("selective", "selective-op")}
    traced = {ac: trace(p)["activations"] for ac, p in plans.items()}
    formula = {ac: theory.predict(p)["activations"] for ac, p in plans.items()}
    d, kv, f = cfg.dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_dim
    dropped = 128 * cfg.n_layers * 4 * (kv + d + f)  # wk, wo, w3 outputs, fp32
    assert formula["selective"] - formula["selective-op"] == dropped
    assert traced["selective"] - traced["selective-op"] == dropped


def test_expandable_segments_reaches_the_allocator_setting(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128,expandable_segments:False")
    cli.use_expandable_segments(False)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128,expandable_segments:False"
    cli.use_expandable_segments(True)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128,expandable_segments:True"
    p = cli.parser("x")
    assert p.parse_args(["--expandable-segments"]).expandable_segments


# ---- Llama 3.1 8B at torchtitan's published layout ------------------------------------------
# 8 GPUs, FSDP, local batch 2 x 8192, Llama 3's 128,256-token vocabulary, bf16, selective AC.
# torchtitan reports 82.4 GiB reserved eager and 77.0 compiled on its 96 GB H100s.
TORCHTITAN_COMPILED_GIB = 77.0
LAYOUT = dict(world=8, batch=16, seq_len=8192, dtype="bf16", device="cuda")
SAVERS = dict(loss_chunks=16, split_root=True)


def test_the_8b_layout_fits_under_torchtitans_compiled_peak_by_the_formula():
    """The formula, every layer (the trace of the whole model is tools.estimate's --trace, 30 s on
    two free cores: README/will_it_fit.md shows it). Without the savers it is far over."""
    cfg = get_config("8b", vocab_size=128256)
    before = theory.predict(Plan(cfg, "fsdp", ac="selective", loss_chunks=1, **LAYOUT))
    after = theory.predict(Plan(cfg, "fsdp", ac="selective", **SAVERS, **LAYOUT))
    op = theory.predict(Plan(cfg, "fsdp", ac="selective-op", **SAVERS, **LAYOUT))
    assert before["peak"] > TORCHTITAN_COMPILED_GIB * GiB > after["peak"] > op["peak"]
    assert before["peak_at"] == "loss backward"  # the (tokens, vocab) gradients decide it


def test_the_8b_layout_under_the_trace_fits_and_is_the_formula():
    """The whole model at torchtitan's layout with the savers, traced under FakeTensorMode
    (about 30 s): at most torchtitan's compiled 77.0 GiB, and the formula within 3%. And its
    head alone (2 of the 32 layers) with the plain loss, whose peak is the loss's backward:
    the two (tokens, vocabulary) fp32 gradients beside the log-probabilities, to the formula."""
    from tools.estimate import trace
    cfg = get_config("8b", vocab_size=128256)
    plan = Plan(cfg, "fsdp", ac="selective", **SAVERS, **LAYOUT)
    t, f = trace(plan), theory.predict(plan)
    print(f"with the savers: trace {t['peak'] / GiB:.2f} GiB, formula {f['peak'] / GiB:.2f} GiB at the {f['peak_at']}")
    assert t["peak"] <= TORCHTITAN_COMPILED_GIB * GiB
    assert t["peak"] == pytest.approx(f["peak"], rel=0.03)
    head = Plan(get_config("8b", vocab_size=128256, n_layers=2), "fsdp", ac="selective", **LAYOUT)
    t, f = trace(head), theory.predict(head)
    print(f"2 layers, plain loss: trace {t['peak'] / GiB:.2f} GiB, formula {f['peak'] / GiB:.2f} GiB at the "
          f"{f['peak_at']}")
    assert f["peak_at"] == "loss backward" and t["peak"] == pytest.approx(f["peak"], rel=0.01)


def test_the_savers_reach_the_dry_run(capsys):
    """The estimator's --dry-run passes the savers to train_fsdp.py (rank 0 of 4, one process):
    its model state and activations are the formula's, and its collectives too, the embedding's
    own unit gathered again for backward (--split-root-unit)."""
    from tools.estimate import main as estimate_main
    estimate_main(["--model", "debug", "--vocab-size", "512", "--world-size", "4", "--strategy", "fsdp", "--device",
                   "cpu", "--batch", "4", "--seq-len", "64", "--loss-chunks", "4", "--split-root-unit", "--ac",
                   "selective-op", "--dry-run"])
    out = capsys.readouterr().out
    print(out)
    assert "--loss-chunks 4" in out and "--split-root-unit" in out  # the savers' share of the peak, named
    for c in ("parameters", "gradients", "optimizer state", "activations"):
        row = next(line for line in out.splitlines() if line.startswith(f"  {c} "))
        assert row.split()[-1] == "1.000", row
    sent = next(line for line in out.splitlines() if "sent per step per rank:" in line)
    moved = next(line for line in out.splitlines() if "the dry run's collectives per step:" in line)
    per_op = {kv.rsplit(" ", 2)[0]: kv.rsplit(" ", 2)[1:] for kv in sent.split(": ", 1)[1].split(" (total")[0].split(", ")}
    assert per_op == {kv.rsplit(" ", 2)[0]: kv.rsplit(" ", 2)[1:] for kv in moved.split(": ", 1)[1].split(", ")}


def test_a_loss_in_no_chunks_is_refused_in_one_sentence(capsys, tmp_path):
    from step3_multi_gpu.train_fsdp import main
    with pytest.raises(SystemExit) as e:
        main(["--model", "debug", "--device", "cpu", "--loss-chunks", "0", "--out", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "error: --loss-chunks must be positive (got 0); 1 is the plain loss.", err
