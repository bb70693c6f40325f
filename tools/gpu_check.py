"""Check the whole project on CUDA in one command: ``python -m tools.gpu_check``.

On whatever CUDA GPUs are visible it runs every training script but train_float8.py and
train_deepspeed.py (the lent GPU machine had neither torchao nor DeepSpeed; tools/gpu_pass.py
times float8 in bench_variants' bare loop) at GPU scale (the 125m
model at 12 x 1024 tokens, and the 1b model at 4 x 2048 where it fits), in bf16 where the
script has it, eager and compiled; step-3 scripts run with one rank per GPU (one rank on a
one-GPU machine: NCCL refuses two ranks on one GPU). Every step-3 script also runs a dry
run of a 4-rank layout on the GPU (``--fake-world-size 4``: rank 0 of four, alone, on
PyTorch's fake process group): the per-rank CUDA code of that layout, everything but the
real NCCL transfers, with every collective's tensors checked to be on the GPU (the fake
group would take a CPU tensor that NCCL refuses). Then it runs the test suite with the GPU
visible (the tests train on CPU ranks and must pass there as on a CPU machine).

It writes one report, ``figs/gpu_check_<gpu>.md`` (and ``.json``, which
``python -m tools.figures`` turns into the README's GPU table): per run, whether it ran
(or the error's last line), step time, tokens/s, MFU, and the CUDA allocator's peak against
the memory tracer's; and the CUDA memory figures, ``figs/<figure>_cuda_<gpu>.png``.

    python -m tools.gpu_check                 # everything
    python -m tools.gpu_check --no-tests      # the runs only
    python -m tools.gpu_check --only 02       # the runs whose names start with 02 (01,02: either)
    python -m tools.gpu_check --cpu           # the uncompiled runs at toy scale on the CPU, no
                                              # tests (the test suite runs it, so it cannot rot)
    python -m tools.gpu_check --merge A.json B.json --note "..."   # here, no GPU: reports made in
                                              # parts (--only, in copies of the tree) joined into figs/

Without a GPU (and without ``--cpu``) it says so in one sentence and exits with 2.
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # run as a script: common/ is not on the path yet
sys.path.insert(0, str(ROOT))

S2, S3 = "step2_memory/", "step3_multi_gpu/"
# (model flags at GPU scale, the same at toy scale for --cpu)
SCALES = {
    "125m": (["--model", "125m", "--global-batch-size", "12", "--seq-len", "1024"],
             ["--model", "debug", "--global-batch-size", "4", "--seq-len", "32"]),
    "1b": (["--model", "1b", "--global-batch-size", "4", "--seq-len", "2048"],
           ["--model", "debug", "--global-batch-size", "4", "--seq-len", "64"]),
    "moe": (["--model", "small-moe", "--global-batch-size", "12", "--seq-len", "1024"],
            ["--model", "debug-moe", "--global-batch-size", "4", "--seq-len", "32"]),
    # tensor parallel over 4: the debug model's 2 key/value heads do not split in 4
    "125m_tp4": (["--model", "125m", "--global-batch-size", "12", "--seq-len", "1024"],
                 ["--model", "small", "--global-batch-size", "4", "--seq-len", "32"]),
    # a layout of common/measure/missed_layouts.py: its flags name the model, batch and sequence
    "layout": ([], []),
}
DRY_WORLD = 4  # the layout each step-3 script's dry run plays: a node of four GPUs
STEPS = ["--steps", "10", "--trace-start", "3", "--trace-steps", "1", "--eval-batches", "0", "--data", "stdlib"]
TOY_STEPS = ["--steps", "3", "--trace-start", "1", "--trace-steps", "1", "--eval-batches", "0", "--data", "synthetic"]


def missed_checks() -> dict:
    """{name: (plan, rank, script, flags)} of each layout in common/measure/missed_layouts.py."""
    from common.measure.missed_layouts import dry_run_argv, missed_layouts
    return {name: (plan, rank, *dry_run_argv(name, fake=False)) for name, (plan, rank) in missed_layouts().items()}


@dataclass
class Check:
    name: str
    script: str
    flags: list[str] = field(default_factory=list)
    scale: str = "125m"
    all_gpus: bool = False           # step 3: one rank per visible GPU, under torchrun
    figure: str | None = None        # figs/<figure>_cuda_<gpu>.png from its memory_trace.png
    fake_world: int | None = None    # a dry run: rank ``fake_rank`` of this many, alone, in plain python
    fake_rank: int = 0
    toy: bool = True                 # also in --cpu mode (not the compiled runs: Inductor takes a
                                     # minute a model on a small CPU; nor the 1b runs, the same scripts)


FP32 = ["--amp", "off"]
CHECKS = [
    Check("01_baseline", "step1_single_gpu/train.py", figure="01_memory_trace_baseline"),
    Check("02_amp", S2 + "train_amp.py", ["--amp", "bf16"], figure="02_memory_trace_amp"),
    Check("02_amp_compile", S2 + "train_amp.py", ["--amp", "bf16", "--compile"], toy=False),
    # the same without the memory trace: its step time must equal the traced run's later steps
    Check("02_amp_compile_notrace", S2 + "train_amp.py", ["--amp", "bf16", "--compile", "--no-trace-memory"],
          toy=False),
    Check("02_amp_sac", S2 + "train_amp_ac.py", ["--amp", "bf16", "--ac", "selective"]),
    Check("02_amp_ac", S2 + "train_amp_ac.py", ["--amp", "bf16", "--ac", "full"], figure="02_memory_trace_amp_ac"),
    # the first step traced: nothing of an earlier step can be alive in it. Beside 02_amp_ac (steps
    # 1-2 traced) it says whether an allocator/trace gap under eager AC is carried from step to step
    Check("02_amp_ac_first", S2 + "train_amp_ac.py", ["--amp", "bf16", "--ac", "full", "--trace-start", "0",
                                                     "--trace-steps", "1"], toy=False),
    Check("02_amp_sac_compile", S2 + "train_amp_ac.py", ["--amp", "bf16", "--ac", "selective", "--compile"],
          toy=False),
    Check("02_amp_ac_compile", S2 + "train_amp_ac.py", ["--amp", "bf16", "--ac", "full", "--compile"], toy=False),
    Check("02_accum", S2 + "train_accum.py", ["--amp", "bf16", "--ac", "full", "--grad-accum", "4"]),
    Check("1b_fp32", "step1_single_gpu/train.py", scale="1b", toy=False),
    Check("1b_amp", S2 + "train_amp.py", ["--amp", "bf16"], scale="1b", toy=False),
    Check("1b_amp_sac", S2 + "train_amp_ac.py", ["--amp", "bf16", "--ac", "selective"], scale="1b", toy=False),
    Check("1b_amp_ac", S2 + "train_amp_ac.py", ["--amp", "bf16", "--ac", "full"], scale="1b", toy=False),
    Check("1b_amp_compile", S2 + "train_amp.py", ["--amp", "bf16", "--compile", "--no-trace-memory"], scale="1b", toy=False),
    # Step 3 in fp32 (--amp off): at one rank each must train exactly what step 1 trains.
    Check("03_ddp", S3 + "train_ddp.py", FP32, all_gpus=True, figure="03_memory_trace_ddp"),
    Check("03_zero1", S3 + "train_ddp.py", FP32 + ["--zero1"], all_gpus=True, figure="03_memory_trace_zero1"),
    Check("03_fsdp", S3 + "train_fsdp.py", FP32, all_gpus=True, figure="03_memory_trace_fsdp"),
    Check("03_tp", S3 + "train_tp.py", FP32, all_gpus=True, figure="03_memory_trace_tp"),
    Check("03_tp_sp", S3 + "train_tp.py", FP32 + ["--sequence-parallel"], all_gpus=True),
    Check("03_pp", S3 + "train_pp.py", FP32 + ["--schedule", "1f1b", "--microbatches", "4"], all_gpus=True,
          figure="03_memory_trace_pp"),
    Check("03_2d", S3 + "train_2d.py", FP32, all_gpus=True, figure="03_memory_trace_2d"),
    Check("03_3d", S3 + "train_3d.py", FP32, all_gpus=True),
    # ... and as a GPU user trains: bf16 (each strategy's mechanism), full AC, compiled.
    Check("03_fsdp_bf16_ac", S3 + "train_fsdp.py", ["--amp", "bf16", "--ac", "full"],
          all_gpus=True, figure="03_memory_trace_fsdp_bf16_ac"),
    Check("03_cp", S3 + "train_cp.py", FP32, all_gpus=True),
    Check("03_ep", S3 + "train_ep.py", FP32, scale="moe", all_gpus=True),
    *[Check(f"03_{name}_bf16_ac_compile", S3 + script, ["--amp", "bf16", "--ac", "full", "--compile", *extra],
            all_gpus=True, toy=False)
      for name, script, extra in [("ddp", "train_ddp.py", []), ("fsdp", "train_fsdp.py", []), ("tp", "train_tp.py", []),
                                  ("pp", "train_pp.py", ["--schedule", "1f1b", "--microbatches", "4"]),
                                  ("2d", "train_2d.py", [])]],
    # One rank of each script's 4-rank layout, alone on the one GPU (bf16, as a GPU user runs
    # them): its shards, its activations, its collectives' tensors, on CUDA.
    *[Check(f"03_dry{DRY_WORLD}_{name}", S3 + script, extra, scale=scale, fake_world=DRY_WORLD)
      for name, script, extra, scale in [
          ("ddp", "train_ddp.py", [], "125m"), ("fsdp", "train_fsdp.py", [], "125m"),
          ("tp", "train_tp.py", [], "125m_tp4"),
          ("pp", "train_pp.py", ["--schedule", "1f1b", "--microbatches", str(DRY_WORLD)], "125m"),
          # 3-D as pipeline x FSDP (TP is 2-D's): the default pp 2 x tp 2 shares a "tp" sub-mesh
          # with 2-D's, which DTensor's cache mixes up in one process (tools/multirun.py)
          ("2d", "train_2d.py", [], "125m"), ("3d", "train_3d.py", ["--pp", "2", "--dp", "2", "--tp", "1"], "125m"),
          ("cp", "train_cp.py", [], "125m"), ("ep", "train_ep.py", [], "moe")]],
    # The layouts the memory formula once missed, each found and fixed on this CPU against a dry
    # run (common/measure/missed_layouts.py): on CUDA, the allocator's peak against the formula
    # with CUDA's kernels, where the streams decide when FSDP frees what it gathered. Rehearsed
    # on the CPU: one of them.
    *[Check(f"03_missed_{name}", script, flags, scale="layout", fake_world=plan.world, fake_rank=rank,
            toy=name == "fsdp_accum_bf16")
      for name, (plan, rank, script, flags) in missed_checks().items()],
]


def gpu_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100': the model number, for file names."""
    m = re.search(r"\b([A-Z]+\d{2,4})\b", name)
    return (m.group(1) if m else re.sub(r"\W+", "_", name)).lower()


