"""The step-time model held to this machine: predicted beside measured, layout by layout.

    python -m tools.bench_plan
    python -m tools.bench_plan --ranks 2 --model small --seq-len 256 --global-batch-size 16 --steps 8

For each rank count, one torchrun job (tools/multirun.py) calibrates this machine
(``python -m tools.plan --calibrate``'s worker: our model's block, forward and backward, timed at
every layout's per-rank shape (tp-way narrow heads and MLP, a micro-batch's sequences) on one
core while the other cores time too, each timing repeated and its median kept; memory
bandwidth; the all-reduce's bandwidth and latency over gloo with the communication lab's code,
every rank at once), then trains DDP, ZeRO-1, FSDP, TP, PP (1F1B) and 2-D for a few steps with
the real step-3 scripts, then calibrates again: the model uses the mean of the two, and the
table says how far they drifted apart. Measured: the median of each run's steps after the
first two (metrics.jsonl). Printed: predicted and measured milliseconds, their ratio, the
predicted terms, and the Spearman rank correlation of the two orders (the target: every
layout within 25%, correlation >= 0.8). Writes runs/bench_plan/bench_plan.{json,md}.

A benchmark, not a test: on a shared machine other processes slow the runs (and the
calibration) by different amounts; read the ratios with that in mind.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.errors import UserError, main_guard  # noqa: E402
from common.measure.cpuload import OtherLoad  # noqa: E402
from common.measure.machines import load_calibration  # noqa: E402
from common.measure.steptime import ALL_TERMS, step_time  # noqa: E402
from common.measure.plan import Plan  # noqa: E402
from common.model import get_config  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
S3 = "step3_multi_gpu/"


def layouts(world: int) -> list[tuple[str, str, list[str], dict]]:
    """(name, script, its flags, the Plan's arguments) of each measured layout."""
    tp = 2
    return [("ddp", S3 + "train_ddp.py", [], {"strategy": "ddp"}),
            ("zero1", S3 + "train_ddp.py", ["--zero1"], {"strategy": "zero1"}),
            ("fsdp", S3 + "train_fsdp.py", [], {"strategy": "fsdp_zero3"}),
            ("tp", S3 + "train_tp.py", [], {"strategy": "tp"}),
            ("pp 1f1b", S3 + "train_pp.py", ["--schedule", "1f1b", "--microbatches", str(world)],
             {"strategy": "pp", "schedule": "1f1b", "microbatches": world}),
            (f"2d tp={tp}", S3 + "train_2d.py", ["--tp", str(tp)], {"strategy": "2d", "tp": tp})]


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        for pos, i in enumerate(order):
            r[i] = pos
        return r
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def fmt_cores(c: float | None) -> str:
    return "?" if c is None else f"{c:.1f}"


def plans(world: int, args, cfg) -> list[Plan]:
    return [Plan(cfg, world=world, batch=args.global_batch_size, seq_len=args.seq_len, dtype="fp32", **kw)
            for _, _, _, kw in layouts(world)]


def measure(world: int, args, out: Path, shapes: list[tuple[int, int]]) -> tuple[list[float], list[Path]]:
    """One torchrun job: calibrate (tools/plan.py's worker: our block at every layout's per-rank
    shape, one core's rate, each timing repeated and its median kept; memory bandwidth; the
    all-reduce's bandwidth and latency over gloo, every rank at once), train each layout, and
    calibrate again, so the drift of the machine's load over the job shows. Returns each
    layout's measured step time (the median of its steps after the first two: the calibration
    keeps medians too) and the two calibrations."""
    flags = ["--model", args.model, "--seq-len", str(args.seq_len), "--global-batch-size", str(args.global_batch_size),
             "--steps", str(args.steps), "--amp", "off", "--no-trace-memory", "--eval-batches", "0",
             "--data", "synthetic", "--device", "cpu"]
    cals = [out / f"calibration_{world}_{when}.json" for when in ("before", "after")]

    def calibrate(path):
        return {"name": f"calibrate ({path.stem})", "script": "tools/plan.py",
                "argv": ["--calibrate-worker", "--model", args.model, "--seq-len", str(args.seq_len),
                         "--global-batch-size", str(args.global_batch_size), "--device", "cpu",
                         "--shapes", json.dumps(sorted(set(shapes))), "--repeats", str(args.repeats), "--out", str(path)]}
    runs = [calibrate(cals[0])]
    for name, script, extra, _ in layouts(world):
        tag = f"{world}_{name.replace(' ', '_').replace('=', '')}"
        runs.append({"name": name, "script": script, "argv": [*flags, *extra, "--out", str(out / tag)]})
    runs.append(calibrate(cals[1]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "tools/multirun.py", "--runs", json.dumps(runs)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    load = OtherLoad(proc.pid)  # the cores the machine's other processes take meanwhile
    _, err = proc.communicate()
    load.stop()
    if proc.returncode:
        raise UserError(f"the {world}-rank job stopped: {(err.strip().splitlines() or ['?'])[-1]}")
    # each run's window: from the previous one's last write to its own (metrics.jsonl, the calibration)
    ends = [cals[0].stat().st_mtime] + [(Path(r["argv"][-1]) / "metrics.jsonl").stat().st_mtime
                                        for r in runs[1:-1]] + [cals[1].stat().st_mtime]
    others = [load.cores(t0, t1) for t0, t1 in zip([start, *ends[:-1]], ends)]
    measured = []
    for run in runs[1:-1]:
        rows = [json.loads(line) for line in (Path(run["argv"][-1]) / "metrics.jsonl").read_text().splitlines()]
        measured.append(statistics.median([x["step_time_s"] for x in rows if x.get("step_time_s")][2:]))
    return measured, cals, others


def machine_of(cals: list[Path]):
    """The machine both calibrations describe: each measured rate (and bandwidth, latency) the
    mean of the two medians. Also returns, per shape, its spread: the range of every repeat
    of both calibrations over the mean."""
    from dataclasses import replace

    from common.measure.machines import Link
    cs = [json.loads(c.read_text()) for c in cals]
    ms = [load_calibration(c) for c in cals]

    def mean(xs):
        return sum(xs) / len(xs)
    rates = {k: mean([m.shape_rates[k] for m in ms]) for k in ms[0].shape_rates}
    spread = {k: (min(c["shapes_flops"][k]["min"] for c in cs), max(c["shapes_flops"][k]["max"] for c in cs))
              for k in rates}  # FLOP/s: the lowest and the highest of every repeat
    link = Link(mean([m.intra.bandwidth for m in ms]), mean([m.intra.latency for m in ms]), ms[0].intra.source)
    m = replace(ms[0], shape_rates=rates, intra=link, inter=link, hbm=mean([m.hbm for m in ms]),
                adamw_s_per_param=mean([m.adamw_s_per_param for m in ms]),
                dtensor_s_per_block=mean([m.dtensor_s_per_block for m in ms]),
                calibrated_rate={k: mean([m.calibrated_rate[k] for m in ms]) for k in ms[0].calibrated_rate})
    drift = {k: ms[1].shape_rates[k] / ms[0].shape_rates[k] for k in rates}
    return m, spread, drift


@main_guard
def main(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m tools.bench_plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="2,4", help="rank counts to measure, comma-separated (default: 2,4)")
    p.add_argument("--model", default="small", help="model preset (default: small)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default: 256)")
    p.add_argument("--global-batch-size", type=int, default=16, help="sequences a step (default: 16)")
    p.add_argument("--steps", type=int, default=8, help="steps each run trains; the first two are not timed (default: 8)")
    p.add_argument("--repeats", type=int, default=7, help="timings of each calibrated shape (default: 7)")
    p.add_argument("--out", default="runs/bench_plan", help="output folder (default: runs/bench_plan)")
    args = p.parse_args(argv)
    try:
        worlds = [int(w) for w in args.ranks.split(",")]
    except ValueError:
        worlds = []
    if not worlds or min(worlds) < 2:
        raise UserError(f"--ranks {args.ranks!r}: give comma-separated rank counts of 2 or more, e.g. 2,4.")
    if args.repeats < 3:
        raise UserError(f"--repeats must be at least 3 (a median of fewer says little; got {args.repeats}).")
    if args.steps < 4:
        raise UserError(f"--steps must be at least 4 (the first two are warm-up; got {args.steps}).")
    from common.measure.machines import shape_key
    from common.measure.steptime import rank_shape
    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cfg = get_config(args.model)
    results, notes = [], []
    for world in worlds:
        ps = plans(world, args, cfg)
        seconds, cals, others = measure(world, args, out, [rank_shape(p) for p in ps])
        machine, spread, drift = machine_of(cals)
        notes.append(f"{world} ranks on {machine.units} cores (other processes took {fmt_cores(others[0])} cores "
                     f"during the first calibration, {fmt_cores(others[-1])} during the second): " + "; ".join(
            f"{k}: {machine.shape_rates[k] / 1e9:.1f} GFLOP/s (repeats {spread[k][0] / 1e9:.1f}-"
            f"{spread[k][1] / 1e9:.1f}, after/before {drift[k]:.2f})" for k in sorted(machine.shape_rates))
            + f"; AdamW (with clipping, zeroing) {machine.adamw_s_per_param * 1e9:.1f} ns a parameter"
            + f"; DTensor {machine.dtensor_s_per_block * 1e3:.1f} ms a block"
            + f"; all-reduce busbw {machine.intra.bandwidth / 1e9:.2f} GB/s, latency {machine.intra.latency * 1e6:,.0f} us")
        print("  " + notes[-1], flush=True)
        for (name, _, _, _), plan, s, busy in zip(layouts(world), ps, seconds, others[1:-1]):
            t = step_time(plan, machine)
            key = shape_key("fp32", *rank_shape(plan))
            results.append({"layout": name, "ranks": world, "predicted_s": t["step"], "measured_s": s,
                            "shape": key, "gflops": machine.shape_rates[key] / 1e9,
                            "busbw_GBps": machine.intra.bandwidth / 1e9, "latency_us": machine.intra.latency * 1e6,
                            "others_cores": busy,
                            **{k: t[k] for k in ALL_TERMS}})
            print(f"  {name} on {world}: predicted {t['step'] * 1e3:,.0f} ms, measured {s * 1e3:,.0f} ms", flush=True)
    rho = spearman([r["predicted_s"] for r in results], [r["measured_s"] for r in results])
    from common.measure.metrics import cpu_name
    lines = [f"model {args.model}, batch {args.global_batch_size} x {args.seq_len}, fp32, gloo, on {cpu_name()} "
             f"({os.cpu_count()} cores, shared); each rank count calibrated before and after its layouts ran "
             f"(our block at each layout's per-rank shape, one core's rate, median of {args.repeats} repeats; "
             f"the all-reduce's busbw and latency), the mean of the two used; measured: the median step; 'cores others took': the "
             f"cores the machine's other processes used during each run (/proc, common/measure/cpuload.py)", "",
             "| layout | ranks | block GFLOP/s at its shape (tp, sequences) | predicted ms | measured ms | "
             "measured / predicted | " + " | ".join(ALL_TERMS) + " | cores others took |",
             "|" + "---|" * (7 + len(ALL_TERMS))]
    for r in results:
        tp, seqs = r["shape"].split()[1:]
        lines.append(f"| {r['layout']} | {r['ranks']} | {r['gflops']:.1f} ({tp}, {seqs}) | "
                     f"{r['predicted_s'] * 1e3:,.0f} | {r['measured_s'] * 1e3:,.0f} | "
                     f"{r['measured_s'] / r['predicted_s']:.2f} | "
                     + " | ".join(f"{r[k] * 1e3:,.0f}" for k in ALL_TERMS) + f" | {fmt_cores(r['others_cores'])} |")
    within = sum(abs(r["measured_s"] / r["predicted_s"] - 1) <= 0.25 for r in results)
    lines += ["", *[f"calibration, {n}" for n in notes], "",
              f"within 25%: {within} of {len(results)}; Spearman rank correlation of the orders: {rho:.2f} "
              f"(targets: all, and >= 0.8)"]
    text = "\n".join(lines)
    print("\n" + text)
    (out / "bench_plan.md").write_text(text + "\n")
    (out / "bench_plan.json").write_text(json.dumps({"results": results, "spearman": rho, "within_25": within,
                                                     "calibration": notes}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
