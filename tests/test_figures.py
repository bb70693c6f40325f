"""The figures command (tools/figures.py): every run it makes is a command the scripts
accept, runs that share a job share one launch and do not disturb each other, a failing
job stops it with the way to its log, and every file in figs/ says which machine made it.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import step3_multi_gpu.figures as step3  # will_it_fit.md's estimator blocks are made there
from tools import figures
from tools.docs import block, untimed
from tools.figures import ROOT, Run, jobs, provenance_table, record_provenance, run_dir
from test_readme import parse_only

TINY = ["--model", "debug", "--steps", "2", "--seq-len", "32", "--global-batch-size", "4", "--eval-batches", "0",
        "--no-trace-memory"]
SUFFIX = "_pytest"


def test_every_run_is_a_valid_command(capsys):
    names = [r.name for r in figures.RUNS]
    assert len(names) == len(set(names)), "two runs write into the same folder"
    bad = []
    for run in figures.RUNS:
        assert (ROOT / run.script).exists(), f"{run.name}: {run.script} does not exist"
        script, flags = run.script, figures.argv(run, "", "cpu")
        if script == "tools/pipeline_bubble.py":  # its own two flags; the rest go to train_pp.py
            i = flags.index("--schedules")
            script, flags = "step3_multi_gpu/train_pp.py", flags[:i] + flags[i + 4:]
        if code := parse_only(script, flags):
            bad.append(f"{run.name}: exit {code}: {capsys.readouterr().err.strip()[-200:]}")
    assert not bad, "runs whose flags the script rejects:\n" + "\n".join(bad)


def test_jobs_group_runs_and_refuse_a_mixed_one():
    grouped = jobs(figures.RUNS)
    assert sum(map(len, grouped)) == len(figures.RUNS)
    for job in grouped:
        assert len({r.job for r in job}) == 1 and len({r.nproc for r in job}) == 1
    # DTensor meshes of different runs must not share a job with FSDP's HSDP mesh (tools/multirun.py)
    hsdp_job = next(j for j in grouped if any("--hsdp" in r.flags for r in j))
    assert not any(Path(r.script).stem in ("train_tp", "train_2d", "train_3d") for r in hsdp_job)
    with pytest.raises(ValueError, match="give it a job of its own"):
        jobs([Run("a", "x.py", [], nproc=1, job="j"), Run("b", "x.py", [], nproc=2, job="j")])


def test_only_that_matches_nothing_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        figures.main(["--only", "99"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no figure or run name starts with '99'") and len(err.splitlines()) == 1


def test_cuda_figures_without_a_gpu_are_refused(capsys, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # no GPU, whatever this machine has
    with pytest.raises(SystemExit) as e:
        figures.main(["--device", "cuda", "--only", "01"])
    assert e.value.code == 2 and capsys.readouterr().err.startswith("error: --device cuda: this machine has no")


def test_a_gpu_machine_makes_the_runs_it_has_gpus_for(capsys):
    kept = figures.fit_on_gpus(figures.RUNS, 1)
    assert kept and all(r.nproc == 1 for r in kept) and len(kept) < len(figures.RUNS)
    assert "leaving out" in capsys.readouterr().out
    assert figures.fit_on_gpus(figures.RUNS, 4) == figures.RUNS


def test_run_dir_puts_the_suffix_on_the_top_folder():
    assert run_dir("baseline", "_cuda") == ROOT / "runs" / "figs" / "baseline_cuda"
    assert run_dir("03_strategies/tp", "_cuda") == ROOT / "runs" / "figs" / "03_strategies_cuda" / "tp"


class Bar:
    def __init__(self):
        self.n, self.postfix = 0, []

    def update(self, k):
        self.n += k

    def set_postfix_str(self, s):
        self.postfix.append(s)

    def close(self):
        pass


@pytest.fixture
def cleanup():
    made = []
    yield made
    for name in made:
        shutil.rmtree(run_dir(name, SUFFIX).parent if "/" in name else run_dir(name, SUFFIX), ignore_errors=True)
    for log in (ROOT / "runs" / "figs").glob(f"*{SUFFIX}.log"):
        log.unlink()


def test_one_launch_runs_several_strategies_and_they_agree(cleanup):
    """A one-process job and a 2-rank torchrun job, two runs each: every run writes its
    own folder, and DDP and FSDP run back to back in one job match step 1's losses."""
    one = [Run("pytest_single", "step1_single_gpu/train.py", TINY, job="pytest_one"),
           Run("pytest_single_again", "step1_single_gpu/train.py", TINY, job="pytest_one")]
    fp32 = TINY + ["--amp", "off"]  # step 3's default is bf16; step 1's losses are fp32
    two = [Run("pytest_dp/ddp", "step3_multi_gpu/train_ddp.py", fp32, nproc=2, job="pytest_two"),
           Run("pytest_dp/fsdp", "step3_multi_gpu/train_fsdp.py", fp32, nproc=2, job="pytest_two")]
    cleanup += [r.name for r in one + two]
    bar = Bar()
    for job in jobs(one + two):
        figures.launch(job, SUFFIX, "cpu", bar)
    assert bar.n == 4 and bar.postfix == [r.name for r in one + two]
    losses = {}
    for r in one + two:
        rows = [json.loads(line) for line in (run_dir(r.name, SUFFIX) / "metrics.jsonl").read_text().splitlines()]
        losses[r.name] = [row["loss"] for row in rows if "loss" in row]
        assert len(losses[r.name]) == 2, r.name
    ref = losses["pytest_single"]
    for name, got in losses.items():
        assert got == pytest.approx(ref, rel=1e-5), name
    log = (ROOT / "runs" / "figs" / f"pytest_two{SUFFIX}.log").read_text()
    assert "$ torchrun --standalone --nproc-per-node 2 step3_multi_gpu/train_fsdp.py" in log


