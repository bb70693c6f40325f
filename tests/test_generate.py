"""Using what was trained: generation with and without the KV cache, the tools' loading, and
the Hugging Face export and import (common/generate.py, common/hf.py, tools.generate,
tools.export_hf).

One small model is trained here, in this process, on a short text repeated (the debug
preset, 48 positions, a few seconds): it must then complete the text from its start, which
the same model untrained does not, and every check after that runs on it, so that a greedy
continuation is a varied string of tokens rather than one token repeated. Loading a DCP
checkpoint sharded by 2 FSDP ranks is checked in tests/test_checkpoint.py, on the runs its
torchrun jobs already make.
"""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from common.errors import UserError
from common.generate import KVCache, decode, encode, forward_cached, generate, load_trained
from common.model import build_model, get_config

TEXT = "the quick brown fox jumps over the lazy dog\n"  # "the " twice: the next byte needs more than the last
PROMPT = "the quick"
SEQ = 48


def _train_on_text(steps: int = 150, seed: int = 0):
    """The debug model after ``steps`` AdamW steps on windows of TEXT repeated."""
    torch.manual_seed(seed)
    model = build_model(get_config("debug"), "cpu", seed=seed)
    data = torch.tensor(encode(TEXT * 20))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - SEQ - 1, (8,))
        batch = torch.stack([data[s:s + SEQ + 1] for s in starts])
        loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval(), loss.item()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Small ops: a second thread only spins (measured: 150 steps took 3 s of CPU on one
    thread, and 5x more on two beside other processes)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def taught():
    return _train_on_text()[0]


@pytest.fixture(scope="module")
def run_folder(taught, tmp_path_factory):
    """The taught model as a run's --out with --save-weights: weights.pt and summary.json."""
    folder = tmp_path_factory.mktemp("run")
    torch.save(taught.state_dict(), folder / "weights.pt")
    (folder / "summary.json").write_text(json.dumps({"model": "debug", "model_config": taught.cfg.as_dict(),
                                                     "seq_len": SEQ}))
    return folder


def _prompt():
    return torch.tensor([encode(PROMPT)])


def test_a_model_trained_on_a_text_completes_it_and_an_untrained_one_does_not(taught):
    want = (TEXT * 2)[len(PROMPT):SEQ]
    tokens, _ = generate(taught, _prompt(), SEQ - len(PROMPT), SEQ)
    assert decode(tokens[0, len(PROMPT):]) == want
    untrained = build_model(get_config("debug"), "cpu", seed=0).eval()
    tokens, _ = generate(untrained, _prompt(), SEQ - len(PROMPT), SEQ)
    assert decode(tokens[0, len(PROMPT):]) != want


@pytest.mark.parametrize("preset", ["debug", "debug-moe"])
def test_the_cache_gives_the_logits_of_the_full_forward(preset):
    """The prompt at once, then one position at a time from the cache: the logits of the
    training path's forward over the whole sequence, to fp32 noise (a mixture of experts too:
    its router sends each token on its own)."""
    model = build_model(get_config(preset), "cpu", seed=1).eval()
    x = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(x)
    cache = KVCache(model, batch=2, context=64)
    steps = [forward_cached(model, x[:, :25], cache)] + [forward_cached(model, x[:, t:t + 1], cache)
                                                         for t in range(25, 40)]
    assert cache.length == 40
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)


def test_cached_and_uncached_generation_give_the_same_tokens(taught):
    for temperature, top_k in ((0.0, None), (0.8, 50)):  # greedy, and sampling with one seed
        cached, _ = generate(taught, _prompt(), 40, SEQ, temperature, top_k, seed=3)
        plain, _ = generate(taught, _prompt(), 40, SEQ, temperature, top_k, seed=3, kv_cache=False)
        assert cached.tolist() == plain.tolist(), temperature
    assert len(set(cached[0].tolist())) > 10  # a varied text, not one token repeated


def test_past_the_context_the_cache_starts_again_from_a_window(taught):
    """A text longer than the context (the cache's buffers would overflow): once full, the
    cache restarts from the last half of the context, and the text goes on as trained."""
    tokens, _ = generate(taught, _prompt(), SEQ, SEQ)
    assert decode(tokens[0]) == (TEXT * 3)[:len(PROMPT) + SEQ]


