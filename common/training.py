"""Small pieces of a training loop that are not the lesson of any step."""
from __future__ import annotations

import contextlib
import math
import os
import shutil

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from common.data import Batches
from common.errors import UserError

AMP_DTYPES = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_forward(module: torch.nn.Module, device: torch.device | str, dtype: torch.dtype | None) -> torch.nn.Module:
    """Run ``module``'s forward under ``torch.autocast(dtype)`` (None: unchanged), for code that
    calls the forward itself (a pipeline schedule). Only the forward: backward runs each op
    in the dtype its forward used. The instance's ``forward`` is wrapped; the class, the
    parameter names and the state_dict are untouched."""
    if dtype is not None:
        module.forward = torch.autocast(torch.device(device).type, dtype=dtype)(module.forward)
    return module


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
    """The AdamW hyperparameters, for wrappers that build the optimizer themselves (ZeRO-1).
    ``--fused-adamw``: one kernel for all parameters. fused=None, not False, without it:
    None keeps PyTorch's default (the foreach kernels on CUDA)."""
    return dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=getattr(args, "fused_adamw", False) or None)


def adamw(params, args, **kwargs) -> torch.optim.AdamW:
    """AdamW as every script uses it (fp32 state: 8 bytes per parameter), one parameter
    group per kind of parameter (``param_groups_by_kind``)."""
    return torch.optim.AdamW(param_groups_by_kind(params), **(adamw_options(args) | kwargs))


def param_kind(t: torch.Tensor):
    """What PyTorch's multi-tensor kernels must not mix: plain tensors (None), or DTensors on
    one mesh (the mesh)."""
    return t.device_mesh if isinstance(t, DTensor) else None


def param_groups_by_kind(params) -> list[dict]:
    """The parameters split into one optimizer group per kind (``param_kind``), in order of
    first appearance; one group when all are alike, as a plain ``AdamW(params)`` has.

    Why: on CUDA, AdamW defaults to its foreach (multi-tensor) kernels, and ``fused=True``
    batches every parameter of a group into one kernel too. Each batch takes one kind of
    tensor: DTensors and plain tensors together fail ("got mixed torch.Tensor and
    DTensor"). Layouts mix them: TP without sequence parallelism leaves the norms plain,
    2-D and 3-D at dp 1 skip FSDP, EP keeps its experts on a mesh of their own. Groups
    keep the fast kernels (one batch per group) on every layout. A checkpoint stores each
    parameter's optimizer state under its name (common/checkpoint_state.py), so a layout with
    two groups resumes one with a single group, and back.

    On a CPU PyTorch takes the one-tensor-at-a-time loop, where the mix never shows;
    ``TUTORIAL_CUDA_PATHS=1`` (``take_cuda_paths``) makes a CPU run take CUDA's path."""
    groups: dict = {}
    for p in params:
        groups.setdefault(param_kind(p), []).append(p)
    return [{"params": ps} for ps in groups.values()]


# ---- CUDA's code paths on a CPU (the test suite's CUDA-path mode) ----------------------------
CUDA_PATHS_ENV = "TUTORIAL_CUDA_PATHS"


def take_cuda_paths(enabled: bool | None = None) -> bool:
    """Let a CPU run take the optimizer path PyTorch takes on CUDA: torch.optim chooses its
    foreach (multi-tensor) kernels by default only for devices in
    ``_get_foreach_kernels_supported_devices()`` (cuda, xpu, mtia, privateuse1; never cpu),
    although the kernels run on a CPU too. Adding "cpu" to that list makes every CPU
    optimizer step batch its tensors as a GPU's does, so a CPU test meets what a GPU would
    (mixed DTensor and plain tensors in one batch, the temporaries a batch holds).

    ``enabled`` None: read ``TUTORIAL_CUDA_PATHS`` (1 = on), which the test suite sets for
    its runs and torchrun passes on to every rank. Returns whether the mode is on.
    ``clip_grad_norm_`` needs nothing: it takes foreach on a CPU already.
    ``--fused-adamw`` needs nothing either: CPU has had fused AdamW since torch 2.4."""
    if enabled is None:
        enabled = os.environ.get(CUDA_PATHS_ENV, "0") == "1"
    if not enabled:
        return False
    import torch.optim.optimizer as optimizer_module
    import torch.utils._foreach_utils as foreach_utils

    original = getattr(foreach_utils._get_foreach_kernels_supported_devices, "_cuda_paths_original",
                       foreach_utils._get_foreach_kernels_supported_devices)

    def with_cpu() -> list[str]:
        return [*original(), "cpu"]

    with_cpu._cuda_paths_original = original
    # torch.optim.optimizer imported the function by name: replace it in both places.
    foreach_utils._get_foreach_kernels_supported_devices = with_cpu
    optimizer_module._get_foreach_kernels_supported_devices = with_cpu
    return True


