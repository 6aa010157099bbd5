"""Typed arguments: a handler's annotations compiled once into the checks and conversions of its jobs.

At enqueue, each argument is checked against its parameter's annotation and
turned into its JSON form (a datetime into ISO 8601, a dataclass into an
object); at execution, a kind whose annotations are not all JSON-native gets
a wrapper (`converter`) that turns the JSON back into the annotated types.
A kind whose annotations are all JSON-native (int, str, list[int], ...) is
only checked at enqueue: its jobs run with no wrapper, at no cost per job.

msgspec and pydantic are never imported here: a handler annotated with one of
their classes has imported the library already, so `sys.modules` has it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import enum
import inspect
import math
import sys
import types
import typing
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Annotated, Any, Literal, NewType, NoReturn, Union

from .errors import InvalidArguments

NoneType = type(None)

# How a parameter annotated with one of these is stored, for the messages that refuse an annotation.
SUPPORTED = (
    "int, float, str, bool, None, list[...], tuple[...], set[...], dict[str, ...], Literal[...], "
    "unions (X | None), enums, datetime (timezone-aware), date, UUID, Decimal, dataclasses, "
    "TypedDict, msgspec.Struct, pydantic.BaseModel, Any"
)


class _Invalid(Exception):
    """A value that does not fit its annotation; `path` is filled in on the way out, innermost first."""

    def __init__(self, message: str, error: type[Exception] = TypeError) -> None:
        super().__init__(message)
        self.message = message
        self.error = error
        self.path: list[str | int] = []


def _type_name(value: Any) -> str:
    return type(value).__name__


def _wrong(expected: str, value: Any) -> NoReturn:
    raise _Invalid(f"must be {expected}, not {_type_name(value)}")


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
            raise _Invalid(f"must be a finite float (JSON has no NaN or infinity), not {value!r}", ValueError)
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


_SCALARS: dict[Any, Node] = {
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
        raise _Invalid("must carry a timezone (a naive datetime is ambiguous)", ValueError)
    return value.isoformat()


def _datetime_decode(value: Any) -> Any:
    if not isinstance(value, str):
        _wrong("an ISO 8601 datetime string", value)
    try:
        parsed = dt.datetime.fromisoformat(value)
    except ValueError:
        raise _Invalid(f"must be an ISO 8601 datetime, not {value!r}", ValueError) from None
    if parsed.utcoffset() is None:
        raise _Invalid(f"must carry a timezone (a naive datetime is ambiguous), not {value!r}", ValueError)
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
        raise _Invalid(f"must be an ISO 8601 date, not {value!r}", ValueError) from None


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
        raise _Invalid(f"must be a UUID, not {value!r}", ValueError) from None


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
        raise _Invalid(f"must be a decimal number, not {value!r}", ValueError) from None


_RICH: dict[Any, Node] = {
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
        except _Invalid as exc:
            exc.path.append(i)
            raise
        if new is not item:
            if out is None:
                out = list(items)
            out[i] = new
    if out is None:
        return items if type(items) is list else list(items)
    return out


def _sequence(
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


def _fixed_tuple(items: list[Node]) -> Node:
    name = f"tuple[{', '.join(n.name for n in items)}]"

    def run(value: Any, decode: bool) -> list[Any]:
        if len(value) != len(items):
            raise _Invalid(f"must have {len(items)} items, not {len(value)}", ValueError)
        out = []
        for i, (node, item) in enumerate(zip(items, value, strict=True)):
            try:
                out.append(node.decode(item) if decode else node.encode(item))
            except _Invalid as exc:
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


def _mapping(value_node: Node) -> Node:
    name = f"dict[str, {value_node.name}]"

    def run(value: dict[Any, Any], step: Callable[[Any], Any], exact: type | None) -> dict[Any, Any]:
        out: dict[Any, Any] | None = None
        for key, item in value.items():
            if type(key) is not str:
                raise _Invalid(f"keys must be str, not {_type_name(key)} ({key!r})")
            if type(item) is exact or value_node.is_any:
                continue
            try:
                new = step(item)
            except _Invalid as exc:
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


def _union(members: list[Node]) -> Node:
    name = " | ".join(m.name for m in members)
    if any(m.is_any for m in members):
        return ANY
    others = [m for m in members if m.exact is not NoneType]

    # Each member's encode and decode are looked up per call: a record's node
    # is filled in after its fields are compiled (a Tree whose parent is a Tree | None).
    def first(value: Any, decode: bool) -> Any:
        if value is None and len(others) < len(members):
            return None
        errors: list[_Invalid] = []
        for member in others:
            try:
                return member.decode(value) if decode else member.encode(value)
            except _Invalid as exc:
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


def _literal(values: tuple[Any, ...]) -> Node:
    name = f"Literal[{', '.join(repr(v) for v in values)}]"
    for v in values:
        if not isinstance(v, str | int | bool | enum.Enum | NoneType):
            raise _Unsupported(f"Literal value {v!r}")
    # JSON form -> the literal; keyed by type too, so True is not 1.
    stored = {(type(_enum_value(v)), _enum_value(v)): v for v in values}

    def encode(value: Any) -> Any:
        for v in values:
            if value is v or (type(value) is type(v) and value == v):
                return _enum_value(v)
        raise _Invalid(f"must be one of {', '.join(repr(v) for v in values)}, not {value!r}", ValueError)

    def decode(value: Any) -> Any:
        try:
            return stored[type(value), value]
        except (KeyError, TypeError):
            raise _Invalid(
                f"must be one of {', '.join(repr(_enum_value(v)) for v in values)}, not {value!r}", ValueError
            ) from None

    return Node(name, encode, decode, converts=any(isinstance(v, enum.Enum) for v in values))


def _enum_value(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


def _enum(cls: type[enum.Enum]) -> Node:
    for member in cls:
        if not isinstance(member.value, str | int | float | bool | NoneType):
            raise _Unsupported(
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
            raise _Invalid(f"must be a value of {cls.__name__}, not {value!r}", ValueError) from None

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
            raise _Invalid(f"has no field {key!r} ({owner} has {', '.join(nodes) or 'none'})")
        if node.is_any or type(item) is node.exact:
            out[key] = item
            continue
        try:
            out[key] = node.decode(item) if decode else node.encode(item)
        except _Invalid as exc:
            exc.path.append(key)
            raise
    if not required.issubset(out):
        missing = ", ".join(repr(k) for k in sorted(required.difference(out)))
        raise _Invalid(f"lacks required field(s) {missing} of {owner}")
    return out


def _record(cls: Any, compiler: _Compiler, known: dict[Any, Node]) -> Node:
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
                except _Invalid as exc:
                    exc.path.append(key)
                    raise
            return out

        def decode(value: Any) -> Any:
            fields = _fields(name, value, nodes, required, decode=True)
            try:
                return cls(**fields)
            except (TypeError, ValueError) as exc:
                raise _Invalid(f"is no valid {cls.__name__}: {exc}", ValueError) from None

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


def _msgspec(cls: Any, msgspec: Any) -> Node:
    """A msgspec.Struct: checked by converting its builtins back (a Struct does not check its fields)."""
    to_builtins, convert, ValidationError = msgspec.to_builtins, msgspec.convert, msgspec.ValidationError
    name = f"{cls.__name__} (a msgspec.Struct)"

    def invalid(exc: Exception) -> _Invalid:
        message, _, at = str(exc).partition(" - at `$")
        invalid = _Invalid(f"is no valid {cls.__name__}: {message}", ValueError)
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


def _pydantic(cls: Any, pydantic: Any) -> Node:
    """A pydantic model: its JSON-mode dump, validated back (an instance may have been built unchecked)."""
    ValidationError = pydantic.ValidationError
    name = f"{cls.__name__} (a pydantic model)"

    def invalid(exc: Any) -> _Invalid:
        error = exc.errors()[0]
        invalid = _Invalid(f"is no valid {cls.__name__}: {error['msg']}", ValueError)
        for part in error["loc"]:
            invalid.path.insert(0, part)
        return invalid

    def encode(value: Any) -> Any:
        if not isinstance(value, cls):
            _wrong(name, value)
        try:
            data = value.model_dump(mode="json", warnings=False)  # an invalid one is refused below
        except ValueError as exc:  # PydanticSerializationError: a value with no JSON form
            raise _Invalid(f"is no valid {cls.__name__}: {exc}", ValueError) from None
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


# The compiler -------------------------------------------------------------


class _Unsupported(Exception):
    pass


class _Compiler:
    """Annotations to nodes, each class compiled once (a record may refer to itself)."""

    def __init__(self) -> None:
        self.known: dict[Any, Node] = {}

    def hints(self, obj: Any) -> dict[str, Any]:
        try:
            return typing.get_type_hints(obj)
        except Exception as exc:  # NameError for a name only imported under TYPE_CHECKING, ...
            raise _Unsupported(
                f"the annotations of {obj.__qualname__}, which do not resolve ({exc})"
            ) from None

    def node(self, hint: Any, where: str) -> Node:
        try:
            return self._node(hint)
        except _Unsupported as exc:
            raise _Unsupported(f"{where}: {exc}") from None

    def _node(self, hint: Any) -> Node:
        if hint is Any or hint is object:
            return ANY
        node = _SCALARS.get(hint) or _RICH.get(hint) or self.known.get(hint)
        if node is not None:
            return node
        origin = typing.get_origin(hint)
        args = typing.get_args(hint)
        if origin is Annotated:
            return self._node(args[0])
        if origin is Union or origin is types.UnionType:
            return _union([self._node(a) for a in args])
        if origin is Literal:
            return _literal(args)
        if hint is list or origin is list:
            return _sequence("list", list, self._node(args[0]) if args else ANY, None)
        if hint in (set, frozenset) or origin in (set, frozenset):
            kind = hint if origin is None else origin
            return _sequence(kind.__name__, (set, frozenset), self._node(args[0]) if args else ANY, kind)
        if hint is tuple or origin is tuple:
            if not args or (len(args) == 2 and args[1] is Ellipsis):
                return _sequence("tuple", tuple, self._node(args[0]) if args else ANY, tuple)
            if args == ((),):
                return _fixed_tuple([])
            return _fixed_tuple([self._node(a) for a in args])
        if hint is dict or origin is dict:
            if args and args[0] is not str:
                raise _Unsupported(f"{hint!r}: JSON object keys are strings, so dict keys must be str")
            return _mapping(self._node(args[1]) if args else ANY)
        if isinstance(hint, NewType):
            return self._node(hint.__supertype__)
        if isinstance(hint, type):
            if issubclass(hint, enum.Enum):
                node = self.known[hint] = _enum(hint)
                return node
            if dataclasses.is_dataclass(hint) or typing.is_typeddict(hint):
                return _record(hint, self, self.known)
            msgspec = sys.modules.get("msgspec")
            if msgspec is not None and issubclass(hint, msgspec.Struct):
                node = self.known[hint] = _msgspec(hint, msgspec)
                return node
            pydantic = sys.modules.get("pydantic")
            if pydantic is not None and issubclass(hint, pydantic.BaseModel):
                node = self.known[hint] = _pydantic(hint, pydantic)
                return node
        raise _Unsupported(f"{hint!r} is no type fastjobs can store as JSON")


# A handler's schema -------------------------------------------------------


class Schema:
    """The compiled annotations of one handler's parameters (`**kwargs: X` checks every other name)."""

    def __init__(self, kind: str, nodes: dict[str, Node], extra: Node | None) -> None:
        self.kind = kind
        self._nodes = nodes
        self._extra = extra
        # Per name, the type whose values need no check: one dict lookup per plain argument.
        self._exact = {name: node.exact for name, node in nodes.items() if node.exact is not None}
        self.converts = any(n.converts for n in nodes.values()) or (extra is not None and extra.converts)

    def encode(self, args: Any, row: int | None = None) -> Any:
        """The JSON form of one job's arguments (the same dict when nothing changed).

        Raises TypeError or ValueError naming the kind, the row of a bulk
        enqueue, the argument and the path inside it. Anything but a mapping
        is returned as it is, for dump_args to refuse with its own message.
        """
        if type(args) is not dict:
            if not isinstance(args, Mapping):
                return args
            args = dict(args)
        nodes, extra, exact = self._nodes, self._extra, self._exact.get
        out: dict[str, Any] | None = None
        name = ""
        try:
            for name, value in args.items():
                if type(value) is exact(name):
                    continue
                node = nodes.get(name, extra)
                if node is None or type(value) is node.exact:
                    continue  # an unknown name is dump_args' to refuse
                new = node.encode(value)
                if new is not value:
                    if out is None:
                        out = dict(args)
                    out[name] = new
        except _Invalid as exc:
            raise _error(exc.error, self.kind, name, exc, row) from None
        return args if out is None else out

    def decode(self, name: str, value: Any) -> Any:
        """One stored argument as its handler gets it; InvalidArguments if it does not convert."""
        node = self._nodes.get(name, self._extra)
        if node is None or node.is_any:
            return value
        try:
            return node.decode(value)
        except _Invalid as exc:
            raise _error(InvalidArguments, self.kind, name, exc) from None

    def encode_rows(self, rows: Iterable[Any]) -> Iterator[Any]:
        encode = self.encode
        for row, args in enumerate(rows):
            yield encode(args, row)

    def converter(self, func: Callable[..., Any], is_async: bool) -> Callable[..., Any] | None:
        """`func` behind the conversion of its arguments from JSON; None when none needs converting.

        An argument that does not convert (a row enqueued by raw SQL or an
        older version) raises InvalidArguments, which discards its job.
        """
        if not self.converts:
            return None
        nodes = {name: node.decode for name, node in self._nodes.items() if not node.is_any}
        extra = self._extra.decode if self._extra is not None and not self._extra.is_any else None
        kind = self.kind

        def convert(args: dict[str, Any]) -> None:
            name = ""
            try:
                for name, value in args.items():
                    decode = nodes.get(name, extra)
                    if decode is not None:
                        args[name] = decode(value)
            except _Invalid as exc:
                raise _error(InvalidArguments, kind, name, exc) from None

        if is_async:

            async def call_async(**args: Any) -> Any:
                convert(args)
                return await func(**args)

            return call_async

        def call(**args: Any) -> Any:
            convert(args)
            return func(**args)

        return call


