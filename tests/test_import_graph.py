"""The package's modules import one another without a circle: the arrows only point forward.

Read statically (every ``import`` in every module of ``attn/``, those inside functions
included: a lazy import hides a circle, it does not break it). Every circle found is reported,
each as its modules.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "attn"

#: Circles that exist today and are being broken elsewhere: attn.fast's kernels and their NumPy
#: ops import each other (the GPU engine work splits them). Remove an entry when its circle is
#: gone: test_known_circles_still_exist fails until then, so the list cannot go stale.


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the attn modules it imports: ``from .x import y`` counts attn.x.y where that
    is a module, else attn.x (``from . import decoding`` imports a submodule, not the package's
    ``__init__``, which Python has already begun)."""
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                submodules = {f"{module}.{a.name}" for a in node.names} & files.keys()
                targets.update(submodules)
                if len(submodules) < len(node.names):       # a name defined in the module itself
                    targets.add(module)
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[frozenset]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_the_imports():
    graph = import_graph()
    assert "attn.backend" in graph["attn.loss"]
    assert "attn.training.distributed" in graph["attn.train"]        # from .training import distributed
    assert "attn.data" in graph["attn.bench.vocab"]


def test_finding_circles_finds_a_planted_one():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [frozenset("abc")]


def test_no_import_circle():
    found = [sorted(c) for c in circles(import_graph())]
    assert not found, "import circles in attn/: " + "; ".join(" <-> ".join(c) for c in found)
