from collections.abc import Iterator
from typing import Any

IMPLEMENTATION: str

def dump_args(kind: str, args: Any, params: frozenset[str] | None, required: frozenset[str]) -> bytes: ...
def encode_copy_rows(
    kind: str,
    rows: Iterator[Any],
    prefix: bytes,
    suffix: bytes,
    limit: int,
    params: frozenset[str] | None,
    required: frozenset[str],
) -> tuple[bytes, int]: ...
