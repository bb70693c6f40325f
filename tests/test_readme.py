"""The README's commands keep working: the docs cannot rot.

Every ``python ...`` / ``torchrun ...`` line in the ```bash blocks of every page (README.md and
the chapters' pages, tools/docs.py) is checked
cheaply: the script exists and argparse accepts its flags (the script's own parser, run
in this process and stopped right after parsing, so no training and no new process per
command). A few representative commands then run end to end, with tiny sizes appended
(argparse keeps the last value of a flag), in parallel processes.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tools.docs import all_text

from common import ROOT  # noqa: E402
from conftest import hang_limit  # noqa: E402
TINY = ["--model", "debug", "--steps", "2", "--seq-len", "32", "--global-batch-size", "4",
        "--no-trace-memory", "--eval-batches", "0"]

# Commands whose flags are not checked, and why.
NOT_CHECKED = {
    "python -m pytest": "the test suite itself",
    "python -c": "an inline snippet, not a script",
    "python -m venv": "Python's own virtual environments (the Quick start's first line)",
}
# Commands that run end to end (matched on the start of the README line). The rest are
# only flag-checked: they need GPUs (dp_vs_ddp.py, --amp fp16), several machines
# (--nnodes 2), are long benchmarks (bench_collectives, ring_allreduce, compare_comm_hooks,
# tools.figures) or need an earlier run's checkpoint (--resume, checkpoint export).
RUN = [
    "python step1_single_gpu/train.py --steps 30",  # the Quick start's
    "python step1_single_gpu/train.py --model small --steps 30",
    "python step2_memory/train_amp_ac.py --ac selective",
    "torchrun --nproc-per-node 4 step3_multi_gpu/train_ddp.py --amp off --zero1",
    "torchrun --nproc-per-node 4 step3_multi_gpu/train_fsdp.py --ac full",
    "torchrun --nproc-per-node 4 step3_multi_gpu/train_cp.py --amp off --seq-len 1024",
    # the CP and EP pages' dry runs of one rank of 8 (tools/figures.py writes them into the pages)
    "python step3_multi_gpu/train_cp.py --model small",
    "python step3_multi_gpu/train_ep.py --model small-moe",
]
# What a command needs on top of TINY: a mixture of experts, and a batch for its 8 ranks.
AFTER_TINY = {"python step3_multi_gpu/train_ep.py": ["--model", "debug-moe", "--global-batch-size", "8"]}


def readme_commands() -> list[list[str]]:
    text = all_text()
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        block = block.replace("\\\n", " ")  # continued lines
        for line in block.splitlines():
            line = line.strip()
            if line.startswith(("python ", "torchrun ")):
                cmds.append(shlex.split(line, comments=True))
    return cmds


class _Parsed(BaseException):
    """Raised right after argparse succeeds; a BaseException so main_guard lets it through."""


def split(cmd: list[str]) -> tuple[list[str], str, list[str]]:
    """(torchrun flags, script path or -m module, script flags)."""
    if cmd[0] == "torchrun":
        from torch.distributed.run import get_args_parser
        ns = get_args_parser().parse_args(cmd[1:])
        return cmd[1:len(cmd) - len(ns.training_script_args) - 1], ns.training_script, ns.training_script_args
    if cmd[1] == "-m":
        return [], "-m " + cmd[2], cmd[3:]
    return [], cmd[1], cmd[2:]


def parse_only(target: str, argv: list[str]) -> int:
    """Run ``target``'s main() with ``argv`` until its arguments are parsed: the exit
    code argparse gives (0 when they parse)."""
    # parse_known_args: parse_args calls it, and the tools that pass their other flags on to a
    # training script (tools/scaling.py, tools/lr_scaling.py) call it themselves
    real = argparse.ArgumentParser.parse_known_args

    def parse_known_args(self, args=None, namespace=None):
        real(self, args, namespace)
        raise _Parsed

    saved = sys.argv
    sys.argv = [target, *argv]
    argparse.ArgumentParser.parse_known_args = parse_known_args
    try:
        if target.startswith("-m "):
            runpy.run_module(target[3:], run_name="__main__", alter_sys=False)
        else:
            runpy.run_path(str(ROOT / target), run_name="__main__")
    except _Parsed:
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    finally:
        argparse.ArgumentParser.parse_known_args = real
        sys.argv = saved
    return 0


def test_readme_flags_parse(capsys):
    cmds = readme_commands()
    assert len(cmds) >= 20, "README.md's bash blocks lost their commands?"
    bad = []
    for cmd in cmds:
        line = " ".join(cmd)
        if any(line.startswith(k) for k in NOT_CHECKED):
            continue
        _, target, argv = split(cmd)
        if not target.startswith("-m "):
            assert (ROOT / target).exists(), f"README runs {target}, which does not exist"
        # placeholders a reader fills in (e.g. a checkpoint path) still parse as strings
        code = parse_only(target, argv)
        if code:
            bad.append(f"{line}: exit {code}: {capsys.readouterr().err.strip()[-200:]}")
    assert not bad, "README commands whose flags the script rejects:\n" + "\n".join(bad)


def test_every_command_prints_its_help(capsys):
    """``--help`` of every script and tool a learner can run prints its usage and exits 0 (a
    help string with a bare % once made argparse's formatting raise instead)."""
    targets = sorted(str(p.relative_to(ROOT)) for d in ("step1_single_gpu", "step2_memory", "step3_multi_gpu",
                                                        "step4_multi_node", "tools")
                     for p in (ROOT / d).glob("*.py") if 'if __name__ == "__main__"' in p.read_text())
    assert len(targets) >= 40, targets
    silent = []
    for target in targets:
        # (by path: runpy's module form meets pytest's assertion rewriter at tools/test_times.py)
        assert parse_only(target, ["--help"]) == 0, target
        if "usage:" not in capsys.readouterr().out:
            silent.append(target)
    assert not silent, f"--help printed no usage: {silent}"


def test_readme_commands_run(tmp_path):
    cmds = {" ".join(c): c for c in readme_commands()}
    for start in RUN:
        assert any(line.startswith(start) for line in cmds), f"README no longer has `{start}`; update RUN"
    # as a user's CPU runs them: AdamW one tensor at a time (the suite's other runs take CUDA's path)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TUTORIAL_CUDA_PATHS="0")

    def run(i_start):
        i, start = i_start
        cmd = next(c for line, c in cmds.items() if line.startswith(start))
        torchrun, target, argv = split(cmd)
        out = ["--out", str(tmp_path / f"run{i}"), "--device", "cpu"]
        if torchrun:
            # 2 ranks, not 4: the same code paths, half the processes on a 2-core machine
            launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        else:
            launch = [sys.executable]
        t = time.perf_counter()
        extra = next((v for k, v in AFTER_TINY.items() if start.startswith(k)), [])
        # a hang detector, far above the ~25 s these take together here: eight fresh interpreters
        # (and three torchrun jobs) start at once, and beside a second suite on 2 cores a
        # 2-step run took over 120 s
        p = subprocess.run(launch + [target, *argv, *TINY, *extra, *out], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=hang_limit(300))
        return start, p, time.perf_counter() - t

    with ThreadPoolExecutor(len(RUN)) as pool:
        results = list(pool.map(run, enumerate(RUN)))
    failed = [f"{s} (exit {p.returncode}):\n{p.stderr[-1500:]}" for s, p, _ in results if p.returncode]
    assert not failed, "\n\n".join(failed)
    # the CPU's own AdamW path (the rest of the suite runs CUDA's): one tensor at a time
    kernels = {json.loads(f.read_text()).get("optimizer_kernels") for f in tmp_path.glob("run*/summary.json")}
    assert kernels == {"for-loop"}, kernels
    for s, _, dt in results:
        print(f"{dt:5.1f} s  {s}")


def test_slurm_script_launches_what_torchrun_and_the_script_accept(capsys):
    """step4_multi_node/train.slurm cannot run here, so it is read: bash's syntax check, then
    its srun line with Slurm's variables filled in (2 nodes, as its #SBATCH lines ask) must
    parse with torchrun's own argument parser, as one torchrun per node of --nproc-per-node
    = the GPUs a node is given, meeting at the head node through the c10d rendezvous; and the
    script and flags of its usage line, with the ones it adds, must parse with that script."""
    path = ROOT / "step4_multi_node" / "train.slurm"
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    text = path.read_text()
    sbatch = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.M))
    usage = shlex.split(re.search(r"^#\s+(?:mkdir -p runs && )?sbatch step4_multi_node/train\.slurm (.*)$", text,
                                  re.M).group(1))
    srun = re.search(r"^srun .*?(?<!\\)$", text.replace("\\\n", " "), re.M | re.S).group(0)
    srun = srun.removesuffix("&").rstrip()  # in the background, so that its USR1 trap can run
    # --shutdown-timeout where the installed torchrun has it (torch 2.11's rejects it), as the script decides
    from torch.distributed.run import get_args_parser
    parser = get_args_parser()
    has_timeout = "--shutdown-timeout" in parser._option_string_actions
    timeout = re.search(r'^\s*SHUTDOWN_TIMEOUT="(--shutdown-timeout \d+)"$', text, re.M).group(1)
    filled = (srun.replace('"$SLURM_JOB_NUM_NODES"', sbatch["nodes"]).replace('"$SLURM_JOB_ID"', "4242")
              .replace('"$HEAD_NODE:29500"', "node-a:29500").replace('"$SCRIPT"', usage[0])
              .replace('"$@"', shlex.join(usage[1:])).replace("$SHUTDOWN_TIMEOUT", timeout if has_timeout else ""))
    assert "$" not in filled, f"a shell variable the test does not fill in: {filled}"
    cmd = shlex.split(filled)
    launcher, target, argv = split(cmd[cmd.index("torchrun"):])
    ns = parser.parse_args(launcher + [target, *argv])
    assert sbatch["ntasks-per-node"] == "1"  # one torchrun per node, which starts the ranks
    assert (ns.nnodes, ns.nproc_per_node) == (sbatch["nodes"], sbatch["gpus-per-node"])
    assert (ns.rdzv_backend, ns.rdzv_endpoint, ns.rdzv_id) == ("c10d", "node-a:29500", "4242")
    assert not ns.standalone and ns.max_restarts > 0 and "--resume" in argv
    # preemption: a warning before the time limit, forwarded to the ranks; torchrun waits for
    # their checkpoint longer than its default 30 s; the job is requeued and resumes
    assert sbatch["signal"].startswith("B:USR1@") and "--requeue" in text and "scontrol requeue" in text
    assert "SIGUSR1" in ns.signals_to_handle.split(",") and (not has_timeout or int(ns.shutdown_timeout) > 30)
    assert parse_only(target, argv) == 0, capsys.readouterr().err[-300:]


