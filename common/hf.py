"""Our model as Hugging Face's Llama, and back: the names, the config and the RoPE layout.

The architectures are the same (pre-norm RMSNorm blocks, SwiGLU, grouped-query attention,
rotary positions, no biases, untied embedding and output), so the conversion is a renaming,
with one catch: the rotary embedding pairs the elements of a head differently. We (like
Meta's original Llama code) rotate interleaved pairs (x[2i], x[2i+1]); transformers rotates
halves (x[i], x[i + head_dim/2]). Reordering each head's rows of wq and wk so that element
2i lands at i and 2i+1 at i + head_dim/2 makes their rotation ours; q and k are reordered
alike, so their dot products, the attention scores, are unchanged (what Meta-to-HF
conversion scripts do). wv and wo are untouched: the values are never rotated.

transformers and safetensors are imported only by the functions that need them, so
training never needs them installed.
"""
from __future__ import annotations

import logging

import torch

from common.errors import THEIR_NOISE, UserError
from common.model import ModelConfig


def require(module: str):
    """Import an optional library, or say in one sentence how to install it. transformers
    imports torchao where it is installed, lazily, whenever a model class is first used;
    torchao's load-time warnings (common.errors.THEIR_NOISE: not ours, and harmless) are
    dropped for the rest of this process, which exports or generates and trains nothing."""
    import importlib
    try:
        if module.split(".")[0] == "transformers":
            for name in THEIR_NOISE:  # left quiet: the lazy imports come later
                logging.getLogger(name).setLevel(logging.ERROR)
        return importlib.import_module(module)
    except ImportError:
        package = module.split(".")[0]
        raise UserError(f"this needs the {package} package, which is not installed: pip install {package} "
                        f"(or pip install -r requirements.txt).") from None


def heads_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection from our interleaved-pair order to transformers' halves."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def heads_pairs(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of heads_halves: transformers' rows back to our interleaved pairs."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(w.shape)


# (our name in a block, theirs): the tensors that only change names
_BLOCK = {"attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
          "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
          "feed_forward.w2.weight": "mlp.down_proj.weight", "attention_norm.weight": "input_layernorm.weight",
          "ffn_norm.weight": "post_attention_layernorm.weight"}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}


def refuse_moe(cfg: ModelConfig) -> None:
    if cfg.n_experts:
        raise UserError(f"this model is a mixture of experts ({cfg.n_experts} experts), which transformers' Llama "
                        f"cannot hold; export a dense preset's run.")


def to_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict (names of common/model.py) as LlamaForCausalLM's."""
    refuse_moe(cfg)
    out = {theirs: sd[ours] for ours, theirs in _TOP.items()}
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        out[theirs + "self_attn.q_proj.weight"] = heads_halves(sd[ours + "attention.wq.weight"], cfg.n_heads)
        out[theirs + "self_attn.k_proj.weight"] = heads_halves(sd[ours + "attention.wk.weight"], cfg.n_kv_heads)
        out |= {theirs + t: sd[ours + o] for o, t in _BLOCK.items()}
    return {k: v.contiguous() for k, v in out.items()}


def from_hf_state_dict(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM's state dict back to our names (the inverse of to_hf_state_dict)."""
    out = {ours: hf[theirs] for ours, theirs in _TOP.items()}
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        out[ours + "attention.wq.weight"] = heads_pairs(hf[theirs + "self_attn.q_proj.weight"], cfg.n_heads)
        out[ours + "attention.wk.weight"] = heads_pairs(hf[theirs + "self_attn.k_proj.weight"], cfg.n_kv_heads)
        out |= {ours + o: hf[theirs + t] for o, t in _BLOCK.items()}
    return {k: v.contiguous() for k, v in out.items()}


def llama_config(cfg: ModelConfig, context: int | None = None):
    """transformers' LlamaConfig of the same shape: every field that could differ is set."""
    transformers = require("transformers")
    refuse_moe(cfg)
    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=context or cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta, hidden_act="silu", attention_bias=False, mlp_bias=False,
        tie_word_embeddings=False,  # our output layer has its own weights
        bos_token_id=None, eos_token_id=None, pad_token_id=None)  # bytes: no special tokens


def model_config(hf_config) -> ModelConfig:
    """Our ModelConfig from a LlamaConfig (what importing reads)."""
    rope = getattr(hf_config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", None))
    return ModelConfig(dim=hf_config.hidden_size, n_layers=hf_config.num_hidden_layers,
                       n_heads=hf_config.num_attention_heads, n_kv_heads=hf_config.num_key_value_heads,
                       ffn_dim=hf_config.intermediate_size, vocab_size=hf_config.vocab_size,
                       max_seq_len=hf_config.max_position_embeddings, rope_theta=float(theta),
                       norm_eps=hf_config.rms_norm_eps)


def byte_chars() -> list[str]:
    """The printable character that the ByteLevel step of the tokenizers library (GPT-2's
    table) stands each byte value for: printable Latin-1 bytes stand for themselves, the
    others (control characters, space, a few more) for the characters from U+0100 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(others)) for b in range(256)]


def byte_tokenizer():
    """A tokenizer whose token ids are the byte values of the UTF-8 text, as ours are
    (transformers' PreTrainedTokenizerFast over ``bytes_tokenizer``)."""
    transformers = require("transformers")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=bytes_tokenizer(),
                                                clean_up_tokenization_spaces=False)


def bytes_tokenizer(eot: str | None = None):
    """The tokenizers library's Tokenizer of the byte vocabulary, and ``eot`` as id 256 if given.

    Each of the 256 bytes is one token, id = its value. The tokenizers library works on
    strings, so its ByteLevel step stands each byte for one printable character, and the
    vocabulary maps those 256 characters to their byte values; with no merges nothing is
    ever joined. Decoding maps the characters back to bytes, then the bytes to text."""
    tokenizers = require("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers
    tok = tokenizers.Tokenizer(models.BPE(vocab={c: b for b, c in enumerate(byte_chars())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    if eot:
        tok.add_special_tokens([eot])
    return tok
