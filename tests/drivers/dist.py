"""Launched by tests/test_distributed.py under torchrun: exercises common/distributed.py."""
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.distributed as dist

from common.distributed import distributed
from common.errors import UserError, main_guard


class SlowToFree(torch.Tensor):
    """A tensor whose Python object takes Python's lock for a while when it is freed: it frees
    on the thread that drops it last, and sleeps (letting go of the lock) in between. The
    group's destructor waits for it."""
    freed_on = []

    def __del__(self):
        SlowToFree.freed_on.append(threading.current_thread() is threading.main_thread())
        time.sleep(3)


def leave_a_worker_freeing(group, rank):
    """A collective on ``group`` whose tensor rank 0's gloo worker drops last: rank 1 joins it
    only once rank 0 has let go of the tensor, so the worker frees it after the collective, in
    SlowToFree.__del__ (holding the group's work lock, and soon wanting Python's)."""
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        dist.all_reduce(torch.Tensor._make_subclass(SlowToFree, torch.ones(4)), group=group, async_op=True)
        store.set("teardown_race", "let go")  # only the collective's work holds the tensor now
    else:
        store.wait(["teardown_race"])
        dist.all_reduce(torch.ones(4), group=group)


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
        elif mode == "teardown_race":
            # DDP on a group of its own: the run's end drains the default group and the meshes'
            from torch.nn.parallel import DistributedDataParallel as DDP
            group = dist.new_group()
            model = DDP(torch.nn.Linear(4, 4), process_group=group)
            model(torch.ones(2, 4)).sum().backward()
            leave_a_worker_freeing(group, ctx.rank)
            del group
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
    if sys.argv[1] == "teardown_race" and int(os.environ["RANK"]) == 0:
        print(f"main returned; the slow tensor was freed on {['a gloo worker', 'the main thread'][SlowToFree.freed_on[0]]}"
              if SlowToFree.freed_on else "main returned; the slow tensor was not freed", flush=True)
