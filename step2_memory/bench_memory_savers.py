"""Step 2's price list: the step time of each memory saver, measured side by side.

Runs made one after another on a shared machine see different loads, so their step times
cannot be compared. Here the set-ups live in one process and take turns, one step each,
in a new random order every round (common/measure/interleaved_bench.py); the fastest of each
set-up's steps is its time, since other jobs only ever add time.
    python step2_memory/bench_memory_savers.py --steps 6                (the chapter's table)
    python step2_memory/bench_memory_savers.py --steps 6 --speed-knobs  (eager, fused AdamW, compiled)
Writes bench.json and bench.md into --out.
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # find common/

import torch

from common import cli
from common.distributed import distributed
from common.errors import UserError, main_guard
from common.measure.interleaved_bench import interleaved, matmul_flops, memory_saver_step
from common.training import compile_unsupported

# The set-ups of the chapter's table, named like its runs (step2_memory/figures.py CHAPTER2).
SAVERS = {"baseline": {}, "amp": {"amp": "bf16"}, "amp_sac": {"amp": "bf16", "ac": "selective"},
          "amp_ac": {"amp": "bf16", "ac": "full"}, "accum_fp32": {"grad_accum": 4},
          "amp_ac_accum": {"amp": "bf16", "ac": "full", "grad_accum": 4}}
SPEED_KNOBS = {"eager": {"amp": "bf16"}, "fused_adamw": {"amp": "bf16", "fused_adamw": True},
               "compiled": {"amp": "bf16", "compile": True}}


@main_guard
def main():
    p = cli.parser(__doc__)
    g = p.add_argument_group("benchmark")
    g.add_argument("--speed-knobs", action="store_true",
                   help="time eager, --fused-adamw and --compile bf16 steps instead of the memory savers")
    g.add_argument("--threads", type=int, default=1,
                   help="CPU threads (default 1: on a busy machine a second OpenMP thread that is not "
                        "scheduled stalls every op, unevenly across set-ups)")
    args = cli.parse(p)
    cli.refuse_run_flags(args, "step2_memory/bench_memory_savers.py")
    if args.threads < 1:
        raise UserError(f"--threads must be at least 1 (got {args.threads}).")
    with distributed(args.device, timeout_s=args.pg_timeout) as ctx:
        if args.global_batch_size % 4:
            raise UserError(f"the accumulation set-ups split the batch in 4: use a --global-batch-size that "
                            f"4 divides (got {args.global_batch_size}).")
        setups = SPEED_KNOBS if args.speed_knobs else SAVERS
        if args.speed_knobs and (why := compile_unsupported(ctx.device)):
            raise UserError(why)
        if ctx.device.type == "cpu":
            torch.set_num_threads(args.threads)
        shape = (args.model, args.global_batch_size, args.seq_len, ctx.device)
        steps = {name: memory_saver_step(*shape, seed=args.seed, lr=args.lr, **kw) for name, kw in setups.items()}
        if args.speed_knobs:
            t = time.perf_counter()
            steps["compiled"]()  # compiles: minutes on a small CPU the first time, seconds once cached
            ctx.print(f"first compiled step: {time.perf_counter() - t:.1f} s")
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        result = interleaved(steps, rounds=args.steps)
        for name, step in steps.items():  # and what each set-up computes, recomputation included
            result[name]["matmul_flops"] = matmul_flops(step)
        tokens = args.global_batch_size * args.seq_len
        info = {"device": str(ctx.device), "threads": torch.get_num_threads() if ctx.device.type == "cpu" else None,
                "model": args.model, "global_batch_size": args.global_batch_size, "seq_len": args.seq_len,
                "rounds": args.steps, "load_before": load,
                "load_after": os.getloadavg()[0] if hasattr(os, "getloadavg") else None, "setups": setups}
        first = next(iter(result.values()))["min_s"]
        flops0 = next(iter(result.values()))["matmul_flops"]
        lines = ["| set-up | fastest step (ms) | median step (ms) | tokens/s (fastest) | vs first | matmul FLOPs vs first |",
                 "|---|---|---|---|---|---|"]
        for name, r in result.items():
            lines.append(f"| {name} | {r['min_s'] * 1e3:.0f} | {r['median_s'] * 1e3:.0f} | "
                         f"{tokens / r['min_s']:,.0f} | {r['min_s'] / first:.2f}x | {r['matmul_flops'] / flops0:.2f}x |")
        if ctx.is_main:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "bench.json").write_text(json.dumps({"info": info, "result": result}, indent=1))
            (args.out / "bench.md").write_text("\n".join(lines) + "\n")
        ctx.print("\n".join(lines))


if __name__ == "__main__":
    main()
