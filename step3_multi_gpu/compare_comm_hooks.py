"""Gradient compression: the same DDP training once per communication hook, side by side.

    torchrun --nproc-per-node 4 step3_multi_gpu/compare_comm_hooks.py --model small --steps 60

DDP spends its communication on one thing: all-reducing 4 bytes of fp32 gradient per
parameter every step. A communication hook (common/parallelize/comm_hooks.py) changes what is sent:
fp16/bf16 send half, PowerSGD sends two thin rank-r matrices per weight matrix. This
script trains the model from the same seed on the same batches with each hook in turn,
counts the bytes DDP all-reduces at every step (common/measure/comm.py), checks them against
the formula, and draws loss and bytes per step for all hooks in one figure.

One training run uses one hook through the same flag: ``train_ddp.py --comm-hook fp16``.
Outputs in --out (default runs/compare_comm_hooks/): <hook>/metrics.jsonl and
summary.json per hook, comm_hooks.json, comm_hooks.md and comm_hooks.png.
"""
import copy
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # find common/

import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common import cli
from common.measure.bench import fmt_size
from common.measure.comm import CommCounter
from common.parallelize.comm_hooks import (BF16_REFUSED, add_comm_hook_flag, all_reduce_bytes, bf16_hook_supported,
                               check_comm_hook, powersgd_options, register_comm_hook)
from common.data import Batches, load_corpus
from common.distributed import distributed, require_launcher
from common.errors import main_guard
from common.measure.metrics import Metrics
from common.model import build_model
from common.training import adamw, evaluate, lr_schedule
from common.figure_file import save_figure


def train_with_hook(hook: str, args, ctx, corpus):
    """One DDP training run with ``hook``; returns its Metrics (rows and summary)."""
    model = build_model(args.model_config, ctx.device, seed=args.seed)
    model = DDP(model)
    register_comm_hook(model, hook, **powersgd_options(args))
    optimizer = adamw(model.parameters(), args)
    scheduler = lr_schedule(optimizer, args)
    batches = iter(Batches(corpus.train, args.seq_len, args.global_batch_size,
                           dp_rank=ctx.rank, dp_size=ctx.world_size, seed=args.seed))

    run_args = copy.copy(args)
    run_args.out, run_args.script = args.out / hook, f"{args.script} [{hook}]"
    metrics = Metrics(run_args, ctx, optimizer)
    start = args.powersgd_start_iter
    for step in metrics.progress():
        x, y = next(batches)
        x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
        with CommCounter() as comm:  # what DDP sends: gradient all-reduces (and a broadcast of buffers)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)  # each rank's loss is its share's mean; log the global mean
        expected = all_reduce_bytes(model.parameters(), hook, compressing=step >= start, **powersgd_options(args))
        metrics.log(step, global_loss / ctx.world_size, grad_bytes=comm.bytes.get("all_reduce", 0),
                    grad_calls=comm.calls.get("all_reduce", 0), expected_grad_bytes=expected,
                    buffer_bytes=comm.bytes.get("broadcast", 0))
        scheduler.step()

    val_loss = evaluate(model.module, corpus.val, args, ctx.device)
    steady = [r for r in metrics.rows if hook != "powersgd" or r["step"] >= start] or metrics.rows
    metrics.finish(val_loss=val_loss, comm_hook=hook,
                   grad_bytes_per_step=sum(r["grad_bytes"] for r in steady) / len(steady),
                   expected_grad_bytes_per_step=steady[-1]["expected_grad_bytes"])
    return metrics, val_loss


