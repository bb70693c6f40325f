"""The house's shape: what keeps each script a lesson and the library a library.

- common/ has no import circle: a module that imports another, even lazily inside a
  function, is never imported back by it, directly or through others (a circle makes the
  import order matter and hides which module owns what).
- every step-3 training script can be read in a few minutes: at most MAX_SCRIPT_LINES lines,
  its plumbing (flags, optional techniques, refusals, summary extras) living in common/.
- every training script's loop shows each part of a step: run.resume() before it, and after the
  optimizer step run.log, scheduler.step(), run.evaluate_if_due and run.save_if_due, each a line.
- train_ddp.py and train_fsdp.py differ in what makes DDP into FSDP: at most
  MAX_DDP_FSDP_DIFF changed lines, the count of ``diff train_ddp.py train_fsdp.py | grep -c '^[<>]'``.
- a chapter's figures live beside its scripts: its runs and what turns them into its figures
  and tables are in its folder's figures.py; tools/figures.py (at most MAX_FIGURES_TOOL_LINES
  lines) only gathers them, launches the runs and writes the pages' blocks; and nothing in
  common/, tools/ or the step folders imports itself back (the chapters' figures modules import
  tools/figure_runs.py, never tools/figures.py).
"""
from __future__ import annotations

import ast
import difflib
import importlib
import inspect
import re

from common import ROOT

MAX_SCRIPT_LINES = 110
MAX_DDP_FSDP_DIFF = 80
MAX_FIGURES_TOOL_LINES = 250
STEP3 = ROOT / "step3_multi_gpu"
# each step folder and the prefixes of the files in figs/ its runs make
CHAPTERS = {"step1_single_gpu": ("01",), "step2_memory": ("02",), "step3_multi_gpu": ("03", "04"),
            "step4_multi_node": ("05",)}


def import_graph(packages=("common",)) -> dict[str, set[str]]:
    """{module: the modules of ``packages`` it imports, anywhere in its body}."""
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for package in packages for p in (ROOT / package).rglob("*.py")}
    graph = {}
    for name, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(packages):
                deps.add(node.module)  # from common.x import y: y may be a module itself
                deps.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in files)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith(packages))
        graph[name] = (deps & files.keys()) - {name, *packages}  # a package's ROOT is no circle
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    found = []

    def walk(node, path):
        for nxt in sorted(graph.get(node, ())):
            if nxt == path[0]:
                found.append(path + [nxt])
            elif nxt not in path:
                walk(nxt, path + [nxt])

    for start in sorted(graph):
        walk(start, [start])
    return found


def test_common_has_no_import_circle():
    graph = import_graph()
    assert len(graph) > 25 and graph["common.run"], "the walk found the modules and their imports"
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) != []  # the finder finds one
    assert circles(graph) == []


def test_the_chapters_figures_live_in_their_folders():
    from tools import figures
    n = len((ROOT / "tools" / "figures.py").read_text().splitlines())
    assert n <= MAX_FIGURES_TOOL_LINES, f"tools/figures.py has {n} lines: move a chapter's part into its folder"
    tree = ast.parse((ROOT / "tools" / "figures.py").read_text())
    assert not [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "Run"], "a run is listed in tools/figures.py, not its chapter's"
    home, steps = {}, []  # id(run) -> its chapter folder; the chapters' POST_STEPS in order
    for folder in CHAPTERS:
        module = importlib.import_module(f"{folder}.figures")
        for value in vars(module).values():
            for run in (value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()):
                if isinstance(run, figures.Run):
                    home.setdefault(id(run), folder)
        steps += module.POST_STEPS
        assert all(not post.__module__.startswith(("step", "tools.figures")) or post.__module__.startswith(folder)
                   for _, post in module.POST_STEPS), f"{folder}/figures.py registers another chapter's table"
    assert len(figures.RUNS) > 50 and all(id(r) in home for r in figures.RUNS), "a run outside the chapters"
    for run in figures.RUNS:
        assert all(f.startswith(CHAPTERS[home[id(run)]]) for f in run.figures), (run.name, home[id(run)])
    # the blocks of a chapter's pages are named in its folder's modules (or a tool its figures.py
    # registers, as step 4's troubleshooting table), never in tools/figures.py
    in_tool = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)}
    for folder in CHAPTERS:
        module = importlib.import_module(f"{folder}.figures")
        sources = [p.read_text() for p in (ROOT / folder).glob("*.py")]
        sources += [inspect.getsource(inspect.getmodule(post)) for _, post in module.POST_STEPS]
        named = {n.value for src in sources for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Constant)}
        pages = sorted((ROOT / folder).glob("*.md"))
        markers = [m for page in pages for m in re.findall(r"<!-- BEGIN ([\w-]+) -->", page.read_text())]
        assert markers, f"the walk found {folder}'s blocks"
        for marker in markers:
            assert marker in named and marker not in in_tool, f"{folder}'s block {marker} is made outside {folder}/"
    # the registry: the chapters' tables, then README.md's own (the GPU report)
    assert figures.POST_STEPS == [*steps, ("gpu", figures.gpu_check_report)]


