"""Chapter 2's figures and tables, made by ``python -m tools.figures --only 02``: each
memory saver's trace beside the baseline's, the peaks by category and the table (block
``table-02`` of README.md here), and float8 beside bf16 (``--only 02_float8``, block
``table-02-float8``), the logits at a real vocabulary (``--only 02_vocab``) and what a corpus
of a billion tokens costs the loader (``--only 02_bench_data``, README.md's block ``bench-data``)
and what ``--doc-mask`` changes (``--only 02_doc_mask``, block ``doc-mask``).

tools/figures.py gathers CHAPTER2 and FLOAT8 into its runs and POST_STEPS into its tables.
"""
from __future__ import annotations

import json

from common import ROOT
from common.errors import UserError
from common.measure.byte_units import fmt_bytes
from tools.figure_runs import Run, run_dir, summary, this_device, tool_block

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

# ---- float8 (step 2.6) ----------------------------------------------------------------------
# float8 beside a bf16 run of its own, so that --only 02_float8 redoes both.
FLOAT8 = [
    Run("02_float8/bf16", "step2_memory/train_amp.py", _CH2 + ["--amp", "bf16"], job="02_float8"),
    Run("02_float8/float8", "step2_memory/train_float8.py", _CH2, job="02_float8"),
]


# ---- a real vocabulary: the logits, and --loss-chunks ----------------------------------------
# The tutorial's bytes give the output layer 256 columns; a subword tokenizer gives it tens of
# thousands, and then the logits (tokens x vocabulary, fp32 in the loss) take a large share of the
# peak. The same small model at a 32,768-token vocabulary (random tokens), the plain loss beside
# --loss-chunks 8 (train_ddp.py at one rank: the script that offers it, plain python).
_VOCAB = ["--model", "small", "--global-batch-size", "8", "--seq-len", "256", "--steps", "4", "--eval-batches", "0",
          "--vocab-size", "32768", "--data", "synthetic", "--amp", "off"]
VOCAB_RUNS = [Run("02_vocab/plain", "step3_multi_gpu/train_ddp.py", _VOCAB, job="02_vocab"),
              Run("02_vocab/chunks", "step3_multi_gpu/train_ddp.py", _VOCAB + ["--loss-chunks", "8"], job="02_vocab")]


def vocab_table(suffix: str = "") -> dict[str, str]:
    """The two runs' traces on one scale (figs/02_memory_trace_vocab.png) and what is alive at
    each one's peak, beside the size of the logits (block ``table-02-vocab``)."""
    from tools.compare import RunResult, render_timelines

    runs = {name: RunResult.load(label, run_dir(f"02_vocab/{name}", suffix))
            for name, label in (("plain", "plain loss"), ("chunks", "--loss-chunks 8"))}
    s = runs["plain"].summary
    tokens, vocab = s["global_batch_size"] * s["seq_len"], s["model_config"]["vocab_size"]
    what = (f"{s['model']} model at a {vocab:,}-token vocabulary, batch {s['global_batch_size']} x {s['seq_len']} "
            f"tokens, fp32, {s['device_name']}")
    render_timelines(list(runs.values()), ROOT / "figs" / f"02_memory_trace_vocab{suffix}.png",
                     f"The loss at a real vocabulary, plain and in 8 chunks: {what}")
    rows = ["| run | command | parameters | gradients | optimizer state | activations | other | peak |",
            "|" + "---|" * 8]
    for name, r in runs.items():
        m = r.summary["memory"][0]
        cells = " | ".join(fmt_bytes(m["at_peak"][c], ".1f") for c in ("parameters", "gradients", "optimizer state",
                                                                            "activations", "other"))
        cmd = " ".join(["python step3_multi_gpu/train_ddp.py", *(["--loss-chunks", "8"] if name == "chunks" else [])])
        rows.append(f"| {r.label} | `{cmd}` | {cells} | **{fmt_bytes(m['peak_bytes'], '.1f')}** |")
    peaks = {name: r.summary["memory"][0]["peak_bytes"] for name, r in runs.items()}
    params = s["memory"][0]["at_peak"]["parameters"]
    text = (f"The {s['model']} model at a {vocab:,}-token vocabulary, batch {s['global_batch_size']} x "
            f"{s['seq_len']} tokens, fp32, on {this_device(s['device'])}; each command with "
            f"`{' '.join(_VOCAB)}`. The fp32 logits of one step: {tokens:,} tokens x {vocab:,} x 4 bytes = "
            f"{fmt_bytes(4 * tokens * vocab, '.1f')}, {4 * tokens * vocab / params:.1f}x the model's parameters "
            f"({fmt_bytes(params, '.1f')}). The plain loss peaks at the start of backward, where the logits, "
            f"their log-probabilities and the gradients made from them are alive together; in 8 chunks the "
            f"peak is {peaks['chunks'] / peaks['plain']:.2f}x that.\n\n" + "\n".join(rows))
    print(f"wrote figs/02_memory_trace_vocab{suffix}.png", flush=True)
    return {f"table-02-vocab{suffix}": text}