def test_a_failing_job_stops_with_its_log(cleanup):
    job = [Run("pytest_ok", "step1_single_gpu/train.py", TINY, job="pytest_bad"),
           Run("pytest_bad", "step1_single_gpu/train.py", TINY + ["--seq-len", "0"], job="pytest_bad"),
           Run("pytest_never", "step1_single_gpu/train.py", TINY, job="pytest_bad")]
    cleanup += [r.name for r in job]
    bar = Bar()
    with pytest.raises(SystemExit) as e:
        figures.launch(job, SUFFIX, "cpu", bar)
    assert bar.n == 1 and "pytest_never" not in bar.postfix
    msg = str(e.value.code)
    assert msg.startswith("error: the job pytest_bad failed") and f"runs/figs/pytest_bad{SUFFIX}.log" in msg
    assert "error: --seq-len" in (ROOT / "runs" / "figs" / f"pytest_bad{SUFFIX}.log").read_text()


def test_provenance_is_kept_per_file(tmp_path):
    figs = tmp_path / "figs"
    figs.mkdir()
    for name in ("01_a.png", "02_b.png", "02_c.md"):
        (figs / name).write_text("x")
    made = record_provenance([figs / "01_a.png", figs / "02_b.png", figs / "02_c.md"], "cpu", [],
                             path=figs / "made_on.json")
    assert set(made) == {"01_a.png", "02_b.png", "02_c.md"} and made["01_a.png"]["device"].startswith("CPU (")
    # a later --only 02 on another machine replaces 02's entries and keeps 01's
    (figs / "02_c.md").unlink()
    made["01_a.png"]["device"] = "an older machine"
    (figs / "made_on.json").write_text(json.dumps(made))
    made = record_provenance([figs / "02_b.png"], "cpu", ["--only", "02"], path=figs / "made_on.json")
    assert set(made) == {"01_a.png", "02_b.png"}  # 02_c.md is gone from figs/, so from the record
    assert made["01_a.png"]["device"] == "an older machine"
    assert made["02_b.png"]["command"] == "python -m tools.figures --only 02"
    rows = provenance_table(made).splitlines()[2:]
    assert len(rows) == 2 and rows[0].startswith("| `01_*` (1 file) | an older machine |")


def test_every_figure_says_which_machine_made_it():
    made = json.loads((ROOT / "figs" / "made_on.json").read_text())
    files = {p.name for p in (ROOT / "figs").iterdir() if p.name != "made_on.json"}
    assert files == set(made), (f"figs/ files without a record: {sorted(files - set(made))}; records of missing "
                                f"files: {sorted(set(made) - files)} (run python -m tools.figures)")
    assert block("figs-made-on")[1].strip() == provenance_table(made), "README's figs-made-on table is stale"


