"""common/measure/theory.py (adding up formulas.py) and tools/estimate.py: the formulas by hand,
against the memory tracer (on real CPU tensors and under FakeTensorMode with a fake process
group), and bad input."""
import json
import math
import re
import subprocess
import sys

import pytest

from common.measure import formulas, splits, theory
from common.measure.missed_layouts import dry_run_argv, missed_layouts
from common.measure.splits import param_shapes
from common.measure.plan import Plan
from tools.estimate import main as estimate_main, trace
from common.model import count_params, get_config
import launch
from conftest import ROOT

DEBUG, SMALL = get_config("debug"), get_config("small")
N, T = count_params(DEBUG), 9 * DEBUG.n_layers + 3  # parameters, parameter tensors


@pytest.fixture(scope="module")
def step1(tmp_path_factory):
    """A real step 1 run (started first; its summary.json holds prediction and measurement)."""
    out = tmp_path_factory.mktemp("step1")
    proc = launch.Popen([sys.executable, "step1_single_gpu/train.py", "--model", "debug", "--steps", "2",
                         "--seq-len", "64", "--global-batch-size", "4", "--device", "cpu", "--data", "synthetic",
                         "--eval-batches", "0", "--trace-steps", "1", "--out", str(out)],
                        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield proc, out
    proc.kill()


def test_formulas_equal_hand_computed_bytes(step1):
    p = theory.predict(Plan(DEBUG, "ddp", world=4, batch=8, seq_len=32))
    assert p["parameters"] == p["gradients"] == 4 * N and p["optimizer state"] == 8 * N + 4 * T
    # 2 sequences x 32 tokens per rank; per token and layer 4(8d + 2kv + 4f + h + 2) bytes; the
    # head 12d + 4 + 4V (log-probs: train_ddp.py asks the model for the loss, nothing holds the
    # logits); the batch's x and y, 16 bytes per token
    d, kv, f, h, v = 64, 32, 192, 4, 256
    assert p["activations"] == 64 * (4 * 4 * (8 * d + 2 * kv + 4 * f + h + 2) + 12 * d + 4 + 4 * v + 16)
    assert p["comm"] == {"all_reduce": 4 * N}
    z3 = theory.predict(Plan(DEBUG, "fsdp", world=4, batch=8, seq_len=32))
    assert z3["parameters"] == 4 * N // 4 and z3["optimizer state"] == 8 * N // 4 + 4 * T  # debug splits evenly
    ac = theory.predict(Plan(DEBUG, "single", batch=2, seq_len=32, ac="full"))
    assert ac["activations"] == 64 * (4 * 4 * d + 12 * d + 4 + 8 * v + 16)
    # 8b on 4 x 80 GB: FSDP fits, DDP does not (16 bytes x 7B parameters alone is 104 GiB)
    big = get_config("8b")
    ddp = theory.predict(Plan(big, "ddp", world=4, batch=4, seq_len=2048, dtype="bf16"))
    fsdp = theory.predict(Plan(big, "fsdp", world=4, batch=4, seq_len=2048, dtype="bf16"))
    assert ddp["peak"] > 80 * 2**30 > fsdp["peak"]


def test_step1_prints_and_stores_the_prediction_beside_the_measurement(step1):
    proc, out = step1
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-2000:]
    assert "predicted (common/measure/theory.py) vs measured" in stdout
    row = json.loads((out / "summary.json").read_text())["predicted"]["per_rank"][0]
    for c in ("parameters", "gradients", "optimizer state"):
        assert row[f"measured {c}"] == row[c], c  # exact
    assert row["measured activations"] == pytest.approx(row["activations"], rel=0.01)


@pytest.mark.parametrize("strategy,world,kw", [
    ("single", 1, {}), ("ddp", 2, {}), ("fsdp", 2, {}), ("tp", 2, {}), ("2d", 4, {"tp": 2}),
    ("single", 1, {"ac": "full"}), ("single", 1, {"dtype": "bf16"}), ("single", 1, {"ac": "selective"}),
    ("single", 1, {"dtype": "bf16", "ac": "selective"}), ("single", 1, {"dtype": "bf16", "ac": "full"}),
    ("tp", 2, {"ac": "selective"}), ("cp", 2, {}),
    ("single", 1, {"dtype": "bf16", "ac": "selective-op"}), ("ddp", 2, {"loss_chunks": 3}),
    ("fsdp", 2, {"dtype": "bf16", "ac": "selective", "loss_chunks": 3, "split_root": True}),
], ids=["single", "ddp", "fsdp", "tp", "2d", "single-ac", "single-bf16", "single-sac", "single-bf16-sac",
        "single-bf16-ac", "tp-sac", "cp", "single-bf16-sac-op", "ddp-chunks", "fsdp-bf16-savers"])
