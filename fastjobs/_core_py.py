"""The hot path in plain Python: the readable reference `_core.pyx` matches name for name."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import orjson

from .errors import args_error

IMPLEMENTATION = "python"

_JSONB_VERSION = b"\x01"


def dump_args(
    kind: str, args: Any, params: frozenset[str] | None, required: frozenset[str]
) -> bytes:
    """Check one job's arguments against its handler and serialise them with orjson."""
    if type(args) is not dict:
        if not isinstance(args, Mapping):
            raise args_error(kind, f"args must be a mapping of argument names, not {type(args).__name__}")
        args = dict(args)
    if params is not None and not params.issuperset(args):
        unknown = sorted(str(k) for k in args if k not in params)
        raise args_error(kind, f"unexpected argument(s) {', '.join(unknown)}")
    if not required.issubset(args):
        missing = sorted(required.difference(args))
        raise args_error(kind, f"missing argument(s) {', '.join(missing)}")
    try:
        return orjson.dumps(args)
    except TypeError as exc:
        raise args_error(kind, str(exc)) from None


def encode_copy_rows(
    kind: str,
    rows: Iterator[Any],
    prefix: bytes,
    suffix: bytes,
    limit: int,
    params: frozenset[str] | None,
    required: frozenset[str],
) -> tuple[bytes, int]:
    """Encode up to `limit` rows of binary COPY data: prefix, the args as jsonb, suffix.

    Every column but args is the same for the whole call, so the caller
    encodes it once into prefix and suffix. Returns the data and the row count
    (0 when `rows` is exhausted).
    """
    parts: list[bytes] = []
    count = 0
    for args in rows:
        data = dump_args(kind, args, params, required)
        parts.append(prefix)
        parts.append((len(data) + 1).to_bytes(4, "big"))
        parts.append(_JSONB_VERSION)
        parts.append(data)
        parts.append(suffix)
        count += 1
        if count == limit:
            break
    return b"".join(parts), count
