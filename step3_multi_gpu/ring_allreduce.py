"""All-reduce from scratch: the ring algorithm, written with point-to-point send/recv.

    torchrun --nproc-per-node 4 step3_multi_gpu/ring_allreduce.py

The n ranks form a ring (rank r sends to r+1 and receives from r-1) and cut the tensor of
S bytes into n chunks. Two phases of n-1 steps each:

1. reduce-scatter: at every step each rank passes one chunk to its right neighbour and
   adds the chunk arriving from its left into its own copy. A chunk travels n-1 hops and
   collects one contribution per hop: after n-1 steps rank r holds the full sum of chunk
   (r+1) mod n.
2. all-gather: the finished chunks travel round the ring once more, each arrival
   overwriting a stale copy, until every rank has every summed chunk.

Each rank sends 2(n-1) chunks of S/n bytes: 2(n-1)/n * S, less than 2S however many
ranks there are. No all-reduce can do with less (every byte of the result depends on
every rank), which is why the ring is called bandwidth optimal and why nccl-tests
reports "bus bandwidth" = S/time * 2(n-1)/n. The price is 2(n-1) sequential steps, each
paying the network's latency: for small messages trees and other algorithms win.

The script checks the ring against ``dist.all_reduce`` (several dtypes, sizes that do
not divide by n, rings of 2..n ranks), counts the bytes each rank sent, and times both.
Outputs in --out (default runs/ring_allreduce/): ring_allreduce.json, ring_allreduce.md
and ring_vs_allreduce.png.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # find common/

import torch
import torch.distributed as dist

from common.measure.bench import GB, check_message_size, fmt_size, message_sizes, time_collective
from common.measure.comm import CommCounter
from common.distributed import distributed, require_launcher
from common.errors import UserError, main_guard
from common.figure_file import save_figure


def ring_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` over the ranks of ``group`` in place, like ``dist.all_reduce``."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if n == 1:
        return tensor
    if not tensor.is_contiguous():
        raise ValueError("ring_all_reduce works in place on a contiguous tensor")
    right = dist.get_global_rank(group, (rank + 1) % n) if group is not None else (rank + 1) % n
    left = dist.get_global_rank(group, (rank - 1) % n) if group is not None else (rank - 1) % n
    # tensor_split gives chunk sizes that differ by at most one element, so sizes that do
    # not divide by n need no padding; views of a flat view write straight into tensor.
    chunks = tensor.view(-1).tensor_split(n)
    incoming = torch.empty_like(chunks[0])  # the largest chunk

    # Phase 1, reduce-scatter: send chunk r-s, add the neighbour's chunk r-s-1 into ours.
    for s in range(n - 1):
        send, recv = chunks[(rank - s) % n], chunks[(rank - s - 1) % n]
        buf = incoming[: recv.numel()]
        _exchange(send, right, buf, left, group)
        recv += buf
    # Phase 2, all-gather: rank r now owns the sum of chunk r+1; pass the sums round.
    for s in range(n - 1):
        send, recv = chunks[(rank + 1 - s) % n], chunks[(rank - s) % n]
        _exchange(send, right, recv, left, group)  # receive straight into place
    return tensor


def _exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, group):
    """Send to the right and receive from the left at the same time.

    A blocking ``dist.send`` then ``dist.recv`` on every rank deadlocks: all ranks sit in
    send() waiting for a receiver that is itself sitting in send() (small messages may
    slip through a buffer, large ones do not). Posting both and then waiting breaks the
    cycle; ``batch_isend_irecv`` also lets NCCL run the pair as one fused operation.
    """
    ops = []
    if send.numel():  # a tensor smaller than the ring leaves some chunks empty
        ops.append(dist.P2POp(dist.isend, send, dst, group))
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, src, group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def chunk_numels(numel: int, n: int) -> list[int]:
    """Element counts of ``tensor_split(n)``: the first numel % n chunks get one more."""
    return [numel // n + (i < numel % n) for i in range(n)]


def expected_sent_bytes(numel: int, elem_size: int, n: int, rank: int) -> int:
    """Bytes rank ``rank`` of an n-rank ring sends: every chunk but (rank+1) in phase 1,
    every chunk but (rank+2) in phase 2. When n divides numel that is exactly 2(n-1)/n of
    the tensor; otherwise ranks differ by at most 2 elements and the mean over the ring is
    still exactly 2(n-1)/n * S, since each chunk is left out twice in total."""
    c = chunk_numels(numel, n)
    return elem_size * (2 * numel - c[(rank + 1) % n] - c[(rank + 2) % n])


# ---- checking it: equal to dist.all_reduce, bytes as the formula says ------------------
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64)
SHAPES = ((1,), (3,), (1001,), (33, 31), (65537,))  # none divisible by 2, 3 and 4 at once; (1,) leaves chunks empty


def _input(shape, dtype, rank: int, case: int) -> torch.Tensor:
    """The same pseudo-random input for (case, rank) on every process, so each rank can
    rebuild what the others hold and compute the exact sum."""
    g = torch.Generator().manual_seed(1000 * case + rank)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)


def check(ctx) -> list[dict]:
    """Compare the ring with dist.all_reduce on the first k ranks for k = 2..world size."""
    rows = []
    case = 0
    for k in range(2, ctx.world_size + 1):
        # new_group is collective: every rank creates every group, members use theirs
        group = None if k == ctx.world_size else dist.new_group(list(range(k)))
        for dtype in DTYPES:
            for shape in SHAPES:
                case += 1
                if ctx.rank >= k:
                    continue
                x = _input(shape, dtype, ctx.rank, case).to(ctx.device)
                ring, lib = x.clone(), x.clone()
                # The library's first: NCCL builds a group's communicator at its first call,
                # with every member of the group; the ring's first step can leave a rank with
                # nothing to send or receive (a tensor smaller than the ring), which must not
                # be the call the others wait in for it.
                dist.all_reduce(lib, group=group)
                with CommCounter() as comm:
                    ring_all_reduce(ring, group)
                inputs = [_input(shape, dtype, r, case) for r in range(k)]
                exact = torch.stack([t.double() for t in inputs]).sum(0)
                ring, lib = ring.cpu(), lib.cpu()
                if dtype.is_floating_point:
                    # Summing k numbers in any order is off by at most (k-1) roundings of
                    # partial sums (each <= sum|x_i|) plus the final one: a wrong or missing
                    # chunk is off by about |x_i| itself, far above this.
                    bound = k * torch.finfo(dtype).eps * torch.stack([t.double().abs() for t in inputs]).sum(0)
                    ok = bool(((ring.double() - exact).abs() <= bound).all()
                              and ((lib.double() - exact).abs() <= bound).all())
                else:
                    ok = torch.equal(ring.long(), exact.long()) and torch.equal(lib.long(), exact.long())
                numel = x.numel()
                rows.append({
                    "ring_size": k, "rank": ctx.rank, "dtype": str(dtype).removeprefix("torch."),
                    "shape": list(shape), "numel": numel, "ok": ok,
                    "equal_to_library": torch.equal(ring, lib),
                    "max_abs_diff_library": float((ring.double() - lib.double()).abs().max()),
                    "sent_bytes": comm.bytes.get("send", 0), "received_bytes": comm.bytes.get("recv", 0),
                    "expected_sent_bytes": expected_sent_bytes(numel, x.element_size(), k, ctx.rank),
                    "two_n_minus_1_over_n_bytes": 2 * (k - 1) / k * numel * x.element_size(),
                })
    return rows


# ---- timing it beside the library ------------------------------------------------------
def bench(ctx, sizes: list[int], iters: int) -> list[dict]:
    n, rows = ctx.world_size, []
    for size in sizes:
        x = torch.randn(size // 4, device=ctx.device)
        row = {"bytes": x.numel() * 4}
        for name, fn in (("ring", ring_all_reduce), ("dist.all_reduce", dist.all_reduce)):
            # best of 5 blocks: each of the ring's 2(n-1) steps waits for a neighbour, so
            # a busy machine delays it more than the library's single call
            t, it = time_collective(lambda: fn(x), ctx.device, max_iters=iters, blocks=5)
            row[name] = {"time_s": t, "iters": it, "algbw_GBps": row["bytes"] / t / GB,
                         "busbw_GBps": row["bytes"] / t / GB * 2 * (n - 1) / n}
        rows.append(row)
    return rows


def report(ctx, checks: list[dict], timings: list[dict], args) -> str:
    n = ctx.world_size
    lines = [f"### Ring all-reduce vs `dist.all_reduce` ({ctx.backend}, {n} ranks, {ctx.device.type})", ""]
    if checks:
        bad = [c for c in checks if not c["ok"] or c["sent_bytes"] != c["expected_sent_bytes"]]
        lines += [f"Checked {len(checks)} (ring size, rank, dtype, shape) cases: rings of "
                  f"{', '.join(str(k) for k in sorted({c['ring_size'] for c in checks}))} ranks, dtypes "
                  f"{', '.join(sorted({c['dtype'] for c in checks}))}; {len(checks) - len(bad)} pass "
                  f"(result within rounding of the exact sum, as dist.all_reduce's; bytes sent = formula). "
                  f"{sum(c['equal_to_library'] for c in checks)} are bitwise equal to dist.all_reduce "
                  f"(integers always; floats may differ in the last bits: another summation order).", "",
                  "Bytes each rank sent (float32, one awkward size):", "",
                  "| ring | numel | rank | sent (counted) | formula | 2(n-1)/n x S |", "|---|---|---|---|---|---|"]
        for c in checks:
            if c["dtype"] == "float32" and c["numel"] == 1001:
                lines.append(f"| {c['ring_size']} | {c['numel']} | {c['rank']} | {c['sent_bytes']} | "
                             f"{c['expected_sent_bytes']} | {c['two_n_minus_1_over_n_bytes']:.1f} |")
        lines.append("")
    if timings:
        lines += ["| size | ring time | ring busbw | dist.all_reduce time | dist.all_reduce busbw | ring / library |",
                  "|---|---|---|---|---|---|"]
        for r in timings:
            a, b = r["ring"], r["dist.all_reduce"]
            lines.append(f"| {fmt_size(r['bytes'])} | {a['time_s'] * 1e6:,.0f} us | {a['busbw_GBps']:.3f} GB/s | "
                         f"{b['time_s'] * 1e6:,.0f} us | {b['busbw_GBps']:.3f} GB/s | {a['time_s'] / b['time_s']:.2f}x |")
    return "\n".join(lines) + "\n"


def plot(timings: list[dict], path, title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sizes = [r["bytes"] for r in timings]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, style in (("ring", "o-"), ("dist.all_reduce", "s--")):
        ax1.plot(sizes, [r[name]["time_s"] * 1e6 for r in timings], style, label=name)
        ax2.plot(sizes, [r[name]["busbw_GBps"] for r in timings], style, label=name)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes[::2], [fmt_size(s) for s in sizes[::2]], rotation=30)
        ax.set_xlabel("message size")
        ax.grid(alpha=0.3)
        ax.legend()
    ax1.set_yscale("log")
    ax1.set_ylabel("time per all-reduce (us, slowest rank)")
    ax2.set_ylabel("bus bandwidth = S/t x 2(n-1)/n (GB/s)")
    fig.suptitle(title)
    save_figure(fig, path)
    plt.close(fig)


@main_guard
def main():
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (CUDA if present, else CPU), cpu or cuda")
    p.add_argument("--out", default="runs/ring_allreduce", help="output folder (default: %(default)s)")
    p.add_argument("--min-size", type=int, default=4096, help="smallest timed message in bytes (default: 4 KiB)")
    p.add_argument("--max-size", type=int, default=None,
                   help="largest timed message in bytes (default: 16 MiB on CPU, 256 MiB on CUDA)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per size, fewer for big ones (default: 20)")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="compare with dist.all_reduce and count bytes (default: on)")
    p.add_argument("--bench", action=argparse.BooleanOptionalAction, default=True,
                   help="time the ring beside dist.all_reduce (default: on)")
    args = p.parse_args()
    if args.iters < 1 or args.min_size < 4:
        raise UserError("--iters must be positive and --min-size at least 4 bytes.")
    check_message_size(args.max_size)
    with distributed(args.device) as ctx:
        require_launcher(ctx, "step3_multi_gpu/ring_allreduce.py")
        # CUDA path: no CPU test: a default size, nothing else differs; NCCL itself needs GPUs
        max_size = args.max_size or (256 * 2**20 if ctx.device.type == "cuda" else 16 * 2**20)
        if max_size < args.min_size:
            raise UserError(f"--max-size {max_size} is below --min-size {args.min_size}.")
        sizes = message_sizes(args.min_size, max_size, factor=4)
        checks = check(ctx) if args.check else []
        gathered = [None] * ctx.world_size
        dist.all_gather_object(gathered, checks)  # every rank's cases, for rank 0 to report
        checks = sorted((c for rank_rows in gathered for c in rank_rows),
                        key=lambda c: (c["ring_size"], c["dtype"], c["numel"], c["rank"]))
        timings = bench(ctx, sizes, args.iters) if args.bench else []
        if ctx.is_main:
            out = os.path.abspath(args.out)
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, "ring_allreduce.json"), "w") as f:
                json.dump({"world_size": ctx.world_size, "backend": ctx.backend, "device": ctx.device.type,
                           "checks": checks, "timings": timings}, f, indent=1)
            table = report(ctx, checks, timings, args)
            with open(os.path.join(out, "ring_allreduce.md"), "w") as f:
                f.write(table)
            print(table)
            if timings:
                plot(timings, os.path.join(out, "ring_vs_allreduce.png"),
                     f"Ring all-reduce from send/recv vs dist.all_reduce: {ctx.world_size} ranks, "
                     f"{ctx.backend} on {ctx.device.type}")
            failed = [c for c in checks if not c["ok"] or c["sent_bytes"] != c["expected_sent_bytes"]]
            if failed:
                print(f"FAILED: {len(failed)} cases, e.g. {failed[0]}", file=sys.stderr)
            print(f"outputs in {args.out}/")
        if checks and any(not c["ok"] or c["sent_bytes"] != c["expected_sent_bytes"] for c in checks):
            raise SystemExit(1)


if __name__ == "__main__":
    main()
