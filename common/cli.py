"""The flags every training script shares (``--help`` lists them) and their checks."""
from __future__ import annotations

import argparse
import contextlib
import math
import sys
from pathlib import Path

import torch

from common import ROOT, checkpoint, prepared
from common.errors import MADE_FOR_THIS_RUN, UserError
from common.model import PRESETS, get_config


class _OneLineErrors(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (no usage block): under torchrun every rank
    prints it, and four copies of the usage would bury the sentence that matters."""

    def error(self, message):
        self.exit(2, f"error: {message} (--help lists the flags)\n")


def parser(description: str | None) -> argparse.ArgumentParser:
    # allow_abbrev=False: "--step 3" is a mistake to name, not a prefix of --steps to accept.
    p = _OneLineErrors(description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                       allow_abbrev=False)
    g = p.add_argument_group("shared by every script")
    g.add_argument("--model", default="small", help=f"model preset: {', '.join(PRESETS)} (default: %(default)s)")
    g.add_argument("--n-layers", type=int, default=None, help="override the preset's number of layers")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="override the vocabulary (default: 256, one token per byte, or a prepared --data's "
                        "tokenizer's); any other size trains on --data synthetic, random token ids, to size a "
                        "layout like a published model's")
    g.add_argument("--steps", type=int, default=100, help="optimizer steps to train (default: 100)")
    g.add_argument("--global-batch-size", type=int, default=8,
                   help="sequences per optimizer step, summed over data-parallel ranks (default: 8)")
    g.add_argument("--seq-len", type=int, default=256, help="tokens (bytes) per sequence (default: 256)")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of AdamW (default: 3e-3)")
    g.add_argument("--warmup-steps", type=int, default=10, help="linear warm-up, then cosine decay (default: 10)")
    g.add_argument("--seed", type=int, default=0, help="seeds the weights and the data order (default: 0)")
    g.add_argument("--data", default="stdlib",
                   help="'stdlib' (this Python's standard library source, the default), 'synthetic' "
                        "(random bytes), a path to a text file or a folder of them (read as bytes), or a folder "
                        "that python -m tools.prepare_data wrote (its tokenizer's tokens, memory-mapped)")
    g.add_argument("--out", default=None, help="output folder (default: runs/<script name>); a finished run found there "
                   "is moved aside to <out>@<date>, never overwritten")
    g.add_argument("--device", default="auto", help="auto (CUDA if present, else CPU), cpu or cuda")
    g.add_argument("--trace-memory", action=argparse.BooleanOptionalAction, default=True,
                   help="record the memory timeline of a few steps and draw it (default: on)")
    g.add_argument("--trace-start", type=int, default=1,
                   help="first recorded step, after warm-up (default: 1, the second step)")
    g.add_argument("--trace-steps", type=int, default=2, help="number of recorded steps (default: 2)")
    g.add_argument("--profile", action="store_true",
                   help="torch.profiler over the last two untraced steps: a Chrome trace per rank in OUT/profile/ "
                        "and OUT/profile_timeline.png, compute and communication and how much of it overlaps")
    g.add_argument("--max-norm", type=float, default=1.0,
                   help="clip the gradients to this global norm before each optimizer step (default: 1.0, "
                        "the usual LLM recipe; 0 only measures it); the norm is logged as grad_norm")
    g.add_argument("--clip-by", default="global", choices=("global", "local"),
                   help="global (default): the norm of all the gradients, whatever the split; local: the "
                        "wrong way, for the lesson: each rank clips by the norm of the part it holds")
    g.add_argument("--save-weights", action="store_true",
                   help="at the end, gather the trained weights into one plain file, OUT/weights.pt")
    g.add_argument("--eval-batches", type=int, default=4,
                   help="held-out batches for the validation loss at the end (default: 4; 0 skips it)")
    g.add_argument("--eval-every", type=int, default=0, metavar="N",
                   help="also measure the validation loss every N steps, logged as val_loss (default: 0, only at "
                        "the end)")
    g.add_argument("--tensorboard", action="store_true",
                   help="also write the logged metrics as TensorBoard scalars into OUT/tensorboard/ (needs "
                        "pip install tensorboard)")
    g.add_argument("--expandable-segments", action="store_true",
                   help="CUDA's caching allocator grows its segments in place (PYTORCH_CUDA_ALLOC_CONF="
                        "expandable_segments:True) instead of caching blocks of fixed sizes: reserved memory stays "
                        "near allocated when the sizes of a step's tensors vary (a no-op on CPU)")
    checkpoint.add_flags(p)
    return p


def use_expandable_segments(on: bool) -> None:
    """--expandable-segments: set where CUDA's allocator reads it when it starts (the variable,
    inherited by child processes too), and, in a process whose allocator has started already
    (an earlier run of tools/gpu_check.py's or tools/multirun.py's shared process), set on the
    running allocator, so that each run gets its own flag's setting, on or off; any other
    PYTORCH_CUDA_ALLOC_CONF options are kept."""
    import os
    conf = [c for c in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").split(",") if c and
            not c.startswith("expandable_segments")]
    if on or _EXPANDABLE["set"]:  # off: undo only what an earlier run of this process set
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(conf + (["expandable_segments:True"] if on else []))
        # CUDA path: tests/test_cuda_paths.py::test_expandable_segments_reach_a_running_allocator
        if torch.cuda.is_initialized():
            torch.cuda.memory._set_allocator_settings(f"expandable_segments:{on}")
        _EXPANDABLE["set"] = on


_EXPANDABLE = {"set": False}  # whether this process's --expandable-segments turned them on


def parse(p: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Parse and check the shared flags; adds ``args.model_config`` and ``args.script``."""
    args = p.parse_args(argv)
    args.script = Path(sys.argv[0]).stem
    use_expandable_segments(args.expandable_segments)
    if args.model not in PRESETS:
        raise UserError(f"unknown --model {args.model!r}; choose one of {', '.join(PRESETS)}.")
    for flag in ("steps", "global_batch_size", "seq_len", "trace_steps"):
        if getattr(args, flag) <= 0:
            raise UserError(f"--{flag.replace('_', '-')} must be positive (got {getattr(args, flag)}).")
    for flag in ("warmup_steps", "trace_start", "eval_batches", "eval_every"):
        if getattr(args, flag) < 0:
            raise UserError(f"--{flag.replace('_', '-')} cannot be negative (got {getattr(args, flag)}).")
    if args.eval_every and not args.eval_batches:
        raise UserError(f"--eval-every {args.eval_every} has nothing to measure with --eval-batches 0; give "
                        f"--eval-batches 1 or more, or drop --eval-every.")
    if args.tensorboard:  # refused now, before any work, where the package is missing
        tensorboard_writer()
    if not (args.max_norm >= 0 and math.isfinite(args.max_norm)):
        raise UserError(f"--max-norm must be 0 (no clipping) or a positive number (got {args.max_norm}).")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        raise UserError(f"--lr must be a positive number (got {args.lr}).")
    if not 0 <= args.seed < 2**63:
        raise UserError(f"--seed must be between 0 and 2**63 - 1 (got {args.seed}).")
    if args.n_layers is not None and args.n_layers <= 0:
        raise UserError(f"--n-layers must be positive (got {args.n_layers}).")
    # A prepared folder brings its tokenizer's vocabulary, and its identity for the checkpoints.
    args.data_id = None
    found = prepared.vocab_of(args.data, args.vocab_size)
    if found:
        args.vocab_size, args.data_id = found
    else:
        check_vocab_size(args.vocab_size, args.data)
    _check_doc_mask(args)
    try:
        args.model_config = get_config(args.model, n_layers=args.n_layers, vocab_size=args.vocab_size)
    except ValueError as e:
        raise UserError(str(e)) from None
    _check_moe(args)
    if not _TRACE[0]:
        _check_it_can_fit(args)
    if args.seq_len > args.model_config.max_seq_len:
        raise UserError(f"--seq-len {args.seq_len} is longer than model {args.model!r} supports "
                        f"({args.model_config.max_seq_len}); use --seq-len {args.model_config.max_seq_len} or less.")
    if args.trace_memory and args.trace_start >= args.steps:
        raise UserError(f"--trace-start {args.trace_start} is past the last step ({args.steps - 1}); "
                        f"lower it, train longer, or pass --no-trace-memory.")
    checkpoint.check_flags(args)
    check_dry_run(args)
    # The default is anchored at the repository, not the working folder: the same
    # runs/<script>/ wherever the script is started from.
    args.out = Path(args.out) if args.out else ROOT / "runs" / args.script
    if args.out.exists() and not args.out.is_dir():
        raise UserError(f"--out {args.out} is a file, not a folder; give a folder (it is created if missing).")
    if not _TRACE[0]:
        check_writable(args.out)
    return args


