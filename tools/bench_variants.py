"""Which compile and kernel settings make a training step fastest? Measured side by side.

    python -m tools.bench_variants --device cuda                  # 125m at 12 x 1024, bf16
    python -m tools.bench_variants --device cuda --scale 1b       # 1b at 4 x 2048
    python -m tools.bench_variants --device cpu --scale debug --only eager,fused   # seconds

Every variant is bench_throughput's bare loop (the least a training step can be: one fixed
batch on the device, bf16 autocast, AdamW, gradient clipping) with one setting changed from
what step 3's scripts do with ``--compile``:

- ``blocks``, the reference: each transformer block compiled on its own
  (common/parallelize/compile.py, step 3's ``--compile``), AdamW's foreach kernels, the
  attention kernel PyTorch picks;
- ``eager``: nothing compiled (what compiling buys);
- ``model``: the whole model as one graph, as step 2's scripts compile it (the embedding,
  the final norm and the output projection fused too; in step 3 the parallelisms' hooks
  would fall inside the graph);
- ``fused``: ``--fused-adamw`` (one kernel for the whole optimizer step);
- ``flash``, ``efficient``, ``cudnn``: that attention kernel forced (``sdpa_kernel``);
- ``cudagraphs``: the whole model compiled with ``mode="reduce-overhead"`` (the step
  replayed as CUDA graphs: no launch cost; CUDA only);
- ``autotune``: blocks compiled with ``mode="max-autotune-no-cudagraphs"`` (Inductor tries
  several matmul and fusion kernels and keeps the fastest; compiling takes longest);
- ``float8``: ``model`` with its Linear layers in float8 first (step 2.6's conversion:
  torchao's Float8Linear, tensorwise scales; the output layer stays bf16): compare it with
  ``model``, and at 1b, where the matmuls are wide enough to gain (on a CPU torchao
  emulates: a time of no meaning; a GPU before compute capability 8.9 has no float8
  matmul, and the row fails with that sentence).

Each variant runs in a fresh process (dynamo's caches and the allocator's pool are per
process: no variant inherits another's), one after another, and its row is printed as soon
as it is measured, so a run stopped partway still reports what it finished. A variant that
fails, or runs past ``--timeout``, gets a row saying so; the others go on. Printed per
variant: tokens/s, its ratio to ``blocks``, and the seconds until its timed steps began
(building, compiling, 3 warm-up steps). The fastest is named at the end: where it beats
``blocks`` on a GPU, by more than the run-to-run noise, it is the candidate for the
scripts' default. This tool measures; it changes no default.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.errors import UserError, main_guard  # noqa: E402


@dataclass(frozen=True)
class Variant:
    name: str
    what: str
    compile: str | None = "blocks"   # None, "blocks" (each block) or "model" (the whole model)
    mode: str | None = None          # torch.compile's mode
    fused: bool = False              # AdamW(fused=True)
    attention: str | None = None     # an SDPBackend forced for the whole run
    cuda_only: bool = False
    float8: bool = False             # the Linear layers converted to torchao's Float8Linear first


VARIANTS = [
    Variant("blocks", "step 3's --compile: each block compiled, foreach AdamW, PyTorch's attention kernel"),
    Variant("eager", "nothing compiled", compile=None),
    Variant("model", "step 2's --compile: the whole model compiled as one graph", compile="model"),
    Variant("fused", "blocks + fused AdamW (--fused-adamw)", fused=True),
    Variant("flash", "blocks + FlashAttention forced", attention="FLASH_ATTENTION"),
    Variant("efficient", "blocks + memory-efficient attention forced", attention="EFFICIENT_ATTENTION",
            cuda_only=True),
    Variant("cudnn", "blocks + cuDNN attention forced", attention="CUDNN_ATTENTION", cuda_only=True),
    Variant("cudagraphs", "the whole model compiled with mode='reduce-overhead' (CUDA graphs)", compile="model",
            mode="reduce-overhead", cuda_only=True),
    Variant("autotune", "blocks compiled with mode='max-autotune-no-cudagraphs'", mode="max-autotune-no-cudagraphs"),
    Variant("float8", "model + its Linear layers in float8 (torchao, tensorwise): against model", compile="model",
            float8=True),
]
BY_NAME = {v.name: v for v in VARIANTS}
DEFAULT = "blocks"


def prepare(model, variant: Variant) -> None:
    """Convert and compile ``model`` in place as ``variant`` says (nothing for eager)."""
    from common.parallelize.compile import apply_compile
    if variant.float8:  # before compiling, as train_float8.py does: the casts fuse into the graph
        from common.parallelize.float8 import convert_float8, float8_unsupported
        device = next(model.parameters()).device
        why = float8_unsupported(device)
        if why:
            raise UserError(why)
        convert_float8(model, device)
    options = {"mode": variant.mode} if variant.mode else {}
    if variant.compile == "model":
        model.compile(**options)
    elif variant.compile == "blocks":
        if options:
            for block in model.layers.values():
                block.compile(**options)
        else:
            apply_compile(model)


def attention(variant: Variant):
    """The context the run takes place in: the forced attention kernel, or none."""
    if variant.attention is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel(getattr(SDPBackend, variant.attention))


def measure(variant: Variant, model_name: str, batch: int, seq_len: int, device, amp: bool, steps: int) -> dict:
    """One variant's bare loop, in this process: tokens/s and the seconds before timing began."""
    import torch
    from common.model import get_config
    from tools.bench_throughput import bare_loop
    t0 = time.perf_counter()
    marks = {}

    def ready():  # the timed steps begin: the model built and compiled, its warm-up steps run
        marks["ready"] = time.perf_counter() - t0

    with attention(variant):
        tps = bare_loop(get_config(model_name), batch, seq_len, torch.device(device), amp, False, steps,
                        prepare=lambda m: prepare(m, variant), fused=variant.fused, ready=ready)
    return {"tokens_per_s": tps, "ready_s": marks.get("ready")}