def flags_of(check: Check, toy: bool, out: Path, device: str) -> list[str]:
    scale = SCALES[check.scale][1 if toy else 0]
    dry = ["--fake-world-size", str(check.fake_world), "--fake-rank", str(check.fake_rank)] if check.fake_world else []
    return [*scale, *(TOY_STEPS if toy else STEPS), *check.flags, *dry, "--out", str(out), "--device", device]


# ---- the worker: the runs of one launch, one after another, carrying on past failures --------------
def worker(spec_path: str) -> None:
    """Inside one process (or one torchrun job): each run's main(), its exit code and the
    last line of what it printed to stderr, written to <out>/gpu_check_status.json."""
    import contextlib
    import os

    import torch
    from common.measure.comm import CommCounter
    from tools.multirun import run_script

    rank0 = os.environ.get("RANK", "0") == "0"
    baseline = None  # what the CUDA allocator held before the launch's first run
    for run in json.loads(Path(spec_path).read_text()):
        if rank0:
            print(f"[gpu_check] start {run['name']}", flush=True)
        # Each run must start from what the first one started from: CUDA's counters are absolute,
        # so anything an earlier run left alive would be counted in this run's peak.
        before = None
        # CUDA path: no CPU test: the CUDA allocator's counter (tests/test_memory.py holds the same
        # property on a CPU: nothing of a finished run is alive when the next starts)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            with contextlib.suppress(Exception):  # cuBLAS keeps a workspace per handle in the allocator
                torch._C._cuda_clearCublasWorkspaces()
            before = torch.cuda.memory_allocated()
        baseline = before if baseline is None else baseline
        t = time.perf_counter()
        # A dry run's collectives, every one of the run, recorded with the devices of their
        # tensors (a dispatch mode slows every op: not for the timed runs).
        recorder = CommCounter(expect=run["device"]) if run["record_devices"] else contextlib.nullcontext()
        with recorder:
            code, err = run_script(run["script"], run["argv"], capture_stderr=True)
        lines = [ln for ln in err.splitlines() if ln.strip() and "%|" not in ln]  # not the progress bar
        if rank0:
            out = Path(run["out"])
            out.mkdir(parents=True, exist_ok=True)
            devices = {k: sorted(v) for k, v in recorder.devices.items()} if run["record_devices"] else None
            (out / "gpu_check_status.json").write_text(json.dumps(
                {"code": code, "error": lines[-1][:300] if code and lines else None,
                 "allocated_before_bytes": before, "baseline_bytes": baseline or 0,
                 "wall_s": time.perf_counter() - t, "collective_devices": devices,
                 "off_device": sorted(set(recorder.off_device)) if run["record_devices"] else []}))
            print(f"[gpu_check] done {run['name']} (exit {code})", flush=True)
        torch._dynamo.reset()  # the next run compiles its own model afresh: no recompile limit carried over


