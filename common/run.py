"""A run's bookkeeping in one object, so that a training script shows only its lesson.

    run = Run(args, ctx, model, optimizer, scheduler, data, strategy="ddp", title="DDP",
              evaluate=lambda: evaluate(model, corpus.val, args, ctx.device))
    run.resume()                      # --resume: the newest checkpoint's state; the step to start at
    for step in run.steps():          # a progress bar, from that step
        with run.step(step):          # memory trace and communication count of this step
            ...forward, backward, optimizer.step()...
        run.log(step, loss)           # metrics.jsonl (one step late), the NaN check
        scheduler.step()              # the next step's learning rate
        run.evaluate_if_due(step)     # the held-out loss every --eval-every steps and after the last
        run.save_if_due(step)         # --ckpt-every; a stop signal: every rank saves this step, then stops
    run.finish()                      # validation loss, figure, summary.json, predicted vs measured, bytes

What it drives, each living in its own module:
- ``Checkpointer`` (common/checkpoint.py; its stop signals in common/checkpoint_signals.py): ``--resume``,
  ``--ckpt-every``, ``--ckpt-async``, ``--on-nan``,
  and preemption (SIGTERM/SIGUSR1: every rank saves one agreed step, then exits 75);
- ``MemoryTracer`` (common/measure/memory.py): the categorised timeline of a few steps;
- ``CommCounter`` (common/measure/comm.py): bytes by collective, per optimizer step;
- ``Metrics`` (common/measure/metrics.py): step time, tokens/s, MFU, the files in --out;
- ``StepCollector`` (common/measure/step_gc.py): Python's cycle collector before every step, and
  the tensors it found (none, unless something keeps a step's tensors in a reference cycle);
- ``theory.report`` (common/measure/theory.py): the formulas beside the measurement.
"""
from __future__ import annotations

import contextlib
import math
import sys
from pathlib import Path

import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from common import cli
from common.checkpoint import Checkpointer, skip_nonfinite_step
from common.data import pins_for
from common.distributed import launch_hint
from common.errors import UserError
from common.measure import theory
from common.measure.byte_units import fmt_bytes
from common.measure.comm import CommCounter, print_comm
from common.measure.memory import MemoryTracer
from common.measure.metrics import Metrics
from common.measure.profile import Profile, profile_steps
from common.measure.step_gc import StepCollector
from common.run_folder import lock_out, unlock_out
from common.training import optimizer_kernels
from common.weights import save_full_weights


