"""Small pieces of a training loop that are not the lesson of any step."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from common.data import Batches


def lr_schedule(optimizer: torch.optim.Optimizer, args) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up to ``--lr``, then cosine decay to a tenth of it at the last step."""
    warmup, total = args.warmup_steps, args.steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def adamw_options(args) -> dict:
    """The AdamW hyperparameters, for wrappers that build the optimizer themselves (ZeRO-1)."""
    return dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)


def adamw(params, args, **kwargs) -> torch.optim.AdamW:
    """AdamW as every script uses it (fp32 state: 8 bytes per parameter)."""
    return torch.optim.AdamW(params, **adamw_options(args), **kwargs)


@torch.no_grad()
def evaluate(model, tokens: torch.Tensor, args, device) -> float | None:
    """Mean next-byte loss on the first ``--eval-batches`` held-out batches (no shuffle)."""
    if args.eval_batches == 0 or len(tokens) <= args.seq_len * args.global_batch_size:
        return None
    was_training = model.training
    model.eval()
    batches = iter(Batches(tokens, args.seq_len, args.global_batch_size, shuffle=False))
    losses = []
    for _ in range(args.eval_batches):
        x, y = next(batches)
        x, y = x.to(device), y.to(device)
        losses.append(F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()).item())
    model.train(was_training)
    return sum(losses) / len(losses)
