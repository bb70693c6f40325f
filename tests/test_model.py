import math

import pytest
import torch
import torch.nn.functional as F

from common.model import PRESETS, Transformer, build_model, count_params, flops_per_token, get_config


def test_shapes_and_dtype():
    cfg = get_config("debug")
    model = build_model(cfg, "cpu", seed=0)
    logits = model(torch.randint(0, 256, (3, 17)))
    assert logits.shape == (3, 17, cfg.vocab_size)
    assert logits.dtype == torch.float32


def test_causal_mask_future_tokens_do_not_change_past_logits():
    model = build_model(get_config("debug"), "cpu", seed=0)
    x = torch.randint(0, 256, (2, 24))
    y = x.clone()
    y[:, 12:] = torch.randint(0, 256, (2, 12))  # change only the future
    a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=1e-6)
    assert (a[:, 12:] - b[:, 12:]).abs().max() > 1e-3  # and the future does change


@pytest.mark.parametrize("name", list(PRESETS))
def test_parameter_count_matches_formula(name):
    cfg = get_config(name)
    with torch.device("meta"):  # the 8b preset costs nothing on meta
        model = Transformer(cfg)
    assert sum(p.numel() for p in model.parameters()) == count_params(cfg)


def test_parameter_counts_are_the_advertised_sizes():
    # the walkthrough names them by size: hold the names to the counts
    assert 120e6 < count_params(get_config("125m")) < 130e6
    assert 0.95e9 < count_params(get_config("1b")) < 1.0e9
    assert 6.9e9 < count_params(get_config("8b")) < 7.1e9  # byte vocab: 8B's layer stack, 7.0B params


def test_formula_by_hand_for_debug():
    # debug: d=64, L=4, 4 heads of 16, 2 kv heads, ffn 192, vocab 256
    attention = 64 * 64 + 2 * 64 * 32 + 64 * 64
    mlp = 3 * 64 * 192
    assert count_params(get_config("debug")) == 256 * 64 + 4 * (attention + mlp + 128) + 64 + 64 * 256


def test_meta_build_then_init_is_finite_and_reproducible():
    cfg = get_config("debug")
    a, b = build_model(cfg, "cpu", seed=3), build_model(cfg, "cpu", seed=3)
    c = build_model(cfg, "cpu", seed=4)
    for (name, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.isfinite(p).all(), name
        assert torch.equal(p, q), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(p, r), name
    assert torch.isfinite(a.rope_cos).all() and a.rope_cos.shape == (cfg.max_seq_len, cfg.head_dim // 2)
    # the init scale is what the docstring says
    assert abs(a.tok_embeddings.weight.std().item() - 0.02) < 0.002
    assert abs(a.layers["0"].attention.wo.weight.std().item() - 0.02 / math.sqrt(8)) < 0.001


def test_dropping_layers_keeps_the_other_weights():
    # pipeline stages keep a subset of layers; their weights must not depend on the subset
    cfg = get_config("debug")
    full = build_model(cfg, "cpu", seed=0)
    with torch.device("meta"):
        stage = Transformer(cfg)
    del stage.layers["0"], stage.layers["1"]
    stage.tok_embeddings = None
    stage.to_empty(device="cpu")
    stage.init_weights(0)
    for name, p in stage.named_parameters():
        assert torch.equal(p, full.get_parameter(name)), name
    h = torch.randn(2, 8, cfg.dim)
    ref = full.output(full.norm(full.layers["3"](full.layers["2"](h, full.rope_cos, full.rope_sin),
                                                 full.rope_cos, full.rope_sin)))
    torch.testing.assert_close(stage(h), ref)


def test_flops_formula_on_a_known_case():
    cfg = get_config("debug")
    n_matmul = count_params(cfg) - 256 * 64 - (2 * 4 + 1) * 64  # no embedding lookup, no norm gains
    assert flops_per_token(cfg, 128) == 6 * n_matmul + 12 * 4 * 64 * 128
    # 125m at 2048: 6N dominates, attention adds 12*L*d*T = 226M FLOPs per token
    cfg = get_config("125m")
    assert flops_per_token(cfg, 2048) - flops_per_token(cfg, 0) == 12 * 12 * 768 * 2048


def test_a_few_steps_lower_the_loss():
    torch.manual_seed(0)
    model = build_model(get_config("debug"), "cpu", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randint(0, 256, (4, 33))
    losses = []
    for _ in range(5):
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


def test_bad_config_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        get_config("huge")
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        get_config("debug", n_kv_heads=3)