def test_trace_agrees_with_the_formula(strategy, world, kw, recwarn):
    for cfg in (DEBUG, SMALL) if strategy == "single" else (DEBUG,):
        plan = Plan(cfg, strategy, world=world, batch=2 * world, seq_len=64, **kw)
        f, t = theory.predict(plan), trace(plan)
        # the tracer asks a fake tensor's storage for no address (PyTorch warns: "deprecated")
        assert not [w for w in recwarn if "data pointer of FakeTensor" in str(w.message)]
        for c in ("parameters", "optimizer state"):
            assert t[c] == pytest.approx(f[c], rel=0.01), (cfg, c)
        assert t["gradients"] == pytest.approx(f["gradients"], rel=0.01), (cfg, kw)
        band = 0.01 if strategy == "single" else 0.02
        assert t["activations"] == pytest.approx(f["activations"], rel=band), (cfg, kw)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_trace_replays_the_schedule_on_the_fullest_stage(schedule):
    """GPipe keeps every micro-batch in flight on every stage, so the last stage (it adds the
    output layer and the loss) is the fullest; 1F1B keeps p - s, so the first stage is."""
    plan = Plan(DEBUG, "pp", world=4, batch=8, seq_len=64, dtype="fp32", microbatches=4, schedule=schedule)
    t = trace(plan)
    assert t["rank"] == (3 if schedule == "gpipe" else 0)
    f = theory.predict(plan, t["rank"])
    for c in ("parameters", "gradients", "optimizer state"):
        assert t[c] == f[c], c
    assert t["activations"] == pytest.approx(f["activations"], rel=0.15)
    if schedule == "1f1b":  # stage 0 holds 4 micro-batches in flight, the last stage 1
        last = trace(plan, 3)
        assert last["activations"] < t["activations"]


def test_cli_table_and_one_strategy(capsys):
    estimate_main(["--model", "8b", "--world-size", "4", "--strategy", "all"])
    table = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    assert "| no |" in rows["ddp on 4"] and "| yes |" in rows["fsdp_zero3 on 4"]
    estimate_main(["--model", "1b", "--strategy", "single", "--gpu-mem", "80", "--ac", "full"])
    assert "fits in 76 GiB usable (80 GiB less 4 GiB headroom)" in capsys.readouterr().out


def test_grad_accum_reaches_the_formula(capsys):
    """--grad-accum K: the micro-batches' moments (FSDP's summed unsharded gradients, and the
    forward's first all-gathers beside them: the dry runs of ``missed_layouts`` hold those),
    not one batch K times as large."""
    flags = ["--model", "small", "--vocab-size", "32768", "--world-size", "4", "--strategy", "fsdp", "--seq-len", "16",
             "--batch", "8", "--device", "cpu"]
    estimate_main([*flags, "--grad-accum", "2"])
    out = capsys.readouterr().out
    want = theory.predict(Plan(get_config("small", vocab_size=32768), "fsdp_zero3", world=4, batch=8, seq_len=16,
                               accum=2, dtype="bf16"))
    assert "batch 8 x 16 tokens in 2 micro-batches" in out
    assert want["peak_at"] == theory.FORWARD_GATHER and f"peak ({theory.FORWARD_GATHER})" in out
    assert f"at peak: {theory.FORWARD_GATHER}" in out and f"{want['peak'] / 2**20:.2f}" in out
    estimate_main(flags)
    assert "micro-batches" not in capsys.readouterr().out


def test_a_3d_dry_run_is_train_3d_on_the_fullest_rank(capsys):
    """--dry-run of --strategy 2d with --pp: train_3d.py on the rank the formula finds fullest,
    its peak beside the formula's (``missed_layouts``' 3-D entries hold more ranks) and its
    collectives beside the formula's bytes, TP's per stage."""
    import re

    from tools.estimate import worst_rank
    p = Plan(get_config("small", vocab_size=32768), "2d", tp=2, pp=2, world=8, batch=16, seq_len=16,
             microbatches=4, dtype="bf16", device="cpu")
    estimate_main(["--model", "small", "--vocab-size", "32768", "--strategy", "2d", "--tp", "2", "--pp", "2",
                   "--world-size", "8", "--batch", "16", "--seq-len", "16", "--microbatches", "4", "--device", "cpu",
                   "--dry-run"])
    out = capsys.readouterr().out
    assert f"(dry run of rank {worst_rank(p)['rank']}: step3_multi_gpu/train_3d.py --fake-world-size 8" in out, out
    ratio = float(re.search(r"peak \([^)]*\) +[\d.]+ +[\d.]+ +([\d.]+)", out)[1])
    assert ratio == pytest.approx(1, abs=0.03), out
    sent = re.search(r"sent per step per rank: (.*) \(total", out)[1]
    seen = re.search(r"the dry run's collectives per step: (.*)", out)[1]
    for coll in ("all_reduce", "all_gather", "reduce_scatter", "send", "recv"):
        want = re.search(rf"(?:^|, ){coll} ([\d.]+ \w+)", sent)[1]
        assert re.search(rf"(?:^|, ){coll} {re.escape(want)}(?:,|$)", seen), (coll, sent, seen)


