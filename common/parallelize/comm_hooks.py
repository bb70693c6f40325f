"""Gradient compression for DDP through PyTorch's communication hooks: ``--comm-hook``.

DDP all-reduces every gradient bucket in fp32: 4 bytes per parameter per step, sent
2(n-1)/n times over by each rank in a ring. A communication hook replaces that
all-reduce with something cheaper:

- ``fp16`` / ``bf16``: cast the bucket to 16 bits, all-reduce, cast back. Half the
  bytes; fp16 keeps 10 mantissa bits but overflows above 65504 (the hook divides by the
  world size *before* the sum for that reason), bf16 keeps fp32's range with 7 bits.
- ``powersgd``: approximate each gradient matrix M (rows x cols) by a rank-r product
  P Q^T and all-reduce P (rows x r) and Q (cols x r) instead: r (rows + cols) numbers
  instead of rows x cols. Vectors (norm gains, biases) are not worth it and go
  uncompressed. The approximation error is remembered and added to the next step's
  gradient (error feedback), so what is dropped now is sent later.

PowerSGD runs plain all-reduce for its first ``start_powerSGD_iter`` steps: the start of
training is the most sensitive to wrong gradients (PyTorch suggests at least the warm-up).

Usage in a training script::

    comm_hooks.add_comm_hook_flag(parser)                  # --comm-hook and its options
    model = DDP(model)
    comm_hooks.register_comm_hook(model, args.comm_hook, **comm_hooks.powersgd_options(args))
"""
from __future__ import annotations

import argparse
import contextlib

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from common.errors import UserError

HOOKS = ("none", "fp16", "bf16", "powersgd")
DEFAULT_POWERSGD = {"matrix_approximation_rank": 4, "start_powerSGD_iter": 10, "min_compression_rate": 2.0}


def add_comm_hook_flag(parser: argparse.ArgumentParser, several: bool = False) -> argparse._ArgumentGroup:
    """``--comm-hook NAME`` (or ``--comm-hooks A,B,...`` with ``several``) and PowerSGD's options."""
    g = parser.add_argument_group("gradient compression (DDP communication hooks)")
    if several:
        g.add_argument("--comm-hooks", default=",".join(HOOKS), type=_hook_list,
                       help=f"comma-separated hooks to compare, from {', '.join(HOOKS)} (default: all)")
    else:
        g.add_argument("--comm-hook", default="none", choices=HOOKS,
                       help="compress the gradient all-reduce: none (fp32, the default), fp16 or bf16 "
                            "(half the bytes), powersgd (low-rank, see --powersgd-rank)")
    g.add_argument("--powersgd-rank", type=int, default=DEFAULT_POWERSGD["matrix_approximation_rank"],
                   help="rank r of PowerSGD's approximation: a rows x cols gradient sends "
                        "r * (rows + cols) numbers instead of rows * cols (default: %(default)s)")
    g.add_argument("--powersgd-start-iter", type=int, default=DEFAULT_POWERSGD["start_powerSGD_iter"],
                   help="plain all-reduce for the first N steps, then PowerSGD; at least 2 "
                        "(default: %(default)s, the default warm-up)")
    return g


def _hook_list(text: str) -> list[str]:
    hooks = [h.strip() for h in text.split(",") if h.strip()]
    if not hooks or any(h not in HOOKS for h in hooks):
        raise argparse.ArgumentTypeError(f"{text!r}: give a comma-separated list from {', '.join(HOOKS)}")
    return list(dict.fromkeys(hooks))


def powersgd_options(args: argparse.Namespace) -> dict:
    """The PowerSGD keyword arguments of ``register_comm_hook`` from the parsed flags."""
    return {"matrix_approximation_rank": args.powersgd_rank, "start_powerSGD_iter": args.powersgd_start_iter}


def bf16_hook_supported() -> bool:
    """Whether DDP accepts ``bf16_compress_hook`` in this build of PyTorch.

    DDP checks the build, not the backend: it refuses the hook unless PyTorch was built
    with CUDA and NCCL >= 2.10 (or XPU with XCCL), so a CPU-only build refuses it even
    though gloo all-reduces bf16 tensors fine.
    """
    try:
        cuda = (torch.version.cuda is not None or torch.version.hip is not None) and \
            dist.is_nccl_available() and torch.cuda.nccl.version() >= (2, 10)
    except Exception:  # noqa: BLE001 - no NCCL in this build
        cuda = False
    xpu = hasattr(dist, "is_xccl_available") and dist.is_xccl_available() and torch.xpu.is_available()
    return bool(cuda or xpu)


BF16_REFUSED = ("--comm-hook bf16: this PyTorch build has no CUDA/NCCL (>= 2.10), and DDP accepts "
                "bf16_compress_hook only there (gloo could sum bf16, DDP refuses the hook); "
                "use --comm-hook fp16 on CPU.")


def check_comm_hook(name: str, **powersgd_opts) -> dict:
    """Raise ``UserError`` (one line, with the fix) if hook ``name`` cannot run here; return
    PowerSGD's full options for powersgd (else {})."""
    if name not in HOOKS:
        raise UserError(f"--comm-hook {name!r}: choose one of {', '.join(HOOKS)}.")
    if name == "bf16" and not bf16_hook_supported():
        raise UserError(BF16_REFUSED)
    if name != "powersgd":
        return {}  # the PowerSGD flags always exist; they only matter for powersgd
    opts = {**DEFAULT_POWERSGD, **powersgd_opts}
    if opts["matrix_approximation_rank"] < 1:
        raise UserError(f"--powersgd-rank must be at least 1 (got {opts['matrix_approximation_rank']}).")
    if opts["start_powerSGD_iter"] < 2:
        # PowerSGD's error feedback and warm start keep per-bucket tensors, and DDP rebuilds
        # its buckets after the first step: compressing before that would mix them up.
        raise UserError(f"--powersgd-start-iter must be at least 2 (got {opts['start_powerSGD_iter']}): DDP "
                        f"rebuilds its gradient buckets after step 1 and PowerSGD keeps state per bucket.")
    return opts