def run_variant(variant: Variant, argv: list[str], timeout: float) -> dict:
    """``variant`` in a fresh process of this tool; its result, or what stopped it."""
    cmd = [sys.executable, "-m", "tools.bench_variants", *argv, "--variant", variant.name]
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"stopped after {timeout:.0f} s (--timeout)"}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or [f"exit {done.returncode}"]
    return {"error": f"exit {done.returncode}: {tail[0][:300]}"}


def parser() -> argparse.ArgumentParser:
    from tools.bench_throughput import bench_parser
    p = bench_parser(__doc__, cpu_steps=3)
    p.add_argument("--only", default=None,
                   help=f"comma-separated variants, in that order (default: all the device runs): "
                        f"{', '.join(v.name for v in VARIANTS)}")
    p.add_argument("--timeout", type=float, default=240, help="seconds a variant may take, compile included")
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # one variant, in this process
    return p


@main_guard
def main(argv=None):
    args = parser().parse_args(argv)
    from tools.bench_throughput import SCALES, resolve
    device, scale, steps = resolve(args, cpu_steps=3)
    gpu = device.type == "cuda"
    model, batch, seq_len = SCALES[scale]
    if args.variant is not None:  # the child: one variant, one line of JSON
        result = measure(BY_NAME[args.variant], model, batch, seq_len, device.type, args.amp == "bf16", steps)
        print("RESULT " + json.dumps(result), flush=True)
        return result
    names = args.only.split(",") if args.only else [v.name for v in VARIANTS if gpu or not v.cuda_only]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise UserError(f"--only: no variant named {', '.join(unknown)}; the variants: "
                        f"{', '.join(v.name for v in VARIANTS)}.")
    if not gpu and any(BY_NAME[n].cuda_only for n in names):
        raise UserError(f"--only: {', '.join(n for n in names if BY_NAME[n].cuda_only)} run on CUDA only.")
    child = ["--scale", scale, "--device", device.type, "--steps", str(steps), "--amp", args.amp]
    print(f"bench_variants: {model}, batch {batch} x {seq_len}, {args.amp}, {device.type}, {steps} timed steps "
          f"each, each variant in a fresh process", flush=True)
    print(f"  {'variant':<11} {'tokens/s':>12} {'vs ' + DEFAULT:>10} {'ready s':>8}  what", flush=True)
    results = {}
    for name in names:
        variant = BY_NAME[name]
        r = results[name] = run_variant(variant, child, args.timeout)
        if "error" in r:
            print(f"  {name:<11} {'failed':>12} {'':>10} {'':>8}  {variant.what}: {r['error']}", flush=True)
            continue
        base = results.get(DEFAULT, {}).get("tokens_per_s")
        ratio = f"{r['tokens_per_s'] / base:.3f}x" if base else ""
        print(f"  {name:<11} {r['tokens_per_s']:>12,.0f} {ratio:>10} {r['ready_s']:>8.1f}  {variant.what}",
              flush=True)
    ok = {n: r for n, r in results.items() if "error" not in r}
    if ok:
        best = max(ok, key=lambda n: ok[n]["tokens_per_s"])
        base = ok.get(DEFAULT, {}).get("tokens_per_s")
        versus = f", {ok[best]['tokens_per_s'] / base:.3f}x {DEFAULT}" if base else ""
        print(f"  fastest: {best}{versus}", flush=True)
        if "float8" in ok and "model" in ok:  # float8's own reference: the same whole-model graph in bf16
            print(f"  float8 against model: {ok['float8']['tokens_per_s'] / ok['model']['tokens_per_s']:.3f}x",
                  flush=True)
    failed = [n for n, r in results.items() if "error" in r]
    if failed:
        raise UserError(f"{len(failed)} of {len(results)} variants did not finish: {', '.join(failed)} (their rows say why).")
    return results


if __name__ == "__main__":
    main()
