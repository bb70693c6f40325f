"""Regenerate every figure in figs/ from real runs: ``python -m tools.figures``.

Each chapter lists the runs it needs (a script and its flags) and which of their outputs
become which figure. ``--only 01`` regenerates the figures whose names start with 01;
``--device cuda`` runs on a GPU (the figures then get a ``_cuda`` suffix so the CPU ones
stay). Runs go to runs/figs/<run name>/.

Runs that share a ``job`` are launched together: one torchrun job (tools/multirun.py)
calls their scripts one after another, because starting processes that import torch is
a good part of a short run's cost on a small machine. The jobs' output goes to
runs/figs/<job>.log; the terminal shows one progress bar over all the runs.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file (python tools/x.py): find common/

from common.errors import UserError
from common.measure.memory import fmt_bytes

from common import ROOT  # noqa: E402


@dataclass
class Run:
    name: str                     # runs/figs/<name>/
    script: str                   # path from the repo root
    flags: list[str]
    nproc: int = 1                # >1: launched with torchrun
    figures: dict[str, str] = field(default_factory=dict)  # figs/ name -> file in the run folder
    job: str = "one_process"      # runs with the same job (and so the same nproc) share one launch


# ---- chapter 1: the single-device baseline --------------------------------------------
CHAPTER1 = [
    Run("baseline", "step1_single_gpu/train.py",
        ["--model", "small", "--steps", "30", "--global-batch-size", "8", "--seq-len", "256", "--save-weights"],
        figures={"01_memory_trace_baseline.png": "memory_trace.png"}),
]

# ---- chapter 2: memory savers on one device -------------------------------------------
# The baseline's model, batch and sequence length, so that every row of the table differs
# from it by the saving alone. Runs with no figures of their own: the post step below
# draws each trace beside the baseline's, on its scale.
_CH2 = ["--model", "small", "--global-batch-size", "8", "--seq-len", "256", "--steps", "8", "--eval-batches", "0"]
CHAPTER2 = [
    Run("02_baseline", "step1_single_gpu/train.py", _CH2),
    Run("02_amp", "step2_memory/train_amp.py", _CH2 + ["--amp", "bf16"]),
    Run("02_amp_sac", "step2_memory/train_amp_ac.py", _CH2 + ["--amp", "bf16", "--ac", "selective"]),
    Run("02_amp_ac", "step2_memory/train_amp_ac.py", _CH2 + ["--amp", "bf16", "--ac", "full"]),
    Run("02_accum_fp32", "step2_memory/train_accum.py", _CH2 + ["--amp", "off", "--ac", "none", "--grad-accum", "4"]),
    Run("02_amp_ac_accum", "step2_memory/train_accum.py", _CH2 + ["--amp", "bf16", "--ac", "full", "--grad-accum", "4"]),
    # The step times of the same set-ups, taken in turns in one process: runs made one
    # after another on a shared machine see different loads.
    Run("02_bench", "step2_memory/bench_memory_savers.py", _CH2[:6] + ["--steps", "6"]),
]
_CH2_LABELS = {"02_baseline": "fp32 baseline (step 1)", "02_amp": "AMP bf16", "02_amp_sac": "AMP + selective AC",
               "02_amp_ac": "AMP + full AC", "02_accum_fp32": "fp32, 4 micro-batches",
               "02_amp_ac_accum": "AMP + full AC + 4 micro-batches"}

# ---- chapter 3a: the data-parallel family ---------------------------------------------
# fp32 (--amp off, step 3 defaults to bf16): the 16 bytes per parameter, and the formulas' bytes, read plainly
_3A = ["--model", "small", "--steps", "6", "--global-batch-size", "8", "--seq-len", "128", "--eval-batches", "2",
       "--amp", "off"]
_DP4 = dict(nproc=4, job="4_ranks_data_parallel")  # chapters 3a, 4 and 5: no DTensor meshes but FSDP's
CHAPTER3A: list[Run] = [
    Run("3a_ddp", "step3_multi_gpu/train_ddp.py", _3A, **_DP4,
        figures={"03_memory_trace_ddp.png": "memory_trace.png"}),
    Run("3a_zero1", "step3_multi_gpu/train_ddp.py", _3A + ["--zero1"], **_DP4,
        figures={"03_memory_trace_zero1.png": "memory_trace.png"}),
    Run("3a_fsdp_zero2", "step3_multi_gpu/train_fsdp.py", _3A + ["--no-reshard-after-forward"], **_DP4,
        figures={"03_memory_trace_zero2.png": "memory_trace.png"}),
    Run("3a_fsdp_zero3", "step3_multi_gpu/train_fsdp.py", _3A, **_DP4,
        figures={"03_memory_trace_fsdp.png": "memory_trace.png"}),
    Run("3a_hsdp", "step3_multi_gpu/train_fsdp.py", _3A + ["--hsdp", "2", "2"], **_DP4,
        figures={"03_memory_trace_hsdp.png": "memory_trace.png"}),
    Run("3a_fsdp_bf16_ac", "step3_multi_gpu/train_fsdp.py", _3A + ["--amp", "bf16", "--ac", "full"],
        **_DP4, figures={"03_memory_trace_fsdp_bf16_ac.png": "memory_trace.png"}),
]

# ---- chapter 3b: the model-parallel family --------------------------------------------
# Every strategy on the same 4 ranks, model, data and batch, so the table compares like
# with like. 8 layers: the interleaved schedule needs two stages per rank. Their own job:
# DTensor meshes of one job can meet a stale cached group (tools/multirun.py).
_3B = ["--model", "small", "--n-layers", "8", "--global-batch-size", "8", "--seq-len", "64", "--steps", "5",
       "--eval-batches", "1", "--trace-start", "2", "--trace-steps", "1",  # one step: a readable figure
       "--amp", "off"]
_TP, _PP, _2D = "step3_multi_gpu/train_tp.py", "step3_multi_gpu/train_pp.py", "step3_multi_gpu/train_2d.py"
_MP4 = dict(nproc=4, job="4_ranks_model_parallel")
_CLIP = ["--model", "small", "--n-layers", "4", "--global-batch-size", "8", "--seq-len", "64", "--steps", "8",
         "--eval-batches", "0", "--no-trace-memory", "--max-norm", "0.5", "--amp", "off"]
STRATEGIES = "03_strategies/"  # the folder of the runs the chapter 3b table and the comparison read
BF16_AC = "03_bf16_ac/"
DRY_RUN = "03_dry_run_1b_fsdp8"  # a dry run of one rank (--fake-world-size)  # the same strategies in bf16 with full activation checkpointing
_BF16_AC_RUNS = [("ddp", "step3_multi_gpu/train_ddp.py", []), ("fsdp", "step3_multi_gpu/train_fsdp.py", []),
                 ("tp", _TP, []), ("pp_1f1b", _PP, ["--schedule", "1f1b", "--microbatches", "8"]),
                 ("2d", _2D, ["--tp", "2"])]
CHAPTER3B: list[Run] = [
    Run("03_single", "step1_single_gpu/train.py", [f for f in _3B if f not in ("--amp", "off")], figures={"03_memory_trace_single.png": "memory_trace.png"}),
    Run(STRATEGIES + "tp", _TP, _3B, **_MP4, figures={"03_memory_trace_tp.png": "memory_trace.png"}),
    Run(STRATEGIES + "tp_sp", _TP, _3B + ["--sequence-parallel"], **_MP4,
        figures={"03_memory_trace_tp_sp.png": "memory_trace.png"}),
    Run(STRATEGIES + "pp_gpipe", _PP, _3B + ["--schedule", "gpipe", "--microbatches", "8"], **_MP4,
        figures={"03_memory_trace_pp_gpipe.png": "memory_trace.png"}),
    Run(STRATEGIES + "pp_1f1b", _PP, _3B + ["--schedule", "1f1b", "--microbatches", "8"], **_MP4,
        figures={"03_memory_trace_pp.png": "memory_trace.png"}),
    Run(STRATEGIES + "pp_interleaved", _PP, _3B + ["--schedule", "interleaved1f1b", "--microbatches", "8"], **_MP4),
    Run(STRATEGIES + "2d", _2D, _3B + ["--tp", "2"], **_MP4, figures={"03_memory_trace_2d.png": "memory_trace.png"}),
    Run(STRATEGIES + "fsdp_via_2d", _2D, _3B + ["--tp", "1"], **_MP4),  # FSDP alone: a 4 x 1 mesh
    # chapter 3a's scripts on the same footing
    Run(STRATEGIES + "ddp", "step3_multi_gpu/train_ddp.py", _3B, **_MP4),
    Run(STRATEGIES + "fsdp", "step3_multi_gpu/train_fsdp.py", _3B, **_MP4),
    # Clipping by the global gradient norm, and by each rank's own (the wrong way)
    *[Run(f"03_clip/{name}_{how}", script, _CLIP + extra + ["--clip-by", how], **_MP4)
      for name, script, extra in (("fsdp", "step3_multi_gpu/train_fsdp.py", []), ("tp", _TP, []),
                                  ("pp", _PP, ["--microbatches", "4"]))
      for how in ("global", "local")],
    Run("03_clip/single", "step1_single_gpu/train.py", [f for f in _CLIP if f not in ("--amp", "off")]),
    # As a GPU user trains: the defaults (bf16, each strategy's way) plus full AC, same model and batch
    *[Run(BF16_AC + name, script, _3B + ["--amp", "bf16", "--ac", "full"] + extra, **_MP4)
      for name, script, extra in _BF16_AC_RUNS],
    # One rank of a layout no machine here could run: rank 0 of FSDP over 8 ranks, the 1b model
    Run(DRY_RUN, "step3_multi_gpu/train_fsdp.py",
        ["--model", "1b", "--fake-world-size", "8", "--fake-rank", "0", "--global-batch-size", "8", "--seq-len",
         "256", "--steps", "3", "--eval-batches", "0", "--trace-start", "1", "--trace-steps", "1",
         "--data", "synthetic"]),
    # 2 ranks on 2 cores: each rank has a core, so waiting is not confused with time-sharing
    Run("03_bubble", "tools/pipeline_bubble.py",
        ["--model", "small", "--global-batch-size", "8", "--seq-len", "128", "--steps", "6", "--eval-batches", "0",
         "--schedules", "gpipe,1f1b,interleaved1f1b,zbv,dualpipev", "--microbatches", "1,2,4,8"],
        nproc=2, job="2_ranks_pipeline", figures={"03_pipeline_bubble.png": "pipeline_bubble.png",
                                                  "03_pipeline_bubble.md": "pipeline_bubble.md",
                                                  "03_pipeline_timeline.png": "pipeline_timeline.png"}),
]

# The zero-bubble V schedules' memory beside 1F1B's: the same model, ranks and batch as the
# 03_strategies runs, in a folder of their own (tools/pipeline_bubble.py:v_memory_table)
PP_V = "03_pp_v/"
CHAPTER3B += [Run(PP_V + s, _PP, _3B + ["--schedule", s, "--microbatches", "8"], nproc=4, job="4_ranks_pp_v",
                  figures={f"03_memory_trace_pp_{s}.png": "memory_trace.png"} if s != "1f1b" else {})
              for s in ("1f1b", "zbv", "dualpipev")]


# ---- chapter 4: the communication lab (README: the communication lab) -------------------------------
CHAPTER4 = [
    Run("commlab_collectives", "step3_multi_gpu/bench_collectives.py", [], **_DP4,
        figures={"04_collectives_busbw.png": "collectives.png", "04_collectives_table.md": "collectives.md"}),
    Run("commlab_ring", "step3_multi_gpu/ring_allreduce.py", [], **_DP4,
        figures={"04_ring_vs_allreduce.png": "ring_vs_allreduce.png", "04_ring_table.md": "ring_allreduce.md"}),
    # --profile: compute and communication on one time line, and how much of it overlaps
    *[Run(f"04_profile/{name}", script, ["--model", "small", "--steps", "8", "--global-batch-size", "8", "--seq-len",
                                         "128", "--eval-batches", "0", "--profile", *extra], **_DP4,
          figures={f"04_profile_{name}.png": "profile_timeline.png"})
      for name, script, extra in (("ddp", "step3_multi_gpu/train_ddp.py", []),
                                  ("fsdp", "step3_multi_gpu/train_fsdp.py", []))],
    # Strong and weak scaling of DDP and FSDP, 1, 2 and 4 ranks (it launches its own torchrun jobs)
    Run("04_scaling", "tools/scaling.py", ["--model", "small", "--seq-len", "128", "--global-batch-size", "8",
                                           "--steps", "10"],
        figures={"04_scaling.png": "scaling.png", "04_scaling_table.md": "scaling.md"}),
    # The learning rate when the batch grows 4x, on the real text: keep, linear, square root
    Run("04_lr_scaling", "tools/lr_scaling.py", ["--model", "small", "--seq-len", "128", "--global-batch-size", "8",
                                                 "--steps", "200", "--warmup-steps", "20", "--k", "4",
                                                 "--eval-batches", "8"],
        figures={"04_lr_scaling.png": "lr_scaling.png", "04_lr_scaling_table.md": "lr_scaling.md"}),
    Run("commlab_comm_hooks", "step3_multi_gpu/compare_comm_hooks.py",
        ["--model", "small", "--steps", "30", "--seq-len", "128", "--global-batch-size", "8"], **_DP4,
        figures={"04_comm_hooks.png": "comm_hooks.png", "04_comm_hooks_table.md": "comm_hooks.md"}),
]

# ---- chapter 5: surviving faults (README: survive faults); the table reads the checkpoints
_5 = ["--model", "small", "--steps", "4", "--global-batch-size", "8", "--seq-len", "128", "--eval-batches", "0",
      "--no-trace-memory", "--ckpt-every", "2", "--amp", "off"]
CHAPTER5 = [
    Run("05_ddp4", "step3_multi_gpu/train_ddp.py", _5, **_DP4),
    Run("05_zero1_4", "step3_multi_gpu/train_ddp.py", _5 + ["--zero1"], **_DP4),
    Run("05_fsdp4", "step3_multi_gpu/train_fsdp.py", _5, **_DP4),
    # --ckpt-async's host copy in the memory trace: the default window (steps 1 and 2) holds the
    # checkpoint after step 1 (--ckpt-every 2)
    Run("05_memory_ckpt_async", "step3_multi_gpu/train_ddp.py",
        ["--model", "small", "--steps", "4", "--global-batch-size", "8", "--seq-len", "128", "--eval-batches", "0",
         "--ckpt-every", "2", "--ckpt-async", "--amp", "off"], nproc=2, job="05_ckpt_async",
        figures={"05_memory_trace_ckpt_async.png": "memory_trace.png"}),
]

# ---- float8 (step 2d) and DeepSpeed beside our ZeRO (step3_multi_gpu/deepspeed.md) ----------
# float8 beside a bf16 run of its own, so that --only 02_float8 redoes both; the DeepSpeed
# comparison is one tool that launches its own torchrun job (our three runs alone, saying
# so, where DeepSpeed is not installed).
FLOAT8_DS = [
    Run("02_float8/bf16", "step2_memory/train_amp.py", _CH2 + ["--amp", "bf16"], job="02_float8"),
    Run("02_float8/float8", "step2_memory/train_float8.py", _CH2, job="02_float8"),
    Run("03_deepspeed", "tools/deepspeed_compare.py", ["--model", "small", "--steps", "8", "--seq-len", "128",
                                                        "--global-batch-size", "8"], job="03_deepspeed",
        figures={"03_deepspeed.png": "deepspeed.png", "03_deepspeed_table.md": "deepspeed.md"}),
]

RUNS = CHAPTER1 + CHAPTER2 + CHAPTER3A + CHAPTER3B + CHAPTER4 + CHAPTER5 + FLOAT8_DS

# ---- chapter 3b, context parallelism (step3_multi_gpu/context_parallel.md) ----------------------
# One long sequence on 1, 2 and 4 ranks of train_cp.py (fp32: the formulas read plainly), and step
# 1's single process with the same flags for the losses. One job per world size.
_CP = ["--model", "small", "--seq-len", "1024", "--global-batch-size", "2", "--steps", "3", "--eval-batches", "0",
       "--trace-start", "1", "--trace-steps", "1"]
CHAPTER3_CP = [
    Run("03_cp/single", "step1_single_gpu/train.py", _CP, job="03_cp_one_process"),
    *[Run(f"03_cp/cp{n}", "step3_multi_gpu/train_cp.py", _CP + ["--amp", "off"], nproc=n, job=f"03_cp_{n}_ranks",
          figures={"03_cp_memory_trace.png": "memory_trace.png"} if n == 4 else {}) for n in (1, 2, 4)],
]
RUNS += CHAPTER3_CP
# ---- expert parallelism (step3_multi_gpu/expert_parallel.md): a mixture of experts on 4 ranks,
# with and without the load-balancing loss, and on one device; a job of its own (DTensor meshes)
_EP = ["--model", "small-moe", "--steps", "40", "--global-batch-size", "8", "--seq-len", "128", "--eval-batches", "1",
       "--trace-start", "2", "--trace-steps", "1"]
CHAPTER3_EP = [
    Run("03_ep/ep4", "step3_multi_gpu/train_ep.py", _EP + ["--amp", "off"], nproc=4, job="4_ranks_ep",
        figures={"03_ep_memory_trace.png": "memory_trace.png"}),
    Run("03_ep/ep4_no_aux", "step3_multi_gpu/train_ep.py", _EP + ["--amp", "off", "--aux-loss-weight", "0"], nproc=4,
        job="4_ranks_ep"),
    Run("03_ep/single", "step1_single_gpu/train.py", _EP),
    # two groups of 2 ranks, copies of each other: memory and bytes only, a few steps
    Run("03_ep/ep4_ep2", "step3_multi_gpu/train_ep.py", _EP + ["--amp", "off", "--ep", "2", "--steps", "6"], nproc=4,
        job="4_ranks_ep"),
]
RUNS += CHAPTER3_EP
# ---- one rank of a layout bigger than this machine runs: CP 8 and EP 8 as dry runs (their pages'
# "on one machine" paragraphs); the figures command shows each page the command it ran. Three
# steps: the second is traced, the third counted (DDP rebuilds its buckets in the second)
_DRY = ["--steps", "3", "--amp", "off", "--eval-batches", "0", "--trace-start", "1", "--trace-steps", "1"]
DRY_CP_EP = {
    "table-03-cp-dry-run": Run("03_cp/dry_cp8", "step3_multi_gpu/train_cp.py", [
        "--model", "small", "--seq-len", "1024", "--global-batch-size", "2", *_DRY, "--fake-world-size", "8"],
        job="03_cp_dry"),
    "table-03-ep-dry-run": Run("03_ep/dry_ep8", "step3_multi_gpu/train_ep.py", [
        "--model", "small-moe", "--seq-len", "128", "--global-batch-size", "8", *_DRY, "--fake-world-size", "8"],
        job="03_ep_dry"),
}
RUNS += list(DRY_CP_EP.values())


def run_dir(name: str, suffix: str = "") -> Path:
    """runs/figs/<name><suffix>; for a run inside a folder (03_strategies/tp) the suffix
    goes on the folder: runs/figs/03_strategies_cuda/tp."""
    head, _, tail = name.partition("/")
    return ROOT / "runs" / "figs" / (head + suffix) / tail


def summary(name: str, suffix: str = "") -> dict:
    return json.loads((run_dir(name, suffix) / "summary.json").read_text())


def n_param_tensors(s: dict) -> int:
    # embedding + 9 per block (4 attention, 3 MLP, 2 norms) + final norm + output
    return 9 * s["model_config"]["n_layers"] + 3


def chapter1_table(suffix: str = "") -> dict[str, str]:
    """The memory anatomy of the baseline: measured bytes beside 4N / 4N / 8N."""
    s = summary("baseline", suffix)
    n, mem = s["n_params"], s["memory"][0]
    peak, at = mem["peak_by_category"], mem["at_peak"]
    rows = [
        ("parameters", "4 N", 4 * n, peak["parameters"]),
        ("gradients", "4 N", 4 * n, peak["gradients"]),
        # On CPU AdamW keeps a 4-byte `step` counter per parameter tensor beside its state
        # (on CUDA that counter lives on the CPU, outside the GPU's bytes).
        ("optimizer state (AdamW)", "8 N" + (" + 4 B x tensors" if s["device"] == "cpu" else ""),
         8 * n + (4 * n_param_tensors(s) if s["device"] == "cpu" else 0), peak["optimizer state"]),
        ("activations", "grows with batch x seq", None, peak["activations"]),
        ("other (temporaries)", "", None, peak["other"]),
    ]
    lines = ["| category | formula | predicted | measured peak | at the step's peak |", "|---|---|---|---|---|"]
    for (name, formula, pred, got), cat in zip(rows, ("parameters", "gradients", "optimizer state",
                                                      "activations", "other")):
        exact = (lambda b: f"{b:,} B") if pred else fmt_bytes  # model state: to the byte
        lines.append(f"| {name} | {formula} | {exact(pred) if pred else ''} | {exact(got)} | "
                     f"{fmt_bytes(at[cat])} |")
    lines.append(f"| **total** | | | | **{fmt_bytes(mem['peak_bytes'])}** |")
    lines.append("")
    lines.append(f"N = {n:,} parameters ({s['model']} preset), batch {s['global_batch_size']} x "
                 f"{s['seq_len']} tokens, fp32, {s['device_name']}; "
                 f"{s['tokens_per_s']:,.0f} tokens/s, {s['step_time_s'] * 1e3:.0f} ms/step, loss "
                 f"{s['first_loss']:.2f} -> {s['final_loss']:.2f} in {s['steps']} steps.")
    return {"table-01" + suffix: "\n".join(lines)}


# The chapter ends with what its run learned: the generator on its weights, command and output shown.
GENERATE_01 = ["--prompt", "def fib(", "--max-new-tokens", "200", "--temperature", "0.8", "--top-k", "50", "--seed", "0"]


def chapter1_generation(suffix: str = "") -> dict[str, str]:
    """The baseline run's model continuing a prompt: python -m tools.generate on its weights.pt."""
    import shlex
    folder = run_dir("baseline", suffix)
    if not (folder / "weights.pt").is_file():
        raise FileNotFoundError(2, "no weights", str(folder / "weights.pt"))
    args = [str(folder.relative_to(ROOT)), *GENERATE_01, "--device", "cuda" if suffix else "cpu"]
    p = subprocess.run([sys.executable, "-m", "tools.generate", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    if p.returncode:
        raise UserError(f"python -m tools.generate failed: {p.stderr.strip()[-300:]}")
    text = p.stdout.rstrip("\n").replace("```", "`\u200b``")  # a fence in the output must not end the block
    return {"generate-01" + suffix: f"```bash\npython -m tools.generate {shlex.join(args)}\n```\n\n```text\n{text}\n```"}


# The faults page: a run that crashed and resumed is the run that never stopped, down to what its
# model writes. FSDP on 2 ranks, checkpoints every 4 steps; the second run crashes at step 6 and
# is started again with --resume; both gather their weights, and tools.generate samples from each.
_RESUME = ["step3_multi_gpu/train_fsdp.py", "--model", "small", "--steps", "12", "--ckpt-every", "4",
           "--amp", "off", "--no-trace-memory", "--eval-batches", "0", "--save-weights"]
_RESUME_PROMPT = ["--prompt", "import ", "--max-new-tokens", "120", "--temperature", "0.8", "--top-k", "50",
                  "--seed", "0"]


def bench_ckpt_block(suffix: str = "") -> dict[str, str]:
    """step4_multi_node/README.md's block bench-ckpt: what python -m tools.bench_ckpt prints
    (a checkpoint step's stall, synchronous vs --ckpt-async, on this machine)."""
    argv = ["--device", "cuda" if suffix else "cpu", "--out", str(run_dir("05_bench_ckpt", suffix).relative_to(ROOT))]
    p = subprocess.run([sys.executable, "-m", "tools.bench_ckpt", *argv], cwd=ROOT, capture_output=True, text=True,
                       timeout=900)
    if p.returncode:
        raise UserError(f"python -m tools.bench_ckpt failed: {p.stderr.strip()[-300:]}")
    return {"bench-ckpt" + suffix: f"```bash\npython -m tools.bench_ckpt {' '.join(argv)}\n```\n\n```\n{p.stdout.strip()}\n```"}


def resume_generation(suffix: str = "") -> dict[str, str]:
    """step4_multi_node/README.md's block resume-generate: the uninterrupted and the resumed
    run's models continue one prompt with one seed, and must write the same bytes."""
    import shlex
    device = "cuda" if suffix else "cpu"
    whole, crashed = run_dir("05_resume/whole", suffix), run_dir("05_resume/crashed", suffix)
    for folder in (whole, crashed):
        shutil.rmtree(folder, ignore_errors=True)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    show = "torchrun --standalone --nproc-per-node 2"
    steps = [(whole, [], 0), (crashed, ["--fail-at-step", "6"], None), (crashed, ["--resume"], 0)]
    shown = []
    for folder, extra, want in steps:
        argv = [*_RESUME, "--device", device, "--out", str(folder.relative_to(ROOT)), *extra]
        p = subprocess.run([*torchrun, *argv], cwd=ROOT, capture_output=True, text=True, timeout=900)
        if (want is not None and p.returncode != want) or (want is None and p.returncode == 0):
            raise UserError(f"{show} {shlex.join(argv)} exited {p.returncode}: {p.stderr.strip()[-300:]}")
        shown.append(f"{show} {shlex.join(argv)}" + ("     # crashes at step 6" if want is None else ""))
    texts = []
    for folder in (whole, crashed):
        argv = [str(folder.relative_to(ROOT)), *_RESUME_PROMPT, "--device", device]
        p = subprocess.run([sys.executable, "-m", "tools.generate", *argv], cwd=ROOT, capture_output=True,
                           text=True, timeout=600)
        if p.returncode:
            raise UserError(f"python -m tools.generate failed: {p.stderr.strip()[-300:]}")
        shown.append(f"python -m tools.generate {shlex.join(argv)}")
        # the continuation alone: the header names the folder and the last line the speed
        texts.append("\n".join(p.stdout.rstrip("\n").splitlines()[1:-1]))
    same = "the same bytes" if texts[0] == texts[1] else "DIFFERENT bytes"
    out = "\n".join(shown)
    body = (f"```bash\n{out}\n```\n\nThe uninterrupted run's model, then the resumed one's ({same}):\n\n"
            + "\n\n".join(f"```text\n{t.replace(chr(96) * 3, chr(96) + chr(8203) + chr(96) * 2)}\n```" for t in texts))
    if texts[0] != texts[1]:
        raise UserError(f"the resumed run's model wrote other bytes than the uninterrupted one's:\n{body}")
    return {"resume-generate" + suffix: body}


def chapter3b_table(suffix: str = "") -> dict[str, str]:
    """Measured per-rank memory, bytes and step time of every strategy among the 03_strategies
    runs; written to figs/03b_table.md and returned as {README marker: markdown}."""
    from step3_multi_gpu.tables import chapter3b_table as table
    runs = run_dir(STRATEGIES, suffix)
    if not runs.exists():
        print(f"skipped the chapter 3b table: {runs} is missing", flush=True)
        return {}
    names = [r.name.removeprefix(STRATEGIES) for r in CHAPTER3B if r.name.startswith(STRATEGIES)]
    md = table(runs, names, single=run_dir("03_single", suffix))
    (ROOT / "figs" / f"03b_table{suffix}.md").write_text(md + "\n")
    print(f"wrote figs/03b_table{suffix}.md", flush=True)
    return {"table-03b" + suffix: md}



def chapter2(suffix: str = "") -> dict[str, str]:
    """Each saving's trace beside the baseline's, the peaks by category, and the table.

    Returns {README marker: table}."""
    from tools.compare import RunResult, markdown_table, render_timelines, render_peak_bars

    runs = {r.name: RunResult.load(_CH2_LABELS[r.name], run_dir(r.name, suffix))
            for r in CHAPTER2 if r.name in _CH2_LABELS}
    bench = json.loads((run_dir("02_bench", suffix) / "bench.json").read_text())
    s = runs["02_baseline"].summary
    what = f"{s['model']} model, batch {s['global_batch_size']} x {s['seq_len']} tokens, {s['device_name']}"
    figs = ROOT / "figs"
    figs.mkdir(exist_ok=True)
    for name, fig, title in [
        ("02_amp", "02_memory_trace_amp", "AMP (bf16 autocast) beside the fp32 baseline"),
        ("02_amp_ac", "02_memory_trace_amp_ac", "AMP + full activation checkpointing beside the fp32 baseline"),
    ]:
        render_timelines([runs["02_baseline"], runs[name]], figs / f"{fig}{suffix}.png", f"{title}: {what}")
    render_timelines([runs["02_baseline"], runs["02_accum_fp32"], runs["02_amp_ac_accum"]],
                  figs / f"02_memory_trace_accum{suffix}.png",
                  f"Gradient accumulation (4 micro-batches of 2) beside the fp32 baseline: {what}")
    render_peak_bars(list(runs.values()), figs / f"02_peak_memory{suffix}.png",
                     f"What is alive at the memory peak, by category: {what}",
                     budget=None if suffix else (128 * 2**20, "a pretend 128 MiB device"))
    device = this_device(s["device"])
    info, times = bench["info"], {_CH2_LABELS["02_" + k]: v["min_s"] for k, v in bench["result"].items()}
    flops = {_CH2_LABELS["02_" + k]: v["matmul_flops"] for k, v in bench["result"].items()}
    threads = f" on {info['threads']} CPU thread{'s' if info['threads'] != 1 else ''}" if info["threads"] else ""
    load = (f" (load average {info['load_before']:.1f} before timing, {info['load_after']:.1f} after)"
            if info["load_before"] is not None else "")
    commands = [" ".join(["python", r.script, *r.flags[len(_CH2):]]) for r in CHAPTER2 if r.name in _CH2_LABELS]
    text = (f"Device: {device}; {what}.\n\n"
            f"Memory: live tensor bytes at each run's peak, from the memory tracer of the run the command makes. "
            f"Step time: the fastest of {info['rounds']} steps per set-up{threads}, the set-ups taking turns step "
            f"by step in one process (`python step2_memory/bench_memory_savers.py`; medians in "
            f"runs/figs/02_bench{suffix}/bench.md){load}. Matmul FLOPs: the matrix multiplies and attention of "
            f"one step, recomputation included, counted by PyTorch's FlopCounterMode.\n\n"
            + markdown_table(list(runs.values()), commands, step_times=times, flops=flops))
    (figs / f"02_table{suffix}.md").write_text(text)
    for f in ("02_memory_trace_amp", "02_memory_trace_amp_ac", "02_memory_trace_accum", "02_peak_memory", "02_table"):
        print(f"wrote figs/{f}{suffix}.{'md' if f.endswith('table') else 'png'}", flush=True)
    return {f"table-02{suffix}": text}


# chapter 3's strategies on one scale: run name -> label. All from the 03_strategies
# runs, which run DDP and FSDP on the same model, batch and sequence length
# as TP and PP (chapter 3a's own runs use 4 layers and 128 tokens, so they would not compare).
_CH3_COMPARE = {"03_strategies/ddp": "DDP", "03_strategies/fsdp": "FSDP (ZeRO-3)", "03_strategies/tp": "TP",
                "03_strategies/pp_1f1b": "PP (1F1B)", "03_strategies/2d": "2-D (FSDP x TP)"}


def chapter3_compare(suffix: str = "") -> dict[str, str]:
    """figs/03_memory_compare.png (and its per-rank peak bars) from chapter 3's runs, with
    ``python -m tools.compare``; the runs that are missing are left out."""
    from tools.compare import compare

    have = {name: label for name, label in _CH3_COMPARE.items() if (run_dir(name, suffix) / "summary.json").exists()
            and (run_dir(name, suffix) / "memory_trace.json").exists()}
    missing = [n for n in _CH3_COMPARE if n not in have]
    if missing:
        print(f"chapter 3 comparison: leaving out {', '.join(missing)} (no run in runs/figs/)", flush=True)
    if len(have) < 2:
        print("skipped the chapter 3 comparison: fewer than two of its runs exist", flush=True)
        return {}
    out = run_dir("03_compare", suffix)
    md = compare([run_dir(n, suffix) for n in have], list(have.values()), out,
                 title=None)
    shutil.copyfile(out / "memory_timelines.png", ROOT / "figs" / f"03_memory_compare{suffix}.png")
    shutil.copyfile(out / "peak_by_category.png", ROOT / "figs" / f"03_peak_by_rank{suffix}.png")
    (ROOT / "figs" / f"03_compare_table{suffix}.md").write_text(md)
    for f in (f"03_memory_compare{suffix}.png", f"03_peak_by_rank{suffix}.png", f"03_compare_table{suffix}.md"):
        print(f"wrote figs/{f}", flush=True)
    return {"table-03-compare" + suffix: md}


def chapter3_bf16_ac(suffix: str = "") -> dict[str, str]:
    """The bf16 + full AC runs of every strategy: their table (beside the fp32 one of
    chapter 3b) and their memory timelines on one scale, figs/03_memory_compare_bf16_ac.png."""
    from step3_multi_gpu.tables import chapter3b_table as table
    from tools.compare import compare

    names = [name for name, _, _ in _BF16_AC_RUNS]
    have = [n for n in names if (run_dir(BF16_AC + n, suffix) / "summary.json").exists()]
    if len(have) < 2:
        print("skipped the bf16 + AC table: fewer than two of its runs exist", flush=True)
        return {}
    md = table(run_dir(BF16_AC, suffix), have, single=run_dir("03_single", suffix))
    labels = {"ddp": "DDP", "fsdp": "FSDP (ZeRO-3)", "tp": "TP", "pp_1f1b": "PP (1F1B)", "2d": "2-D (FSDP x TP)"}
    out = run_dir("03_compare_bf16_ac", suffix)
    compare([run_dir(BF16_AC + n, suffix) for n in have], [labels[n] + ", bf16 + AC" for n in have], out, title=None)
    shutil.copyfile(out / "memory_timelines.png", ROOT / "figs" / f"03_memory_compare_bf16_ac{suffix}.png")
    (ROOT / "figs" / f"03_bf16_ac_table{suffix}.md").write_text(md + "\n")
    print(f"wrote figs/03_memory_compare_bf16_ac{suffix}.png and figs/03_bf16_ac_table{suffix}.md", flush=True)
    return {"table-03-bf16-ac" + suffix: md}


def dry_run_table(suffix: str = "") -> dict[str, str]:
    """The 1b dry run's rank against the formulas: per category, predicted and measured."""
    from common.measure.memory import CATEGORIES, fmt_bytes
    path = run_dir(DRY_RUN, suffix) / "summary.json"
    if not path.exists():
        print(f"skipped the dry-run table: {path} is missing", flush=True)
        return {}
    s = json.loads(path.read_text())
    return {"table-03-dry-run" + suffix: dry_run_md(s, "rank 0 of FSDP over 8, 1b model, batch 8 x 256, bf16")}


def dry_run_md(s: dict, head: str) -> str:
    """A dry run's summary.json as a table: per category and per collective, what theory.py
    predicts for its rank beside what the rank held and sent; its peak and step time below."""
    from common.measure.memory import CATEGORIES, fmt_bytes
    (mem,), (pred,) = s["memory"], s["predicted"]["per_rank"]
    lines = [f"| {head} | predicted (theory.py) | measured (dry run) |", "|---|---|---|"]
    for c in CATEGORIES:
        if c in pred:
            lines.append(f"| {c} | {fmt_bytes(pred[c])} | {fmt_bytes(pred[f'measured {c}'])} |")
    sent = {k: v["bytes"] for k, v in s["comm"][0].items()}
    want = {k: v for k, v in pred["comm"].items()}
    for k in sorted(sent):
        lines.append(f"| {k} per step | {fmt_bytes(want.get(k, 0))} | {fmt_bytes(sent[k])} |")
    lines += ["", f"Peak of the rank: {fmt_bytes(mem['peak_bytes'])}; {s['step_time_s']:.1f} s a step on "
                  f"{s['device_name']}, in one process. Model state is compared when the optimizer step begins, "
                  f"activations at their peak."]
    return "\n".join(lines)


def _md_table(text: str, header: str) -> list[str]:
    """The lines of the markdown table in ``text`` whose header row starts with ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return lines[start:end]


def bubble_table(suffix: str = "") -> dict[str, str]:
    """The pipeline-bubble table, copied into the README where its discussion is."""
    return {"table-03-bubble" + suffix: (ROOT / "figs" / f"03_pipeline_bubble{suffix}.md").read_text().strip()}


def chapter4_tables(suffix: str = "") -> dict[str, str]:
    """README copies of the communication lab's tables: the collectives at a few sizes with
    the latency/bandwidth fit, the ring's bytes and its timings beside gloo's, and the
    communication hooks."""
    name = f"04_collectives_table{suffix}.md"
    text = (ROOT / "figs" / name).read_text()
    table = _md_table(text, "| size")
    keep = {"1 KiB", "16 KiB", "256 KiB", "1 MiB", "4 MiB", table[-1].split("|")[1].strip()}
    rows = table[:2] + [r for r in table[2:] if r.split("|")[1].strip() in keep]
    fit = next(line for line in text.splitlines() if line.startswith("all_reduce latency alpha"))
    collectives = "\n".join(rows + ["", f"(busbw in GB/s; every size is in `figs/{name}`.) {fit}"])
    ring_md = (ROOT / "figs" / f"04_ring_table{suffix}.md").read_text()
    hooks = _md_table((ROOT / "figs" / f"04_comm_hooks_table{suffix}.md").read_text(), "| hook |")
    profile = ["| run (4 ranks, bf16) | rank | compute | communication | of it under compute |", "|---|---|---|---|---|"]
    for name in ("ddp", "fsdp"):
        path = run_dir(f"04_profile/{name}", suffix) / "summary.json"
        if path.exists():
            for r in json.loads(path.read_text())["profile"]:
                frac = r["overlapped_fraction"]
                profile.append(f"| {name.upper()} | {r['rank']} | {r['compute_s'] * 1e3:,.0f} ms | "
                               f"{r['comm_s'] * 1e3:,.0f} ms | {'-' if frac is None else f'{frac:.0%}'} |")
    profile_tables = {}
    for marker, name in (("table-04-scaling", "04_scaling_table"), ("table-04-lr-scaling", "04_lr_scaling_table")):
        if (ROOT / "figs" / f"{name}{suffix}.md").exists():
            profile_tables[marker + suffix] = (ROOT / "figs" / f"{name}{suffix}.md").read_text().strip()
    return {**profile_tables, "table-04-profile" + suffix: "\n".join(profile),
            "table-04-collectives" + suffix: collectives,
            "table-04-ring" + suffix: "\n".join(_md_table(ring_md, "| size | ring time")),
            "table-04-ring-bytes" + suffix: "\n".join(_md_table(ring_md, "| ring | numel")),
            "table-04-hooks" + suffix: "\n".join(hooks)}


# The estimator's answers the README quotes: README marker -> (the commands' arguments, in a
# code block?). Formulas, and three traces under FakeTensorMode: about 15 s in all on 2 cores;
# the H100 comparison (fit-h100-1b) traces four 1b steps more, about 15 s.
ESTIMATES = {
    "est-8b": ([["--model", "8b", "--world-size", "4", "--strategy", "all"]], False),
    "est-8b-ac": ([["--model", "8b", "--world-size", "4", "--strategy", "all", "--ac", "full"]], False),
    "est-1b": ([["--model", "1b", "--strategy", "single"],
                ["--model", "1b", "--strategy", "single", "--gpu-mem", "24", "--ac", "full"]], True),
    "est-trace-debug": ([["--model", "debug", "--world-size", "2", "--strategy", "fsdp", "--seq-len", "64",
                          "--batch", "4", "--trace"]], True),
    "est-trace-8b": ([["--model", "8b", "--world-size", "4", "--strategy", "fsdp", "--trace"]], True),
    "est-cp": ([["--model", "1b", "--strategy", "single", "--seq-len", "2048", "--batch", "4"],
                ["--model", "1b", "--world-size", "4", "--strategy", "cp", "--seq-len", "2048", "--batch", "4"]], True),
    "est-torchtitan-8b": ([["--model", "8b", "--vocab-size", "128256", "--world-size", "8", "--strategy", "fsdp",
                            "--batch", "16", "--seq-len", "8192", "--ac", "selective", "--loss-chunks", "16",
                            "--split-root-unit", "--trace"]], True),
    "est-trace-pp": ([["--model", "small", "--n-layers", "8", "--world-size", "4", "--strategy", "pp", "--batch", "8",
                       "--seq-len", "64", "--dtype", "fp32", "--microbatches", "8", "--trace"]], True),
}

ESTIMATES["est-1b-moe"] = ([["--model", "1b-moe", "--world-size", "8", "--strategy", "all"]], False)  # expert_parallel.md


def estimates(suffix: str = "") -> dict[str, str]:
    """The output of each ESTIMATES command, for the README's estimator chapter (the
    estimator runs on any machine: there is no _cuda version)."""
    import contextlib
    import io

    from tools.estimate import main as estimate
    if suffix:
        return {}
    blocks = {}
    for marker, (commands, fenced) in ESTIMATES.items():
        outs = []
        for argv in commands:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                estimate(argv)
            outs.append(out.getvalue().strip("\n"))
        text = "\n\n".join(outs)
        blocks[marker] = f"```\n{text}\n```" if fenced else text
    from tools.estimate import h100_comparison, torchtitan_comparison
    blocks["fit-h100-1b"] = h100_comparison()  # the formulas against the GPUs' 1b peaks
    blocks["fit-torchtitan-8b"] = torchtitan_comparison()  # torchtitan's 8B layout, saver by saver (90 s)
    return blocks


def gpu_check_report(suffix: str = "") -> dict[str, str]:
    """The reports ``python -m tools.gpu_check`` left in figs/ (one per GPU model), for the
    README's GPU section; a sentence saying there is none yet otherwise."""
    if suffix:
        return {}
    reports = [p for p in sorted((ROOT / "figs").glob("gpu_check_*.md")) if p.stem != "gpu_check_cpu"]
    if not reports:
        return {"gpu-check": "No GPU report is in figs/ yet: `python -m tools.gpu_check` on a CUDA machine writes "
                             "one (figs/gpu_check_<gpu>.md), and this command copies it here."}
    parts = []
    for p in reports:
        slug = p.stem.removeprefix("gpu_check_")
        pngs = sorted((ROOT / "figs").glob(f"*_cuda_{slug}.png"))
        rows = [f"| {png.name.split('_cuda_')[0]} | [CPU](figs/{png.name.split('_cuda_')[0]}.png) | "
                f"[{slug.upper()}](figs/{png.name}) |" for png in pngs]
        figs = (f"\n\nThe memory figures of these runs, beside the CPU ones the chapters show (the same layout):\n\n"
                f"| figure | CPU | CUDA |\n|---|---|---|\n" + "\n".join(rows)) if rows else ""
        parts.append(p.read_text().strip() + figs)
    return {"gpu-check": "\n\n".join(parts)}


def float8_table(suffix: str = "") -> dict[str, str]:
    """Step 2d: float8 beside bf16, same model, batch and steps: the losses, the memory at
    the peak against the bf16 prediction, and the (CPU-emulated) step time."""
    rows = ["| run | command | largest loss gap to bf16 | final loss | parameters | gradients | optimizer state | "
            "activations (predicted for bf16) | other | peak | step time |", "|" + "---|" * 11]
    ref = [json.loads(x)["loss"] for x in (run_dir("02_float8/bf16", suffix) / "metrics.jsonl").read_text().splitlines()]
    for name, label, cmd in (("bf16", "AMP bf16", "python step2_memory/train_amp.py"),
                             ("float8", "float8 + bf16", "python step2_memory/train_float8.py")):
        folder = run_dir(f"02_float8/{name}", suffix)
        s = summary(f"02_float8/{name}", suffix)
        loss = [json.loads(x)["loss"] for x in (folder / "metrics.jsonl").read_text().splitlines()]
        gap = max(abs(a - b) / a for a, b in zip(ref, loss))
        m, pred = s["memory"][0]["at_peak"], s["predicted"]["per_rank"][0]
        cells = [fmt_bytes(m[c], ".1f") for c in ("parameters", "gradients", "optimizer state")]
        act = f"{fmt_bytes(m['activations'], '.1f')} ({fmt_bytes(pred['activations'], '.1f')})"
        rows.append(f"| {label} | `{cmd}` | {gap:.2%} | {s['final_loss']:.4f} | {' | '.join(cells)} | {act} | "
                    f"{fmt_bytes(m['other'], '.1f')} | **{fmt_bytes(s['memory'][0]['peak_bytes'], '.1f')}** | "
                    f"{s['step_time_s'] * 1e3:,.0f} ms |")
    s = summary("02_float8/float8", suffix)
    head = (f"{s['model']} model, batch {s['global_batch_size']} x {s['seq_len']}, {s['steps']} steps, "
            f"{s['device_name']}; float8 layers: {len(s['float8']['converted'])} converted, kept in bf16: "
            f"{', '.join(s['float8']['skipped'])}.")
    return {"table-02-float8" + suffix: head + "\n\n" + "\n".join(rows)}


def deepspeed_table(suffix: str = "") -> dict[str, str]:
    """The DeepSpeed comparison's table (tools/deepspeed_compare.py wrote it), for its page."""
    return {"table-03-deepspeed" + suffix: (ROOT / "figs" / f"03_deepspeed_table{suffix}.md").read_text().strip()}


from step3_multi_gpu.tables import write_chapter3a_table, write_clip_table  # noqa: E402

from step4_multi_node.tables import write_faults_table  # noqa: E402
from tools.misuse import table as misuse_table  # noqa: E402
from step3_multi_gpu.ep_tables import write_ep_figures  # noqa: E402

# (prefix of what it writes in figs/, callable(suffix) -> {README marker: markdown}); each
# draws on the runs above and is redone when --only matches its prefix
POST_STEPS = [("01", chapter1_table), ("01", chapter1_generation), ("02", chapter2), ("03", write_chapter3a_table), ("03", chapter3b_table),
              ("03", chapter3_compare), ("03", chapter3_bf16_ac), ("03", dry_run_table), ("03", bubble_table),
              ("03", write_clip_table), ("04", chapter4_tables), ("05", write_faults_table),
              ("estimates", estimates), ("gpu", gpu_check_report), ("misuse", misuse_table),
              ("02_float8", float8_table), ("03_deepspeed", deepspeed_table)]
POST_STEPS.append(("03_ep", write_ep_figures))
POST_STEPS.append(("05_resume", resume_generation))
POST_STEPS.append(("05_bench_ckpt", bench_ckpt_block))

# The soak of step4_multi_node/README.md (--only chaos): FSDP on 2 CPU ranks, 6 random kills.
CHAOS = ["--script", "step3_multi_gpu/train_fsdp.py", "--kills", "6", "--steps", "60", "--ckpt-every", "5",
         "--seed", "7", "--timeout", "1500"]


def chaos_soak(suffix: str = "") -> dict[str, str]:
    """The faults page's block ``chaos-soak``: what ``python -m tools.chaos *CHAOS`` prints."""
    if suffix:
        return {}
    r = subprocess.run([sys.executable, "-m", "tools.chaos", *CHAOS, "--out", str(run_dir("chaos_soak", suffix))],
                       cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if r.returncode:
        raise UserError(f"python -m tools.chaos failed: {(r.stdout + r.stderr).strip()[-500:]}")
    return {"chaos-soak": f"```bash\npython -m tools.chaos {' '.join(CHAOS)}\n```\n\n{r.stdout.strip()}"}


POST_STEPS.append(("chaos", chaos_soak))

# The estimator's --dry-run beside its formula and its trace, for a layout no machine here could
# hold whole: Llama 3.2 1B's shape (its 128256-token vocabulary, synthetic ids) as rank 0 of FSDP
# over 8. Minutes on 2 cores (the rank runs the whole model's matmuls): a prefix of its own, so
# --only estimates stays quick (--only dry_estimate makes it).
DRY_ESTIMATE = ["--model", "1b", "--vocab-size", "128256", "--world-size", "8", "--strategy", "fsdp", "--batch", "8",
                "--seq-len", "256", "--device", "cpu", "--trace", "--dry-run"]


# And the 8b preset (7.0B parameters, 104 GiB of model state) as rank 0 of FSDP over 16, at 32
# tokens a sequence: about 5 minutes here, most of it the kernel handing out memory for each
# gathered block (--only dry8b makes it).
DRY_ESTIMATE_8B = ["--model", "8b", "--world-size", "16", "--strategy", "fsdp", "--batch", "16", "--seq-len", "32",
                   "--device", "cpu", "--dry-run"]
DRY_ESTIMATES = {"est-dry-run-1b": DRY_ESTIMATE, "est-dry-run-8b": DRY_ESTIMATE_8B}  # block -> its command


def dry_run_estimate(suffix: str = "", marker: str = "est-dry-run-1b") -> dict[str, str]:
    """will_it_fit.md's block ``marker``: what ``python -m tools.estimate *DRY_ESTIMATES[marker]`` prints."""
    import contextlib
    import io

    from tools.estimate import main as estimate
    if suffix:
        return {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        estimate(DRY_ESTIMATES[marker])
    return {marker: f"```\n{out.getvalue().strip()}\n```"}


POST_STEPS.append(("dry_estimate", dry_run_estimate))
POST_STEPS.append(("dry8b", lambda suffix="": dry_run_estimate(suffix, "est-dry-run-8b")))


def chapter3_cp(suffix: str = "") -> dict[str, str]:
    """The context-parallel figure and table (step3_multi_gpu/cp_tables.py)."""
    from step3_multi_gpu.cp_tables import cp_memory_figure
    return cp_memory_figure(run_dir, suffix)


POST_STEPS.append(("03_cp", chapter3_cp))


def cp_ep_dry_runs(suffix: str = "", prefix: str = "03_") -> dict[str, str]:
    """The CP and EP pages' dry-run blocks: the command (a bash block, so the README test
    runs it) and its rank's bytes beside theory.py's (EP's all-to-all at even routing,
    which the dry run assumes like the formula)."""
    blocks = {}
    for marker, run in DRY_CP_EP.items():
        if not run.name.startswith(prefix):
            continue
        s = summary(run.name, suffix)
        layout = {"cp": "CP", "ep": "EP"}[s["predicted"]["strategy"]]
        head = (f"rank {s['dry_run']['rank']} of {layout} over {s['dry_run']['world_size']}, {s['model']} model, "
                f"batch {s['global_batch_size']} x {s['seq_len']}, {s['dtype']}")
        blocks[marker + suffix] = (f"```bash\npython {run.script} {' '.join(run.flags)}\n```\n\n"
                                   + dry_run_md(s, head))
    return blocks


def cp_dry_run(suffix: str = "") -> dict[str, str]:
    return cp_ep_dry_runs(suffix, "03_cp")


def ep_dry_run(suffix: str = "") -> dict[str, str]:
    return cp_ep_dry_runs(suffix, "03_ep")


POST_STEPS += [("03_cp", cp_dry_run), ("03_ep", ep_dry_run)]

def pp_v_memory_table(suffix: str = "") -> dict[str, str]:
    """Per-rank activations of 1F1B, ZBV and DualPipeV, measured beside theory.py's prediction."""
    from tools.pipeline_bubble import v_memory_table
    md = v_memory_table({s: run_dir(PP_V + s, suffix) for s in ("1f1b", "zbv", "dualpipev")})
    (ROOT / "figs" / f"03_pp_v_memory{suffix}.md").write_text(md + "\n")
    return {"table-03-pp-v-memory" + suffix: md}


# The planner (tools/plan.py): its choice for Llama 3.1 8B's shape (the 8b preset with Llama 3's
# vocabulary) at torchtitan's local batch (2 x 8192 a GPU) on one H100 node and on four, its
# prediction of torchtitan's published runs, the figure of every layout that fits on four nodes,
# and the benchmark against this machine if tools/bench_plan.py has run (--only plan).
PLANS = {"plan-8b-1node": ["--model", "8b", "--vocab-size", "128256", "--gpus", "8", "--gpu", "h100",
                           "--global-batch-size", "16", "--seq-len", "8192", "--loss-chunks", "16",
                           "--split-root-unit", "--top", "3"],
         "plan-8b-4nodes": ["--model", "8b", "--vocab-size", "128256", "--gpus", "32", "--gpus-per-node", "8",
                            "--gpu", "h100", "--global-batch-size", "64", "--seq-len", "8192", "--top", "3"]}


def plan_blocks(suffix: str = "") -> dict[str, str]:
    import contextlib
    import io

    from tools.plan import build_parser, layouts_figure
    from tools.plan import main as plan
    if suffix:
        return {}
    blocks = {}
    for name, flags in {**PLANS, "plan-torchtitan": ["--torchtitan"]}.items():
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            plan(flags)
        text = out.getvalue().strip()
        blocks[name] = text if name == "plan-torchtitan" else f"```\n{text}\n```"
    layouts_figure(build_parser().parse_args(PLANS["plan-8b-4nodes"]), ROOT / "figs" / "plan_8b_layouts.png")
    bench = ROOT / "runs" / "bench_plan" / "bench_plan.md"
    if bench.exists():
        blocks["plan-bench"] = bench.read_text().strip()
    return blocks


POST_STEPS.append(("plan", plan_blocks))


POST_STEPS.append(("03", pp_v_memory_table))


def update_readme(tables: dict[str, str]):
    """Replace the text between <!-- BEGIN name --> and <!-- END name --> markers, in
    whichever page of the walkthrough (tools/docs.py) holds them."""
    from tools.docs import block
    for name, body in tables.items():
        found = block(name)
        if found is None:
            print(f"no page has a <!-- BEGIN {name} --> marker; table {name} not written", flush=True)
            continue
        path, _ = found
        begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
        head, rest = path.read_text().split(begin, 1)
        _, tail = rest.split(end, 1)
        path.write_text(f"{head}{begin}\n{body.strip(chr(10))}\n{end}{tail}")


def this_device(device: str) -> str:
    """The machine's name as the README states it: the GPU's, or the CPU's and its cores."""
    if device.startswith("cuda"):
        import torch
        return torch.cuda.get_device_name()
    import platform
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
             if line.startswith("model name")]
    return f"CPU ({names[0] if names else platform.processor()}, {len(names) or '?'} cores), no GPU"


def jobs(todo: list[Run]) -> list[list[Run]]:
    """The runs grouped by job, in the order each job first appears."""
    grouped: dict[str, list[Run]] = {}
    for r in todo:
        grouped.setdefault(r.job, []).append(r)
        if r.nproc != grouped[r.job][0].nproc:
            raise ValueError(f"run {r.name} has {r.nproc} processes but its job {r.job} has "
                             f"{grouped[r.job][0].nproc}: give it a job of its own")
    return list(grouped.values())


def fit_on_gpus(todo: list[Run], gpus: int) -> list[Run]:
    """The runs this machine's GPUs can make (NCCL wants a GPU per rank); says which are left out."""
    left_out = [r.name for r in todo if r.nproc > gpus]
    if left_out:
        print(f"leaving out {len(left_out)} runs that need more GPUs than the {gpus} here: {', '.join(left_out)}",
              flush=True)
    return [r for r in todo if r.nproc <= gpus]


def argv(run: Run, suffix: str, device: str) -> list[str]:
    return [*run.flags, "--out", str(run_dir(run.name, suffix).relative_to(ROOT)), "--device", device]


def command(run: Run, suffix: str, device: str) -> str:
    """The command that makes this run by itself."""
    launcher = "python" if run.nproc == 1 else f"torchrun --standalone --nproc-per-node {run.nproc}"
    return " ".join([launcher, run.script, *argv(run, suffix, device)])


def launch(job: list[Run], suffix: str, device: str, bar) -> None:
    """One process (or one torchrun job) for all of ``job``'s runs; its output goes to
    runs/figs/<job>.log, and each ``[multirun] done`` line it prints moves ``bar`` on.
    Exits with the log's tail if the job fails."""
    from tqdm import tqdm
    first = job[0]
    cmd = [sys.executable] if first.nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={first.nproc}"]
    cmd += ["tools/multirun.py", "--runs", json.dumps([{"name": r.name, "script": r.script,
                                                         "argv": argv(r, suffix, device)} for r in job])]
    log = ROOT / "runs" / "figs" / f"{first.job}{suffix}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    for r in job:  # a figure's run starts afresh: an older run's checkpoints there would be refused as another run's
        shutil.rmtree(run_dir(r.name, suffix) / "checkpoints", ignore_errors=True)
    by_name = {r.name: r for r in job}
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log, "w") as f, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                               stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            f.write(line)
            if "[multirun] start " in line:
                name = line.split("[multirun] start ", 1)[1].strip()
                bar.set_postfix_str(name)
                tqdm.write("$ " + command(by_name[name], suffix, device))
                f.write("$ " + command(by_name[name], suffix, device) + "\n")
            elif "[multirun] done " in line:
                bar.update(1)
    if proc.returncode:
        bar.close()
        print("\n".join(log.read_text().splitlines()[-40:]), file=sys.stderr)
        sys.exit(f"error: the job {first.job} failed (exit code {proc.returncode}); its whole output is in "
                 f"{log.relative_to(ROOT)}")


def record_provenance(written: list[Path], device: str, argv: list[str], path: Path = ROOT / "figs" / "made_on.json",
                      tool: str = "python -m tools.figures", entry: dict | None = None):
    """Remember, per file in figs/, the device, torch version, date and command that made it:
    regenerating one chapter keeps the others' entries. ``entry``: those four, when the files
    were made on another machine (a GPU's reports, merged here)."""
    import datetime

    import torch
    made = json.loads(path.read_text()) if path.exists() else {}
    entry = entry or {"device": this_device(device), "torch": torch.__version__.split("+")[0],
                      "date": datetime.date.today().isoformat(),
                      "command": " ".join([tool, *argv])}
    made.update({p.name: entry for p in written})
    made = {k: v for k, v in sorted(made.items()) if (path.parent / k).exists()}
    path.write_text(json.dumps(made, indent=1) + "\n")
    return made


def provenance_table(made: dict[str, dict]) -> str:
    """Which device made which figures: one row per chapter prefix and machine."""
    rows: dict[tuple, list[str]] = {}
    for name, e in made.items():
        rows.setdefault((name.split("_", 1)[0], e["device"], e["torch"], e["date"], e["command"]), []).append(name)
    lines = ["| files in figs/ | made on | torch | date | by |", "|---|---|---|---|---|"]
    for (prefix, dev, torch_version, date, cmd), names in rows.items():
        files = f"{len(names)} file{'s' if len(names) != 1 else ''}"
        lines.append(f"| `{prefix}_*` ({files}) | {dev} | {torch_version} | {date} | `{cmd}` |")
    return "\n".join(lines)


def main(argv=None):
    from tqdm import tqdm
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="regenerate only the figures whose names start with this")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = p.parse_args(argv)
    suffix = "" if args.device == "cpu" else "_cuda"
    # a run is redone if one of its figures, or its name (runs that only feed a table), matches --only
    todo = [r for r in RUNS if any(f.startswith(args.only) for f in r.figures) or (not r.figures and not args.only)
            or (args.only and r.name.startswith(args.only))]
    if not todo and not any(prefix.startswith(args.only) for prefix, _ in POST_STEPS):
        print(f"error: no figure or run name starts with {args.only!r}; figure names start with 01, 02, 03, 04 "
              f"or 05 (see figs/), --only estimates redoes the estimator's answers, --only misuse the troubleshooting table", file=sys.stderr)
        sys.exit(2)
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            print("error: --device cuda: this machine has no CUDA GPU (or this torch has no CUDA); leave "
                  "--device out to make the CPU figures", file=sys.stderr)
            sys.exit(2)
        todo = fit_on_gpus(todo, torch.cuda.device_count())
    start = time.time()
    bar = tqdm(total=len(todo), unit="run", desc="figures", dynamic_ncols=True)
    for job in jobs(todo):
        launch(job, suffix, args.device, bar)
        for run in job:
            for fig, src in run.figures.items():
                shutil.copyfile(run_dir(run.name, suffix) / src, ROOT / "figs" / fig.replace(".png", f"{suffix}.png"))
    bar.close()
    tables = {}
    for prefix, post in POST_STEPS:
        if not (prefix.startswith(args.only) or args.only.startswith(prefix)):
            continue
        try:
            tables.update(post(suffix) or {})
        except FileNotFoundError as e:  # --only skipped the runs this table needs
            print(f"skipped {post.__name__}: {e.filename} is missing", flush=True)
        except UserError as e:  # the same, said by tools/compare.py (a run folder missing)
            print(f"skipped {post.__name__}: {e}", flush=True)
    written = [f for f in sorted((ROOT / "figs").iterdir()) if f.stat().st_mtime >= start and f.name != "made_on.json"]
    made = record_provenance(written, args.device, sys.argv[1:] if argv is None else argv)
    tables["figs-made-on"] = provenance_table(made)
    update_readme(tables)
    print(f"wrote {len(written)} files in figs/ and {len(tables)} README tables in {time.time() - start:.0f} s; "
          f"the runs' output is in runs/figs/", flush=True)


if __name__ == "__main__":
    main()