# ---- the orchestrator ---------------------------------------------------------------------
def launch(checks: list[Check], key: str, nproc: int, torchrun: bool, toy: bool, device: str, runs_dir: Path,
           timeout_s: float) -> str:
    spec = [{"name": c.name, "script": c.script, "out": str(runs_dir / c.name), "device": device,
             "record_devices": bool(c.fake_world), "argv": flags_of(c, toy, runs_dir / c.name, device)}
            for c in checks]
    spec_path = runs_dir / f"spec_{key}.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable] if not torchrun else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                 f"--nproc-per-node={nproc}"]
    cmd += [str(Path(__file__).relative_to(ROOT)), "--worker", str(spec_path)]
    log = runs_dir / f"launch_{key}.log"
    try:
        with open(log, "w") as f:
            subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout_s:.0f} s (log: {log})"
    return ""


def result_row(check: Check, runs_dir: Path, nproc: int, launch_error: str) -> dict:
    out = runs_dir / check.name
    row = {"name": check.name, "script": check.script, "flags": check.flags, "scale": check.scale, "ranks": nproc,
           "fake_world_size": check.fake_world, "fake_rank": check.fake_rank}
    status = out / "gpu_check_status.json"
    if not status.exists():
        return row | {"ok": False, "error": launch_error or "did not run (the launch stopped before it)"}
    st = json.loads(status.read_text())
    if st["code"] != 0:
        return row | {"ok": False, "error": st["error"] or f"exit code {st['code']}"}
    before = st.get("allocated_before_bytes")
    row["allocated_before_bytes"] = before
    if before is not None and before != st.get("baseline_bytes", 0):
        return row | {"ok": False, "error": f"the run started with {before:,} bytes allocated, the launch's first run "
                                             f"with {st['baseline_bytes']:,}: an earlier run's tensors were alive, and "
                                             f"CUDA's counters would count them in this run's peak"}
    row["collective_devices"] = st.get("collective_devices")
    if st.get("off_device"):  # NCCL would refuse these tensors on a real node
        return row | {"ok": False, "error": f"collectives handed tensors off the run's device: "
                                             f"{'; '.join(st['off_device'][:3])}"}
    s = json.loads((out / "summary.json").read_text())
    mem = s.get("memory") or [{}]
    traced = max((m.get("peak_bytes") or 0 for m in mem), default=0) or None
    allocator = max((m.get("allocator_peak_bytes") or 0 for m in mem), default=0) or None
    # (CPU: what the allocator's count held at its peak that the trace never saw, by op)
    missed = max(mem, key=lambda m: (m.get("allocator_unseen_at_peak") or {}).get("bytes") or 0)
    missed = missed.get("allocator_unseen_at_peak") if mem else None
    # What the allocator held that the trace did not see (rank 0), and what reference cycles
    # held from one step to the next (the collector frees them before each step): the two
    # numbers that say where an allocator/trace gap comes from
    unseen = (mem[0].get("unseen") or {}) if mem else {}
    cycles = (s.get("gc") or {}).get("tensor_bytes") or []
    # the memory formula's peak for the rank that ran (common/measure/theory.py, the run's own device)
    per_rank = (s.get("predicted") or {}).get("per_rank") or []
    # (a dry run: its rank's; else the fullest rank's, as the allocator's peak is the highest rank's)
    peaks = [p.get("peak") for p in per_rank if p.get("peak") and (not check.fake_world or p.get("rank") == check.fake_rank)]
    formula = max(peaks, default=None)
    return row | {"ok": True, "step_time_s": s["step_time_s"], "tokens_per_s": s["tokens_per_s"], "mfu": s.get("mfu"),
                  "peak_flops_source": s.get("peak_flops_source"), "allocator_unseen_at_peak": missed,
                  "dtype": s.get("dtype"), "allocator_peak_bytes": allocator, "traced_peak_bytes": traced,
                  "unseen_max_bytes": unseen.get("max_bytes"), "alive_before_bytes": unseen.get("alive_before_bytes"),
                  "cycle_tensor_bytes_max": max(cycles, default=None), "final_loss": s["final_loss"],
                  "formula_peak_bytes": formula}


