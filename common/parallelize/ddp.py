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
