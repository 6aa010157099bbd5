"""Cron expressions: five fields (minute hour day-of-month month day-of-week), in UTC.

Each field takes `*`, numbers, ranges `a-b`, lists `a,b` and steps `*/n` or
`a-b/n`; day-of-week is 0-6 from Sunday (7 is Sunday too). As in cron, when
both day fields are restricted a day matching either one is a tick.
"""

from __future__ import annotations

import datetime as dt

from .errors import ConfigurationError

_FIELDS = (
    ("minute", 0, 59),
    ("hour", 0, 23),
    ("day of month", 1, 31),
    ("month", 1, 12),
    ("day of week", 0, 7),
)
# Far enough back to find the last tick of any valid expression (29 February: 8 years).
_SEARCH_DAYS = 366 * 8 + 2


def _number(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _parse_field(text: str, name: str, low: int, high: int) -> frozenset[int]:
    values: set[int] = set()
    for part in text.split(","):
        body, slash, step_text = part.partition("/")
        step = 1
        if slash:
            if not _number(step_text) or int(step_text) < 1:
                raise ConfigurationError(f"cron {name}: bad step in {part!r}")
            step = int(step_text)
        if body == "*":
            start, end = low, high
        else:
            first, dash, last = body.partition("-")
            if not _number(first) or (dash and not _number(last)):
                raise ConfigurationError(f"cron {name}: {part!r} is not a number, range or *")
            start = int(first)
            end = int(last) if dash else (high if slash else start)
        if not low <= start <= end <= high:
            raise ConfigurationError(f"cron {name}: {part!r} is outside {low}-{high}")
        values.update(range(start, end + 1, step))
    return frozenset(values)


class Cron:
    """A cron expression: `latest(now)` is its last tick at or before `now`, `next(now)` the first after."""

    def __init__(self, expression: str) -> None:
        fields = expression.split()
        if len(fields) != 5:
            raise ConfigurationError(f"cron expression {expression!r} must have 5 fields, not {len(fields)}")
        parsed = [_parse_field(text, *spec) for text, spec in zip(fields, _FIELDS, strict=True)]
        self.expression = expression
        self.minutes, self.hours, self.days, self.months, dow = parsed
        self.weekdays = frozenset(d % 7 for d in dow)
        self._any_day = fields[2] == "*"
        self._any_weekday = fields[4] == "*"

    def _day_matches(self, day: dt.date) -> bool:
        if day.month not in self.months:
            return False
        by_month_day = day.day in self.days
        by_weekday = (day.isoweekday() % 7) in self.weekdays
        if self._any_day or self._any_weekday:
            return by_month_day and by_weekday
        return by_month_day or by_weekday

    def latest(self, now: dt.datetime) -> dt.datetime | None:
        """The last tick at or before `now` (UTC), or None if there is none within 8 years."""
        now = now.astimezone(dt.UTC).replace(second=0, microsecond=0)
        day = now.date()
        for back in range(_SEARCH_DAYS):
            if self._day_matches(day):
                hours = [h for h in self.hours if back or h <= now.hour]
                for hour in sorted(hours, reverse=True):
                    minutes = [m for m in self.minutes if back or hour < now.hour or m <= now.minute]
                    if minutes:
                        return dt.datetime(day.year, day.month, day.day, hour, max(minutes), tzinfo=dt.UTC)
            day -= dt.timedelta(days=1)
        return None

    def next(self, now: dt.datetime) -> dt.datetime | None:
        """The first tick after `now` (UTC), or None if there is none within 8 years."""
        start = now.astimezone(dt.UTC).replace(second=0, microsecond=0) + dt.timedelta(minutes=1)
        day = start.date()
        for ahead in range(_SEARCH_DAYS):
            if self._day_matches(day):
                hours = [h for h in self.hours if ahead or h >= start.hour]
                for hour in sorted(hours):
                    minutes = [m for m in self.minutes if ahead or hour > start.hour or m >= start.minute]
                    if minutes:
                        return dt.datetime(day.year, day.month, day.day, hour, min(minutes), tzinfo=dt.UTC)
            day += dt.timedelta(days=1)
        return None

    def __repr__(self) -> str:
        return f"Cron({self.expression!r})"