def test_nothing_imports_itself_back():
    graph = import_graph(("common", "tools", *CHAPTERS))
    assert graph["tools.figures"] >= {f"{c}.figures" for c in CHAPTERS}, "the walk found the chapters' figures"
    assert all("tools.figures" not in graph[f"{c}.figures"] for c in CHAPTERS)
    assert circles(graph) == []


def changed_lines(a: list[str], b: list[str]) -> int:
    """The lines ``diff`` prints with < or >: those only one side has, after matching the rest."""
    return sum(max(i2 - i1, 0) + max(j2 - j1, 0) for tag, i1, i2, j1, j2 in
               difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes() if tag != "equal")


def test_every_step3_training_script_is_short_enough_to_read():
    scripts = sorted(STEP3.glob("train_*.py"))
    assert len(scripts) >= 9, "the walk found the scripts"
    long = {p.name: n for p in scripts if (n := len(p.read_text().splitlines())) > MAX_SCRIPT_LINES}
    assert long == {}, f"over {MAX_SCRIPT_LINES} lines: move their plumbing into common/"


# What a step does after its optimizer step, each a line of every training script's loop, in
# this order: nothing of it hidden in run.log (common/run.py holds only the bookkeeping)
STEP_END = ["run.log", "scheduler.step", "run.evaluate_if_due", "run.save_if_due"]


def loop_calls(path) -> tuple[list[str], list[str]]:
    """(the calls made before the script's ``for step in run.steps()`` loop, the calls its body
    makes outside ``with run.step(step)``), as dotted names."""
    def name(call):
        f = call.func
        return f"{f.value.id}.{f.attr}" if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None
    tree = ast.parse(path.read_text())
    loop = next(n for n in ast.walk(tree) if isinstance(n, ast.For) and isinstance(n.iter, ast.Call)
                and name(n.iter) == "run.steps")
    before = [name(n) for n in ast.walk(tree) if isinstance(n, ast.Call) and n.lineno < loop.lineno]
    after = [name(s.value) for s in loop.body if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)]
    return before, after


def test_every_part_of_a_step_is_a_line_of_the_loop():
    scripts = [ROOT / "step1_single_gpu" / "train.py", *sorted((ROOT / "step2_memory").glob("train_*.py")),
               *sorted(STEP3.glob("train_*.py"))]
    assert len(scripts) >= 14, "the walk found the scripts"
    for path in scripts:
        before, after = loop_calls(path)
        assert "run.resume" in before, f"{path.name}: run.resume() before the loop (where --resume loads)"
        assert [c for c in after if c in STEP_END] == STEP_END, f"{path.name}: the loop ends {after}, not {STEP_END}"


def test_the_ddp_to_fsdp_diff_is_the_lesson():
    assert changed_lines(["a", "b", "c"], ["a", "x", "c", "d"]) == 3  # b out; x and d in
    ddp, fsdp = ((STEP3 / f"train_{s}.py").read_text().splitlines() for s in ("ddp", "fsdp"))
    n = changed_lines(ddp, fsdp)
    assert 0 < n <= MAX_DDP_FSDP_DIFF, f"{n} changed lines between train_ddp.py and train_fsdp.py"
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"turn DDP into FSDP, {n} changed lines" in readme, "README.md's count of the diff is out of date"
