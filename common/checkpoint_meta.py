"""A checkpoint folder's meta.json, the file that makes it complete: which step folders are
complete (``complete_checkpoints``), reading one's meta.json (``read_meta``), and which of the
settings its run had differ from this run's (``config_differences``). The checkpointer
(common/checkpoint.py), the run folder's move-aside (common/run_folder.py), the weight export
(common/weights.py) and tools.generate read checkpoints through these."""
from __future__ import annotations

import json
from pathlib import Path

from common.errors import UserError

PARTIAL = "_partial"
META_KEYS = ("step", "model", "model_config", "world_size", "parallel", "global_batch_size", "seq_len", "seed",
             "data", "scheduler", "data_position")


def read_meta(path: Path) -> dict:
    """meta.json of a checkpoint, or one sentence saying why it cannot be used."""
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"checkpoint {path}: meta.json cannot be read ({type(e).__name__}); move the folder "
                        f"aside to resume from the one before it.") from None
    missing = [k for k in META_KEYS if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise UserError(f"checkpoint {path}: meta.json lacks {', '.join(missing)}; it was not written by this "
                        f"tutorial's checkpointer (or was edited); move the folder aside.")
    return meta


# What a checkpoint's numbers depend on, as (meta.json key, flag, default for checkpoints
# written before the key was saved). The parallel layout, --steps (raising it is how a finished
# run continues) and the pipeline schedule are not here: DCP reshards by parameter name, and
# none of them changes the numbers already trained.
RUN_SETTINGS = (("model", "--model", None), ("n_layers", "--n-layers", None),
                ("global_batch_size", "--global-batch-size", None), ("seq_len", "--seq-len", None),
                ("lr", "--lr", None), ("warmup_steps", "--warmup-steps", None), ("data", "--data", None),
                ("seed", "--seed", None), ("grad_accum", "--grad-accum", 1),
                ("data_id", "--data's contents (prepared folder's meta.json hash)", None),
                ("doc_mask", "--doc-mask", False))


def config_differences(meta: dict, args) -> list[str]:
    """'--lr 0.001 there, 0.003 here' for every setting the checkpoint's run had otherwise."""
    saved = dict(meta)
    saved.setdefault("n_layers", (meta.get("model_config") or {}).get("n_layers"))
    saved.setdefault("grad_accum", meta.get("grad_accum_steps", 1))  # the data position counts micro-batches
    here = {"n_layers": args.model_config.n_layers, "grad_accum": getattr(args, "grad_accum", 1),
            "doc_mask": getattr(args, "doc_mask", False)}
    diff = []
    for key, flag, default in RUN_SETTINGS:
        there, now = saved.get(key, default), here.get(key, getattr(args, key, None))
        if there is not None and there != now:
            diff.append(f"{flag} {there} there, {now} here")
    if not diff and meta.get("model_config") not in (None, args.model_config.as_dict()):
        diff.append(f"--model {meta.get('model')} there had another shape than --model {args.model} here")
    return diff


def complete_checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints in ``folder``, oldest first."""
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith("step_")
             and not p.name.endswith(PARTIAL) and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: p.name)