def test_fits_means_under_usable_memory_not_the_card_total(capsys):
    """An "80 GB" H100 reports 79.65 GiB; the CUDA context, NCCL and the allocator need some
    of it. 8b FSDP ZeRO-2 on 4 at 16 x 2048 peaks at 79.09 GiB: under the total, over what is usable."""
    peak = theory.predict(Plan(get_config("8b"), "fsdp_zero2", world=4, batch=16, seq_len=2048, dtype="bf16",
                               device="cuda"))["peak"] / 2**30
    assert 75.65 < peak < 79.65, peak
    rows = {}
    for headroom in ("4", "0"):
        estimate_main(["--model", "8b", "--world-size", "4", "--strategy", "all", "--batch", "16", "--seq-len", "2048",
                       "--headroom", headroom])
        out = capsys.readouterr().out
        rows[headroom] = next(line for line in out.splitlines() if line.startswith("| fsdp_zero2 on 4"))
    print(f"fsdp_zero2 peak {peak:.2f} GiB; usable 79.65 - 4 = 75.65 GiB")
    assert "| no |" in rows["4"] and "| yes |" in rows["0"]  # the default headroom is what says no


def test_dry_run_stands_beside_the_formula_and_the_trace(capsys):
    """--dry-run runs rank 0 of the layout for real (train_fsdp.py --fake-world-size 4, a
    subprocess): its model state equals the formula's to the byte, its activations the fake
    trace's, and it sends what the formula says. A 512-token vocabulary on synthetic ids
    checks that --vocab-size reaches the script, its data and the formulas alike (ids past
    255 would fail the embedding of a 256-row model)."""
    estimate_main(["--model", "debug", "--vocab-size", "512", "--world-size", "4", "--strategy", "fsdp",
                   "--device", "cpu", "--batch", "4", "--seq-len", "64", "--trace", "--dry-run"])
    out = capsys.readouterr().out
    print(out)
    rows = {line[:36].strip(): line[36:].split() for line in out.splitlines() if line.startswith("  ")}
    for c in ("parameters", "gradients", "optimizer state"):
        formula, tr, tr_ratio, dry, dry_ratio = rows[c]
        assert tr_ratio == dry_ratio == "1.000", (c, rows[c])
    _, tr, _, dry, _ = rows["activations"]
    assert float(dry) == pytest.approx(float(tr), rel=0.02)
    vocab = get_config("debug", vocab_size=512)
    assert float(rows["parameters"][0]) == pytest.approx(4 * count_params(vocab) / 4 / 2**20, abs=0.005)
    sent = next(line for line in out.splitlines() if "sent per step per rank:" in line)
    moved = next(line for line in out.splitlines() if "the dry run's collectives per step:" in line)
    formula = dict(kv.rsplit(" ", 2)[0:1] + [" ".join(kv.rsplit(" ", 2)[1:])] for kv in
                   sent.split(": ", 1)[1].split(" (total")[0].split(", "))
    measured = dict(kv.rsplit(" ", 2)[0:1] + [" ".join(kv.rsplit(" ", 2)[1:])] for kv in
                    moved.split(": ", 1)[1].split(", "))
    assert formula == measured and "all_gather" in measured
    # the CPU allocator's own count of the rank: at least the traced peak, and what the trace
    # did not see named by the op that allocated it (the difference, to 1% of the peak)
    line = next(line for line in out.splitlines() if "the dry run's allocator: peak" in line)
    allocated = float(re.search(r"peak ([\d.]+) MiB allocated", line).group(1))
    unseen = re.search(r"; ([\d.]+) (KiB|MiB) of it in blocks no op handed the trace \((\S+)", line)
    unseen_mib = float(unseen.group(1)) / (1024 if unseen.group(2) == "KiB" else 1) if unseen else 0.0
    dry_peak = float(next(v for k, v in rows.items() if k.startswith("peak ("))[3])  # the dry run's traced peak
    assert dry_peak <= allocated * 1.01 and allocated - unseen_mib == pytest.approx(dry_peak, rel=0.01), line


