"""Chapter 3's figures and tables, made by ``python -m tools.figures --only 03`` (and the
communication lab's, ``--only 04``): the run lists of the data-parallel family (3a), the
model-parallel family (3b), context and expert parallelism, the dry runs and the
communication lab, and what turns their runs into the pages' figures and blocks
(README.md, model_parallel.md, comm_lab.md, will_it_fit.md, context_parallel.md,
expert_parallel.md, deepspeed.md here). The tables themselves are in tables.py,
cp_tables.py and ep_tables.py; the estimator's and the planner's answers that
will_it_fit.md quotes are made here too (``--only estimates``, ``dry_estimate``, ``plan``).

tools/figures.py gathers the run lists into its runs and POST_STEPS into its tables.
"""
from __future__ import annotations

import json
import shutil

from common import ROOT
from step3_multi_gpu.ep_tables import write_ep_figures
from step3_multi_gpu.tables import write_chapter3a_table, write_clip_table
from tools.figure_runs import DP4, Run, run_dir, summary

# ---- chapter 3a: the data-parallel family ---------------------------------------------
# fp32 (--amp off, step 3 defaults to bf16): the 16 bytes per parameter, and the formulas' bytes, read plainly
_3A = ["--model", "small", "--steps", "6", "--global-batch-size", "8", "--seq-len", "128", "--eval-batches", "2",
       "--amp", "off"]
