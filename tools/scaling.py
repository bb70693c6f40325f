"""Strong and weak scaling of DDP and FSDP: the same training on 1, 2 and 4 ranks.

    python -m tools.scaling                                   # DDP and FSDP, 1, 2, 4 ranks, small model
    python -m tools.scaling --ranks 1,2,4,8 --model 125m --global-batch-size 32 --seq-len 1024   # a GPU node

- **strong scaling**: the same global batch on N ranks (each rank gets 1/N of it). Ideal:
  the step takes 1/N of the time. Efficiency T1 / (N x TN).
- **weak scaling**: the same batch per rank (the global batch grows with N). Ideal: the
  step takes as long as on one rank. Efficiency T1 / TN.

Each point is one ``torchrun --nproc-per-node N`` launch of the real script with
``--profile``: its mean step time (untraced steps after the first), tokens/s, and the
share of the profiled steps' wall time that rank 0 spent in collectives. The table and
the figure go to ``--out`` (default runs/scaling): scaling.md, scaling.png, scaling.json.
Every flag it does not know is passed on to the training scripts (``--steps`` is 10
unless given). Each rank runs one thread (OMP_NUM_THREADS=1, unless set). On a CPU the ranks share
its cores, so efficiency falls with N for a reason a GPU node does not have; the same
command on a GPU node measures the network and the overlap instead.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import ROOT  # noqa: E402
from common.errors import UserError, main_guard  # noqa: E402
from common.figure_file import save_figure  # noqa: E402

SCRIPTS = {"ddp": "step3_multi_gpu/train_ddp.py", "fsdp": "step3_multi_gpu/train_fsdp.py"}


def efficiency(mode: str, n: int, t1: float, tn: float) -> float:
    """Strong: T1 / (N x TN); weak: T1 / TN. 1.0 is perfect scaling."""
    return t1 / (n * tn) if mode == "strong" else t1 / tn


def launch(strategy: str, n: int, batch: int, out: Path, rest: list[str], timeout: int) -> dict:
    """One torchrun job; its summary.json."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
           SCRIPTS[strategy], *rest, "--global-batch-size", str(batch), "--profile", "--no-trace-memory",
           "--eval-batches", "0", "--out", str(out)]
    print("$ " + " ".join(cmd[2:]), flush=True)
    # One thread a rank, also for one rank (torchrun sets it only from two up): on a CPU the
    # one-rank baseline would otherwise use every core, and the others share them.
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    if r.returncode:
        raise UserError(f"{SCRIPTS[strategy]} on {n} ranks failed (exit {r.returncode}): "
                        f"{(r.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads((out / "summary.json").read_text())


def point(strategy: str, mode: str, n: int, s: dict) -> dict:
    prof = (s.get("profile") or [{}])[0]
    wall = prof.get("wall_s")
    return {"strategy": strategy, "mode": mode, "ranks": n, "global_batch": s["global_batch_size"],
            "step_time_s": s["step_time_s"], "tokens_per_s": s["tokens_per_s"],
            "comm_share": prof["comm_s"] / wall if wall and n > 1 else 0.0}


def table(points: list[dict]) -> str:
    lines = ["| strategy | scaling | ranks | global batch | step time | tokens/s | efficiency | "
             "rank 0 in collectives |", "|---|---|---|---|---|---|---|---|"]
    for p in points:
        lines.append(f"| {p['strategy'].upper()} | {p['mode']} | {p['ranks']} | {p['global_batch']} | "
                     f"{p['step_time_s'] * 1e3:,.0f} ms | {p['tokens_per_s']:,.0f} | {p['efficiency']:.2f} | "
                     f"{p['comm_share']:.0%} |")
    return "\n".join(lines)


def plot(points: list[dict], path: Path, title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for ax, mode in zip(axes, ("strong", "weak")):
        for strategy in sorted({p["strategy"] for p in points}):
            pts = [p for p in points if p["mode"] == mode and p["strategy"] == strategy]
            ax.plot([p["ranks"] for p in pts], [p["efficiency"] for p in pts], "o-", label=strategy.upper())
        ranks = sorted({p["ranks"] for p in points})
        ax.axhline(1.0, color="grey", ls="--", lw=1, label="perfect")
        ax.set(xscale="log", xticks=ranks, xlabel="ranks", title=f"{mode} scaling: " +
               ("same global batch, T1 / (N x TN)" if mode == "strong" else "same batch per rank, T1 / TN"))
        ax.set_xticklabels([str(r) for r in ranks])
        ax.legend(fontsize=8)
    axes[0].set_ylabel("scaling efficiency")
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)
    plt.close(fig)


@main_guard
def main(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategies", default="ddp,fsdp", help="ddp, fsdp or both (default: ddp,fsdp)")
    p.add_argument("--ranks", default="1,2,4", help="the world sizes (default: 1,2,4)")
    p.add_argument("--global-batch-size", type=int, default=8,
                   help="strong scaling's global batch, weak scaling's batch on one rank (default: 8)")
    p.add_argument("--out", default=str(ROOT / "runs" / "scaling"))
    p.add_argument("--timeout", type=int, default=600, help="seconds for each launch (default: 600)")
    args, rest = p.parse_known_args(argv)
    if "--steps" not in rest:
        rest += ["--steps", "10"]  # the scripts' 100 is for learning, not for timing
    strategies = args.strategies.split(",")
    if not set(strategies) <= SCRIPTS.keys():
        raise UserError(f"--strategies {args.strategies}: choose from {', '.join(SCRIPTS)}.")
    try:
        ranks = sorted({int(r) for r in args.ranks.split(",")})
    except ValueError:
        raise UserError(f"--ranks {args.ranks}: give world sizes separated by commas, e.g. 1,2,4.") from None
    if ranks[0] != 1 or len(ranks) < 2:
        raise UserError(f"--ranks {args.ranks}: start at 1 (the baseline every efficiency divides by) and add "
                        f"at least one more.")
    b = args.global_batch_size
    bad = [n for n in ranks if b % n]
    if bad:
        raise UserError(f"--global-batch-size {b} does not split over {bad[0]} ranks for strong scaling; use a "
                        f"multiple of {max(ranks)}.")
    out = Path(args.out)
    points = []
    for strategy in strategies:
        one = launch(strategy, 1, b, out / f"{strategy}_1", rest, args.timeout)
        for mode in ("strong", "weak"):
            for n in ranks:
                s = one if n == 1 else launch(strategy, n, b if mode == "strong" else b * n,
                                              out / f"{strategy}_{mode}_{n}", rest, args.timeout)
                points.append(point(strategy, mode, n, s))
                points[-1]["efficiency"] = efficiency(mode, n, one["step_time_s"], s["step_time_s"])
    md = table(points)
    what = (f"{one['model']} model, {one['seq_len']} tokens a sequence, {one['dtype']}, on "
            f"{one['device_name']}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaling.json").write_text(json.dumps(points, indent=1))
    (out / "scaling.md").write_text(md + f"\n\nMeasured: {what}.\n")
    plot(points, out / "scaling.png", f"Scaling of {' and '.join(s.upper() for s in strategies)}: {what}")
    print(md + f"\n\nMeasured: {what}. Written to {out}/scaling.md, scaling.png, scaling.json", flush=True)
    return points


if __name__ == "__main__":
    main()
