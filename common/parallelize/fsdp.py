"""FSDP2 (``fully_shard``) applied from outside the model, and the glue that lets the
memory tracer see FSDP's all-gathered parameters.

``apply_fsdp`` follows torchtitan's ``parallelize_llama``: the model never knows it is
sharded; one short function wraps each transformer block, then the root.
"""
from __future__ import annotations

import argparse
import weakref

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from common.errors import UserError

try:  # public since torch 2.6
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
except ImportError:  # pragma: no cover - older torch
    from torch.distributed._composable.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy,
                                                    OffloadPolicy, fully_shard)


def add_fsdp_flags(p: argparse.ArgumentParser) -> None:
    """train_fsdp.py's own flags: the ZeRO stage, HSDP, and the options FSDP2 offers beside."""
    p.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True,
                   help="free each block's gathered parameters after its forward and gather them again in "
                        "backward (ZeRO-3, the default); --no-reshard-after-forward keeps them (ZeRO-2)")
    p.add_argument("--hsdp", type=int, nargs=2, metavar=("REPLICAS", "SHARDS"),
                   help="hybrid sharding: shard each parameter over SHARDS ranks and replicate that over "
                        "REPLICAS groups (REPLICAS x SHARDS = the number of ranks)")
    p.add_argument("--cpu-offload", action="store_true",
                   help="keep parameter shards, gradients and AdamW on the host (CUDA; a no-op on CPU)")
    p.add_argument("--split-root-unit", action="store_true",
                   help="the embedding, and the final norm with the output layer, in FSDP units of their own, "
                        "gathered only around their own forward and backward (default: both in the root unit, "
                        "gathered all step)")
    p.add_argument("--float8", action="store_true",
                   help="float8 matmuls (torchao, step 2.6) and float8 all-gather of the weights: NCCL on "
                        "H100-class GPUs only")


def check_fsdp_float8(enabled: bool, ctx) -> None:
    """--float8 under FSDP2: it all-gathers float8 weights, which only NCCL can send (gloo has
    no float8 type), and needs float8 tensor cores."""
    from common.parallelize.float8 import float8_unsupported
    if not enabled:
        return
    why = float8_unsupported(ctx.device) or (ctx.backend != "nccl" and (
        f"--float8 all-gathers float8 weights, which {ctx.backend} cannot send (NCCL only); drop --float8, "
        f"or train float8 on one device with step2_memory/train_float8.py."))
    if why:
        raise UserError(why)


def fsdp_run_labels(args: argparse.Namespace, mesh: DeviceMesh) -> dict:
    """train_fsdp.py's keywords for Run: the title, the strategy theory.py predicts for, the
    mesh's degrees. Each rank checkpoints only its shards (DTensors); a run on another number
    of ranks reads its new shards from whichever files hold them."""
    zero = " ZeRO-3" if args.reshard_after_forward else " ZeRO-2"
    what = (f"HSDP {args.hsdp[0]} x {args.hsdp[1]}" if args.hsdp else "FSDP") + zero
    return dict(fsdp=True, title=f"Step 3a, {what}",
                strategy=("hsdp" if args.hsdp else "fsdp") + ("_zero3" if args.reshard_after_forward else "_zero2"),
                parallel=dict(zip(mesh.mesh_dim_names, mesh.shape)),
                predict=dict(shard=args.hsdp and args.hsdp[1], cpu_offload=args.cpu_offload))


# The models apply_fsdp offloaded (CPUOffloadPolicy): the memory tracer counts their state as the host's
_OFFLOADED: weakref.WeakSet = weakref.WeakSet()


