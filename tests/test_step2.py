"""Step 2: memory savers on one device. Parity with the plain step, the memory they save,
the fp16 loss scaler under overflow, and misuse.

Most checks run the step scripts' ``main()`` in this process (starting a Python that
imports torch costs seconds on 2 cores); the misuse checks launch real processes to see
the exit code and the one-line message.
"""
import copy
import importlib.util
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from common import ROOT  # noqa: E402
sys.path.insert(0, str(ROOT))

import launch  # noqa: E402

from common import training  # noqa: E402
from common.measure.memory import MemoryTracer  # noqa: E402
from common.parallelize.ac import apply_ac  # noqa: E402
from common.model import build_model, get_config  # noqa: E402

# Real text that loads at once (the default corpus takes seconds to read): this repo's model.
TINY = ["--model", "debug", "--seq-len", "64", "--global-batch-size", "4", "--data", str(ROOT / "common" / "model.py"),
        "--device", "cpu", "--eval-batches", "1", "--warmup-steps", "2"]
_modules = {}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The debug model's ops are too small to share between threads, and on a busy 2-core
    machine a second OpenMP thread that is not scheduled stalls every op (measured: a
    3-step run took 10 s with 2 threads and 0.3 s with 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _script(name):
    """Import step2_memory/<name>.py once as a module (its main() parses sys.argv)."""
    if name not in _modules:
        spec = importlib.util.spec_from_file_location(f"step2_{name}", ROOT / "step2_memory" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _modules[name] = mod
    return _modules[name]


def run_main(monkeypatch, name, out, *flags, steps=3):
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *TINY, "--steps", str(steps), "--out", str(out), *flags])
    _script(name).main()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trace = out / "memory_trace.json"
    return rows, json.loads(trace.read_text())[0] if trace.exists() else None


def capture(monkeypatch, module, name):
    """Wrap module.<name> (a factory the script calls) and keep what it returns."""
    kept = []
    real = getattr(module, name)

    def wrapper(*args, **kwargs):
        kept.append(real(*args, **kwargs))
        return kept[-1]

    monkeypatch.setattr(module, name, wrapper)
    return kept


TRACED = {  # name: (script, flags); each traces one step (step 1) and skips the evaluation
    "fp32": ("train_amp", ["--amp", "off"]),
    "bf16": ("train_amp", []),
    "bf16+ac": ("train_amp_ac", []),
    "bf16+sac": ("train_amp_ac", ["--ac", "selective"]),
    "bf16+ac every 2": ("train_amp_ac", ["--ac", "full", "--ac-every", "2"]),
    # the page's size, where the first rebuild is the peak: the last (unchecked) block's activations
    # are freed before it (the formula once counted both: 0.85)
    "bf16+ac every 2, small": ("train_amp_ac", ["--ac", "full", "--ac-every", "2", "--model", "small",
                                                "--seq-len", "256", "--global-batch-size", "8"]),
    "accum fp32": ("train_accum", ["--amp", "off", "--ac", "none"]),
    "bf16+ac+accum": ("train_accum", []),
}


@pytest.fixture(scope="module")
def traced(tmp_path_factory, one_thread):
    """The runs several tests look at, made once: {name: (metrics rows, trace, out dir)}."""
    import common.measure.memory_result

    out = tmp_path_factory.mktemp("traced")
    results = {}
    render = common.measure.memory_result.render
    with pytest.MonkeyPatch.context() as mp:
        for name, (script, flags) in TRACED.items():
            # One figure is enough to see that it is drawn; matplotlib costs seconds.
            mp.setattr(common.measure.memory_result, "render", render if name == "bf16" else lambda *a, **k: None)
            folder = out / name.replace(" ", "_").replace("+", "_")
            rows, trace = run_main(mp, script, folder, "--trace-steps", "1", "--eval-batches", "0", *flags)
            results[name] = rows, trace, folder
    return results


# ---- activation checkpointing -------------------------------------------------------------
def _traced_step(model, x, y):
    """Loss, gradients and memory trace of one fp32 forward + backward."""
    opt = torch.optim.AdamW(model.parameters())
    tracer = MemoryTracer(model, opt, "cpu", start=0, steps=1)
    with tracer.record(0):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.item(), grads, tracer.result["peak_by_category"]