def optimizer_kernels(optimizer) -> str | None:
    """Which of PyTorch's three AdamW implementations a step of ``optimizer`` runs: "fused"
    (one kernel), "foreach" (a few multi-tensor kernels: CUDA's default, and the CPU's in the
    CUDA-path mode) or "for-loop" (one parameter at a time: the CPU's default). The memory
    formula asks this: the foreach step holds temporaries the other two do not
    (common/measure/theory.py). ZeRO-1's wrapper is asked about the optimizer inside it;
    None for an optimizer that is not torch.optim's (DeepSpeed's)."""
    from torch.optim.optimizer import _default_to_fused_or_foreach
    optimizer = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's inner AdamW
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(optimizer, torch.optim.Optimizer) or not groups:
        return None
    kinds = set()
    for g in groups:
        if g.get("fused"):
            kinds.add("fused")
        elif g.get("foreach") is not None:
            kinds.add("foreach" if g["foreach"] else "for-loop")
        else:  # what AdamW.step decides when told neither
            kinds.add("foreach" if _default_to_fused_or_foreach(g["params"], False, False)[1] else "for-loop")
    return "/".join(sorted(kinds))



def eval_batch_count(tokens: torch.Tensor, args) -> int:
    """``--eval-batches``, but at most one pass over the held-out text: the loader is endless,
    and a huge value would evaluate the same batches over and over (for hours)."""
    per_pass = ((len(tokens) - 1) // args.seq_len) // args.global_batch_size
    if args.eval_batches > per_pass and not getattr(args, "_eval_capped", False):
        args._eval_capped = True  # say it once, on one rank
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"--eval-batches {args.eval_batches}: the held-out text holds {per_pass} batches of "
                  f"{args.global_batch_size} x {args.seq_len}; evaluating on those", flush=True)
    return min(args.eval_batches, per_pass)


@torch.no_grad()
def evaluate(model, tokens: torch.Tensor, args, device, loss_context=contextlib.nullcontext) -> float | None:
    """Mean next-byte loss on the first ``--eval-batches`` held-out batches (no shuffle).
    ``loss_context``: what the cross entropy runs under (loss_parallel, for logits split
    over the vocabulary)."""
    if args.eval_batches == 0 or len(tokens) <= args.seq_len * args.global_batch_size:
        return None
    was_training = model.training
    model.eval()
    batches = iter(Batches(tokens, args.seq_len, args.global_batch_size, shuffle=False))
    losses = []
    for _ in range(eval_batch_count(tokens, args)):
        x, y = next(batches)
        x, y = x.to(device), y.to(device)
        logits = model(x)
        with loss_context():
            losses.append(F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()).item())
    model.train(was_training)
    return sum(losses) / len(losses)


def micro_batch_size(global_batch_size: int, dp_size: int, accum_steps: int = 1) -> int:
    """Sequences per rank per forward pass; the global batch must split evenly."""
    if accum_steps <= 0:
        raise UserError(f"--grad-accum must be positive (got {accum_steps}).")
    if global_batch_size % (dp_size * accum_steps):
        into = (f"among {dp_size} data-parallel ranks" if accum_steps == 1 else
                f"into {accum_steps} micro-batches on each of {dp_size} data-parallel ranks")
        raise UserError(f"--global-batch-size {global_batch_size} does not divide {into}; "
                        f"use a multiple of {dp_size * accum_steps}.")
    return global_batch_size // (dp_size * accum_steps)



def global_loss(loss: torch.Tensor, dp_group=None, dp_size: int = 1) -> torch.Tensor:
    """The global-batch mean from this rank's loss: averaged over the ``dp_size`` ranks of
    ``dp_group`` that saw different data (a DTensor under TP is replicated: made whole).
    SUM then divide, not ReduceOp.AVG: NCCL and gloo both have AVG on recent torch, but
    the same two ops give the same number on every backend and version."""
    loss = loss.detach()
    if isinstance(loss, DTensor):
        loss = loss.full_tensor()
    if dp_size > 1:
        loss = loss.clone()
        dist.all_reduce(loss, group=dp_group)
        loss /= dp_size
    return loss



# ---- what the device supports -------------------------------------------------------------
def amp_unsupported(device: torch.device, amp: str) -> str | None:
    """Why ``--amp`` cannot run on ``device`` (one sentence), or None if it can."""
    # CUDA path: tests/test_cuda_paths.py::test_what_an_older_gpu_refuses (both branches)
    if amp == "fp16" and device.type != "cuda":
        # PyTorch can autocast to fp16 on a CPU, but most CPUs have no fp16 arithmetic (it
        # is emulated), and a CPU with bf16 units needs no loss scaler for bf16: fp16 with
        # loss scaling is a GPU recipe.
        return ("--amp fp16 needs a CUDA GPU (fp16 with loss scaling is a GPU recipe; most CPUs have no fp16 "
                "arithmetic); use --amp bf16, which needs no loss scaling, or --amp off.")
    # CUDA path: tests/test_cuda_paths.py::test_what_an_older_gpu_refuses. Without
    # including_emulation=False PyTorch answers True on a V100 or T4, where it emulates bf16
    # (slowly): the refusal would never fire where it is meant to.
    if amp == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        return (f"--amp bf16: {torch.cuda.get_device_name(device)} has no bf16 support (it needs an "
                f"Ampere or newer GPU); use --amp fp16, which adds loss scaling.")
    return None


