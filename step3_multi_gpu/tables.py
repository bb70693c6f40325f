"""Chapter 3's tables, made from the runs of figures.py here: 3a (the data-parallel
family, measured next to its formulas) and 3b (the model-parallel family side by side).

What the data-parallel family should cost, per rank:

The formulas of the chapter (N parameters in fp32, W ranks, AdamW):

                 model state per rank          communicated per rank per step
  DDP            4N + 4N + 8N = 16N            all-reduce 4N (gradients)
  ZeRO-1         4N + 4N + 8N/W                all-reduce 4N + broadcast 4N (updated weights)
  FSDP ZeRO-2    16N/W (+ all 4N gathered      all-gather 4N, reduce-scatter 4N
                 from forward to backward)
  FSDP ZeRO-3    16N/W (+ one or two blocks    all-gather 4N in forward + 4N in backward,
                 gathered at a time)           reduce-scatter 4N
  HSDP R x S     16N/S                         as FSDP over S ranks, + all-reduce 4N/S

The functions here make them exact for the tests, to the byte:
- AdamW's ``step`` counter is a 4-byte fp32 tensor per parameter tensor (on the CPU;
  on CUDA it stays on the host unless ``capturable`` or ``fused``), so the state is 8N + 4T bytes;
- FSDP shards each parameter along dim 0 in W chunks of ceil(rows / W) rows (the last
  ones shorter or empty) and pads its own storage, so parameters, gradients and the
  all-gathers are counted with the padded chunk, the AdamW state with the real one;
- FSDP keeps the root (embedding, final norm, output) gathered from forward to backward
  (gathering it again right away would be waste), so ZeRO-3's backward all-gather is
  4(N - N_root), not 4N.
"""
from __future__ import annotations

# The formulas live in common/measure/formulas.py (one definition each); this module holds the
# chapter's table.


# ---- the chapter's table, from the runs of figures.py here ----------------------------
# (run name, label, strategy, HSDP shard size or None)
TABLE_ROWS = [
    ("3a_ddp", "DDP", "ddp", None),
    ("3a_zero1", "ZeRO-1 (DDP + sharded AdamW)", "zero1", None),
    ("3a_fsdp_zero2", "FSDP ZeRO-2 (`--no-reshard-after-forward`)", "fsdp_zero2", None),
    ("3a_fsdp_zero3", "FSDP ZeRO-3", "fsdp_zero3", None),
    ("3a_hsdp", "HSDP 2 x 2, ZeRO-3 (`--hsdp 2 2`)", "hsdp_zero3", 2),
    ("3a_fsdp_bf16_ac", "FSDP ZeRO-3, bf16 + checkpointing", "fsdp_zero3", None),
]
_SIMPLE = {  # the formulas as the chapter writes them: (model state, bytes sent) in units of N
    "ddp": (lambda w, s: 16, lambda w, s: 4),
    "zero1": (lambda w, s: 8 + 8 / w, lambda w, s: 8),
    "fsdp_zero2": (lambda w, s: 16 / w, lambda w, s: 8),
    "fsdp_zero3": (lambda w, s: 16 / w, lambda w, s: 12),
    "hsdp_zero3": (lambda w, s: 16 / s, lambda w, s: 12 + 4 / s),
}
_COMM_TEXT = {"ddp": "AR 4N", "zero1": "AR 4N + B 4N", "fsdp_zero2": "AG 4N + RS 4N",
              "fsdp_zero3": "AG 2 x 4N + RS 4N", "hsdp_zero3": "AG 2 x 4N + RS 4N + AR 4N/S"}
_MEM_TEXT = {"ddp": "16N", "zero1": "8N + 8N/W", "fsdp_zero2": "16N/W", "fsdp_zero3": "16N/W",
             "hsdp_zero3": "16N/S"}
_SHORT = {"all_reduce": "AR", "broadcast": "B", "all_gather": "AG", "reduce_scatter": "RS",
          "all_reduce (grad norm)": "AR (grad norm)"}