def apply_fsdp(model: torch.nn.Module, mesh: DeviceMesh, *, reshard_after_forward: bool = True,
               param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = torch.float32,
               cpu_offload: bool = False, ignored_params: set | None = None,
               split_root: bool = False) -> torch.nn.Module:
    """FSDP2 on every transformer block, then on the root (call it on a meta-device model).

    - mesh 1-D: full sharding over its ranks. mesh 2-D (replicate, shard): HSDP, each
      parameter sharded across the second dimension and replicated across the first.
    - reshard_after_forward: True frees each block's gathered parameters after its
      forward and gathers them again in backward (ZeRO-3); False keeps them from forward
      to backward (ZeRO-2: one all-gather per step, more memory).
    - param_dtype: compute dtype of the gathered parameters (bf16 halves the all-gather);
      the shards, and so the optimizer, stay fp32. reduce_dtype: gradients are
      reduce-scattered in fp32 so that summing many ranks' bf16 gradients loses nothing.
    - cpu_offload: keep shards, gradients and the optimizer step on the host.
    - ignored_params: parameters FSDP leaves alone (expert parallelism's experts, which
      each rank holds whole for its own experts).
    - split_root: the embedding, and the final norm with the output layer, in units of
      their own (torchtitan's wrapping) instead of in the root unit, which FSDP keeps
      gathered from the first forward to the end of backward. The embedding is then
      gathered only while it runs; the head stays gathered from its forward to its
      backward (backward needs it at once), and its gradients are reduce-scattered as soon
      as backward leaves it, not at the very end. With Llama 3's 128K vocabulary each of
      the two is the size of two or three blocks.
    - an already tensor-parallel model (parameters are DTensors on a TP mesh) is sharded
      further (2-D): both meshes must be slices of one parent mesh.
    """
    if mesh.size() == 1 and any(isinstance(p, DTensor) for p in model.parameters()):
        # A tensor-parallel model with a data-parallel degree of 1 (2-D/3-D): nothing to
        # shard, and on torch 2.13 a 2-D DTensor whose FSDP dimension has one rank fails in
        # gloo's scatter. A plain model on one rank is still wrapped, so that the FSDP
        # script's calls (set_requires_gradient_sync, ...) work at world size 1. Without
        # FSDP's policy, autocast keeps the promise of param_dtype (bf16 compute).
        from common.training import autocast_forward
        return autocast_forward(model, mesh.device_type, param_dtype)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # pinned host memory speeds the copies to and from a GPU; a CPU run has none to make
    # CUDA path: no CPU test: pinned host memory needs CUDA; the shards' placement under offload is
    # tests/test_step3a.py::test_cpu_offload_materialises_the_shards_on_the_host_and_the_buffers_on_the_device
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if cpu_offload else OffloadPolicy()
    layers = model.layers.values() if getattr(model, "layers", None) is not None else []
    for block in layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp,
                    offload_policy=offload, **({"ignored_params": ignored_params} if ignored_params else {}))
    if split_root and getattr(model, "tok_embeddings", None) is not None:
        fully_shard(model.tok_embeddings, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp,
                    offload_policy=offload)
    if split_root and getattr(model, "output", None) is not None:
        head = [m for m in (model.norm, model.output) if m is not None]
        fully_shard(head, mesh=mesh, reshard_after_forward=False, mp_policy=mp, offload_policy=offload)
    # The root takes what no block owns (embedding, final norm, output). Every parameter
    # must be in some unit with the policy, or fp32 weights meet bf16 activations. Its
    # output_dtype hands fp32 logits to the loss. reshard_after_forward is left to FSDP,
    # which keeps the root gathered after forward: backward needs it at once.
    root_mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                   output_dtype=torch.float32 if param_dtype is not None else None)
    fully_shard(model, mesh=mesh, mp_policy=root_mp, offload_policy=offload,
                **({"ignored_params": ignored_params} if ignored_params else {}))
    if cpu_offload:
        _OFFLOADED.add(model)
    return model


def materialize(model: torch.nn.Module, device: torch.device, *, cpu_offload: bool = False) -> torch.nn.Module:
    """Allocate a sharded meta-device model's storage (``to_empty``), uninitialised.

    Under CPU offload the shards are materialised on the host, where FSDP2 keeps them (it
    refuses shards materialised on a GPU); the buffers (the RoPE tables), which FSDP never
    offloads, go to ``device``, where the forward pass reads them. Without offload,
    everything goes to ``device``.
    """
    model.to_empty(device="cpu" if cpu_offload else device)
    if cpu_offload:
        for module in model.modules():
            for name, buf in module.named_buffers(recurse=False):
                module._buffers[name] = buf.to(device)
    return model


def trace_fsdp_memory(tracer, model: torch.nn.Module):
    """Let the memory tracer count FSDP's gathered parameters as parameters.

    FSDP2 gathers a unit's parameters into storages it frees and re-allocates in place
    (``resize_``) and swaps them into the module only between its own hooks; the
    tracer's walk of ``model.parameters()`` never sees them. A forward pre-hook that runs
    after FSDP's (which it registers first, with ``prepend``) hands them to the tracer
    to follow, and a hook on each gathered parameter tags the full-size gradient that
    backward writes before FSDP reduce-scatters it away. Under CPU offload the tracer is told
    that the state it finds by walking the model and the optimizer is the host's.
    """
    if not tracer.enabled:
        return
    if model in _OFFLOADED:
        tracer.offloaded_state = True
    hooked: set[int] = set()

    def tag_gradient(p):
        tracer.tag(p.grad, "gradients")

    def on_unshard(module, *_):
        if not tracer.active:
            return
        for p in module.parameters():
            tracer.watch(p, "parameters")
            if p.requires_grad and id(p) not in hooked:
                hooked.add(id(p))
                tracer.until_done(p.register_post_accumulate_grad_hook(tag_gradient))

    for m in model.modules():
        if isinstance(m, FSDPModule):
            tracer.until_done(m.register_forward_pre_hook(on_unshard))
