"""Failed attempts as log records error trackers report: WARNING or ERROR, the exception, the job's fields."""

from __future__ import annotations

import json
import logging
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fastjobs import App, Retry

from . import procs
from .helpers import drain


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def records() -> Iterator[list[logging.LogRecord]]:
    handler = Records()
    logger = logging.getLogger("fastjobs.handlers")
    logger.addHandler(handler)
    yield handler.records
    logger.removeHandler(handler)


def test_a_failed_attempt_is_a_warning_then_an_error_with_its_exception_and_the_jobs_fields(
    app: App, records: list[logging.LogRecord]
) -> None:
    @app.job(kind="boom", queue="loud", max_attempts=2, retry=lambda attempt, rand: 0)
    def boom(n: int) -> None:
        raise ValueError(f"boom {n}")

    @app.job(kind="asked", queue="loud", max_attempts=2)
    def asked() -> None:
        raise Retry(0)

    job_id = boom.enqueue(n=3)
    asked_id = asked.enqueue()
    drain(app, ["loud"], worker_id="w-1")
    failures = [r for r in records if r.levelno >= logging.WARNING]
    assert [(r.job_id, r.levelname, r.attempt) for r in failures] == [  # type: ignore[attr-defined]
        (job_id, "WARNING", 1),
        (asked_id, "WARNING", 1),
        (job_id, "ERROR", 2),
        (asked_id, "ERROR", 2),
    ]
    for record in failures:
        assert (record.queue, record.worker) == ("loud", "w-1")  # type: ignore[attr-defined]
    boom_records = [r for r in failures if r.job_id == job_id]  # type: ignore[attr-defined]
    for record in boom_records:
        assert record.kind == "boom"  # type: ignore[attr-defined]
        assert record.exc_info is not None and isinstance(record.exc_info[1], ValueError)
        assert record.exc_info[2] is not None  # the handler's traceback
    # A Retry the handler raised is no exception to report: the message says it all.
    assert [r.exc_info for r in failures if r.job_id == asked_id] == [None, None]  # type: ignore[attr-defined]


MODULE = "fjsentry"
SOURCE = '''
"""Sentry in a `fastjobs run` app: every event its client sends goes, as JSON, to $FJ_TEST_EVENTS."""

import json
import os

import sentry_sdk
from sentry_sdk.transport import Transport

import fastjobs


class Capture(Transport):
    """No network: each event of an envelope is one line of the file."""

    def capture_envelope(self, envelope):
        with open(os.environ["FJ_TEST_EVENTS"], "a") as out:
            for item in envelope.items:
                if item.type == "event":
                    out.write(json.dumps(item.payload.json, default=str) + "\\n")


sentry_sdk.init(
    dsn="https://public@sentry.invalid/1",
    transport=Capture,
    default_integrations=True,
    auto_session_tracking=False,
    enable_backpressure_handling=False,
)

app = fastjobs.App()


@app.job(kind="boom", queue="reported", max_attempts=2, retry=lambda attempt, rand: 0)
def boom(n):
    raise ValueError(f"boom {n}")
'''


def test_sentry_reports_a_discarded_job_with_its_exception_and_fields(
    masters: procs.Masters, app: App, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events_path = tmp_path / "events.jsonl"
    monkeypatch.setenv("FJ_TEST_EVENTS", str(events_path))
    (tmp_path / f"{MODULE}.py").write_text(textwrap.dedent(SOURCE))
    master = masters.start("--processes", "1", "--queues", "reported", module=MODULE)
    master.wait_stderr(r"leader elected")
    job_id = app.enqueue("boom", {"n": 5}, queue="reported", max_attempts=2)
    master.wait_stderr(rf"job {job_id} \(boom\) attempt 2 failed; discarded")

    def events() -> list[dict[str, Any]]:
        return (
            [json.loads(line) for line in events_path.read_text().splitlines()]
            if events_path.exists()
            else []
        )

    [event] = procs.wait_for(events, f"Sentry's event in {events_path}")
    assert master.stop() == 0, master.stderr()
    assert events() == [event]  # the retried attempt is no event: a breadcrumb of the discarded one's
    assert (event["level"], event["logger"]) == ("error", "fastjobs.handlers")
    assert (
        event["logentry"]["formatted"]
        == f"job {job_id} (boom) attempt 2 failed; discarded: ValueError: boom 5"
    )
    [exception] = event["exception"]["values"]
    assert (exception["type"], exception["value"]) == ("ValueError", "boom 5")
    assert exception["stacktrace"]["frames"][-1]["function"] == "boom"
    extra = event["extra"]
    assert (extra["job_id"], extra["kind"], extra["queue"], extra["attempt"]) == (
        job_id,
        "boom",
        "reported",
        2,
    )
    assert extra["worker"]
    [crumb] = [c for c in event["breadcrumbs"]["values"] if c.get("category") == "fastjobs.handlers"]
    assert crumb["level"] == "warning"
    assert crumb["message"] == f"job {job_id} (boom) attempt 1 failed; retrying in 0s: ValueError: boom 5"
