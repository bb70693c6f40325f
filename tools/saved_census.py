"""What autograd keeps from one transformer block, tensor by tensor, on this machine's kernels.

    python -m tools.saved_census --model 1b --device cuda --amp bf16
    python -m tools.saved_census --model 1b --device cuda --amp off --batch 4 --seq-len 2048

common/measure/formulas.py counts a block's activations from what its ops save for backward.
On a CPU the memory tracer checks that count; on a GPU the kernels differ (attention,
RMSNorm, autocast's casts), and this tool lists what they really save: one forward of one
block, then a walk over the autograd graph reading each node's saved tensors
(``grad_fn._saved_*``), counted once per storage. Weights and autocast's bf16 copies of
them are listed apart (formulas.py counts the copies per model, not per block), and so are
the rotary tables. The last line compares the total with ``formulas.layer_activation_bytes``.
"""
from __future__ import annotations

import argparse
import sys

import torch

from common.errors import UserError, main_guard
from common.measure import formulas
from common.model import PRESETS, TransformerBlock, get_config, rope_tables


def _saved(node):
    """(attribute, tensor) pairs a grad_fn node keeps: _saved_self, _saved_result, ..."""
    for name in dir(node):
        if not name.startswith("_saved_"):
            continue
        try:
            value = getattr(node, name)
        except RuntimeError:  # already freed
            continue
        for t in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(t, torch.Tensor):
                yield name[len("_saved_"):], t


def census(cfg, batch: int, seq_len: int, device: str, amp: bool, ac: str = "none") -> dict:
    """One block's saved tensors: {'rows': [(node, attribute, shape, dtype, bytes, kind)], 'total': bytes of
    activations, 'weight copies': bytes, 'tokens': n}. ``ac``: 'none' only (checkpointed blocks save
    through their own hooks, which this walk does not see)."""
    if ac != "none":
        raise UserError("--ac: the census walks autograd's graph, which a checkpointed block does not keep; "
                        "use --ac none.")
    dev = torch.device(device)
    torch.manual_seed(0)
    block = TransformerBlock(cfg).to(dev)
    weights = {p.untyped_storage().data_ptr() for p in block.parameters()}
    matrices = {tuple(reversed(p.shape)) for p in block.parameters() if p.dim() == 2}
    x = torch.randn(batch, seq_len, cfg.dim, device=dev, requires_grad=True)  # the fp32 residual stream
    before = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None
    with torch.autocast(dev.type, torch.bfloat16, enabled=amp):
        cos, sin = rope_tables(cfg, dev)
        dtype = torch.bfloat16 if amp else torch.float32
        cos, sin = cos.to(dtype), sin.to(dtype)  # what Transformer.rope_for hands every block
        out = block(x, cos, sin)
    # On CUDA the allocator says what the forward left behind in all (saved tensors, the block's
    # output, anything held outside the graph): more than the census means something else keeps memory.
    left = torch.cuda.memory_allocated(dev) - before if before is not None else None
    tables = {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}
    seen, rows, todo, visited = set(), [], [out.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        todo.extend(n for n, _ in node.next_functions)
        for attr, t in _saved(node):
            key = t.untyped_storage().data_ptr()
            if key in seen or t.numel() == 0:
                continue
            seen.add(key)
            nbytes = t.untyped_storage().nbytes()
            kind = ("weight" if key in weights else "rope table" if key in tables
                    # a linear layer is mm(input, weight.t()): its mat2 is the weight (autocast's copy)
                    else "weight copy" if attr == "mat2" and tuple(t.shape) in matrices
                    else "activation")
            rows.append((node.name(), attr, tuple(t.shape), str(t.dtype).replace("torch.", ""), nbytes, kind))
    total = sum(r[4] for r in rows if r[5] == "activation")
    return {"rows": rows, "total": total, "weight copies": sum(r[4] for r in rows if r[5] == "weight copy"),
            "tokens": batch * seq_len, "allocated after forward": left,
            "output": out.untyped_storage().nbytes()}


@main_guard
def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tools.saved_census", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--model", default="1b", help=f"preset: {', '.join(PRESETS)} (default: 1b)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    p.add_argument("--amp", default="bf16", choices=("bf16", "off"))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=2048)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device here; use --device cpu.")
    if args.model not in PRESETS:
        raise UserError(f"unknown --model {args.model!r}; choose one of {', '.join(PRESETS)}.")
    cfg = get_config(args.model)
    c = census(cfg, args.batch, args.seq_len, args.device, args.amp == "bf16")
    n = c["tokens"]
    print(f"one {args.model} block, {args.batch} x {args.seq_len} tokens, {args.device}, amp {args.amp}, "
          f"torch {torch.__version__}")
    print(f"  {'node':<34} {'saved':<12} {'shape':<24} {'dtype':<9} {'bytes/token':>11}  kind")
    for node, attr, shape, dtype, nbytes, kind in sorted(c["rows"], key=lambda r: (r[5], -r[4])):
        print(f"  {node:<34} {attr:<12} {str(shape):<24} {dtype:<9} {nbytes / n:>11.1f}  {kind}")
    formula = formulas.layer_activation_bytes(cfg, n, "bf16" if args.amp == "bf16" else "fp32", device=args.device)
    print(f"activations {c['total'] / n:.1f} bytes/token; formulas.layer_activation_bytes {formula / n:.1f} "
          f"({c['total'] / formula:.4f}); weight copies {c['weight copies'] / 2**20:.1f} MiB")
    if c["allocated after forward"] is not None:
        print(f"the allocator: {c['allocated after forward'] / n:.1f} bytes/token left by the forward, of which the "
              f"census accounts for {(c['total'] + c['weight copies'] + c['output']) / n:.1f} (activations, weight "
              f"copies, the block's output)")


if __name__ == "__main__":
    sys.exit(main())
