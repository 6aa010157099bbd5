"""Cron expressions (fastjobs.cron) and periodic jobs: `periodic_once` with a frozen clock.

A tick is enqueued exactly once across the cluster because `periodic_once`
records it in fastjobs_periodic in the same transaction as the enqueue; the
tests call it from one connection, from several at once, and from a "new
leader" (another connection) at the same frozen tick.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import subprocess
import sys
import threading
from typing import Any

import psycopg
import pytest

from fastjobs import App, ConfigurationError
from fastjobs.cron import Cron
from fastjobs.maintenance import periodic_once, periodic_status
from fastjobs.types import JobSpec

from . import procs
from .helpers import query
from .procs import count, wait_for

UTC = dt.UTC


def at(day: int, hour: int = 0, minute: int = 0, second: int = 0, month: int = 6) -> dt.datetime:
    """A moment of 2030 (1 June 2030 is a Saturday)."""
    return dt.datetime(2030, month, day, hour, minute, second, tzinfo=UTC)


# --- parsing ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "now", "tick"),
    [
        pytest.param("*/15 9-17 1,15,31 1-3,12 1-5", at(3, 12, 7), at(31, 17, 45, month=3), id="fields"),
        pytest.param("5-20/5 * * * *", at(3, 12, 59), at(3, 12, 20), id="range-step"),
        pytest.param("0 9 * JAN MON-FRI", at(3), dt.datetime(2030, 1, 31, 9, tzinfo=UTC), id="names"),
        pytest.param("0 9 * * mon-fri", at(1, 12), at(31, 9, month=5), id="names-any-case"),
        pytest.param("@hourly", at(3, 12, 7), at(3, 12), id="hourly"),
        pytest.param("@daily", at(3, 12, 7), at(3), id="daily"),
        pytest.param("@weekly", at(3, 12, 7), at(2), id="weekly-sunday"),
        pytest.param("@monthly", at(3, 12, 7), at(1), id="monthly"),
        pytest.param("@yearly", at(3), dt.datetime(2030, 1, 1, tzinfo=UTC), id="yearly"),
        pytest.param("@annually", at(3), dt.datetime(2030, 1, 1, tzinfo=UTC), id="annually"),
    ],
)
def test_names_and_shorthands(expression: str, now: dt.datetime, tick: dt.datetime) -> None:
    assert Cron(expression).latest(now) == tick
    assert repr(Cron("0 0 * * *")) == "Cron('0 0 * * *')"


def test_day_of_week_7_is_sunday() -> None:
    sunday = at(2, 0, 0)
    assert Cron("0 0 * * 7").latest(at(5, 12)) == sunday
    assert Cron("0 0 * * 0").latest(at(5, 12)) == sunday
    assert Cron("0 0 * * SUN").latest(at(5, 12)) == sunday


@pytest.mark.parametrize(
    ("expression", "field"),
    [
        ("60 * * * *", "minute"),
        ("* 24 * * *", "hour"),
        ("* * 0 * *", "day-of-month"),
        ("* * 32 * *", "day-of-month"),
        ("* * * 0 *", "month"),
        ("* * * 13 *", "month"),
        ("* * * * 8", "day-of-week"),
        ("*/0 * * * *", "minute"),
        ("*/x * * * *", "minute"),
        ("a * * * *", "minute"),
        ("10-5 * * * *", "minute"),
        ("1,,2 * * * *", "minute"),
        ("-1 * * * *", "minute"),
        ("* * * JANUARY *", "month"),
        ("* * * * MONDAY", "day-of-week"),
    ],
)
def test_a_bad_field_raises_naming_the_field(expression: str, field: str) -> None:
    with pytest.raises(ConfigurationError, match=f"Bad {field}"):
        Cron(expression)


@pytest.mark.parametrize("expression", ["* * * *", "* * * * * *", "", "@fortnightly"])
def test_an_expression_needs_five_fields(expression: str) -> None:
    with pytest.raises(ConfigurationError, match=r"expected 5 fields .*, or one of @yearly"):
        Cron(expression)


@pytest.mark.parametrize("expression", ["5- * * * *", "*/ * * * *", "1-5/ * * * *", "\u0663 * * * *"])
def test_a_dangling_range_or_step_is_refused(expression: str) -> None:
    with pytest.raises(ConfigurationError, match="Bad minute"):
        Cron(expression)


@pytest.mark.parametrize("expression", ["0 0 31 2 *", "0 0 30 2 *", "0 0 31 4,6 *", "0 0 30,31 FEB *"])
def test_an_expression_that_can_never_fire_is_refused(expression: str) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(repr(expression))):
        Cron(expression)


def test_a_time_zone_reads_the_expression_in_local_time() -> None:
    # 9:00 in Paris is 7:00 UTC in summer (CEST), 8:00 in winter (CET).
    assert Cron("0 9 * * *", "Europe/Paris").latest(at(3, 12)) == at(3, 7)
    assert Cron("0 9 * * *", "Europe/Paris").next(at(3, 12, month=12)) == at(4, 8, month=12)
    assert Cron("0 9 * * *", "Europe/Paris").describe() == "0 9 * * * (Europe/Paris)"
    with pytest.raises(ConfigurationError, match="unknown time zone 'Mars/Olympus'"):
        Cron("0 9 * * *", "Mars/Olympus")


def paris(month: int, day: int, hour: int, minute: int = 0, fold: int = 0) -> dt.datetime:
    from zoneinfo import ZoneInfo

    local = dt.datetime(2030, month, day, hour, minute, fold=fold, tzinfo=ZoneInfo("Europe/Paris"))
    return local.astimezone(UTC)


def test_dst_a_fixed_time_the_spring_change_skips_runs_once_right_after_it() -> None:
    # 31 March 2030: Paris clocks go from 02:00 to 03:00; 02:30 does not exist that day.
    cron = Cron("30 2 * * *", "Europe/Paris")
    assert cron.next(paris(3, 30, 12)) == paris(3, 31, 3, 0)
    assert cron.next(paris(3, 31, 3, 0)) == paris(4, 1, 2, 30)
    assert cron.latest(paris(3, 31, 12)) == paris(3, 31, 3, 0)
    # A step in the hour field ticks by the wall clock: none in the skipped hour.
    every = Cron("*/30 * * * *", "Europe/Paris")
    assert every.next(paris(3, 31, 1, 30)) == paris(3, 31, 3, 0)


def test_dst_a_fixed_time_the_autumn_change_repeats_runs_once() -> None:
    # 27 October 2030: Paris clocks go from 03:00 back to 02:00; 02:30 comes twice.
    cron = Cron("30 2 * * *", "Europe/Paris")
    first = paris(10, 27, 2, 30)
    assert cron.next(paris(10, 26, 12)) == first
    assert cron.next(first) == paris(10, 28, 2, 30)
    assert cron.latest(paris(10, 27, 2, 45, fold=1)) == first
    # A wildcard schedule ticks in both of the repeated hours.
    every = Cron("30 * * * *", "Europe/Paris")
    assert every.next(first) == paris(10, 27, 2, 30, fold=1)


def test_without_cronsim_a_cron_schedule_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cronsim", None)  # import cronsim raises ImportError
    with pytest.raises(ConfigurationError, match=re.escape("pip install 'fastjobs[cron]'")):
        App("postgresql://unused").periodic("* * * * *", kind="needs_cronsim")(lambda: None)


# --- Cron.latest -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "now", "tick"),
    [
        pytest.param("* * * * *", at(3, 12, 7, 45), at(3, 12, 7), id="every-minute-drops-seconds"),
        pytest.param("*/5 * * * *", at(3, 12, 7, 30), at(3, 12, 5), id="step"),
        pytest.param("*/5 * * * *", at(3, 12, 5), at(3, 12, 5), id="now-on-a-tick-is-that-tick"),
        pytest.param("30 * * * *", at(3, 12, 7), at(3, 11, 30), id="previous-hour"),
        pytest.param("0 9 * * *", at(3, 8, 59), at(2, 9, 0), id="previous-day"),
        pytest.param("0 9 * * 1-5", at(1, 12), at(31, 9, 0, month=5), id="weekdays-from-saturday"),
        pytest.param("0 0 1 1 *", at(3), dt.datetime(2030, 1, 1, tzinfo=UTC), id="yearly"),
        pytest.param("0 0 29 2 *", at(3), dt.datetime(2028, 2, 29, tzinfo=UTC), id="leap-day"),
        pytest.param("0 0 31 * *", at(3), at(31, month=5), id="skips-short-months"),
        pytest.param(
            "59 23 31 12 *", at(3), dt.datetime(2029, 12, 31, 23, 59, tzinfo=UTC), id="new-year-eve"
        ),
    ],
)
def test_latest_is_the_last_tick_at_or_before_now(
    expression: str, now: dt.datetime, tick: dt.datetime
) -> None:
    assert Cron(expression).latest(now) == tick


def test_both_day_fields_restricted_match_either_one() -> None:
    # The 13th, or any Friday: 7 and 14 June 2030 are Fridays, the 13th a Thursday.
    cron = Cron("0 0 13 * 5")
    assert cron.latest(at(10)) == at(7)
    assert cron.latest(at(13, 12)) == at(13)
    assert cron.latest(at(14, 12)) == at(14)
    assert cron.latest(at(6)) == at(31, month=5)  # a Friday


def test_one_day_field_restricted_is_the_only_condition() -> None:
    assert Cron("0 0 13 * *").latest(at(12)) == at(13, month=5)
    assert Cron("0 0 * * 5").latest(at(12)) == at(7)


def test_latest_converts_to_utc() -> None:
    paris = dt.timezone(dt.timedelta(hours=2))
    # 12:30 in UTC+2 is 10:30 UTC: the last "0 11 * * *" tick is yesterday's.
    now = dt.datetime(2030, 6, 3, 12, 30, tzinfo=paris)
    assert Cron("0 11 * * *").latest(now) == at(2, 11)
    assert Cron("0 10 * * *").latest(now) == at(3, 10)


# --- registering cron jobs -------------------------------------------------------------------


def test_registering_a_cron_job_whose_handler_requires_args_raises_type_error() -> None:
    app = App("postgresql://unused")
    with pytest.raises(TypeError, match="requires"):

        @app.periodic("* * * * *", kind="needs_args")
        def needs_args(user_id: int) -> None: ...

    with pytest.raises(TypeError, match="requires"):

        @app.job("needs_args_too", cron="*/5 * * * *")
        def needs_args_too(user_id: int, limit: int = 1) -> None: ...

    assert app.jobs == {}

    @app.periodic("*/5 * * * *", kind="optional_args")
    def optional_args(limit: int = 10) -> None: ...

    assert app.jobs["optional_args"].cron == "*/5 * * * *"


def test_a_bad_cron_fails_at_registration_naming_the_field() -> None:
    app = App("postgresql://unused")
    with pytest.raises(ConfigurationError, match="Bad hour"):

        @app.periodic("0 25 * * *", kind="bad")
        def bad() -> None: ...

    assert "bad" not in app.jobs
    with pytest.raises(ConfigurationError, match="can never fire"):

        @app.periodic("0 0 31 2 *", kind="never")
        def never() -> None: ...

    with pytest.raises(ConfigurationError, match="unknown time zone"):

        @app.periodic("0 9 * * *", kind="nowhere", tz="Europe/Nowhere")
        def nowhere() -> None: ...

    assert app.jobs == {}


def test_a_periodic_job_in_a_time_zone_ticks_in_it(dsn: str) -> None:
    app = App(dsn)
    app.periodic("0 9 * * MON-FRI", kind="morning", tz="America/New_York")(lambda: None)
    # Monday 3 June 2030, 13:00 UTC is 9:00 in New York (EDT, UTC-4).
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert periodic_once(conn, specs(app), at(3, 13)) == [("morning", at(3, 13))]
        status = periodic_status(conn, specs(app), at(3, 13))
    assert status[0].schedule == "0 9 * * MON-FRI (America/New_York)"
    assert status[0].next_tick == at(4, 13)


# --- periodic_once with a frozen clock -------------------------------------------------------


def cron_app(dsn: str, **kinds: str) -> App:
    app = App(dsn)
    for kind, expression in kinds.items():
        app.periodic(expression, kind=kind)(lambda: None)
    return app


def specs(app: App) -> list[JobSpec]:
    return [spec for spec in app.jobs.values() if spec.cron]


def periodic_jobs(dsn: str) -> list[tuple[str, str, str | None]]:
    """(kind, queue, unique_key) of every job, oldest first."""
    rows = query(dsn, "SELECT kind, queue, unique_key FROM fastjobs_jobs_all ORDER BY id")
    return [(r["kind"], r["queue"], r["unique_key"]) for r in rows]


def test_each_tick_is_enqueued_once(dsn: str) -> None:
    app = cron_app(dsn, five="*/5 * * * *")
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert periodic_once(conn, specs(app), at(3, 12, 5, 20)) == [("five", at(3, 12, 5))]
        assert periodic_once(conn, specs(app), at(3, 12, 5, 20)) == []  # the same tick again
        assert periodic_once(conn, specs(app), at(3, 12, 9, 59)) == []  # still the 12:05 tick
        assert periodic_once(conn, specs(app), at(3, 12, 10)) == [("five", at(3, 12, 10))]
        assert periodic_once(conn, specs(app), at(3, 12, 10, 1)) == []
    assert periodic_jobs(dsn) == [
        ("five", "default", "periodic:five:2030-06-03T12:05:00+00:00"),
        ("five", "default", "periodic:five:2030-06-03T12:10:00+00:00"),
    ]
    assert query(dsn, "SELECT kind, last_tick FROM fastjobs_periodic") == [
        {"kind": "five", "last_tick": at(3, 12, 10)}
    ]


def test_each_kind_has_its_own_ticks_and_queue(dsn: str) -> None:
    app = App(dsn)
    app.periodic("* * * * *", kind="minutely", queue="cron")(lambda: None)
    app.periodic("0 * * * *", kind="hourly", priority=5)(lambda: None)
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert periodic_once(conn, specs(app), at(3, 12, 0, 30)) == [
            ("minutely", at(3, 12, 0)),
            ("hourly", at(3, 12, 0)),
        ]
        assert periodic_once(conn, specs(app), at(3, 12, 1, 30)) == [("minutely", at(3, 12, 1))]
    rows = query(dsn, "SELECT kind, queue, priority, state::text, args FROM fastjobs_jobs_all ORDER BY id")
    assert [(r["kind"], r["queue"], r["priority"], r["state"], r["args"]) for r in rows] == [
        ("minutely", "cron", 0, "available", {}),
        ("hourly", "default", 5, "available", {}),
        ("minutely", "cron", 0, "available", {}),
    ]


def test_first_sight_of_a_tick_older_than_a_minute_is_not_enqueued(dsn: str) -> None:
    app = cron_app(dsn, five="*/5 * * * *")
    with psycopg.connect(dsn, autocommit=True) as conn:
        # Deployed at 12:07:30: the 12:05 tick is 2.5 minutes old, too late to run.
        assert periodic_once(conn, specs(app), at(3, 12, 7, 30)) == []
        assert periodic_jobs(dsn) == []
        # ... but the next one runs.
        assert periodic_once(conn, specs(app), at(3, 12, 10, 5)) == [("five", at(3, 12, 10))]
    assert len(periodic_jobs(dsn)) == 1


def test_first_sight_within_a_minute_of_the_tick_is_enqueued(dsn: str) -> None:
    app = cron_app(dsn, five="*/5 * * * *")
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert periodic_once(conn, specs(app), at(3, 12, 5, 59)) == [("five", at(3, 12, 5))]


def test_after_downtime_only_the_latest_tick_is_caught_up(dsn: str) -> None:
    app = cron_app(dsn, five="*/5 * * * *")
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert periodic_once(conn, specs(app), at(3, 12, 5)) == [("five", at(3, 12, 5))]
        # No leader for an hour: eleven ticks missed, one caught up, however old.
        assert periodic_once(conn, specs(app), at(3, 13, 3)) == [("five", at(3, 13, 0))]
        assert periodic_once(conn, specs(app), at(3, 13, 4)) == []
    assert len(periodic_jobs(dsn)) == 2


def test_a_new_leader_does_not_enqueue_a_tick_again(dsn: str) -> None:
    app = cron_app(dsn, five="*/5 * * * *")
    with psycopg.connect(dsn, autocommit=True) as old:
        assert periodic_once(old, specs(app), at(3, 12, 5, 1)) == [("five", at(3, 12, 5))]
    # The new leader is another process: another connection, another App.
    heir = cron_app(dsn, five="*/5 * * * *")
    with psycopg.connect(dsn, autocommit=True) as new:
        assert periodic_once(new, specs(heir), at(3, 12, 5, 40)) == []
        assert periodic_once(new, specs(heir), at(3, 12, 10, 0)) == [("five", at(3, 12, 10))]
    assert len(periodic_jobs(dsn)) == 2


def test_the_tick_and_its_job_commit_or_roll_back_together(dsn: str) -> None:
    app = cron_app(dsn, five="*/5 * * * *")
    with psycopg.connect(dsn) as conn:
        conn.execute("SELECT 1")  # inside a transaction that is then rolled back
        assert periodic_once(conn, specs(app), at(3, 12, 5, 1)) == [("five", at(3, 12, 5))]
        conn.rollback()
    assert query(dsn, "SELECT * FROM fastjobs_periodic") == []
    assert periodic_jobs(dsn) == []
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert periodic_once(conn, specs(app), at(3, 12, 5, 2)) == [("five", at(3, 12, 5))]
    assert len(periodic_jobs(dsn)) == 1


@pytest.mark.parametrize("contenders", [2, 8])
def test_concurrent_leaders_at_the_same_tick_enqueue_it_once(dsn: str, contenders: int) -> None:
    """Leaders on separate connections race for each of 20 ticks, released together by a barrier."""
    app = cron_app(dsn, every="* * * * *", other="*/2 * * * *")
    ticks = [at(3, 12, m, 1) for m in range(20)]
    barrier = threading.Barrier(contenders)
    results: list[list[Any]] = [[] for _ in range(contenders)]
    errors: list[BaseException] = []

    def contend(index: int) -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                for now in ticks:
                    barrier.wait(10)
                    results[index].extend(periodic_once(conn, specs(app), now))
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(contenders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    enqueued = sorted(item for result in results for item in result)
    expected = sorted(
        [("every", now.replace(second=0)) for now in ticks]
        + [("other", now.replace(second=0)) for now in ticks if now.minute % 2 == 0]
    )
    assert enqueued == expected  # each tick once, by whichever leader got there first
    rows = periodic_jobs(dsn)
    assert len(rows) == len(expected)
    assert len({key for _, _, key in rows}) == len(rows)


# --- Cron.next -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "now", "tick"),
    [
        pytest.param("*/5 * * * *", at(3, 12, 7, 30), at(3, 12, 10), id="step"),
        pytest.param("*/5 * * * *", at(3, 12, 5), at(3, 12, 10), id="now-on-a-tick-is-after-it"),
        pytest.param("0 3 * * *", at(3, 3, 0, 1), at(4, 3), id="tomorrow"),
        pytest.param("59 23 * * *", at(30, 23, 59), at(1, 23, 59, month=7), id="next-month"),
        pytest.param("0 9 * * 1-5", at(1, 12), at(3, 9), id="weekdays-from-saturday"),
        pytest.param("0 0 29 2 *", at(3), dt.datetime(2032, 2, 29, tzinfo=UTC), id="leap-day"),
        pytest.param("0 0 13 * 5", at(7, 1), at(13), id="either-day-field"),
    ],
)
def test_next_is_the_first_tick_after_now(expression: str, now: dt.datetime, tick: dt.datetime) -> None:
    assert Cron(expression).next(now) == tick
    assert Cron(expression).latest(tick) == tick


# --- the missed-tick rule --------------------------------------------------------------------


def recorded(dsn: str) -> dict[str, dt.datetime]:
    return {r["kind"]: r["last_tick"] for r in query(dsn, "SELECT kind, last_tick FROM fastjobs_periodic")}


def test_a_tick_past_at_first_sight_is_not_recorded_as_done(dsn: str) -> None:
    app = cron_app(dsn, nightly="0 3 * * *")
    with psycopg.connect(dsn, autocommit=True) as conn:
        # First seen at 09:00:30: the 03:00 tick was before any leader knew the job.
        assert periodic_once(conn, specs(app), at(3, 9, 0, 30)) == []
        assert recorded(dsn) == {"nightly": at(3, 9, 0, 30)}  # when it was seen, not "03:00 done"
        [status] = periodic_status(conn, specs(app), at(3, 9, 1))
        assert (status.last_tick, status.first_seen, status.next_tick) == (None, at(3, 9, 0, 30), at(4, 3))
        assert periodic_once(conn, specs(app), at(3, 23, 59)) == []
        assert periodic_once(conn, specs(app), at(4, 3, 0, 2)) == [("nightly", at(4, 3))]
        [status] = periodic_status(conn, specs(app), at(4, 3, 1))
        assert (status.last_tick, status.first_seen, status.next_tick) == (at(4, 3), None, at(5, 3))
    assert periodic_jobs(dsn) == [("nightly", "default", "periodic:nightly:2030-06-04T03:00:00+00:00")]


def test_first_sight_on_a_whole_minute_is_not_taken_for_a_tick(dsn: str) -> None:
    app = cron_app(dsn, nightly="0 3 * * *")
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert periodic_once(conn, specs(app), at(3, 9)) == []
        [status] = periodic_status(conn, specs(app), at(3, 9))
    assert status.last_tick is None and status.first_seen is not None
    assert dt.timedelta(0) < status.first_seen - at(3, 9) < dt.timedelta(milliseconds=1)


def test_a_leader_absent_over_ticks_runs_the_latest_once_when_back(dsn: str) -> None:
    """No leader from 02:00 on the 3rd to 09:00 on the 5th: the database says the 2nd's tick ran."""
    app = cron_app(dsn, nightly="0 3 * * *")
    query(dsn, "INSERT INTO fastjobs_periodic (kind, last_tick) VALUES ('nightly', %s)", (at(2, 3),))
    with psycopg.connect(dsn, autocommit=True) as conn:
        # Two nightly ticks missed (the 3rd's, the 4th's... and the 5th's at 03:00): one job, for the latest.
        assert periodic_once(conn, specs(app), at(5, 9)) == [("nightly", at(5, 3))]
        assert periodic_once(conn, specs(app), at(5, 9, 0, 1)) == []
        assert periodic_once(conn, specs(app), at(6, 3, 0, 5)) == [("nightly", at(6, 3))]
    assert [key for _, _, key in periodic_jobs(dsn)] == [
        "periodic:nightly:2030-06-05T03:00:00+00:00",
        "periodic:nightly:2030-06-06T03:00:00+00:00",
    ]