def test_ac_same_loss_and_gradients_less_activation_memory():
    cfg = get_config("debug")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 256, (4, 128), generator=g), torch.randint(0, 256, (4, 128), generator=g)
    reference = build_model(cfg, "cpu")
    keys = list(reference.state_dict())
    names = [n for n, _ in reference.named_parameters()]
    results = {}
    for mode, every in [("none", 1), ("full", 1), ("full", 2), ("selective", 1)]:
        model = copy.deepcopy(reference)
        wrapped = apply_ac(model, mode, every=every)
        assert wrapped == ([] if mode == "none" else ["0", "2"] if every == 2 else ["0", "1", "2", "3"])
        # Nothing is wrapped: names and state_dict keys are those of the plain model.
        assert list(model.state_dict()) == keys and [n for n, _ in model.named_parameters()] == names
        results[mode, every] = _traced_step(model, x, y)
    assert type(model.layers["0"]).__name__ == "CheckpointedTransformerBlock"

    loss0, grads0, mem0 = results["none", 1]
    for key, (loss, grads, _) in results.items():
        # Recomputation replays the same fp32 ops on the same inputs: same numbers.
        assert loss == pytest.approx(loss0, rel=1e-6, abs=0), key
        for n in names:
            torch.testing.assert_close(grads[n], grads0[n], rtol=1e-5, atol=1e-7, msg=f"{key}: {n}")
    act = {key: r[2]["activations"] for key, r in results.items()}
    assert act["full", 1] < act["selective", 1] < act["none", 1], act
    assert act["full", 1] < act["full", 2] < act["none", 1], act
    # Full AC keeps little more than the four block inputs: the rest is gone.
    assert act["full", 1] < 0.3 * act["none", 1], act
    # ...and rebuilds one block at a time in backward, which the tracer counts as "other".
    assert results["full", 1][2]["other"] > mem0["other"]


def test_checkpointing_twice_is_refused_and_unknown_mode_named():
    model = build_model(get_config("debug"), "cpu")
    apply_ac(model, "full")
    with pytest.raises(ValueError, match="already checkpointed"):
        apply_ac(model, "full")
    with pytest.raises(ValueError, match="unknown AC mode 'some'"):
        apply_ac(model, "some")


def test_every_step2_run_measures_what_theory_predicts(traced):
    """Each step-2 script prints common/measure/theory.py's prediction beside its trace: model
    state to the byte, activations (the formula per block: fp32, autocast bf16, selective and
    full checkpointing, every k-th block, micro-batches) within 1.5%, and the step's peak within
    -5%/+10%. Mostly from below: the formula leaves out the backward's own temporaries (the
    gradients of activations), 2-8% of the peak at the debug model's 64 tokens, under 2% at
    1b on an H200 (tests/test_estimate.py holds the formula to those runs). With --ac-every 2
    backward frees the last (unchecked) block's activations before it rebuilds a checkpointed
    one, and the formula's start of backward says so."""
    for name, (_, _, out) in traced.items():
        row = json.loads((out / "summary.json").read_text())["predicted"]["per_rank"][0]
        for c in ("parameters", "gradients", "optimizer state"):
            assert row[f"measured {c}"] == row[c], (name, c)
        assert row["measured activations"] == pytest.approx(row["activations"], rel=0.015), name
        assert 0.95 <= row["measured peak"] / row["peak"] < 1.10, (name, row["peak_at"])


def test_the_trace_agrees_with_the_cpu_allocator_for_every_saver(traced):
    """The tracer held to an allocator on a CPU: PyTorch's CPU allocator counts, over the
    traced step, every block it hands out and takes back (the profiler's memory events);
    its peak and the traced peak agree within 1% of what the trace could see for every saver
    (tests/tolerances.py: a bf16 matmul's workspace is the math library's, named by the count)."""
    from tests.tolerances import check_allocator
    for name, (_, trace, _) in traced.items():
        assert trace["allocator_peak_bytes"], name
        check_allocator(trace, name)


