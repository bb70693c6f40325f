"""The FLOPs the step-time model (steptime.py) counts: a block's matmuls and causal
attention, the output layer, and what activation checkpointing runs again."""
from __future__ import annotations

from common.model import ModelConfig


def layer_matmul_params(cfg: ModelConfig) -> int:
    d, kv = cfg.dim, cfg.n_kv_heads * cfg.head_dim
    return 2 * d * d + 2 * d * kv + 3 * d * cfg.ffn_dim * max(1, min(cfg.n_experts, cfg.top_k))


def layer_flops(cfg: ModelConfig, seq_len: int) -> float:
    """Forward + backward FLOPs of one block per token, causal attention counted as run (half)."""
    return 6 * layer_matmul_params(cfg) + attention_flops(cfg, seq_len)


def attention_flops(cfg: ModelConfig, seq_len: int) -> float:
    """QK^T and AV of one block per token, forward and backward, as a causal kernel runs them:
    half of PaLM's 6 x 2 x dim x seq (common/model.py's flops_per_token counts it whole)."""
    return 6 * cfg.dim * seq_len


def model_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """The step-time model's FLOPs a token, the whole model forward and backward: every block's
    (causal attention halved) and the output layer's. The planner's MFU and its "% of the rate
    assumed" count these, as its compute term does; flops_per_token (the scripts' MFU) counts
    attention whole, 6 x n_layers x dim x seq more."""
    return cfg.n_layers * layer_flops(cfg, seq_len) + head_flops(cfg)


def head_flops(cfg: ModelConfig) -> float:
    return 6 * cfg.vocab_size * cfg.dim


def recompute_flops(cfg: ModelConfig, seq_len: int, ac: str) -> float:
    """Extra FLOPs per token and checkpointed block: full AC runs the forward again (a third);
    selective-op runs wk, wo and w3 again (2 FLOPs a weight a token)."""
    if ac == "selective-op":
        return float(per_op_sac_flops(cfg))
    return layer_flops(cfg, seq_len) / 3 if ac == "full" else 0.0


def per_op_sac_flops(cfg: ModelConfig) -> float:
    """Matmul FLOPs per token and block that torchtitan's per-op selective AC runs again:
    it saves every second matmul's output (a count per block, saving the odd ones), so of
    wq, wk, wv, wo, w1, w3, w2 it recomputes wk, wo and w3 in backward, 2 FLOPs a weight."""
    d, kv = cfg.dim, cfg.n_kv_heads * cfg.head_dim
    return 2 * (d * kv + d * d + d * cfg.ffn_dim * max(1, min(cfg.n_experts, cfg.top_k)))
