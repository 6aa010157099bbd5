"""Cron schedules: a cron expression read in a time zone (UTC unless told), its last and next ticks.

The expression is cronsim's (the `cron` extra), which reads cron as
Debian's cron does: five fields (minute hour day-of-month month
day-of-week), names (`JAN`, `MON-FRI`), `L` and `#`, and the usual rule
that when both day fields are restricted a day matching either is a tick.
fastjobs adds the `@hourly`-style shorthands. cronsim is imported lazily:
an application without periodic jobs needs nothing beyond the core.

Daylight saving time follows Debian's cron as well (README, Periodic jobs):
a tick at a fixed wall time that the spring change skips (02:30) runs once,
at the first minute after the jump (03:00); one that the autumn change
repeats runs once, at its first occurrence. Schedules with a wildcard or
step in the minute or hour fields (`*/15 * * * *`) tick by the wall clock
both times: none in the skipped hour, each in the repeated one.
"""

from __future__ import annotations

import datetime as dt
import functools
import re
import zoneinfo
from typing import Any

from .errors import ConfigurationError

__all__ = ["MISSING", "SHORTHANDS", "Cron", "schedule"]

# Vixie cron's shorthands (cronsim reads the five fields only).
SHORTHANDS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}

MISSING = (
    "cron schedules need the cronsim package, which fastjobs does not install by itself:"
    " pip install 'fastjobs[cron]'"
)


def _cronsim() -> Any:
    try:
        import cronsim
    except ImportError:
        raise ConfigurationError(MISSING) from None
    return cronsim


def _zone(tz: str | None) -> dt.tzinfo:
    if tz is None:
        return dt.UTC
    if not isinstance(tz, str) or not tz:
        raise ConfigurationError(f"tz must be an IANA time zone name such as 'Europe/Paris', not {tz!r}")
    try:
        return zoneinfo.ZoneInfo(tz)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise ConfigurationError(
            f"unknown time zone {tz!r}: give an IANA name such as 'Europe/Paris' or 'America/New_York'"
            " (the tzdata package provides them where the system has none)"
        ) from None


def _days_in_range(field: str) -> bool:
    """Whether every number of a day-of-month field is a day of some month (1-31)."""
    numbers = re.findall(r"\d+", field)
    return bool(numbers) and all(1 <= int(n) <= 31 for n in numbers)


class Cron:
    """A cron expression in a time zone: `latest(now)` is its last tick at or before `now`,
    `next(now)` the first after, both in UTC (None: none within 50 years)."""

    def __init__(self, expression: str, tz: str | None = None) -> None:
        if not isinstance(expression, str):
            raise ConfigurationError(f"a cron expression is a string, not {expression!r}")
        self.expression = expression
        self.tz = tz
        self.zone = _zone(tz)
        self._fields = SHORTHANDS.get(expression.strip().lower(), expression)
        cronsim = _cronsim()
        fields = self._fields.split()
        try:
            if len(fields) != 5:  # cronsim would take a sixth, seconds, field: ticks are minutes here
                raise cronsim.CronSimError("Wrong number of fields")
            ticks = cronsim.CronSim(self._fields, dt.datetime(2000, 1, 1, tzinfo=self.zone))
        except cronsim.CronSimError as exc:
            if str(exc) == "Bad day-of-month" and _days_in_range(fields[2]):  # 31 February
                raise ConfigurationError(
                    f"cron expression {expression!r} can never fire: no month it names has those days"
                ) from None
            expected = "5 fields (minute hour day-of-month month day-of-week)"
            raise ConfigurationError(
                f"cron expression {expression!r}: {exc}; expected {expected}, or one of"
                f" {', '.join(SHORTHANDS)}"
            ) from None
        # cronsim refuses a day no month has (31 April); what can still never come (29 February on a
        # weekday it never falls on, with L or #) is caught by looking for one tick.
        if next(ticks, None) is None:
            raise ConfigurationError(f"cron expression {expression!r} can never fire")

    def _first(self, start: dt.datetime, reverse: bool) -> dt.datetime | None:
        tick = next(self._ticks(start, reverse), None)
        return None if tick is None else tick.astimezone(dt.UTC)

    def _ticks(self, start: dt.datetime, reverse: bool) -> Any:
        return _cronsim().CronSim(self._fields, start.astimezone(self.zone), reverse=reverse)

    def latest(self, now: dt.datetime) -> dt.datetime | None:
        """The last tick at or before `now`, in UTC."""
        # cronsim's reverse search starts strictly before its start: one minute past `now`'s.
        start = now.astimezone(dt.UTC).replace(second=0, microsecond=0) + dt.timedelta(minutes=1)
        return self._first(start, reverse=True)

    def next(self, now: dt.datetime) -> dt.datetime | None:
        """The first tick after `now`, in UTC."""
        return self._first(now.astimezone(dt.UTC), reverse=False)

    def describe(self) -> str:
        """The expression, and its time zone when it is not UTC."""
        return self.expression if self.tz is None else f"{self.expression} ({self.tz})"

    def __repr__(self) -> str:
        return f"Cron({self.expression!r})" if self.tz is None else f"Cron({self.expression!r}, {self.tz!r})"


@functools.lru_cache(maxsize=256)
def schedule(expression: str, tz: str | None = None) -> Cron:
    """The Cron of `expression` in `tz`, parsed once (the leader asks every second)."""
    return Cron(expression, tz)
