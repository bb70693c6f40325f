"""The house's shape: what keeps each script a lesson and the library a library.

- common/ has no import circle: a module that imports another, even lazily inside a
  function, is never imported back by it, directly or through others (a circle makes the
  import order matter and hides which module owns what).
"""
from __future__ import annotations

import ast

from common import ROOT


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
