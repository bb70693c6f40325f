"""Throughput, MFU, peak memory, the progress bar and the files a run leaves behind.

Outputs in ``--out`` (rank 0 writes them; every rank's numbers are in them):
- ``metrics.jsonl``: one line per optimizer step: step, loss (the global-batch mean),
  lr, step_time_s, tokens_per_s, peak_mem_bytes (+ its source), mfu where known, traced;
- ``summary.json``: the run in one object, including per-rank peak memory by category;
- with ``--tensorboard``, ``tensorboard/``: the numbers of metrics.jsonl as TensorBoard
  scalars under the same names (``tensorboard --logdir runs`` shows every run's), and
  each rank's peak memory by category at the end.
"""
from __future__ import annotations

import json
import os
import resource
import time

import torch
from tqdm import tqdm

from common.cli import saver_label, tensorboard_writer
from common.errors import UserError
from common.measure import syncs
from common.measure.byte_units import fmt_bytes
from common.measure.syncs import HostCopy
from common.model import count_params, flops_per_token

# Dense (no sparsity: half the sheet's "with sparsity" figure) peak FLOP/s per GPU, from the
# vendor's data sheets, by the exact name CUDA reports. Not by substring: an "H100 NVL" or an
# "H200 NVL" (835 TFLOP/s bf16) would pass for an SXM part (989) and read 15% low. fp32 is the
# plain CUDA-core rate; tf32 applies to fp32 matmuls only when TF32 is switched on.
_A100 = ("A100 data sheet", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12})
_H100_SXM = ("H100 SXM data sheet", {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12})
_NVL = {"bf16": 835e12, "fp16": 835e12, "tf32": 417.5e12, "fp32": 60e12}
PEAK_FLOPS = {
    "NVIDIA A100-SXM4-40GB": _A100, "NVIDIA A100-SXM4-80GB": _A100,
    "NVIDIA A100-PCIE-40GB": _A100, "NVIDIA A100 80GB PCIe": _A100,
    "NVIDIA H100 80GB HBM3": _H100_SXM,
    "NVIDIA H100 PCIe": ("H100 PCIe data sheet", {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51e12}),
    "NVIDIA H100 NVL": ("H100 NVL data sheet", _NVL),
    "NVIDIA H200": ("H200 SXM data sheet", _H100_SXM[1]),
    "NVIDIA H200 NVL": ("H200 NVL data sheet", _NVL),
}


def peak_flops(device: torch.device, dtype: str) -> tuple[float | None, str, str | None]:
    """(peak FLOP/s, device name, where the peak comes from); (None, name, None) where we do
    not know the device's peak."""
    # CUDA path: tests/test_cuda_paths.py::test_peak_flops_by_gpu_name
    if device.type != "cuda":
        return None, cpu_name(), None
    name = torch.cuda.get_device_name(device)
    if dtype == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        dtype = "tf32"
    if name not in PEAK_FLOPS:
        return None, name, None
    sheet, peaks = PEAK_FLOPS[name]
    return peaks[dtype], name, f"{peaks[dtype] / 1e12:,.1f} TFLOP/s, {dtype} dense, {sheet}".replace(".0 TFLOP", " TFLOP")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"CPU ({line.split(':', 1)[1].strip()})"
    except OSError:
        pass
    return "CPU"


# What --tensorboard draws of each metrics.jsonl row, under the same names.
SCALARS = ("loss", "val_loss", "grad_norm", "lr", "tokens_per_s", "step_time_s", "data_wait_s", "mfu", "peak_mem_bytes")


def peak_memory(device: torch.device) -> tuple[int, str]:
    """The step's peak memory: the CUDA allocator's, or the process's peak RSS on CPU."""
    # CUDA path: no CPU test: the CUDA allocator's peak; a CPU reports the process's peak RSS
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_memory_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "cpu_peak_rss"


