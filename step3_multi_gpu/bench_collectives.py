"""How fast are the collectives? Time them over message sizes, nccl-tests style.

    torchrun --nproc-per-node 4 step3_multi_gpu/bench_collectives.py

Every parallel strategy is built from five operations: all_reduce (DDP's gradients),
all_gather and reduce_scatter (FSDP's parameters and gradients), broadcast (initial
weights) and send/recv (pipeline stages). This script times each over message sizes
from KiB to tens (CPU) or hundreds (GPU) of MiB and reports two bandwidths, defined as
nccl-tests defines them, for a message of S bytes taking t seconds on n ranks:

    algorithm bandwidth  algbw = S / t
    bus bandwidth        busbw = algbw x factor, where factor is
        all_reduce          2(n-1)/n   (a ring sends 2(n-1)/n x S per rank)
        all_gather          (n-1)/n    (S = the gathered size; each rank receives the n-1 shards it lacks)
        reduce_scatter      (n-1)/n    (S = the full input before scattering)
        broadcast, send/recv  1

busbw is what each rank's link actually carried, so it can be compared across
collectives and world sizes and against the link's rated speed; algbw cannot (an
all-reduce moves almost twice its size). The time of one call is roughly
t = alpha + S / B: alpha (latency, fixed per call) dominates small messages, where
bandwidth grows with size, and S / B dominates large ones, where busbw levels off at the
link's speed. The figure shades the two regions. Many small collectives waste the link;
that is why DDP buckets its gradients (25 MiB by default) and FSDP gathers whole layers.

Outputs in --out (default runs/bench_collectives/): collectives.json, collectives.md and
collectives.png.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # find common/

import torch
import torch.distributed as dist

from common.measure.bench import GB, check_message_size, fmt_size, message_sizes, time_collective
from common.distributed import distributed, require_launcher
from common.errors import UserError, main_guard
from common.figure_file import save_figure

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv")


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for ``op`` on ``n`` ranks (nccl-tests' definitions)."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if op in ("broadcast", "send_recv"):
        return 1.0
    raise ValueError(f"unknown collective {op!r}")


def alg_bandwidth(size_bytes: float, seconds: float) -> float:
    """GB/s of the message itself: S / t."""
    return size_bytes / seconds / GB


def bus_bandwidth(op: str, size_bytes: float, seconds: float, n: int) -> float:
    """GB/s each rank's link carried: algbw x bus_factor(op, n)."""
    return alg_bandwidth(size_bytes, seconds) * bus_factor(op, n)


