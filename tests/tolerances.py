"""Tolerances the parity tests share, each derived rather than picked."""
from __future__ import annotations

import os

# tests/conftest.py: the suite's runs take CUDA's optimizer path on a CPU (common/training.py)
CUDA_PATHS = os.environ.get("TUTORIAL_CUDA_PATHS") == "1"

# ---- the tolerances the pages quote (tools/docs.py renders them: <!-- v:test.NAME -->) -------
# A split against one device, in fp32, where only the order of the sums differs: every
# step's loss and gradient norm, relative.
PARITY_RTOL = 1e-5
# Where fewer sums are reordered (CP's ring, EP's experts: the loss; a saver or compile
# against the same strategy without it): relative.
TIGHT_RTOL = 1e-6
# The final weights, gathered back: at most WEIGHT_FRACTION of the elements further apart
# than WEIGHT_ATOL (AdamW divides by the root of a near-zero second moment: a handful of
# elements move visibly; none beyond two Adam trajectories, test_model_parallel.adam_drift_bound).
WEIGHT_FRACTION = 1e-4
WEIGHT_ATOL = 1e-6
ALLOCATOR_RTOL = 0.01  # the trace against the CPU allocator's count (check_allocator)
BF16_GAPS = 4          # a bf16 split against one device's bf16, in bf16's own gaps (check_bf16_parity)
DRY_OTHER_FEWER = 0.2  # a dry run's "other" tensors under the real rank's (check_dry_run)


def check_optimizer_path(summary: dict, flags=()) -> None:
    """The run took the AdamW kernels a GPU would: foreach by default in the suite's
    CUDA-path mode (one tensor at a time if the mode is off), fused with --fused-adamw. A
    layout mixing DTensor and plain parameters fails here if its groups mix them."""
    want = "fused" if "--fused-adamw" in flags else "foreach" if CUDA_PATHS else "for-loop"
    assert summary["optimizer_kernels"] == want, (summary["optimizer_kernels"], want)


def check_weights(r: dict, drift_bound: float | None = None) -> None:
    """A driver's final weights against the one-device run's (tests/drivers/model_parallel.py:
    gathered back into one state dict): the same keys, at most WEIGHT_FRACTION of the elements
    off by more than WEIGHT_ATOL, and none by more than ``drift_bound`` when given."""
    assert r["weight_keys_match"], "the gathered state dict does not have the full model's names"
    assert r["weight_n_over_atol"] <= WEIGHT_FRACTION * r["weight_numel"], r["weight_n_over_atol"]
    if drift_bound is not None:
        assert r["weight_max_abs_diff"] <= drift_bound, r["weight_max_abs_diff"]


def bf16_gap(ref16: list[float], ref32: list[float]) -> float:
    """How far bf16 moves the one-device run's losses from fp32 (the largest step)."""
    return max(abs(a - b) for a, b in zip(ref16, ref32))


def check_bf16_parity(name: str, got: list[float], ref16: list[float], ref32: list[float]) -> None:
    """A bf16 run of some split against the one-device bf16 run.

    bf16 rounds each sum differently depending on how the work is split (other reduction
    orders), and a split rounds where one device does not (FSDP's policy gathers bf16
    weights, the norm gains among them, which autocast keeps in fp32; TP sums bf16 partial
    products), so no two bf16 runs agree to fp32's 1e-5. The yardstick is bf16 itself: the
    one-device bf16 run's largest distance from fp32 (the gap). A split's own distance from
    fp32 reaches about twice the gap (3-D: 1.8 to 1.9 gaps on Intel's AMX kernels and on
    AVX2's, measured with ATEN_CPU_CAPABILITY=avx2, what an AMD EPYC of before Zen 4 runs);
    the two distances add, and four steps' largest is a rough scale: the losses may be no
    farther from the one-device bf16 run than 4 gaps (a bug moves them by tens of gaps),
    and must differ from fp32 (the run really computed in bf16).
    """
    gap = bf16_gap(ref16, ref32)
    assert gap > 1e-6, "the bf16 reference must differ from fp32"
    far = max(abs(a - b) for a, b in zip(got, ref16))
    assert far <= BF16_GAPS * gap, (name, f"{far / gap:.2f} gaps from the one-device bf16 run", got, ref16, ref32)
    assert got != ref32, name


