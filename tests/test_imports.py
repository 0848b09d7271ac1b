"""The house's rules, read from the source (ast) and checked in fresh processes.

One package, autotune, in wings that match the processes (docs/architecture.md):
* autotune.contract — what every process shares; imports no torch, no other wing;
* autotune.engine and autotune.workloads — the probe child; nothing of the service, the worker
  or the command line;
* autotune.worker — the GPU host's process; no optuna, fastapi or SQL, nothing of the service;
* autotune.api (the repository's api/) — the service; nothing of the engine, worker or CLI;
* autotune.cli — the command line; it reaches the service through one seam,
  `autotune.cli.seam.service()`, never through module names in strings.
No circle among the modules, counting the imports inside functions too (a lazy import that
closes a circle is still one for a reader and for the tools)."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# the package's own folder, and the repository's folders it holds as links (pyproject.toml)
FOLDERS = {"autotune": ROOT / "autotune", "autotune.api": ROOT / "api", "autotune.migrations": ROOT / "migrations"}


def product_modules() -> dict[str, Path]:
    """Dotted name → file, for every module of the product."""
    modules = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):  # rglob does not follow the links: api/ is read once
            name = ".".join((package, *path.relative_to(folder).with_suffix("").parts))
            modules[name.removesuffix(".__init__")] = path
    return modules


@functools.cache
def parsed(path: Path) -> ast.Module:
    """One tree a file (the checks below match nodes across walks by identity)."""
    return ast.parse(path.read_text())


def wing(module: str) -> str:
    """autotune.engine.probe → engine; autotune → root."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "root"