CHAPTER3A: list[Run] = [
    Run("3a_ddp", "step3_multi_gpu/train_ddp.py", _3A, **DP4,
        figures={"03_memory_trace_ddp.png": "memory_trace.png"}),
    Run("3a_zero1", "step3_multi_gpu/train_ddp.py", _3A + ["--zero1"], **DP4,
        figures={"03_memory_trace_zero1.png": "memory_trace.png"}),
    Run("3a_fsdp_zero2", "step3_multi_gpu/train_fsdp.py", _3A + ["--no-reshard-after-forward"], **DP4,
        figures={"03_memory_trace_zero2.png": "memory_trace.png"}),
    Run("3a_fsdp_zero3", "step3_multi_gpu/train_fsdp.py", _3A, **DP4,
        figures={"03_memory_trace_fsdp.png": "memory_trace.png"}),
    Run("3a_hsdp", "step3_multi_gpu/train_fsdp.py", _3A + ["--hsdp", "2", "2"], **DP4,
        figures={"03_memory_trace_hsdp.png": "memory_trace.png"}),
    Run("3a_fsdp_bf16_ac", "step3_multi_gpu/train_fsdp.py", _3A + ["--amp", "bf16", "--ac", "full"],
        **DP4, figures={"03_memory_trace_fsdp_bf16_ac.png": "memory_trace.png"}),
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
BF16_AC = "03_bf16_ac/"  # the same strategies in bf16 with full activation checkpointing
DRY_RUN = "03_dry_run_1b_fsdp8"  # a dry run of one rank (--fake-world-size)
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
    Run("commlab_collectives", "step3_multi_gpu/bench_collectives.py", [], **DP4,
        figures={"04_collectives_busbw.png": "collectives.png", "04_collectives_table.md": "collectives.md"}),
    Run("commlab_ring", "step3_multi_gpu/ring_allreduce.py", [], **DP4,
        figures={"04_ring_vs_allreduce.png": "ring_vs_allreduce.png", "04_ring_table.md": "ring_allreduce.md"}),
    # --profile: compute and communication on one time line, and how much of it overlaps
    *[Run(f"04_profile/{name}", script, ["--model", "small", "--steps", "8", "--global-batch-size", "8", "--seq-len",
                                         "128", "--eval-batches", "0", "--profile", *extra], **DP4,
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
        ["--model", "small", "--steps", "30", "--seq-len", "128", "--global-batch-size", "8"], **DP4,
        figures={"04_comm_hooks.png": "comm_hooks.png", "04_comm_hooks_table.md": "comm_hooks.md"}),
]

# ---- DeepSpeed beside our ZeRO (deepspeed.md) ----------------------------------------------
# One tool that launches its own torchrun job (our three runs alone, saying so, where DeepSpeed
# is not installed).
DEEPSPEED = [
    Run("03_deepspeed", "tools/deepspeed_compare.py", ["--model", "small", "--steps", "8", "--seq-len", "128",
                                                        "--global-batch-size", "8"], job="03_deepspeed",
        figures={"03_deepspeed.png": "deepspeed.png", "03_deepspeed_table.md": "deepspeed.md"}),
]

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
    from common.measure.byte_units import fmt_bytes
    from common.measure.memory_categories import CATEGORIES
    path = run_dir(DRY_RUN, suffix) / "summary.json"
    if not path.exists():
        print(f"skipped the dry-run table: {path} is missing", flush=True)
        return {}
    s = json.loads(path.read_text())
    return {"table-03-dry-run" + suffix: dry_run_md(s, "rank 0 of FSDP over 8, 1b model, batch 8 x 256, bf16")}


def dry_run_md(s: dict, head: str) -> str:
    """A dry run's summary.json as a table: per category and per collective, what theory.py
    predicts for its rank beside what the rank held and sent; its peak and step time below."""
    from common.measure.byte_units import fmt_bytes
    from common.measure.memory_categories import CATEGORIES
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
# the GPU comparison (fit-gpu-1b) traces four 1b steps more, about 15 s.
ESTIMATES = {
    "est-8b": ([["--model", "8b", "--world-size", "4", "--strategy", "all"]], False),
    "est-8b-ac": ([["--model", "8b", "--world-size", "4", "--strategy", "all", "--ac", "full"]], False),
    # at the batch the GPU runs of the next section measured: there checkpointing decides a 24 GiB card
    # (at one sequence the optimizer step's peak is the same with it or without)
    "est-1b": ([["--model", "1b", "--strategy", "single", "--batch", "4", "--gpu-mem", "24"],
                ["--model", "1b", "--strategy", "single", "--batch", "4", "--gpu-mem", "24", "--ac", "full"]], True),
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
    from tools.estimate import gpu_1b_comparison, torchtitan_comparison
    blocks["fit-gpu-1b"] = gpu_1b_comparison()  # the formulas against the GPU's 1b peaks
    blocks["fit-torchtitan-8b"] = torchtitan_comparison()  # torchtitan's 8B layout, saver by saver (90 s)
    return blocks


def deepspeed_table(suffix: str = "") -> dict[str, str]:
    """The DeepSpeed comparison's table (tools/deepspeed_compare.py wrote it), for its page."""
    return {"table-03-deepspeed" + suffix: (ROOT / "figs" / f"03_deepspeed_table{suffix}.md").read_text().strip()}


# The estimator's --dry-run beside its formula and its trace, for a layout no machine here could
# hold whole: Llama 3.2 1B's shape (its 128256-token vocabulary, synthetic ids) as rank 0 of FSDP
# over 8. Minutes on 2 cores (the rank runs the whole model's matmuls): a prefix of its own, so
# --only estimates stays quick (--only dry_estimate makes it).
DRY_ESTIMATE = ["--model", "1b", "--vocab-size", "128256", "--world-size", "8", "--strategy", "fsdp", "--batch", "8",
                "--seq-len", "256", "--device", "cpu", "--trace", "--dry-run"]


# And the 8b preset (7.0B parameters, 104 GiB of model state) as rank 0 of FSDP over 16, at 32
# tokens a sequence: minutes on 2 cores (its block's first line says how long it took), most of it
# the kernel handing out memory for each gathered block (--only dry8b makes it).
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


def chapter3_cp(suffix: str = "") -> dict[str, str]:
    """The context-parallel figure and table (step3_multi_gpu/cp_tables.py)."""
    from step3_multi_gpu.cp_tables import cp_memory_figure
    return cp_memory_figure(run_dir, suffix)


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
    blocks["plan-8b-cp"] = plan_cp_table()
    bench = ROOT / "runs" / "bench_plan" / "bench_plan.md"
    if bench.exists():
        blocks["plan-bench"] = bench.read_text().strip()
    return blocks


def plan_cp_table() -> str:
    """Where context parallelism ranks in each of PLANS's plans, beside the fastest layout and the
    fastest without CP at CP's checkpointing: train_cp.py runs full AC or none (its ring attention
    refuses the selective modes), so the planner offers CP with full AC alone, and the page says
    what that costs against a layout with selective AC."""
    from common.model import get_config
    from tools.plan import AC_MODES, build_parser, check, evaluate, layout_name, layouts, machine_of
    lines = ["| plan | fastest layout | its step | fastest CP layout | its place | its step | CP / fastest | "
             "fastest without CP at CP's AC | its step |", "|---|---|---|---|---|---|---|---|---|"]
    for name, flags in PLANS.items():
        args = build_parser().parse_args(flags)
        check(args)
        machine = machine_of(args)
        cfg = get_config(args.model, n_layers=args.n_layers, vocab_size=args.vocab_size)
        acs = AC_MODES if args.ac == "all" else (args.ac,)
        fit, _ = evaluate(layouts(cfg, args.gpus, machine.gpus_per_node, args.global_batch_size or args.gpus,
                                  args.seq_len, args.dtype, "cuda", acs, args.loss_chunks, args.split_root_unit),
                          machine, args.compile, args.headroom)
        i, cp = next((i, r) for i, r in enumerate(fit, 1) if r["plan"].strategy.startswith("cp"))
        same = next(r for r in fit if not r["plan"].strategy.startswith("cp") and r["plan"].ac == cp["plan"].ac)
        ms = lambda r: f"{r['time']['step'] * 1e3:,.0f} ms"  # noqa: E731
        lines.append(f"| `{name}` | {layout_name(fit[0]['plan'])} | {ms(fit[0])} | {layout_name(cp['plan'])} | {i} of "
                     f"{len(fit)} | {ms(cp)} | {cp['time']['step'] / fit[0]['time']['step']:.2f} | "
                     f"{layout_name(same['plan'])} | {ms(same)} |")
    return "\n".join(lines)


# (prefix of what it writes in figs/, callable(suffix) -> {README marker: markdown}); each
# draws on the runs above and is redone when --only matches its prefix
POST_STEPS = [("03", write_chapter3a_table), ("03", chapter3b_table), ("03", chapter3_compare),
              ("03", chapter3_bf16_ac), ("03", dry_run_table), ("03", bubble_table), ("03", write_clip_table),
              ("04", chapter4_tables), ("estimates", estimates), ("03_deepspeed", deepspeed_table),
              ("03_ep", write_ep_figures), ("dry_estimate", dry_run_estimate),
              ("dry8b", lambda suffix="": dry_run_estimate(suffix, "est-dry-run-8b")),
              ("03_cp", chapter3_cp), ("03_cp", cp_dry_run), ("03_ep", ep_dry_run), ("plan", plan_blocks),
              ("03", pp_v_memory_table)]