def register_comm_hook(ddp_model, name: str, process_group=None, **powersgd_opts):
    """Register the hook called ``name`` on a ``DistributedDataParallel`` model.

    Returns the hook's state (a ``PowerSGDState`` for powersgd, else None). Raises
    ``UserError`` with a one-line fix for what cannot work (see ``check_comm_hook``).
    """
    opts = check_comm_hook(name, **powersgd_opts)
    if dist.get_backend(process_group) == "fake":
        if name != "none":
            raise UserError(f"--comm-hook {name} cannot run in a dry run (--fake-world-size): it computes with "
                            f"what the other ranks send, which never arrives; drop --comm-hook.")
        ddp_model.register_comm_hook(None, _dry_run_hook)
        return None
    if name == "none":
        return None  # DDP's built-in fp32 all-reduce (in C++, faster than the Python allreduce_hook)
    if name in ("fp16", "bf16"):
        hook = default_hooks.fp16_compress_hook if name == "fp16" else default_hooks.bf16_compress_hook
        ddp_model.register_comm_hook(process_group, hook)
        return None
    state = powerSGD_hook.PowerSGDState(process_group=process_group, **opts)
    hook = powerSGD_hook.powerSGD_hook
    if dist.get_backend(process_group) != "nccl":
        hook = _one_bucket_at_a_time(hook)
    ddp_model.register_comm_hook(state, hook)
    return state


def _dry_run_hook(_, bucket):
    """DDP's all-reduce on the fake process group: issued (so it is counted, bucket by bucket)
    but never waited on, whose Work gives DDP no tensor back; the bucket is handed back as is."""
    dist.all_reduce(bucket.buffer())
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _one_bucket_at_a_time(hook):
    """PowerSGD for backends whose futures complete on a worker thread (gloo).

    PowerSGD all-reduces P and Q from ``Future.then`` callbacks. gloo runs those on its own
    threads while the backward pass goes on and issues the next bucket's all-reduce, so
    with two buckets or more the ranks disagree on the order of their collectives and gloo
    fails ("Received data size doesn't match expected size") or hangs (seen here with
    torch 2.13 on 4 CPU ranks). NCCL marks its futures complete when the work is queued,
    so the callbacks run at once, in order, and need no help. Waiting for each bucket
    keeps the order, at the price of not overlapping communication with the backward pass.
    """
    def powerSGD_hook_in_order(state, bucket):
        with _no_cuda_sync_on_cpu(bucket.buffer().device):
            fut = hook(state, bucket)
            fut.wait()  # the whole chain, decompression included, runs inside the shim
        return fut

    return powerSGD_hook_in_order


@contextlib.contextmanager
def _no_cuda_sync_on_cpu(device: torch.device):
    """PowerSGD calls ``torch.cuda.synchronize(device)`` whenever CUDA is available, even
    for a CPU bucket, which raises "Expected a cuda device, but got: cpu" on a GPU machine
    whose ranks train on the CPU (torch 2.11 to 2.13). A CPU bucket needs no CUDA sync:
    skip it for CPU devices while the hook runs; CUDA buckets keep the real call."""
    # CUDA path: tests/test_cuda_paths.py::test_powersgd_skips_cudas_synchronize_for_a_cpu_bucket
    if device.type == "cuda" or not torch.cuda.is_available():
        yield
        return
    real = torch.cuda.synchronize

    def synchronize(d=None):
        if d is not None and torch.device(d).type == "cpu":
            return None
        return real(d)

    torch.cuda.synchronize = synchronize
    try:
        yield
    finally:
        torch.cuda.synchronize = real


def all_reduce_bytes(params, name: str, compressing: bool = True, elem_size: int = 4, **powersgd_opts) -> int:
    """Bytes a DDP step all-reduces (logical size, before the ring's 2(n-1)/n) under hook ``name``.

    ``compressing=False`` is PowerSGD before ``start_powerSGD_iter``: plain all-reduce.
    For PowerSGD each gradient is seen as a matrix ``g.view(g.shape[0], -1)`` (rows x
    cols) with rank ``r' = min(rows, cols, r)``; it is compressed when
    ``r' (rows + cols) * min_compression_rate < rows * cols`` and then costs
    ``r' (rows + cols)`` numbers (P and Q), else ``rows * cols`` (vectors always land here).
    """
    params = [p for p in params if p.requires_grad]
    numel = sum(p.numel() for p in params)
    if name == "none" or (name == "powersgd" and not compressing):
        return elem_size * numel
    if name in ("fp16", "bf16"):
        return 2 * numel
    if name != "powersgd":
        raise ValueError(f"unknown hook {name!r}")
    opts = {**DEFAULT_POWERSGD, **powersgd_opts}
    total = 0
    for p in params:
        rows = p.shape[0] if p.dim() else 1
        cols = p.numel() // rows
        r = min(rows, cols, opts["matrix_approximation_rank"])
        low_rank = r * (rows + cols)
        total += low_rank if low_rank * opts["min_compression_rate"] < rows * cols else rows * cols
    return elem_size * total
