"""What the figures command and the chapters' figure modules share: a run (``Run``), where
its output lives (``run_dir``, ``summary``) and the machine's name (``this_device``).

The chapters' run lists and tables live beside their scripts (step1_single_gpu/figures.py,
step2_memory/figures.py, step3_multi_gpu/figures.py, step4_multi_node/figures.py);
tools/figures.py gathers them and launches the runs. This module imports neither, so that
a chapter's module and the command can both import it without a circle.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from common import ROOT


@dataclass
class Run:
    name: str                     # runs/figs/<name>/
    script: str                   # path from the repo root
    flags: list[str]
    nproc: int = 1                # >1: launched with torchrun
    figures: dict[str, str] = field(default_factory=dict)  # figs/ name -> file in the run folder
    job: str = "one_process"      # runs with the same job (and so the same nproc) share one launch


# Chapters 3a, 4 and 5 share this 4-rank job: no DTensor meshes but FSDP's
DP4 = dict(nproc=4, job="4_ranks_data_parallel")


def run_dir(name: str, suffix: str = "") -> Path:
    """runs/figs/<name><suffix>; for a run inside a folder (03_strategies/tp) the suffix
    goes on the folder: runs/figs/03_strategies_cuda/tp."""
    head, _, tail = name.partition("/")
    return ROOT / "runs" / "figs" / (head + suffix) / tail


def summary(name: str, suffix: str = "") -> dict:
    return json.loads((run_dir(name, suffix) / "summary.json").read_text())


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


def tool_block(marker: str, module: str, argv: list[str], timeout_s: float = 900) -> dict[str, str]:
    """A page's block of what ``python -m MODULE ARGV`` printed on this machine: the command,
    then its output ({marker: markdown}, for tools/figures.py's update_readme)."""
    import subprocess
    import sys

    from common.errors import UserError
    p = subprocess.run([sys.executable, "-m", module, *argv], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout_s)
    if p.returncode:
        raise UserError(f"python -m {module} failed: {p.stderr.strip()[-300:]}")
    return {marker: f"```bash\npython -m {' '.join([module, *argv])}\n```\n\n```\n{p.stdout.strip()}\n```"}