def test_no_step_leaves_tensors_in_reference_cycles(traced):
    """Nothing a step makes outlives it unless Python's cycle collector runs: Run collects
    before every step and counts the tensors it found in reference cycles (a checkpointed
    block's recomputation, its frames, the previous step's loss and its graph would be the
    usual holders). None on any step of any saver, activation checkpointing above all."""
    for name, (rows, _, out) in traced.items():
        gc_ = json.loads((out / "summary.json").read_text())["gc"]
        assert len(gc_["tensor_bytes"]) == len(rows) == 3, name
        assert gc_["tensor_bytes"] == [0, 0, 0], (name, gc_)


# ---- gradient accumulation ----------------------------------------------------------------
def test_accumulation_matches_one_big_batch(monkeypatch, tmp_path):
    """K micro-batches (loss / K each) make the same updates as the whole batch at once."""
    acc = _script("train_accum")
    first_grads, models = [], []

    def adamw(params, args, **kwargs):  # the optimizer, with a look at what it is handed
        opt = common_adamw(params, args, **kwargs)
        opt.register_step_pre_hook(lambda o, *_: first_grads.append(
            [p.grad.clone() for g in o.param_groups for p in g["params"]]) if not o.state else None)
        return opt

    common_adamw = acc.adamw
    monkeypatch.setattr(acc, "adamw", adamw)
    monkeypatch.setattr(acc, "evaluate", lambda model, *a, **k: models.append(model))  # keep the trained model
    runs = {k: run_main(monkeypatch, "train_accum", tmp_path / f"k{k}", "--amp", "off", "--ac", "none",
                        "--grad-accum", str(k), "--no-trace-memory") for k in (1, 4)}
    big, micro = runs[1][0], runs[4][0]
    # The first update's gradients: the same up to the order of the sums (fp32 rounding).
    assert len(first_grads) == 2
    for a, b in zip(*first_grads):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-8)
    assert [r["loss"] for r in micro] == pytest.approx([r["loss"] for r in big], rel=1e-6)
    assert big[-1]["loss"] < big[0]["loss"] - 0.1  # the steps really moved the weights
    # After three AdamW steps the weights agree to 1e-5 but for a handful of elements: AdamW
    # divides each gradient by its running RMS, so an element whose gradient is near zero can
    # move by its rounding, up to two Adam trajectories apart (a plain atol of 1e-5 held only
    # while the text trained on, this repository's own model.py, happened to make none)
    from test_model_parallel import adam_drift_bound
    from tests.tolerances import WEIGHT_FRACTION
    assert list(models[0].state_dict()) == list(models[1].state_dict())
    pairs = list(zip(models[0].state_dict().values(), models[1].state_dict().values()))
    numel = sum(a.numel() for a, _ in pairs)
    over = sum(int(((b - a).abs() > 1e-5).sum()) for a, b in pairs)
    worst = max(float((b - a).abs().max()) for a, b in pairs)
    assert over <= WEIGHT_FRACTION * numel, (over, numel)
    assert worst <= adam_drift_bound(steps=3, warmup=2), worst


def test_accumulation_trace_activations_shrink_gradients_persist(traced):
    t1, t4 = traced["fp32"][1], traced["accum fp32"][1]
    ratio = t4["peak_by_category"]["activations"] / t1["peak_by_category"]["activations"]
    assert 0.2 < ratio < 0.35, ratio  # a quarter of the batch at a time (plus a little fixed cost)
    # With K > 1 all gradients are alive while the next micro-batch runs forward.
    n_bytes = sum(p.numel() * 4 for p in build_model(get_config("debug"), "meta").parameters())
    assert t4["at_peak"]["gradients"] == n_bytes, t4["at_peak"]
    assert t1["at_peak"]["gradients"] < n_bytes