@pytest.fixture
def synthetic_runs(tmp_path):
    """Two run folders with made-up summaries and 2-rank traces."""
    import json
    from common.measure.memory_categories import CATEGORIES
    folders = []
    for k, scale in enumerate((1.0, 0.5)):
        folder = tmp_path / f"run{k}"
        folder.mkdir()
        traces = []
        for rank in range(2):
            series = {"event": list(range(10))}
            for j, c in enumerate(CATEGORIES):
                series[c] = [int(scale * (j + 1) * 2**20 * (1 + (e % 5) / 4 + rank / 10)) for e in range(10)]
            totals = [sum(series[c][e] for c in CATEGORIES) for e in range(10)]
            pe = max(range(10), key=totals.__getitem__)
            traces.append({"rank": rank, "device": "cpu", "events": 10, "peak_bytes": totals[pe], "peak_event": pe,
                           "at_peak": {c: series[c][pe] for c in CATEGORIES},
                           "peak_by_category": {c: max(series[c]) for c in CATEGORIES},
                           "allocator_peak_bytes": None, "phases": [[0, "forward"], [4, "backward"], [8, "optimizer"]],
                           "steps": [[0, 1]], "series": series})
        (folder / "memory_trace.json").write_text(json.dumps(traces))
        summary = {"model": "debug", "global_batch_size": 4, "seq_len": 32, "device_name": "CPU", "world_size": 2,
                   "step_time_s": 0.5, "tokens_per_s": 256.0, "final_loss": 3.0 + k,
                   **({"comm": [{"all_reduce": {"calls": 1, "bytes": 1000, "wire_bytes": 1000},
                             "recv": {"calls": 1, "bytes": 500, "wire_bytes": 500}}] * 2} if k else {})}
        (folder / "summary.json").write_text(json.dumps(summary))
        folders.append(folder)
    return folders


