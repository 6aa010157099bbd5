"""Copies of a checkout whose loops' claims scan fewer slots: the seventh sitting of issue 22 §5.

    python bench/slot_variants.py TREE OUT {one,two}

Copies TREE (a checkout built in place) to OUT and appends to its fastjobs/sql.py
a rewrite of the loops' statement tables (sql.FINISH, COMPLETE, CLAIM_ONLY,
FINISH_RESULTS; with `one`, sql.LOCK too):
- one: every statement on slot 1 alone (`fastjobs_jobs_1` for `fastjobs_jobs_all`);
- two: the claims after the mark on slot 0 and slot 1, `slot IN (0, <an expression of $3
  that is 1>)` in their SELECT and UPDATE, which PostgreSQL prunes at executor start-up, as a
  loop sending the slots as parameters would have it (every partition is still locked).
Both are right only while slot 1 stays current: run them with the rotation off
(`bench/latency_rounds.sh ... 'one=OUT:{"rotate": false}'`). They measure what the five
partitions' start-up costs the pickup; they are not a design.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ONE = """

# bench/slot_variants.py (one): the loops' claim and finish statements on slot 1 alone.
def _variant(m: Any) -> Any:
    return MappingProxyType(
        {k: (n, t.replace("fastjobs_jobs_all", "fastjobs_jobs_1")) for k, (n, t) in m.items()}
    )


FINISH, COMPLETE = _variant(FINISH), _variant(COMPLETE)  # type: ignore[misc]
CLAIM_ONLY = _variant(CLAIM_ONLY)  # type: ignore[misc]
FINISH_RESULTS, LOCK = _variant(FINISH_RESULTS), _variant(LOCK)  # type: ignore[misc]
"""

TWO = """

# bench/slot_variants.py (two): claims after the mark on slots 0 and 1, pruned at start-up.
_SLOTS = "slot IN (0::smallint, (1 + 0 * length($3))::smallint)"


def _variant(m: Any) -> Any:
    out = {}
    for k, (n, t) in m.items():
        if k[1]:  # after the mark
            t = t.replace("AND limit_key IS NULL\\n", f"AND limit_key IS NULL AND {_SLOTS}\\n")
            t = t.replace(" WHERE j.id = ANY(ARRAY(", f" WHERE j.{_SLOTS} AND j.id = ANY(ARRAY(")
        out[k] = (n, t)
    return MappingProxyType(out)


FINISH, COMPLETE = _variant(FINISH), _variant(COMPLETE)  # type: ignore[misc]
CLAIM_ONLY = _variant(CLAIM_ONLY)  # type: ignore[misc]
FINISH_RESULTS = _variant(FINISH_RESULTS)  # type: ignore[misc]
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tree", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("variant", choices=["one", "two"])
    args = parser.parse_args()
    shutil.copytree(args.tree, args.out, ignore=shutil.ignore_patterns(".git", ".ci-venv*"))
    with open(args.out / "fastjobs" / "sql.py", "a") as f:
        f.write(ONE if args.variant == "one" else TWO)
    return 0


if __name__ == "__main__":
    sys.exit(main())
