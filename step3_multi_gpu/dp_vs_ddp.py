"""nn.DataParallel versus DistributedDataParallel: why one process per GPU wins.

    python step3_multi_gpu/dp_vs_ddp.py          (all visible GPUs; at least 2)

``nn.DataParallel`` (DP) is one process driving every GPU. Each step it
  1. scatters the batch from GPU 0 to the GPUs,
  2. replicates the model: copies every parameter from GPU 0 to each other GPU, every
     step again (the replicas are thrown away after the step),
  3. runs the replicas' forward passes in Python threads that share one interpreter
     lock, so one Python thread effectively launches the kernels of all GPUs,
  4. gathers every output onto GPU 0 and computes the loss there,
  5. in backward, sums all replicas' gradients onto GPU 0,
  6. steps the optimizer on GPU 0 alone.
GPU 0 is the hub of every copy and holds extra memory (all the logits, the optimizer
state); the others wait on it and on the single Python thread.

DDP runs one process per GPU (torchrun). Each process builds its replica once, owns an
optimizer, and its only traffic is the gradient all-reduce: 2(n-1)/n x 4 bytes per
parameter per GPU with a ring, in buckets that overlap the backward pass. No shared
interpreter, no hub GPU. PyTorch's own documentation recommends DDP over DP for this
reason, even on a single machine.

The script trains the same model from the same seed on the same global batches both
ways and compares throughput, per-GPU peak memory and the losses. It needs at least two
CUDA GPUs; elsewhere it says what it would show and exits. It starts the DDP half itself
with torchrun. Outputs in --out (default runs/dp_vs_ddp/): dp/ and ddp/ metrics and
dp_vs_ddp.json.
"""
import copy
import dataclasses
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # find common/

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common import cli
from common.data import Batches, load_corpus
from common.distributed import distributed
from common.errors import UserError, main_guard
from common.measure.byte_units import fmt_bytes
from common.measure.metrics import Metrics
from common.model import build_model, count_params
from common.training import adamw, lr_schedule


def traffic(args, n: int) -> dict:
    """Bytes per step over all of the node's links, from the shapes (fp32)."""
    weights = 4 * count_params(args.model_config)
    return {
        "weights": weights,
        "dp_replicate": (n - 1) * weights,   # GPU 0's weights to each other GPU, before every forward
        "dp_reduce": (n - 1) * weights,      # the replicas' gradients summed onto GPU 0
        "dp_gather_logits": 4 * args.global_batch_size * args.seq_len * args.model_config.vocab_size * (n - 1) // n,
        "ddp_per_gpu": 2 * (n - 1) * weights // n,  # ring all-reduce of the gradients
        "ddp_total": 2 * (n - 1) * weights,
    }


def explain(args, found: str, n: int = 4) -> str:
    t = traffic(args, n)
    b = fmt_bytes
    return f"""dp_vs_ddp compares nn.DataParallel with DDP on 2 or more CUDA GPUs; {found}, so there is nothing to time here.

What it would show, for the {args.model} model ({count_params(args.model_config) / 1e6:.1f}M parameters, \
W = {b(t['weights'])} of fp32 weights) on n = {n} GPUs, global batch {args.global_batch_size} x {args.seq_len} tokens.
Bytes per step, summed over the links:

  nn.DataParallel: one process; a Python thread per GPU, all under one interpreter lock, launches their work.
    copy the weights from GPU 0 to the other GPUs, before the forward:  (n-1) W = {b(t['dp_replicate'])}
    sum the replicas' gradients onto GPU 0, after the backward:          (n-1) W = {b(t['dp_reduce'])}
    gather the logits onto GPU 0 to compute the loss:                     {b(t['dp_gather_logits'])}
    then GPU 0 alone steps the optimizer (and alone holds its 8 bytes per parameter).
  DDP: one process per GPU, each with its own replica (made once) and optimizer.
    ring all-reduce of the gradients, in buckets during the backward:   2(n-1) W = {b(t['ddp_total'])}
    ({b(t['ddp_per_gpu'])} = 2(n-1)/n W sent by each GPU)

  About the same bytes; what differs is who moves them and when. DP funnels every copy
  through GPU 0, does them before and after the compute instead of during it, and drives
  all GPUs from threads under one interpreter lock; DDP overlaps its all-reduce with the backward pass and
  has no hub. Expected: the same losses (same seed, same global batches), more tokens/s with
  DDP, and a higher peak memory on DP's GPU 0 than on its other GPUs, where DDP's are even.
  (These are expectations: this machine cannot measure them.)

On a machine with several GPUs:  python step3_multi_gpu/dp_vs_ddp.py --model 125m --global-batch-size 32
For data parallelism that runs here, see train_ddp.py:  torchrun --nproc-per-node 4 step3_multi_gpu/train_ddp.py
"""


