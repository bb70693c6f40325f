"""The numbers the pages quote cannot go stale, and what a newcomer reads first is true.

A number the prose takes from a block, a report in figs/ or train.slurm is written between
<!-- v:NAME --> and <!-- /v -->; tools/docs.py's VALUES renders it from that source, and the
figures command (tools/figures.py: update_readme) renders them all after writing its blocks.
These tests hold every such value to its source, refuse a name the registry lacks, and check
that rewriting the blocks as they are changes no page while a changed block carries its number
into the prose. Then the smaller promises: the Slurm script's flags as the preemption section
quotes them, what the estimator and the planner say they assumed, the memory trace's message
after a resume, and the CPU threads in a run's end table.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from tools import docs
from tools.docs import VALUE, VALUES, block, doc_paths, fill, stale

from common import ROOT


def test_every_value_in_the_pages_is_its_sources():
    assert sum(len(VALUE.findall(p.read_text())) for p in doc_paths()) >= 60, "the walk found the pages' values"
    bad = stale()
    assert not bad, "stale numbers (python -m tools.docs rewrites them from their sources):\n" + "\n".join(bad)


def test_every_value_name_is_known_and_used():
    used = {name for p in doc_paths() for name, _ in VALUE.findall(p.read_text())}
    assert used <= set(VALUES), f"markers naming no value of tools/docs.py: {sorted(used - set(VALUES))}"
    assert set(VALUES) <= used, f"values no page quotes: {sorted(set(VALUES) - used)}"
    with pytest.raises(KeyError, match="names no value"):
        fill("a <!-- v:no-such-value -->1 GiB<!-- /v --> peak")
    # markers come in pairs: an opening without its close would swallow the prose up to the next one
    for p in doc_paths():
        text = p.read_text()
        assert text.count("<!-- v:") == text.count("<!-- /v -->") == len(VALUE.findall(text)), p.name
        spans = re.findall(r"`[^`\n]*`", re.sub(r"```.*?```", "", text, flags=re.S))
        assert not [c for c in spans if "<!-- v:" in c], f"{p.name}: a value inside a code span shows its markers"


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """A copy of the pages and the sources their values read, for the figures command to rewrite."""
    for rel in [*docs.DOCS, "figs/gpu_check_h200.json", "step4_multi_node/train.slurm", "tests/tolerances.py"]:
        if (ROOT / rel).exists():
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / rel, tmp_path / rel)
    import tools.figures
    monkeypatch.setattr(docs, "ROOT", tmp_path)
    monkeypatch.setattr(tools.figures, "ROOT", tmp_path)
    return tmp_path


def test_a_tolerance_the_tests_change_changes_the_pages(tree):
    """The tolerances the pages quote are the tests' own (tests/tolerances.py): a test made
    looser or stricter carries its number into every sentence that quotes it."""
    source = tree / "tests" / "tolerances.py"
    source.write_text(source.read_text().replace("PARITY_RTOL = 1e-5", "PARITY_RTOL = 2e-5"))
    assert any("test.parity-rtol reads '1e-5', its source says '2e-5'" in s for s in docs.stale()), docs.stale()
    docs.fill_pages()
    text = (tree / "step3_multi_gpu" / "model_parallel.md").read_text()
    assert "<!-- v:test.parity-rtol -->2e-5<!-- /v -->" in text and "<!-- v:test.parity-rtol -->1e-5" not in text


def test_regenerating_an_unchanged_tree_changes_no_page(tree):
    from tools.figures import update_readme
    pages = {p: p.read_text() for p in docs.doc_paths()}
    names = {m for text in pages.values() for m in re.findall(r"<!-- BEGIN ([\w-]+) -->", text)}
    update_readme({name: block(name)[1] for name in names})  # every block as it is
    assert {p: p.read_text() for p in pages} == pages


def test_a_regenerated_block_carries_its_number_into_the_prose(tree):
    from tools.figures import update_readme
    page = tree / "step3_multi_gpu" / "will_it_fit.md"
    old = VALUES["est-8b.zero3-peak"]()
    body = block("est-8b")[1]
    row = next(line for line in body.splitlines() if line.startswith("| fsdp_zero3 on 4 |"))
    cells = row.split("|")
    cells[7] = " 12.34 "  # the peak column
    update_readme({"est-8b": body.replace(row, "|".join(cells))})
    text = page.read_text()
    assert "<!-- v:est-8b.zero3-peak -->12.34 GiB<!-- /v -->" in text and f"-->{old}<!-- /v --> peak" not in text
    assert "<!-- v:est-8b.zero3-spare -->63 GiB<!-- /v -->" in text  # 75.65 usable less the new peak


def test_the_preemption_section_quotes_train_slurm():
    """Every #SBATCH line and torchrun timeout step 4's page shows is the script's; the window a
    preemption leaves the ranks is said as Slurm and torchrun give it."""
    slurm = (ROOT / "step4_multi_node" / "train.slurm").read_text()
    page = (ROOT / "step4_multi_node" / "README.md").read_text()
    quoted = re.findall(r"`(#SBATCH [^`]+)`", page)
    assert quoted and all(q in slurm for q in quoted), quoted
    assert VALUES["slurm.shutdown-timeout"]() in re.search(r"--shutdown-timeout (\d+)", slurm).group(0)
    assert f"--signal=B:USR1@{VALUES['slurm.warning']()}" in slurm
    text = " ".join(page.split())
    assert "SIGTERM at once" in text and "GraceTime + min(KillWait, torchrun's shutdown timeout)" in text \
        and "a timer that Slurm's second SIGTERM starts again" in text, "the preemption window"
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "`torchrun --help`" in readme and "below 2.13" not in readme.lower()


def test_the_estimator_and_the_planner_say_what_they_assumed(capsys):
    from tools.estimate import main as estimate
    from tools.plan import main as plan
    estimate(["--model", "debug", "--strategy", "single"])
    first = capsys.readouterr().out.splitlines()[0]
    assert "batch 1 x 256 tokens" in first and "an 80 GB H100 (79.65 GiB)" in first, first
    estimate(["--model", "debug", "--world-size", "2", "--strategy", "all", "--gpu-mem", "24"])
    first = capsys.readouterr().out.splitlines()[0]
    assert "global batch 2 x 256 tokens" in first and "a 24 GiB GPU" in first, first
    plan(["--model", "debug", "--gpus", "2", "--top", "1"])
    first = capsys.readouterr().out.splitlines()[0]
    assert "global batch 2 x 256 tokens" in first and "on 2 x H100 SXM 80GB" in first, first


def test_a_trace_window_before_the_resume_is_said_so(tmp_path):
    import torch

    from common.measure.memory import MemoryTracer
    said = []
    ctx = SimpleNamespace(print=said.append, is_main=True, rank=0, has_peers=False, world_size=1)
    model = torch.nn.Linear(4, 4)
    for first, steps, expect in ((5, 2, "this run resumed at step 5: steps 1-2 (--trace-start, --trace-steps) ran before"),
                                 (0, 2, "the run never reached step 9"),
                                 # resumed after its last step's checkpoint (common/run.py sets first_step): no step ran
                                 (6, 0, "this run resumed at step 6, past its last step (--steps): it trained no step")):
        tracer = MemoryTracer(model, [], "cpu", start=1 if first else 9, steps=2, count_allocator=False)
        tracer.first_step = first
        for step in range(first, first + steps):
            with tracer.record(step):
                pass
        assert tracer.save(tmp_path, ctx, "t") is None
        assert expect in said[-1], said[-1]
        tracer.close()


def test_the_end_table_names_the_cpu_threads(capsys, tmp_path):
    import torch

    from common.measure.metrics import Metrics
    s = {"model": "debug", "n_params": 1e5, "device_name": "CPU", "world_size": 1, "backend": "gloo",
         "dtype": "fp32", "first_loss": 5.5, "final_loss": 5.0, "val_loss": None, "tokens_per_s": 1e3,
         "step_time_s": 0.1, "mfu": None, "peak_flops_source": "", "memory": []}
    Metrics._print_table(SimpleNamespace(args=SimpleNamespace(out=tmp_path)), s)
    line = next(x for x in capsys.readouterr().out.splitlines() if "CPU threads" in x)
    assert f"{torch.get_num_threads()} a process" in line and "OMP_NUM_THREADS" in line


def test_the_readme_says_how_to_run_the_tests():
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "pytest-xdist" in (ROOT / "requirements.txt").read_text() and "pip install pytest-xdist" in readme
    # CI runs exactly the README's command for the whole suite, in a fresh venv made as the README says
    ci = (ROOT / ".ci" / "run").read_text()
    (command,) = re.findall(r"^python -m pytest.*$", ci, re.M)
    assert f"{command} # the whole suite, on every core (what CI runs)" in readme, command
    assert "python -m venv .venv" in ci and "pip install --quiet --disable-pip-version-check -r requirements.txt" in ci
    quick = re.search(r"python -m pytest (tests/test_\w+\.py(?: tests/test_\w+\.py)+)", readme)
    assert quick and all((ROOT / f).exists() for f in quick.group(1).split())


def test_the_readme_lists_every_test_files_time():
    """The suite's time: each file's, from a full run (tools/test_times.py), every test file in it."""
    from tools.docs import block
    rows = re.findall(r"^\| (tests/test_\w+\.py) \|", block("test-times")[1], re.M)
    assert sorted(rows) == sorted(f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py")), \
        "stale: run the whole suite, then python -m tools.test_times"


def test_the_readme_says_what_every_test_file_proves():
    """The table under "What the suite proves" has one row for each test file, no more."""
    readme = (ROOT / "README.md").read_text()
    table = readme.split("What the suite proves", 1)[1].split("\n\n|", 1)[1].split("\n\n", 1)[0]
    rows = re.findall(r"^\| (tests/test_\w+\.py) \| \D", "|" + table, re.M)
    assert sorted(rows) == sorted(f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py"))


def test_the_test_times_table_is_the_runs_and_refuses_a_failed_or_missing_one(tmp_path, capsys, monkeypatch):
    """tools/test_times.py: each file's seconds and share of a full run, slowest first; a run
    that failed, or none, is refused in one sentence."""
    import json

    from tools import test_times
    times = {"wall_s": 100.0, "exit_status": 0, "workers": 1, "cpu": "CPU (x), 2 cores",
             "files": {"tests/test_a.py": 25.0, "tests/test_b.py": 75.0}}
    text = test_times.table(times)
    assert text.splitlines()[-2:] == ["| tests/test_b.py | 75.0 | 75% |", "| tests/test_a.py | 25.0 | 25% |"]
    assert "100 s of wall time on CPU (x), 2 cores, one process" in text
    # the run names the commit (and day) it measured, where it knows them
    assert test_times.table(times | {"commit": "abc1234", "date": "2026-11-29"}).startswith(
        "The last full run (commit abc1234, 2026-11-29): 100 s")
    assert text.startswith("The last full run: 100 s")
    path = tmp_path / "t.json"
    path.write_text(json.dumps(times | {"exit_status": 1}))
    assert test_times.main(["--times", str(path)]) == 2
    assert test_times.main(["--times", str(tmp_path / "none.json")]) == 2
    # a run whose one failure is the table's own check (a new file without a row) is the suite's
    path.write_text(json.dumps(times | {"exit_status": 1, "failed": [test_times.STALE_TABLE, "tests/test_a.py::x"]}))
    assert test_times.main(["--times", str(path)]) == 2
    err = capsys.readouterr().err
    assert "failed (exit status 1)" in err and "run the whole suite first" in err
    written = {}
    monkeypatch.setattr("tools.figures.update_readme", written.update)
    path.write_text(json.dumps(times | {"exit_status": 1, "failed": [test_times.STALE_TABLE]}))
    assert test_times.main(["--times", str(path)]) == 0 and written == {"test-times": text}

