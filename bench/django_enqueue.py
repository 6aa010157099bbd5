"""What a task enqueue costs inside a Django `atomic()` block, beside a plain `Model.objects.create`.

The test project (tests/django_project) on a database of its own, created
next to the one in FASTJOBS_DSN and migrated with `manage.py migrate`. Each
round, in one run and alternating: K `Order.objects.create()` in one
`atomic()` block; K `add.enqueue()` (a Django task on fastjobs' backend) in
one block; K of the same job through `App.enqueue` on Django's connection
(fastjobs without Django's task API); and K of a view's pair (create, then enqueue) in one block. The
medians of the per-operation times are printed, and the ratio of an
enqueue to a create, first as Django connects (psycopg's automatic prepared
statements off), then with them on. Run (Django 6, Python >= 3.12):

    FASTJOBS_DSN=postgresql://postgres@127.0.0.1:5432/postgres python bench/django_enqueue.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

PROJECT = Path(__file__).resolve().parent.parent / "tests" / "django_project"
DATABASE = "fastjobs_bench_django"
K = 200  # operations per atomic() block
ROUNDS = 15


def main() -> None:
    server = os.environ.get("FASTJOBS_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {DATABASE}")
    os.environ["FASTJOBS_DJANGO_DSN"] = make_conninfo(server, dbname=DATABASE)
    os.environ["DJANGO_SETTINGS_MODULE"] = "djproject.settings"
    sys.path.insert(0, str(PROJECT))
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection, transaction

    from shop.models import Order
    from shop.tasks import add

    call_command("migrate", verbosity=0)
    connection.ensure_connection()

    def creates() -> None:
        with transaction.atomic():
            for i in range(K):
                Order.objects.create(email=f"u{i}@example.com")

    def enqueues() -> None:
        with transaction.atomic():
            for i in range(K):
                add.enqueue(i, i)

    backend = add.get_backend()

    def inserts() -> None:  # the same job through fastjobs alone, without Django's task API around it
        with transaction.atomic():
            conn = backend.connection()
            for i in range(K):
                backend.app.enqueue(add.module_path, {"args": [i, i], "kwargs": {}}, conn=conn)

    def pairs() -> None:
        with transaction.atomic():
            for i in range(K):
                order = Order.objects.create(email=f"u{i}@example.com")
                add.enqueue(order.id, i)

    contenders: dict[str, Callable[[], None]] = {
        "create": creates,
        "enqueue": enqueues,
        "app.enqueue": inserts,
        "create+enqueue": pairs,
    }
    info = conninfo_to_dict(os.environ["FASTJOBS_DJANGO_DSN"])
    print(f"database {info.get('host')}:{info.get('port')}/{DATABASE}, {K} operations per atomic() block,")
    print(f"median of {ROUNDS} rounds, microseconds per operation (Django {django.get_version()}):")
    # Django turns psycopg's automatic prepared statements off (prepare_threshold None, for
    # transaction-mode poolers); DATABASES' OPTIONS {"prepare_threshold": 5} turns them on.
    for threshold in (None, 5):
        connection.connection.prepare_threshold = threshold
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for run in contenders.values():  # warm-up: prepared statements, caches
            run()
        for _ in range(ROUNDS):
            for name, run in contenders.items():
                start = time.perf_counter()
                run()
                times[name].append((time.perf_counter() - start) / K * 1e6)
        median = {name: statistics.median(values) for name, values in times.items()}
        print(f"prepare_threshold={threshold}:")
        for name, value in median.items():
            print(f"  {name:16} {value:8.1f} us")
        print(f"  enqueue / create: {median['enqueue'] / median['create']:.2f}")
        print(f"  app.enqueue / create: {median['app.enqueue'] / median['create']:.2f}")
        print(f"  (create+enqueue) / create: {median['create+enqueue'] / median['create']:.2f}")
    connection.close()
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")


if __name__ == "__main__":
    main()