def test_a_kind_seen_late_then_missed_while_no_leader_ran_is_caught_up(dsn: str) -> None:
    app = cron_app(dsn, five="*/5 * * * *")
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert periodic_once(conn, specs(app), at(3, 12, 7, 30)) == []  # seen late: 12:05 is not run
        # No leader from 12:08 to 12:31: 12:10 ... 12:30 missed, 12:30 caught up.
        assert periodic_once(conn, specs(app), at(3, 12, 31, 40)) == [("five", at(3, 12, 30))]
    assert len(periodic_jobs(dsn)) == 1


# --- `fastjobs periodic list|run`, as real processes beside a real master -------------------

CRON_JOBS = '''
"""Periodic jobs for the CLI tests: each run is a row of `runs` (n: -1 nightly, -2 yearly)."""

from fjjobs import _record, app


@app.periodic("0 3 * * *", kind="nightly", queue="cron")
def nightly():
    _record(-1)


@app.periodic("0 0 1 1 *", kind="yearly")
def yearly():
    _record(-2)
'''


def periodic_cli(masters: procs.Masters, *args: str) -> subprocess.CompletedProcess[str]:
    """`fastjobs --dsn DSN periodic ARGS` in the directory of the jobs modules."""
    return subprocess.run(
        [sys.executable, "-m", "fastjobs.cli", "--dsn", masters.dsn, "periodic", *args],
        cwd=masters.cwd,
        capture_output=True,
        text=True,
        timeout=procs.DEADLINE,
        check=False,
    )


