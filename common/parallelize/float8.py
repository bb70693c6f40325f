"""float8 training with torchao, applied from outside the model like every other saver.

``convert_float8`` swaps chosen ``nn.Linear`` modules for torchao's ``Float8Linear``: each
matmul of forward and backward casts its two operands to float8, one scale per tensor
computed from its current absolute maximum ("dynamic" scaling), and multiplies them on the
tensor cores' float8 path, twice bf16's rate on an H100. With torchao's default
``Float8LinearConfig`` the input and the weight are e4m3 (3 mantissa bits, largest 448)
and the incoming gradient e5m2 (2 mantissa bits, largest 57344). The weights, gradients and
AdamW state stay fp32: float8 changes what the matmuls compute in, not what is stored.

torchao is optional for the rest of the tutorial: only what imports this module needs it.
"""
from __future__ import annotations

import functools

import torch

from common.errors import UserError, quiet_logs

# Dimensions a float8 matmul accepts: torch._scaled_mm wants both of a weight's sides
# divisible by 16 (the tensor cores' tile); torchao would refuse the layer at its first call.
FLOAT8_MULTIPLE = 16


def _torchao_float8():
    """Import torchao.float8 quietly (it logs a warning per optional CUDA kernel it cannot
    load, which a CPU build never can), or say in one sentence how to get it."""
    try:
        with quiet_logs():
            import torchao.float8 as float8
    except ImportError:
        raise UserError("--float8 needs torchao, which is not installed; pip install -r requirements.txt "
                        "(or pip install torchao).") from None
    return float8


@functools.cache
def cpu_float8_matmul() -> bool:
    """Whether this CPU's matmul library multiplies float8 at all, asked by trying (the
    tests compare torchao's emulation with it where it does). ``torch._scaled_mm``
    on a CPU is oneDNN's, whose float8 kernels need AVX-512 FP16 (Intel Xeon since Sapphire
    Rapids): with oneDNN's instructions capped (ONEDNN_MAX_CPU_ISA) on such a Xeon,
    AVX512_CORE_FP16 and AMX run them, AVX512_CORE_BF16 and every level below, AVX2 among
    them (most laptops), refuse: "could not create a primitive descriptor for the matmul
    primitive"."""
    one = torch.ones(())
    a = torch.zeros(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def float8_unsupported(device: torch.device) -> str | None:
    """Why float8 cannot train on this device (None: it can). A CPU runs it emulated
    (``emulates``), a lesson in what float8 does to the numbers and not a speed-up."""
    # CUDA path: tests/test_cuda_paths.py::test_what_an_older_gpu_refuses
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        return (f"--float8 needs a GPU with float8 tensor cores (compute capability 8.9 or newer: L4, L40, "
                f"H100, ...); this {name} has none: drop --float8.")
    return None


def float8_layers(model: torch.nn.Module) -> tuple[list[str], dict[str, str]]:
    """(names of the Linear layers to convert, {name: why not} for the others)."""
    convert, skip = [], {}
    for name, m in model.named_modules():
        if not isinstance(m, torch.nn.Linear):
            continue
        if name == "output":
            # The last projection feeds the loss straight: its rounding error is not averaged
            # by any later layer, and torchao's and torchtitan's recipes keep it in bf16 too.
            skip[name] = "the output layer, kept in bf16"
        elif m.in_features % FLOAT8_MULTIPLE or m.out_features % FLOAT8_MULTIPLE:
            skip[name] = f"{m.in_features} x {m.out_features} is not a multiple of {FLOAT8_MULTIPLE}"
        else:
            convert.append(name)
    return convert, skip


def emulates(device) -> bool:
    """Whether a run on ``device`` emulates float8's matmuls: on every CPU. Where a CPU has
    oneDNN's float8 matmuls at all (``cpu_float8_matmul``) they are a reference path, not a
    fast one: one 2048 x 256 x 768 product took 14 s on a Sapphire Rapids Xeon, against
    0.085 s in bf16, so a step of the small model took 4.6 minutes. torchao's emulation
    casts and scales every operand to float8 as the kernels do and multiplies in fp32: the
    numbers float8 gives, in a few times bf16's step time (tests/test_float8.py holds it to
    the kernels where the CPU has them). A GPU runs the real kernels: float8 is fast only there."""
    return device is not None and torch.device(device).type == "cpu"


def convert_float8(model: torch.nn.Module, device=None, *, fsdp_float8_all_gather: bool = False,
                   emulate: bool | None = None) -> dict:
    """Swap the model's convertible Linear layers for Float8Linear, in place (call it before
    fully_shard, so that FSDP sees the float8 weights). ``fsdp_float8_all_gather``: FSDP2
    all-gathers the weights already cast to float8 (half of bf16's bytes); NCCL only.
    ``device``: the run's; ``emulate``: torchao's emulation of the matmuls (default: on a
    CPU, ``emulates``). Returns what was converted and what was skipped, and whether
    emulated, for summary.json."""
    float8 = _torchao_float8()
    convert, skip = float8_layers(model)
    chosen = set(convert)
    emulated = emulates(device) if emulate is None else emulate
    config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_float8_all_gather, emulate=emulated)
    float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn in chosen)
    return {"converted": convert, "skipped": skip, "fsdp_float8_all_gather": fsdp_float8_all_gather,
            "emulated": emulated}


def is_float8(module: torch.nn.Module) -> bool:
    return type(module).__name__ == "Float8Linear"


def precompute_fsdp_scales(model: torch.nn.Module, enabled: bool) -> None:
    """After the optimizer step, with float8 all-gather: compute every weight's float8
    scale in one fused reduction, instead of one small all-reduce per weight inside the
    next forward pass."""
    if enabled:
        _torchao_float8().precompute_float8_dynamic_scale_for_fsdp(model)