def train_dp(args, n: int) -> dict:
    """nn.DataParallel in this process over GPUs 0..n-1."""
    with distributed("cuda", timeout_s=args.pg_timeout) as ctx:  # one process: world size 1, GPU 0
        corpus = load_corpus(args.data, seed=args.seed, vocab_size=args.model_config.vocab_size)
        batches = iter(Batches(corpus.train, args.seq_len, args.global_batch_size, seed=args.seed))
        model = build_model(args.model_config, ctx.device, seed=args.seed)
        model = nn.DataParallel(model, device_ids=list(range(n)))  # output_device: GPU 0
        optimizer = adamw(model.parameters(), args)
        scheduler = lr_schedule(optimizer, args)
        run_args = copy.copy(args)
        run_args.out, run_args.script = args.out / "dp", "DataParallel"
        # world_size=n: Metrics' MFU divides by the GPUs in use, and DP uses n of them
        metrics = Metrics(run_args, dataclasses.replace(ctx, world_size=n), optimizer,
                          parallel={"dp (nn.DataParallel)": n})
        for i in range(n):
            torch.cuda.reset_peak_memory_stats(i)
        for step in metrics.progress():
            x, y = next(batches)  # the whole global batch, on GPU 0: DP scatters it
            x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
            logits = model(x)  # gathered onto GPU 0
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            metrics.log(step, loss)
            scheduler.step()
        summary = metrics.finish()
        return {**_brief(summary), "losses": [r["loss"] for r in metrics.rows],
                "peak_mem_per_gpu": [torch.cuda.max_memory_allocated(i) for i in range(n)]}


def train_ddp(args) -> None:
    """DDP, one process per GPU; started by torchrun (see main)."""
    with distributed("cuda", timeout_s=args.pg_timeout) as ctx:
        corpus = load_corpus(args.data, seed=args.seed, vocab_size=args.model_config.vocab_size)
        batches = iter(Batches(corpus.train, args.seq_len, args.global_batch_size,
                               dp_rank=ctx.rank, dp_size=ctx.world_size, seed=args.seed))
        model = build_model(args.model_config, ctx.device, seed=args.seed)
        model = DDP(model, device_ids=[ctx.local_rank])
        optimizer = adamw(model.parameters(), args)
        scheduler = lr_schedule(optimizer, args)
        run_args = copy.copy(args)
        run_args.out, run_args.script = args.out / "ddp", "DDP"
        metrics = Metrics(run_args, ctx, optimizer)
        torch.cuda.reset_peak_memory_stats(ctx.device)
        for step in metrics.progress():
            x, y = next(batches)  # this rank's share of the global batch
            x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            global_loss = loss.detach().clone()
            dist.all_reduce(global_loss)
            metrics.log(step, global_loss / ctx.world_size)
            scheduler.step()
        peaks = [None] * ctx.world_size
        dist.all_gather_object(peaks, torch.cuda.max_memory_allocated(ctx.device))
        summary = metrics.finish()
        if ctx.is_main:
            result = {**_brief(summary), "losses": [r["loss"] for r in metrics.rows], "peak_mem_per_gpu": peaks}
            (args.out / "ddp.json").write_text(json.dumps(result))


