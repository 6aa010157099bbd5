"""Each type a handler's arguments may have, as a Node: its check and JSON form, its conversion back."""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import enum
import math
import typing
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

__all__ = [
    "ANY",
    "RICH",
    "SCALARS",
    "SUPPORTED",
    "Invalid",
    "Node",
    "NoneType",
    "Unsupported",
    "fixed_tuple",
    "literal",
    "mapping",
    "of_enum",
    "of_msgspec",
    "of_pydantic",
    "record",
    "sequence",
    "union",
]

if TYPE_CHECKING:
    from .typed import Compiler

NoneType = type(None)

# How a parameter annotated with one of these is stored, for the messages that refuse an annotation.
SUPPORTED = (
    "int, float, str, bool, None, list[...], tuple[...], set[...], dict[str, ...], Literal[...], "
    "unions (X | None), enums, datetime (timezone-aware), date, UUID, Decimal, dataclasses, "
    "TypedDict, msgspec.Struct, pydantic.BaseModel, Any"
)


class Invalid(Exception):
    """A value that does not fit its annotation; `path` is filled in on the way out, innermost first."""

    def __init__(self, message: str, error: type[Exception] = TypeError) -> None:
        super().__init__(message)
        self.message = message
        self.error = error
        self.path: list[str | int] = []


def _type_name(value: Any) -> str:
    return type(value).__name__


def _wrong(expected: str, value: Any) -> NoReturn:
    raise Invalid(f"must be {expected}, not {_type_name(value)}")


def _identity(value: Any) -> Any:
    return value


@dataclasses.dataclass(slots=True)
class Node:
    """One annotation compiled: `encode` checks a Python value and returns its JSON form, `decode`
    turns the JSON form back (checking it). `exact`: a type whose instances need neither, skipped
    without a call; `converts`: decode does more than check, so execution needs a wrapper."""

    name: str
    encode: Callable[[Any], Any] = _identity
    decode: Callable[[Any], Any] = _identity
    converts: bool = False
    exact: type | None = None
    is_any: bool = False


ANY = Node("Any", is_any=True)


# Scalars ------------------------------------------------------------------


