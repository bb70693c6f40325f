"""Which script trains each layout, with which flags, and the function that builds it: one
table, read by the planner's commands (tools/plan.py), the estimator's dry runs and its
fake-tensor traces (tools/estimate.py), so that what they predict is what the scripts run.

Each step-3 training script (DeepSpeed's comparison aside) defines ``parse(argv)`` (its
flags) and ``build(args, ctx, ...)`` (the model on the meta device, the savers, the
parallelism, compile, materialisation and AdamW's parameter groups); its ``main`` calls
both, and so does the estimator's trace, under fake tensors, for the layouts it traces
(``TRACED``). tests/test_layouts.py holds the traced model of each of them equal to the
one the script builds.
"""
from __future__ import annotations

import importlib
from dataclasses import replace

S3 = "step3_multi_gpu/"

# strategy -> (script, the flags that make its layout from a Plan)
SCRIPTS = {
    "ddp": (S3 + "train_ddp.py", lambda p: []),
    "zero1": (S3 + "train_ddp.py", lambda p: ["--zero1"]),
    "fsdp_zero3": (S3 + "train_fsdp.py", lambda p: []),
    "fsdp_zero2": (S3 + "train_fsdp.py", lambda p: ["--no-reshard-after-forward"]),
    "hsdp": (S3 + "train_fsdp.py", lambda p: ["--hsdp", str(p.world // (p.shard or p.world)), str(p.shard or p.world)]),
    "hsdp_zero2": (S3 + "train_fsdp.py", lambda p: [*SCRIPTS["hsdp"][1](p), "--no-reshard-after-forward"]),
    "tp": (S3 + "train_tp.py", lambda p: []),
    "2d": (S3 + "train_2d.py", lambda p: ["--tp", str(p.tp)]),
    "3d": (S3 + "train_3d.py", lambda p: ["--pp", str(p.pp), "--dp", str(p.dp), "--tp", str(p.tp), "--schedule",
                                          p.schedule, "--microbatches", str(p.microbatches or p.pp)]),
    "pp": (S3 + "train_pp.py", lambda p: ["--schedule", p.schedule, "--microbatches", str(p.microbatches or p.pp)]),
    "cp": (S3 + "train_cp.py", lambda p: ["--dp", str(p.world // (p.cp or p.world))]),
    "cp_fsdp": (S3 + "train_cp.py", lambda p: ["--dp", str(p.world // (p.cp or p.world)), "--fsdp"]),
    "ep": (S3 + "train_ep.py", lambda p: ["--ep", str(p.ep or p.world)]),
}

# The layouts whose build a fake-tensor trace runs (tools/estimate.py): their scripts' (one
# device: train_ddp.py's, as for DDP, with DDP's wrapper left out: its C++ Reducer cannot be
# faked, and one replica holds what one device holds at batch / W; step 1's and step 2's
# scripts build the same model inline, as their lessons).
TRACED = ("single", "ddp", "fsdp_zero3", "fsdp_zero2", "hsdp", "hsdp_zero2", "tp", "2d", "pp", "cp", "cp_fsdp")


def layout(p) -> str:
    """The table's key for plan ``p``: its strategy, or 3d for 2-D with a pipeline."""
    return "3d" if p.strategy == "2d" and p.pp > 1 else p.strategy


def one_device_script(p) -> str:
    """One GPU: step 1's fp32 baseline, step 2's bf16 script, or its AC script."""
    if p.dtype == "fp32" and p.ac == "none":
        return "step1_single_gpu/train.py"
    return "step2_memory/train_amp.py" if p.ac == "none" else "step2_memory/train_amp_ac.py"


def script_of(p) -> str:
    return one_device_script(p) if p.strategy == "single" else SCRIPTS[layout(p)][0]


def _batch_and_savers(p) -> list[str]:
    return ["--global-batch-size", str(p.batch), "--seq-len", str(p.seq_len), "--ac", p.ac] + (
        ["--amp", "off"] if p.dtype == "fp32" else []) + (  # (bf16 is the step-3 scripts' default)
        ["--grad-accum", str(p.accum)] if p.accum > 1 else [])


def layout_flags(p) -> list[str]:
    """The flags that make plan ``p``'s layout in its script (not the model, data, launch or run
    length): the strategy's own, the savers, the batch and the sequence."""
    if p.strategy == "single":  # step 1 takes neither --amp nor --ac; step 2's train_amp.py no --ac
        flags = ["--global-batch-size", str(p.batch), "--seq-len", str(p.seq_len)]
        if (p.dtype, p.ac) != ("fp32", "none"):
            flags += ["--amp", "bf16" if p.dtype == "bf16" else "off"] + (["--ac", p.ac] if p.ac != "none" else [])
        return flags
    flags = SCRIPTS[layout(p)][1](p)
    flags += ["--sequence-parallel"] if p.sequence_parallel else []
    flags += ["--no-loss-parallel"] if p.strategy == "tp" and not p.loss_parallel else []
    flags += ["--loss-chunks", str(p.loss_chunks)] if p.loss_chunks > 1 else []
    flags += ["--split-root-unit"] if p.split_root else []
    return flags + _batch_and_savers(p)


def build_module(p):
    """The script module (imported, not run) whose ``parse`` and ``build`` trace plan ``p``."""
    if p.strategy not in TRACED:
        raise ValueError(f"no traced build for {p.strategy}")
    script = SCRIPTS["ddp" if p.strategy == "single" else p.strategy][0]
    return importlib.import_module(script.removesuffix(".py").replace("/", "."))


def build_args(p, extra: list[str] = ()):
    """The parsed flags plan ``p``'s build runs with: its layout flags in the build's script
    (for one device, train_ddp.py's for the same model) and ``extra``."""
    flags = _batch_and_savers(p) if p.strategy == "single" else layout_flags(p)
    return build_module(p).parse([*flags, *extra])


def model_flags(cfg) -> list[str]:
    """--model, --n-layers and --vocab-size for the config ``cfg`` (a preset's, with its layers
    and vocabulary changed, as the tools' flags make them)."""
    from common.model import PRESETS
    for name, preset in PRESETS.items():
        if replace(preset, n_layers=cfg.n_layers, vocab_size=cfg.vocab_size) == cfg:
            return ["--model", name, "--n-layers", str(cfg.n_layers), "--vocab-size", str(cfg.vocab_size)]
    raise ValueError(f"no preset has the shapes of {cfg}")
