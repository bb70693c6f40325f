"""Test-only driver for context parallelism, one torchrun job:

    torchrun --standalone --nproc-per-node N tests/drivers/cp.py OUT_DIR CASES_JSON

First the ring itself against full attention: common/parallelize/cp.py's ring attention on
each rank's slice of a sequence, against SDPA on the whole sequence (every rank computes
it), outputs and the gradients of q, k and v, with and without load balancing, grouped
and plain multi-head; each rank writes its largest differences to
OUT_DIR/ring_rank{R}.json. Then the training cases, through tests/drivers/model_parallel.py
(the scripts' main() one after another, rank 0 training the single-process reference).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "drivers"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import model_parallel  # noqa: E402
from common.distributed import distributed  # noqa: E402
from common.parallelize.cp import Ring, ring_attention  # noqa: E402
from tools.multirun import allow_reinit  # noqa: E402


def ring_against_full_attention(out_dir: Path):
    allow_reinit()
    with distributed("cpu") as ctx:
        w, results = ctx.world_size, {}
        for hkv in (2, 4):  # grouped-query (2 key/value heads for 4 query heads) and plain
            g = torch.Generator().manual_seed(hkv)
            B, H, S, D = 2, 4, 8 * w, 8
            q, grad = (torch.randn(B, H, S, D, generator=g, dtype=torch.float64) for _ in range(2))
            k, v = (torch.randn(B, hkv, S, D, generator=g, dtype=torch.float64) for _ in range(2))
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=hkv != H)
            (ref * grad).sum().backward()
            for lb in (True, False):
                ring = Ring(dist.group.WORLD, lb)
                mine = ring.positions(S // w, ctx.rank)
                local = [t[:, :, mine].float().requires_grad_() for t in (q, k, v)]
                out = ring_attention(*local, ring=ring)
                (out * grad[:, :, mine].float()).sum().backward()
                diff = {"out": (out.double() - ref[:, :, mine]).abs().max().item()}
                for name, a, b in zip("qkv", local, full):
                    diff["d" + name] = (a.grad.double() - b.grad[:, :, mine]).abs().max().item()
                diff["scale"] = max(ref.abs().max().item(), *(t.grad.abs().max().item() for t in full))
                results[f"hkv{hkv}_{'lb' if lb else 'contiguous'}"] = diff
        (out_dir / f"ring_rank{ctx.rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    ring_against_full_attention(Path(sys.argv[1]))
    model_parallel.main()
