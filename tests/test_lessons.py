"""The house's shape: what keeps each script a lesson and the library a library.

- common/ has no import circle: a module that imports another, even lazily inside a
  function, is never imported back by it, directly or through others (a circle makes the
  import order matter and hides which module owns what).
- every step-3 training script can be read in a few minutes: at most MAX_SCRIPT_LINES lines,
  its plumbing (flags, optional techniques, refusals, summary extras) living in common/.
- train_ddp.py and train_fsdp.py differ in what makes DDP into FSDP: at most
  MAX_DDP_FSDP_DIFF changed lines, the count of ``diff train_ddp.py train_fsdp.py | grep -c '^[<>]'``.
"""
from __future__ import annotations

import ast
import difflib

from common import ROOT

MAX_SCRIPT_LINES = 110
MAX_DDP_FSDP_DIFF = 80
STEP3 = ROOT / "step3_multi_gpu"


def import_graph() -> dict[str, set[str]]:
    """{module: the common.* modules it imports, anywhere in its body}."""
    root = ROOT / "common"
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for p in root.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("common"):
                deps.add(node.module)  # from common.x import y: y may be a module itself
                deps.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in files)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("common"))
        graph[name] = (deps & files.keys()) - {name, "common"}  # the package's ROOT is no circle
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


def changed_lines(a: list[str], b: list[str]) -> int:
    """The lines ``diff`` prints with < or >: those only one side has, after matching the rest."""
    return sum(max(i2 - i1, 0) + max(j2 - j1, 0) for tag, i1, i2, j1, j2 in
               difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes() if tag != "equal")


def test_every_step3_training_script_is_short_enough_to_read():
    scripts = sorted(STEP3.glob("train_*.py"))
    assert len(scripts) >= 9, "the walk found the scripts"
    long = {p.name: n for p in scripts if (n := len(p.read_text().splitlines())) > MAX_SCRIPT_LINES}
    assert long == {}, f"over {MAX_SCRIPT_LINES} lines: move their plumbing into common/"


def test_the_ddp_to_fsdp_diff_is_the_lesson():
    assert changed_lines(["a", "b", "c"], ["a", "x", "c", "d"]) == 3  # b out; x and d in
    ddp, fsdp = ((STEP3 / f"train_{s}.py").read_text().splitlines() for s in ("ddp", "fsdp"))
    n = changed_lines(ddp, fsdp)
    assert 0 < n <= MAX_DDP_FSDP_DIFF, f"{n} changed lines between train_ddp.py and train_fsdp.py"
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"turn DDP into FSDP, {n} changed lines" in readme, "README.md's count of the diff is out of date"
