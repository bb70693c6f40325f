"""The expert-parallel page's figure and table (step3_multi_gpu/expert_parallel.md), from the
runs of figures.py here (runs/figs/03_ep/...): ``python -m tools.figures --only 03_ep``.

- figs/03_ep_tokens_per_expert.png: the tokens each expert got at every step, with and
  without the load-balancing loss: is the router balanced?
- the table (block ``table-ep``): one device against expert parallelism on 4 ranks, model
  state and peak per rank, and the bytes each collective moved against the formulas.
"""
from __future__ import annotations

import json
from pathlib import Path

RUNS = "03_ep"  # runs/figs/03_ep/<name>
WITH, WITHOUT, SINGLE, GROUPS = "ep4", "ep4_no_aux", "single", "ep4_ep2"


def _load(folder: Path) -> tuple[dict, list[dict]]:
    summary = json.loads((folder / "summary.json").read_text())
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return summary, rows


def imbalance(counts: list[int]) -> float:
    """The busiest expert's load over the even load (1: balanced; n_experts / top_k at most: every token picks the same top_k)."""
    return max(counts) / (sum(counts) / len(counts))


def tokens_figure(runs: Path, out: Path) -> str:
    """Two panels sharing one scale: layer 0's tokens per expert at every step, with the
    load-balancing loss and without. Returns the caption's numbers."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loaded = {name: _load(runs / name) for name in (WITH, WITHOUT)}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    worst = {}
    for ax, name in zip(axes, (WITH, WITHOUT)):
        summary, rows = loaded[name]
        cfg = summary["model_config"]
        steps = [r["step"] for r in rows]
        layer0 = [r["tokens_per_expert"][0] for r in rows]
        for e in range(cfg["n_experts"]):
            ax.plot(steps, [c[e] for c in layer0], lw=1.2, label=f"expert {e}")
        even = sum(layer0[0]) / cfg["n_experts"]
        ax.axhline(even, color="black", ls="--", lw=1, label="even load")
        weight = cfg["moe_aux_weight"]
        late = rows[len(rows) // 2:]
        worst[name] = [sum(imbalance(r["tokens_per_expert"][i]) for r in late) / len(late)
                       for i in range(cfg["n_layers"])]
        ax.set_title(f"aux-loss weight {weight:g}: busiest expert at "
                     f"{', '.join(f'{v:.1f}' for v in worst[name])}x the even load\n"
                     f"(layers 0-{cfg['n_layers'] - 1}, mean of steps {late[0]['step']}-{late[-1]['step']})", fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("token slots of layer 0 (global batch)")
    axes[1].legend(fontsize=8, ncol=2, loc="upper right")
    s = loaded[WITH][0]
    fig.suptitle(f"Is the router balanced? Tokens per expert per step, {s['model']} (top-{s['model_config']['top_k']} "
                 f"of {s['model_config']['n_experts']}) on {s['world_size']} ranks, batch {s['global_batch_size']} x "
                 f"{s['seq_len']}\ntorchrun --nproc-per-node 4 step3_multi_gpu/train_ep.py [--aux-loss-weight 0]",
                 fontsize=11)
    from common.figure_file import save_figure
    save_figure(fig, out)
    plt.close(fig)
    top = cfg["n_experts"] / cfg["top_k"]  # one expert chosen by every token: 1/top_k of the slots

    def span(v):
        return f"{min(v):.2f}x to {max(v):.2f}x"
    return (f"averaged over the second half of the run, the busiest expert of a layer took {span(worst[WITH])} the "
            f"even load with the load-balancing loss (weight {loaded[WITH][0]['model_config']['moe_aux_weight']:g}) "
            f"and {span(worst[WITHOUT])} without it, where {top:g}x is the most possible: that expert is chosen by "
            f"every token")


def ep_table(runs: Path) -> str:
    from common.measure.byte_units import fmt_bytes
    from common.measure.plan import Plan
    from common.measure.theory import predict
    from common.model import ModelConfig
    from common.parallelize.ep import ep_bytes_per_step

    single, _ = _load(runs / SINGLE)
    ep, rows = _load(runs / WITH)
    cfg = ModelConfig(**ep["model_config"])
    w = ep["world_size"]
    lines = ["| run | parameters + gradients + AdamW per rank: formula | measured | peak per rank | "
             "sent per step per rank (logical), measured | formula |", "|---|---|---|---|---|---|"]
    groups, _ = _load(runs / GROUPS)
    for label, s, strategy in (("one device (step 1)", single, "single"), (f"EP {w} (`train_ep.py`)", ep, "ep"),
                               ("EP 2, two copies of each expert (`--ep 2`)", groups, "ep")):
        plan = Plan(cfg, strategy, world=s["world_size"], batch=s["global_batch_size"], seq_len=s["seq_len"],
                    dtype=s["dtype"], **({"ep": s["parallel"]["ep"]} if strategy == "ep" else {}))
        p = predict(plan, 0)
        state = sum(p[c] for c in ("parameters", "gradients", "optimizer state"))
        m = next(m for m in s["memory"] if m["rank"] == 0)
        seen = sum(m["before_optimizer"][c] for c in ("parameters", "gradients", "optimizer state"))
        peaks = [x["peak_bytes"] for x in s["memory"]]
        peak = fmt_bytes(max(peaks)) if len(peaks) == 1 else f"{fmt_bytes(min(peaks))} – {fmt_bytes(max(peaks))}"
        if strategy == "single":
            sent, formula = "none", "none"
        else:
            comm = s["comm"]
            kinds = sorted({k for c in comm for k in c})
            mean = {k: sum(c.get(k, {}).get("bytes", 0) for c in comm) / len(comm) for k in kinds}
            sent = " + ".join(f"{k} {fmt_bytes(v)}" for k, v in mean.items()) + " (mean over the ranks)"
            formula = " + ".join(f"{k} {fmt_bytes(v)}" for k, v in p["comm"].items())
        lines.append(f"| {label} | {fmt_bytes(state)} | {fmt_bytes(seen)} | {peak} | {sent} | {formula} |")
    a2a = [c["all_to_all"]["bytes"] for c in ep["comm"]]
    tokens = ep["global_batch_size"] // w * ep["seq_len"]
    lines.append("")
    lines.append(f"{ep['model']}: N = {ep['n_params']:,} parameters ({cfg.n_experts} experts of {cfg.ffn_dim} hidden "
                 f"units per layer, top-{cfg.top_k}), batch {ep['global_batch_size']} x {ep['seq_len']}, fp32, "
                 f"{ep['device_name']}, gloo. The all-to-all moves 2 (kT + R) rows of dim = {cfg.dim} values per MoE "
                 f"layer and rank, k T = {cfg.top_k * tokens} the slots a rank sends, R the rows its experts receive: "
                 f"{fmt_bytes(min(a2a))} to {fmt_bytes(max(a2a))} per rank here, as the router sent more to some "
                 f"experts than others; the mean over the ranks is exactly {fmt_bytes(ep_bytes_per_step(cfg, tokens))} "
                 f"(4 kT rows), whatever the routing. FSDP gathers and reduces the dense part only: "
                 f"the experts never leave their rank. With `--ep 2` each rank holds 4 experts instead of 2, and the "
                 f"two copies of each expert all-reduce its gradient. Bytes counted on steps 2 and 3.")
    return "\n".join(lines)


def write_ep_figures(suffix: str = "") -> dict[str, str]:
    """A POST_STEPS entry of figures.py here."""
    from common import ROOT
    runs = ROOT / "runs" / "figs" / (RUNS + suffix)
    caption = tokens_figure(runs, ROOT / "figs" / f"03_ep_tokens_per_expert{suffix}.png")
    table = ep_table(runs)
    (ROOT / "figs" / f"03_ep_table{suffix}.md").write_text(table + "\n")
    print(f"wrote figs/03_ep_tokens_per_expert{suffix}.png and figs/03_ep_table{suffix}.md", flush=True)
    return {"table-ep" + suffix: table, "ep-balance" + suffix: caption[0].upper() + caption[1:] + "."}