def chapter2(suffix: str = "") -> dict[str, str]:
    """Each saving's trace beside the baseline's, the peaks by category, and the table.

    Returns {README marker: table}."""
    from tools.compare import RunResult, markdown_table, render_timelines, render_peak_bars

    runs = {r.name: RunResult.load(_CH2_LABELS[r.name], run_dir(r.name, suffix))
            for r in CHAPTER2 if r.name in _CH2_LABELS}
    bench = json.loads((run_dir("02_bench", suffix) / "bench.json").read_text())
    s = runs["02_baseline"].summary
    setup = f"{s['model']} model, batch {s['global_batch_size']} x {s['seq_len']} tokens"
    what = f"{setup}, {s['device_name']}"  # (the figures' titles name the device; the table's first line does)
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
    counted = (" and its attention" if suffix else  # on a CPU: _scaled_dot_product_flash_attention_for_cpu
               " (not attention: FlopCounterMode has no formula for the CPU's attention kernel)")
    text = (f"Device: {device}; {setup}.\n\n"
            f"Memory: live tensor bytes at each run's peak, from the memory tracer of the run the command makes. "
            f"Step time: the fastest of {info['rounds']} steps per set-up{threads}, the set-ups taking turns step "
            f"by step in one process (`python step2_memory/bench_memory_savers.py --steps {info['rounds']}`; medians in "
            f"runs/figs/02_bench{suffix}/bench.md, which `python -m tools.figures --only 02` writes){load}. Matmul FLOPs: the matrix multiplies of one step{counted}, "
            f"recomputation included, counted by PyTorch's FlopCounterMode.\n\n"
            + markdown_table(list(runs.values()), commands, step_times=times, flops=flops))
    (figs / f"02_table{suffix}.md").write_text(text)
    for f in ("02_memory_trace_amp", "02_memory_trace_amp_ac", "02_memory_trace_accum", "02_peak_memory", "02_table"):
        print(f"wrote figs/{f}{suffix}.{'md' if f.endswith('table') else 'png'}", flush=True)
    return {f"table-02{suffix}": text}


def _allocator_peak(m: dict) -> str:
    """The allocator's peak of a run, and the part of it no op handed the tracer."""
    if not m.get("allocator_peak_bytes"):
        return "-"
    unseen = (m.get("allocator_unseen_at_peak") or {}).get("bytes") or 0
    return fmt_bytes(m["allocator_peak_bytes"], ".1f") + (f" ({fmt_bytes(unseen, '.1f')} unseen)" if unseen >= 2**20
                                                            else "")


def float8_table(suffix: str = "") -> dict[str, str]:
    """Step 2.6: float8 beside bf16, same model, batch and steps: the losses, the memory at
    the peak against the bf16 prediction, and the (CPU-emulated) step time."""
    rows = ["| run | command | largest loss gap to bf16 | final loss | parameters | gradients | optimizer state | "
            "activations | other | peak | allocator's peak | activations at their own peak (predicted for bf16) | "
            "step time |", "|" + "---|" * 13]
    ref = [json.loads(x)["loss"] for x in (run_dir("02_float8/bf16", suffix) / "metrics.jsonl").read_text().splitlines()]
    for name, label, cmd in (("bf16", "AMP bf16", "python step2_memory/train_amp.py"),
                             ("float8", "float8 + bf16", "python step2_memory/train_float8.py")):
        folder = run_dir(f"02_float8/{name}", suffix)
        s = summary(f"02_float8/{name}", suffix)
        loss = [json.loads(x)["loss"] for x in (folder / "metrics.jsonl").read_text().splitlines()]
        gap = max(abs(a - b) / a for a, b in zip(ref, loss))
        m, pred = s["memory"][0]["at_peak"], s["predicted"]["per_rank"][0]
        cells = [fmt_bytes(m[c], ".1f") for c in ("parameters", "gradients", "optimizer state", "activations")]
        # the formula's activations are their own peak (theory.py), not their share of the step's peak
        own = s["memory"][0]["peak_by_category"]["activations"]
        act = f"{fmt_bytes(own, '.1f')} ({fmt_bytes(pred['activations'], '.1f')})"
        rows.append(f"| {label} | `{cmd}` | {gap:.2%} | {s['final_loss']:.4f} | {' | '.join(cells)} | "
                    f"{fmt_bytes(m['other'], '.1f')} | **{fmt_bytes(s['memory'][0]['peak_bytes'], '.1f')}** | "
                    f"{_allocator_peak(s['memory'][0])} | {act} | {s['step_time_s'] * 1e3:,.0f} ms |")
    s = summary("02_float8/float8", suffix)
    head = (f"{s['model']} model, batch {s['global_batch_size']} x {s['seq_len']}, {s['steps']} steps, "
            f"{s['device_name']} (each command with `{' '.join(_CH2)}`); float8 layers: {len(s['float8']['converted'])} converted, kept in bf16: "
            f"{', '.join(s['float8']['skipped'])}. The peak and its categories are the memory tracer's; the "
            f"allocator's peak is the device allocator's own count of the same steps, with what it held at its "
            f"peak that no op handed the tracer (allocated inside an op).")
    return {"table-02-float8" + suffix: head + "\n\n" + "\n".join(rows)}


