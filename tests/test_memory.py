import json
import pytest
import weakref
from types import SimpleNamespace

import matplotlib.image
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from common.measure.memory import MemoryTracer
from common.measure.memory_figure import render
from common.measure.step_gc import StepCollector
from common.model import build_model, count_params, get_config
from common.training import clip_grad_norm

CTX = SimpleNamespace(rank=0, world_size=1, is_main=True)


def _train(batch=4, seq=32, steps=3, enabled=True, start=1, n=1, seen_modes=None, between=None, clip=False):
    torch.manual_seed(0)
    cfg = get_config("debug")
    model = build_model(cfg, "cpu", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if seen_modes is not None:
        model.register_forward_pre_hook(lambda *_: seen_modes.append(len(_get_current_dispatch_mode_stack())))
    tracer = MemoryTracer(model, opt, "cpu", enabled=enabled, start=start, steps=n)
    data = torch.randint(0, 256, (steps, batch, seq + 1), generator=torch.Generator().manual_seed(1))
    losses = []
    for step in range(steps):
        with tracer.record(step):
            x, y = data[step, :, :-1], data[step, :, 1:]
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            if clip:
                clip_grad_norm(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if between is not None:
            between(step, tracer, model, opt)
    return tracer, model, opt, losses


def test_model_state_bytes_are_exactly_the_formula():
    tracer, model, opt, _ = _train()
    n = count_params(get_config("debug"))
    n_tensors = len(list(model.parameters()))
    peaks = tracer.result["peak_by_category"]
    assert peaks["parameters"] == 4 * n
    assert peaks["gradients"] == 4 * n
    # AdamW: exp_avg + exp_avg_sq in fp32 (8 bytes per parameter), plus one 4-byte fp32
    # `step` counter per parameter tensor (on CPU it is a tensor on the same device)
    assert peaks["optimizer state"] == 8 * n + 4 * n_tensors
    assert tracer.result["at_peak"]["activations"] > 0


def test_phases_are_marked_in_order():
    tracer, *_ = _train(n=2, clip=True)
    phases = [p for _, p in tracer.result["phases"] if p]
    # clipping, between backward and the optimizer step, is a phase of its own, not a second forward
    assert phases == ["forward", "backward", "clipping", "optimizer"] * 2
    assert [s for _, s in tracer.result["steps"]] == [1, 2]
    # the peak of a plain step falls at the end of forward / start of backward
    fwd_start, opt_start = (next(e for e, p in tracer.result["phases"] if p == name) for name in ("forward", "optimizer"))
    assert fwd_start < tracer.result["peak_event"] <= opt_start


def test_activations_grow_with_batch_size():
    small = _train(batch=2)[0].result["peak_by_category"]["activations"]
    large = _train(batch=8)[0].result["peak_by_category"]["activations"]
    assert 3.5 < large / small < 4.2  # four times the tokens, nearly four times the bytes


def test_the_figure_is_a_real_png_and_the_json_has_every_category(tmp_path):
    tracer, *_ = _train(n=2)
    traces = tracer.save(tmp_path, CTX, title="test")
    png = tmp_path / "memory_trace.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(png)
    assert img.shape[0] > 300 and img.shape[1] > 600 and img[..., :3].std() > 0.05  # not blank
    saved = json.loads((tmp_path / "memory_trace.json").read_text())
    assert saved[0]["peak_by_category"] == traces[0]["peak_by_category"]
    assert set(saved[0]["series"]) == {"event", "parameters", "gradients", "optimizer state", "activations", "other"}


def test_recording_off_adds_nothing(tmp_path):
    seen_off, seen_on = [], []
    tracer, _, opt, losses_off = _train(enabled=False, seen_modes=seen_off)
    assert seen_off == [0, 0, 0]                 # no dispatch mode ever ran
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    assert tracer.save(tmp_path, CTX, title="off") is None and not list(tmp_path.iterdir())
    tracer, _, opt, losses_on = _train(enabled=True, start=1, n=1, seen_modes=seen_on)
    assert seen_on == [0, 1, 0]                  # only the recorded step, and cleaned up after
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    assert losses_on == losses_off               # recording does not change the numbers


def test_a_checkpoint_host_copy_is_its_own_category_freed_by_its_writer_thread(tmp_path):
    """What --ckpt-async's stager copied after step 1 (a clone of the model state, handed over
    with ``staged``) is "checkpoint staging" until the thread that wrote it drops it, during
    step 2; the other categories are those of a run without it, and so is a trace without it."""
    import threading

    from common.measure.memory_categories import CATEGORIES, STAGING
    held, done = {}, threading.Event()

    def checkpoint(step, tracer, model, opt):
        if step != 1:
            return
        held["copy"] = [t.detach().clone() for t in [*model.parameters(), *(v for s in opt.state.values()
                                                                             for v in s.values())]]
        tracer.staged(held["copy"])

        def write():  # the writer thread: done once step 2 has begun, then the copy goes
            done.wait()
            held.clear()
        writer = threading.Thread(target=write)
        writer.start()

        def step2_begins(*_):
            if not done.is_set():
                done.set()
                writer.join()  # the copy is freed in the writer's thread, in step 2
        model.register_forward_pre_hook(step2_begins)

    tracer, model, opt, _ = _train(steps=3, n=2, between=checkpoint)
    plain, *_ = _train(steps=3, n=2)
    n, tensors = count_params(get_config("debug")), len(list(model.parameters()))
    r = tracer.result
    assert r["peak_by_category"][STAGING] == 12 * n + 4 * tensors  # weights + AdamW moments + step counts
    assert list(r["peak_by_category"]) == [*CATEGORIES, STAGING] and list(plain.result["peak_by_category"]) == \
        list(CATEGORIES)
    assert {c: r["peak_by_category"][c] for c in CATEGORIES} == plain.result["peak_by_category"]
    staged = r["series"][STAGING]
    assert staged[0] == 0 and staged[-1] == 0 and max(staged) == 12 * n + 4 * tensors  # taken, then freed
    step2 = next(e for e, s in r["steps"] if s == 2)
    freed = next(e for e, b in zip(r["series"]["event"], staged) if e > step2 and b == 0)
    assert freed > step2  # freed in another thread, counted when the recording thread next ran
    traces = tracer.save(tmp_path, CTX, title="test")
    assert set(traces[0]["series"]) == {"event", *CATEGORIES, STAGING}
    assert (tmp_path / "memory_trace.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _overlap(a, b, margin=0.0):
    return a[0] - margin < b[2] and b[0] - margin < a[2] and a[1] - margin < b[3] and b[1] - margin < a[3]


def test_the_box_never_hides_the_peak_and_the_allocator_peak_is_a_line(tmp_path):
    trace = dict(_train(n=2, clip=True)[0].result, rank=0)
    end = trace["events"] - 1
    for at in (int(0.1 * end), int(0.5 * end), int(0.97 * end)):  # a peak on the left, in the middle, on the right
        t = dict(trace, peak_event=at, allocator_peak_bytes=int(trace["peak_bytes"] * 1.2))
        (panel,) = render([t], tmp_path / f"at{at}.png", title="box")
        x, y = panel["peak"]
        assert not _overlap(panel["box"], [x, y, x, y], margin=6), (at, panel)
        assert not _overlap(panel["box"], panel["label"]), (at, panel)
        assert panel["allocator"] is not None and panel["allocator"] > y  # drawn above the traced peak
    (panel,) = render([dict(trace, allocator_peak_bytes=None)], tmp_path / "none.png", title="no allocator peak")
    assert panel["allocator"] is None


def test_a_window_reaching_past_the_last_step_keeps_the_steps_that_ran(tmp_path):
    said = []
    tracer, *_ = _train(steps=2, start=1, n=2)  # asks for steps 1-2 of a run whose last step is 1
    assert tracer.result is None  # (still recording when the loop ended)
    traces = tracer.save(tmp_path, SimpleNamespace(rank=0, world_size=1, is_main=True, print=said.append), "past")
    assert [s for _, s in traces[0]["steps"]] == [1] and traces[0]["peak_bytes"] > 0
    assert (tmp_path / "memory_trace.png").exists()
    assert len(said) == 1 and "ended at step 1" in said[0] and "holds step 1" in said[0]


def test_the_step_collector_finds_tensors_held_by_a_reference_cycle():
    class Ring:
        pass

    collector = StepCollector()
    try:
        collector.collect()
        ring = Ring()
        ring.me, ring.t = ring, torch.zeros(1000)  # 4000 bytes only a cycle holds, once the name goes
        ring.proxy = weakref.proxy(Ring())  # a dead proxy in the garbage, as torch.compile leaves them
        del ring
        collector.collect()
        _train(steps=2, enabled=False)  # a plain training loop leaves no tensor in a cycle
        collector.collect()
    finally:
        collector.close()
    assert collector.tensor_bytes == [0, 4000, 0]
    assert collector.objects[1] >= 2  # the ring and the tensor (and its __dict__ where it is an object)


def _mem(ts, addr, nbytes, tid=1):
    return {"ph": "i", "name": "[memory]", "tid": tid, "ts": ts, "args": {"Addr": addr, "Bytes": nbytes, "Device Type": 0}}


def test_the_cpu_count_keeps_gloos_buffers_apart_and_survives_frees_it_never_saw():
    """The CPU allocator's count from a profiler trace (common/measure/allocator_count.py, _cpu_count):
    a block allocated inside a c10d op, or on another thread (gloo's worker), is gloo's own (kept
    out of the peak, its size reported),
    whether or not its free was seen; a block whose address comes back before its free was
    seen was freed by a thread the profiler does not record, and leaves the count there."""
    from common.measure.allocator_count import _cpu_count
    events = [
        {"ph": "X", "name": "c10d::_allgather_base_", "tid": 1, "ts": 10, "dur": 5},
        {"ph": "X", "name": "c10d::send", "tid": 2, "ts": 18, "dur": 5},  # (another thread's: no span)
        _mem(1, 0xA, 100),          # an activation
        _mem(11, 0xB, 400),         # gloo's staging buffer, inside the all-gather
        _mem(12, 0xE, 300, tid=2),  # gloo's worker thread: gloo's too
        _mem(13, 0xE, -300, tid=2),
        _mem(20, 0xC, 50),          # (inside thread 2's span, but on the main thread)
        _mem(21, 0xC, -50),
        _mem(30, 0xA, 70),          # 0xA again, its free never seen: the 100 bytes are gone
        _mem(31, 0xD, 10),
    ]
    top, gloos, unseen = _cpu_count(events, main=1)
    assert (top, gloos) == (150, 400)  # 100, +50: the peak, -50, -100 +70, +10
    assert _cpu_count([_mem(1, 0xA, 100), _mem(2, 0xA, 100), _mem(3, 0xA, 100)], main=1)[:2] == (100, 0)


def test_the_cpu_count_names_what_the_trace_did_not_see_at_its_peak():
    """At the allocator's peak, the blocks the trace never saw (no tensor an op returned had
    their address while they held it), by the innermost op that allocated them: a matmul's
    workspace is what separates the two peaks, whatever its size on this CPU."""
    from common.measure.allocator_count import _cpu_count
    events = [
        {"ph": "X", "name": "aten::linear", "tid": 1, "ts": 10, "dur": 10},
        {"ph": "X", "name": "aten::mm", "tid": 1, "ts": 11, "dur": 8},
        _mem(1, 0xA, 100),   # an activation the trace saw (at time 2)
        _mem(12, 0xB, 64),   # the matmul's output, seen when the op returned (time 19)
        _mem(13, 0xC, 32),   # its workspace: never an op's output
        _mem(15, 0xD, 16),   # 0xD: the trace saw this address, but for a block long gone (time 0)
        _mem(16, 0xD, -16),
        _mem(17, 0xC, -32),
        _mem(30, 0xB, -64),
    ]
    seen = [(0xA, 2.0), (0xB, 19.0), (0xD, 0.0)]
    top, _, unseen = _cpu_count(events, main=1, seen=seen)
    assert top == 100 + 64 + 32 + 16  # the peak: all four alive at time 15
    assert unseen == {"bytes": 48, "by_op": {"aten::mm": 48}}  # the workspace and 0xD's block, seen at no time of theirs
    seen.append((0xD, 15.5))
    assert _cpu_count(events, main=1, seen=seen)[2] == {"bytes": 32, "by_op": {"aten::mm": 32}}


def test_a_free_on_another_thread_does_not_inflate_the_cpu_allocator_peak():
    """What gloo's worker threads do to the count, done by a Python thread: every step, a
    block the main thread allocated is freed by another thread, which the profiler never
    records. Without pairing by address the count grew by a block a step."""
    import threading
    cfg = get_config("debug")
    model = build_model(cfg, "cpu", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tracer = MemoryTracer(model, opt, "cpu", enabled=True, start=0, steps=4)
    x = torch.randint(0, 256, (2, 16))
    for step in range(4):
        with tracer.record(step):
            box = [torch.empty(1 << 18)]  # 1 MiB, freed below by another thread
            model(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t = threading.Thread(target=box.clear)
            t.start()
            t.join()
    r = tracer.result
    assert r["peak_bytes"] / r["allocator_peak_bytes"] == pytest.approx(1, abs=0.01), r["allocator_peak_bytes"]


def test_a_block_from_before_the_window_freed_inside_it_leaves_the_cpu_count():
    """The profiler cannot size a free of a block allocated before it started (and says
    nothing): the trace tells the count. Here the previous step's gradients, alive when the
    window opens, are freed by the first thing the step does (DDP's second step does the
    same to its gradient buckets, which it rebuilds): without this the count kept them, 4N
    bytes too many at the peak."""
    model = build_model(get_config("debug"), "cpu", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tracer = MemoryTracer(model, opt, "cpu", enabled=True, start=1, steps=1)
    x = torch.randint(0, 256, (2, 16))
    for step in range(2):
        with tracer.record(step):
            opt.zero_grad(set_to_none=True)
            model(x).float().pow(2).mean().backward()
            opt.step()
    r = tracer.result
    assert r["peak_bytes"] / r["allocator_peak_bytes"] == pytest.approx(1, abs=0.01), r["allocator_peak_bytes"]


def test_runs_in_one_process_leave_nothing_of_each_other(tmp_path):
    """Traced runs one after another in one process (tools/gpu_check.py, tools/multirun.py):
    when a run returns, nothing of it is alive, without waiting for a collection (a reference
    cycle through the tracer kept the model and AdamW's state until one: on CUDA, whose
    allocator counts everything alive, the next run's peak then held 12-16 bytes a parameter
    of every run before it). FSDP2's own cycles (module <-> FSDPParam) go with the full
    collection tools.multirun makes after every run."""
    import sys

    import launch
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    scripts = ["step1_single_gpu/train.py", "step2_memory/train_amp.py", "step2_memory/train_amp_ac.py",
               "step3_multi_gpu/train_ddp.py", "step3_multi_gpu/train_tp.py", "multirun:step3_multi_gpu/train_fsdp.py",
               "multirun:step3_multi_gpu/train_tp.py"]
    r = launch.run([sys.executable, "tests/drivers/one_process.py", str(tmp_path), *scripts], cwd=root,
                   capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads((tmp_path / "alive.json").read_text())
    baseline = rows[0]
    assert baseline["models"] == baseline["optimizers"] == 0
    assert [row["script"] for row in rows[1:]] == scripts
    for row in rows[1:]:
        # nothing of the finished run: no model, no optimizer, no tensor beyond what was alive before
        assert (row["models"], row["optimizers"], row["tensor_bytes"]) == (0, 0, baseline["tensor_bytes"]), row
        assert row["after_collect"]["tensor_bytes"] == baseline["tensor_bytes"], row
        assert row["frozen"] == 0, row  # the collector was given back everything frozen during the run
