"""Typed arguments: annotations checked at enqueue, the annotated types handed over, call sites typed."""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import enum
import functools
import importlib
import uuid
import zoneinfo
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, NewType, NotRequired, TypedDict

import msgspec
import psycopg
import pydantic
import pytest

from fastjobs import App, bulk, typed
from fastjobs.errors import InvalidArguments

from .helpers import by_state, drain, insert_raw, jobs


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


@dataclasses.dataclass
class Address:
    street: str
    zip: str


@dataclasses.dataclass
class User:
    name: str
    address: Address
    tags: list[str] = dataclasses.field(default_factory=list)
    since: dt.date | None = None


@dataclasses.dataclass
class Tree:
    """A record that refers to itself."""

    label: str
    children: list[Tree] = dataclasses.field(default_factory=list)
    first: tuple[Tree, int] | None = None


class Point(TypedDict):
    x: int
    y: int
    at: NotRequired[dt.datetime]


class Order(msgspec.Struct):
    id: uuid.UUID
    total: decimal.Decimal
    placed: dt.datetime


class Invoice(pydantic.BaseModel):
    number: int
    due: dt.date
    lines: list[str] = []


UserId = NewType("UserId", int)

PARIS = zoneinfo.ZoneInfo("Europe/Paris")
NOW = dt.datetime(2026, 3, 1, 12, 30, 15, 123456, tzinfo=dt.UTC)

# (annotation, value): each must reach a handler annotated so as an equal value of the same type.
ROUND_TRIP: list[tuple[Any, Any]] = [
    (int, 7),
    (float, 2.5),
    (float, 3),  # an int where a float is expected arrives as a float
    (str, "héllo"),
    (bool, True),
    (None, None),
    (list[int], [1, 2, 3]),
    (dict[str, list[float]], {"a": [1.5]}),
    (Literal["a", "b"], "b"),
    (Literal[Color.RED], Color.RED),
    (int | None, None),
    (int | str, "x"),
    (Color, Color.BLUE),
    (Level, Level.HIGH),
    (dt.datetime, NOW),
    (dt.datetime, dt.datetime(2026, 7, 1, 9, 0, tzinfo=PARIS)),  # the offset kept (the zone is not)
    (dt.date, dt.date(2026, 2, 28)),
    (uuid.UUID, uuid.UUID("12345678-1234-5678-1234-567812345678")),
    (decimal.Decimal, decimal.Decimal("12.30")),
    (tuple[int, str], (1, "a")),
    (tuple[dt.date, ...], (dt.date(2026, 1, 1), dt.date(2026, 1, 2))),
    (set[int], {1, 2}),
    (User, User("ann", Address("1 Main St", "02134"), ["a"], dt.date(2020, 5, 17))),
    (Tree, Tree("root", [Tree("leaf")], (Tree("first"), 1))),
    (Point, {"x": 1, "y": 2, "at": NOW}),
    (list[User], [User("bob", Address("2 Side St", "10001"))]),
    (dict[str, Color], {"fg": Color.RED}),
    (UserId, UserId(5)),
    (Any, {"anything": [1, None]}),
    (Order, Order(uuid.UUID(int=1), decimal.Decimal("9.99"), NOW)),
    (Invoice, Invoice(number=3, due=dt.date(2026, 4, 1), lines=["x"])),
]


def _annotated(app: App, kind: str, hint: Any, seen: dict[str, list[Any]], is_async: bool = False) -> Any:
    """A handler of `value: hint` that records what it receives."""
    seen[kind] = []

    if is_async:

        async def handler_async(value: Any) -> None:
            seen[kind].append(value)

        handler: Any = handler_async
    else:

        def handler_sync(value: Any) -> None:
            seen[kind].append(value)

        handler = handler_sync
    handler.__annotations__ = {"value": hint, "return": None}
    return app.job(kind=kind)(handler)


def _same(received: Any, sent: Any) -> bool:
    """Equal, and of the same types all the way down (1.0 == 1 and True == 1 are not enough)."""
    if type(received) is not type(sent) and not (type(sent) is int and type(received) is float):
        return False
    if isinstance(sent, dict):
        return sent.keys() == received.keys() and all(_same(received[k], sent[k]) for k in sent)
    if isinstance(sent, list | tuple):
        return len(sent) == len(received) and all(_same(r, s) for r, s in zip(received, sent, strict=True))
    if dataclasses.is_dataclass(sent):
        return all(_same(getattr(received, f.name), getattr(sent, f.name)) for f in dataclasses.fields(sent))
    if isinstance(sent, dt.datetime):
        return bool(received == sent and received.utcoffset() == sent.utcoffset())
    return bool(received == sent)