def suite_command() -> list[str]:
    """The test suite as a GPU machine runs it: on all its cores when pytest-xdist is there, one
    test file to a worker (--dist loadfile: a file's tests share its launches and folders)."""
    import importlib.util
    xdist = ["-n", "auto", "--dist", "loadfile"] if importlib.util.find_spec("xdist") else []
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *xdist]


def run_tests(timeout_s: float) -> dict:
    t = time.perf_counter()
    try:
        r = subprocess.run(suite_command(), cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"ok": False, "summary": f"the test suite did not finish in {timeout_s:.0f} s", "wall_s": timeout_s}
    tail = [ln for ln in r.stdout.splitlines() if ln.strip()]
    failed = [ln for ln in tail if ln.startswith("FAILED") or ln.startswith("ERROR")]
    return {"ok": r.returncode == 0, "summary": tail[-1] if tail else f"exit code {r.returncode}",
            "failed": failed, "wall_s": time.perf_counter() - t}


def markdown(report: dict) -> str:
    gib = lambda b: f"{b / 2**30:.2f} GiB" if b else "-"  # noqa: E731
    lines = [f"Made by `python -m tools.gpu_check` on {report['gpus']} x {report['device']}, torch {report['torch']}, "
             f"{report['date']}.", ""]
    if report.get("merged"):  # several partial runs, joined here by --merge
        parts = "; ".join(f"{', '.join(m['prefixes'])} ({m['runs']} runs, {m['wall_s']:.0f} s)" for m in report["merged"])
        lines += [f"Joined by `python -m tools.gpu_check {' '.join(report['merge_argv'])}` from {len(report['merged'])} "
                  f"reports of that machine, one a part: {parts}.", ""]
    if report.get("note"):
        lines += [f"NOTE: {report['note']}", ""]
    lines += [
             "| run | script and flags | ranks | ran | step time | tokens/s | MFU | allocator peak | traced peak | "
             "traced / allocator |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        dry = [f"--fake-world-size {r['fake_world_size']}"] if r.get("fake_world_size") else []
        dry += [f"--fake-rank {r['fake_rank']}"] if r.get("fake_world_size") and r.get("fake_rank") else []
        alone = f"rank {r.get('fake_rank') or 0} of {r.get('fake_world_size')}, alone"
        cmd = f"`{' '.join([r['script'], *r['flags'], *dry])}` ({'toy' if report['device'] == 'CPU' else r['scale']})"
        if not r["ok"]:
            who = alone if r.get("fake_world_size") else r["ranks"]
            lines.append(f"| {r['name']} | {cmd} | {who} | no: {r['error']} | | | | | | |")
            continue
        a, t = r["allocator_peak_bytes"], r["traced_peak_bytes"]
        # a dry run's rank never waits for a peer: its time is compute alone, not a throughput
        dry = r.get("fake_world_size")
        mfu = f"{r['mfu']:.1%}" if r["mfu"] and not dry else "-"
        ratio = f"{t / a:.3f}" if a and t else "-"
        tps = "-" if dry else f"{r['tokens_per_s']:,.0f}"
        lines.append(f"| {r['name']} | {cmd} | {alone if dry else r['ranks']} | yes | "
                     f"{r['step_time_s'] * 1e3:.1f} ms | {tps} | {mfu} | {gib(a)} | {gib(t)} | {ratio} |")
    sources = sorted({r["peak_flops_source"] for r in report["runs"] if r.get("mfu") and r.get("peak_flops_source")})
    if sources:  # fp32 and bf16 runs are measured against different peaks: their MFUs do not compare
        lines += ["", f"MFU: 6N + 12LdT FLOPs a token against the dense peak of each run's dtype: {'; '.join(sources)}."]
    formula = [r for r in report["runs"] if r["ok"] and r.get("formula_peak_bytes") and r.get("allocator_peak_bytes")]
    if formula:  # (reports made before the formula's peak was kept have none)
        lines += ["", "The memory formula (common/measure/theory.py, with the kernels of the run's device) against the "
                      "allocator's peak of the rank that ran; target: within 3%:", "",
                  "| run | formula peak | allocator peak | allocator / formula |", "|---|---|---|---|"]
        from common.measure.byte_units import fmt_bytes
        lines += [f"| {r['name']} | {fmt_bytes(r['formula_peak_bytes'])} | {fmt_bytes(r['allocator_peak_bytes'])} | "
                  f"{r['allocator_peak_bytes'] / r['formula_peak_bytes']:.3f} |" for r in formula]
    gaps = [r for r in report["runs"] if r["ok"] and (r.get("unseen_max_bytes") or r.get("cycle_tensor_bytes_max"))]
    if gaps:
        lines += ["", "Where the allocator's bytes went that the trace did not see (rank 0): not seen by the trace at "
                      "most / alive before the traced step / tensors reference cycles held from one step to the "
                      "next (freed before each step):"]
        lines += [f"- {r['name']}: {gib(r.get('unseen_max_bytes'))} / {gib(r.get('alive_before_bytes'))} / "
                  f"{gib(r.get('cycle_tensor_bytes_max'))}" for r in gaps]
    by = {r["name"]: r for r in report["runs"] if r["ok"]}
    if "02_amp_compile" in by and "02_amp_compile_notrace" in by:
        ratio = by["02_amp_compile"]["step_time_s"] / by["02_amp_compile_notrace"]["step_time_s"]
        lines += ["", f"Compiled steps after the memory trace against a run without it: {ratio:.2f}x "
                      f"(1.00x: the trace leaves the compiled steps alone)."]
    if {"02_amp", "02_amp_sac", "02_amp_ac"} <= by.keys():
        t = {k: by[k]["step_time_s"] * 1e3 for k in ("02_amp", "02_amp_sac", "02_amp_ac")}
        lines += [f"Eager step time, no AC / selective / full: {t['02_amp']:.1f} / {t['02_amp_sac']:.1f} / "
                  f"{t['02_amp_ac']:.1f} ms."]
    if report.get("tests"):
        tst = report["tests"]
        lines += ["", f"Test suite with the GPU visible: {tst['summary']} ({tst['wall_s']:.0f} s)."]
        lines += [f"- {f}" for f in tst.get("failed", [])]
    return "\n".join(lines) + "\n"


def write_report(report: dict, report_dir: Path, slug: str, started_at: float, argv: list[str], device: str,
                 made_on: dict | None = None) -> None:
    """figs/gpu_check_<slug>.json and .md; in figs/, also which machine made them (made_on.json)
    and the README's copies. ``made_on``: the machine's entry when the report was made elsewhere
    (--merge here, from a GPU machine's reports)."""
    (report_dir / f"gpu_check_{slug}.json").write_text(json.dumps(report, indent=1) + "\n")
    md = markdown(report)
    (report_dir / f"gpu_check_{slug}.md").write_text(md)
    print(md)
    if report_dir.resolve() == (ROOT / "figs").resolve():  # which machine made them, and the README's copies
        from tools import figures
        written = [p for p in report_dir.iterdir() if p.name.startswith(f"gpu_check_{slug}.") or f"_cuda_{slug}." in p.name]
        made = figures.record_provenance([p for p in written if p.stat().st_mtime >= started_at], device, argv,
                                         tool="python -m tools.gpu_check", entry=made_on)
        figures.update_readme({"figs-made-on": figures.provenance_table(made), **figures.gpu_check_report()})


def merge(paths: list[str], report_dir: Path = ROOT / "figs", note: str = "") -> Path:
    """Join gpu_check reports of one GPU made in parts (``--only``, on one machine or several
    copies of the tree) into ``report_dir``/gpu_check_<gpu>.json and .md: every row of every
    report, the failed ones with their errors, in CHECKS order (a later report's row replaces an
    earlier one of the same name), and the CUDA figures found beside each report (in its folder
    or a figs/ folder there) copied in. Refuses reports of different GPUs or torch versions."""
    started_at = time.time()
    reports = [(Path(p), json.loads(Path(p).read_text())) for p in paths]
    first = reports[0][1]
    for path, r in reports:
        for key in ("device", "torch"):
            if r.get(key) != first.get(key):
                raise ValueError(f"{path.name} was made with {key} {r.get(key)!r}, {reports[0][0].name} with "
                                 f"{first.get(key)!r}: merge one GPU's reports from one torch")
        if r["device"] == "CPU":
            raise ValueError(f"{path.name} is a --cpu report (toy scale): only GPU reports are merged")
    rows = {}
    for _, r in reports:
        rows.update({row["name"]: row for row in r["runs"]})
    order = [c.name for c in CHECKS]
    slug = gpu_slug(first["device"])
    report = {"device": first["device"], "gpus": first["gpus"], "torch": first["torch"],
              "date": max(r["date"] for _, r in reports),
              "runs": sorted(rows.values(), key=lambda r: order.index(r["name"]) if r["name"] in order else len(order)),
              "tests": next((r["tests"] for _, r in reversed(reports) if r.get("tests")), None),
              "wall_s": sum(r.get("wall_s") or 0 for _, r in reports),
              # what each part ran (its runs' name prefixes, as --only takes them), not the files: they
              # stay on the machine that made them, and the report holds all they said
              # (a report that was itself merged keeps its parts: merging it again, with a new
              # --note, say, changes nothing else)
              "merged": [part for _, r in reports for part in r.get("merged") or [
                  {"prefixes": sorted({row["name"].split("_")[0] for row in r["runs"]}), "runs": len(r["runs"]),
                   "wall_s": r.get("wall_s") or 0, "date": r["date"]}]]}
    report["merge_argv"] = ["--merge", *["REPORT.json"] * len(report["merged"]), *(["--note", "NOTE"] if note else [])]
    if note:
        report["note"] = note
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    for path, _ in reports:
        for folder in (path.parent, path.parent / "figs"):
            for png in sorted(folder.glob(f"*_cuda_{slug}.png")):
                if png.parent.resolve() != report_dir.resolve():
                    shutil.copyfile(png, report_dir / png.name)
    made_on = {"device": first["device"], "torch": first["torch"].split("+")[0], "date": report["date"],
               "command": "python -m tools.gpu_check " + " ".join(report["merge_argv"])}
    write_report(report, report_dir, slug, started_at, report["merge_argv"], "cuda", made_on)
    return report_dir / f"gpu_check_{slug}.md"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--cpu", action="store_true", help="the same runs at toy scale on the CPU (no test suite)")
    p.add_argument("--no-tests", action="store_true", help="skip the test suite")
    p.add_argument("--only", default="", help="the runs whose names start with this (or with any of several, "
                                               "comma-separated); the report keeps earlier runs' other rows")
    p.add_argument("--report-dir", default=None,
                   help="where the report and figures go (default: figs/, or runs/gpu_check_cpu with --cpu)")
    p.add_argument("--timeout", type=float, default=420, help="seconds per launch before it is stopped (default 420)")
    p.add_argument("--fresh-process", action="store_true",
                   help="each run in a process (or torchrun job) of its own, as a learner runs it: no run can see "
                        "another's leftovers, at a few seconds of start-up each (default: one launch per kind)")
    p.add_argument("--merge", nargs="+", metavar="REPORT",
                   help="join gpu_check_<gpu>.json reports made in parts (--only) into figs/ (no GPU needed): "
                        "every row, failures with their errors, and the CUDA figures found beside them")
    p.add_argument("--note", default="", help="with --merge: a sentence the report carries (how it was measured)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    if args.merge:
        missing = [m for m in args.merge if not Path(m).is_file()]
        if missing:
            print(f"error: --merge: no report at {missing[0]} (give gpu_check_<gpu>.json files)", file=sys.stderr)
            return 2
        try:
            path = merge(args.merge, Path(args.report_dir) if args.report_dir else ROOT / "figs", args.note)
        except (ValueError, KeyError, json.JSONDecodeError) as e:
            print(f"error: --merge: {e}", file=sys.stderr)
            return 2
        print(f"wrote {path}")
        return 0
    if not 1 <= args.timeout <= 86400:  # (nan fails this too) a launch stopped at once, or never
        print(f"error: --timeout must be between 1 and 86400 seconds (got {args.timeout}).", file=sys.stderr)
        return 2
    import torch
    if not args.cpu and not torch.cuda.is_available():
        print("error: no CUDA GPU is visible here (or this torch has no CUDA); run this on a GPU machine, or pass "
              "--cpu for the same runs at toy scale on the CPU", file=sys.stderr)
        return 2
    prefixes = tuple(args.only.split(","))
    checks = [c for c in CHECKS if c.name.startswith(prefixes) and (c.toy or not args.cpu)]
    if not checks:
        print(f"error: no run name starts with {args.only!r}; names start with 01, 02, 1b or 03", file=sys.stderr)
        return 2
    device = "cpu" if args.cpu else "cuda"
    gpus = 1 if args.cpu else torch.cuda.device_count()
    name = "CPU" if args.cpu else torch.cuda.get_device_name(0)
    slug = "cpu" if args.cpu else gpu_slug(name)
    report_dir = Path(args.report_dir) if args.report_dir else (ROOT / "runs" / "gpu_check_cpu" if args.cpu
                                                                else ROOT / "figs")
    runs_dir = ROOT / "runs" / f"gpu_check_{slug}"
    shutil.rmtree(runs_dir, ignore_errors=True)
    runs_dir.mkdir(parents=True)
    report_dir.mkdir(parents=True, exist_ok=True)
    start, started_at = time.perf_counter(), time.time()
    rows = []
    # One launch per kind: the one-device runs together, step 3 on every GPU (torchrun), and
    # the dry runs (plain python: torchrun's ranks cannot play a fake layout), on a GPU in a
    # launch of their own (with its own time limit), at toy scale after the one-device runs.
    one, dry = [c for c in checks if not (c.all_gpus or c.fake_world)], [c for c in checks if c.fake_world]
    launches = [("one", 1, one + dry if args.cpu else one), ("all", gpus, [c for c in checks if c.all_gpus]),
                ("dry", 1, [] if args.cpu else dry)]
    if args.fresh_process:
        launches = [(f"{key}_{c.name}", nproc, [c]) for key, nproc, group in launches for c in group]
    for key, nproc, group in launches:
        if not group:
            continue
        print(f"{len(group)} runs on {nproc} {'CPU process' if args.cpu else 'GPU'}{'es' if args.cpu and nproc > 1 else ''}"
              f"{'' if args.cpu or nproc == 1 else 's'}: {', '.join(c.name for c in group)}", flush=True)
        err = launch(group, key, nproc, group[0].all_gpus, args.cpu, device, runs_dir, args.timeout)
        rows += [result_row(c, runs_dir, nproc, err) for c in group]
    earlier = report_dir / f"gpu_check_{slug}.json"
    old = json.loads(earlier.read_text()) if args.only and earlier.exists() else None
    if old and (old["date"], old["torch"]) == (datetime.date.today().isoformat(), torch.__version__):
        ran = {r["name"] for r in rows}  # a run in parts today (tools/gpu_pass.py): keep the other parts' rows
        rows += [r for r in old["runs"] if r["name"] not in ran]
    order = [c.name for c in CHECKS]
    rows.sort(key=lambda r: order.index(r["name"]) if r["name"] in order else len(order))  # as CHECKS lists them
    report = {"device": name, "gpus": gpus, "torch": torch.__version__, "date": datetime.date.today().isoformat(),
              "runs": rows, "tests": None}
    if not (args.cpu or args.no_tests):
        print("the test suite, with the GPU visible ...", flush=True)
        report["tests"] = run_tests(args.timeout)
    report["wall_s"] = time.perf_counter() - start
    for c in checks:  # the CUDA figures beside the CPU ones
        png = runs_dir / c.name / "memory_trace.png"
        if c.figure and png.exists():
            shutil.copyfile(png, report_dir / f"{c.figure}_{'cpu_toy' if args.cpu else 'cuda_' + slug}.png")
    write_report(report, report_dir, slug, started_at, sys.argv[1:] if argv is None else argv, device)
    failed = [r["name"] for r in rows if not r["ok"]]
    tests_failed = report["tests"] is not None and not report["tests"]["ok"]
    print(f"{len(rows) - len(failed)} of {len(rows)} runs ran"
          + (f"; failed: {', '.join(failed)}" if failed else "")
          + ("; the test suite failed" if tests_failed else "")
          + f". Report: {(report_dir / f'gpu_check_{slug}.md').relative_to(ROOT) if report_dir.is_relative_to(ROOT) else report_dir}"
          f" ({report['wall_s']:.0f} s)", flush=True)
    return 1 if failed or tests_failed else 0


if __name__ == "__main__":
    sys.exit(main())