# ---- mixed precision ----------------------------------------------------------------------
def test_bf16_activations_are_smaller_and_training_agrees(traced):
    (fp32, t32, _), (bf16, t16, out16) = traced["fp32"], traced["bf16"]
    ratio = t16["peak_by_category"]["activations"] / t32["peak_by_category"]["activations"]
    # Matmul, attention and SwiGLU activations are bf16 (half). RMSNorm's math and the
    # residual stream stay fp32 by design, autocast saves its own bf16 copy of an fp32
    # input per matmul and the bf16 weight copies ride along: so not quite a half.
    assert 0.5 <= ratio <= 0.8, ratio
    # Persistent state is untouched by AMP: fp32 weights, gradients and AdamW state.
    for cat in ("parameters", "optimizer state", "gradients"):
        assert t16["peak_by_category"][cat] == t32["peak_by_category"][cat], cat
    assert all(r["loss_scale"] == 1.0 for r in bf16)  # bf16 needs (and gets) no loss scaling
    assert bf16[0]["loss"] == pytest.approx(fp32[0]["loss"], abs=0.02)
    assert json.loads((out16 / "summary.json").read_text())["dtype"] == "bf16"
    assert (out16 / "memory_trace.png").stat().st_size > 10_000


def test_fp16_scaler_skips_an_overflowing_step_and_carries_on(monkeypatch, tmp_path):
    """The GradScaler recipe of train_amp.py under an injected gradient overflow.

    The script refuses fp16 on a CPU as a GPU recipe, not because it fails: PyTorch can
    autocast to fp16 there and has a CPU GradScaler, so lifting the refusal lets
    the very lines a GPU runs be tested here.
    """
    amp = _script("train_amp")
    monkeypatch.setattr(training, "amp_unsupported", lambda device, amp: None)
    optimizers = capture(monkeypatch, amp, "adamw")
    poisoned_step = 2
    calls = []

    def build(*args, **kwargs):
        model = build_model(*args, **kwargs)

        def poison(module, inputs, output):
            if output.requires_grad:  # a training forward, not the final evaluation
                calls.append(output.dtype)
                if len(calls) == poisoned_step + 1:
                    output.register_hook(lambda grad: torch.full_like(grad, float("inf")))

        model.output.register_forward_hook(poison)
        return model

    monkeypatch.setattr(amp, "build_model", build)
    rows, trace = run_main(monkeypatch, "train_amp", tmp_path / "fp16", "--amp", "fp16", "--no-trace-memory",
                           steps=6)
    assert calls[0] == torch.float16  # autocast really ran in fp16
    scales = [r["loss_scale"] for r in rows]
    before = scales[poisoned_step - 1]
    assert scales[poisoned_step] == before / 2, scales  # the overflow halved the scale...
    assert scales[poisoned_step + 1:] == [before / 2] * (len(scales) - poisoned_step - 1), scales
    state = optimizers[0].state
    steps_taken = {int(s["step"]) for s in state.values()}
    assert steps_taken == {len(rows) - 1}, steps_taken  # ...its update was skipped, once
    model_params = [p for group in optimizers[0].param_groups for p in group["params"]]
    assert all(torch.isfinite(p).all() for p in model_params)  # no inf reached the weights
    assert all(r["loss"] == r["loss"] and abs(r["loss"]) != float("inf") for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]  # and training carried on


def test_speed_flags_reach_the_optimizer_and_the_model(monkeypatch, tmp_path):
    """--fused-adamw and --compile change speed, not the lesson: check they are wired.

    torch.compile itself takes over a minute to warm up on this CPU, so Module.compile is
    replaced by a recorder here.
    """
    amp = _script("train_amp")
    optimizers = capture(monkeypatch, amp, "adamw")
    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **k: compiled.append(type(self).__name__))
    run_main(monkeypatch, "train_amp", tmp_path / "fast", "--fused-adamw", "--compile", "--no-trace-memory",
             "--eval-batches", "0", steps=2)
    run_main(monkeypatch, "train_amp", tmp_path / "plain", "--no-trace-memory", "--eval-batches", "0", steps=2)
    assert optimizers[0].defaults["fused"] is True
    assert optimizers[1].defaults["fused"] is None  # PyTorch's default, not a forced for-loop
    assert compiled == ["Transformer"]


