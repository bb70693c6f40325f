"""A Llama-style decoder-only transformer that knows nothing about parallelism.

Every parallel strategy in this tutorial is applied to this model from the outside
(torchtitan's rule): FSDP wraps each entry of ``model.layers``; tensor parallelism
addresses the projections by name (``attention.wq/wk/wv/wo``,
``feed_forward.w1/w2/w3``); pipeline parallelism deletes the layers a stage does not own
and sets ``tok_embeddings`` / ``norm`` / ``output`` to ``None`` where they live on
another stage. ``layers`` is an ``nn.ModuleDict`` keyed by the global layer index so
that names (and therefore checkpoints and initial weights) stay the same after layers
are dropped.

Two choices keep the strategies exact and simple:
- the rotary tables are real cos/sin buffers (no complex numbers, which DTensor and
  gloo handle poorly) and are cast to the activation dtype where they are used, so a
  bf16 compute dtype never meets an fp32 buffer;
- the local number of heads is inferred from the projection's output (``view(..., -1,
  head_dim)``), so the same code runs with all heads or with 1/tp of them.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, distribute_tensor


@dataclass(frozen=True)
class ModelConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int = 256  # byte-level tokens: no tokenizer to download
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def as_dict(self) -> dict:
        return asdict(self)


# The presets. ``debug`` trains in seconds on a laptop CPU (tests use it), ``small`` is
# the CPU walkthrough model, and the larger ones have the shapes of well-known models:
# ``1b`` is Llama 3.2 1B's and ``8b`` is Llama 3 8B's layer stack. With a 256-entry byte
# vocabulary their embeddings are tiny, so ``8b`` has 7.0B parameters, not 8.0B (Llama 3's
# 128K-token vocabulary accounts for the other billion).
PRESETS: dict[str, ModelConfig] = {
    "debug": ModelConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=192, max_seq_len=256),
    "small": ModelConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768, max_seq_len=1024),
    "125m": ModelConfig(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, ffn_dim=3584),
    "1b": ModelConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192),
    "8b": ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, rope_theta=500000.0),
}


def get_config(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    cfg = replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})
    if cfg.dim % cfg.n_heads or cfg.n_heads % cfg.n_kv_heads or cfg.head_dim % 2:
        raise ValueError(f"model {name!r}: dim must split into an even head_dim per head and "
                         f"n_heads must be a multiple of n_kv_heads (got {cfg})")
    return cfg


def count_params(cfg: ModelConfig) -> int:
    """Parameter count from the shapes alone (tests hold the real model to it)."""
    d, kv = cfg.dim, cfg.n_kv_heads * cfg.head_dim
    attention = d * d + 2 * d * kv + d * d          # wq, wk, wv, wo
    mlp = 3 * d * cfg.ffn_dim                       # w1 (gate), w3 (up), w2 (down)
    norms = 2 * d                                   # attention_norm, ffn_norm
    return cfg.vocab_size * d + cfg.n_layers * (attention + mlp + norms) + d + d * cfg.vocab_size


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token: 6 * N_matmul + 12 * n_layers * dim * seq_len.

    6N: each weight does one multiply-add (2 FLOPs) per token in the forward pass and two
    in the backward pass (gradient of the input and of the weight). N counts the weights
    used in matrix multiplies, so the embedding lookup and the norm gains are left out,
    the output projection is in. The second term is attention's QK^T and AV products
    (PaLM's appendix B formula: 6 * 2 * L * d * T), counted as if the causal mask did not
    skip the upper triangle, the convention MFU numbers are usually reported with.
    """
    n_matmul = count_params(cfg) - cfg.vocab_size * cfg.dim - (2 * cfg.n_layers + 1) * cfg.dim
    return 6 * n_matmul + 12 * cfg.n_layers * cfg.dim * seq_len


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 even when x is bf16: the mean of squares loses precision fast.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight

    def reset_parameters(self):
        nn.init.ones_(self.weight)


def rope_tables(cfg: ModelConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device).float() / cfg.head_dim))
    angles = torch.outer(torch.arange(cfg.max_seq_len, device=device).float(), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., 2i], x[..., 2i+1]) of x: (batch, seq, heads, head_dim)."""
    cos = cos[: x.shape[1]].to(x.dtype)[None, :, None, :]  # cast: fp32 tables, bf16 compute
    sin = sin[: x.shape[1]].to(x.dtype)[None, :, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin):
        bsz, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them.
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if k.shape[2] != q.shape[2]:  # grouped-query attention: share each k/v head
            k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
            v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # Not persistent: they are a function of the config, never trained or saved.
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # A pipeline stage without the embedding receives hidden states instead of tokens.
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    @torch.no_grad()
    def init_weights(self, seed: int = 0):
        """(Re)initialise every parameter and buffer in place, reproducibly.

        Each parameter draws from its own generator seeded by (seed, its name), on the
        CPU, so the weights are the same whatever the device, whichever layers this
        process kept (pipeline stages) and whatever order modules are materialised in.
        Linear and embedding weights ~ N(0, 0.02); the projections that write into the
        residual stream (wo, w2) are scaled by 1/sqrt(2 * n_layers) (GPT-2) so the
        residual's variance does not grow with depth; norm gains are 1.
        """
        cos, sin = rope_tables(self.cfg)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            std = residual_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            full = torch.empty(p.shape).normal_(0.0, std, generator=g)
            if isinstance(p, DTensor):  # sharded (FSDP/TP): keep only this rank's piece
                full = distribute_tensor(full, p.device_mesh, p.placements)
            p.copy_(full)


def build_model(cfg: ModelConfig, device: torch.device | str, seed: int = 0) -> Transformer:
    """Build on the meta device (no memory, no init cost), then materialise and init.

    The same two steps let FSDP materialise only its shards: build on meta, shard, then
    ``to_empty`` and ``init_weights``.
    """
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model
