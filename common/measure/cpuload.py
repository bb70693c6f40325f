"""How many of a machine's cores other processes took while a job of ours ran (Linux /proc).

A benchmark on a shared CPU is slowed by whatever else runs; this says by how much, so a
table can print it beside each measurement: a thread samples the machine's busy CPU time
(/proc/stat) and our process tree's (/proc/<pid>/stat of the launcher and its descendants);
between two moments, (machine's busy - ours) / wall time = the cores the others used.
Where /proc is missing (not Linux) it reports nothing (None).
"""
from __future__ import annotations

import os
import threading
import time

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def machine_busy_s() -> float | None:
    """Seconds of CPU time all cores spent busy since boot (/proc/stat's first line)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
    return (sum(v[:8]) - idle) / TICK  # user nice system idle iowait irq softirq steal


def tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system) of ``root`` and every live descendant."""
    parent, cpu = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        parent[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / TICK  # utime, stime
    total = 0.0
    for pid, t in cpu.items():
        p, seen = pid, 0
        while p and p != root and seen < 64:
            p, seen = parent.get(p, 0), seen + 1
        if p == root:
            total += t
    return total


class OtherLoad:
    """Samples in a thread, every ``every`` seconds, until ``stop()``; ``cores(t0, t1)``: the
    cores other processes used between two wall-clock moments (time.time())."""

    def __init__(self, root: int, every: float = 0.5):
        self.root, self.every, self.samples = root, every, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        if machine_busy_s() is not None:
            self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            self.samples.append((time.time(), machine_busy_s(), tree_cpu_s(self.root)))
            self._stop.wait(self.every)

    def stop(self):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def cores(self, t0: float, t1: float) -> float | None:
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2:
            return None
        (a, busy_a, ours_a), (b, busy_b, ours_b) = inside[0], inside[-1]
        # our tree's time can only grow; a rank's exit would take its time away: never below 0
        return max(0.0, ((busy_b - busy_a) - max(0.0, ours_b - ours_a)) / (b - a))