def report(results: dict, skipped: dict, args, ctx) -> tuple[str, dict]:
    n = ctx.world_size
    base = results.get("none")
    base_bytes = base[0].rows[0]["expected_grad_bytes"] if base else None
    lines = [f"### DDP communication hooks: {args.model} model, {n} ranks, {ctx.backend} on {ctx.device.type}, "
             f"{args.steps} steps, seed {args.seed}", "",
             "Bytes all-reduced per step (logical size S; each rank's link carries 2(n-1)/n x S = "
             f"{2 * (n - 1) / n:.3g} x S in a ring). PowerSGD: rank {args.powersgd_rank}, plain all-reduce "
             f"for the first {args.powersgd_start_iter} steps, the steps after are shown.", "",
             "| hook | bytes/step (measured) | formula | vs none | final loss | validation loss | step time |",
             "|---|---|---|---|---|---|---|"]
    table = {}
    for hook, (m, val) in results.items():
        start = args.powersgd_start_iter if hook == "powersgd" else 0
        steady = [r for r in m.rows if r["step"] >= start] or m.rows
        measured = sum(r["grad_bytes"] for r in steady) / len(steady)
        expected = steady[-1]["expected_grad_bytes"]
        times = [r["step_time_s"] for r in m.rows[1:]] or [m.rows[0]["step_time_s"]]
        table[hook] = {"bytes_per_step": measured, "expected_bytes_per_step": expected,
                       "reduction_vs_none": base_bytes / measured if base_bytes else None,
                       "final_loss": m.rows[-1]["loss"], "val_loss": val,
                       "step_time_s": sum(times) / len(times), "losses": [r["loss"] for r in m.rows],
                       "bytes": [r["grad_bytes"] for r in m.rows], "all_match": all(
                           r["grad_bytes"] == r["expected_grad_bytes"] for r in m.rows)}
        t = table[hook]
        lines.append(f"| {hook} | {fmt_size(measured)} ({measured:,.0f} B) | {expected:,} B | "
                     + (f"{t['reduction_vs_none']:.1f}x less" if base_bytes and hook != "none" else "1x")
                     + f" | {t['final_loss']:.4f} | " + (f"{val:.4f}" if val is not None else "-")
                     + f" | {t['step_time_s'] * 1e3:.0f} ms |")
    for hook, why in skipped.items():
        lines.append(f"| {hook} | not run: {why} | | | | | |")
    if results:
        m = next(iter(results.values()))[0]
        lines += ["", f"Not in the table: DDP also broadcasts the model's buffers from rank 0 before each forward "
                      f"(here the RoPE tables, {m.rows[-1]['buffer_bytes']:,} B); hooks do not touch that."]
    return "\n".join(lines) + "\n", table


def plot(table: dict, args, ctx, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.6))
    base = table.get("none")
    for hook, t in table.items():
        steps = range(len(t["losses"]))
        ax1.plot(steps, t["losses"], label=hook, lw=1.3)
        if base:  # the curves overlap at this scale: the difference shows what compression costs
            ax2.plot(steps, [a - b for a, b in zip(t["losses"], base["losses"])], label=hook, lw=1.3)
        ax3.step(steps, t["bytes"], where="mid", label=f"{hook}: {fmt_size(t['bytes_per_step'])}/step")
    if "powersgd" in table:
        for ax in (ax1, ax2, ax3):
            ax.axvline(args.powersgd_start_iter - 0.5, color="gray", ls=":", lw=1)
        ax3.text(args.powersgd_start_iter, 0.5, " PowerSGD starts\n compressing", color="gray", fontsize=8,
                 transform=ax3.get_xaxis_transform())
    ax1.set(xlabel="step", ylabel="training loss (global batch mean)", title="loss, same seed and batches")
    ax2.set(xlabel="step", ylabel="loss - loss without compression", title="what compression costs")
    ax3.set(xlabel="step", ylabel="bytes all-reduced per step (log)", yscale="log",
            title="gradient bytes per step (measured)")
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"DDP communication hooks: {args.model} model, {ctx.world_size} ranks, {ctx.backend}, "
                 f"PowerSGD rank {args.powersgd_rank}")
    save_figure(fig, path)
    plt.close(fig)


@main_guard
def main():
    p = cli.parser(__doc__)
    add_comm_hook_flag(p, several=True)
    p.set_defaults(trace_memory=False)  # memory is not this lesson: see the DDP chapter
    args = cli.parse(p)
    cli.refuse_run_flags(args, "step3_multi_gpu/compare_comm_hooks.py")
    with distributed(args.device, timeout_s=args.pg_timeout) as ctx:
        require_launcher(ctx, "step3_multi_gpu/compare_comm_hooks.py")
        # bf16 is in the default list but DDP refuses it on CPU-only builds: say so and go
        # on; any other problem stops the script before the first run, not after it.
        skipped = {"bf16": BF16_REFUSED} if "bf16" in args.comm_hooks and not bf16_hook_supported() else {}
        hooks = [h for h in args.comm_hooks if h not in skipped]
        for hook in hooks:
            check_comm_hook(hook, **powersgd_options(args))
        for why in skipped.values():
            ctx.print(f"skipping it: {why}")
        corpus = load_corpus(args.data, seed=args.seed, vocab_size=args.model_config.vocab_size)
        results = {hook: train_with_hook(hook, args, ctx, corpus) for hook in hooks}
        if ctx.is_main:
            md, table = report(results, skipped, args, ctx)
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "comm_hooks.md").write_text(md)
            (args.out / "comm_hooks.json").write_text(json.dumps(
                {"world_size": ctx.world_size, "backend": ctx.backend, "model": args.model, "steps": args.steps,
                 "powersgd": powersgd_options(args), "hooks": table, "skipped": skipped}, indent=1))
            if table:
                plot(table, args, ctx, args.out / "comm_hooks.png")
            print("\n" + md + f"outputs in {args.out}/")
            for hook, t in table.items():
                if not t["all_match"]:
                    print(f"warning: {hook}: the measured bytes differ from the formula at some steps", file=sys.stderr)


if __name__ == "__main__":
    main()