def test_each_supported_type_reaches_the_handler_as_itself(app: App, dsn):
    seen: dict[str, list[Any]] = {}
    for i, (hint, value) in enumerate(ROUND_TRIP):
        job = _annotated(app, f"typed.{i}", hint, seen, is_async=i % 5 == 0)
        job.enqueue(value=value)
        job.enqueue_many([{"value": value}])  # COPY: the same conversion
    drain(app)

    assert by_state(dsn) == {}  # every job completed
    for i, (hint, value) in enumerate(ROUND_TRIP):
        received = seen[f"typed.{i}"]
        assert len(received) == 2, hint
        assert all(_same(r, value) for r in received), (hint, received, value)


def test_the_json_form_of_each_rich_type_is_stored(app: App, dsn):
    @app.job(kind="stored")
    def stored(
        when: dt.datetime, day: dt.date, ref: uuid.UUID, amount: decimal.Decimal, user: User
    ) -> None: ...

    stored.enqueue(
        when=dt.datetime(2026, 7, 1, 9, 0, tzinfo=PARIS),
        day=dt.date(2026, 1, 2),
        ref=uuid.UUID(int=255),
        amount=decimal.Decimal("0.10"),
        user=User("ann", Address("x", "1")),
    )
    [row] = jobs(dsn)
    assert row["args"] == {
        "when": "2026-07-01T09:00:00+02:00",
        "day": "2026-01-02",
        "ref": "00000000-0000-0000-0000-0000000000ff",
        "amount": "0.10",
        "user": {"name": "ann", "address": {"street": "x", "zip": "1"}, "tags": [], "since": None},
    }


def send(user: User, when: dt.datetime, priority: Literal["low", "high"] = "low") -> None:
    """A handler at module level: its kind is tests.test_typed.send."""


KIND = "tests.test_typed.send"
USER = User("ann", Address("1 Main St", "02134"))

# (arguments, error class, message): each refused at enqueue, naming the kind, the argument and the path.
BAD: list[tuple[dict[str, Any], type[Exception], str]] = [
    (
        {"user": User("ann", Address("1 Main St", 2134)), "when": NOW},  # type: ignore[arg-type]
        TypeError,
        f"{KIND}: argument 'user.address.zip' must be str, not int",
    ),
    (
        {"user": {"name": "ann"}, "when": NOW},
        TypeError,
        f"{KIND}: argument 'user' must be User (a dataclass), not dict",
    ),
    (
        {"user": User("ann", Address("x", "1"), ["ok", 3]), "when": NOW},  # type: ignore[list-item]
        TypeError,
        f"{KIND}: argument 'user.tags[1]' must be str, not int",
    ),
    (
        {"user": USER, "when": dt.datetime(2026, 1, 1)},
        ValueError,
        f"{KIND}: argument 'when' must carry a timezone (a naive datetime is ambiguous)",
    ),
    (
        {"user": USER, "when": "2026-01-01T00:00:00Z"},
        TypeError,
        f"{KIND}: argument 'when' must be datetime, not str",
    ),
    (
        {"user": USER, "when": NOW, "priority": "urgent"},
        ValueError,
        f"{KIND}: argument 'priority' must be one of 'low', 'high', not 'urgent'",
    ),
]


@pytest.mark.parametrize(("args", "error", "message"), BAD, ids=[m.split(": ", 1)[1][:40] for _, _, m in BAD])
def test_bad_arguments_are_refused_naming_the_kind_argument_and_path(app: App, dsn, args, error, message):
    job = app.job()(send)
    with pytest.raises(error) as single:
        job.enqueue(**args)
    assert str(single.value) == message
    with pytest.raises(error) as by_kind:
        app.enqueue(KIND, args)
    assert str(by_kind.value) == message
    with pytest.raises(error) as bulk:
        job.enqueue_many([{"user": USER, "when": NOW}, args])
    assert str(bulk.value) == message.replace(": argument", ": row 1: argument", 1)
    assert jobs(dsn) == []


