"""The package's shape: no import circles (function-local imports included) and no source file over 400 lines."""

import ast
import os

import large_model_training

PACKAGE = os.path.dirname(large_model_training.__file__)
MAX_LINES = 400


def _modules() -> dict[str, str]:
    """Module name -> path, for every source file of the package."""
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path[:-3], os.path.dirname(PACKAGE)).replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


def _imports(name: str, path: str, modules: dict[str, str]) -> set[str]:
    """The package modules `name` imports anywhere in its file (a package import counts as its __init__)."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in modules else base)
    return {m for m in found if m in modules and m != name}


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    modules = _modules()
    edges = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert len(edges) > 50 and any(edges.values()), "the import graph was not read"
    assert _cycles(edges) == []


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_source_file_over_400_lines():
    long = {os.path.relpath(p, PACKAGE): n for p in _modules().values()
            if (n := sum(1 for _ in open(p))) > MAX_LINES}
    assert long == {}
