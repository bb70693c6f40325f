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
  gloo handle poorly), cast once per forward to the dtype attention computes in and
  handed to every block, so a bf16 compute dtype never meets an fp32 buffer (FSDP2
  never casts buffers);
- the local number of heads is inferred from the projection's output (``view(..., -1,
  head_dim)``), so the same code runs with all heads or with 1/tp of them.

It is also lean in eager mode: outside the matmuls a GPU step is a string of
memory-bound kernels, each reading and writing whole activations, so every extra
cast or copy costs time (``python -m tools.bench_model`` counts them against a GPT-2
block). Hence PyTorch's fused RMSNorm, RoPE in two multiplies and an add, SDPA's own
grouped-query support instead of copied k/v heads, and each norm's output cast to
autocast's dtype once rather than once per projection that reads it.
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
    # Mixture of experts (0 experts: the dense SwiGLU MLP). Each token goes to top_k of
    # n_experts SwiGLU experts of hidden size ffn_dim; moe_aux_weight scales the router's
    # load-balancing loss in the training loss.
    n_experts: int = 0
    top_k: int = 2
    moe_aux_weight: float = 0.01

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def as_dict(self) -> dict:
        return asdict(self)


# The presets. ``debug`` trains in seconds on a laptop CPU (tests use it), ``small`` is
# the CPU walkthrough model, and the larger ones have the shapes of well-known models:
# ``1b`` is Llama 3.2 1B's and ``8b`` is Llama 3 8B's layer stack. With a 256-entry byte
# vocabulary their embeddings are tiny, so ``8b`` has 7.0B parameters, not 8.0B (Llama 3's
# 128K-token vocabulary accounts for the other billion: ``--vocab-size 128256`` restores it,
# and ``8b`` takes Llama 3's 8192-token context, so published layouts can be sized as they are).
PRESETS: dict[str, ModelConfig] = {
    "debug": ModelConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=192, max_seq_len=256),
    "small": ModelConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768, max_seq_len=1024),
    "125m": ModelConfig(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, ffn_dim=3584),
    "1b": ModelConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192),
    "8b": ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, rope_theta=500000.0,
                      max_seq_len=8192),
}
# Mixtures of experts: 8 experts, each token through 2 of them. Each expert is half as wide
# as the dense preset's MLP, so a token computes about what it does in the dense model
# while the model holds 4x the MLP weights.
PRESETS |= {
    "debug-moe": replace(PRESETS["debug"], ffn_dim=96, n_experts=8, top_k=2),
    "small-moe": replace(PRESETS["small"], ffn_dim=384, n_experts=8, top_k=2),
    "1b-moe": replace(PRESETS["1b"], ffn_dim=4096, n_experts=8, top_k=2),
}


def get_config(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    cfg = replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})
    if cfg.dim % cfg.n_heads or cfg.n_heads % cfg.n_kv_heads or cfg.head_dim % 2:
        raise ValueError(f"model {name!r}: dim must split into an even head_dim per head and "
                         f"n_heads must be a multiple of n_kv_heads (got {cfg})")
    if cfg.n_experts and not 1 <= cfg.top_k <= cfg.n_experts:
        raise ValueError(f"model {name!r}: top_k must be between 1 and n_experts ({cfg.n_experts}), got {cfg.top_k}")
    return cfg