class Run:
    """``models``: one module, or a list (a pipeline rank's stages). ``strategy``: the
    name theory.py predicts for (None: no prediction). ``predict``: the extra keyword
    arguments of that prediction (shard, microbatches, ...); dtype, ac and accum come from
    the saver flags (--amp, --ac, --grad-accum) unless given. ``fsdp``: let the tracer
    see FSDP's gathered parameters. ``sources``: optimizer state the tracer cannot find
    by itself (ZeRO-1's inner optimizer). ``checkpoints=False``: this script's state cannot be
    saved by common/checkpoint.py (DeepSpeed's engine); a stop signal stops every rank at one
    step, unsaved, exit 75. ``evaluate``: the held-out loss of the model as it
    is now (a float, the same on every rank, which all call it together), or None; Run calls
    it every --eval-every steps and once at the end."""

    def __init__(self, args, ctx, models, optimizer, scheduler=None, data=None, *, strategy: str | None,
                 title: str, parallel: dict | None = None, dtype: str | None = None, predict: dict | None = None,
                 fsdp: bool = False, sources=(), ckpt_optimizer=None, evaluate=None, checkpoints: bool = True):
        self.args, self.ctx, self.scheduler, self.evaluate = args, ctx, scheduler, evaluate
        dtype = dtype or getattr(args, "compute_dtype", "fp32")
        self.strategy = strategy
        self.lesson = title  # the strategy alone, for summary.json
        self.title = ", ".join(filter(None, [title, cli.saver_label(args)]))
        # which AdamW kernels a step runs (foreach holds temporaries: the formula counts them)
        self.optimizer_kernels = optimizer_kernels(optimizer)
        self.predict = {"dtype": dtype, "ac": getattr(args, "ac", "none"), "ac_every": getattr(args, "ac_every", 1),
                        "accum": getattr(args, "grad_accum", 1), "optimizer": self.optimizer_kernels,
                        "loss_chunks": getattr(args, "loss_chunks", 1),
                        "split_root": getattr(args, "split_root_unit", False), **(predict or {})}
        self.parallel = parallel or {"dp": ctx.world_size}
        self.models = list(models) if isinstance(models, (list, tuple)) else [models]
        script = Path(sys.argv[0])
        if script.parent.name == "step3_multi_gpu":  # a multi-GPU lesson run by plain python: one rank
            launch_hint(ctx, f"{script.parent.name}/{script.name}")
        self.lock = lock_out(args, ctx)  # one live run per --out
        skip_nonfinite_step(optimizer, ctx, enabled=args.on_nan == "skip")  # --on-nan skip
        # A part is what shares one optimizer: several pipeline stages, saved by parameter name.
        part = self.models if len(self.models) > 1 else self.models[0]
        if data is not None:  # a CUDA run's batches in pinned memory, for the copy that does not wait
            data.pin_memory = pins_for(ctx.device)
        self.data, self._waited = data, None  # the loader's wait_s, read around each step
        self.ckpt = Checkpointer(args, ctx, [(part, ckpt_optimizer or optimizer)], scheduler, data,
                                 parallel=self.parallel, can_save=checkpoints)
        self._setup = (part, optimizer, fsdp, sources, dtype)
        self.start, self._saved_up_to = None, None

    def resume(self) -> int:
        """With --resume, load the newest checkpoint of --out (the model, the optimizer, the
        LR schedule, where the data was) and return the step after it; else 0. Then set up what
        depends on where the run starts: the stop signals, the memory tracer, the counters."""
        if self.start is not None:
            raise RuntimeError("run.resume() is called once, before run.steps()")
        args, ctx = self.args, self.ctx
        (part, optimizer, fsdp, sources, dtype), self._setup = self._setup, None
        self.start = self.ckpt.resume()  # 0, or the step after the newest checkpoint with --resume
        # A checkpoint's optimizer brings its parameter groups, and with them the kernels it ran
        # (fused or foreach): what runs now may not be what the flags asked for.
        ran = optimizer_kernels(optimizer)
        if ran != self.optimizer_kernels:
            ctx.print(f"AdamW runs its {ran} kernels, as the checkpoint's optimizer did, not the {self.optimizer_kernels} "
                      f"ones this run's flags ask for (--fused-adamw): a resumed optimizer keeps its kernels.")
            self.optimizer_kernels = self.predict["optimizer"] = ran
        self.ckpt.listen()  # SIGTERM/SIGUSR1 (a cluster taking the nodes back): save one agreed step, stop
        self.tracer = MemoryTracer(part, optimizer, ctx.device, enabled=args.trace_memory,
                                   start=args.trace_start, steps=args.trace_steps, sources=sources)
        self.tracer.first_step = self.start  # where this run starts (its first step, if it trains one)
        if self.tracer.enabled:  # --ckpt-async's host copy, when its checkpoint step is in the traced window
            self.ckpt.on_staged = self.tracer.staged
        if fsdp:
            from common.parallelize.fsdp import trace_fsdp_memory
            for m in self.models:
                trace_fsdp_memory(self.tracer, m)  # FSDP's gathered weights count as parameters
        self.metrics = Metrics(args, ctx, optimizer, parallel=self.parallel, dtype=dtype)
        self.comm, self.comm_steps = CommCounter(), 0
        # --profile: the last steps that are neither traced nor counted (timed as they run)
        steps = profile_steps(args, lambda s: self.tracer.will_record(s) or self.counts_comm(s))
        if args.profile and not steps:
            raise UserError(f"--profile needs a step after the first that is not memory-traced or byte-counted; "
                            f"train longer than --steps {args.steps}, or pass --no-trace-memory.")
        self.profile = Profile(steps, ctx.device, enabled=args.profile)
        # Reference cycles freed before every step, not whenever Python's collector happens to
        # run: what one step leaves in a cycle (tensors too) never reaches the next step's peak.
        self.gc = StepCollector()
        return self.start

    def steps(self):
        """The step numbers still to run, with the progress bar (rank 0)."""
        if self.start is None:
            raise RuntimeError("call run.resume() before run.steps(): it decides the first step")
        self._saved_up_to = self.start - 1
        return self.metrics.progress(self.start)

    def counts_comm(self, step: int) -> bool:
        """Whether this step's bytes are counted: two steps, after the first two, which do
        one-time work (a pipeline's shape exchange in the first, DDP's bucket rebuild in the
        second). The traffic is the same every step after that. A counted step, like a
        traced one, runs under a dispatch mode, where torch.compile's graphs do not run: it
        is an eager step, left out of the throughput."""
        if self.ctx.world_size == 1:
            return False  # no collectives to count
        first = min(self.start + 2, self.args.steps - 1)
        return first <= step < first + 2

    def evaluates(self, step: int) -> bool:
        """Whether the held-out loss is measured after this step: every --eval-every steps and
        after the last (a step number, so the same steps on any layout and after --resume).
        Outside ``step()``: never in a traced or counted step's window."""
        every = self.args.eval_every
        return bool(every) and self.evaluate is not None and ((step + 1) % every == 0 or step == self.args.steps - 1)

    def _validate(self) -> float | None:
        """The held-out loss, or None. A forward with no backward leaves FSDP's root module
        gathered (it skips the root's reshard after forward, for the backward that usually
        follows): sharded again here, or the next step would start with it whole."""
        if self.evaluate is None:
            return None
        val = self.evaluate()
        for m in self.models:
            for module in m.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
        return val

    @contextlib.contextmanager
    def step(self, step: int):
        """Trace the step's memory and count its bytes, if it is one of the steps for that."""
        if self._saved_up_to != step - 1:
            raise RuntimeError(f"step {step} began before run.save_if_due({step - 1}): call it after every step")
        self.gc.collect()  # before the tracer starts: the traced step, too, begins with nothing left over
        count = self.counts_comm(step)
        self.comm_steps += count
        waited = getattr(self.data, "wait_s", None)
        with self.tracer.record(step), (self.comm if count else contextlib.nullcontext()), \
                self.profile.record(step):
            yield
        # the seconds this step's next(batches) took, logged with the step (data_wait_s)
        self._waited = None if waited is None else self.data.wait_s - waited

    def log(self, step: int, loss, **extra):
        """After the optimizer step: ``loss`` is the global-batch mean, the same on every rank;
        tensors (loss, grad_norm) stay on the device: Metrics reads them one step late. Then
        the NaN check (--on-nan) of the steps whose numbers this made known."""
        # Traced and counted steps run under a dispatch mode, profiled ones under the
        # profiler: all left out of the throughput.
        if self._waited is not None:
            extra["data_wait_s"] = self._waited
        self._check(self.metrics.log(step, loss, traced=self.tracer.will_record(step) or self.counts_comm(step)
                                     or (self.profile.enabled and step in self.profile.steps),
                                     now=self.ckpt.saves_at(step), hold=self.evaluates(step), **extra))

    def evaluate_if_due(self, step: int):
        """The held-out loss after this step, every --eval-every steps and after the last:
        logged with this step, its time and memory counted in no step."""
        if self.evaluates(step):
            with self.ckpt.busy():  # (after a signal the stuck-rank watch waits for it)
                self._check(self.metrics.evaluated(step, self._validate))
            self.ckpt.mark_progress()  # (and counts from its end, not from the step's)

    def save_if_due(self, step: int):
        """A checkpoint of this step with --ckpt-every; on a stop signal (SIGTERM/SIGUSR1 seen by
        any rank up to the previous step: an all-reduce of every rank's vote), every rank saves
        this step and the run stops (exit 75); --fail-at-step's planned failure."""
        stop = self.ckpt.stop_agreed()
        if stop:
            self._check(self.metrics.flush())  # this step's row too: it is the one being saved
        self.ckpt.end_step(step, stop)
        self._saved_up_to = step

    def _check(self, rows: list[dict]):
        for row in rows:  # a step whose numbers are known: a checkpoint must not save a non-finite one
            self.ckpt.check_finite(row["step"], row["loss"], row.get("grad_norm"))

    def comm_by_rank(self) -> list[dict] | None:
        """Every rank's bytes per step by collective, on rank 0 (None elsewhere)."""
        mine = self.comm.summary(per=max(1, self.comm_steps))
        if not (dist.is_initialized() and self.ctx.has_peers):
            return [mine]
        out = [None] * self.ctx.world_size if self.ctx.is_main else None
        dist.gather_object(mine, out, dst=0)
        return out

    def finish(self, **extra) -> dict | None:
        """Measure the validation loss, draw the memory figure, write summary.json, print
        prediction and bytes (rank 0); with --save-weights, gather the weights into OUT/weights.pt."""
        self.ckpt.mark_progress()
        with self.ckpt.busy():  # (after a signal the stuck-rank watch waits for the outputs, however long)
            return self._finish(extra)

    def _finish(self, extra: dict) -> dict | None:
        a, ctx = self.args, self.ctx
        self.ckpt.wait()  # --ckpt-async: the last checkpoint is written and declared before the run ends
        if self.ckpt.staging_bytes:
            # host memory, per rank (rank 0's), and how long each background write took
            extra |= {"ckpt_staging_bytes": self.ckpt.staging_bytes, "ckpt_write_s": self.ckpt.write_seconds}
        # The last step's held-out loss where --eval-every measured it already, else measured now
        last = self.metrics.last_val
        val_loss = last[1] if last and last[0] == a.steps - 1 else self._validate()
        if a.save_weights:  # pipeline ranks hold different layers: rank 0 merges them, one copy per stage
            save_full_weights(self.models, ctx, a.out / "weights.pt", pp=self.parallel.get("pp", 1))
        memory = self.tracer.save(a.out, ctx, title=f"{self.title} on {ctx.world_size} rank"
                                  f"{'s' if ctx.world_size > 1 else ''}: {a.model} model, batch "
                                  f"{a.global_batch_size} x {a.seq_len} tokens, {ctx.device.type}")
        self.tracer.close()  # it lets go of the model and optimizer: nothing of this run outlives it
        comm = self.comm_by_rank()
        profiled = self.profile.save(a.out, ctx, f"{self.title}: compute and communication, steps "
                                     f"{self.profile.steps[0]}-{self.profile.steps[-1]}") if a.profile else None
        if profiled:
            extra |= {"profile": profiled}
            for r in profiled:
                frac = r["overlapped_fraction"]
                ctx.print(f"  profile rank {r['rank']}: compute {r['compute_s'] * 1e3:,.0f} ms, communication "
                          f"{r['comm_s'] * 1e3:,.0f} ms" + (f", {frac:.0%} of it overlapped" if frac is not None else ""))
            ctx.print(f"  profile traces in {a.out}/profile/ (open at ui.perfetto.dev), figure {a.out}/profile_timeline.png")
        said: list[str] = []  # printed after the run's table: first what ran, then the formulas beside it
        predicted = theory.report(a, ctx, memory, self.strategy, lines=said, **self.predict) if self.strategy else None
        if self.strategy:
            extra |= {"strategy": self.strategy, "predicted": predicted}
        extra = {"lesson": self.lesson, "optimizer_kernels": self.optimizer_kernels, **extra}
        # Per step (from the run's first): objects the cycle collector found, and the bytes of the
        # tensors among them, which would otherwise have lived on until Python collected by itself
        extra |= {"gc": {"unreachable_objects": self.gc.objects, "tensor_bytes": self.gc.tensor_bytes}}
        held = [(self.start + i, b) for i, b in enumerate(self.gc.tensor_bytes) if b]
        if held:
            ctx.print(f"reference cycles held {fmt_bytes(max(b for _, b in held))} of tensors at most from one step "
                      f"to the next (freed before steps {', '.join(str(s) for s, _ in held[:8])}"
                      f"{' ...' if len(held) > 8 else ''}); summary.json's gc says how much before each step.")
        self.gc.close()
        if ctx.fake:  # one rank of the layout, alone: memory and bytes real, losses not
            extra |= {"dry_run": {"rank": ctx.rank, "world_size": ctx.world_size}}
        summary = self.metrics.finish(memory, val_loss=val_loss, comm=comm, said=said, **extra)
        print_comm(ctx, comm, self.metrics.n_params)
        late = self.ckpt.signal_at_the_end()
        if late:  # a SIGTERM/SIGUSR1 too late for the vote to stop a step: the run completed
            saved = f" and its checkpoint of step {a.steps - 1}" if a.ckpt_every else ""
            ctx.print(f"{late} came with no step left to stop before: the run completed all {a.steps} steps and "
                      f"wrote its outputs{saved}; nothing is lost and nothing is left to resume.")
        self.ckpt.close()
        unlock_out(self.lock)
        if not math.isfinite(self.metrics.last_loss) and not ctx.fake:
            # --on-nan skip keeps a run going past bad steps; one that ends non-finite has
            # nothing usable to show for it, and must not look like a success.
            raise UserError(f"the run ended with a loss of {self.metrics.last_loss} (step {a.steps - 1}): the model is "
                            f"not usable; lower --lr, or look for the first non-finite step in {a.out}/metrics.jsonl.")
        return summary