def _brief(summary: dict) -> dict:
    return {k: summary[k] for k in ("tokens_per_s", "step_time_s", "final_loss", "mfu")}


def compare(dp: dict, ddp: dict, n: int) -> str:
    b = fmt_bytes
    dloss = max(abs(a - c) for a, c in zip(dp["losses"], ddp["losses"]))
    rows = [("tokens/s", f"{dp['tokens_per_s']:,.0f}", f"{ddp['tokens_per_s']:,.0f}"),
            ("ms per step", f"{dp['step_time_s'] * 1e3:.1f}", f"{ddp['step_time_s'] * 1e3:.1f}"),
            ("peak memory GPU 0", b(dp["peak_mem_per_gpu"][0]), b(ddp["peak_mem_per_gpu"][0])),
            (f"peak memory GPUs 1-{n - 1} (max)", b(max(dp["peak_mem_per_gpu"][1:])), b(max(ddp["peak_mem_per_gpu"][1:]))),
            ("final loss", f"{dp['final_loss']:.4f}", f"{ddp['final_loss']:.4f}")]
    lines = [f"| {n} GPUs | nn.DataParallel | DDP |", "|---|---|---|"] + [f"| {a} | {c} | {d} |" for a, c, d in rows]
    return ("\n".join(lines) + f"\n\nDDP / DP throughput: {ddp['tokens_per_s'] / dp['tokens_per_s']:.2f}x; "
            f"largest loss difference over the steps: {dloss:.2e}\n")


@main_guard
def main():
    p = cli.parser(__doc__)
    p.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all visible)")
    p.set_defaults(trace_memory=False, steps=30)
    args = cli.parse(p)
    cli.refuse_run_flags(args, "step3_multi_gpu/dp_vs_ddp.py")
    args.script = "dp_vs_ddp"
    if args.gpus is not None and args.gpus < 2:  # checked first: the CPU explanation would use it
        raise UserError(f"--gpus {args.gpus}: the comparison needs at least 2 GPUs.")
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    # CUDA path: no CPU test: nn.DataParallel runs on GPUs only; the script refuses a CPU in one sentence
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.device == "cpu" or visible < 2:
        found = "this run is on CPU" if args.device == "cpu" else (
            "no CUDA GPU is visible" if visible == 0 else "only 1 CUDA GPU is visible")
        if int(os.environ.get("RANK", 0)) == 0:
            print(explain(args, found, n=args.gpus or 4), flush=True)
        return
    if launched:  # the DDP half, started below
        train_ddp(args)
        return
    n = args.gpus or visible
    if not 2 <= n <= visible:
        raise UserError(f"--gpus {n}: choose between 2 and {visible}, the GPUs visible here.")
    if args.global_batch_size % n:
        raise UserError(f"--global-batch-size {args.global_batch_size} does not split over {n} GPUs; "
                        f"use a multiple of {n}.")
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"nn.DataParallel on {n} GPUs, one process:", flush=True)
    dp = train_dp(args, n)
    print(f"\nDDP on {n} GPUs, {n} processes (torchrun):", flush=True)
    (args.out / "ddp.json").unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           os.path.abspath(__file__), *sys.argv[1:], "--out", str(args.out)]
    if subprocess.run(cmd).returncode != 0:  # ranks 0..n-1 take GPUs 0..n-1, the ones DP used
        raise UserError("the DDP run failed (its error is above).")
    ddp = json.loads((args.out / "ddp.json").read_text())
    table = compare(dp, ddp, n)
    (args.out / "dp_vs_ddp.json").write_text(json.dumps({"gpus": n, "dp": dp, "ddp": ddp}, indent=1))
    (args.out / "dp_vs_ddp.md").write_text(table)
    print("\n" + table, flush=True)


if __name__ == "__main__":
    main()
