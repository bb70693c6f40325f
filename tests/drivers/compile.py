"""Test-only driver: tests/drivers/model_parallel.py's cases, each with a fresh torch.compile.

    torchrun --standalone --nproc-per-node N tests/drivers/compile.py OUT_DIR CASES_JSON

The cases run as model_parallel.py runs them (one job, the step scripts' ``main()`` one after
another, rank 0 training the single-process eager reference), with three differences:
- dynamo forgets the previous run's graphs before each run (they hold that run's modules and
  process groups, and count towards its recompile limit, past which a block silently runs
  eagerly);
- a case may name a ``"backend"`` for ``Module.compile`` (default: inductor, as the scripts
  compile); ``"aot_eager"`` traces the same graphs (dynamo, then AOTAutograd's forward and
  backward, where DTensor meets the compiler) without inductor's C++ code generation;
- each rank writes what dynamo did to OUT_DIR/<case>/compile_rank<R>.json: the frames it
  compiled, the graphs and the graph breaks, so a test can tell the blocks really ran compiled.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
import torch._dynamo
from torch._dynamo.utils import counters

spec = importlib.util.spec_from_file_location("model_parallel_driver", Path(__file__).with_name("model_parallel.py"))
driver = importlib.util.module_from_spec(spec)
spec.loader.exec_module(driver)
run_script = driver.run_script
BACKENDS = {c["name"]: c.get("backend") for c in json.loads(Path(sys.argv[2]).read_text())}


@contextlib.contextmanager
def compile_backend(backend: str | None):
    real = torch.nn.Module.compile
    if backend:
        torch.nn.Module.compile = lambda self, *args, **kwargs: real(self, *args, **{**kwargs, "backend": backend})
    try:
        yield
    finally:
        torch.nn.Module.compile = real


def run_compiled(script: str, flags: list[str], capture_stderr: bool = False) -> tuple[int, str]:
    out = Path(driver.last_value(flags, "--out", ""))
    torch._dynamo.reset()
    counters.clear()
    with compile_backend(BACKENDS.get(out.name)):
        code, err = run_script(script, flags, capture_stderr=capture_stderr)
    if out.is_dir():
        (out / f"compile_rank{os.environ['RANK']}.json").write_text(json.dumps({
            "frames_ok": counters["frames"]["ok"], "unique_graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values())}))
    return code, err


driver.run_script = run_compiled

if __name__ == "__main__":
    sys.exit(driver.main())