@pytest.mark.parametrize(
    ("hint", "value", "error", "detail"),
    [
        (int, True, TypeError, "must be int, not bool"),
        (bool, 1, TypeError, "must be bool, not int"),
        (float, float("nan"), ValueError, "must be a finite float (JSON has no NaN or infinity), not nan"),
        (None, 0, TypeError, "must be None, not int"),
        (list[int], (1, 2), TypeError, "must be list, not tuple"),
        (dict[str, int], {1: 2}, TypeError, "keys must be str, not int (1)"),
        (dict[str, int], {"a": {"b": 1}}, TypeError, "'value.a' must be int, not dict"),
        (int | str, 1.5, TypeError, "must be int | str, not float"),
        (Color, "red", TypeError, "must be Color (an enum), not str"),
        (dt.date, NOW, TypeError, "must be date, not datetime"),
        (uuid.UUID, "x", TypeError, "must be UUID, not str"),
        (decimal.Decimal, 1.5, TypeError, "must be Decimal, not float"),
        (tuple[int, int], (1,), ValueError, "must have 2 items, not 1"),
        (Point, {"x": 1}, TypeError, "lacks required field(s) 'y' of Point (a TypedDict)"),
        (Point, {"x": 1, "y": 2, "z": 3}, TypeError, "has no field 'z' (Point (a TypedDict) has x, y, at)"),
        (Point, {"x": 1, "y": "2"}, TypeError, "'value.y' must be int, not str"),
        (
            Order,
            Order(uuid.UUID(int=1), decimal.Decimal(1), "yesterday"),  # type: ignore[arg-type]
            ValueError,
            "'value.placed' is no valid Order: Invalid RFC3339 encoded datetime",
        ),
        (
            Invoice,
            Invoice.model_construct(number="x", due=NOW.date()),
            ValueError,
            "is no valid Invoice: Input should be",
        ),
    ],
)
def test_each_kind_of_mismatch_has_its_message(app: App, dsn, hint, value, error, detail):
    job = _annotated(app, "mismatch", hint, {})
    with pytest.raises(error, match=r"^mismatch: argument 'value") as raised:
        job.enqueue(value=value)
    assert detail in str(raised.value)
    assert jobs(dsn) == []


def test_a_pydantic_error_names_the_path_inside_the_model(app: App):
    job = _annotated(app, "invoice", list[Invoice], {})
    bad = Invoice.model_construct(number=1, due=NOW.date(), lines=["ok", 2])
    with pytest.raises(ValueError, match=r"^invoice: argument 'value\[0\]\.lines\[1\]' is no valid Invoice"):
        job.enqueue(value=[bad])


def test_a_msgspec_error_names_the_path_inside_the_struct(app: App):
    job = _annotated(app, "order", dict[str, Order], {})
    with pytest.raises(ValueError, match=r"^order: argument 'value\.a\.total' is no valid Order"):
        job.enqueue(value={"a": Order(uuid.UUID(int=1), "total", NOW)})  # type: ignore[arg-type]


def test_a_bulk_enqueue_is_all_or_nothing_and_names_the_row(app: App, dsn):
    job = app.job()(send)
    rows = [{"user": USER, "when": NOW}] * (bulk.COPY_CHUNK + 10)
    rows[bulk.COPY_CHUNK + 5] = {"user": USER, "when": NOW.replace(tzinfo=None)}  # past the first chunk
    with pytest.raises(ValueError, match=rf"^{KIND}: row {bulk.COPY_CHUNK + 5}: argument 'when' must carry"):
        job.enqueue_many(rows)
    assert jobs(dsn) == []
    with psycopg.connect(dsn) as conn:  # in the caller's transaction, which stays usable
        job.using(conn).enqueue(user=USER, when=NOW)
        with pytest.raises(TypeError, match="row 1: argument 'when' must be datetime, not date"):
            job.using(conn).enqueue_many(
                iter([{"user": USER, "when": NOW}, {"user": USER, "when": dt.date(2026, 1, 1)}])
            )
        conn.commit()
    assert len(jobs(dsn)) == 1
    assert job.enqueue_many(rows[:3]) == 3