def chapter3a_table(runs_dir, suffix: str = "") -> str:
    """Markdown: per-rank model state and bytes per step, measured next to the formula."""
    import json
    from pathlib import Path

    from common.measure.byte_units import fmt_bytes
    from common.measure.splits import param_shapes
    from common.model import get_config

    lines = ["| strategy | model state per rank: formula | = | measured (rank 0) | ratio | peak per rank "
             "| sent per rank per step: formula | = | measured (logical bytes) | ratio | a ring sends |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    first = None
    for name, label, strategy, shard in TABLE_ROWS:
        path = Path(runs_dir) / (name + suffix) / "summary.json"
        if not path.exists():
            continue
        s = json.loads(path.read_text())
        first = first or s
        n, w = s["n_params"], s["world_size"]
        mem_f, comm_f = (f(w, shard or w) for f in _SIMPLE[strategy])
        states = [sum(m["before_optimizer"][c] for c in ("parameters", "gradients", "optimizer state"))
                  for m in s["memory"]]
        spread = "" if len(set(states)) == 1 else f" (ranks differ by up to {fmt_bytes(max(states) - min(states))})"
        peaks = [m["peak_bytes"] for m in s["memory"]]
        comm = s["comm"][0]
        sent = sum(c["bytes"] for c in comm.values())
        wire = sum(c["wire_bytes"] for c in comm.values())
        parts = " + ".join(f"{_SHORT.get(k, k)} {fmt_bytes(c['bytes'])}" for k, c in comm.items())
        lines.append(f"| {label} | {_MEM_TEXT[strategy]} | {fmt_bytes(mem_f * n)} | {fmt_bytes(states[0])}{spread} "
                     f"| {states[0] / (mem_f * n):.4f} | {fmt_bytes(max(peaks))} | {_COMM_TEXT[strategy]} "
                     f"| {fmt_bytes(comm_f * n)} | {parts} | {sent / (comm_f * n):.3f} | {fmt_bytes(wire)} |")
    if first is None:
        return ""
    lines += ["", f"N = {first['n_params']:,} parameters ({first['model']} preset), W = {first['world_size']} "
              f"ranks, S = 2 (HSDP's shard group), batch {first['global_batch_size']} x {first['seq_len']} "
              f"tokens; {first.get('device_name', first['device'])}, gloo, fp32 unless marked. Model state = "
              "parameters + gradients + AdamW state when the optimizer step begins, from the memory trace (AdamW's "
              f"4-byte step counters, {4 * len(param_shapes(get_config(first['model'])))} B, put the ratio above 1 in "
              "its fifth or sixth decimal; ZeRO-1's rank 0 holds more AdamW state than the others, its partition "
              "being uneven); peak = the trace's highest point, activations "
              "included. AR all-reduce, B broadcast, AG all-gather, RS reduce-scatter; logical bytes count the whole "
              "tensor each collective works on, a ring sends 2(n-1)/n of that for AR and (n-1)/n for AG and RS, n being the group's size (W; S "
              "and R = W/S under HSDP), and B is counted at its root's full size (an upper bound: under ZeRO-1 each "
              "rank is the root for 1/W of the parameters, so on average it sends (W-1)/W). "
              "ZeRO-3 sends a little less than 12N because FSDP keeps the root (embedding, final norm, output) "
              "gathered from forward to backward; bf16 gathers half the bytes. Bytes are counted on steps 2 and 3, "
              "after the one-time work of the first two (DDP rebuilds its buckets in step 1)."]
    return "\n".join(lines)


def write_chapter3a_table(suffix: str = "") -> dict[str, str]:
    """A POST_STEPS entry of figures.py here: figs/03a_table.md, and the README block."""
    from common import ROOT as root

    md = chapter3a_table(root / "runs" / "figs", suffix)
    if not md:
        return {}
    (root / "figs" / f"03a_table{suffix}.md").write_text(md + "\n")
    print(f"wrote figs/03a_table{suffix}.md", flush=True)
    return {"table-03a" + suffix: md}


# ---- chapter 3b: the model-parallel family ----------------------------------------------------
_LABELS = {
    "single": "one device (step 1, fp32)",
    "tp": "TP {tp}", "tp_sp": "TP {tp} + sequence parallel", "pp_gpipe": "PP {pp}, GPipe",
    "pp_1f1b": "PP {pp}, 1F1B", "pp_interleaved": "PP {pp}, interleaved 1F1B (2 stages/rank)",
    "2d": "2-D: FSDP {dp} x TP {tp}", "fsdp_via_2d": "FSDP {dp} (train_2d.py --tp 1)", "ddp": "DDP {dp}",
    "fsdp": "FSDP {dp} (train_fsdp.py)",
}


def chapter3b_table(runs_dir, names: list[str], single=None) -> str:
    """One row per strategy from its summary.json: per-rank memory, bytes sent, step time.

    ``single``: the step 1 run with the same flags, the first row."""
    import json
    from pathlib import Path

    from common.measure.comm import sent_per_step
    from common.measure.byte_units import fmt_bytes
    from common.model import ModelConfig, count_params

    def span(values, fmt=fmt_bytes):
        lo, hi = min(values), max(values)
        return fmt(lo) if abs(hi - lo) <= 0.005 * max(hi, 1) else f"{fmt(lo)} – {fmt(hi)}"

    head = ("| strategy | parameters / rank | gradients / rank | AdamW state / rank | activations / rank "
            "(peak) | peak / rank | sent per step / rank (logical) | on the wire / rank | step time |")
    lines = [head, "|" + "---|" * 9]
    s = None
    paths = [(name, Path(runs_dir) / name / "summary.json") for name in names]
    if single is not None:
        paths.insert(0, ("single", Path(single) / "summary.json"))
    for name, path in paths:
        if not path.exists():
            continue
        s = json.loads(path.read_text())
        par = {"tp": 1, "pp": 1, "dp": 1, **s.get("parallel", {})}
        mem = s["memory"]
        cat = lambda c: [m["peak_by_category"][c] for m in mem]  # noqa: E731
        comm = s.get("comm") or [{}]
        sent = [sent_per_step(c) for c in comm]
        label = _LABELS.get(name, name).format(**par)
        if "microbatches" in s:
            label += f", m={s['microbatches']}"
        lines.append(f"| {label} | {span(cat('parameters'))} | {span(cat('gradients'))} | "
                     f"{span(cat('optimizer state'))} | {span(cat('activations'))} | "
                     f"{span([m['peak_bytes'] for m in mem])} | {span([a for a, _ in sent])} | "
                     f"{span([b for _, b in sent])} | {s['step_time_s'] * 1e3:,.0f} ms |")
    if s is None:
        return "(no runs found)"
    cfg = s["model_config"]
    n = s["n_params"]
    world = s["world_size"]
    assert n == count_params(ModelConfig(**cfg))
    ac = (s.get("predicted") or {}).get("ac", "none")
    how = s.get("dtype", "fp32") + ("" if ac == "none" else f" + {ac} activation checkpointing")
    lines += ["", f"Measured on {s['device_name']} ({s['backend']}), {world} ranks, {how}: the {s['model']} preset with "
              f"{cfg['n_layers']} layers (N = {n:,} parameters, {fmt_bytes(4 * n)} of fp32 weights), global batch "
              f"{s['global_batch_size']} x {s['seq_len']} tokens. Memory: the tracer's peak per category "
              f"(a range where the ranks differ). Bytes: per optimizer step, as common/measure/comm.py counts them; "
              f"'on the wire' is what a ring algorithm makes each rank send. Step time: rank 0's mean "
              f"over the untraced steps after the first."]
    return "\n".join(lines)


# ---- clipping by the global norm, and the wrong way --------------------------------------------
CLIP_RUNS = [("fsdp", "FSDP 4"), ("tp", "TP 4"), ("pp", "PP 4 (1F1B)")]


def clip_table(runs_dir) -> str:
    """Each strategy clipped by the global norm (--clip-by global) and by each rank's own
    (--clip-by local), against one device: the norms rank 0 logged and the losses."""
    import json
    from pathlib import Path

    def rows(name):
        path = Path(runs_dir) / name / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else None

    single = rows("single")
    if single is None:
        return ""
    lines = ["| run | clipping by | grad_norm, step 0 | grad_norm, last step | loss, last step | "
             "loss minus one device's |", "|---|---|---|---|---|---|",
             f"| one device (step 1) | the whole model | {single[0]['grad_norm']:.4f} | {single[-1]['grad_norm']:.4f} "
             f"| {single[-1]['loss']:.5f} | |"]
    for name, label in CLIP_RUNS:
        for how in ("global", "local"):
            r = rows(f"{name}_{how}")
            if r is None:
                continue
            lines.append(f"| {label} | {'the global norm' if how == 'global' else 'each rank its own'} | "
                         f"{r[0]['grad_norm']:.4f} | {r[-1]['grad_norm']:.4f} | {r[-1]['loss']:.5f} | "
                         f"{r[-1]['loss'] - single[-1]['loss'] + 0.0:+.5f} |".replace("-0.00000", "+0.00000"))
    s = json.loads((Path(runs_dir) / "single" / "summary.json").read_text())
    lines += ["", f"{s['model']} preset, {s['model_config']['n_layers']} layers, batch {s['global_batch_size']} x "
              f"{s['seq_len']} tokens, {s['steps']} steps, --max-norm 0.5 (every step clips); "
              f"{s.get('device_name', s['device'])}, fp32. grad_norm is the norm before clipping as rank 0 logged it: "
              "with --clip-by local, the norm of rank 0's part only."]
    return "\n".join(lines)


def write_clip_table(suffix: str = "") -> dict[str, str]:
    """A POST_STEPS entry of figures.py here: figs/03_clip_table.md, and the README block."""
    from common import ROOT as root

    md = clip_table(root / "runs" / "figs" / f"03_clip{suffix}")
    if not md:
        return {}
    (root / "figs" / f"03_clip_table{suffix}.md").write_text(md + "\n")
    print(f"wrote figs/03_clip_table{suffix}.md", flush=True)
    return {"table-03-clip" + suffix: md}