class Metrics:
    def __init__(self, args, ctx, optimizer=None, parallel: dict | None = None, dtype: str = "fp32",
                 n_params: int | None = None):
        self.args, self.ctx, self.optimizer, self.dtype = args, ctx, optimizer, dtype
        self.cfg = args.model_config
        self.parallel = parallel or {"dp": ctx.world_size}
        self.n_params = n_params or count_params(self.cfg)
        self.tokens_per_step = args.global_batch_size * args.seq_len
        self.flops_per_step = flops_per_token(self.cfg, args.seq_len) * self.tokens_per_step
        self.peak, self.device_name, self.peak_source = peak_flops(ctx.device, dtype)
        self.rows: list[dict] = []
        self.bar = None
        self._t = None  # the previous step's end (see _write)
        self._pending = None  # (row, HostCopy, end) of the step whose numbers are not read yet
        self._jsonl = None
        self.last_val = None  # (step, val_loss) of the newest evaluation during training
        # --tensorboard (cli.parse has checked for the package): rank 0 writes
        self._tb_class = tensorboard_writer() if getattr(args, "tensorboard", False) else None
        self._tb = None

    def progress(self, start: int = 0):
        """Step numbers start..steps-1, with a progress bar on rank 0 only.

        A resumed run (start > 0) keeps the lines of the steps before ``start`` in
        metrics.jsonl and drops the later ones, which it is about to redo.
        """
        if self.ctx.is_main:
            self.args.out.mkdir(parents=True, exist_ok=True)
            path = self.args.out / "metrics.jsonl"
            kept = []
            if start > 0 and path.exists():
                kept = [line for line in self._read_lines(path) if json.loads(line)["step"] < start]
                self.rows = [json.loads(line) for line in kept]
            if start < self.args.steps:
                # summary.json is written last, so it says "this run is complete" (--resume refuses
                # such a run): one left by an earlier run into this --out goes now
                (self.args.out / "summary.json").unlink(missing_ok=True)
            # The kept lines go to a new file that replaces the old one whole: a run killed right
            # after its restart (before its first row) must not leave the log truncated.
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, path)
            self._jsonl = open(path, "a")
            if self._tb_class is not None:
                # The event files are rewritten like metrics.jsonl: an earlier run's into this
                # --out go (TensorBoard would draw both), a resumed run writes the kept rows again.
                folder = self.args.out / "tensorboard"
                for old in folder.glob("events.out.tfevents.*"):
                    old.unlink()
                self._tb = self._tb_class(log_dir=str(folder))
                for row in self.rows:
                    self._scalars(row)
        logged = self.rows
        if start >= self.args.steps and not self.ctx.is_main:  # every rank: they must agree on val_loss
            logged = [json.loads(line) for line in self._read_lines(self.args.out / "metrics.jsonl")]
        if logged:  # a run resumed after its last step (only its outputs to write): what it had logged
            self.last_loss = logged[-1]["loss"]
            self.last_val = next(((r["step"], r["val_loss"]) for r in reversed(logged) if "val_loss" in r), None)
        self.bar = tqdm(range(start, self.args.steps), disable=not self.ctx.is_main, desc=self.args.script,
                        unit="step", dynamic_ncols=True, initial=start, total=self.args.steps)
        self._start()
        return self._marked(self.bar)

    @staticmethod
    def _marked(bar):
        for step in bar:
            syncs.step_begins(step)  # for a SyncCounter, if one is open
            yield step
        syncs.step_begins(None)

    def _read_lines(self, path) -> list[str]:
        """metrics.jsonl's complete lines. A run killed while writing leaves its last line
        torn: that line is dropped (its step is redone anyway), and said so; a damaged line
        before it is a damaged file, named in one sentence."""
        from common.errors import UserError
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        for i, line in enumerate(lines):
            try:
                json.loads(line)
            except json.JSONDecodeError:
                if i < len(lines) - 1:
                    raise UserError(f"{path} line {i + 1} is not JSON (a damaged file); move the file aside "
                                    f"to resume without the earlier steps' metrics.") from None
                self.ctx.print(f"{path}: dropped a torn last line (a run killed while writing it)")
                return lines[:-1]
        return lines

    # CUDA path: no CPU test: the CUDA allocator's peak statistics and events exist only with a GPU;
    # tools/gpu_check.py runs them
    def _start(self):
        if self.ctx.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.ctx.device)
        self._t = self._now()

    def _now(self):
        """A point on the clock the step times are read from: an event queued on the GPU, or the host's time."""
        # CUDA path: no CPU test: CUDA's events exist only with a GPU; tools/gpu_check.py times with them
        if self.ctx.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def log(self, step: int, loss: torch.Tensor | float, traced: bool = False, now: bool = False,
            hold: bool = False, **extra) -> list[dict]:
        """Record one optimizer step (call it before the LR scheduler steps); return the rows
        that became known, in step order.

        ``loss`` must already be the global-batch mean. One step late: this step's loss (and
        every tensor in ``extra``, such as grad_norm) is copied to the host without waiting,
        and the previous step's numbers are read, which waits for the previous step only,
        while the GPU works on this one. Asking for this step's value now (``.item()``)
        would leave the GPU idle while the host queues the next step. ``now``: read this
        step's numbers as well (a checkpoint must not save a step whose loss is not finite);
        the last step's are always read at once.

        ``hold``: an evaluation follows (``evaluated``): this step's row waits for its
        ``val_loss`` and is written there."""
        tensors = {k: v for k, v in {"loss": loss, **extra}.items() if isinstance(v, torch.Tensor)}
        copy = HostCopy(tensors, self.ctx.device)
        # Where this step's work ends: the event after it, or on a CPU, which has done the work, now
        end = copy.event if copy.event is not None else time.perf_counter()
        mem, mem_source = peak_memory(self.ctx.device)  # the allocator's, kept on the host: no wait
        lr = self.optimizer.param_groups[0]["lr"] if self.optimizer is not None else None
        # The tensors' places are kept (for the order of the keys) but not the tensors themselves
        row = {"step": step, "loss": None if "loss" in tensors else float(loss), "lr": lr, "step_time_s": None,
               "tokens_per_s": None, "peak_mem_bytes": mem, "peak_mem_source": mem_source, "traced": traced,
               **{k: None if k in tensors else v for k, v in extra.items()}}
        done = [self._write(*self._pending)] if self._pending else []
        self._pending = (row, copy, end)
        if (now or step == self.args.steps - 1) and not hold:
            done.append(self._write(row, copy, end))
            self._pending = None
        self._reset_peak()
        return done

    def evaluated(self, step: int, evaluate) -> list[dict]:
        """After ``log(step, hold=True)``: ``evaluate()``, the held-out loss, is this step's
        ``val_loss``. It runs after this step's end was taken and before the next step's clock
        starts, and the peak memory is reset after it: its time and memory count in no step.
        It reads its loss on the host anyway, so this step's numbers are read at once too."""
        row, copy, end = self._pending
        val = evaluate()
        if val is not None:
            row["val_loss"] = val
            self.last_val = (step, val)
        resume = self._now()
        done = [self._write(row, copy, end)]
        self._pending = None
        self._t = resume  # the next step starts after the evaluation
        self._reset_peak()
        return done

    def _reset_peak(self):
        # CUDA path: no CPU test: the CUDA allocator's peak statistics exist only with a GPU
        if self.ctx.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.ctx.device)

    def _write(self, row: dict, copy: HostCopy, end) -> dict:
        """A step's row, once its numbers have reached the host: metrics.jsonl, the bar."""
        row |= copy.values()
        # The step time: from the end of the previous step's work to the end of this one's,
        # both taken at the same point, where the step is logged: on a GPU the device's
        # clock at the events that follow each step's work (so it counts any time the GPU
        # waited for the host), on a CPU the host's clock there.
        dt = end - self._t if isinstance(end, float) else self._t.elapsed_time(end) / 1e3
        self._t = end
        row["step_time_s"], row["tokens_per_s"] = dt, self.tokens_per_step / dt
        if self.peak:
            row["mfu"] = self.flops_per_step / dt / (self.peak * self.ctx.world_size)
        self.rows.append(row)
        self.last_loss = row["loss"]
        if self.ctx.is_main:
            self._jsonl.write(json.dumps(row) + "\n")
            self._jsonl.flush()
            norm = {"grad_norm": f"{row['grad_norm']:.3f}"} if "grad_norm" in row else {}
            val = {"val_loss": f"{self.last_val[1]:.3f}"} if self.last_val else {}  # the newest measured
            self.bar.set_postfix(loss=f"{row['loss']:.3f}", **val, **norm, tok_s=f"{row['tokens_per_s']:,.0f}",
                                 refresh=False)
            self._scalars(row)
        return row

    def _scalars(self, row: dict):
        """--tensorboard: a row's numbers as scalars named as in metrics.jsonl, at its step."""
        if self._tb is None:
            return
        for key in SCALARS:
            if row.get(key) is not None:
                self._tb.add_scalar(key, row[key], row["step"])
        self._tb.flush()  # like metrics.jsonl's line: on disk as the step ends

    def flush(self) -> list[dict]:
        """The row still waiting for its numbers, if any (a loop left before its last step)."""
        done = [self._write(*self._pending)] if self._pending else []
        self._pending = None
        return done

    def throughput(self) -> tuple[float, float]:
        """Mean step time and tokens/s, leaving out the first step (warm-up) and traced steps."""
        rows = self._steady()
        dt = sum(r["step_time_s"] for r in rows) / len(rows)
        return dt, self.tokens_per_step / dt

    def _steady(self) -> list[dict]:
        return [r for r in self.rows[1:] if not r["traced"]] or self.rows

    def data_wait(self, dt: float) -> dict | None:
        """The loop's wait for batches over the same steps as the throughput: seconds a step
        and the share of the step time (None: the script's loader reports none). The host's
        time in next(): on a GPU, which runs ahead of the host, a wait shorter than the
        device's step is hidden behind it, so what the GPU lost is at most this share."""
        rows = [r for r in self._steady() if r.get("data_wait_s") is not None]
        if not rows:
            return None
        wait = sum(r["data_wait_s"] for r in rows) / len(rows)
        return {"data_wait_s": wait, "data_wait_share": wait / dt}

    def finish(self, memory: list[dict] | None = None, val_loss: float | None = None, said: tuple = (),
               **extra) -> dict | None:
        """Write summary.json and print the end-of-run table (rank 0), then the lines ``said``
        (the formulas beside the measurement), then where the outputs are."""
        self.flush()
        if self.bar is not None:
            self.bar.close()
        if not self.ctx.is_main:
            return None
        self._jsonl.close()
        dt, tps = self.throughput()
        summary = {
            "script": self.args.script, "model": self.args.model, "model_config": self.cfg.as_dict(),
            "world_size": self.ctx.world_size, "parallel": self.parallel, "device": str(self.ctx.device),
            "device_name": self.device_name, "backend": self.ctx.backend, "dtype": self.dtype,
            "n_params": self.n_params, "steps": self.args.steps,
            "global_batch_size": self.args.global_batch_size, "seq_len": self.args.seq_len,
            # what else makes two runs' numbers differ (tools/compare.py names it)
            "savers": saver_label(self.args), **{k: getattr(self.args, k, None) for k in ("lr", "seed")},
            "data": None if getattr(self.args, "data", None) is None else str(self.args.data),
            "first_loss": self.rows[0]["loss"], "final_loss": self.rows[-1]["loss"], "val_loss": val_loss,
            "step_time_s": dt, "tokens_per_s": tps, **(self.data_wait(dt) or {}),
            **({"grad_norm": {"first": self.rows[0]["grad_norm"], "final": self.rows[-1]["grad_norm"],
                              "max": max(r.get("grad_norm", 0.0) for r in self.rows)}} if "grad_norm" in self.rows[0] else {}),
            "mfu": self.flops_per_step / dt / (self.peak * self.ctx.world_size) if self.peak else None,
            "peak_flops": self.peak, "peak_flops_source": self.peak_source,
            "flops_per_token": flops_per_token(self.cfg, self.args.seq_len),
            "peak_mem_bytes": max(r["peak_mem_bytes"] for r in self.rows),
            "peak_mem_source": self.rows[-1]["peak_mem_source"],
            "memory": [{"rank": m["rank"], "peak_bytes": m["peak_bytes"], "at_peak": m["at_peak"],
                        "peak_by_category": m["peak_by_category"],
                        "allocator_peak_bytes": m["allocator_peak_bytes"], "unseen": m.get("unseen"),
                        "allocator_reserved_bytes": m.get("allocator_reserved_bytes"),
                        "allocator_collective_bytes": m.get("allocator_collective_bytes"),
                        "allocator_unseen_at_peak": m.get("allocator_unseen_at_peak"),
                        "before_optimizer": m.get("before_optimizer")} for m in memory or []],
            **extra,
        }
        (self.args.out / "summary.json").write_text(json.dumps(summary, indent=2))
        if self._tb is not None:  # the peak of each category, per rank, at the last step
            last = self.rows[-1]["step"]
            for m in summary["memory"]:
                for category, nbytes in m["peak_by_category"].items():
                    self._tb.add_scalar(f"peak_mem_bytes/rank{m['rank']}/{category.replace(' ', '_')}", nbytes, last)
            if val_loss is not None and "val_loss" not in self.rows[-1]:  # measured after the loop
                self._tb.add_scalar("val_loss", val_loss, last)
            self._tb.close()
        self._print_table(summary, said)
        return summary

    def _print_table(self, s: dict, said=()):
        lines = [
            ("model", f"{s['model']} ({s['n_params'] / 1e6:.2f}M parameters)"),
            ("device", (f"{s['device_name']}, one process" if s["world_size"] == 1 else
                        f"{s['device_name']} x {s['world_size']} ranks ({s['backend']})") + f", {s['dtype']}"),
            ("loss", f"{s['first_loss']:.3f} -> {s['final_loss']:.3f}"
                     + (f" (validation {s['val_loss']:.3f})" if s["val_loss"] is not None else "")),
            ("throughput", f"{s['tokens_per_s']:,.0f} tokens/s, {s['step_time_s'] * 1e3:.1f} ms/step"),
            *([("data wait", f"{s['data_wait_s'] * 1e3:.2f} ms/step in the loader ({s['data_wait_share']:.2%} of the "
                              f"step time)")] if "data_wait_s" in s else []),
            ("MFU", f"{s['mfu']:.1%} of {s['peak_flops_source']}" if s["mfu"] else
             f"n/a (no known peak FLOP/s for {s['device_name']})"),
            # a CPU run's speed depends on it: each process's threads share the cores with every
            # other process's (step 1's page says what to set)
            ("CPU threads", f"{torch.get_num_threads()} a process (OMP_NUM_THREADS or torch.set_num_threads)"),
        ]
        for m in s["memory"]:
            who = f"rank {m['rank']} " if len(s["memory"]) > 1 else ""
            lines.append((f"{who}peak memory", f"{fmt_bytes(m['peak_bytes'])}, made of " + " + ".join(
                f"{c} {fmt_bytes(b)}" for c, b in m["at_peak"].items() if b) + " at that moment"))
            if m["allocator_peak_bytes"]:
                unseen = m.get("allocator_unseen_at_peak") or {}
                why = (", the allocator's peak holds " + ", ".join(
                    f"{fmt_bytes(b)} made inside {op}" for op, b in sorted(unseen["by_op"].items(), key=lambda kv: -kv[1])[:3])
                    + " that no op returned") if unseen.get("bytes") else ""
                lines.append((f"{who}allocator peak", f"{fmt_bytes(m['allocator_peak_bytes'])} (traced / allocator "
                              f"{m['peak_bytes'] / m['allocator_peak_bytes']:.3f}{why})"))
            if m.get("allocator_collective_bytes"):  # (CPU: see common/measure/allocator_count.py, _AllocatorView)
                lines.append((f"{who}gloo's own buffers", f"up to {fmt_bytes(m['allocator_collective_bytes'])} a "
                              "collective, outside the trace and the allocator peak (NCCL keeps its own outside PyTorch's allocator)"))
            if m.get("unseen"):
                lines.append((f"{who}not seen by the trace", f"{fmt_bytes(m['unseen']['max_bytes'])} at most, "
                              f"{fmt_bytes(m['unseen']['alive_before_bytes'])} of it alive before the step"))
        width = max(len(k) for k, _ in lines)
        print("\n".join(f"  {k:<{width}}  {v}" for k, v in lines), flush=True)
        for line in said:
            print(line, flush=True)
        print(f"  outputs in {os.path.relpath(self.args.out)}/", flush=True)  # from where you are