def check_allocator(mem: dict, what) -> None:
    """One rank's trace against the CPU allocator's own count of the same steps
    (common/measure/allocator_count.py, _AllocatorView): never above it by more than 1%, and below it
    by no more than 1% of what the allocator held at its peak that the trace saw. The rest is
    named by the count, with the op that allocated it (``allocator_unseen_at_peak``): blocks
    no op returned, such as the workspace a CPU's bf16 matmul keeps inside the op or a
    temporary inside DTensor's dispatch. Their size is the math library's choice and differs
    from one CPU to the next (Intel's and AMD's take other kernels), so no machine's ratio is
    held; what is held is that the gap is those blocks."""
    a, t = mem["allocator_peak_bytes"], mem["peak_bytes"]
    unseen = (mem.get("allocator_unseen_at_peak") or {}).get("bytes") or 0
    assert a and t <= (1 + ALLOCATOR_RTOL) * a, (what, t, a)
    assert t >= (1 - ALLOCATOR_RTOL) * (a - unseen), (what, t, a, mem.get("allocator_unseen_at_peak"))


def check_dry_run(dry: dict, real: dict, rank: int, world: int, received: int = 0) -> None:
    """A dry run's summary (``--fake-world-size world --fake-rank rank``) against the real
    run's: rank R's model state before the optimizer step and every category's peak exactly,
    and its bytes per collective; marked as a dry run of that rank. "other" may peak up to
    20% lower: a real rank's collectives hold their buffers until they complete, a fake
    one's complete at once. ``received``: the bytes of pipeline receives a real rank may
    still hold at its activation peak and a lone one does not (a schedule with two stages
    a rank posts receives ahead; a fake receive completes at once)."""
    assert dry["dry_run"] == {"rank": rank, "world_size": world}
    assert dry["optimizer_kernels"] == real["optimizer_kernels"]
    (memory,) = dry["memory"]
    assert memory["rank"] == rank
    state = lambda m: {k: v for k, v in m["before_optimizer"].items() if k != "other"}  # noqa: E731
    assert state(memory) == state(real["memory"][rank])
    want, got = real["memory"][rank]["peak_by_category"], memory["peak_by_category"]
    exact = ("parameters", "gradients", "optimizer state") + (() if received else ("activations",))
    assert {k: got[k] for k in exact} == {k: want[k] for k in exact}
    assert want["activations"] - received <= got["activations"] <= want["activations"]
    assert (1 - DRY_OTHER_FEWER) * want["other"] <= got["other"] <= want["other"], (got["other"], want["other"])
    (sent,) = dry["comm"]
    assert {k: v["bytes"] for k, v in sent.items()} == {k: v["bytes"] for k, v in real["comm"][rank].items()}


def dry_runs(runs: list[dict], out, timeout_s: float, env: dict | None = None) -> dict[str, dict]:
    """Run dry runs ({"name", "script", "argv"}, each with its --fake-world-size and
    --fake-rank) one after another in one plain python process (tools/multirun.py: one
    torch start-up for all); their summaries by name, each written to out/NAME. Three steps
    each, the second traced and the third counted, as in the real runs they are held to
    (the first two do one-time work: DDP rebuilds its buckets in the second). ``env``: what
    the process's environment changes (TUTORIAL_CUDA_PATHS=0: the CPU's own AdamW loop)."""
    import json
    import os
    import sys

    import launch

    from common import ROOT
    runs = [{**r, "argv": [*r["argv"], "--steps", "3", "--trace-start", "1", "--trace-steps", "1", "--device", "cpu",
                           "--out", str(out / r["name"])]} for r in runs]
    p = launch.run([sys.executable, "tools/multirun.py", "--runs", json.dumps(runs)], cwd=ROOT,
                   capture_output=True, text=True, timeout=timeout_s, env={**os.environ, **(env or {})})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert p.stdout.count("collectives are skipped") == len(runs), p.stdout[-2000:]
    return {r["name"]: json.loads((out / r["name"] / "summary.json").read_text()) for r in runs}
