"""What the commands print: tables, times, sizes, and job input made safe for a terminal."""

from __future__ import annotations

import datetime as dt
import logging
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, TypeVar

__all__ = ["Column", "echo", "iso", "minute", "safe", "size", "table", "when"]

logger = logging.getLogger("fastjobs.cli")


def iso(value: object) -> str:
    return value.isoformat() if isinstance(value, dt.datetime) else str(value)


def minute(at: dt.datetime | None) -> str:
    return "-" if at is None else f"{at:%Y-%m-%d %H:%M}"


# Job input (args, error messages, kinds) must not drive the operator's
# terminal: C0 and C1 controls, ESC and DEL among them, print as \xNN.
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
_CONTROLS_BUT_NEWLINES = {c: text for c, text in _CONTROLS.items() if c not in (0x09, 0x0A)}


def echo(text: str) -> None:
    """A line of the command's output (stdout): what it was asked for, unlike its log on stderr."""
    sys.stdout.write(f"{text}\n")


def safe(text: str, lines: bool = False) -> str:
    """`text` with control characters escaped; with `lines`, newlines and tabs kept."""
    return text.translate(_CONTROLS_BUT_NEWLINES if lines else _CONTROLS)


def when(at: dt.datetime | str) -> str:
    """A run_at for humans; control gives what a datetime cannot hold (infinity, BC) as text."""
    return f"{at:%Y-%m-%d %H:%M:%S}" if isinstance(at, dt.datetime) else at


T = TypeVar("T")


class Column(Generic[T]):
    """A column of a table the command prints: its header, alignment and cell text from a row."""

    __slots__ = ("align", "cell", "header")

    def __init__(self, header: str, cell: Callable[[T], str], align: str = "<") -> None:
        self.header, self.cell, self.align = header, cell, align


def table(columns: Sequence[Column[T]], rows: Iterable[T], indent: str = "") -> None:
    """Print rows under their headers, each column as wide as its widest cell, two spaces apart.

    However wide a value, columns never run together; the last column is not padded.
    """
    cells = [[c.header for c in columns]] + [[c.cell(row) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    for line in cells:
        text = "  ".join(
            f"{cell:{c.align}{width}}" for cell, c, width in zip(line, columns, widths, strict=True)
        )
        echo(indent + text.rstrip())


def size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("kB", "MB", "GB"):
        size /= 1024
        if size < 1024 or unit == "GB":
            break
    return f"{size:,.1f} {unit}"