@pytest.mark.parametrize("flags,stand_in", [
    # two data-parallel groups of two context-parallel ranks, FSDP over all four: the fake
    # trace runs the ring (its sends and receives on the fake process group)
    (["--model", "debug", "--world-size", "4", "--strategy", "cp_fsdp", "--cp", "2", "--seq-len", "64",
      "--trace", "--dry-run"], False),
    # a mixture of experts cannot be fake-traced: --trace runs the dry run instead, and says so
    (["--model", "debug-moe", "--world-size", "2", "--strategy", "ep", "--seq-len", "32", "--dtype", "fp32",
      "--trace"], True),
], ids=["cp_fsdp", "ep"])
def test_cp_and_ep_dry_runs_are_the_formula(flags, stand_in, capsys, monkeypatch):
    """--dry-run of train_cp.py (--dp, --fsdp) and train_ep.py: the rank's model state and
    every collective's bytes equal the formula's exactly (EP's all-to-all at the even routing
    both assume); CP's activations are the fake trace's within 2%."""
    import tools.estimate as estimate
    ran, real = {}, estimate.dry_run

    def dry_run(p, args):  # the estimator's own dry run, kept for the exact bytes
        ran["plan"], ran["dry"] = p, real(p, args)
        return ran["dry"]

    monkeypatch.setattr(estimate, "dry_run", dry_run)
    estimate_main([*flags, "--device", "cpu", "--batch", "4"])
    out = capsys.readouterr().out
    print(out)
    plan, dry = ran["plan"], ran["dry"]
    want = theory.predict(plan)
    for c in ("parameters", "gradients", "optimizer state"):
        assert dry[c] == want[c], c
    assert dry["comm"] == want["comm"]
    assert ("the dry run stands in for the trace" in out) == stand_in
    assert ("it assumes the router spreads the tokens evenly" in out) == stand_in
    header = next(line for line in out.splitlines() if line.strip().startswith("formula")).split()
    assert header == ["formula", *([] if stand_in else ["trace", "trace/formula"]), "dry", "run", "dry",
                      "run/formula"]
    if not stand_in:
        row = next(line for line in out.splitlines() if line.startswith("  activations")).split()
        assert float(row[4]) == pytest.approx(float(row[2]), rel=0.02)  # dry run against trace, MiB


BAD = [
    (["--strategy", "zero9"], "unknown --strategy 'zero9'"),
    (["--world-size", "6", "--tp", "4"], "--world-size 6 is not divisible by --tp 4 x --pp 1"),
    (["--gpu-mem", "0"], "--gpu-mem must be a positive number of GiB (got 0)"),
    (["--gpu-mem", "24", "--headroom", "24"], "--headroom must be at least 0 and less than --gpu-mem 24 GiB"),
    (["--strategy", "pp", "--world-size", "2", "--trace", "--model", "debug", "--seq-len", "64", "--schedule",
      "interleaved1f1b"], "--trace replays the gpipe and 1f1b schedules, not interleaved1f1b"),
    (["--strategy", "2d", "--pp", "2", "--world-size", "4", "--trace", "--model", "debug", "--seq-len", "64"],
     "--trace runs pipeline parallelism alone"),
    (["--strategy", "fsdp", "--tp", "2", "--world-size", "4", "--model", "debug", "--seq-len", "64"],
     "--strategy fsdp_zero3 with --tp 2: no script runs that layout; tensor parallelism is --strategy tp"),
    (["--strategy", "ddp", "--tp", "2", "--pp", "2", "--world-size", "4"], "--strategy ddp with --tp 2 --pp 2"),
    (["--strategy", "tp", "--pp", "2", "--world-size", "4"], "--strategy tp with --pp 2: no script runs"),
    (["--strategy", "tp", "--tp", "2", "--world-size", "4"], "--strategy tp runs tp over every rank (train_tp.py)"),
    (["--strategy", "2d", "--tp", "2", "--pp", "2", "--world-size", "8", "--sequence-parallel"],
     "--sequence-parallel is TP's (train_tp.py, train_2d.py); --strategy 2d with --pp runs no sequence parallelism"),
    (["--strategy", "fsdp", "--world-size", "2", "--sequence-parallel"], "--strategy fsdp_zero3 runs no sequence"),
    (["--strategy", "pp", "--pp", "2", "--world-size", "4"], "--strategy pp runs pp over every rank (train_pp.py)"),
    (["--strategy", "fsdp", "--world-size", "4", "--batch", "8", "--grad-accum", "2", "--model", "debug",
      "--seq-len", "64", "--trace"], "--trace traces one batch in one step, not 2 micro-batches; --dry-run runs"),
    (["--strategy", "tp", "--world-size", "4", "--model", "debug", "--seq-len", "64"],
     "the model's n_kv_heads (2) is not divisible by the tensor-parallel degree 4"),
    (["--strategy", "single", "--model", "debug", "--seq-len", "64", "--dry-run"],
     "--dry-run plays one rank of a multi-rank layout"),
    (["--strategy", "all", "--world-size", "2", "--model", "debug", "--seq-len", "64", "--dry-run"],
     "--dry-run runs one layout"),
    (["--vocab-size", "1"], "--vocab-size must be between 2 and 2**31 - 1 (got 1)"),
    (["--loss-chunks", "0"], "--loss-chunks must be positive (got 0); 1 is the plain loss."),
    (["--strategy", "tp", "--world-size", "2", "--loss-chunks", "4"],
     "--loss-chunks: the tp script computes its loss on logits it holds"),
    (["--strategy", "ddp", "--world-size", "2", "--split-root-unit"], "--split-root-unit places FSDP's units"),
    (["--grad-accum", "0"], "--grad-accum must be positive (got 0); 1 is no accumulation."),
    (["--strategy", "pp", "--world-size", "2", "--grad-accum", "2"],
     "--grad-accum with --pp: a pipeline's micro-batches already are gradient accumulation"),
    (["--strategy", "fsdp", "--world-size", "4", "--batch", "4", "--grad-accum", "2", "--model", "debug"],
     "--batch 4 does not split over 4 data-parallel ranks and 2 micro-batches"),
]


