"""The package's shape: the layer order docs/architecture.md states (no module imports a higher layer), no import
circles (function-local imports included) and no source file over 400 lines."""

import ast
import io
import os
import re
import tokenize

import large_model_training

PACKAGE = os.path.dirname(large_model_training.__file__)
ROOT = "large_model_training"
DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "architecture.md")
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


def doc_layers(text: str) -> list[list[str]]:
    """The first column of the first code block under '## Layers', one list of module names per layer, lowest
    first ("models/" -> the package and everything in it; "models/presets.py" -> that module)."""
    block = text.split("## Layers", 1)[1].split("```", 2)[1]
    layers = []
    for line in block.splitlines():
        if line and not line[0].isspace():  # a layer; indented lines continue the description
            names = re.split(r"\s{3,}", line, maxsplit=1)[0].split()
            assert all(n.endswith((".py", "/")) for n in names), f"not a module or folder: {line!r}"
            layers.append([".".join([ROOT, *n.removesuffix(".py").strip("/").split("/")]) for n in names])
    return layers


def layer_of(module: str, layers: list[list[str]]) -> int | None:
    """The layer of the most specific entry naming `module` or a package holding it; the package itself
    (its __init__: the public names re-exported from every layer) sits above them all."""
    if module == ROOT:
        return len(layers)
    best = max(
        ((len(e), i) for i, names in enumerate(layers) for e in names if module == e or module.startswith(e + ".")),
        default=None,
    )
    return None if best is None else best[1]


def upward_imports(edges: dict[str, set[str]], layers: list[list[str]]) -> list[str]:
    return sorted(
        f"{m} (layer {layer_of(m, layers)}) imports {d} (layer {layer_of(d, layers)})"
        for m, deps in edges.items()
        for d in deps
        if layer_of(d, layers) > layer_of(m, layers)
    )


def test_every_module_has_a_layer_in_the_doc():
    layers = doc_layers(open(DOC).read())
    assert len(layers) > 10
    assert sorted(m for m in _modules() if layer_of(m, layers) is None) == []


def test_no_module_imports_a_higher_layer():
    modules, layers = _modules(), doc_layers(open(DOC).read())
    edges = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert upward_imports(edges, layers) == []


def test_the_layer_check_finds_an_upward_import():
    text = (
        "## Layers\n\n```\nerrors.py  choices.py      ConfigError\nmodels/    the model\n"
        "models/presets.py   presets\n   continued\n```\n"
    )
    layers = doc_layers(text)
    assert layers == [[f"{ROOT}.errors", f"{ROOT}.choices"], [f"{ROOT}.models"], [f"{ROOT}.models.presets"]]
    assert layer_of(f"{ROOT}.models.moe", layers) == 1 and layer_of(f"{ROOT}.models.presets", layers) == 2
    edges = {f"{ROOT}.errors": {f"{ROOT}.models.moe"}, f"{ROOT}.models.presets": {f"{ROOT}.models.moe"}}
    assert upward_imports(edges, layers) == [f"{ROOT}.errors (layer 0) imports {ROOT}.models.moe (layer 1)"]


def counted_lines(source: str) -> int:
    """Lines that do not continue a bracketed expression: a formatter that wraps a call, a signature or an
    import one item a line leaves the count as it was (docstrings and comments count line by line)."""
    depth, depth_at_start = 0, {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        depth_at_start.setdefault(tok.start[0], depth)
        if tok.type == tokenize.OP and tok.string in "([{":
            depth += 1
        elif tok.type == tokenize.OP and tok.string in ")]}":
            depth -= 1
    return sum(1 for line in range(1, source.count("\n") + 1) if depth_at_start.get(line, 0) == 0)


def test_the_line_count_ignores_wrapping():
    dense = 'def f(a, b,\n      c):\n    """Doc\n    string."""\n    return g(a, b, c)  # note\n'
    wrapped = (
        'def f(\n    a,\n    b,\n    c,\n):\n    """Doc\n    string."""\n'
        "    return g(\n        a, b, c\n    )  # note\n"
    )
    assert counted_lines(dense) == counted_lines(wrapped) == 4


def test_no_source_file_over_400_lines():
    long = {
        os.path.relpath(p, PACKAGE): n for p in _modules().values() if (n := counted_lines(open(p).read())) > MAX_LINES
    }
    assert long == {}