# torch 2.13 names them *_single and deprecates the *_tensor names; older releases (the
# GPU machines run 2.11) only have the latter.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def make_op(op: str, size: int, ctx, dtype=torch.float32):
    """(a no-argument call doing one ``op`` of about ``size`` bytes, its exact size S)."""
    n, dev, elem = ctx.world_size, ctx.device, torch.tensor([], dtype=dtype).element_size()
    numel = max(1, size // elem)
    if op in ("all_gather", "reduce_scatter"):
        numel = max(n, numel // n * n)  # S is the full tensor, n equal shards of it
    full = torch.zeros(numel, dtype=dtype, device=dev)
    if op == "all_reduce":
        return (lambda: dist.all_reduce(full)), full.nbytes
    if op == "all_gather":
        shard = torch.zeros(numel // n, dtype=dtype, device=dev)
        return (lambda: all_gather_single(full, shard)), full.nbytes
    if op == "reduce_scatter":
        shard = torch.zeros(numel // n, dtype=dtype, device=dev)
        return (lambda: reduce_scatter_single(shard, full)), full.nbytes
    if op == "broadcast":
        return (lambda: dist.broadcast(full, src=0)), full.nbytes
    if op == "send_recv":
        # Every rank sends S to its right neighbour and receives S from its left at once
        # (nccl-tests' sendrecv), so every link in the ring is busy in both directions.
        incoming = torch.zeros_like(full)
        right, left = (ctx.rank + 1) % n, (ctx.rank - 1) % n

        def send_recv():
            ops = [dist.P2POp(dist.isend, full, right), dist.P2POp(dist.irecv, incoming, left)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return send_recv, full.nbytes
    raise ValueError(f"unknown collective {op!r}")


def latency_bandwidth_model(rows: list[dict]) -> dict:
    """alpha (s) and B (bytes/s) of t = alpha + S / B, from the smallest and largest messages.

    alpha: the fastest time among the three smallest messages (all latency);
    B: the best algbw seen (the large-message plateau). Their product S* = alpha x B is
    the size at which moving the data costs as much as the latency: below it a call is
    latency-bound, above it bandwidth-bound.
    """
    rows = sorted(rows, key=lambda r: r["bytes"])
    alpha = min(r["time_s"] for r in rows[:3])
    bandwidth = max(r["algbw_GBps"] for r in rows) * GB
    return {"alpha_s": alpha, "bandwidth_Bps": bandwidth, "crossover_bytes": alpha * bandwidth}


def run(ctx, ops, sizes, iters: int, budget_s: float, blocks: int) -> list[dict]:
    rows = []
    for op in ops:
        for size in sizes:
            fn, nbytes = make_op(op, size, ctx)
            t, it = time_collective(fn, ctx.device, max_iters=iters, budget_s=budget_s, blocks=blocks)
            rows.append({"op": op, "bytes": nbytes, "iters": it, "time_s": t,
                         "algbw_GBps": alg_bandwidth(nbytes, t),
                         "busbw_GBps": bus_bandwidth(op, nbytes, t, ctx.world_size)})
    return rows


def print_tables(rows: list[dict], n: int, header: str):
    print(header)
    for op in dict.fromkeys(r["op"] for r in rows):
        print(f"\n# {op}: busbw = algbw x {bus_factor(op, n):.3g}")
        print(f"{'size':>12} {'time (us)':>12} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}")
        for r in (r for r in rows if r["op"] == op):
            print(f"{fmt_size(r['bytes']):>12} {r['time_s'] * 1e6:>12,.1f} {r['algbw_GBps']:>13.3f} "
                  f"{r['busbw_GBps']:>13.3f}")


def markdown(rows: list[dict], n: int, header: str, model: dict) -> str:
    ops = list(dict.fromkeys(r["op"] for r in rows))
    sizes = sorted({r["bytes"] for r in rows if r["op"] == ops[0]})
    by = {(r["op"], r["bytes"]): r for r in rows}
    lines = [header, "", "busbw in GB/s (and all_reduce's time per call); busbw = algbw x "
             + ", ".join(f"{bus_factor(op, n):.3g} ({op})" for op in ops), "",
             "| size | all_reduce time | " + " | ".join(ops) + " |", "|---" * (len(ops) + 2) + "|"]
    for s in sizes:
        ar = by.get(("all_reduce", s))
        cells = []
        for op in ops:  # all_gather/reduce_scatter sizes are rounded to n shards: take the nearest
            r = min((r for r in rows if r["op"] == op), key=lambda r: abs(r["bytes"] - s))
            cells.append(f"{r['busbw_GBps']:.3f}")
        lines.append(f"| {fmt_size(s)} | {ar['time_s'] * 1e6:,.0f} us | " if ar else f"| {fmt_size(s)} | - | ")
        lines[-1] += " | ".join(cells) + " |"
    if model:
        lines += ["", f"all_reduce latency alpha = {model['alpha_s'] * 1e6:,.0f} us, best algbw "
                  f"B = {model['bandwidth_Bps'] / GB:.3f} GB/s: latency-bound below S* = alpha x B = "
                  f"{fmt_size(model['crossover_bytes'])}, bandwidth-bound above."]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], n: int, model: dict, path: str, title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ops = list(dict.fromkeys(r["op"] for r in rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    lo, hi = min(r["bytes"] for r in rows), max(r["bytes"] for r in rows)
    for op, marker in zip(ops, "osD^v"):
        rs = sorted((r for r in rows if r["op"] == op), key=lambda r: r["bytes"])
        x = [r["bytes"] for r in rs]
        ax1.plot(x, [r["time_s"] * 1e6 for r in rs], marker=marker, ms=4,
                 label=f"{op} (busbw = algbw x {bus_factor(op, n):.3g})")
        ax2.plot(x, [r["busbw_GBps"] for r in rs], marker=marker, ms=4)
    if model:
        s_star = min(max(model["crossover_bytes"], lo), hi)
        for ax in (ax1, ax2):
            ax.axvspan(lo, s_star, color="#4C72B0", alpha=0.08, lw=0)
            ax.axvspan(s_star, hi, color="#C44E52", alpha=0.08, lw=0)
            ax.axvline(s_star, color="gray", ls=":", lw=1)
        xs = [lo * (hi / lo) ** (i / 60) for i in range(61)]
        ax1.plot(xs, [(model["alpha_s"] + s / model["bandwidth_Bps"]) * 1e6 for s in xs], "k:", lw=1,
                 label="all_reduce model: alpha + S/B")
        ax1.text(lo * 1.15, 0.97, "latency-bound\n(time ~ alpha)", transform=ax1.get_xaxis_transform(),
                 va="top", fontsize=8, color="#4C72B0")
        ax1.text(hi / 1.15, 0.03, "bandwidth-bound\n(time ~ S/B)", transform=ax1.get_xaxis_transform(),
                 ha="right", va="bottom", fontsize=8, color="#C44E52")
        # right of S* every bandwidth is high, so the bottom of the panel is free
        ax2.text(s_star * 1.1, 0.03, f"S* = alpha x B = {fmt_size(model['crossover_bytes'])}",
                 transform=ax2.get_xaxis_transform(), va="bottom", ha="left", fontsize=8, color="gray")
    ticks = [s for s in sorted({r["bytes"] for r in rows if r["op"] == ops[0]})][::2]
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [fmt_size(s) for s in ticks], rotation=35, fontsize=8)
        ax.set_xlabel("message size S")
        ax.grid(alpha=0.3)
    ax1.set_yscale("log")
    ax1.set_ylabel("time per call (us, slowest rank)")
    ax2.set_ylabel("bus bandwidth (GB/s)")
    fig.legend(*ax1.get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(title)
    save_figure(fig, path, (0, 0.11, 1, 1))
    plt.close(fig)


@main_guard
def main():
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (CUDA if present, else CPU), cpu or cuda")
    p.add_argument("--out", default="runs/bench_collectives", help="output folder (default: %(default)s)")
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of: " + ", ".join(OPS))
    p.add_argument("--min-size", type=int, default=1024, help="smallest message in bytes (default: 1 KiB)")
    p.add_argument("--max-size", type=int, default=None,
                   help="largest message in bytes (default: 32 MiB on CPU, 256 MiB on CUDA)")
    p.add_argument("--factor", type=int, default=2, help="each size is the previous times this (default: 2)")
    p.add_argument("--iters", type=int, default=20,
                   help="most calls per timed block; big messages get fewer, so a block takes about "
                        "--budget seconds (default: 20)")
    p.add_argument("--budget", type=float, default=0.06, help="seconds per timed block (default: 0.06)")
    p.add_argument("--blocks", type=int, default=5,
                   help="timed blocks per size; the fastest counts, as noise only adds time (default: 5)")
    args = p.parse_args()
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    if not ops or any(o not in OPS for o in ops):
        raise UserError(f"--ops {args.ops!r}: choose from {', '.join(OPS)}.")
    # (not "budget <= 0": nan compares false with everything and would pass)
    if not (args.iters >= 1 and args.blocks >= 1 and 0 < args.budget <= 3600 and args.factor >= 2
            and args.min_size >= 4):
        raise UserError(f"--iters and --blocks must be positive, --budget between 0 and 3600 seconds (got "
                        f"{args.budget:g}), --factor at least 2, --min-size at least 4.")
    check_message_size(args.max_size)
    with distributed(args.device) as ctx:
        require_launcher(ctx, "step3_multi_gpu/bench_collectives.py")
        # CUDA path: no CPU test: a default size and the GPU's name; NCCL itself needs GPUs
        max_size = args.max_size or (256 * 2**20 if ctx.device.type == "cuda" else 32 * 2**20)
        if max_size < args.min_size:
            raise UserError(f"--max-size {max_size} is below --min-size {args.min_size}.")
        sizes = message_sizes(args.min_size, max_size, args.factor)
        rows = run(ctx, ops, sizes, args.iters, args.budget, args.blocks)
        if ctx.is_main:
            n = ctx.world_size
            # CUDA path: no CPU test: the GPU's name
            name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "CPU"
            header = f"### Collectives: {n} ranks, {ctx.backend} on {name}, float32, torch {torch.__version__}"
            ar = [r for r in rows if r["op"] == "all_reduce"]
            model = latency_bandwidth_model(ar) if len(ar) >= 3 else {}
            print_tables(rows, n, header)
            out = os.path.abspath(args.out)
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, "collectives.json"), "w") as f:
                json.dump({"world_size": n, "backend": ctx.backend, "device": name, "torch": torch.__version__,
                           "bus_factor": {op: bus_factor(op, n) for op in ops}, "all_reduce_model": model,
                           "rows": rows}, f, indent=1)
            with open(os.path.join(out, "collectives.md"), "w") as f:
                f.write(markdown(rows, n, header, model))
            plot(rows, n, model, os.path.join(out, "collectives.png"),
                 f"Collectives on {n} ranks ({ctx.backend}, {name}): time and bus bandwidth")
            print(f"\noutputs in {args.out}/")


if __name__ == "__main__":
    main()
