"""How lean is our block in eager mode? Ops and bytes against a GPT-2 block, and step times.

    python -m tools.bench_model

Outside its matmuls a training step is a string of small elementwise kernels (norms,
RoPE, casts, the SwiGLU gate, residual adds). Each reads and writes whole activations
and does almost no arithmetic, so its time is memory traffic plus a kernel launch;
``torch.compile`` fuses them away, eager mode pays for every one. This counts them.

What is counted, over one block's forward and backward under bf16 autocast at 125m's
width, batch 2 x 256, the input and parameters requiring gradients (the set-up the targets below were set for):

- **ops**: aten ops that run a kernel, as a ``TorchDispatchMode`` sees them. Ops whose
  outputs are views of their inputs (view, transpose, t, expand, slice, detach,
  ``_unsafe_view``...) launch nothing and are not counted; matmuls and attention are.
- **non-matmul bytes**: the bytes of the tensors those ops write, except the matmuls
  (mm, addmm, bmm, baddbmm) and the attention kernels (forward and backward), whose
  cost is the arithmetic both blocks share. In-place ops count the tensor they write.
  autocast's bf16 copies of the weights and the fp32 casts of their gradients are
  included (they are real traffic every step) and also shown on their own: they grow
  with the parameters, not the batch, so at 2 x 256 they are a large share.

The yardstick is a GPT-2 block of the same width (``GPT2Block`` below: LayerNorm, one
fused qkv projection with biases, SDPA, GELU MLP of 4 x width), the block nanoGPT
trains. CPU has no fused RMSNorm kernel (``F.rms_norm`` decomposes into about twenty
ops there), while CUDA runs it as one kernel each way, as LayerNorm is on both. So on
CPU our block is also counted with the norm standing in for CUDA's fused kernel (a
custom op with the same outputs): that row is the one the targets apply to. On CUDA
the counts are what CUDA runs, and the eager and compiled step times of a whole 125m
model (12 x 1024 tokens, bf16 autocast) are timed against a GPT-2 of the same width and
depth.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file (python tools/x.py): find common/

from common.errors import UserError, main_guard
from common.model import PRESETS, ModelConfig, Transformer, TransformerBlock, get_config

MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul"}
TARGET_OPS, TARGET_BYTES = 1.5, 1.4   # the lean block's targets, ratios to the GPT-2 block


def _is_matmul(name: str) -> bool:
    return name in MATMULS or "scaled_dot_product" in name or "attention" in name


class OpCounter(TorchDispatchMode):
    """Counts the kernels a region runs and the bytes their outputs take (module notes)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.bytes = collections.Counter()   # non-matmul output bytes by op name

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        outs = out if isinstance(out, (tuple, list)) else (out,)
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor) and a.device.type != "meta"}
        written = 0
        new = False
        for ret, o in zip(func._schema.returns, outs):
            if not isinstance(o, torch.Tensor):
                continue
            alias = ret.alias_info
            if alias is not None and not alias.is_write:
                continue                       # a view: no kernel, no bytes
            if alias is None and o.untyped_storage().data_ptr() in inputs:
                continue                       # aliasing without saying so (_unsafe_view)
            new = True
            written += o.numel() * o.element_size()
        if new:
            self.ops[name] += 1
            if not _is_matmul(name):
                self.bytes[name] += written
        return out

    @property
    def n_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def n_bytes(self) -> int:
        return sum(self.bytes.values())


# ---- CUDA's fused RMSNorm, for counting on a CPU --------------------------------------
# One op each way with the outputs of aten::_fused_rms_norm (y, 1/rms) and its backward
# (dx, dweight), so the dispatch mode sees what a GPU would launch.
@torch.library.custom_op("bench_model::fused_rms_norm", mutates_args=())
def _fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (x.float() * rstd).to(x.dtype) * weight, rstd


@_fused_rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x), x.new_empty(x.shape[:-1] + (1,), dtype=torch.float32)


@torch.library.custom_op("bench_model::fused_rms_norm_backward", mutates_args=())
def _fused_rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                             rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xhat = x.float() * rstd
    gw = grad.float() * weight.float()
    dx = rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
    return dx.to(x.dtype), (grad.float() * xhat).flatten(0, -2).sum(0).to(weight.dtype)


def _norm_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1], output[1])
    ctx.set_materialize_grads(False)  # 1/rms gets no gradient: no zeros for it, as on CUDA


