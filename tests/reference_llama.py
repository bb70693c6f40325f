"""The model as it was before it was made lean, written plainly, for parity tests.

RMSNorm in fp32 by hand, RoPE on the even/odd elements with fp32 half-width tables cast
per call, k/v heads copied for grouped-query attention. It takes the lean model's state
dict as is: the names and the weights are the same, so equal logits prove the rewrite
computes the same function.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


def rms_norm(x, weight, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.type_as(x) * weight


def rope(x, cos, sin):
    cos = cos[: x.shape[1]].to(x.dtype)[None, :, None, :]
    sin = sin[: x.shape[1]].to(x.dtype)[None, :, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class ReferenceLlama(nn.Module):
    def __init__(self, cfg, state_dict):
        super().__init__()
        self.cfg = cfg
        self.w = nn.ParameterDict({k.replace(".", "/"): nn.Parameter(v.detach().clone()) for k, v in state_dict.items()})
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
        angles = torch.outer(torch.arange(cfg.max_seq_len).float(), inv_freq)
        self.cos, self.sin = angles.cos(), angles.sin()

    def p(self, name):
        return self.w[name.replace(".", "/")]

    def forward(self, tokens):
        cfg, p = self.cfg, self.p
        h = F.embedding(tokens, p("tok_embeddings.weight"))
        bsz, seq = tokens.shape
        for i in range(cfg.n_layers):
            L = f"layers.{i}."
            x = rms_norm(h, p(L + "attention_norm.weight"), cfg.norm_eps)
            q = (x @ p(L + "attention.wq.weight").T).view(bsz, seq, cfg.n_heads, cfg.head_dim)
            k = (x @ p(L + "attention.wk.weight").T).view(bsz, seq, cfg.n_kv_heads, cfg.head_dim)
            v = (x @ p(L + "attention.wv.weight").T).view(bsz, seq, cfg.n_kv_heads, cfg.head_dim)
            q, k = rope(q, self.cos, self.sin), rope(k, self.cos, self.sin)
            rep = cfg.n_heads // cfg.n_kv_heads
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
            att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            h = h + att.transpose(1, 2).reshape(bsz, seq, -1) @ p(L + "attention.wo.weight").T
            x = rms_norm(h, p(L + "ffn_norm.weight"), cfg.norm_eps)
            gate = F.silu(x @ p(L + "feed_forward.w1.weight").T) * (x @ p(L + "feed_forward.w3.weight").T)
            h = h + gate @ p(L + "feed_forward.w2.weight").T
        return rms_norm(h, p("norm.weight"), cfg.norm_eps) @ p("output.weight").T
