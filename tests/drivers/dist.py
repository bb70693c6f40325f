"""Launched by tests/test_distributed.py under torchrun: exercises common/distributed.py."""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.distributed as dist

from common.distributed import distributed
from common.errors import UserError, main_guard


@main_guard
def main(mode, out):
    with distributed("cpu", timeout_s=4 if mode == "hang" else 300) as ctx:
        if mode == "ok":
            mesh = ctx.mesh()
            t = torch.tensor([float(ctx.rank)])
            dist.all_reduce(t)
            mesh2d = ctx.mesh((2, ctx.world_size // 2), ("dp", "tp")) if ctx.world_size % 2 == 0 else None
            result = {"rank": ctx.rank, "world": ctx.world_size, "backend": ctx.backend, "launched": ctx.launched,
                      "sum": t.item(), "mesh": mesh.size(), "mesh2d": list(mesh2d.shape) if mesh2d else None}
            with open(f"{out}.{ctx.rank}.json", "w") as f:
                json.dump(result, f)
            ctx.print("only rank 0 prints this")
        elif mode == "bad_mesh":
            ctx.mesh((3, 3), ("dp", "tp"))
        elif mode == "hang":
            if ctx.rank == 1:
                time.sleep(120)  # never joins: rank 0's collective must time out, not hang
            dist.all_reduce(torch.ones(1))
        elif mode == "one_rank_fails":
            if ctx.rank == 1:
                raise UserError("rank 1 cannot go on")
            dist.barrier()  # rank 0 waits for a rank that is gone: torchrun must end it


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "")
