"""The pytest plugin of the testing kit (fastjobs.testing), registered as `fastjobs` under pytest11.

Fixtures: `fastjobs_dsn` (a fresh migrated database per test), `fastjobs_app`
(the application's App: the `fastjobs_app` ini option, or override the
fixture), `fastjobs_testing` (the kit bound to that App on that database).
`@pytest.mark.fastjobs(mode="inline")` picks a test's mode.

A module of its own outside the package, as Hypothesis's plugin is: pytest
imports every installed plugin at startup, and importing `fastjobs` (psycopg,
the C extension) would cost every session of a project that has fastjobs
installed, 0.1 to 0.3 s, used or not. Nothing of fastjobs is imported until
a test asks for one of these fixtures.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from fastjobs.app import App
    from fastjobs.testing import Testing


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("fastjobs_app", "the App the fastjobs_testing fixture uses, as 'package.module:attribute'")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "fastjobs(mode): the fastjobs_testing fixture's mode, 'manual' (default) or 'inline'"
    )


@pytest.fixture
def fastjobs_dsn() -> Iterator[str]:
    """A fresh, migrated database of this test's own (FASTJOBS_TEST_DSN's server, else an embedded one)."""
    from fastjobs.testing import databases

    with databases.fresh() as dsn:
        yield dsn


@pytest.fixture
def fastjobs_app(request: pytest.FixtureRequest) -> App:
    """The App under test: the `fastjobs_app` ini option names it; a conftest may override this fixture."""
    target = request.config.getini("fastjobs_app")
    if not target:
        raise pytest.UsageError(
            'fastjobs_testing needs your App: set `fastjobs_app = "package.module:app"` in the'
            " pytest configuration, or define a `fastjobs_app` fixture returning it in conftest.py"
        )
    return load_app(str(target))


@pytest.fixture
def fastjobs_testing(
    request: pytest.FixtureRequest, fastjobs_app: App, fastjobs_dsn: str
) -> Iterator[Testing]:
    """The testing kit bound to `fastjobs_app`, which uses `fastjobs_dsn` for the test's duration."""
    marker = request.node.get_closest_marker("fastjobs")
    mode: Any = marker.kwargs.get("mode", marker.args[0] if marker.args else "manual") if marker else "manual"
    with fastjobs_app.testing(mode, dsn=fastjobs_dsn) as kit:
        yield kit


def load_app(target: str) -> App:
    """The App named by `"package.module:attribute"` (the `fastjobs_app` ini option's form)."""
    import importlib

    from fastjobs.app import App

    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"name the App as 'package.module:attribute', not {target!r}")
    value: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        value = getattr(value, part)
    if not isinstance(value, App):
        raise TypeError(f"{target} is a {type(value).__name__}, not a fastjobs.App")
    return value
