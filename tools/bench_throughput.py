"""What does the harness cost? Our training script against a bare loop, side by side.

    python -m tools.bench_throughput                     # on a GPU: 125m at 12 x 1024, bf16 + compile
    python -m tools.bench_throughput --scale 1b          # 1b at 4 x 2048
    python -m tools.bench_throughput --scale toy         # the CPU default: small, 8 x 128, eager

The bare loop is the least a training step can be: the same model, batch, dtype, AdamW
and compile, one fixed batch already on the device, no progress bar, no metrics, no
checks. The script is step2_memory/train_amp.py as a learner runs it (real data, the
bar, metrics.jsonl, the NaN checks), with --no-trace-memory and no held-out evaluation.
The two run in turns in this process (bare, script, bare) and each keeps its best
(noise only ever adds time). Printed: tokens/s of each, the script's overhead over the
bare loop, and MFU (6N + 12 L d T FLOPs a token against the device's dense bf16 peak)
where the device's peak is known; on a CPU, the ratio only.

Beside them, each loop's host syncs per steady-state step (common/measure/syncs.py): the
times the host waited for the device. The bare loop has none; a harness that reads the
loss with .item() every step has one or more, and the GPU idles at each. On a GPU they
are counted in the timed runs (torch.cuda.set_sync_debug_mode); on a CPU, where the
counting slows every op, in short extra runs.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from common import ROOT
from common.distributed import resolve_device
from common.errors import UserError, main_guard
from common.measure import syncs
from common.measure.metrics import peak_flops
from common.model import flops_per_token
from common.model import build_model, get_config  # noqa: E402
from common.training import adamw

SCALES = {  # (model, batch, seq_len): the two GPU set-ups the throughput targets name, and one a CPU runs in seconds
    "125m": ("125m", 12, 1024),
    "1b": ("1b", 4, 2048),
    "toy": ("small", 8, 128),
    "debug": ("debug", 4, 32),  # the test suite's: seconds, numbers meaningless
}


def bare_loop(cfg, batch: int, seq_len: int, device, amp: bool, compile: bool, steps: int, *,
              prepare=None, fused: bool = False, ready=None) -> float:
    """Tokens/s of the least a step can be (after 3 warm-up steps, compile's included).
    ``compile``: the whole model, as step2_memory/train_amp.py's ``--compile`` does;
    ``prepare(model)`` instead: any other way (tools/bench_variants.py); ``fused``: fused
    AdamW; ``ready()`` is called as the timed steps begin."""
    model = build_model(cfg, device, seed=0)
    if prepare is not None:
        prepare(model)
    elif compile:
        model.compile()
    optimizer = adamw(model.parameters(), argparse.Namespace(lr=1e-4, fused_adamw=fused))
    x = torch.randint(0, cfg.vocab_size, (batch, seq_len), device=device)
    y = torch.roll(x, -1, dims=1)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    _sync(device)
    if ready:
        ready()
    t0 = time.perf_counter()
    for i in range(steps):
        syncs.step_begins(i)  # for a SyncCounter, if one is open
        step()
    syncs.step_begins(None)
    _sync(device)
    return steps * batch * seq_len / (time.perf_counter() - t0)


def script(model: str, batch: int, seq_len: int, device, amp: bool, compile: bool, steps: int) -> float:
    """Tokens/s of step2_memory/train_amp.py (its own mean over the steps after the first)."""
    from tools.multirun import run_script
    with tempfile.TemporaryDirectory() as out:
        argv = ["--model", model, "--global-batch-size", str(batch), "--seq-len", str(seq_len),
                "--steps", str(steps + 3), "--warmup-steps", "2", "--amp", "bf16" if amp else "off",
                "--no-trace-memory", "--eval-batches", "0", "--device", device.type, "--out", out]
        with contextlib.redirect_stdout(io.StringIO()):  # its summary: the table below says it
            code, err = run_script("step2_memory/train_amp.py", argv + (["--compile"] if compile else []),
                                   capture_stderr=True)
        if code:
            raise UserError(f"step2_memory/train_amp.py failed (exit {code}): {err.strip()[-500:]}")
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    rows = rows[3:]  # as the bare loop: after 3 warm-up steps (compile's among them)
    return len(rows) / sum(1 / r["tokens_per_s"] for r in rows)  # total tokens over total time


def counted(device, loop, *args) -> tuple[float, int]:
    """(tokens/s, host syncs per steady-state step) of ``loop(*args)``: the most of any step
    but the first and last (the script reads its last step's loss at once, on purpose)."""
    with syncs.SyncCounter(device) as counter:
        tps = loop(*args)
    return tps, max(counter.steady() or counter.per_step())


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_parser(doc: str, cpu_steps: int) -> argparse.ArgumentParser:
    """The flags every benchmark of a training step shares: --scale, --device, --steps, --amp."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--scale", choices=sorted(SCALES), default=None,
                   help="125m (12 x 1024) or 1b (4 x 2048) on a GPU; toy (small, 8 x 128) or debug on a CPU "
                        "(default: by device)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--steps", type=int, default=None,
                   help=f"timed steps of each (default: 20 on a GPU, {cpu_steps} on a CPU)")
    p.add_argument("--amp", default="bf16", choices=("bf16", "off"), help="bf16 autocast (default) or fp32")
    return p


def resolve(args, cpu_steps: int):
    """(device, scale, timed steps) from a benchmark's --device, --scale and --steps: on a
    GPU 125m and 20 steps by default, on a CPU the toy scale and ``cpu_steps``."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA GPU is visible here; use --device cpu (ratios only).")
    device = resolve_device(args.device, 0, 1)
    gpu = device.type == "cuda"
    steps = args.steps if args.steps is not None else (20 if gpu else cpu_steps)
    if steps <= 0:
        raise UserError(f"--steps must be positive (got {steps}).")
    return device, args.scale or ("125m" if gpu else "toy"), steps


@main_guard
def main(argv=None):
    p = bench_parser(__doc__, cpu_steps=5)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile both (default: on a GPU, off on a CPU, where Inductor takes minutes)")
    args = p.parse_args(argv)
    device, scale, steps = resolve(args, cpu_steps=5)
    gpu = device.type == "cuda"
    compile = gpu if args.compile is None else args.compile
    model, batch, seq_len = SCALES[scale]
    cfg = get_config(model)
    amp = args.amp == "bf16"
    what = f"{model}, batch {batch} x {seq_len}, {args.amp}{' + compile' if compile else ''}, {device.type}"
    print(f"bench_throughput: {what}, {steps} timed steps each, in turns: bare, script, bare", flush=True)
    if gpu:  # counting costs nothing here: count in the timed runs
        (b1, bare_syncs), (ours, our_syncs), (b2, _) = (
            counted(device, bare_loop, cfg, batch, seq_len, device, amp, compile, steps),
            counted(device, script, model, batch, seq_len, device, amp, compile, steps),
            counted(device, bare_loop, cfg, batch, seq_len, device, amp, compile, steps))
        bare = max(b1, b2)
    else:
        bare = max(bare_loop(cfg, batch, seq_len, device, amp, compile, steps),
                   bare_loop(cfg, batch, seq_len, device, amp, compile, steps))
        ours = script(model, batch, seq_len, device, amp, compile, steps)
        _, bare_syncs = counted(device, bare_loop, cfg, batch, seq_len, device, amp, False, 3)
        _, our_syncs = counted(device, script, model, batch, seq_len, device, amp, False, 1)
    overhead = bare / ours - 1
    peak, name, source = peak_flops(device, args.amp if amp else "fp32")
    per_token = flops_per_token(cfg, seq_len)
    lines = [f"  device          {name}",
             f"  bare loop       {bare:,.0f} tokens/s",
             f"  our script      {ours:,.0f} tokens/s",
             f"  overhead        {100 * overhead:+.1f}% (the script's step time over the bare loop's, minus 1)",
             f"  host syncs      bare {bare_syncs}, script {our_syncs} per step (waits for the device, steady state)"]
    if peak:
        lines += [f"  MFU             bare {bare * per_token / peak:.1%}, script {ours * per_token / peak:.1%} "
                  f"({per_token / 1e9:.2f} GFLOP a token against {source})"]
    else:
        lines += ["  MFU             n/a (no known peak for this device: the ratio above is the number to read)"]
    print("\n".join(lines), flush=True)
    return {"bare_tokens_per_s": bare, "script_tokens_per_s": ours, "overhead": overhead,
            "bare_syncs_per_step": bare_syncs, "script_syncs_per_step": our_syncs}


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