_TRACE = [False]


@contextlib.contextmanager
def for_a_trace():
    """Parse a script's flags for a fake-tensor trace of its build (tools/estimate.py): it
    allocates nothing and writes nothing, so the checks of this machine (does the model's
    state fit its memory; can --out be written) are left out."""
    _TRACE[0] = True
    try:
        yield
    finally:
        _TRACE[0] = False


def tensorboard_writer():
    """TensorBoard's SummaryWriter class, or the sentence naming the package it needs
    (only --tensorboard needs it: the tutorial runs without it)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UserError("--tensorboard needs the tensorboard package, which is not installed; run "
                        "pip install tensorboard, or drop --tensorboard.") from None
    return SummaryWriter


def check_vocab_size(vocab_size: int | None, data: str) -> None:
    """Real text is bytes: a vocabulary other than 256 only makes sense with random token ids."""
    if vocab_size is None:
        return
    if not 2 <= vocab_size <= 2**31 - 1:
        raise UserError(f"--vocab-size must be between 2 and 2**31 - 1 (got {vocab_size}).")
    if vocab_size != 256 and data != "synthetic":
        raise UserError(f"--vocab-size {vocab_size} needs --data synthetic: the text is read as bytes (256 tokens), "
                        f"so real text would leave most of a larger vocabulary unused and overflow a smaller one "
                        f"(or tokenize it first: python -m tools.prepare_data).")


def check_writable(out: Path):
    """Create --out and write a file into it now: a folder that cannot be written would
    otherwise surface as a traceback at the first metrics line, or at the first checkpoint
    after hours of training. (Each rank its own probe name: ranks run this side by side.)"""
    import os
    probe = out / f".write_probe_{os.getpid()}"

    def refuse(e: OSError):
        return UserError(f"--out {out} cannot be written ({e.strerror or type(e).__name__}); give a folder you can "
                         f"write to.")
    for attempt in range(3):
        missing = [p for p in [out, *out.parents] if not p.exists()]  # deepest first
        try:
            out.mkdir(parents=True, exist_ok=True)
        except FileExistsError as e:
            # Another rank made it just before this one, then removed it again (as below) before
            # mkdir looked whether it is a folder: make it anew (a file there is refused)
            if out.exists() or attempt == 2:
                raise refuse(e) from None
            continue
        except OSError as e:
            raise refuse(e) from None
        MADE_FOR_THIS_RUN[:] = missing  # this run's (a harness may run several in one process)
        try:
            probe.write_text("ok")
            probe.unlink()
            return
        except FileNotFoundError as e:
            # Made, then gone: another rank made the folder, met an error of its own and removed
            # it again (an empty folder it had made). Make it anew, to say this rank's own error.
            if attempt == 2:
                raise refuse(e) from None
        except OSError as e:
            raise refuse(e) from None


def _check_it_can_fit(args):
    """Refuse a model no split could hold on this machine before building anything (a
    million layers would otherwise run until killed): fp32 weights, gradients and AdamW
    state are 16 bytes a parameter, which at best spread over all the memory of every node."""
    import os

    import torch

    from common.measure.byte_units import fmt_bytes
    from common.model import count_params
    need = 16 * count_params(args.model_config)
    nodes = max(1, int(os.environ.get("WORLD_SIZE", "1")) // int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    if (getattr(args, "fake_world_size", None) or 0) > 1:  # a dry run's rank is one of that many machines
        nodes = args.fake_world_size
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None
    # CUDA path: no CPU test: the GPUs' memory is the CUDA runtime's to tell; a CPU run's limit is its RAM
    gpus = sum(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())) \
        if torch.cuda.is_available() else 0
    have = max(ram or 0, gpus)
    if ram and need / nodes > have:
        raise UserError(f"--model {args.model} with {args.model_config.n_layers} layers has "
                        f"{need // 16 / 1e9:,.1f}B parameters: their weights, gradients and AdamW state alone need "
                        f"{fmt_bytes(need)}, more than this machine's {fmt_bytes(have)}; use fewer --n-layers or a "
                        f"smaller --model.")


# ---- the memory savers: chapter 2 teaches them, every later script keeps them -------------
# Each lesson adds its own flags, so a script never accepts a flag that it would ignore.
# One vocabulary everywhere: the same names and meanings in step 2 and step 3; only the
# defaults differ, each chapter's being its lesson (step 2.2: full AC) or, in step 3, what a
# GPU user trains with (bf16, no AC, one micro-batch).
def add_amp_flags(p: argparse.ArgumentParser, default: str = "bf16", fp16: bool = True) -> None:
    g = p.add_argument_group("mixed precision, and two speed-ups that save no memory")
    g.add_argument("--amp", default=default,
                   help=f"compute dtype: bf16, {'fp16 (CUDA, with a GradScaler), ' if fp16 else ''}or off (fp32) "
                        f"(default: {default})")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile the model (step 2's scripts: the whole model; step 3's: block by block, "
                        "with the parallelism's hooks between the blocks); the traced steps run eagerly")
    g.add_argument("--fused-adamw", action="store_true", help="AdamW's fused kernel: one kernel for all parameters")


def add_ac_flags(p: argparse.ArgumentParser, default: str = "full") -> None:
    g = p.add_argument_group("activation checkpointing")
    g.add_argument("--ac", default=default,
                   help=f"none; full: recompute each block in backward; selective: keep matmul and attention "
                        f"outputs, recompute the rest; selective-op: the same but recompute every second matmul "
                        f"too (torchtitan's per-op policy) (default: {default})")
    g.add_argument("--ac-every", type=int, default=1,
                   help="checkpoint only every k-th transformer block (default: 1, all of them)")


def add_loss_flags(p: argparse.ArgumentParser) -> None:
    """For a script whose model computes its own loss (``model(x, targets=y)``)."""
    g = p.add_argument_group("the loss")
    g.add_argument("--loss-chunks", type=int, default=1, metavar="N",
                   help="compute the output layer and the loss N chunks of tokens at a time, never holding all the "
                        "logits (the same loss and gradients; the output matmul runs again in backward). Worth it "
                        "with a large vocabulary (default: 1, the plain loss)")


def add_doc_mask_flags(p: argparse.ArgumentParser, refused: str | None = None) -> None:
    """--doc-mask, for a script whose model reads its own tokens (common/model.py's
    set_doc_mask). ``refused``: why this script cannot serve it, the end of the sentence
    "--doc-mask cannot be used with ..." that parse then says."""
    refused = refused or p.get_default("doc_mask_refused")  # (a script's own flags may have said why first)
    g = p.add_argument_group("documents")
    g.add_argument("--doc-mask", action="store_true",
                   help="attention never crosses a document boundary inside a window and RoPE positions restart at "
                        "0 at each document (--data prepared by python -m tools.prepare_data: a document ends at "
                        "its end-of-text token); costs a seq x seq mask per sequence, which takes SDPA off its "
                        "fastest causal kernels on a GPU (default: off, causal attention over the whole window)"
                        + (" (refused by this script)" if refused else ""))
    p.set_defaults(doc_mask_refused=refused)


def _check_doc_mask(args: argparse.Namespace) -> None:
    """Adds ``args.doc_eot``: the end-of-text token id documents end at, None without --doc-mask."""
    args.doc_eot = None
    if not getattr(args, "doc_mask", False):
        return
    if args.doc_mask_refused:
        raise UserError(f"--doc-mask cannot be used with {args.doc_mask_refused}; drop --doc-mask.")
    eot = prepared.read_meta(Path(args.data))["tokenizer"].get("eot_id") if prepared.is_prepared(args.data) else None
    if not isinstance(eot, int):
        raise UserError(f"--doc-mask needs --data prepared with an end-of-text token (python -m tools.prepare_data), "
                        f"which --data {args.data} is not: without one there is no document boundary to mask.")
    args.doc_eot = eot


def add_accum_flags(p: argparse.ArgumentParser, default: int = 4, what: str = "") -> None:
    g = p.add_argument_group("gradient accumulation")
    # --grad-accum-steps: step 3's old name, still accepted
    g.add_argument("--grad-accum", "--grad-accum-steps", dest="grad_accum", type=int, default=default,
                   help=f"split each global batch into this many micro-batches, one forward and backward "
                        f"each, and step once{what} (default: {default})")


def add_saver_flags(p: argparse.ArgumentParser, accum_what: str = "") -> None:
    """Step 3's flags for the savers of chapter 2, with a GPU user's defaults, and --doc-mask. fp16 is
    left out: its loss scale would have to agree across ranks (and be checkpointed), a
    recipe bf16 makes unnecessary on every GPU since Ampere."""
    add_amp_flags(p, default="bf16", fp16=False)
    add_ac_flags(p, default="none")
    add_accum_flags(p, default=1, what=accum_what)
    add_doc_mask_flags(p)  # (not a saver: what attention sees; a script that cannot serve it said why before)
    # the names train_fsdp.py used before every script had the savers: still accepted
    p.add_argument("--mixed-precision", dest="amp", action="store_const", const="bf16", help=argparse.SUPPRESS)
    p.add_argument("--activation-checkpointing", dest="ac", action="store_const", const="full",
                   help=argparse.SUPPRESS)


# ---- a dry run: one rank of a larger layout, in one process ------------------------------
def add_dry_run_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("dry run: what one rank of a bigger layout holds, before renting it")
    g.add_argument("--fake-world-size", type=int, default=None, metavar="N",
                   help="run rank --fake-rank of an N-rank layout alone in this process (PyTorch's fake process "
                        "group: collectives skipped): its real memory and bytes, meaningless losses; plain python")
    g.add_argument("--fake-rank", type=int, default=0, metavar="R", help="the rank a dry run plays (default: 0)")


def check_dry_run(args: argparse.Namespace) -> None:
    """What a dry run cannot do: it has no peers to save a checkpoint with, nor real weights to keep."""
    if getattr(args, "fake_world_size", None) is None:
        if getattr(args, "fake_rank", 0):
            raise UserError("--fake-rank needs --fake-world-size (the layout the rank belongs to).")
        return
    if args.fake_world_size < 1:
        raise UserError(f"--fake-world-size must be positive (got {args.fake_world_size}).")
    for flag, on in (("--ckpt-every", args.ckpt_every), ("--resume", args.resume), ("--save-weights", args.save_weights)):
        if on:
            raise UserError(f"{flag} cannot be used in a dry run (--fake-world-size): its weights are not trained "
                            f"(the other ranks' parts never arrive); drop {flag}.")


def refuse_run_flags(args: argparse.Namespace, script: str) -> None:
    """For the scripts that share the flags but not the Run object (comparisons, benchmarks):
    what only a training run does is refused, not silently ignored."""
    for flag, on in (("--profile", args.profile), ("--save-weights", args.save_weights),
                     ("--eval-every", args.eval_every), ("--tensorboard", args.tensorboard)):
        if on:
            raise UserError(f"{script} does not take {flag} (it compares or times runs of its own); use {flag} with "
                            f"a training script.")


def saver_label(args: argparse.Namespace) -> str:
    """The savers a run uses, for titles: "AMP bf16 + full AC + compiled" ("" without saver flags);
    --doc-mask too, which changes what is computed (summary.json's "savers", which compare names)."""
    parts = []
    if hasattr(args, "amp"):
        parts.append("fp32" if args.amp == "off" else f"AMP {args.amp}")
    if getattr(args, "ac", "none") != "none":
        parts.append(f"{args.ac} AC" + (f" every {args.ac_every} blocks" if args.ac_every > 1 else ""))
    if getattr(args, "compile", False):
        parts.append("compiled")
    if getattr(args, "grad_accum", 1) > 1:
        parts.append(f"{args.grad_accum} micro-batches")
    if getattr(args, "loss_chunks", 1) > 1:
        parts.append(f"loss in {args.loss_chunks} chunks")
    if getattr(args, "doc_mask", False):
        parts.append("per-document attention")
    return " + ".join(parts)


def check_memory_savers(args: argparse.Namespace, device, dp_size: int | None = 1, *,
                        fp16: bool = True) -> argparse.Namespace:
    """Check the saver flags a script declared against each other and the device.

    ``dp_size``: the data-parallel ranks the global batch is split over, for the
    micro-batch check (None: the script checks the split itself, with micro_batch_size).
    ``fp16``: whether the script offers fp16 (step 3 does not, see add_saver_flags).
    Adds ``args.amp_dtype`` (None when off) and ``args.compute_dtype`` (for MFU).
    """
    from common.parallelize.ac import AC_MODES
    from common.training import AMP_DTYPES, amp_unsupported, compile_unsupported, fused_adamw_unsupported

    if hasattr(args, "amp"):
        if args.amp not in AMP_DTYPES:
            raise UserError(f"unknown --amp {args.amp!r}; choose one of {', '.join(AMP_DTYPES)}.")
        if args.amp == "fp16" and not fp16:
            raise UserError("--amp fp16 is not offered in step 3: its loss scale would have to agree across "
                            "ranks; use --amp bf16 (the default), which needs no loss scaling, or --amp off.")
        for why in (amp_unsupported(device, args.amp),
                    args.fused_adamw and fused_adamw_unsupported(device),
                    args.compile and compile_unsupported(device)):
            if why:
                raise UserError(why)
        if args.amp == "fp16" and (args.ckpt_every or args.resume):
            # GradScaler's loss scale is not saved: a resumed run would restart it and differ.
            raise UserError("--amp fp16 cannot be checkpointed yet (the loss scale is not saved); use --amp bf16 "
                            "with --ckpt-every/--resume, or drop them.")
        args.amp_dtype = AMP_DTYPES[args.amp]
        args.compute_dtype = "fp32" if args.amp == "off" else args.amp
    if hasattr(args, "ac"):
        if args.ac not in AC_MODES:
            raise UserError(f"unknown --ac mode {args.ac!r}; choose one of {', '.join(AC_MODES)}.")
        if args.ac_every <= 0:
            raise UserError(f"--ac-every must be positive (got {args.ac_every}).")
    if getattr(args, "loss_chunks", 1) < 1:
        raise UserError(f"--loss-chunks must be positive (got {args.loss_chunks}); 1 is the plain loss.")
    if hasattr(args, "grad_accum") and dp_size is not None:
        if args.grad_accum <= 0:
            raise UserError(f"--grad-accum must be positive (got {args.grad_accum}).")
        # Equal micro-batches: only then is the mean of their mean losses the batch's mean loss.
        k, local = args.grad_accum, args.global_batch_size // dp_size
        if local % k and dp_size == 1:
            raise UserError(f"--grad-accum {k} does not split --global-batch-size {local} into equal "
                            f"micro-batches; use a divisor of {local}.")
        if local % k:
            raise UserError(f"--grad-accum {k} does not split the {local} sequences each of the {dp_size} "
                            f"data-parallel ranks gets into equal micro-batches; use a divisor of {local}.")
    return args


# ---- mixture of experts: the scripts that can train one say so ----------------------------
def add_moe_flags(p: argparse.ArgumentParser) -> None:
    """For a script whose training step adds the router's load-balancing loss (the *-moe presets)."""
    g = p.add_argument_group("mixture of experts (the *-moe presets)")
    g.add_argument("--n-experts", type=int, default=None,
                   help="override the preset's number of experts (each token still goes to top_k of them)")
    g.add_argument("--aux-loss-weight", type=float, default=None,
                   help="weight of the router's load-balancing loss in the training loss (default: the preset's, "
                        "0.01; 0 leaves the router unbalanced)")


def _check_moe(args: argparse.Namespace) -> None:
    if getattr(args, "n_experts", None) is not None:
        if args.n_experts < 0:
            raise UserError(f"--n-experts cannot be negative (got {args.n_experts}); 0 is the dense model.")
        try:
            args.model_config = get_config(args.model, n_layers=args.n_layers, n_experts=args.n_experts,
                                           vocab_size=args.vocab_size)
        except ValueError:
            raise UserError(f"--n-experts {args.n_experts} is fewer than the {args.model_config.top_k} experts each "
                            f"token goes to; use at least {args.model_config.top_k}.") from None
    cfg = args.model_config
    if not cfg.n_experts:
        return
    if not hasattr(args, "aux_loss_weight"):
        raise UserError(moe_unsupported(args.model, f"{args.script}.py"))
    if args.aux_loss_weight is not None:
        if not (args.aux_loss_weight >= 0 and math.isfinite(args.aux_loss_weight)):
            raise UserError(f"--aux-loss-weight must be 0 or a positive number (got {args.aux_loss_weight}).")
        from dataclasses import replace
        args.model_config = replace(cfg, moe_aux_weight=args.aux_loss_weight)


def moe_unsupported(model: str, script: str) -> str:
    """The sentence for a mixture-of-experts preset given to a script that cannot train one
    (also tools/estimate.py's, for the layouts of those scripts)."""
    return (f"--model {model} is a mixture of experts, which {script} cannot train (no router loss, no expert "
            f"split); use step1_single_gpu/train.py or step3_multi_gpu/train_ep.py.")
