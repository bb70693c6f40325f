"""How long a checkpoint stalls training: synchronous vs --ckpt-async, in one run.

    python -m tools.bench_ckpt                      # 125m model, CPU or the GPU at hand
    python -m tools.bench_ckpt --model 1b --device cuda

Runs step1_single_gpu/train.py twice in this process (plain python, one rank):
``--ckpt-every K`` and ``--ckpt-every K --ckpt-async``, and reads their metrics.jsonl. A
checkpoint is saved after step K-1 has been logged, so its cost shows in the step time of
step K (metrics.jsonl times each step from the previous step's log). Printed, per run: the
median step with no checkpoint before it, the median step after one, and how long the
background writes took (summary.json's ``ckpt_write_s``). The model is
large and the batch small on purpose: the state (12 bytes a parameter) is what is written.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file

from common.errors import UserError, main_guard  # noqa: E402
from common.measure.byte_units import fmt_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--model", default="125m", help="model preset (default: 125m, 1.4 GiB of checkpoint state)")
    p.add_argument("--steps", type=int, default=8, help="steps per run (default: 8)")
    p.add_argument("--ckpt-every", type=int, default=3, help="checkpoint every K steps (default: 3)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default: auto)")
    p.add_argument("--out", default="runs/bench_ckpt", help="folder for the three runs (default: runs/bench_ckpt)")
    a = p.parse_args(argv)
    if a.ckpt_every < 2 or a.steps < a.ckpt_every + 2:
        raise UserError(f"--ckpt-every {a.ckpt_every} --steps {a.steps}: give --ckpt-every 2 or more and at least "
                        f"--ckpt-every + 2 steps, so that a step after a checkpoint is timed.")
    return a


def run(a, name: str, extra: list[str]) -> tuple[list[dict], dict]:
    import importlib.util
    path = ROOT / "step1_single_gpu" / "train.py"
    spec = importlib.util.spec_from_file_location("bench_ckpt_train", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = Path(a.out) / name
    import shutil
    shutil.rmtree(out, ignore_errors=True)
    argv = ["--model", a.model, "--steps", str(a.steps), "--seq-len", "32", "--global-batch-size", "1",
            "--no-trace-memory", "--eval-batches", "0", "--device", a.device, "--data", "synthetic",
            "--out", str(out), *extra]
    err, saved = io.StringIO(), sys.argv
    sys.argv = [str(path), *argv]  # the script parses sys.argv
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            module.main()
        except SystemExit as e:
            if e.code:
                raise UserError(f"the {name} run failed: {(err.getvalue().strip().splitlines() or ['?'])[-1]}")
        finally:
            sys.argv = saved
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows, json.loads((out / "summary.json").read_text())


@main_guard
def main(argv=None):
    a = parse(argv)
    k = a.ckpt_every
    after = [s for s in range(k, a.steps) if s % k == 0]  # the steps right after a checkpoint
    runs = {"synchronous": run(a, "sync", ["--ckpt-every", str(k)]),
            "asynchronous (--ckpt-async)": run(a, "async", ["--ckpt-every", str(k), "--ckpt-async"])}
    (rows, summary) = runs["asynchronous (--ckpt-async)"]
    print(f"{a.model} ({summary['n_params'] / 1e6:.0f}M parameters) on {summary['device_name']}, one rank; a "
          f"checkpoint every {k} steps, {fmt_bytes(summary['ckpt_staging_bytes'])} of state each")
    print("| checkpoints | step without a checkpoint before it (median) | step after a checkpoint (median) | "
          "the stall |\n|---|---|---|---|")
    for name, (rows, _) in runs.items():
        # Within one run, so that a machine busy with something else slows both alike; step 0 warms up.
        plain = statistics.median(r["step_time_s"] for r in rows[1:] if r["step"] not in after)
        stalled = statistics.median(rows[s]["step_time_s"] for s in after)
        print(f"| {name} | {plain * 1e3:,.0f} ms | {stalled * 1e3:,.0f} ms | {(stalled - plain) * 1e3:+,.0f} ms "
              f"({stalled / plain:.2f}x) |")
    print(f"The background writes took {', '.join(f'{w:.1f} s' for w in summary['ckpt_write_s'])} (training went "
          f"on beside each but the last, the final checkpoint's); the host copy held {fmt_bytes(summary['ckpt_staging_bytes'])}. Losses equal in both runs: "
          f"{[r['loss'] for r in runs['synchronous'][0]] == [r['loss'] for r in rows]}.")


if __name__ == "__main__":
    main()
