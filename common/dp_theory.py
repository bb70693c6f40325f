"""What the data-parallel family should cost, per rank, and the chapter's table.

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
  on CUDA it stays on the host unless ``capturable``), so the state is 8N + 4T bytes;
- FSDP shards each parameter along dim 0 in W chunks of ceil(rows / W) rows (the last
  ones shorter or empty) and pads its own storage, so parameters, gradients and the
  all-gathers are counted with the padded chunk, the AdamW state with the real one;
- FSDP keeps the root (embedding, final norm, output) gathered from forward to backward
  (gathering it again right away would be waste), so ZeRO-3's backward all-gather is
  4(N - N_root), not 4N.
"""
from __future__ import annotations

import math

import torch

from common.model import ModelConfig, Transformer


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = Transformer(cfg)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _rows(shape) -> tuple[int, int]:
    return shape[0], math.prod(shape[1:])


def shard_numel(shape, w: int, rank: int) -> int:
    """Elements of rank's chunk of a parameter sharded in w along dim 0 (torch.chunk)."""
    rows, rest = _rows(shape)
    chunk = math.ceil(rows / w)
    return max(0, min(chunk, rows - rank * chunk)) * rest


def padded_shard_numel(shape, w: int) -> int:
    rows, rest = _rows(shape)
    return math.ceil(rows / w) * rest


def is_root(name: str) -> bool:
    return not name.startswith("layers.")


def model_state(strategy: str, cfg: ModelConfig, world: int, rank: int = 0, shard: int | None = None,
                adam_step_bytes: int = 4) -> dict[str, int]:
    """Predicted bytes of parameters, gradients and AdamW state on one rank at the
    optimizer step (``shard``: the FSDP shard group size, the world size by default;
    ZeRO-1's partition is ZeroRedundancyOptimizer's own, so its state is the average)."""
    shapes = param_shapes(cfg)
    n, t = sum(math.prod(s) for s in shapes.values()), len(shapes)
    if strategy == "ddp":
        return {"parameters": 4 * n, "gradients": 4 * n, "optimizer state": 8 * n + adam_step_bytes * t}
    if strategy == "zero1":
        return {"parameters": 4 * n, "gradients": 4 * n,
                "optimizer state": round((8 * n + adam_step_bytes * t) / world)}
    s = shard or world
    r = rank % s  # HSDP: ranks are laid out (replicate, shard), the shard index varies fastest
    padded = sum(padded_shard_numel(sh, s) for sh in shapes.values())
    local = sum(shard_numel(sh, s, r) for sh in shapes.values())
    return {"parameters": 4 * padded, "gradients": 4 * padded, "optimizer state": 8 * local + adam_step_bytes * t}


def unsharded_bytes(cfg: ModelConfig, world: int = 1, bytes_per_param: int = 4) -> dict[str, int]:
    """Gathered size of each FSDP unit, 'root' and one 'block' (padded chunks x world)."""
    shapes = param_shapes(cfg)
    root = sum(padded_shard_numel(s, world) * world for k, s in shapes.items() if is_root(k))
    block = sum(padded_shard_numel(s, world) * world for k, s in shapes.items() if k.startswith("layers.0."))
    return {"root": bytes_per_param * root, "block": bytes_per_param * block}


def comm_bytes(strategy: str, cfg: ModelConfig, world: int, shard: int | None = None,
               param_bytes: int = 4, accum: int = 1) -> dict[str, int]:
    """Logical bytes per rank per optimizer step, by collective (``param_bytes`` 2 for
    bf16 all-gathers; gradients are always reduced in fp32). With ``accum`` micro-batches
    the gradients are still reduced once, but FSDP gathers the parameters for each."""
    shapes = param_shapes(cfg)
    n = sum(math.prod(s) for s in shapes.values())
    if strategy == "ddp":
        return {"all_reduce": 4 * n}
    if strategy == "zero1":
        return {"all_reduce": 4 * n, "broadcast": 4 * n}
    s = shard or world
    if s == 1:  # nothing sharded: HSDP degenerates into DDP
        return {"all_reduce": 4 * n} if world > 1 else {}
    gathered = {k: padded_shard_numel(sh, s) * s for k, sh in shapes.items()}  # padded full size
    full = sum(gathered.values())
    no_root = sum(v for k, v in gathered.items() if not is_root(k))
    out = {"all_gather": accum * param_bytes * (full + (no_root if strategy.endswith("zero3") else 0)),
           "reduce_scatter": 4 * full}
    if strategy.startswith("hsdp") and world > s:
        out["all_reduce"] = 4 * full // s  # each rank's reduced shard, across the replicas
    return out


# ---- the chapter's table, from the runs common/figures.py makes ----------------------
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
_SHORT = {"all_reduce": "AR", "broadcast": "B", "all_gather": "AG", "reduce_scatter": "RS"}


def chapter3a_table(runs_dir, suffix: str = "") -> str:
    """Markdown: per-rank model state and bytes per step, measured next to the formula."""
    import json
    from pathlib import Path

    from common.memory import fmt_bytes

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
              "4-byte step counters make the ratio a hair above 1); peak = the trace's highest point, activations "
              "included. AR all-reduce, B broadcast, AG all-gather, RS reduce-scatter; logical bytes count the whole "
              "tensor each collective works on, a ring sends 2(n-1)/n of that for AR and (n-1)/n for AG and RS, n being the group's size (W; S "
              "and R = W/S under HSDP). "
              "ZeRO-3 sends a little less than 12N because FSDP keeps the root (embedding, final norm, output) "
              "gathered from forward to backward; bf16 gathers half the bytes; DDP's few-byte broadcast is the "
              "one-time rebuild of its buckets after the first step."]
    return "\n".join(lines)


def write_chapter3a_table(suffix: str = "", only: str = "") -> dict[str, str]:
    """A POST_STEPS entry of common/figures.py: figs/03a_table.md, and the README block."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    md = chapter3a_table(root / "runs" / "figs", suffix)
    if not md:
        return {}
    (root / "figs" / f"03a_table{suffix}.md").write_text(md + "\n")
    print(f"wrote figs/03a_table{suffix}.md", flush=True)
    return {"table-03a" + suffix: md}
