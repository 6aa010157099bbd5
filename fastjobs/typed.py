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
import enum
import inspect
import sys
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Annotated, Any, Literal, NewType, Union

from .conversions import (
    ANY,
    RICH,
    SCALARS,
    SUPPORTED,
    Invalid,
    Node,
    Unsupported,
    fixed_tuple,
    literal,
    mapping,
    of_enum,
    of_msgspec,
    of_pydantic,
    record,
    sequence,
    union,
)
from .errors import InvalidArguments

__all__ = ["Compiler", "Schema", "converter", "schema"]

# The compiler -------------------------------------------------------------


class Compiler:
    """Annotations to nodes, each class compiled once (a record may refer to itself)."""

    def __init__(self) -> None:
        self.known: dict[Any, Node] = {}

    def hints(self, obj: Any) -> dict[str, Any]:
        try:
            return typing.get_type_hints(obj)
        except Exception as exc:  # NameError for a name only imported under TYPE_CHECKING, ...
            raise Unsupported(
                f"the annotations of {obj.__qualname__}, which do not resolve ({exc})"
            ) from None

    def node(self, hint: Any, where: str) -> Node:
        try:
            return self._node(hint)
        except Unsupported as exc:
            raise Unsupported(f"{where}: {exc}") from None

    def _node(self, hint: Any) -> Node:
        if hint is Any or hint is object:
            return ANY
        node = SCALARS.get(hint) or RICH.get(hint) or self.known.get(hint)
        if node is not None:
            return node
        origin = typing.get_origin(hint)
        args = typing.get_args(hint)
        if origin is Annotated:
            return self._node(args[0])
        if origin is Union or origin is types.UnionType:
            return union([self._node(a) for a in args])
        if origin is Literal:
            return literal(args)
        if hint is list or origin is list:
            return sequence("list", list, self._node(args[0]) if args else ANY, None)
        if hint in (set, frozenset) or origin in (set, frozenset):
            kind = hint if origin is None else origin
            return sequence(kind.__name__, (set, frozenset), self._node(args[0]) if args else ANY, kind)
        if hint is tuple or origin is tuple:
            if not args or (len(args) == 2 and args[1] is Ellipsis):
                return sequence("tuple", tuple, self._node(args[0]) if args else ANY, tuple)
            if args == ((),):
                return fixed_tuple([])
            return fixed_tuple([self._node(a) for a in args])
        if hint is dict or origin is dict:
            if args and args[0] is not str:
                raise Unsupported(f"{hint!r}: JSON object keys are strings, so dict keys must be str")
            return mapping(self._node(args[1]) if args else ANY)
        if isinstance(hint, NewType):
            return self._node(hint.__supertype__)
        if isinstance(hint, type):
            if issubclass(hint, enum.Enum):
                node = self.known[hint] = of_enum(hint)
                return node
            if dataclasses.is_dataclass(hint) or typing.is_typeddict(hint):
                return record(hint, self, self.known)
            msgspec = sys.modules.get("msgspec")
            if msgspec is not None and issubclass(hint, msgspec.Struct):
                node = self.known[hint] = of_msgspec(hint, msgspec)
                return node
            pydantic = sys.modules.get("pydantic")
            if pydantic is not None and issubclass(hint, pydantic.BaseModel):
                node = self.known[hint] = of_pydantic(hint, pydantic)
                return node
        raise Unsupported(f"{hint!r} is no type fastjobs can store as JSON")


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
        except Invalid as exc:
            raise _error(exc.error, self.kind, name, exc, row) from None
        return args if out is None else out

    def decode(self, name: str, value: Any) -> Any:
        """One stored argument as its handler gets it; InvalidArguments if it does not convert."""
        node = self._nodes.get(name, self._extra)
        if node is None or node.is_any:
            return value
        try:
            return node.decode(value)
        except Invalid as exc:
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
            except Invalid as exc:
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


def _error(cls: type[Exception], kind: str, name: str, exc: Invalid, row: int | None = None) -> Exception:
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
    compiler = Compiler()
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
    except Unsupported as exc:
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
