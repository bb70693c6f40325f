"""The context-parallel page's figure and table, from the 03_cp runs of figures.py here:
the same model, batch and long sequence on 1, 2 and 4 ranks of train_cp.py, and step 1's
single process beside them for the losses."""
from __future__ import annotations

import json

from common import ROOT
from common.measure.byte_units import fmt_bytes
from common.measure.plan import Plan
from common.measure.theory import predict
from common.model import get_config
from common.figure_file import save_figure

DEGREES = (1, 2, 4)


def _load(folder):
    s = json.loads((folder / "summary.json").read_text())
    losses = [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return s, losses


def cp_memory_figure(run_dir, suffix: str = "") -> dict[str, str]:
    """figs/03_cp_memory.png (per-rank activations against the CP degree, measured on the
    formula's curve) and figs/03_cp_table.md; returns {page marker: the table}."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {n: _load(run_dir(f"03_cp/cp{n}", suffix)) for n in DEGREES}
    single, single_losses = _load(run_dir("03_cp/single", suffix))
    s1 = runs[1][0]
    cfg = get_config(s1["model"], n_layers=s1["model_config"]["n_layers"])
    batch, seq, dtype = s1["global_batch_size"], s1["seq_len"], s1["dtype"]
    MiB = 2**20

    def formula(n):
        return predict(Plan(cfg, "cp", world=n, batch=batch, seq_len=seq, dtype=dtype,
                            device="cuda" if suffix else "cpu"))

    rows = ["| CP degree | tokens per rank | activations per rank, measured (formula) | peak per rank | "
            "ring: sent per step per rank, measured (formula) | gradients' all-reduce | losses vs one device |",
            "|---|---|---|---|---|---|---|"]
    measured, peaks, state = {}, {}, {}
    for n, (s, losses) in runs.items():
        mem = s["memory"]
        measured[n] = max(m["peak_by_category"]["activations"] for m in mem)
        peaks[n] = max(m["peak_bytes"] for m in mem)
        state[n] = max(sum((m["before_optimizer"] or m["peak_by_category"])[c]
                           for c in ("parameters", "gradients", "optimizer state")) for m in mem)
        f = formula(n)
        comm = s.get("comm") or [{}]
        sent = comm[0].get("send", {}).get("bytes", 0)
        reduce = comm[0].get("all_reduce", {}).get("bytes", 0)
        gap = max(abs(a - b) for a, b in zip(losses, single_losses))
        rows.append(f"| {n} | {seq // n:,} | {fmt_bytes(measured[n])} ({fmt_bytes(f['activations'])}) | "
                    f"{fmt_bytes(peaks[n])} | {fmt_bytes(sent)} ({fmt_bytes(f['comm'].get('send', 0))}) | "
                    f"{fmt_bytes(reduce)} | {len(losses)} steps, largest difference {gap:.1e} |")
    md = "\n".join(rows) + (f"\n\n{s1['model']} model ({s1['n_params'] / 1e6:.2f}M parameters), batch {batch} x "
                            f"{seq} tokens, {dtype}, {s1['device_name']}; the one-device run is "
                            f"`step1_single_gpu/train.py` with the same flags (final loss {single_losses[-1]:.4f}).")

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    xs = [1, 2, 4, 8]
    ax.plot(xs, [formula(n)["activations"] / MiB for n in xs], "-", color="tab:blue", label="activations, formula (theory.py)")
    ax.plot(list(measured), [v / MiB for v in measured.values()], "o", color="tab:blue", ms=8,
            label="activations, measured (memory tracer)")
    ax.plot(list(peaks), [v / MiB for v in peaks.values()], "s--", color="tab:gray", mfc="none",
            label="whole peak, measured (with one ring step's (seq/cp)² scores, transient)")
    ax.plot(list(state), [v / MiB for v in state.values()], "^:", color="tab:green",
            label="weights + gradients + AdamW state, measured (do not shrink)")
    for n, v in measured.items():
        ax.annotate(fmt_bytes(v), (n, v / MiB), textcoords="offset points", xytext=(8, 4), fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("context-parallel degree (ranks sharing each sequence)")
    ax.set_ylabel("MiB per rank")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"Each rank keeps 1/cp of the activations: {s1['model']}, batch {batch} x {seq}, {dtype}\n"
                 f"torchrun --nproc-per-node N step3_multi_gpu/train_cp.py --seq-len {seq} --global-batch-size {batch}"
                 + (" --amp off" if dtype == "fp32" else ""), fontsize=9)
    figs = ROOT / "figs"
    save_figure(fig, figs / f"03_cp_memory{suffix}.png")
    plt.close(fig)
    (figs / f"03_cp_table{suffix}.md").write_text(md + "\n")
    print(f"wrote figs/03_cp_memory{suffix}.png and figs/03_cp_table{suffix}.md", flush=True)
    return {"table-03-cp" + suffix: md}