def test_compare_renders(synthetic_runs, tmp_path):
    from tools.compare import compare
    md = compare(synthetic_runs, ["A", "B"], tmp_path / "out")
    for f in ("memory_timelines.png", "peak_by_category.png", "compare.md"):
        assert (tmp_path / "out" / f).stat().st_size > 0
    note, blank, *rows = md.strip().splitlines()
    # the runs share every setting: said once, and no column for any of them
    assert note == "All runs: model debug, batch 4 x 32 tokens, device CPU, ranks 2." and not blank
    assert len(rows) == 4 and rows[0].startswith("| run | ranks |")
    assert rows[2].startswith("| A | 2 |") and rows[3].startswith("| B | 2 |")
    # A counted no bytes; B sent 1000 B per rank per step (what it received is its sender's)
    assert "n/a" in rows[2] and "1000 B" in rows[3]
    assert "0.50x" in rows[3]


def test_compare_names_what_differs(synthetic_runs, tmp_path, monkeypatch):
    """An fp32 DDP run beside a bf16 FSDP run at twice the batch: the table gives each
    differing setting a column and says the peaks compare all of them; the figure titles
    name what the runs share and what differs (the strategy is what a comparison is for)."""
    import json

    import tools.compare as compare_mod
    for folder, lesson, savers, batch in zip(synthetic_runs, ("Step 3a, DDP", "Step 3a, FSDP (ZeRO-3)"),
                                             ("fp32", "AMP bf16"), (4, 8)):
        s = json.loads((folder / "summary.json").read_text())
        s.update(lesson=lesson, savers=savers, global_batch_size=batch, steps=5)
        (folder / "summary.json").write_text(json.dumps(s))
    titles = []
    monkeypatch.setattr(compare_mod, "render_peak_bars", lambda runs, path, title: titles.append(title))
    monkeypatch.setattr(compare_mod, "render_timelines", lambda runs, path, title: titles.append(title))
    note, _, head, _, a, b = compare_mod.compare(synthetic_runs, ["A", "B"], tmp_path / "out").strip().splitlines()
    assert note == ("All runs: model debug, steps 5, device CPU, ranks 2. They differ in strategy, precision, "
                    "batch: the columns compare all of these, not the strategy alone.")
    assert head.startswith("| run | strategy | precision | batch | ranks | peak")
    assert a.startswith("| A | DDP | fp32 | 4 x 32 tokens | 2 |")
    assert b.startswith("| B | FSDP (ZeRO-3) | AMP bf16 | 8 x 32 tokens | 2 |")
    assert titles and all(t.endswith(": debug model, 5 steps, CPU, 2 ranks; runs differ in precision, batch")
                          for t in titles), titles
    # step 1 beside step 2 (the README's own comparison): one device both, so only the precision differs
    for folder, lesson, savers in zip(synthetic_runs, ("Step 1, fp32 baseline", "Step 2"), ("fp32", "AMP bf16")):
        s = json.loads((folder / "summary.json").read_text())
        s.update(lesson=lesson, savers=savers, strategy="single", global_batch_size=4)
        (folder / "summary.json").write_text(json.dumps(s))
    note = compare_mod.compare(synthetic_runs, ["A", "B"], tmp_path / "out2").strip().splitlines()[0]
    assert note.endswith("They differ in precision: the columns compare all of these, not the strategy alone."), note