def test_each_saving_lowers_the_activations_further(traced):
    """The scripts' defaults stack: AMP, then selective or full AC, then accumulation."""
    act = {k: t["peak_by_category"]["activations"] for k, (_, t, _) in traced.items()}
    order = ["fp32", "bf16", "bf16+sac", "bf16+ac", "bf16+ac+accum"]
    assert [act[k] for k in order] == sorted({act[k] for k in order}, reverse=True), act
    peaks = [traced[k][1]["peak_bytes"] for k in order]
    assert peaks == sorted(peaks, reverse=True), peaks
    assert all(r["loss"] == r["loss"] for rows, _, _ in traced.values() for r in rows)


def test_fused_adamw_keeps_the_same_state_and_drops_foreachs_temporary():
    """The chapter's claim about --fused-adamw: same 8 bytes per parameter of state, and
    no temporary the size of the parameters during the step (foreach, CUDA's default, makes
    one); the one-tensor-at-a-time loop (a CPU's default) makes one the size of a tensor."""
    from types import SimpleNamespace

    from common.training import adamw

    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    seen = {}
    for name, kwargs in {"foreach": {"foreach": True}, "loop": {"foreach": False}, "fused": {"fused": True}}.items():
        model = build_model(get_config("debug"), "cpu")
        opt = adamw(model.parameters(), SimpleNamespace(lr=1e-3), **kwargs)
        tracer = MemoryTracer(model, opt, "cpu", start=1, steps=1)
        for step in range(2):
            with tracer.record(step):
                F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
                opt.step()
                opt.zero_grad()
        r = tracer.result
        start = next(t for t, phase in r["phases"] if phase == "optimizer")
        end = next((t for t, _ in r["phases"] if t > start), r["events"])
        other = [o for e, o in zip(r["series"]["event"], r["series"]["other"]) if start <= e < end]
        seen[name] = r["peak_by_category"], max(other)
    n_bytes, n_tensors = seen["fused"][0]["parameters"], len(list(model.parameters()))
    # exp_avg and exp_avg_sq (8 bytes per parameter), plus a 4-byte step count per tensor
    assert seen["fused"][0]["optimizer state"] == seen["foreach"][0]["optimizer state"] == 2 * n_bytes + 4 * n_tensors
    assert seen["foreach"][1] >= n_bytes > 20 * seen["fused"][1], seen
    largest = max(p.numel() * 4 for p in model.parameters())
    assert seen["foreach"][1] > seen["loop"][1] >= largest > seen["fused"][1], (seen, largest)


def test_bench_times_every_setup_of_the_table(monkeypatch, tmp_path):
    argv = ["bench_memory_savers.py", "--model", "debug", "--seq-len", "32", "--global-batch-size", "4",
            "--steps", "2", "--device", "cpu", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    bench = _script("bench_memory_savers")
    bench.main()
    result = json.loads((tmp_path / "bench.json").read_text())["result"]
    assert list(result) == list(bench.SAVERS)
    assert all(len(r["times_s"]) == 2 and 0 < r["min_s"] <= r["median_s"] for r in result.values())


# ---- the tracer does not count the training data --------------------------------------------
def test_tracer_ignores_views_of_memory_from_before_recording():
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters())
    corpus = torch.zeros(1_000_000, dtype=torch.uint8)  # like the DataLoader's token tensor
    tracer = MemoryTracer(model, opt, "cpu", start=0, steps=1)
    with tracer.record(0):
        x = corpus[:64].float().view(8, 8)  # the slice is a view of the whole corpus
        model(x).sum().backward()
        opt.step()
    assert tracer.result["peak_bytes"] < 100_000, tracer.result["at_peak"]