def _path(name: str, parts: list[str | int]) -> str:
    path = name
    for part in reversed(parts):
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.startswith((".", "[")):
            path += part
        elif part.isidentifier():
            path += f".{part}"
        else:
            path += f"[{part!r}]"
    return path


def _error(cls: type[Exception], kind: str, name: str, exc: _Invalid, row: int | None = None) -> Exception:
    where = "" if row is None else f"row {row}: "
    return cls(f"{kind}: {where}argument {_path(name, exc.path)!r} {exc.message}")


def schema(kind: str, func: Callable[..., Any]) -> Schema | None:
    """The schema of a handler's annotations; None when none is annotated (its args are not checked).

    Raises TypeError naming the parameter for an annotation that cannot be
    stored as JSON, or that does not resolve.
    """
    annotated = [
        p
        for p in inspect.signature(func).parameters.values()
        if p.annotation is not p.empty and p.kind not in (p.VAR_POSITIONAL, p.POSITIONAL_ONLY)
    ]
    if not annotated:
        return None
    compiler = _Compiler()
    try:
        # The signature's, not get_type_hints': it sees through functools.wraps and partial.
        try:
            hints = inspect.signature(func, eval_str=True).parameters
        except Exception as exc:  # NameError for a name only imported under TYPE_CHECKING, ...
            name = getattr(func, "__qualname__", repr(func))
            # Not a type fastjobs cannot store: the list of those it can would mislead.
            raise TypeError(
                f"{kind}: the annotations of {name}, which do not resolve ({exc}), are read when"
                " the handler is registered: define or import what they name before it (a class"
                " defined further down the module, or imported only under TYPE_CHECKING, is not"
                " there yet), or annotate the parameter Any to take raw JSON"
            ) from None
        nodes: dict[str, Node] = {}
        extra: Node | None = None
        for p in annotated:
            node = compiler.node(hints[p.name].annotation, f"parameter {p.name!r}")
            if p.kind is p.VAR_KEYWORD:
                extra = node
            elif not node.is_any:
                nodes[p.name] = node
    except _Unsupported as exc:
        raise TypeError(
            f"{kind}: {exc}; fastjobs stores {SUPPORTED} (annotate Any to take raw JSON)"
        ) from None
    if not nodes and (extra is None or extra.is_any):
        return None
    return Schema(kind, nodes, extra)


def converter(spec: Any) -> Callable[..., Any] | None:
    """What a worker calls for `spec`'s jobs so its handler gets the annotated types; None: `spec.func`."""
    schema: Schema | None = spec.args_schema
    return None if schema is None else schema.converter(spec.func, spec.is_async)