def bench_data_block(suffix: str = "") -> dict[str, str]:
    """README.md's block bench-data: what python -m tools.bench_data prints (a run's resident
    memory and data wait on corpora of 10 million to a billion tokens, on this machine)."""
    argv = ["--device", "cuda" if suffix else "cpu", "--out", str(run_dir("02_bench_data", suffix).relative_to(ROOT))]
    return tool_block("bench-data" + suffix, "tools.bench_data", argv, timeout_s=3600)


# ---- --doc-mask, measured: the same runs with and without it -------------------------------
# The standard library's files as documents (bytes, an end-of-text token between two), the small
# model at 1,024 tokens a sequence, in one process (tools.multirun.run_script), one after the other.
_DOC_MASK = ["--model", "small", "--global-batch-size", "8", "--seq-len", "1024", "--steps", "30", "--eval-every", "30",
             "--eval-batches", "4", "--amp", "off", "--no-trace-memory", "--device", "cpu"]


def doc_mask_block(suffix: str = "") -> dict[str, str]:
    """README.md's block doc-mask: train_ddp.py at one rank on the stdlib prepared as documents,
    plain causal attention beside --doc-mask: the losses, the step time, and how many windows
    hold a document boundary (where the mask changes anything)."""
    if suffix:
        return {}  # (a CPU measurement: the GPU's fastest causal kernels are the point there, not measured here)
    import torch

    from common.data import Batches, load_corpus
    from tools.bench_data import stdlib_texts, write_source
    from tools.multirun import run_script
    from tools.prepare_data import main as prepare_data
    out = run_dir("02_doc_mask")
    out.mkdir(parents=True, exist_ok=True)
    texts = stdlib_texts()
    write_source(out / "stdlib.jsonl", sum(len(t.encode()) for t in texts), texts)  # each file once
    prepare_data([str(out / "stdlib.jsonl"), "--out", str(out / "data"), "--tokenizer", "bytes"])
    rows = {}
    for name, extra in (("causal (default)", []), ("--doc-mask", ["--doc-mask"])):
        folder = out / ("mask" if extra else "plain")
        code, err = run_script("step3_multi_gpu/train_ddp.py", [*_DOC_MASK, *extra, "--data", str(out / "data"),
                                                                 "--out", str(folder)], capture_stderr=True)
        if code:
            raise UserError(f"the {name} run failed: {err.strip()[-300:]}")
        rows[name] = json.loads((folder / "summary.json").read_text())
    s = rows["causal (default)"]
    corpus = load_corpus(str(out / "data"), vocab_size=s["model_config"]["vocab_size"])
    eot = json.loads((out / "data" / "meta.json").read_text())["tokenizer"]["eot_id"]
    seq = s["seq_len"]
    batches = iter(Batches(corpus.train, seq, s["global_batch_size"], seed=s["seed"]))  # the runs' own windows
    x = torch.cat([next(batches)[0] for _ in range(s["steps"])])
    # the mask starts a document after each end-of-text token but the window's last
    crossing = float((x[:, :-1] == eot).any(dim=1).float().mean())
    lines = [f"{s['model']} model ({s['n_params'] / 1e6:.1f}M parameters), {s['global_batch_size']} x {seq} byte tokens a "
             f"step, {s['steps']} steps, fp32, {s['device_name']}, each run with `{' '.join(_DOC_MASK)}` on the standard "
             f"library's files prepared as documents (`--tokenizer bytes`); {crossing:.0%} of the windows trained on "
             f"hold an end-of-text token before their last position, so a document starts inside them (the mask "
             f"changes nothing in the others).", "",
             "| attention | loss at the last step | held-out loss | step (mean) | tokens/s |", "|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['final_loss']:.4f} | {r['val_loss']:.4f} | {r['step_time_s'] * 1e3:,.0f} ms | "
                     f"{r['tokens_per_s']:,.0f} |")
    return {"doc-mask": "\n".join(lines)}


def bench_model_block(suffix: str = "") -> dict[str, str]:
    """Section 2.4's block: our block's kernels and bytes against GPT-2's (tools/bench_model.py;
    the counts are the same on any CPU, and on a GPU it times both models too)."""
    return tool_block(f"bench-model{suffix}", "tools.bench_model", [])


# (prefix of what it writes in figs/, callable(suffix) -> {README marker: markdown})
POST_STEPS = [("02", chapter2), ("02_float8", float8_table), ("02_vocab", vocab_table),
              ("02_bench_data", bench_data_block), ("02_doc_mask", doc_mask_block),
              ("02_bench_model", bench_model_block)]