# ---- misuse ---------------------------------------------------------------------------------
MISUSE = [
    ("train_accum", ["--grad-accum", "3"],
     "error: --grad-accum 3 does not split --global-batch-size 4 into equal micro-batches; use a divisor of 4."),
    ("train_amp", ["--amp", "fp16"],
     "error: --amp fp16 needs a CUDA GPU (fp16 with loss scaling is a GPU recipe; most CPUs have no fp16 "
     "arithmetic); "
     "use --amp bf16, which needs no loss scaling, or --amp off."),
    ("train_amp_ac", ["--ac", "sometimes"], "error: unknown --ac mode 'sometimes'; choose one of none, full, selective, selective-op."),
    ("train_amp_ac", ["--ac", "full", "--ac-every", "0"], "error: --ac-every must be positive (got 0)."),
    ("train_amp", ["--amp", "fp8"], "error: unknown --amp 'fp8'; choose one of off, bf16, fp16."),
    ("train_accum", ["--grad-accum", "0"], "error: --grad-accum must be positive (got 0)."),
]


@pytest.fixture(scope="module", autouse=True)
def misuse_process(tmp_path_factory):
    """Started before the first test, so that its seconds of importing torch overlap them."""
    name, flags, _ = MISUSE[1]
    out = tmp_path_factory.mktemp("misuse")
    proc = launch.Popen([sys.executable, str(ROOT / "step2_memory" / f"{name}.py"), *TINY, "--out", str(out),
                         *flags], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def test_misuse_exits_with_one_sentence_as_a_process(misuse_process):
    """One real process: exit code 2, the sentence on stderr, no traceback, nothing else."""
    out, err = misuse_process.communicate(timeout=120)
    assert misuse_process.returncode == 2, err
    assert err.strip() == MISUSE[1][2]
    assert out == ""


@pytest.mark.parametrize("name, flags, message", MISUSE, ids=[" ".join(m[1]) for m in MISUSE])
def test_misuse_is_one_sentence_and_a_nonzero_exit(monkeypatch, tmp_path, capsys, name, flags, message):
    with pytest.raises(SystemExit) as exc:  # main_guard's exit, as the process would make it
        run_main(monkeypatch, name, tmp_path, *flags)
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip() == message


def test_compile_without_a_compiler_is_refused(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(training.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit) as exc:
        run_main(monkeypatch, "train_amp", tmp_path, "--compile")
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip() == ("error: --compile on CPU needs a C++ compiler (g++ or clang++) "
                                               "on the PATH; install one or drop --compile.")


def test_scripts_only_accept_their_own_flags(monkeypatch, tmp_path, capsys):
    """train_amp.py has no AC: --ac there is an argparse error, not a silently ignored flag."""
    with pytest.raises(SystemExit) as exc:
        run_main(monkeypatch, "train_amp", tmp_path, "--ac", "full")
    assert exc.value.code == 2
    assert "unrecognized arguments: --ac full" in capsys.readouterr().err


def test_memory_trace_leaves_compiled_steps_untouched(monkeypatch, tmp_path):
    """--compile with the memory trace on: the steps after the trace must run the same
    compiled graphs as a run without the trace (on an H100 they ran 2.3x slower when the
    allocator's history was left recording). Dynamo's counters of a traced run equal an
    untraced run's (no recompilation, no graph lost), and afterwards no dispatch mode, no
    tracer hook and no allocator history is left behind.

    The aot_eager backend: dynamo's capture and guards are what matter here, and inductor's
    C++ code generation costs a minute on this CPU."""
    from torch._dynamo.utils import counters
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    real_compile = torch.nn.Module.compile
    aot_eager = torch._dynamo.lookup_backend("aot_eager")
    calls = []

    def counting_backend(gm, example_inputs):  # aot_eager, counting each run of the compiled graph
        compiled = aot_eager(gm, example_inputs)
        return lambda *a: calls.append(1) or compiled(*a)

    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **k: real_compile(self, backend=counting_backend))
    seen = {}
    for name, flags in (("untraced", ["--no-trace-memory"]), ("traced", ["--trace-start", "1", "--trace-steps", "2"])):
        torch._dynamo.reset()
        counters.clear()
        calls.clear()
        rows, trace = run_main(monkeypatch, "train_amp", tmp_path / name, "--compile", "--eval-batches", "0",
                               *flags, steps=6)
        seen[name] = {"frames": dict(counters["frames"]), "graphs": counters["stats"]["unique_graphs"],
                      "recompiles": sum(v for k, v in counters["recompiles"].items()), "traced": trace is not None,
                      "losses": [r["loss"] for r in rows], "compiled_steps": len(calls)}
        assert not _get_current_dispatch_mode_stack(), "a dispatch mode was left installed"
    assert seen["traced"]["traced"] and not seen["untraced"]["traced"]
    assert seen["traced"]["graphs"] == seen["untraced"]["graphs"] >= 1
    assert seen["traced"]["frames"] == seen["untraced"]["frames"]
    assert seen["traced"]["recompiles"] == seen["untraced"]["recompiles"] == 0
    # Every step ran the compiled graph, but the two traced ones (dynamo runs a frame eagerly
    # while a TorchDispatchMode is active: the figure shows eager memory).
    assert seen["untraced"]["compiled_steps"] == 6 and seen["traced"]["compiled_steps"] == 4
    assert seen["traced"]["losses"] == pytest.approx(seen["untraced"]["losses"], rel=1e-6)
    torch._dynamo.reset()


def test_selective_ac_recomputes_no_matmul_and_full_ac_a_forward():
    """The FLOPs column of the chapter's table: full AC runs each block's forward again in
    backward, but for the last matmul (w2), whose output backward does not need (the
    non-reentrant checkpoint stops as soon as it has what it needs); selective AC keeps
    every matmul output and replays only the cheap ops, so its matmul FLOPs equal no AC's.
    (CPU's attention kernel has no FLOP formula in FlopCounterMode: matmuls only here.)"""
    from common.measure.interleaved_bench import matmul_flops, memory_saver_step
    cfg, batch, seq = get_config("debug"), 4, 64
    flops = {ac: matmul_flops(memory_saver_step("debug", batch, seq, "cpu", amp="bf16", ac=ac))
             for ac in ("none", "selective", "full")}
    d, kv, f = cfg.dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_dim
    block = 2 * d * d + 2 * d * kv + 3 * d * f  # wq, wo, wk, wv, w1, w2, w3
    tokens = batch * seq
    assert flops["none"] == 6 * tokens * (cfg.n_layers * block + d * cfg.vocab_size)  # 6N per token
    assert flops["selective"] == flops["none"]
    assert flops["full"] - flops["none"] == 2 * tokens * cfg.n_layers * (block - d * f)


def test_step2_scripts_checkpoint_and_resume_exactly(monkeypatch, tmp_path, capsys):
    """Run saves and resumes step 2's runs as step 1's: a bf16 + AC + accumulation run whose
    last checkpoint is lost redoes steps 2 and 3 from step 1's, with the same losses. Its
    AdamW ran fused; resumed without --fused-adamw it still runs fused (the checkpoint's
    parameter groups say so), and the run says so and reports the kernels that ran."""
    import shutil
    flags = ["--grad-accum", "2", "--ckpt-every", "2", "--no-trace-memory", "--eval-batches", "0"]
    rows, _ = run_main(monkeypatch, "train_accum", tmp_path, *flags, "--fused-adamw", steps=4)
    assert json.loads((tmp_path / "summary.json").read_text())["optimizer_kernels"] == "fused"
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000003")  # as if the run had died after step 2
    capsys.readouterr()
    again, _ = run_main(monkeypatch, "train_accum", tmp_path, *flags, "--resume", steps=4)
    assert [r["step"] for r in again] == [0, 1, 2, 3]
    assert [r["loss"] for r in again] == [r["loss"] for r in rows]  # steps 0-1 kept, 2-3 redone bit for bit
    assert [r["grad_norm"] for r in again[2:]] == [r["grad_norm"] for r in rows[2:]]
    said = capsys.readouterr().out
    assert "AdamW runs its fused kernels, as the checkpoint's optimizer did, not the " in said
    assert json.loads((tmp_path / "summary.json").read_text())["optimizer_kernels"] == "fused"


def test_fp16_with_checkpoints_is_refused(monkeypatch, tmp_path, capsys):
    """The loss scale is not in the checkpoint: an fp16 run could not resume exactly."""
    monkeypatch.setattr(training, "amp_unsupported", lambda device, amp: None)  # fp16 on this CPU
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, "train_amp", tmp_path, "--amp", "fp16", "--ckpt-every", "2")
    assert e.value.code == 2
    assert "--amp fp16 cannot be checkpointed" in capsys.readouterr().err