def _tool(main, argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
            code = 0
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def test_the_tool_loads_a_run_folder_and_prints_the_continuation(run_folder, taught):
    from tools.generate import main
    code, out, err = _tool(main, [str(run_folder), "--prompt", PROMPT, "--max-new-tokens", "30",
                                  "--temperature", "0", "--device", "cpu"])
    assert code == 0, err
    header, text, speed = out.splitlines()[0], "\n".join(out.splitlines()[1:-1]), out.splitlines()[-1]
    assert header.startswith(f"debug model from {run_folder / 'weights.pt'}, cpu, fp32, greedy")
    assert text == (TEXT * 2)[:len(PROMPT) + 30]
    assert speed.startswith("30 tokens in ") and speed.endswith("tokens/s (KV cache)")
    # bf16: weights and cache cast, the same model (the first bytes at least)
    code, out, err = _tool(main, [str(run_folder), "--prompt", PROMPT, "--max-new-tokens", "8", "--temperature", "0",
                                  "--device", "cpu", "--amp", "bf16"])
    assert code == 0 and out.splitlines()[1] == TEXT[:len(PROMPT) + 8], out + err
    # the loaded weights are the saved ones, bit for bit
    loaded = load_trained(run_folder).model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in taught.state_dict().items())


def test_export_to_transformers_and_back(run_folder, taught, tmp_path):
    """Exported, transformers loads it as a Llama with our logits and our greedy tokens, its
    AutoTokenizer gives our byte ids, and importing it back gives our weights bit for bit."""
    import transformers

    from tools.export_hf import export, import_hf
    export(run_folder, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(hf).__name__ == "LlamaForCausalLM" and not hf.config.tie_word_embeddings
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = tok(PROMPT, return_tensors="pt").input_ids
    assert ids.tolist() == [encode(PROMPT)]
    for text in ("caf\u00e9 \u65e5\u672c \U0001f642\t\x00\n  x", TEXT):  # multi-byte characters, control bytes
        assert tok(text).input_ids == encode(text) and tok.decode(encode(text)) == text
    x = torch.tensor([encode(TEXT[:SEQ])])
    with torch.no_grad():  # two fp32 implementations (transformers' Llama and ours order their ops
        # apart): fp32's rounding, relative to the logits' size (1.2e-5 at |logits| ~5 on AVX2
        # kernels); a weight mapped wrong, another RoPE layout or norm eps moves them by 1e-2 or more
        ours = taught(x)
        assert (hf(x).logits - ours).abs().max().item() < 1e-5 * max(1.0, ours.abs().max().item())
    ours, _ = generate(taught, ids, 30, SEQ)
    theirs = hf.generate(ids, max_new_tokens=30, do_sample=False)
    assert theirs.tolist() == ours.tolist()
    assert tok.decode(theirs[0]) == (TEXT * 2)[:len(PROMPT) + 30]

    import_hf(tmp_path / "hf", tmp_path / "back.pt")
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert back["model_config"] == taught.cfg.as_dict()
    assert back["model"].keys() == taught.state_dict().keys()
    assert all(torch.equal(back["model"][k], v) for k, v in taught.state_dict().items())
    assert load_trained(tmp_path / "back.pt").name == "debug"  # tools.generate reads it too


def test_moe_export_other_vocabularies_and_missing_libraries_are_one_sentence(tmp_path):
    from common.generate import Weights, require_bytes
    from common.hf import require, to_hf_state_dict
    with pytest.raises(UserError, match=r"^run/weights.pt holds a model of 1000 token ids \(--vocab-size\), trained on "
                                        r"random ids, not on text's 256 byte values"):
        require_bytes(Weights(Path("run/weights.pt"), get_config("debug", vocab_size=1000), 32, "debug"))
    cfg = get_config("debug-moe")
    with pytest.raises(UserError, match=r"^this model is a mixture of experts \(8 experts\), which transformers' "
                                        r"Llama cannot hold; export a dense preset's run\.$"):
        to_hf_state_dict(build_model(cfg, "meta").state_dict(), cfg)
    with pytest.raises(UserError, match=r"^this needs the no_such_lib package, which is not installed: pip install "
                                        r"no_such_lib \(or pip install -r requirements.txt\)\.$"):
        require("no_such_lib.torch")
    (tmp_path / "weights.pt").write_bytes(b"half a file")  # a copy cut short
    with pytest.raises(UserError, match=r"weights.pt cannot be read as a file of weights \(\w+\); give the weights.pt "
                                        r"of a finished run\.$"):
        load_trained(tmp_path / "weights.pt")


def test_loading_transformers_prints_nothing_that_is_not_ours():
    """transformers loads torchao, whose CPU build warns once per CUDA kernel library it cannot
    load, and torch notes deprecations; a learner exporting a model reads them as our failure.
    common.hf.require loads torchao first with those warnings quieted (a fresh process: in
    this one torchao may be loaded already)."""
    import sys

    import launch

    from common import ROOT

    code = ("from common.hf import require; t = require('transformers'); t.LlamaForCausalLM; "
            "t.AutoModelForCausalLM; print('ok')")
    p = launch.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]
    assert "Failed to load" not in p.stderr and "register_constant" not in p.stderr, p.stderr[-2000:]
