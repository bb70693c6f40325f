"""The language-model loss, with or without ever holding all the logits.

The plain loss projects every token onto the vocabulary and hands the (tokens, vocab)
logits to cross entropy. With a large vocabulary that tensor, not the model, is what a
step's memory is made of: at 16,384 tokens a rank and Llama 3's 128,256 entries the fp32
logits are 7.8 GiB, cross entropy's log-probabilities as much again, and backward adds two
gradients of the same size (31 GiB in all). ``chunked_cross_entropy`` computes the same
loss and gradients a chunk of tokens at a time: forward keeps only the hidden states it
was given (the output layer's input, which the plain loss keeps too), and backward
recomputes each chunk's logits, turns them into that chunk's gradients and frees them
before the next chunk. The price is the output matmul run twice (a few percent of a step).
The same idea as Liger-Kernel's fused linear cross entropy, in plain PyTorch ops.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _compute_dtype(h: torch.Tensor) -> torch.dtype:
    device = h.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """mean over tokens of cross_entropy(h @ weight.T, targets), chunk by chunk."""

    @staticmethod
    def forward(ctx, h, weight, targets, chunks, dtype):
        # Autocast does not reach inside a custom Function's backward: cast explicitly, once,
        # and run both passes in that dtype (under autocast the plain loss's weight copy is
        # autocast's cache; here it is this one, saved for backward the same way).
        with torch.autocast(h.device.type, enabled=False):
            hc, w = h.to(dtype), weight.to(dtype)
            total = torch.zeros((), device=h.device, dtype=torch.float32)
            for x, y in zip(hc.chunk(chunks), targets.chunk(chunks)):
                total += F.cross_entropy((x @ w.t()).float(), y, reduction="sum")
        ctx.save_for_backward(hc, w, targets)
        ctx.chunks, ctx.weight_dtype, ctx.h_dtype = chunks, weight.dtype, h.dtype
        return total / h.shape[0]

    @staticmethod
    def backward(ctx, grad):
        hc, w, targets = ctx.saved_tensors
        scale = grad / hc.shape[0]
        grad_h = torch.empty(hc.shape, dtype=ctx.h_dtype, device=hc.device)
        grad_w = torch.zeros(w.shape, dtype=ctx.weight_dtype, device=w.device)
        start = 0
        with torch.autocast(hc.device.type, enabled=False):
            for x, y in zip(hc.chunk(ctx.chunks), targets.chunk(ctx.chunks)):
                # d loss / d logits = softmax - one_hot(target), over the mean's token count
                g = (x @ w.t()).float().softmax(dim=-1)
                g[torch.arange(len(y), device=y.device), y] -= 1
                g = (g * scale).to(x.dtype)
                grad_h[start:start + len(y)] = g @ w
                if grad_w.dtype == x.dtype:
                    grad_w.addmm_(g.t(), x)
                else:  # fp32 weights computed in bf16: the chunk's product, then added in fp32
                    grad_w += g.t() @ x
                start += len(y)
        return grad_h, grad_w, None, None, None


def chunked_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunks: int) -> torch.Tensor:
    """``F.cross_entropy(h @ weight.T, targets)`` (the mean over tokens, fp32) computed in
    ``chunks`` chunks of tokens: h (..., dim), weight (vocab, dim), targets h's leading shape."""
    h, targets = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    return _ChunkedLinearCrossEntropy.apply(h, weight, targets, chunks, _compute_dtype(h))


def plain_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss of every script: the mean next-token cross entropy, in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