def test_throughput_benchmark_prints_both_and_the_overhead(capsys):
    """tools/bench_throughput.py at the debug scale: both loops run, the ratio is a number."""
    import math
    from tools.bench_throughput import main
    got = main(["--scale", "debug", "--steps", "2", "--device", "cpu", "--no-compile"])
    out = capsys.readouterr().out
    assert got["bare_tokens_per_s"] > 0 and got["script_tokens_per_s"] > 0
    assert math.isfinite(got["overhead"]) and got["overhead"] > -0.9
    for line in ("bare loop", "our script", "overhead", "MFU", "host syncs"):
        assert line in out, line
    assert got["bare_syncs_per_step"] == got["script_syncs_per_step"] == 0  # tests/test_syncs.py


def test_speed_variants_compile_what_they_name_and_report_each_row(capsys, monkeypatch):
    """tools/bench_variants.py (the GPU pass's phase 1): each variant compiles what it names
    (per block, the whole model, with its mode), a row per variant, a failure reported in
    its row and in the exit status, misuse refused in one sentence."""
    import torch.nn as nn
    from tools import bench_variants as bv
    compiled = []
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kw: compiled.append((type(self).__name__, kw)))
    cfg = get_config("debug")
    for name, want in [("blocks", [("TransformerBlock", {})] * cfg.n_layers), ("eager", []),
                       ("model", [("Transformer", {})]), ("fused", [("TransformerBlock", {})] * cfg.n_layers),
                       ("cudagraphs", [("Transformer", {"mode": "reduce-overhead"})]),
                       ("autotune", [("TransformerBlock", {"mode": "max-autotune-no-cudagraphs"})] * cfg.n_layers)]:
        compiled.clear()
        bv.prepare(build_model(cfg, "cpu", seed=0), bv.BY_NAME[name])
        assert compiled == want, name
    assert bv.BY_NAME["fused"].fused and not bv.BY_NAME["blocks"].fused
    # float8: step 2.6's conversion first, then the whole model compiled (the casts in its graph)
    compiled.clear()
    model = build_model(cfg, "cpu", seed=0)
    bv.prepare(model, bv.BY_NAME["float8"])
    kinds = [type(m).__name__ for m in model.modules() if isinstance(m, nn.Linear)]
    assert compiled == [("Transformer", {})] and kinds.count("Float8Linear") == len(kinds) - 1, kinds  # output: bf16
    # float8 is reported against its own reference, the whole-model graph in bf16
    monkeypatch.setattr(bv, "run_variant", lambda v, argv, timeout: {"tokens_per_s": {"model": 800.0}.get(v.name, 1000.0),
                                                                     "ready_s": 1.0})
    bv.main(["--device", "cpu", "--scale", "debug", "--only", "model,float8"])
    assert "float8 against model: 1.250x" in capsys.readouterr().out
    monkeypatch.undo()
    # the child's result reaches the parent (a fresh process, eager: no compile on a CPU here)
    got = bv.main(["--device", "cpu", "--scale", "debug", "--steps", "1", "--only", "eager"])
    assert got["eager"]["tokens_per_s"] > 0 and got["eager"]["ready_s"] > 0
    assert "eager" in capsys.readouterr().out
    # a variant that runs past --timeout is stopped, reported in its row, and fails the run
    # (a variant past --timeout: stopped, said in its row, and the run fails)
    for argv, message, row in [(["--only", "eager", "--timeout", "0.5"], "1 of 1 variants did not finish: eager",
                                "stopped after 0 s (--timeout)"),
                               (["--only", "eager,fast"], "--only: no variant named fast", None),
                               (["--only", "cudnn"], "--only: cudnn run on CUDA only.", None)]:
        with pytest.raises(SystemExit) as e:
            bv.main(["--device", "cpu", "--scale", "debug", *argv])
        out = capsys.readouterr()
        assert e.value.code == 2 and message in out.err, out.err
        assert row is None or row in out.out, out.out