def test_estimator_blocks_follow_their_commands():
    """Each README block the figures command fills with the estimator's output comes right
    after a bash block holding exactly the commands that make it."""
    import shlex
    dry = {marker: ([argv], True) for marker, argv in step3.DRY_ESTIMATES.items()}
    for marker, (commands, _) in {**step3.ESTIMATES, **dry}.items():
        page = block(marker)[0].read_text()
        head = page.split(f"<!-- BEGIN {marker} -->", 1)[0]
        shown = head.rstrip().removesuffix("```").rsplit("```bash\n", 1)[1]
        assert [shlex.split(line)[3:] for line in shown.strip().splitlines()] == commands, marker
        assert all(line.startswith("python -m tools.estimate ") for line in shown.strip().splitlines())


@pytest.mark.parametrize("marker", sorted(step3.DRY_ESTIMATES))
def test_the_dry_run_blocks_hold_answers_that_agree(marker, capsys):
    """The dry-run blocks (minutes to make: python -m tools.figures --only dry_estimate, --only
    dry8b) show the formula, the trace (1b) and the dry run, equal on parameters, gradients
    and AdamW state, and within 1% on activations and the peak (1b at a 128K vocabulary: the
    peak is FSDP's last reduce-scatter, of the root unit, theory._root_reduce). Their formula
    column is what the formula says today (the trace and the dry run take minutes to redo;
    the formula does not)."""
    import re

    from tools.estimate import main as estimate
    text = block(marker)[1]
    cells = lambda line: re.split(r"\s{2,}", line.strip())  # noqa: E731  name, formula, [trace, ratio,] dry, ratio

    def row(t, name):
        return next(line for line in t.splitlines() if line.strip().startswith(name))
    for c in ("parameters", "gradients", "optimizer state"):
        assert cells(row(text, c))[3::2] == ["1.000"] * (2 if "--trace" in step3.DRY_ESTIMATES[marker] else 1), c
    for c in ("activations", "peak ("):
        assert all(abs(float(r) - 1) <= 0.01 for r in cells(row(text, c))[3::2]), row(text, c)
    assert "the dry run's collectives per step" in text
    estimate([a for a in step3.DRY_ESTIMATES[marker] if a not in ("--trace", "--dry-run")])
    formula = capsys.readouterr().out
    names = [cells(line)[0] for line in formula.splitlines()[2:] if not line.strip().startswith(("fits", "sent"))]
    assert len(names) >= 7 and ("at peak: root's fp32 reduce-scatter copy" in names) == (marker.endswith("1b")), names
    for name in names:  # the block's formula column: the first number after the row's name
        assert cells(row(text, name))[1] == cells(row(formula, name))[1], name


def test_estimator_blocks_are_current():
    """The estimator is deterministic (but for its timing line): the README's copies of its
    answers must be what it answers now."""
    for marker, text in step3.estimates().items():
        assert untimed(block(marker)[1]) == untimed(text), f"the {marker} block is stale: run python -m tools.figures"


def test_a_block_whose_own_time_alone_moved_is_not_rewritten(tmp_path, monkeypatch):
    """Regenerating on an unchanged tree changes no page: a tool's block that differs only in
    the time its command took keeps the page's copy; any other change is written."""
    import tools.docs as docs
    page = tmp_path / "README.md"
    page.write_text("x\n<!-- BEGIN est-x -->\n(traced rank 0 in 2.4 s)\npeak 1.00\n<!-- END est-x -->\ny\n")
    monkeypatch.setattr(docs, "ROOT", tmp_path)
    monkeypatch.setattr(docs, "DOCS", ["README.md"])
    monkeypatch.setattr(docs, "fill_pages", lambda: [])
    figures.update_readme({"est-x": "(traced rank 0 in 9.9 s)\npeak 1.00"})
    assert "in 2.4 s)" in page.read_text()
    figures.update_readme({"est-x": "(traced rank 0 in 9.9 s)\npeak 1.01"})
    assert page.read_text() == "x\n<!-- BEGIN est-x -->\n(traced rank 0 in 9.9 s)\npeak 1.01\n<!-- END est-x -->\ny\n"