def _int(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    _wrong("int", value)


def _float(value: Any) -> Any:
    if type(value) is float or (isinstance(value, float | int) and not isinstance(value, bool)):
        if not math.isfinite(value):
            # orjson writes NaN and infinity as null: refused rather than lost.
            raise Invalid(f"must be a finite float (JSON has no NaN or infinity), not {value!r}", ValueError)
        return float(value)
    _wrong("float", value)


def _str(value: Any) -> Any:
    if isinstance(value, str):
        return value
    _wrong("str", value)


def _bool(value: Any) -> Any:
    if value is True or value is False:
        return value
    _wrong("bool", value)


def _none(value: Any) -> Any:
    if value is None:
        return value
    _wrong("None", value)


SCALARS: dict[Any, Node] = {
    int: Node("int", _int, _int, exact=int),
    float: Node("float", _float, _float),  # no `exact`: NaN and infinity are floats JSON lacks
    str: Node("str", _str, _str, exact=str),
    bool: Node("bool", _bool, _bool, exact=bool),
    NoneType: Node("None", _none, _none, exact=NoneType),
    None: Node("None", _none, _none, exact=NoneType),
}


def _datetime_encode(value: Any) -> Any:
    if not isinstance(value, dt.datetime):
        _wrong("datetime", value)
    if value.utcoffset() is None:
        raise Invalid("must carry a timezone (a naive datetime is ambiguous)", ValueError)
    return value.isoformat()


def _datetime_decode(value: Any) -> Any:
    if not isinstance(value, str):
        _wrong("an ISO 8601 datetime string", value)
    try:
        parsed = dt.datetime.fromisoformat(value)
    except ValueError:
        raise Invalid(f"must be an ISO 8601 datetime, not {value!r}", ValueError) from None
    if parsed.utcoffset() is None:
        raise Invalid(f"must carry a timezone (a naive datetime is ambiguous), not {value!r}", ValueError)
    return parsed


def _date_encode(value: Any) -> Any:
    if isinstance(value, dt.date) and not isinstance(value, dt.datetime):
        return value.isoformat()
    _wrong("date", value)


def _date_decode(value: Any) -> Any:
    if not isinstance(value, str):
        _wrong("an ISO 8601 date string", value)
    try:
        return dt.date.fromisoformat(value)
    except ValueError:
        raise Invalid(f"must be an ISO 8601 date, not {value!r}", ValueError) from None


def _uuid_encode(value: Any) -> Any:
    if isinstance(value, uuid.UUID):
        return str(value)
    _wrong("UUID", value)


def _uuid_decode(value: Any) -> Any:
    if not isinstance(value, str):
        _wrong("a UUID string", value)
    try:
        return uuid.UUID(value)
    except ValueError:
        raise Invalid(f"must be a UUID, not {value!r}", ValueError) from None


def _decimal_encode(value: Any) -> Any:
    if isinstance(value, decimal.Decimal):
        return str(value)  # a string: a JSON number would go through a float
    _wrong("Decimal", value)


def _decimal_decode(value: Any) -> Any:
    if not isinstance(value, str | int) or isinstance(value, bool):
        _wrong("a decimal string", value)
    try:
        return decimal.Decimal(value)
    except decimal.InvalidOperation:
        raise Invalid(f"must be a decimal number, not {value!r}", ValueError) from None


RICH: dict[Any, Node] = {
    dt.datetime: Node("datetime", _datetime_encode, _datetime_decode, converts=True),
    dt.date: Node("date", _date_encode, _date_decode, converts=True),
    uuid.UUID: Node("UUID", _uuid_encode, _uuid_decode, converts=True),
    decimal.Decimal: Node("Decimal", _decimal_encode, _decimal_decode, converts=True),
}


# Containers ---------------------------------------------------------------


def _each(step: Callable[[Any], Any], exact: type | None, items: Any) -> list[Any]:
    """`step` applied to each item (skipping those of type `exact`); the list itself when nothing changed."""
    out: list[Any] | None = None
    for i, item in enumerate(items):
        if type(item) is exact:
            continue
        try:
            new = step(item)
        except Invalid as exc:
            exc.path.append(i)
            raise
        if new is not item:
            if out is None:
                out = list(items)
            out[i] = new
    if out is None:
        return items if type(items) is list else list(items)
    return out


def sequence(
    kind: str, accepts: type | tuple[type, ...], item: Node, rebuild: Callable[[list[Any]], Any] | None
) -> Node:
    """list[X] (rebuild None), tuple[X, ...], set[X]: a JSON array either way."""
    name = f"{kind}[{item.name}]"

    def encode(value: Any) -> Any:
        if not isinstance(value, accepts):
            _wrong(kind, value)
        value = typing.cast(Any, value)
        if item.is_any:
            return value if type(value) is list else list(value)
        return _each(item.encode, item.exact, value)

    def decode(value: Any) -> Any:
        if type(value) is not list:
            _wrong(f"{kind} (a JSON array)", value)
        items = value if item.is_any else _each(item.decode, item.exact if not item.converts else None, value)
        return items if rebuild is None else rebuild(items)

    return Node(name, encode, decode, converts=item.converts or rebuild is not None)


def fixed_tuple(items: list[Node]) -> Node:
    name = f"tuple[{', '.join(n.name for n in items)}]"

    def run(value: Any, decode: bool) -> list[Any]:
        if len(value) != len(items):
            raise Invalid(f"must have {len(items)} items, not {len(value)}", ValueError)
        out = []
        for i, (node, item) in enumerate(zip(items, value, strict=True)):
            try:
                out.append(node.decode(item) if decode else node.encode(item))
            except Invalid as exc:
                exc.path.append(i)
                raise
        return out

    def encode(value: Any) -> Any:
        if not isinstance(value, tuple):
            _wrong("tuple", value)
        return run(value, False)

    def decode(value: Any) -> Any:
        if type(value) is not list:
            _wrong("tuple (a JSON array)", value)
        return tuple(run(value, True))

    return Node(name, encode, decode, converts=True)


def mapping(value_node: Node) -> Node:
    name = f"dict[str, {value_node.name}]"

    def run(value: dict[Any, Any], step: Callable[[Any], Any], exact: type | None) -> dict[Any, Any]:
        out: dict[Any, Any] | None = None
        for key, item in value.items():
            if type(key) is not str:
                raise Invalid(f"keys must be str, not {_type_name(key)} ({key!r})")
            if type(item) is exact or value_node.is_any:
                continue
            try:
                new = step(item)
            except Invalid as exc:
                exc.path.append(key)
                raise
            if new is not item:
                if out is None:
                    out = dict(value)
                out[key] = new
        return value if out is None else out

    def encode(value: Any) -> Any:
        if not isinstance(value, dict):
            _wrong("dict", value)
        return run(value, value_node.encode, value_node.exact)

    def decode(value: Any) -> Any:
        if type(value) is not dict:
            _wrong("dict (a JSON object)", value)
        return run(value, value_node.decode, None if value_node.converts else value_node.exact)

    return Node(name, encode, decode, converts=value_node.converts)


def union(members: list[Node]) -> Node:
    name = " | ".join(m.name for m in members)
    if any(m.is_any for m in members):
        return ANY
    others = [m for m in members if m.exact is not NoneType]

    # Each member's encode and decode are looked up per call: a record's node
    # is filled in after its fields are compiled (a Tree whose parent is a Tree | None).
    def first(value: Any, decode: bool) -> Any:
        if value is None and len(others) < len(members):
            return None
        errors: list[Invalid] = []
        for member in others:
            try:
                return member.decode(value) if decode else member.encode(value)
            except Invalid as exc:
                errors.append(exc)
        if len(errors) == 1:  # X | None: X's own message, with its path
            raise errors[0]
        _wrong(name, value)

    return Node(
        name,
        lambda value: first(value, False),
        lambda value: first(value, True),
        converts=any(m.converts for m in members),
    )


def literal(values: tuple[Any, ...]) -> Node:
    name = f"Literal[{', '.join(repr(v) for v in values)}]"
    for v in values:
        if not isinstance(v, str | int | bool | enum.Enum | NoneType):
            raise Unsupported(f"Literal value {v!r}")
    # JSON form -> the literal; keyed by type too, so True is not 1.
    stored = {(type(_enum_value(v)), _enum_value(v)): v for v in values}

    def encode(value: Any) -> Any:
        for v in values:
            if value is v or (type(value) is type(v) and value == v):
                return _enum_value(v)
        raise Invalid(f"must be one of {', '.join(repr(v) for v in values)}, not {value!r}", ValueError)

    def decode(value: Any) -> Any:
        try:
            return stored[type(value), value]
        except (KeyError, TypeError):
            raise Invalid(
                f"must be one of {', '.join(repr(_enum_value(v)) for v in values)}, not {value!r}", ValueError
            ) from None

    return Node(name, encode, decode, converts=any(isinstance(v, enum.Enum) for v in values))


def _enum_value(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


def of_enum(cls: type[enum.Enum]) -> Node:
    for member in cls:
        if not isinstance(member.value, str | int | float | bool | NoneType):
            raise Unsupported(
                f"{cls.__name__}.{member.name}, whose value {member.value!r} is not a JSON scalar"
            )

    def encode(value: Any) -> Any:
        if isinstance(value, cls):
            return value.value
        _wrong(f"{cls.__name__} (an enum)", value)

    def decode(value: Any) -> Any:
        try:
            return cls(value)
        except ValueError:
            raise Invalid(f"must be a value of {cls.__name__}, not {value!r}", ValueError) from None

    return Node(cls.__name__, encode, decode, converts=True)


# Records ------------------------------------------------------------------


def _fields(
    owner: str, value: dict[Any, Any], nodes: dict[str, Node], required: frozenset[str], decode: bool
) -> dict[str, Any]:
    """A JSON object's fields decoded (or a TypedDict's encoded), unknown and missing keys refused."""
    if type(value) is not dict:
        _wrong(f"{owner} (a JSON object)" if decode else owner, value)
    out: dict[str, Any] = {}
    for key, item in value.items():
        node = nodes.get(key)
        if node is None:
            raise Invalid(f"has no field {key!r} ({owner} has {', '.join(nodes) or 'none'})")
        if node.is_any or type(item) is node.exact:
            out[key] = item
            continue
        try:
            out[key] = node.decode(item) if decode else node.encode(item)
        except Invalid as exc:
            exc.path.append(key)
            raise
    if not required.issubset(out):
        missing = ", ".join(repr(k) for k in sorted(required.difference(out)))
        raise Invalid(f"lacks required field(s) {missing} of {owner}")
    return out


def record(cls: Any, compiler: Compiler, known: dict[Any, Node]) -> Node:
    """A dataclass or a TypedDict: a JSON object of its fields, compiled once (recursion allowed)."""
    node = Node(cls.__name__, converts=True)
    known[cls] = node  # a field of the record's own type finds this one
    hints = compiler.hints(cls)
    is_dataclass = dataclasses.is_dataclass(cls)  # (not narrowing cls, which stays a class)
    if is_dataclass:
        fields = [f for f in dataclasses.fields(cls) if f.init]
        nodes = {
            f.name: compiler.node(hints.get(f.name, Any), f"field {f.name!r} of {cls.__name__}")
            for f in fields
        }
        required = frozenset(
            f.name
            for f in fields
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )
        name = f"{cls.__name__} (a dataclass)"

        def encode(value: Any) -> Any:
            if not isinstance(value, cls):
                _wrong(name, value)
            out = {}
            for key, field in nodes.items():
                item = getattr(value, key)
                try:
                    out[key] = item if type(item) is field.exact else field.encode(item)
                except Invalid as exc:
                    exc.path.append(key)
                    raise
            return out

        def decode(value: Any) -> Any:
            fields = _fields(name, value, nodes, required, decode=True)
            try:
                return cls(**fields)
            except (TypeError, ValueError) as exc:
                raise Invalid(f"is no valid {cls.__name__}: {exc}", ValueError) from None

    else:
        nodes = {key: compiler.node(hint, f"key {key!r} of {cls.__name__}") for key, hint in hints.items()}
        required = _required_keys(cls)
        name = f"{cls.__name__} (a TypedDict)"
        node.converts = any(n.converts for n in nodes.values())

        def encode(value: Any) -> Any:
            return _fields(name, value, nodes, required, decode=False)

        def decode(value: Any) -> Any:
            return _fields(name, value, nodes, required, decode=True)

    node.encode, node.decode = encode, decode
    return node


def _required_keys(cls: Any) -> frozenset[str]:
    """A TypedDict's required keys. Python 3.11 misses a NotRequired[...] written as a string
    (`from __future__ import annotations`) in `__required_keys__`: the resolved hints say."""
    required = set(cls.__required_keys__)
    for key, hint in typing.get_type_hints(cls, include_extras=True).items():
        if typing.get_origin(hint) is typing.NotRequired:
            required.discard(key)
        elif typing.get_origin(hint) is typing.Required:
            required.add(key)
    return frozenset(required)


def of_msgspec(cls: Any, msgspec: Any) -> Node:
    """A msgspec.Struct: checked by converting its builtins back (a Struct does not check its fields)."""
    to_builtins, convert, ValidationError = msgspec.to_builtins, msgspec.convert, msgspec.ValidationError
    name = f"{cls.__name__} (a msgspec.Struct)"

    def invalid(exc: Exception) -> Invalid:
        message, _, at = str(exc).partition(" - at `$")
        invalid = Invalid(f"is no valid {cls.__name__}: {message}", ValueError)
        if at:
            invalid.path.append(at.rstrip("`"))  # ".zip", "[0].name": a path already
        return invalid

    def encode(value: Any) -> Any:
        if not isinstance(value, cls):
            _wrong(name, value)
        try:
            data = to_builtins(value)
            convert(data, cls)
        except (ValidationError, TypeError) as exc:
            raise invalid(exc) from None
        return data

    def decode(value: Any) -> Any:
        try:
            return convert(value, cls)
        except ValidationError as exc:
            raise invalid(exc) from None

    return Node(cls.__name__, encode, decode, converts=True)


def of_pydantic(cls: Any, pydantic: Any) -> Node:
    """A pydantic model: its JSON-mode dump, validated back (an instance may have been built unchecked)."""
    ValidationError = pydantic.ValidationError
    name = f"{cls.__name__} (a pydantic model)"

    def invalid(exc: Any) -> Invalid:
        error = exc.errors()[0]
        invalid = Invalid(f"is no valid {cls.__name__}: {error['msg']}", ValueError)
        for part in error["loc"]:
            invalid.path.insert(0, part)
        return invalid

    def encode(value: Any) -> Any:
        if not isinstance(value, cls):
            _wrong(name, value)
        try:
            data = value.model_dump(mode="json", warnings=False)  # an invalid one is refused below
        except ValueError as exc:  # PydanticSerializationError: a value with no JSON form
            raise Invalid(f"is no valid {cls.__name__}: {exc}", ValueError) from None
        try:
            cls.model_validate(data)
        except ValidationError as exc:
            raise invalid(exc) from None
        return data

    def decode(value: Any) -> Any:
        try:
            return cls.model_validate(value)
        except ValidationError as exc:
            raise invalid(exc) from None

    return Node(cls.__name__, encode, decode, converts=True)


class Unsupported(Exception):
    pass
