"""DDP's options that our model needs (ZeRO-1 is PyTorch's ``ZeroRedundancyOptimizer``,
used as is in step3_multi_gpu/train_ddp.py; gradient compression is comm_hooks.py)."""
from __future__ import annotations

import inspect


def ddp_no_buffer_sync() -> dict:
    """DDP's keyword that skips broadcasting the buffers before every forward.

    Our only buffers are the RoPE tables, constants. torch 2.13 renamed the keyword
    (``broadcast_buffers`` -> ``forward_sync_buffers``) and warns about the old one.
    """
    from torch.nn.parallel import DistributedDataParallel
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def ddp_run_labels(args, mesh, optimizer) -> dict:
    """train_ddp.py's keywords for Run: the title, the strategy theory.py predicts for, the
    data-parallel degree. ZeRO-1's AdamW state lives in an inner optimizer over this rank's
    partition: each rank checkpoints its own part (by parameter name, so any world size can
    load it), and the memory tracer is shown where it is."""
    if not args.zero1:
        return dict(strategy="ddp", title="Step 3a, DDP", parallel={"dp": mesh.size()}, ckpt_optimizer=None, sources=[])
    return dict(strategy="zero1", title="Step 3a, DDP + ZeRO-1", parallel={"dp": mesh.size()},
                ckpt_optimizer=optimizer.optim, sources=[lambda: [("optimizer state", optimizer.optim.state)]])