def test_compare_missing_folder(synthetic_runs, tmp_path, capsys):
    from tools.compare import main
    for bad in (tmp_path / "nope", tmp_path):  # missing; a folder without summary.json
        with pytest.raises(SystemExit) as e:
            main([str(synthetic_runs[0]), str(bad), "--out", str(tmp_path / "o")])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and len(err.splitlines()) == 1 and str(bad) in err


def test_readme_python_snippets_print_what_they_claim():
    """A ```python block of the README that imports what it needs is a runnable snippet; the
    comment lines that end it are the output it claims, and running it must print exactly those."""
    import contextlib
    import io
    text = all_text()
    snippets = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if re.search(r"^(from|import) ", b, re.M)]
    assert snippets, "README.md lost its runnable snippet(s)?"
    for code in snippets:
        lines = code.rstrip("\n").splitlines()
        claimed = []
        while lines and lines[-1].startswith("# "):
            claimed.insert(0, lines.pop()[2:])
        assert claimed, f"a runnable README snippet claims no output:\n{code[:200]}"
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, "README snippet", "exec"), {"__name__": "readme_snippet"})
        assert out.getvalue().splitlines() == claimed, code[:200]


def test_every_link_of_every_page_leads_somewhere():
    """The pages link to each other, to the code and to figs/: every relative link names a
    file that exists, and every #anchor a heading of the page it points into."""
    from tools.docs import doc_paths

    def anchors(page: Path) -> set[str]:
        heads = re.findall(r"^#{1,6} (.*)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), re.M)
        return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}

    bad, checked = [], 0
    for page in doc_paths():
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            checked += 1
            if re.match(r"^(https?|mailto):", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert checked > 50 and not bad, "\n".join(bad) or f"only {checked} links found: the pattern broke?"


def test_every_figure_is_shown_on_some_page():
    from tools.docs import all_text
    text = all_text()
    unused = [p.name for p in sorted((ROOT / "figs").glob("*.png")) if p.name not in text]
    assert not unused, f"figures no page shows: {unused}"
