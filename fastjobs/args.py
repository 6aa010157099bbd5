"""A job's arguments: checked against its handler's signature and serialised for jsonb.

The Python hot path uses `dump_args` and `encode_copy_rows` as they are; the C one (`_core.pyx`) runs
its fast checks inline and falls back to `dump_args` for the exact error message.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import orjson

__all__ = ["dump_args", "encode_copy_rows"]


def dump_args(kind: str, args: Any, params: frozenset[str] | None, required: frozenset[str]) -> bytes:
    """Check one job's arguments against its handler and serialise them with orjson."""
    if type(args) is not dict:
        if not isinstance(args, Mapping):
            raise _error(kind, f"args must be a mapping of argument names, not {type(args).__name__}")
        args = dict(args)
    if params is not None and not params.issuperset(args):
        unknown = sorted(str(k) for k in args if k not in params)
        raise _error(kind, f"unexpected argument(s) {', '.join(unknown)}")
    if not required.issubset(args):
        missing = sorted(required.difference(args))
        raise _error(kind, f"missing argument(s) {', '.join(missing)}")
    try:
        data = orjson.dumps(args)
    except TypeError as exc:
        key = _non_str_key(args)
        detail = f"dict keys must be str, not {type(key).__name__} ({key!r})" if key is not None else str(exc)
        raise _error(kind, detail) from None
    # jsonb cannot store NUL; failing here keeps the caller's transaction
    # usable. The byte search is the fast test, `_has_nul` the exact one (an
    # escaped backslash followed by "u0000" is no NUL).
    if b"\\u0000" in data and _has_nul(args):
        raise _error(kind, "strings cannot contain NUL (\\x00): PostgreSQL's jsonb cannot store it")
    return data


_JSONB_VERSION = b"\x01"


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


def _error(kind: str, detail: str) -> TypeError:
    """The TypeError every enqueue path raises for arguments it cannot store."""
    return TypeError(f"arguments of job kind {kind!r} cannot be enqueued: {detail}")


def _has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(_has_nul(v) for v in value)
    return False


def _non_str_key(value: Any) -> Any:
    """The first dict key that is not a str, anywhere in `value` (orjson's message does not name it)."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return key
            found = _non_str_key(item)
            if found is not None:
                return found
    elif isinstance(value, list | tuple):
        for item in value:
            found = _non_str_key(item)
            if found is not None:
                return found
    return None