def test_gpu_report_block_is_current(tmp_path, monkeypatch):
    """The README's GPU section is what tools/gpu_check.py left in figs/ (or says there is
    none), and a report in figs/ reaches the README through the figures command."""
    assert block("gpu-check")[1].strip() == figures.gpu_check_report()["gpu-check"].strip(), \
        "stale: run python -m tools.figures"
    figs = tmp_path / "figs"
    figs.mkdir()
    (figs / "gpu_check_h100.md").write_text("Made by `python -m tools.gpu_check` on 1 x NVIDIA H100\n")
    (figs / "gpu_check_cpu.md").write_text("a toy run: not for the README\n")
    monkeypatch.setattr(figures, "ROOT", tmp_path)
    assert figures.gpu_check_report()["gpu-check"] == "Made by `python -m tools.gpu_check` on 1 x NVIDIA H100"


def test_the_vocabulary_table_holds_the_logits_and_what_chunks_take_off():
    """README's table-02-vocab (python -m tools.figures --only 02_vocab): its logits are
    tokens x vocabulary x 4 bytes from its own flags, and the loss in 8 chunks takes at least
    that much off the plain loss's peak, everything else at the peak unchanged but the loss's
    activations and temporaries."""
    import re

    from step2_memory.figures import _VOCAB

    def parse_bytes(cell: str) -> float:  # "1.2 GiB" -> bytes
        number, unit = cell.split()
        return float(number) * 2 ** (10 * ["B", "KiB", "MiB", "GiB"].index(unit))
    text = block("table-02-vocab")[1]
    flags = dict(zip(_VOCAB[::2], _VOCAB[1::2]))
    tokens, vocab = int(flags["--global-batch-size"]) * int(flags["--seq-len"]), int(flags["--vocab-size"])
    said = re.search(r"logits of one step: ([\d,]+) tokens x ([\d,]+) x 4 bytes = ([\d.]+ \w+)", text)
    assert said and (int(said[1].replace(",", "")), int(said[2].replace(",", ""))) == (tokens, vocab)
    assert parse_bytes(said[3]) == pytest.approx(4 * tokens * vocab, rel=1e-3)
    rows = {r.split("|")[1].strip(): [c.strip().strip("*") for c in r.split("|")[3:-1]]
            for r in text.splitlines() if r.startswith("| ") and "`python" in r}
    plain, chunks = rows["plain loss"], rows["--loss-chunks 8"]
    assert plain[:3] == chunks[:3]  # parameters, gradients, optimizer state
    assert parse_bytes(plain[-1]) - parse_bytes(chunks[-1]) >= 4 * tokens * vocab


def test_the_doc_mask_block_is_of_the_runs_its_flags_make():
    """README's doc-mask block (python -m tools.figures --only 02_doc_mask) names the flags
    the figures command gives its runs now, and has the two rows, plain and masked, whose
    tokens/s are the step time's (global batch x seq len / step)."""
    import re

    from step2_memory.figures import _DOC_MASK
    text = block("doc-mask")[1]
    assert f"`{' '.join(_DOC_MASK)}`" in text, "stale: run python -m tools.figures --only 02_doc_mask"
    flags = dict(zip(_DOC_MASK[::2], _DOC_MASK[1::2]))
    tokens = int(flags["--global-batch-size"]) * int(flags["--seq-len"])
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]] for r in text.splitlines()
            if r.startswith("| ") and not r.startswith("| attention")}
    assert list(rows) == ["causal (default)", "--doc-mask"]
    for name, (last, held_out, step, per_s) in rows.items():
        assert 0 < float(last) < 6 and 0 < float(held_out) < 6, name  # (an untrained byte model starts at ln 256 = 5.5)
        ms, tok_s = float(step.split()[0].replace(",", "")), float(per_s.replace(",", ""))
        assert tok_s == pytest.approx(tokens / (ms / 1e3), rel=0.01), name
    share = re.search(r"(\d+)% of the windows trained on hold an end-of-text token before their last position", text)
    assert share and 0 < int(share[1]) < 100