def imported_names(path: Path, module: str, top_level_only: bool = False) -> list[tuple[str, ast.AST]]:
    """Every name `module` imports (absolute, relative ones resolved), with its node; with
    `top_level_only`, those run when the module is imported (not in a function or under
    TYPE_CHECKING)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = parsed(path)
    nodes: list[ast.AST] = []
    if top_level_only:
        def visit(body: list[ast.stmt]) -> None:
            for stmt in body:
                if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test):
                    continue
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                nodes.append(stmt)
                for field in ("body", "orelse", "finalbody", "handlers"):
                    inner = getattr(stmt, field, None)
                    if isinstance(inner, list):
                        visit([s for s in inner if isinstance(s, ast.stmt)] +
                              [s for h in inner if isinstance(h, ast.ExceptHandler) for s in h.body])
        visit(tree.body)
    else:
        nodes = list(ast.walk(tree))
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(alias.name, node) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            found += [(base, node), *((f"{base}.{alias.name}", node) for alias in node.names)]
    return found


def imports_of(path: Path, module: str, known: set[str]) -> set[str]:
    """The product modules `module` imports anywhere in its file (top level or in a function)."""
    return {name for name, _ in imported_names(path, module) if name in known and name != module}


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
    # the walk sees lazy imports (the command line imports the demo in a function)
    assert "autotune.cli.demo" in graph["autotune.cli.study_cmds"]
    assert circles(graph) == []


def test_a_circle_is_found() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_cli_names_no_module_in_a_string() -> None:
    for path in product_modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" and node.args:
                first = node.args[0]
                assert not (isinstance(first, ast.Constant) and str(first.value).startswith("api")), \
                    f"{path.relative_to(ROOT)}:{node.lineno} imports the service by name: import it plainly"


def third_party(name: str) -> str:
    return name.split(".")[0]


SERVICE_LIBRARIES = {"optuna", "fastapi", "starlette", "uvicorn", "sqlalchemy", "alembic", "psycopg"}
# what each wing may not import, anywhere in its files (wings of the product; libraries by top name)
FORBIDDEN = {
    "contract": {"engine", "workloads", "worker", "cli", "api", "migrations"},
    "engine": {"workloads", "worker", "cli", "api", "migrations"} | SERVICE_LIBRARIES,
    "workloads": {"worker", "cli", "api", "migrations"} | SERVICE_LIBRARIES,
    "worker": {"cli", "api", "migrations"} | SERVICE_LIBRARIES,
    "api": {"engine", "workloads", "worker", "cli"},
}


def enclosing_functions(path: Path) -> dict[int, str]:
    """Import node id → the name of the function it sits in ("" at module level or under
    TYPE_CHECKING, which runs only for the type checker: "TYPE_CHECKING")."""
    where: dict[int, str] = {}

    def visit(node: ast.AST, inside: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child.name)
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                visit(child, "TYPE_CHECKING")
            else:
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    where[id(child)] = inside
                visit(child, inside)

    visit(parsed(path), "")
    return where


def test_each_wing_imports_only_what_its_process_runs() -> None:
    broken = []
    for module, path in product_modules().items():
        own = wing(module)
        tree_where = enclosing_functions(path)
        for name, node in imported_names(path, module):
            other = wing(name) if name.startswith("autotune.") else third_party(name)
            # the one exception: Workload's default methods (run only in the probe child) call the
            # engine's AdamW and LR schedule from inside the method, never at import time
            excepted = module == "autotune.contract.workload" and other == "engine" and tree_where.get(id(node))
            if other in FORBIDDEN.get(own, set()) and not excepted:
                broken.append(f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')} ({own}) imports {name}")
    assert broken == []


def test_the_contract_imports_no_torch_at_import_time() -> None:
    """Every contract module's import-time imports: the standard library, pydantic, yaml and
    the contract itself."""
    allowed = {"pydantic", "yaml", "autotune"}
    for module, path in product_modules().items():
        if wing(module) != "contract":
            continue
        for name, node in imported_names(path, module, top_level_only=True):
            top = third_party(name)
            assert top in allowed or top in sys.stdlib_module_names, \
                f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')} imports {name} when imported"
            if top == "autotune":
                assert name == "autotune" or wing(name) == "contract", f"{path.relative_to(ROOT)} imports {name}"


# optional libraries (extras): imported inside the functions that use them, never when a module is
# imported, so that autotune, its contract, the worker and the engine import without them
LAZY_LIBRARIES = {"transformers", "accelerate", "torchao", "liger_kernel"}


def test_optional_libraries_are_imported_only_where_they_are_used() -> None:
    """transformers (the `hf` extra: autotune/workloads/hf.py), torchao (`gpu`) and liger_kernel (`liger`) only inside
    functions or under TYPE_CHECKING, in every module of the product."""
    eager = []
    for module, path in product_modules().items():
        for name, node in imported_names(path, module, top_level_only=True):
            if third_party(name) in LAZY_LIBRARIES:
                eager.append(f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')} imports {name} when imported")
    assert eager == []


def test_the_command_line_reaches_the_service_through_one_seam() -> None:
    """Outside the service, only `autotune.cli.seam.service()` imports it."""
    reaching = set()
    for module, path in product_modules().items():
        if wing(module) in ("api", "migrations"):
            continue
        where = enclosing_functions(path)
        for name, node in imported_names(path, module):
            if name.startswith("autotune.") and wing(name) in ("api", "migrations"):
                reaching.add((module, where.get(id(node), "?")))
    assert sorted(reaching) == [("autotune.cli.seam", "service")]


@pytest.mark.parametrize(("modules", "absent"), [
    (["autotune.contract." + p.stem for p in (ROOT / "autotune" / "contract").glob("*.py") if p.stem != "__init__"],
     {"torch", "fastapi", "optuna", "sqlalchemy", "httpx", "transformers"}),
    (["autotune.worker.loop", "autotune.worker.spool", "autotune.worker.client"],
     {"torch", "fastapi", "optuna", "sqlalchemy", "starlette", "transformers"}),
    (["autotune.api.main"], {"torch"}),
    (["autotune"], {"torch", "transformers", "fastapi", "optuna", "sqlalchemy"}),  # `import autotune`: all lazy
], ids=["contract", "worker", "service", "package"])
def test_a_fresh_process_loads_only_its_wing(modules: list[str], absent: set[str]) -> None:
    """Imported in a fresh process, a wing does not bring in what its process never runs."""
    code = (f"import sys\nimport {', '.join(modules)}\n"
            f"print(sorted(set({sorted(absent)!r}) & {{m.split('.')[0] for m in sys.modules}}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
