"""``--profile``: where a step's time goes, and how much communication hides under compute.

``torch.profiler`` records the last ``PROFILED_STEPS`` steps of a run that are neither
memory-traced nor byte-counted (both run under a dispatch mode that slows every op and
would distort the timing), and writes one Chrome trace per rank to
``<out>/profile/trace_rank<r>.json`` (open it at ui.perfetto.dev). From the same events:

- **compute**: on CPU, the top-level ops of the training thread; on CUDA, the kernels
  that are not NCCL's;
- **communication**: on CPU, gloo's collectives, which run on gloo's own worker threads
  (``gloo:all_reduce`` ...); on CUDA, NCCL's kernels on their own streams;
- **overlapped**: the communication time during which compute was also running. DDP's
  bucketed all-reduces start while backward still runs, FSDP prefetches the next
  block's all-gather: the overlapped fraction says how much of that really hid.

One figure per run, ``<out>/profile_timeline.png``: each rank's compute and
communication on one time line, the overlapped fraction in the title. On a CPU, the
collectives' threads compete with the compute threads for the same cores, so "overlap"
there is two things running at once, not free communication; on a GPU the NCCL streams
run beside the compute stream for real.
"""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

PROFILED_STEPS = 2
_COMM_PREFIXES = ("gloo:", "nccl:", "ncclDevKernel", "ncclKernel")


def profile_steps(args, busy) -> list[int]:
    """The steps to profile: the last PROFILED_STEPS for which ``busy(step)`` (traced or
    counted) is False, never the first (warm-up). Empty when there are none."""
    free = [s for s in range(1, args.steps) if not busy(s)]
    return free[-PROFILED_STEPS:]


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(xs, ys) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def intervals_from_trace(events: list[dict], main_tid) -> dict:
    """Compute and communication intervals (µs, unions) from a Chrome trace's events."""
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in spans if e.get("cat") == "kernel"]
    if kernels:  # CUDA: what the GPU ran, NCCL's kernels against the others. Not the host's
        # "nccl:all_reduce" spans: those time the launch on the CPU, beside the GPU's work,
        # and counted as communication they would look overlapped with every kernel.
        comm = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if e["name"].startswith(_COMM_PREFIXES)]
        compute = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if not e["name"].startswith(_COMM_PREFIXES)]
    else:  # CPU: the training thread's ops, but not its waits on (or launches of) collectives
        comm = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e["name"].startswith(_COMM_PREFIXES)]
        ops = sorted((e for e in spans if e.get("tid") == main_tid and e.get("cat") == "cpu_op"
                      and not e["name"].startswith(("c10d::", "record_param_comms", *_COMM_PREFIXES))),
                     key=lambda e: e["ts"])
        compute = [(e["ts"], e["ts"] + e["dur"]) for e in ops]
    return {"compute": _union(compute), "comm": _union(comm)}


def overlap(iv: dict) -> dict:
    comm, both = _length(iv["comm"]), _length(_intersection(iv["compute"], iv["comm"]))
    return {"compute_s": _length(iv["compute"]) / 1e6, "comm_s": comm / 1e6, "overlapped_s": both / 1e6,
            "overlapped_fraction": both / comm if comm else None}


class Profile:
    """torch.profiler over the chosen steps; ``save`` writes the traces, figure and numbers."""

    def __init__(self, steps: list[int], device: torch.device, enabled: bool):
        self.steps, self.device, self.enabled = steps, device, enabled
        self.prof = None
        self.wall_s = 0.0  # the profiled window's wall time, first step's start to last step's end

    @contextlib.contextmanager
    def record(self, step: int):
        if not (self.enabled and step in self.steps):
            yield
            return
        if step == self.steps[0]:
            # CUDA path: no CPU test: CUDA's runtime (events, synchronize) does not exist on a CPU;
            # tools/gpu_check.py runs it
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.__enter__()
            self._t0 = time.perf_counter()
        with torch.profiler.record_function(f"step {step}"):
            yield
        if step == self.steps[-1]:
            # CUDA path: no CPU test: CUDA's synchronize does not exist on a CPU
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            # the whole window, the logging between the steps included (its loss all-reduce too)
            self.wall_s = time.perf_counter() - self._t0
            self.prof.__exit__(None, None, None)

    def save(self, out_dir: Path, ctx, title: str) -> list[dict] | None:
        """Every rank writes its trace; rank 0 draws the figure. Returns per-rank numbers (rank 0)."""
        if not self.enabled or self.prof is None:
            return None
        import threading
        folder = Path(out_dir) / "profile"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"trace_rank{ctx.rank}.json"
        self.prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
        mine = {"rank": ctx.rank, "wall_s": self.wall_s, **intervals_from_trace(events, threading.get_native_id())}
        if ctx.has_peers:
            everyone = [None] * ctx.world_size if ctx.is_main else None
            dist.gather_object(mine, everyone, dst=0)
        else:
            everyone = [mine]
        if not ctx.is_main:
            return None
        numbers = [{"rank": r["rank"], "wall_s": r["wall_s"], **overlap(r)} for r in everyone]
        draw(everyone, numbers, Path(out_dir) / "profile_timeline.png", title)
        return numbers


def draw(everyone: list[dict], numbers: list[dict], path: Path, title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min([a for r in everyone for a, _ in r["compute"] + r["comm"]] or [0.0])
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.9 * len(everyone)))
    for i, (r, n) in enumerate(zip(everyone, numbers)):
        y = (len(everyone) - 1 - i) * 2
        for lane, key, color in ((y + 1, "compute", "#4C72B0"), (y, "comm", "#DD8452")):
            ax.broken_barh([((a - t0) / 1e3, (b - a) / 1e3) for a, b in r[key]], (lane + 0.1, 0.8), color=color)
        frac = n["overlapped_fraction"]
        ax.text(1.005, (y + 1) / (2 * len(everyone)), f"rank {r['rank']}: " +
                (f"{frac:.0%} of {n['comm_s'] * 1e3:.0f} ms\ncommunication overlapped" if frac is not None
                 else "no communication"), transform=ax.transAxes, va="center", fontsize=8)
    ax.set_yticks([y + 0.5 for i in range(len(everyone)) for y in ((len(everyone) - 1 - i) * 2,
                                                                    (len(everyone) - 1 - i) * 2 + 1)])
    ax.set_yticklabels([lab for r in everyone for lab in (f"rank {r['rank']} comm", f"rank {r['rank']} compute")])
    ax.set_xlabel("time (ms) over the profiled steps")
    ax.set_title(title, fontsize=9)
    from common.figure_file import save_figure
    save_figure(fig, path)
    plt.close(fig)