def test_periodic_list_and_run_beside_a_leader_that_was_absent_over_ticks(
    masters: procs.Masters, db: psycopg.Connection[Any]
) -> None:
    (masters.cwd / "fjcron.py").write_text(CRON_JOBS)
    before = periodic_cli(masters, "list", "fjcron", "--json")
    assert before.returncode == 0, before.stderr
    assert [
        (p["kind"], p["queue"], p["schedule"], p["last_tick"], p["first_seen"])
        for p in json.loads(before.stdout)
    ] == [
        ("nightly", "cron", "0 3 * * *", None, None),
        ("yearly", "default", "0 0 1 1 *", None, None),
    ]
    # The database says a leader ran the nightly job three days ago, and none has run since.
    db.execute(
        "INSERT INTO fastjobs_periodic (kind, last_tick)"
        " VALUES ('nightly', date_trunc('day', now()) - interval '3 days' + interval '3 hours')"
    )
    master = masters.start("--processes", "1", module="fjcron")
    wait_for(lambda: count(db, "SELECT count(*) FROM runs WHERE n = -1") >= 1, "the missed nightly tick")
    wait_for(lambda: count(db, "SELECT count(*) FROM fastjobs_periodic") == 2, "the leader to see both kinds")
    now = db.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
    latest = Cron("0 3 * * *").latest(now)
    assert latest is not None

    listed = periodic_cli(masters, "list", "fjcron", "--json")
    assert listed.returncode == 0, listed.stderr
    nightly, yearly = json.loads(listed.stdout)
    assert (nightly["last_tick"], nightly["first_seen"]) == (latest.isoformat(), None)
    assert nightly["next_tick"] == (latest + dt.timedelta(days=1)).isoformat()
    assert yearly["last_tick"] is None and yearly["first_seen"] is not None  # seen late: not run
    assert yearly["next_tick"] == dt.datetime(now.year + 1, 1, 1, tzinfo=UTC).isoformat()
    human = periodic_cli(masters, "list", "fjcron")
    assert human.returncode == 0, human.stderr
    header, *rows = human.stdout.splitlines()
    assert re.fullmatch(r"kind +queue +schedule +last tick \(UTC\) +next tick \(UTC\)", header), header
    assert re.fullmatch(rf"nightly +cron +0 3 \* \* \* +{latest:%Y-%m-%d %H:%M} +\S+ 03:00", rows[0]), rows
    assert re.fullmatch(
        r"yearly +default +0 0 1 1 \* +none \(first seen [\d-]+ [\d:]+\) +\d{4}-01-01 00:00", rows[1]
    )

    ran = periodic_cli(masters, "run", "fjcron", "yearly")
    assert ran.returncode == 0, ran.stderr
    match = re.fullmatch(
        r"job (\d+): yearly enqueued on queue default; its schedule is as it was\n", ran.stdout
    )
    assert match, ran.stdout
    wait_for(lambda: count(db, "SELECT count(*) FROM runs WHERE n = -2") == 1, "the yearly job run now")
    assert (
        json.loads(periodic_cli(masters, "list", "fjcron", "--json").stdout)[1] == yearly
    )  # schedule as it was
    for kind in ("record", "nope"):
        refused = periodic_cli(masters, "run", "fjcron", kind)
        assert (refused.returncode, refused.stdout) == (1, "")
        assert refused.stderr == (
            f"fastjobs: {kind!r} is not a periodic job of fjcron (its periodic jobs: nightly, yearly)\n"
        )
    assert master.stop() == 0, master.stderr()
    # Three nightly ticks were missed while no leader ran: one job, for the latest, ran once.
    assert count(db, "SELECT count(*) FROM runs WHERE n = -1") == 1