def count_params(cfg: ModelConfig, active: bool = False) -> int:
    """Parameter count from the shapes alone (tests hold the real model to it). ``active``:
    those a token uses, with a mixture of experts' top_k experts instead of all of them."""
    d, kv = cfg.dim, cfg.n_kv_heads * cfg.head_dim
    attention = d * d + 2 * d * kv + d * d          # wq, wk, wv, wo
    experts = min(cfg.n_experts, cfg.top_k) if active else cfg.n_experts
    mlp = 3 * d * cfg.ffn_dim * max(1, experts)  # w1 (gate), w3 (up), w2 (down), per expert
    mlp += d * cfg.n_experts                             # the router (MoE only)
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
    # A mixture of experts: a token goes through top_k experts, not all (active parameters).
    n_matmul = count_params(cfg, active=True) - cfg.vocab_size * cfg.dim - (2 * cfg.n_layers + 1) * cfg.dim
    return 6 * n_matmul + 12 * cfg.n_layers * cfg.dim * seq_len


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm``, returning its output in autocast's dtype when autocast is on.

    ``F.rms_norm`` normalises in fp32 whatever the input dtype, and on CUDA it is one
    fused kernel each way when the input and the gain share a dtype (the fp32 residual
    stream under autocast, bf16 under FSDP's mixed precision). Several projections read a
    norm's output (q, k and v; gate and up) and autocast would make one bf16 copy of it
    for each of them, in forward and again for the gradients: one cast here serves them all.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        device = y.device.type
        return y.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else y


def rope_tables(cfg: ModelConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(max_seq_len, head_dim) tables: the angle of pair i repeated for both of its
    elements, and the sine signed for the element it is subtracted from (apply_rope)."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device).float() / cfg.head_dim))
    angles = torch.outer(torch.arange(cfg.max_seq_len, device=device).float(), inv_freq)
    cos = angles.cos().repeat_interleave(2, dim=-1)                      # c0 c0 c1 c1 ...
    sin = torch.stack((-angles.sin(), angles.sin()), dim=-1).flatten(-2)  # -s0 s0 -s1 s1 ...
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., 2i], x[..., 2i+1]) of x: (batch, seq, heads, head_dim).

    (a, b) -> (a cos - b sin, b cos + a sin) is x * cos + (x with each pair swapped) * sin,
    the minus sign living in the table: one copy (the swap) and three elementwise ops,
    where slicing out the even and odd elements and stacking them back took eight.
    """
    if cos.dim() == 2:  # the tables: positions 0, 1, ... for every sequence
        cos, sin = cos[: x.shape[1], None, :], sin[: x.shape[1], None, :]
    else:  # (batch, seq, head_dim): each token's own row (--doc-mask: positions restart per document)
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return x * cos + swapped * sin



def kv_for_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, device_type: str, masked: bool = False):
    """(k, v, grouped) as the attention kernel takes them. Grouped-query attention (fewer k/v
    heads than q heads) runs as it is (``enable_gqa``), except on CUDA in fp32 or with a
    mask (``masked``, --doc-mask): CUDA's grouped kernel (flash) is half/bf16 only and takes
    no mask, and the kernel that takes a mask (memory-efficient) takes no grouped heads, so
    enable_gqa would fall back to the math kernel, which stores the seq x seq scores; there
    each k/v head is repeated for its q heads instead.
    CUDA path: tests/test_cuda_paths.py::test_fp32_grouped_attention_takes_the_expanded_heads_on_cuda
    and tests/test_doc_mask.py::test_masked_grouped_attention_takes_the_expanded_heads_on_cuda"""
    grouped = k.shape[2] != q.shape[2]
    if grouped and device_type == "cuda" and (q.dtype == torch.float32 or masked):
        k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
        v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
        grouped = False
    return k, v, grouped

class Attention(nn.Module):
    # The attention kernel, (q, k, v, is_causal, enable_gqa) in SDPA's layout: context
    # parallelism swaps in its ring from outside (common/parallelize/cp.py). The ring is
    # causal only: handed a mask (--doc-mask) it raises, and train_cp.py refuses the flag.
    sdpa = staticmethod(F.scaled_dot_product_attention)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin, mask=None):
        """``mask``: None, causal attention over the whole window; or (batch, 1, seq, seq)
        booleans, True where a query may attend to a key (--doc-mask: document_mask)."""
        bsz, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them.
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v, grouped = kv_for_kernel(q, k, v, x.device.type, masked=mask is not None)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if mask is None:
            out = self.sdpa(q, k, v, is_causal=True, enable_gqa=grouped)
        else:  # the mask holds causality too: is_causal and attn_mask do not go together
            out = self.sdpa(q, k, v, attn_mask=mask, enable_gqa=grouped)
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


# ---- mixture of experts -----------------------------------------------------------------
_GROUPED_MM: dict = {}


def grouped_mm_works(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``F.grouped_mm`` runs for these shapes, dtype and device (probed once each).

    It is one kernel for all experts' matmuls on the tokens grouped by expert. torch 2.13
    has it on CPU too; older builds have it only on CUDA, for bf16 on Hopper GPUs and
    newer. Where it is missing the experts run one after another (the same numbers), and
    so they do under torch.compile, whose grouped_mm takes bf16 only (torch 2.13)."""
    if torch.compiler.is_compiling():
        return False
    key = (x.device.type, x.dtype, w.shape[-2:])
    if key not in _GROUPED_MM:
        ok = hasattr(F, "grouped_mm")
        if ok:
            try:
                probe = torch.zeros(2, w.shape[-2], device=x.device, dtype=x.dtype)
                F.grouped_mm(probe, torch.zeros(2, *w.shape[-2:], device=x.device, dtype=x.dtype),
                             offs=torch.tensor([1, 2], device=x.device, dtype=torch.int32))
            except (RuntimeError, NotImplementedError):
                ok = False
        _GROUPED_MM[key] = ok
    return _GROUPED_MM[key]