def _norm_backward(ctx, grad, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _fused_rms_norm_backward(grad, x, weight, rstd)
    return dx, dw, None


_fused_rms_norm.register_autograd(_norm_backward, setup_context=_norm_setup)


class FusedNormAsOnCUDA(TorchFunctionMode):
    """Routes ``F.rms_norm`` to the stand-in above (used for counting only)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (F.rms_norm, torch.rms_norm):
            x, shape, weight, eps = (list(args) + [None] * 4)[:4]
            weight, eps = kwargs.get("weight", weight), kwargs.get("eps", eps)
            return _fused_rms_norm(x, weight, eps if eps is not None else torch.finfo(x.dtype).eps)[0]
        return func(*args, **kwargs)


# ---- the yardstick ---------------------------------------------------------------------
class GPT2Block(nn.Module):
    """nanoGPT's block: pre-LayerNorm, fused qkv with biases, causal SDPA, 4x GELU MLP."""

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.c_attn, self.c_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.c_fc, self.mlp_proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        bsz, seq, dim = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(dim, dim=-1)
        q, k, v = (t.view(bsz, seq, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(bsz, seq, dim))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT2(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, cfg.dim), nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.h = nn.ModuleList(GPT2Block(cfg.dim, cfg.n_heads) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, vocab_size, bias=False)

    def forward(self, tokens):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# ---- counting ---------------------------------------------------------------------------
def count_block(block: nn.Module, dim: int, device="cpu", batch: int = 2, seq: int = 256,
                rope: tuple | None = None, fused_norm: bool = False) -> OpCounter:
    """One forward and backward of ``block`` under bf16 autocast, counted."""
    block.zero_grad(set_to_none=True)  # a gradient left from an earlier count would add an add_ per parameter
    x = torch.randn(batch, seq, dim, device=device, requires_grad=True)
    args = (x,) if rope is None else (x, *(t.to(device, torch.bfloat16) for t in rope))
    counter = OpCounter()
    with contextlib.ExitStack() as stack:
        if fused_norm:
            stack.enter_context(FusedNormAsOnCUDA())
        stack.enter_context(torch.autocast(torch.device(device).type, torch.bfloat16))
        stack.enter_context(counter)
        y = block(*args)
    grad = torch.ones_like(y)
    with counter:
        y.backward(grad)
    return counter


def our_block(cfg: ModelConfig, device="cpu"):
    model = Transformer(cfg)   # for its rope tables; the block is what is counted
    return model.layers["0"].to(device), (model.rope_cos, model.rope_sin)


def autocast_weight_bytes(block: nn.Module) -> int:
    """autocast's bf16 copy of each matrix (and bias) a matmul reads, plus the fp32 cast of its gradient."""
    return sum(6 * p.numel() for name, p in block.named_parameters() if "norm" not in name and "ln_" not in name)


# ---- step times (CUDA) ------------------------------------------------------------------
def step_ms(model: nn.Module, tokens: torch.Tensor, compiled: bool, steps: int = 20) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    fwd = torch.compile(model) if compiled else model

    def step():
        with torch.autocast("cuda", torch.bfloat16):
            logits = fwd(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


@main_guard
def main(argv=None):
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="125m", help="model preset whose width is counted and timed (default 125m)")
    ap.add_argument("--batch", type=int, default=12, help="sequences per timed step (CUDA only)")
    ap.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence in the timed step (CUDA only)")
    args = ap.parse_args(argv)
    if args.model not in PRESETS:
        raise UserError(f"unknown --model {args.model!r}; choose one of {', '.join(PRESETS)}.")
    cfg = get_config(args.model)
    if not 0 < args.seq_len <= cfg.max_seq_len or args.batch <= 0:  # before the model is built or timed
        raise UserError(f"--batch must be positive and --seq-len between 1 and {cfg.max_seq_len} (got --batch {args.batch} "
                 f"--seq-len {args.seq_len}).")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)

    gpt2 = GPT2Block(cfg.dim, cfg.n_heads).to(device)
    block, rope = our_block(cfg, device)
    yard = count_block(gpt2, cfg.dim, device)
    rows = [("GPT-2 block (yardstick)", yard, autocast_weight_bytes(gpt2))]
    if device == "cpu":
        rows.append(("our block, RMSNorm as CPU runs it", count_block(block, cfg.dim, rope=rope),
                     autocast_weight_bytes(block)))
        rows.append(("our block, RMSNorm as CUDA runs it", count_block(block, cfg.dim, rope=rope, fused_norm=True),
                     autocast_weight_bytes(block)))
    else:
        rows.append(("our block", count_block(block, cfg.dim, device, rope=rope), autocast_weight_bytes(block)))

    mib = 2**20
    print(f"One block's forward + backward, bf16 autocast, width {cfg.dim}, batch 2 x 256, on {device}:")
    print(f"{'':36s} {'ops':>5s} {'x GPT-2':>8s} {'non-matmul MiB':>15s} {'x GPT-2':>8s} {'of which weight casts':>22s}")
    for label, c, wb in rows:
        print(f"{label:36s} {c.n_ops:5d} {c.n_ops / yard.n_ops:8.2f} {c.n_bytes / mib:15.1f} "
              f"{c.n_bytes / yard.n_bytes:8.2f} {wb / mib:18.1f} MiB")
    ours = rows[-1][1]
    print(f"targets: ops <= {TARGET_OPS}x, bytes <= {TARGET_BYTES}x the yardstick's; "
          f"here {ours.n_ops / yard.n_ops:.2f}x and {ours.n_bytes / yard.n_bytes:.2f}x")
    print("our block's ops:", ", ".join(f"{k} {v}" for k, v in ours.ops.most_common()))

    if device != "cuda":
        print("CUDA step times skipped: no GPU here (run this on one to time eager and compiled steps).")
        return
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), device=device)
    ours_model = Transformer(cfg).to(device)
    ours_model.init_weights(0)
    ref_model = GPT2(cfg, cfg.vocab_size).to(device)
    print(f"\nStep time, {args.model} ({cfg.n_layers} layers), {args.batch} x {args.seq_len} tokens, bf16 autocast, "
          f"median of 20 ({torch.cuda.get_device_name()}):")
    times = {}
    for compiled in (False, True):
        times[compiled] = (step_ms(ours_model, tokens, compiled), step_ms(ref_model, tokens, compiled))
        mode = "compiled" if compiled else "eager"
        a, b = times[compiled]
        print(f"  {mode:9s} ours {a:7.1f} ms   GPT-2 {b:7.1f} ms   ratio {a / b:.2f}")
    print("target: eager ratio <= 1.15")


if __name__ == "__main__":
    main()
