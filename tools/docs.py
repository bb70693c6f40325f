"""The walkthrough's files: README.md (the map) and one README per chapter beside its
scripts. The figures command fills their generated blocks, the tests read their commands."""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a file (python tools/x.py): find common/

from common import ROOT

DOCS = ["README.md", "step1_single_gpu/README.md", "step2_memory/README.md", "step3_multi_gpu/README.md",
        "step3_multi_gpu/comm_lab.md", "step3_multi_gpu/model_parallel.md",
        "step3_multi_gpu/context_parallel.md", "step3_multi_gpu/will_it_fit.md",
        "step3_multi_gpu/deepspeed.md",
        "step4_multi_node/README.md"]
DOCS.insert(DOCS.index("step3_multi_gpu/will_it_fit.md"), "step3_multi_gpu/expert_parallel.md")


def doc_paths() -> list[Path]:
    return [ROOT / d for d in DOCS if (ROOT / d).exists()]


def all_text() -> str:
    """Every walkthrough file, one after another (for checks that do not care which)."""
    return "\n".join(p.read_text() for p in doc_paths())


def block(name: str) -> tuple[Path, str] | None:
    """(the file holding <!-- BEGIN name --> ... <!-- END name -->, the text between), or None."""
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    for p in doc_paths():
        text = p.read_text()
        if begin in text and end in text:
            return p, text.split(begin, 1)[1].split(end, 1)[0]
    return None