@pytest.mark.parametrize("flags,expected", BAD, ids=[b[1][:20] for b in BAD])
def test_bad_input_is_one_sentence_and_exit_2(flags, expected, capsys):
    with pytest.raises(SystemExit) as e:
        estimate_main(flags)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err


def test_bad_input_exit_code_from_the_command_line():
    r = launch.run([sys.executable, "-m", "tools.estimate", "--strategy", "zero9"], cwd=ROOT,
                   capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().startswith("error: unknown --strategy")


# ---- the formula against a GPU ------------------------------------------------------------------
# Measured on one NVIDIA H200 (torch 2.11, CUDA 13, eager; figs/gpu_check_h200.json), 1b preset,
# batch 4 x 2048, one device, over the traced steps of tools/gpu_check.py's runs
#   1b_fp32      python step1_single_gpu/train.py --model 1b --global-batch-size 4 --seq-len 2048
#   1b_amp       python step2_memory/train_amp.py --amp bf16 (same model and batch)
#   1b_amp_sac   python step2_memory/train_amp_ac.py --amp bf16 --ac selective
#   1b_amp_ac    python step2_memory/train_amp_ac.py --amp bf16 --ac full
# the allocator's peak (torch.cuda.max_memory_allocated) for the first two; the memory tracer's for
# the AC runs, whose allocator peak also held an earlier run of the process (the report's note).
# The CUDA formula must stay within 3% of them:
#   python -m tools.estimate --model 1b --strategy single --batch 4 --seq-len 2048 --dtype ... --ac ...
GPU_1B = {  # (dtype, ac): GiB, what measured it
    ("fp32", "none"): (35.60, "H200 allocator"),
    ("bf16", "none"): (25.38, "H200 allocator"),
    ("bf16", "selective"): (20.25, "H200 tracer"),
    ("bf16", "full"): (18.15, "H200 tracer"),
}


@pytest.mark.parametrize("dtype,ac", list(GPU_1B), ids=[f"{d}-{a}" for d, a in GPU_1B])
def test_cuda_formula_within_3_percent_of_the_gpu(dtype, ac):
    from tools.estimate import gpu_1b_peaks
    got = gpu_1b_peaks()[dtype, ac]  # the page's table reads the report: these numbers
    assert (round(got[0], 2), got[1]) == GPU_1B[dtype, ac]
    plan = Plan(get_config("1b"), "single", batch=4, seq_len=2048, dtype=dtype, ac=ac, device="cuda")
    p = theory.predict(plan)
    measured, gpu = GPU_1B[dtype, ac]
    print(f"{dtype} AC {ac}: formula {p['peak'] / 2**30:.2f} GiB at the {p['peak_at']}, {gpu} {measured} GiB")
    assert p["peak"] == pytest.approx(measured * 2**30, rel=0.03)


def test_cuda_kernels_keep_what_the_census_on_the_h200_listed():
    """tools.saved_census --device cuda on the H200 (1b, 4 x 2048), one block's saved tensors:
    cuDNN attention keeps q, k, v, its output and the log-sum-exp, the fused RMSNorm its input
    and 1/rms, nothing else. Listed there node by node, 100,488 bytes a token in bf16 and
    196,744 in fp32 (k and v copied to the 32 query heads: CUDA's fp32 kernel has no grouped
    heads); the CUDA formula is those lists, to the byte."""
    cfg = get_config("1b")
    d, kv, f, h = cfg.dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_dim, cfg.n_heads
    bf16 = (4 * d * 2                 # both norms' fp32 inputs (the block input and the residual)
            + 4 + 4                   # their 1/rms
            + 2 * d * 2 + 2 * d       # the norms' bf16 outputs and attention's output (the mm inputs)
            + 2 * d + 2 * kv * 2      # q, k, v as attention keeps them
            + 4 * h                   # the log-sum-exp
            + 2 * f * 4)              # w1's and w3's outputs, silu's and the product
    fp32 = 4 * d * 2 + 4 + 4 + 4 * d * 3 + 4 * d * 3 + 4 * h + 4 * f * 4
    assert (bf16, fp32) == (100_488, 196_744)
    assert formulas.layer_activation_bytes(cfg, 1, "bf16", device="cuda") == bf16
    assert formulas.layer_activation_bytes(cfg, 1, "fp32", device="cuda") == fp32


def test_where_the_1b_peaks_fall_and_what_is_device_specific():
    """Full AC's peak is the optimizer step on CUDA: 16N of model state plus foreach AdamW's
    sqrt(v) for every parameter at once (4N), 20N = 18.15 GiB, what the H200's tracer showed; on a
    CPU AdamW updates one tensor at a time and the peak moves to the end of backward. In fp32
    on CUDA attention saves k and v copied to all 32 heads, 4 x the 8 kv heads' width; in both
    dtypes CUDA's fused RMSNorm keeps no normalised x (4 bytes x d, twice a block)."""
    cfg, n = get_config("1b"), count_params(get_config("1b"))
    kw = dict(batch=4, seq_len=2048, dtype="bf16", ac="full")
    cuda = theory.predict(Plan(cfg, "single", device="cuda", **kw))
    cpu = theory.predict(Plan(cfg, "single", device="cpu", **kw))
    assert cuda["peak_at"] == "optimizer step" and cpu["peak_at"] == "end of backward"
    assert cuda["optimizer temporaries"] == pytest.approx(4 * n, rel=1e-6)
    # the CPU's for-loop AdamW: sqrt(v) and its quotient, two fp32 copies of one tensor, the largest
    assert cpu["optimizer temporaries"] == 2 * 4 * max(math.prod(s) for s in param_shapes(cfg).values())
    assert cuda["peak"] == pytest.approx(20 * n, rel=1e-6)
    tokens, d, kv = 8192, cfg.dim, cfg.n_kv_heads * cfg.head_dim
    per_layer = {dev: formulas.layer_activation_bytes(cfg, tokens, "fp32", device=dev) for dev in ("cpu", "cuda")}
    assert per_layer["cuda"] - per_layer["cpu"] == tokens * (4 * 2 * (d - kv) - 8 * d)
    # bf16 keeps grouped k/v on both (the flash kernels take them as they are): only the norms differ
    bf16 = {dev: formulas.layer_activation_bytes(cfg, tokens, "bf16", device=dev) for dev in ("cpu", "cuda")}
    assert bf16["cpu"] - bf16["cuda"] == tokens * 8 * d


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
def test_saved_tensor_census_of_one_block_is_the_formula(amp):
    """tools/saved_census.py reads what autograd keeps from one block, node by node: on this CPU
    its total is theory's per-block count to the byte. (On a GPU the same command shows what
    CUDA's kernels keep; the bf16 row above is what it is for.)"""
    from tools.saved_census import census
    c = census(SMALL, 2, 128, "cpu", amp)
    assert c["total"] == formulas.layer_activation_bytes(SMALL, 256, "bf16" if amp else "fp32", device="cpu")
    d, kv, f = SMALL.dim, SMALL.n_kv_heads * SMALL.head_dim, SMALL.ffn_dim
    assert c["weight copies"] == (2 * (2 * d * d + 2 * d * kv + 3 * d * f) if amp else 0)  # the block's bf16 copies


def test_cpu_offload_puts_the_sharded_state_on_the_host():
    """FSDP's CPU offload: the rank's 16N/W of model state leaves the device for the host; the
    gathered units, their full gradients and the activations stay. The optimizer step runs on
    the host (nothing of it on the device), and at the root's reduce-scatter the other units'
    gradient shards are on the host already. A CPU run's gradient shards are views of the
    reduce-scatter's padded output, a GPU's are unpadded copies: rank 2 of 3, whose chunks of
    the 64-row matrices are short (22, 22, 20 rows), holds fewer gradient bytes than padding."""
    kw = dict(world=3, batch=6, seq_len=32)
    state = ("parameters", "gradients", "optimizer state")
    local = 4 * sum(splits.shard_numel(s, 3, 2) for s in splits.param_shapes(DEBUG).values())
    for device in ("cpu", "cuda"):
        plain = theory.predict(Plan(DEBUG, "fsdp", device=device, **kw), rank=2)
        off = theory.predict(Plan(DEBUG, "fsdp", device=device, cpu_offload=True, **kw), rank=2)
        assert all(off[c] == 0 for c in state) and off["activations"] == plain["activations"]
        assert off["transient"] == plain["transient"]  # the gathered units and their gradients
        assert off["host"] == {c: plain[c] for c in state} | ({"gradients": local} if device == "cuda" else {})
        root = theory.ROOT_REDUCE
        assert off[root] == plain[root] | {"other units' gradient shards": 0}
        assert off["optimizer temporaries"] == 0 and off["peak_at"] != "optimizer step"
    assert local < plain["gradients"]
    # on the CPU the peak is the start of backward (no gradient of the last step, the first block's
    # unsharded gradients, which the end of forward has not made yet): less the parameters and AdamW state
    plain, off = (theory.predict(Plan(DEBUG, "fsdp", cpu_offload=o, **kw), rank=2) for o in (False, True))
    assert plain["peak_at"] == off["peak_at"] == "start of backward"
    assert plain["transient"][theory.UNSHARDED_GRADS] > 0
    assert off["peak"] == plain["peak"] - plain["parameters"] - plain["optimizer state"]
    with pytest.raises(ValueError, match="FSDP's"):
        Plan(DEBUG, "ddp", world=2, cpu_offload=True)


def test_report_holds_an_offloaded_run_to_the_device_and_the_host():
    """theory.report under --cpu-offload, on a trace's result as common/measure/memory_result.py
    writes it: the device's model state is the trace's less the host's share, the host's is
    held beside it, and the peak is the allocator's on a GPU (the device's own: the host's
    state was never in it) but the trace less the host's share on a CPU (whose allocator
    counts both)."""
    from types import SimpleNamespace

    import torch
    args = SimpleNamespace(model_config=DEBUG, global_batch_size=4, seq_len=32)
    host = formulas.model_state("fsdp", DEBUG, 2, 0)
    device = {"parameters": 0, "gradients": 0, "optimizer state": 0, "activations": 5_000, "other": 700}
    for kind, in_trace, want in (("cuda", False, 9_100), ("cpu", True, 8_000)):
        both = {c: device[c] + host.get(c, 0) for c in device} if in_trace else device
        memory = [{"rank": 0, "before_optimizer": both, "peak_by_category": both, "peak_bytes": 9_000,
                   "allocator_peak_bytes": 9_100,
                   "offloaded": {"host_in_trace": in_trace, "host_before_optimizer": host,
                                 "device_before_optimizer": device, "device_peak_by_category": device,
                                 "device_peak_bytes": 8_000}}]
        ctx = SimpleNamespace(is_main=True, device=torch.device(kind), world_size=2)
        lines = []
        row = theory.report(args, ctx, memory, "fsdp_zero3", lines=lines, cpu_offload=True)["per_rank"][0]
        assert row["measured peak"] == want, kind
        assert row["host"] == row["measured host"] == host
        assert all(row[c] == row[f"measured {c}"] == 0 for c in host)
        assert "on the host parameters" in lines[1] and "device peak" in lines[1]


# run again with the CPU's own one-tensor-at-a-time AdamW (the suite takes CUDA's foreach path):
# where its temporaries of the largest tensor make the peak
FOR_LOOP = ("pp_last", "zbv_ac", "ddp_rebuild", "zbv_ac_turn")


@pytest.fixture(scope="module")
def missed(tmp_path_factory):
    """Dry runs of the real scripts, one process (tests.tolerances.dry_runs), for ``missed_layouts``;
    FOR_LOOP's again under the CPU's AdamW loop, named NAME@for-loop."""
    from conftest import hang_limit
    from tests.tolerances import dry_runs
    runs = [{"name": name, "script": script, "argv": argv}
            for name in missed_layouts() for script, argv in [dry_run_argv(name)]]
    out = tmp_path_factory.mktemp("missed")
    got = dry_runs(runs, out, hang_limit(360))
    again = [{**r, "name": f"{r['name']}@for-loop"} for r in runs if r["name"] in FOR_LOOP]
    return got | dry_runs(again, out, hang_limit(120), env={"TUTORIAL_CUDA_PATHS": "0"})


def _predicted(missed, name: str) -> dict:
    """The formula for dry run ``name``, with the AdamW kernels it ran (the suite takes CUDA's
    foreach path on a CPU: tests/conftest.py)."""
    from dataclasses import replace
    plan, rank = missed_layouts()[name.split("@")[0]]
    return theory.predict(replace(plan, optimizer=missed[name]["optimizer_kernels"]), rank)


@pytest.mark.parametrize("name", [n for n in missed_layouts() if n != "2d_ac"] + [f"{n}@for-loop" for n in FOR_LOOP])
def test_the_layouts_the_formula_once_missed_peak_where_it_says(missed, name):
    """The formula's peak against a dry run of the layout's real script, within 3%. Loss
    parallelism's backward runs ops inside DTensor's handler that the trace does not see: the
    CPU allocator's peak counts them."""
    f, (mem,) = _predicted(missed, name), missed[name]["memory"]
    measured = mem["allocator_peak_bytes"] if name.endswith("loss_parallel") else mem["peak_bytes"]
    assert measured == pytest.approx(f["peak"], rel=0.03), (name, measured / f["peak"], f["peak_at"])
    if name.endswith("@for-loop"):
        assert missed[name]["optimizer_kernels"] == "for-loop" and f["optimizer temporaries"] > 0
    if name in ("fsdp_accum_bf16", "fsdp_accum_fp32", "3d", "ep_accum", "2d_accum_embedding"):
        assert theory.ACCUM_GRADS in f["transient"], name
    if name == "2d_root_reduce":  # the reduce-scatter's moment, not the copy-in's
        assert f["peak_at"] == "end of backward" and any("still referenced" in k for k in f[theory.ROOT_REDUCE])
    if name in ("3d_tp_embedding", "3d_tp_head"):  # TP's collectives on a stage: its own ends' only, and the
        # last stage's whole logits gathered (no loss parallelism)
        (sent,) = missed[name]["comm"]
        for coll in ("all_reduce", "all_gather"):
            assert sent[coll]["bytes"] == f["comm"][coll], (name, coll)
    if name in ("fsdp_accum_root_gather", "split_root_loss", "split_root_accum"):  # the moments named above
        assert f["peak_at"] == {"fsdp_accum_root_gather": theory.FORWARD_GATHER, "split_root_loss":
                                theory.SPLIT_LOSS_FORWARD, "split_root_accum": theory.SPLIT_HEAD_REDUCE}[name]
    if name == "tp_byte_vocab":  # after the loss's backward, in the final norm's
        assert f["peak_at"] == theory.NORM_BACKWARD
    if "rebuild" in name:  # the second step's start, before any activation
        assert f["peak_at"] == theory.DDP_REBUILD and mem["peak_by_category"]["gradients"] == 2 * f["gradients"]


def test_3d_gathers_its_stage_once_a_step(missed):
    """train_3d.py keeps its stage gathered all step (ZeRO-2): one all-gather, not one a micro-batch."""
    plan, rank = missed_layouts()["3d"]
    (sent,) = missed["3d"]["comm"]
    assert sent["all_gather"]["bytes"] == theory.predict(plan, rank)["comm"]["all_gather"]


def test_hsdp_zero2_and_2d_ac_are_counted_as_they_run(missed):
    """HSDP with --no-reshard-after-forward keeps every unit gathered from its forward to its
    backward, as FSDP ZeRO-2 does, and is predicted so. 2-D with full AC keeps each block's
    bf16 input (FSDP's policy): the activations within 5%."""
    plan, _ = missed_layouts()["hsdp_zero2"]
    assert _predicted(missed, "hsdp_zero2")["transient"]["gathered parameters (FSDP)"] == 2 * count_params(plan.cfg)
    f, (mem,) = _predicted(missed, "2d_ac"), missed["2d_ac"]["memory"]
    assert mem["peak_by_category"]["activations"] == pytest.approx(f["activations"], rel=0.05)
    assert mem["peak_bytes"] == pytest.approx(f["peak"], rel=0.05)
