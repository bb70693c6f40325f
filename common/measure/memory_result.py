"""What a memory trace becomes once its steps are recorded: the timeline of live bytes per
category (``_timeline``), with what the CUDA allocator held beyond it (``_unseen``),
downsampled for the JSON and the figure (``_downsample``), and the files rank 0 writes
(``save``: the JSON, the figure, each rank's CUDA allocator snapshot).

``TraceResult`` is that half of ``MemoryTracer`` (common/measure/memory.py), which inherits
it: its methods read the records, phases and samples the tracer kept while recording.
"""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import torch.distributed as dist

from common.measure.memory_categories import CATEGORIES, EXTRA_CATEGORIES, UNSEEN
from common.measure.memory_figure import render


class TraceResult:
    """The result and output half of MemoryTracer (see the module notes)."""

    # ---- the result ---------------------------------------------------------------------
    def _timeline(self, end: int, allocator_peak) -> dict:
        n = end + 1
        cats = CATEGORIES + tuple(c for c in EXTRA_CATEGORIES if any(r.category == c for r in self._records))
        deltas = np.zeros((len(cats), n + 1), dtype=np.int64)
        host = np.zeros_like(deltas)  # the offloaded model state's share (a CPU run's), apart
        for rec in self._records:
            cat = rec.category or ("activations" if rec.activation else "other")
            i = cats.index(cat)
            for d in (deltas, host) if rec.host else (deltas,):
                d[i, rec.alloc] += rec.nbytes
                if rec.free is not None:
                    d[i, rec.free] -= rec.nbytes
        live = np.cumsum(deltas[:, :n], axis=1)
        total = live.sum(0)
        peak_at = int(total.argmax())
        # The model state when it is complete: the last optimizer step about to begin.
        opt_start = [t for t, ph in self.phases if ph == "optimizer"]
        before_opt = max(opt_start[-1] - 1, 0) if opt_start else None
        series = _downsample(live, peak_at, cats)
        unseen = self._unseen(total, series["event"])
        offloaded = None
        if self.offloaded_state:  # what the device holds: the trace less the host's share
            # CUDA path: no CPU test: a GPU run's trace follows the GPU's storages only, so the host's share is
            # never in it (host_in_trace False, and the walk's sum is all there is of it); the report's use of
            # either case is tests/test_estimate.py::test_report_holds_an_offloaded_run_to_the_device_and_the_host
            device = live - np.cumsum(host[:, :n], axis=1)
            offloaded = {"host_in_trace": self.device.type == "cpu", "host_before_optimizer": self._host_state,
                         "device_before_optimizer": None if before_opt is None else
                         {c: int(device[i, before_opt]) for i, c in enumerate(cats)},
                         "device_peak_by_category": {c: int(device[i].max()) for i, c in enumerate(cats)},
                         "device_peak_bytes": int(device.sum(0).max())}
        return {
            "device": str(self.device),
            "events": n,
            "peak_bytes": int(total[peak_at]),
            "peak_event": peak_at,
            "at_peak": {c: int(live[i, peak_at]) for i, c in enumerate(cats)},
            "peak_by_category": {c: int(live[i].max()) for i, c in enumerate(cats)},
            "before_optimizer": None if before_opt is None else
            {c: int(live[i, before_opt]) for i, c in enumerate(cats)},
            "allocator_peak_bytes": allocator_peak,
            "phases": self.phases,
            "steps": self.step_marks,
            "series": series | ({UNSEEN: unseen.pop("series")} if unseen else {}),
            **({"unseen": unseen} if unseen else {}),
            **({"offloaded": offloaded} if offloaded else {}),
        }

    def _unseen(self, total: np.ndarray, events: list[int]) -> dict | None:
        """CUDA: what the allocator held beyond the traced total at each event (memory the
        trace does not see: blocks alive before the window that are no parameter, gradient,
        optimizer state or buffer, communication buffers, a kernel's workspace...), with the
        part alive when the window began. None on a CPU (see _AllocatorView)."""
        view = self._allocator
        if view is None or view.start_bytes is None:
            return None
        n = len(total)
        held = np.full(n, -1, dtype=np.int64)
        held[0] = view.start_bytes
        for t, b in self._samples:
            if 0 <= t < n:
                held[t] = b
        have = np.where(held >= 0, np.arange(n), 0)
        held = held[np.maximum.accumulate(have)]  # each event: the newest reading at or before it
        gap = np.maximum(held - total, 0)
        return {"alive_before_bytes": max(view.start_bytes - self._seeded, 0), "at_peak": int(gap[int(total.argmax())]),
                "max_bytes": int(gap.max()), "series": gap[np.asarray(events)].tolist()}

    # ---- output -------------------------------------------------------------------------
    def save(self, out_dir, ctx, title: str, ymax: float | None = None, name: str = "memory_trace"):
        """Gather every rank's timeline to rank 0; write the figure and the JSON there.

        On CUDA each rank also writes its own allocator snapshot pickle.
        Returns the list of per-rank results on rank 0 (None elsewhere, or if nothing was
        recorded).
        """
        if not self.enabled:
            return None
        say = getattr(ctx, "print", print) if getattr(ctx, "is_main", True) else (lambda *_: None)
        last = self.start + self.steps - 1
        if self.active:  # the window reaches past the run's last step: keep the steps that ran
            done = [s for _, s in self.step_marks]
            self._end()
            say(f"memory trace: steps {self.start}-{last} were asked for (--trace-start {self.start}, --trace-steps "
                f"{self.steps}) but the run ended at step {done[-1]}; the trace holds step"
                f"{'s' if len(done) > 1 else ''} {', '.join(map(str, done))}.")
        elif self.result is None and not self.trained and self.first_step:  # (a --resume: past step 0)
            say(f"memory trace: nothing recorded, this run resumed at step {self.first_step}, past its last step "
                f"(--steps): it trained no step.")
        elif self.result is None and self.first_step is not None and self.first_step > last:
            # a --resume past the window: those steps ran, before the checkpoint it resumed from
            say(f"memory trace: nothing recorded, this run resumed at step {self.first_step}: steps "
                f"{self.start}-{last} (--trace-start, --trace-steps) ran before the resume; a --trace-start of "
                f"{self.first_step} or later traces a step of this run.")
        elif self.result is None:
            say(f"memory trace: nothing recorded, the run never reached step {self.start} (--trace-start); "
                f"lower --trace-start or train longer to see its memory.")
        out_dir = Path(out_dir)
        if self._cuda_snapshot is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            with open(out_dir / f"memory_snapshot_rank{ctx.rank}.pickle", "wb") as f:
                pickle.dump(self._cuda_snapshot, f)  # what torch.cuda.memory._dump_snapshot writes
            self._cuda_snapshot = None
        mine = dict(self.result or {}, rank=ctx.rank)
        if dist.is_initialized() and ctx.has_peers:
            gathered = [None] * ctx.world_size if ctx.is_main else None
            dist.gather_object(mine, gathered, dst=0)
        else:
            gathered = [mine]
        if not ctx.is_main:
            return None
        if any("series" not in g for g in gathered):
            return None  # the run ended before the recorded steps
        (out_dir / f"{name}.json").write_text(json.dumps(
            [{k: v for k, v in g.items() if k != "series"} | {"series": g["series"]} for g in gathered]))
        render(gathered, out_dir / f"{name}.png", title=title, ymax=ymax)
        return gathered


def _downsample(live: np.ndarray, peak_at: int, cats=CATEGORIES, max_points: int = 3000) -> dict:
    """At most max_points events, keeping each bucket's highest point and the peak."""
    n = live.shape[1]
    if n <= max_points:
        idx = np.arange(n)
    else:
        total = live.sum(0)
        edges = np.linspace(0, n, max_points + 1).astype(int)
        idx = np.array([a + int(total[a:b].argmax()) for a, b in zip(edges[:-1], edges[1:]) if b > a])
        idx = np.union1d(np.union1d(idx, [0, n - 1]), [peak_at])
    return {"event": idx.tolist(), **{c: live[i, idx].tolist() for i, c in enumerate(cats)}}