def expert_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x's rows grouped by expert (``counts[e]`` rows for expert e) times that expert's w[e]."""
    if grouped_mm_works(x, w):
        return F.grouped_mm(x, w, offs=counts.cumsum(0).to(torch.int32))
    return torch.cat([xe @ we for xe, we in zip(x.split(counts.tolist()), w)])


class GroupedExperts(nn.Module):
    """n SwiGLU experts, each weight a stack (n, in, out), so one kernel serves all experts."""

    def __init__(self, n: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, dim, hidden))  # gate
        self.w3 = nn.Parameter(torch.empty(n, dim, hidden))  # up
        self.w2 = nn.Parameter(torch.empty(n, hidden, dim))  # down

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # Under expert parallelism the stacks are DTensors split by expert: each rank
        # computes with its own experts. Cast to x's dtype: autocast does not cover grouped_mm.
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        w1, w2, w3 = w1.to(x.dtype), w2.to(x.dtype), w3.to(x.dtype)
        return expert_matmul(F.silu(expert_matmul(x, w1, counts)) * expert_matmul(x, w3, counts), w2, counts)


class MoE(nn.Module):
    """Mixture of experts: a router sends each token to its top_k experts.

    Dropless: every expert takes however many tokens it is sent, so no token is dropped
    and the result is a function of the routing alone, the same on one device and split
    over any number of ranks (what lets the tests check expert parallelism exactly). The
    price is uneven work: a popular expert computes more, and under expert parallelism
    its rank works longer and the others wait for it (a capacity factor would cap it and drop tokens).

    ``aux_loss`` (after a forward) is the load-balancing loss of Switch Transformer,
    n_experts * sum_e f_e * P_e, f_e the share of routed tokens expert e got and P_e its
    mean router probability: 1 when the load is even, n_experts / top_k at worst (every token
    picks the same top_k experts). f counts the
    tokens of the whole global batch: ``global_counts`` sums them over the data-parallel
    ranks when set from outside (each rank's loss then averages to the global one).
    ``tokens_per_expert`` keeps the last forward's global counts, for the figures.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg.n_experts, cfg.dim, cfg.ffn_dim)
        self.global_counts = None  # set by common/parallelize/ep.py: counts -> summed over the ranks
        self.aux_loss = self.tokens_per_expert = None

    def forward(self, x):
        shape, n = x.shape, self.router.out_features
        x = x.reshape(-1, shape[-1])
        probs = self.router(x).float().softmax(dim=-1)           # (tokens, n_experts), fp32
        weights, chosen = probs.topk(self.top_k, dim=-1)        # (tokens, top_k)
        weights = weights / weights.sum(dim=-1, keepdim=True)   # the chosen experts' shares sum to 1
        counts = torch.bincount(chosen.flatten(), minlength=n)  # token slots per expert
        total = self.global_counts(counts) if self.global_counts is not None else counts
        self.tokens_per_expert = total.detach()
        self.aux_loss = n * (total.float() / total.sum() * probs.mean(dim=0)).sum()
        # Group the (token, choice) slots by expert, run the experts, weigh, add back per token.
        order = chosen.flatten().argsort(stable=True)
        token = order // self.top_k
        y = self.experts(x[token], counts) * weights.flatten()[order, None].to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, y).view(shape)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = MoE(cfg) if cfg.n_experts else FeedForward(cfg)

    def forward(self, x, cos, sin, mask=None):
        # mask by keyword: tensor parallelism's input plan (common/parallelize/tp.py) lays out
        # the positional inputs (x, cos, sin) and passes keywords through untouched.
        x = x + self.attention(self.attention_norm(x), cos, sin, mask=mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Output(nn.Linear):
    """The output layer; given the targets too, it returns the loss instead of the logits.

    ``loss_chunks`` > 1 (``--loss-chunks``, set from outside) computes that loss a chunk of
    tokens at a time and never holds all the logits (common/loss.py). Both happen inside
    this module's forward, so an FSDP unit around it has its weight gathered for it."""

    loss_chunks = 1

    def forward(self, h: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        from common.loss import chunked_cross_entropy, plain_cross_entropy
        if targets is None:
            return super().forward(h)
        if self.loss_chunks > 1:
            return chunked_cross_entropy(h, self.weight, targets, self.loss_chunks)
        return plain_cross_entropy(super().forward(h), targets)


def document_mask(tokens: torch.Tensor, eot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, mask) for per-document attention (--doc-mask) over a (batch, seq) window.

    A window may hold the end of one document and the start of others. A document starts at
    the window's first token and right after each end-of-text token ``eot``; the end-of-text
    token belongs to the document it ends. ``positions`` (batch, seq): each token's position
    inside its document (0 at its start), the RoPE rows to read. ``mask`` (batch, 1, seq, seq):
    True where query i may attend to key j: j <= i and both in the same document (the 1
    broadcasts over the heads). It is the same for every layer, so it is built once a forward.
    """
    seq = tokens.shape[1]
    idx = torch.arange(seq, device=tokens.device)
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = tokens[:, :-1] == eot
    doc = starts.cumsum(dim=1)  # which document of the window each token is in
    first = torch.where(starts, idx, 0).cummax(dim=1).values  # where that document starts
    mask = (doc[:, :, None] == doc[:, None, :]) & (idx[:, None] >= idx[None, :])
    return idx - first, mask[:, None]


class Transformer(nn.Module):
    # --doc-mask (set from outside, set_doc_mask): the end-of-text token id whose documents
    # attend only to themselves, or None: causal attention over the whole window.
    doc_eot: int | None = None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = Output(cfg.dim, cfg.vocab_size, bias=False)
        # Not persistent: they are a function of the config, never trained or saved.
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The logits, or given ``targets`` the mean cross entropy (fp32; ``Output``)."""
        # A pipeline stage without the embedding receives hidden states instead of tokens.
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        cos, sin = self.rope_for(h)
        mask = None
        if self.doc_eot is not None:  # each token's RoPE row by its position in its document
            positions, mask = document_mask(tokens, self.doc_eot)
            cos, sin = cos[positions], sin[positions]
        for layer in self.layers.values():
            h = layer(h, cos, sin) if mask is None else layer(h, cos, sin, mask=mask)
        h = self.norm(h) if self.norm is not None else h
        if self.output is None:
            return h
        return self.output(h) if targets is None else self.output(h, targets)

    def moe_aux_loss(self) -> torch.Tensor | float:
        """The load-balancing loss of the last forward, weighted, summed over the MoE layers
        (0 for a dense model): what a training step adds to the language-model loss."""
        losses = [layer.feed_forward.aux_loss for layer in self.layers.values() if isinstance(layer.feed_forward, MoE)]
        return self.cfg.moe_aux_weight * sum(losses) if losses else 0.0

    def rope_for(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables in the dtype q and k will have: autocast's if it is on, else h's."""
        device = h.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
        return self.rope_cos.to(dtype), self.rope_sin.to(dtype)  # no copy when already in dtype

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
            std = residual_std if name.endswith(("wo.weight", "w2.weight", "experts.w2")) else 0.02
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            full = torch.empty(p.shape).normal_(0.0, std, generator=g)
            if isinstance(p, DTensor):  # sharded (FSDP/TP): every rank drew the same whole tensor, so each
                # keeps its own piece (src_data_rank=None: no scatter from rank 0, no communication)
                full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
            p.copy_(full)


def set_loss_chunks(model: nn.Module, chunks: int) -> None:
    """``--loss-chunks``: the model's loss (``model(x, targets=y)``) in that many chunks of tokens."""
    if chunks < 1:
        raise ValueError(f"loss chunks must be at least 1 (got {chunks})")
    if getattr(model, "output", None) is not None:
        model.output.loss_chunks = chunks


def set_doc_mask(model: nn.Module, eot: int | None) -> None:
    """``--doc-mask``: attention and RoPE positions restart at every document in a window, the
    documents ending at token ``eot`` (None: off, causal attention over the whole window).
    The boundaries are read from the input tokens, so the model must see them: a pipeline
    stage without the embedding, which receives hidden states, cannot."""
    if eot is not None and getattr(model, "tok_embeddings", None) is None:
        raise ValueError("--doc-mask reads the document boundaries from the tokens: this model part has no embedding")
    model.doc_eot = eot


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
