"""The `fastjobs` command's log output: one handler on the "fastjobs" logger, as text or JSON lines.

The library configures no handler (a NullHandler in `fastjobs/__init__.py`):
an application embedding fastjobs sees its records only once it configures
logging. Every module logs on its own logger (`logging.getLogger(__name__)`);
records about one job carry JOB_FIELDS as attributes (`extra=`), which the
JSON format writes out.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import sys
from collections.abc import Iterator
from typing import Any

__all__ = [
    "FORMATS",
    "JOB_FIELDS",
    "LEVELS",
    "TEXT_FORMAT",
    "JsonFormatter",
    "TextFormatter",
    "configured",
    "duration",
    "job_fields",
    "plural",
]

FORMATS = ("text", "json")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
TEXT_FORMAT = "fastjobs: %(message)s"


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """`count` and `noun`, in the plural unless one: "1 job kind", "2 job kinds"."""
    return f"{count:,} {noun if count == 1 else nouns or noun + 's'}"


def duration(seconds: float) -> str:
    """A delay for people: "350ms", "1.1s", "45s", "2m 5s", "3h 20m", "2d 4h" (rounded, two units at most)."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(seconds * 1000, 1):.0f}ms"
    if seconds < 10:
        return f"{seconds:.1f}".removesuffix(".0") + "s"
    whole = round(seconds)
    for unit, size, small, small_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60), ("m", 60, "s", 1)):
        if whole >= size:
            big, rest = divmod(whole, size)
            rest //= small_size
            return f"{big}{unit} {rest}{small}" if rest else f"{big}{unit}"
    return f"{whole}s"


# The structured fields of a record about one job (None where the record does not know one).
JOB_FIELDS = ("job_id", "kind", "queue", "attempt", "worker")

# Attributes every LogRecord has: anything else on a record came from `extra=`.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def job_fields(
    job_id: int | None,
    kind: str | None = None,
    queue: str | None = None,
    attempt: int | None = None,
    worker: str | None = None,
) -> dict[str, Any]:
    """The `extra=` of a record about one job: every JOB_FIELDS key, None where unknown."""
    return {"job_id": job_id, "kind": kind, "queue": queue, "attempt": attempt, "worker": worker}


class TextFormatter(logging.Formatter):
    """TEXT_FORMAT, a record about one job on one line: the traceback of a failed attempt
    is in the job's errors (`fastjobs jobs ID`) and in the JSON format's `exc`."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        if getattr(record, "job_id", None) is None:
            return super().format(record)
        record.message = record.getMessage()
        return self.formatMessage(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, the record's extra fields, exc."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(timespec="microseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in doc:
                doc[key] = value
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str, ensure_ascii=False)


@contextlib.contextmanager
def configured(level: str = "INFO", fmt: str = "text") -> Iterator[None]:
    """Within: the "fastjobs" logger's records at `level` and above go to stderr, as `fmt` (text or json).

    The command's own handler, and only while the command runs: `main()`
    called in-process (an application's script, the tests) leaves logging as
    it found it. Forked children (workers, leader, metrics, releasers) inherit
    the handler and never return here; a StreamHandler flushes every record,
    so nothing is lost to their os._exit.
    """
    logger = logging.getLogger("fastjobs")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(level)
    # The command's records go to its handler once, whatever the application's module does to the root.
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]