async def test_the_async_enqueues_check_and_convert_too(app: App, dsn):
    job = app.job()(send)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        with pytest.raises(TypeError, match=r"argument 'user\.address\.zip'"):
            await job.using(conn).enqueue_async(user=User("a", Address("x", 1)), when=NOW)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"row 0: argument 'when'"):
            await job.enqueue_many_async([{"user": USER, "when": dt.datetime(2026, 1, 1)}], conn=conn)
        await job.using(conn).enqueue_async(USER, NOW)
        assert await job.using(conn).enqueue_many_async([job.args(user=USER, when=NOW, priority="high")]) == 1
    assert [row["args"]["when"] for row in jobs(dsn)] == [NOW.isoformat()] * 2


def test_positional_arguments_are_stored_by_name(app: App, dsn):
    job = app.job()(send)
    job.enqueue(USER, NOW, "high")
    assert job.args(USER, when=NOW) == {"user": USER, "when": NOW}
    [row] = jobs(dsn)
    assert row["args"]["priority"] == "high" and row["args"]["when"] == NOW.isoformat()
    with pytest.raises(TypeError, match="takes 3 positional argument"):
        job.enqueue(USER, NOW, "high", 4)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="multiple values for argument 'user'"):
        job.enqueue(USER, user=USER, when=NOW)  # type: ignore[misc]


def test_the_conn_keyword_still_works_untyped(app: App, dsn):
    job = app.job()(send)
    with psycopg.connect(dsn) as conn:
        job.enqueue(user=USER, when=NOW, conn=conn)  # type: ignore[call-arg]
        conn.rollback()
    assert jobs(dsn) == []
    with pytest.raises(TypeError, match="using\\(\\) takes a psycopg 3 Connection or AsyncConnection"):
        job.using("postgresql://")  # type: ignore[arg-type]


def test_unannotated_handlers_are_unchanged(app: App, dsn):
    seen: list[Any] = []

    @app.job(kind="loose")
    def loose(a, b=None):
        seen.append((a, b))

    @app.job(kind="any")
    def anything(a: Any, **rest: Any) -> None:
        seen.append((a, rest))

    assert app.jobs["loose"].args_schema is None and app.jobs["any"].args_schema is None
    assert all(spec.call is None for spec in app.runnable().values())
    loose.enqueue(a={"name": "ann"}, b=[1])
    loose.enqueue_many([{"a": "x"}, {"a": 1.5, "b": None}])
    anything.enqueue(a=1, extra="y")
    loose.enqueue(a=NOW)  # no annotation: orjson's string, as before
    drain(app)
    assert sorted(map(repr, seen)) == sorted(
        map(
            repr,
            [({"name": "ann"}, [1]), ("x", None), (1.5, None), (1, {"extra": "y"}), (NOW.isoformat(), None)],
        )
    )


def test_only_kinds_that_convert_are_wrapped_at_execution(app: App):
    @app.job(kind="native")
    def native(n: int, names: list[str], opt: dict[str, float] | None = None, **more: bool) -> None: ...

    @app.job(kind="rich")
    def rich(n: int, when: dt.datetime) -> None: ...

    @app.job(kind="rich_kwargs")
    def rich_kwargs(**days: dt.date) -> None: ...

    specs = app.runnable()
    assert specs["native"].call is None  # the hot loop calls the handler: no cost per job
    assert specs["native"].target is native.spec.func
    assert specs["rich"].call is not None and specs["rich_kwargs"].call is not None
    assert app.jobs["rich"].call is None  # the registry itself is not changed
    with pytest.raises(TypeError, match=r"argument 'more' must be bool, not int"):
        native.enqueue(n=1, names=[], more=1)  # type: ignore[arg-type]


def test_args_that_do_not_convert_at_execution_discard_that_job_only(app: App, dsn):
    seen: list[Any] = []

    @app.job(kind="dated", max_attempts=5)
    def dated(day: dt.date, user: User | None = None) -> None:
        seen.append(day)

    bad_date = insert_raw(dsn, "dated", '{"day": "not a date"}')
    bad_user = insert_raw(
        dsn, "dated", '{"day": "2026-01-01", "user": {"name": "a", "address": {"zip": "1"}}}'
    )
    good = dated.enqueue(day=dt.date(2026, 1, 2))
    drain(app)

    assert seen == [dt.date(2026, 1, 2)]
    rows = {row["id"]: row for row in jobs(dsn)}
    assert good not in rows
    assert rows[bad_date]["state"] == "discarded" and rows[bad_date]["attempt"] == 1  # never retried
    assert rows[bad_date]["errors"][0]["error"] == (
        "InvalidArguments: dated: argument 'day' must be an ISO 8601 date, not 'not a date'"
    )
    assert rows[bad_user]["state"] == "discarded"
    assert rows[bad_user]["errors"][0]["error"] == (
        "InvalidArguments: dated: argument 'user.address' lacks required field(s) 'street'"
        " of Address (a dataclass)"
    )


