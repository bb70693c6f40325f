"""The trained weights as one plain file, for inference: gathered from every rank at the end of
a run (``save_full_weights``: OUT/weights.pt), or taken out of a checkpoint afterwards
(``export``, which ``python -m common.checkpoint export <checkpoint folder> <file.pt>`` runs)."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from common.checkpoint_meta import read_meta
from common.errors import UserError


def export(checkpoint: str, dest: str):
    """One plain torch.save file of the model's full weights (no optimizer), for inference."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path, dest = Path(checkpoint), Path(dest)
    if not (path / "meta.json").is_file():
        raise UserError(f"{path} is not a complete checkpoint (no meta.json); give a step_... folder.")
    if dest.exists():
        raise UserError(f"{dest} already exists; give a new file name (export never overwrites).")
    if not dest.parent.is_dir():
        raise UserError(f"cannot write {dest}: the folder {dest.parent} does not exist.")
    meta = read_meta(path)
    tmp = dest.with_name(dest.name + ".tmp")
    try:
        dcp_to_torch_save(str(path), str(tmp))
        full = torch.load(tmp, map_location="cpu", weights_only=False)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - a damaged checkpoint, said plainly
        reason = str(e).strip().splitlines()[-1][:200] if str(e).strip() else type(e).__name__
        raise UserError(f"checkpoint {path} cannot be read ({reason}); export an older one.") from None
    finally:
        tmp.unlink(missing_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    torch.save({"model_config": meta["model_config"], "step": meta["step"], "model": full["model"]}, partial)
    os.replace(partial, dest)  # a crash mid-write leaves no half file under the real name
    print(f"wrote {dest}: {len(full['model'])} tensors of the {meta['model']!r} model at step {meta['step']}")


# ---- one plain file of full weights, for inference ---------------------------------------
# The sending rank's bytes gathered for rank 0 and not yet known to have arrived there, at
# their highest during the last full_state_dict (0 on the ranks that send nothing). The
# handshake below keeps it to one tensor; tests/drivers/model_parallel.py reads it.
IN_FLIGHT = {"bytes": 0, "peak_bytes": 0}


def _ready_for_next(ctx):
    """The sender waits for rank 0's "ready": rank 0 has received every tensor before this one."""
    ready = torch.zeros(1, dtype=torch.int32, device=ctx.device)
    dist.recv(ready, src=0)
    ready.item()  # on a GPU, recv only queues the wait; the host waits here, before the next gather
    IN_FLIGHT["bytes"] = 0


def full_state_dict(modules: list[torch.nn.Module], ctx, pp: int = 1) -> dict[str, torch.Tensor] | None:
    """Gather the trained weights back into one plain state dict in rank 0's host memory
    (None elsewhere), one tensor at a time.

    DTensor shards (TP, FSDP) are gathered with ``full_tensor()`` by the ranks that share
    them. ``pp``: pipeline stages, the outermost dimension of the mesh (ranks s * W/pp to
    (s + 1) * W/pp - 1 hold stage s, as their data- and tensor-parallel copies). Only the
    first rank of each stage sends, tensor by tensor, in step with rank 0: rank 0 says
    "ready" for each tensor once the one before has arrived and moved to its host memory,
    and the sender gathers a tensor only after that, so it never holds more than one
    gathered tensor that rank 0 has not received. Every stage keeps the full model's
    parameter names, so the parts merge by name. Every rank must call this.
    """
    per_stage = ctx.world_size // pp if pp > 1 and ctx.has_peers else ctx.world_size
    sends = ctx.rank % per_stage == 0 and not ctx.is_main  # the one copy of its stage, to rank 0
    out = {} if ctx.is_main else None
    IN_FLIGHT.update(bytes=0, peak_bytes=0)
    # 2-D (FSDP over TP) shards gather in two steps and DTensor logs that this is slow;
    # once per checkpoint it does not matter.
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level, log.level = log.level, logging.ERROR
    try:
        mine = [(k, v) for m in modules for k, v in getattr(m, "module", m).state_dict().items()]  # (DDP's wrapper)
        if sends:
            dist.send_object_list([[(k, tuple(v.shape), v.dtype) for k, v in mine]], dst=0)
        for k, v in mine:
            if sends:
                # CUDA path: tests/test_model_parallel.py::test_save_weights_sends_one_tensor_at_a_time takes this
                # handshake on CPU. It is for NCCL: there dist.send returns at once and the sent tensor stays
                # allocated until rank 0's matching recv, which comes only after rank 0 has gathered its own
                # stage; a sender that did not wait held its whole stage gathered (8b over 2 stages: ~14 GB
                # more). gloo's send blocks until received, which hid it on CPU.
                _ready_for_next(ctx)
            v = v.full_tensor() if isinstance(v, DTensor) else v  # every rank of the stage takes part
            if out is not None:
                out[k] = v.detach().cpu()
            elif sends:
                v = v.detach().to(ctx.device).contiguous()
                IN_FLIGHT["bytes"] += v.numel() * v.element_size()
                IN_FLIGHT["peak_bytes"] = max(IN_FLIGHT["peak_bytes"], IN_FLIGHT["bytes"])
                dist.send(v, dst=0)
            del v
    finally:
        log.setLevel(level)
    if out is not None:
        ready = torch.ones(1, dtype=torch.int32, device=ctx.device)
        for src in range(per_stage, ctx.world_size, per_stage):
            box = [None]
            dist.recv_object_list(box, src=src)
            for k, shape, dtype in box[0]:
                dist.send(ready, dst=src)
                buf = torch.empty(shape, dtype=dtype, device=ctx.device)
                dist.recv(buf, src=src)
                out[k] = buf.cpu()  # (on a GPU, waits for the data: only then is the next "ready" sent)
    return out


def save_full_weights(modules: list[torch.nn.Module], ctx, path, pp: int = 1):
    """``full_state_dict`` then ``torch.save`` on rank 0: the checkpoint a single process can load."""
    state = full_state_dict(modules, ctx, pp)
    if state is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)
