"""Chapter "survive faults": what a checkpoint holds on disk, per strategy, against 12N.

``write_faults_table`` reads the checkpoint folders of the chapter's runs (listed in
step4_multi_node/figures.py as CHAPTER5) and writes figs/05_checkpoint_table.md: files, bytes per
rank's data file, the total against the formula, and, from the checkpoint's .metadata, the
tensor bytes and the number of items it wrote. A checkpoint holds the fp32 weights
(4N bytes) and AdamW's two moments (8N), N = parameters, whatever the strategy: DDP's
replicas are written once (DCP spreads the identical tensors over the ranks), FSDP's
shards once each.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from common.measure.byte_units import fmt_bytes

from common import ROOT  # noqa: E402


def checkpoint_items(folder: Path) -> tuple[int, int]:
    """(items DCP wrote, bytes of tensor data among them), from the checkpoint's .metadata:
    every item (a tensor, a shard of one, a pickled setting) is its own record in a .distcp
    file, with a header of its own; the tensor bytes are what the shapes and dtypes hold."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    meta = FileSystemReader(str(folder)).read_metadata()
    tensors = sum(math.prod(chunk.sizes) * m.properties.dtype.itemsize for m in meta.state_dict_metadata.values()
                  if isinstance(m, TensorStorageMetadata) for chunk in m.chunks)
    return len(meta.storage_data), tensors


def checkpoint_row(run: Path) -> dict:
    summary = json.loads((run / "summary.json").read_text())
    newest = sorted(p for p in (run / "checkpoints").iterdir() if p.is_dir() and not p.name.endswith("_partial"))[-1]
    data = sorted(newest.glob("*.distcp"))
    n = summary["n_params"]
    total = sum(p.stat().st_size for p in newest.iterdir() if p.is_file())
    items, tensor_bytes = checkpoint_items(newest)
    return {"script": summary["script"], "strategy": summary.get("strategy", "?"), "world": summary["world_size"],
            "checkpoint": newest.name, "files": len(list(newest.iterdir())),
            "per_rank": [p.stat().st_size for p in data], "data_bytes": sum(p.stat().st_size for p in data),
            "total_bytes": total, "n_params": n, "formula": 12 * n, "items": items, "tensor_bytes": tensor_bytes}


def write_faults_table(suffix: str = "", runs=("05_ddp4", "05_zero1_4", "05_fsdp4")) -> dict[str, str]:
    missing = [name for name in runs if not (ROOT / "runs" / "figs" / (name + suffix) / "summary.json").exists()]
    if missing:  # (--only 05_memory makes one figure of the chapter, not these runs)
        print(f"skipped the checkpoint table: {', '.join(missing)} not run", flush=True)
        return {}
    rows = [checkpoint_row(ROOT / "runs" / "figs" / (name + suffix)) for name in runs]
    lines = ["| run | ranks | files in the checkpoint | bytes per rank's .distcp file | all .distcp files | "
             "12N (4N weights + 8N AdamW) | tensor bytes in them | items | the rest, per item |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        per = ", ".join(fmt_bytes(b) for b in r["per_rank"])
        lines.append(f"| {r['strategy']} | {r['world']} | {r['files']} | {per} | {fmt_bytes(r['data_bytes'])} | "
                     f"{fmt_bytes(r['formula'])} ({r['data_bytes'] / r['formula']:.3f}x) | {r['tensor_bytes']:,} | "
                     f"{r['items']:,} | {(r['data_bytes'] - r['tensor_bytes']) / r['items']:,.0f} B |")
    table = "\n".join(lines)
    (ROOT / "figs" / f"05_checkpoint_table{suffix}.md").write_text(table + "\n")
    return {"table-05" + suffix: table}
