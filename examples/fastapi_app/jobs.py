"""The example's jobs: `fastjobs run jobs` (from this directory) runs them."""

from __future__ import annotations

import os

import psycopg

import fastjobs

DATABASE_URL = os.environ["DATABASE_URL"]  # postgresql://... (libpq's form)

app = fastjobs.App(DATABASE_URL)


# The outcome is kept an hour, for GET /jobs/{id}; pricing fails the same way every time: no retry.
@app.job(keep_result=3600, max_attempts=1)
def price_order(order_id: int, amounts: list[int]) -> int:
    total = sum(amounts)
    if total < 0:
        raise ValueError(f"order {order_id}: a negative total ({total})")
    with psycopg.connect(DATABASE_URL) as conn:
        conn.execute("UPDATE orders SET total = %s WHERE id = %s", (total, order_id))
    return total