def test_a_unique_key_is_derived_from_the_stored_form(app: App, dsn):
    job = app.job(kind="once", unique=True)(send)
    first = job.enqueue(user=USER, when=NOW)
    assert job.enqueue(user=User("ann", Address("1 Main St", "02134")), when=NOW) == first
    assert job.enqueue_many([{"user": USER, "when": NOW}, {"user": USER, "when": NOW.astimezone(PARIS)}]) == 1
    assert len(jobs(dsn)) == 2


def test_unsupported_annotations_are_refused_at_registration(app: App):
    def complex_arg(z: complex) -> None: ...

    def int_keys(m: dict[int, str]) -> None: ...

    def unresolved(x: NotImported) -> None:  # type: ignore[name-defined]  # noqa: F821
        ...

    with pytest.raises(
        TypeError, match=r"^c: parameter 'z': <class 'complex'> is no type fastjobs can store"
    ):
        app.job(kind="c")(complex_arg)
    with pytest.raises(TypeError, match=r"^m: parameter 'm': .*dict keys must be str"):
        app.job(kind="m")(int_keys)
    with pytest.raises(
        TypeError, match=r"^u: the annotations of .*unresolved, which do not resolve .*NotImported"
    ):
        app.job(kind="u")(unresolved)
    assert app.jobs == {}


def test_an_annotation_naming_a_class_defined_further_down_says_to_define_it_first(
    app: App, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """`from __future__ import annotations` makes a forward reference legal Python, but the
    decorator reads the annotations when it registers the handler: the error says so."""
    (tmp_path / "fjforward.py").write_text(
        "from __future__ import annotations\n"
        "import dataclasses\n"
        "import fastjobs\n"
        "app = fastjobs.App()\n"
        "@app.job()\n"
        "def ship(order: Order) -> None: ...\n"
        "@dataclasses.dataclass\n"
        "class Order:\n"
        "    id: int\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TypeError) as excinfo:
        importlib.import_module("fjforward")
    message = str(excinfo.value)
    assert message.startswith("fjforward.ship: the annotations of ship, which do not resolve")
    assert "name 'Order' is not defined" in message
    assert "define or import what they name before it" in message
    assert "fastjobs stores" not in message  # Order is a dataclass: a type it does store


def test_the_schema_compiles_once_per_handler():
    """What a worker runs: the schema's converter, built from the registration's compiled schema."""
    schema = typed.schema("k", send)
    assert schema is not None and schema.converts
    call = schema.converter(send, is_async=False)
    assert call is not None
    with pytest.raises(
        InvalidArguments, match=r"^k: argument 'when' must be an ISO 8601 datetime string, not int"
    ):
        call(user={"name": "a", "address": {"street": "s", "zip": "z"}}, when=5)


# Static typing: tests/test_install.py runs mypy --strict on a user's module against an installed
# fastjobs, as the install page says to install it.


def test_the_bench_reports_the_per_job_cost_of_each_record_type():
    from fastjobs import bench

    costs = bench.typed_costs(number=50)
    assert list(costs) == ["plain", "dataclass", "msgspec.Struct", "pydantic.BaseModel"]
    assert all(enqueue_us > 0 and run_us > 0 for enqueue_us, run_us in costs.values())


def test_decorated_handlers_and_annotated_types_are_seen_through(app: App, dsn):
    seen: list[Any] = []

    def logged(func: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> None:
            func(*args, **kwargs)

        return wrapper

    @app.job(kind="wrapped")
    @logged
    def wrapped(day: Annotated[dt.date, "a note"]) -> None:
        seen.append(day)

    wrapped.enqueue(day=dt.date(2026, 1, 1))
    with pytest.raises(TypeError, match=r"^wrapped: argument 'day' must be date, not str"):
        wrapped.enqueue(day="2026-01-01")
    drain(app)
    assert seen == [dt.date(2026, 1, 1)]
