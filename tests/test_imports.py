"""The product's modules import one another in one direction: no circle among autotune/ and
api/, counting the imports inside functions too (a lazy import that closes a circle is still
one for a reader and for the tools), and the CLI reaches the service through plain imports,
never through module names in strings. Read from the source (ast): nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("autotune", "api")


def product_modules() -> dict[str, Path]:
    """Dotted name → file, for every module of the product's packages."""
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    return modules


def imports_of(path: Path, module: str, known: set[str]) -> set[str]:
    """The product modules `module` imports anywhere in its file (top level or in a function)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level-1 parents
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        found |= {name for name in names if name in known and name != module}
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
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
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_product_has_no_import_circle() -> None:
    modules = product_modules()
    graph = {name: imports_of(path, name, set(modules)) for name, path in modules.items()}
    assert "autotune.demo" in graph["autotune.cli"]  # the walk sees lazy imports (cli imports demo in a function)
    assert circles(graph) == []


def test_a_circle_is_found() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_cli_names_no_module_in_a_string() -> None:
    for path in (ROOT / "autotune").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" and node.args:
                first = node.args[0]
                assert not (isinstance(first, ast.Constant) and str(first.value).startswith("api")), \
                    f"{path.relative_to(ROOT)}:{node.lineno} imports the service by name: import it plainly"