def fused_adamw_unsupported(device: torch.device) -> str | None:
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
        supported = _get_fused_kernels_supported_devices()
    except ImportError:  # private helper moved: fall back to the devices fused AdamW has had since 2.4
        supported = ["cuda", "cpu"]
    if device.type not in supported:
        return f"--fused-adamw: this PyTorch has no fused AdamW for {device.type}; drop the flag."
    return None


def compile_unsupported(device: torch.device) -> str | None:
    # CUDA path: tests/test_cuda_paths.py::test_what_an_older_gpu_refuses (no Triton)
    if device.type == "cpu" and not any(shutil.which(c) for c in ("g++", "clang++", "c++")):
        return "--compile on CPU needs a C++ compiler (g++ or clang++) on the PATH; install one or drop --compile."
    if device.type == "cuda":
        try:
            from torch.utils._triton import has_triton
        except ImportError:
            has_triton = lambda: True  # noqa: E731  (cannot tell; let torch.compile report it)
        if not has_triton():
            return "--compile on CUDA needs Triton (pip install triton); install it or drop --compile."
    return None


# ---- the global gradient norm ----------------------------------------------------------------
def reduce_partial_grads(params) -> None:
    """Sum, once, the gradients backward left as sums still to be taken. Under sequence
    parallelism each TP rank computes a norm gain's gradient from its slice of the sequence,
    and DTensor keeps it ``Partial`` (unreduced) after backward; every later op on it would
    all-reduce it again, AdamW's three of them inside DTensor's operators (where the byte
    counter cannot see them). One redistribution each, counted as ``all_reduce (norm
    gains)``, leaves them ``Replicate``, as the weights are. (Under 2-D, FSDP's reduction
    takes care of them.)"""
    from torch.distributed.tensor import Replicate

    from common.measure.comm import purpose
    with purpose("norm gains"):
        for p in params:
            g = p.grad
            if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
                p.grad = g.redistribute(placements=[Replicate() if pl.is_partial() else pl for pl in g.placements])


def clip_grad_norm(params, max_norm: float, pp_group=None, local: bool = False) -> torch.Tensor:
    """Clip the gradients to a global norm of ``max_norm`` (0: measure only); return the norm
    before clipping, the same number on every rank.

    PyTorch's ``get_total_norm`` is right on one device, under DDP and ZeRO-1 (every rank
    holds the same all-reduced gradients) and on DTensor gradients (FSDP's shards, TP's
    slices, HSDP's replicas): a DTensor's norm is reduced over the ranks that hold parts
    of it and counted once over those that hold copies. Two things it does not do, hence
    the lines below: a model whose gradients are partly DTensors and partly plain tensors
    (TP leaves the norms' weights plain) is summed group by group, and a pipeline's stages,
    each holding other parameters, add their sums of squares over ``pp_group``. First,
    sequence parallelism's Partial gradients are summed once (``reduce_partial_grads``): the
    norm would sum them right by itself, but AdamW would sum them again at every use.

    ``local``: the wrong way, for the lesson: each rank clips by the norm of what it holds.
    """
    from common.measure.comm import purpose  # the byte counts show the norm's traffic apart
    from common.measure.memory import named_phase  # the memory trace draws it as its own phase

    params = list(params)
    reduce_partial_grads(params)  # sequence parallelism's norm gains: summed once, before any use
    # The sum starts on the parameters' device even where no gradient is there to tell it:
    # on a CUDA run a host zero would reach pp_group's NCCL all-reduce, which refuses it.
    device = params[0].device if params else "cpu"
    params = [p for p in params if p.grad is not None]
    groups: dict = {}
    for p in params:  # one group per kind of gradient: plain, or DTensor on a mesh with placements
        key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None
        groups.setdefault(key, []).append(p)
    with purpose("grad norm"), named_phase("clipping"):
        squares = torch.zeros((), device=device)
        for group in groups.values():
            grads = [p.grad.to_local() if local and isinstance(p.grad, DTensor) else p.grad for p in group]
            norm = torch.nn.utils.get_total_norm(grads, 2.0)
            squares = squares + (norm.full_tensor() if isinstance(norm, DTensor) else norm).float() ** 2
        if pp_group is not None and not local:
            dist.all_reduce(squares, group=pp_group)
        total = squares.sqrt()
        if max_norm > 0:
            for group in groups.values():  # PyTorch's foreach kernels take one kind of tensor at a time
                torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


take_cuda_paths()  # TUTORIAL_CUDA_PATHS=1: in every process that imports this module (every rank)
