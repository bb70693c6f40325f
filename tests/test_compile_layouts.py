"""--compile under every model-parallel layout that offers it, against one eager process.

The step 3 scripts compile block by block (common/parallelize/compile.py) after the layout
has split the blocks. Two torchrun jobs (2 and 4 ranks, gloo on the CPU, started together)
run, compiled: tensor parallelism, TP with sequence parallelism, 2-D (FSDP x TP), the
pipeline and expert parallelism at 2 ranks, 3-D (pipeline x TP) at 4, through
tests/drivers/compile.py, which also trains the single-process eager reference on the same
seed and batch. DDP and FSDP compiled are tests/test_step3a.py's; context parallelism
refuses --compile.

Inductor compiles the dense layouts at 2 ranks, as the scripts do. Expert parallelism and
3-D trace through ``aot_eager`` instead: the same dynamo graphs and AOTAutograd's forward
and backward (where DTensor and the collectives meet the compiler: a TP embedding that hands
the first block a tensor still in flight fails there, see EmbeddingParallel in
common/parallelize/tp.py), without inductor's C++: the experts' routing breaks their block
into some twenty graphs, a minute of C++ compilation on two cores, and 3-D's TP block is
the graph the 2-rank TP and 2-D runs already lower.

Three steps of 2 x 16 tokens through two layers, fp32 (parity to 1e-5, the model-parallel
tests' own, is an fp32 claim; inductor may fuse and reorder float sums): step 0 compiles and
runs the graph, step 1 runs it again without recompiling, step 2 runs eagerly (Run counts
its bytes under a dispatch mode), on weights the compiled steps trained.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest

from common import ROOT
import launch
from conftest import hang_limit
from tests.tolerances import PARITY_RTOL

TIMEOUT_S = hang_limit(240)  # a hang detector: both jobs together take about a minute on an idle 2-core machine
STEPS = 3
COMMON = ["--compile", "--n-layers", "2", "--steps", str(STEPS), "--global-batch-size", "2", "--seq-len", "16",
          "--data", "synthetic", "--eval-batches", "0", "--amp", "off", "--no-trace-memory", "--max-norm", "0.5"]


def case(name, script, *flags, backend=None):
    return {"name": name, "script": f"step3_multi_gpu/{script}", "flags": [*COMMON, "--model", "debug", *flags],
            "expect_error": False, "backend": backend}


CASES = {
    2: [case("tp", "train_tp.py"),
        case("tp_sp", "train_tp.py", "--sequence-parallel", "--no-loss-parallel"),
        case("2d", "train_2d.py", "--dp", "1", "--tp", "2"),
        case("pp", "train_pp.py", "--schedule", "1f1b", "--microbatches", "2"),
        case("ep", "train_ep.py", "--model", "debug-moe", backend="aot_eager")],
    4: [case("3d", "train_3d.py", "--pp", "2", "--dp", "1", "--tp", "2", backend="aot_eager")],
}
LAYOUTS = [(world, c["name"]) for world, cases in CASES.items() for c in cases]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compile_layouts")
    procs = {}
    for world, cases in CASES.items():
        out = tmp / f"world{world}"
        out.mkdir()
        (out / "cases.json").write_text(json.dumps(cases))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               str(ROOT / "tests/drivers/compile.py"), str(out), str(out / "cases.json")]
        procs[world] = launch.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    start = time.perf_counter()
    for world, proc in procs.items():
        try:
            log, _ = proc.communicate(timeout=max(1, TIMEOUT_S - (time.perf_counter() - start)))
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            pytest.fail(f"the {world}-rank job did not finish in {TIMEOUT_S:.0f} s (a hang?):\n"
                        f"{proc.communicate()[0][-4000:]}")
        assert proc.returncode == 0, f"the {world}-rank job failed:\n{log[-5000:]}"
    results = {world: json.loads((tmp / f"world{world}" / "results.json").read_text()) for world in CASES}
    for world, res in results.items():
        for name, r in res.items():
            r["compile"] = [json.loads((tmp / f"world{world}" / name / f"compile_rank{rank}.json").read_text())
                            for rank in range(world)]
        print(f"\n{world} ranks: " + ", ".join(f"{k} {v['wall_s']:.1f}s" for k, v in res.items()))
    return results


@pytest.mark.parametrize("world,name", LAYOUTS, ids=[f"{w}ranks-{n}" for w, n in LAYOUTS])
def test_compiled_layout_gives_the_eager_losses(runs, world, name):
    """Every step's loss and gradient norm are one eager process's to 1e-5, and every rank
    ran its blocks compiled: for a dense block one graph, without a break, that serves every
    block and step (the experts' data-dependent routing breaks theirs into several)."""
    r = runs[world][name]
    assert r["exit_code"] == 0, r["stderr_tail"]
    assert len(r["losses"]) == STEPS and r["losses"][-1] != r["losses"][0]  # it trained
    for step, (got, ref) in enumerate(zip(r["losses"], r["ref_losses"])):
        assert math.isclose(got, ref, rel_tol=PARITY_RTOL), f"step {step}: loss {got} vs eager single-process {ref}"
    for step, (got, ref) in enumerate(zip(r["grad_norms"], r["ref_grad_norms"])):
        assert math.isclose(got, ref, rel_tol=PARITY_RTOL), f"step {step}: grad_norm {got} vs eager single-process {ref}"
    assert r["summary"]["dtype"] == "fp32"
    for rank, stats in enumerate(r["compile"]):
        if name == "ep":
            assert stats["unique_graphs"] >= 1, (rank, stats)
        else:
            assert stats == {"frames_ok": 1, "unique_graphs": 1, "graph_breaks": 0}, (rank, stats)
