"""The dashboard over HTTP: a real `fastjobs web` (uvicorn) and a real client (httpx), on a real database.

Its pages, their escaping of hostile job input, CSRF, read-only mode,
authentication off loopback, the DSN kept out of every page, the bulk
operations by filter, and the reads behind the pages (the jobs list's
window, the overview's estimates, the leader's samples).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any
from unittest import mock

import httpx
import psycopg
import pytest

from fastjobs import App, control, samples, schema, sql
from fastjobs.cli import main
from fastjobs.web import reads
from fastjobs.web.bulk import Operations
from tests import procs
from tests.helpers import query
from tests.procs import wait_for
from tests.web_server import free_port, web

HOSTILE = [
    "<script>alert(1)</script>",
    '"><img src=x onerror=alert(2)>',
    "' onmouseover='alert(3)",
    "\x1b[31mred\x07\u200b\ufeff",
    "Ã©Ã¨ \ufffd\ufffd mojibake, and \\xff\\xfe as text",
    "é" * 3000,
]
KIND = '<script>alert("kind")</script>'


def _hostile_job(dsn: str) -> int:
    """A discarded job whose kind, queue, args, meta and errors are each an attack on the page."""
    errors = [
        {"at": "2026-01-01T00:00:00Z", "attempt": 1, "error": HOSTILE[0], "traceback": "\n".join(HOSTILE)},
    ]
    rows = query(
        dsn,
        """INSERT INTO fastjobs_jobs (queue, kind, args, meta, state, errors, finalized_at)
           VALUES (%s, %s, %s::jsonb, %s::jsonb, 'discarded', %s::jsonb, now()) RETURNING id""",
        ("q<u>", KIND, json.dumps({"x": HOSTILE}), json.dumps({"m": HOSTILE[1]}), json.dumps(errors)),
    )
    return int(rows[0]["id"])


def _no_live_markup(body: str) -> None:
    """None of the hostile text comes through as markup; it is there, escaped."""
    for attack in ("<script>alert", "<img src=x", "onerror=alert(2)>", "' onmouseover='", "<u>"):
        assert attack not in body
    assert "\x1b" not in body and "\x07" not in body


def _state(dsn: str, job_id: int) -> str:
    return str(query(dsn, "SELECT state::text FROM fastjobs_jobs_all WHERE id = %s", (job_id,))[0]["state"])


def _client(base: str, **kwargs: Any) -> httpx.Client:
    return httpx.Client(base_url=base, timeout=10, follow_redirects=False, **kwargs)


def _csrf(client: httpx.Client, path: str) -> str:
    """The CSRF token a page's forms carry (the cookie is set on the client by the same answer)."""
    page = client.get(path)
    assert page.status_code == 200, page.text
    found = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert found, page.text
    return found.group(1)


def test_every_page_escapes_what_comes_from_jobs(dsn: str, tmp_path: Path) -> None:
    job_id = _hostile_job(dsn)
    with web(dsn, tmp_path) as base, _client(base) as client:
        for path in ("/", "/jobs", f"/jobs/{job_id}", "/jobs?state=discarded", "/engine", "/periodic"):
            page = client.get(path)
            assert page.status_code == 200, (path, page.text)
            assert page.headers["content-security-policy"].startswith("default-src 'none'")
            _no_live_markup(page.text)
        job_page = client.get(f"/jobs/{job_id}").text
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in job_page
        assert "&#34;&gt;&lt;img src=x onerror=alert(2)&gt;" in job_page
        assert "\\x1b[31mred\\x07" in job_page  # control characters print as \xNN
        assert "é" * 3000 in job_page  # long text whole on the job's page
        assert "Ã©Ã¨ \ufffd\ufffd mojibake, and \\xff\\xfe as text" in job_page  # as it is stored
        listing = client.get("/jobs").text
        assert "é" * 3000 not in listing  # and cut in the list
        assert "&lt;script&gt;alert(&#34;kind&#34;)&lt;/script&gt;" in listing
        # a search on a hostile value is escaped back into the form
        found = client.get("/jobs", params={"args": json.dumps({"x": [HOSTILE[1]]})})
        assert found.status_code == 200
        _no_live_markup(found.text)
        assert f'href="/jobs/{job_id}"' in found.text


def test_the_dsn_is_never_shown(dsn: str, tmp_path: Path) -> None:
    """Not on a page, not in an error: the server's trust authentication ignores the password."""
    secret_dsn = f"{dsn} password=s3cr3t-pw application_name=s3cr3t-app"
    with web(secret_dsn, tmp_path) as base, _client(base) as client:
        bodies = [client.get(p).text for p in ("/", "/jobs", "/jobs/12345", "/engine", "/periodic")]
    assert all("s3cr3t" not in body for body in bodies)
    assert "no job with id 12345" in bodies[2]
    with web(dsn, tmp_path) as base, _client(base) as client:
        assert client.get(f"/jobs/{2**70}").status_code == 404  # past bigint: no job, not an error
        assert client.get("/jobs?before=99999999999999999999999").status_code == 200


def test_a_write_needs_the_csrf_token_of_its_browser(app: App, dsn: str, tmp_path: Path) -> None:
    app.declare("mail.send")
    job_id = app.enqueue("mail.send", args={"to": 1}, delay=3600)
    with web(dsn, tmp_path) as base, _client(base) as client:
        token = _csrf(client, f"/jobs/{job_id}")
        # no token, another token, no cookie, a foreign Origin: all refused, the job untouched
        assert client.post(f"/jobs/{job_id}/cancel", data={}).status_code == 403
        assert client.post(f"/jobs/{job_id}/cancel", data={"csrf": "x" * 43}).status_code == 403
        with _client(base) as stranger:
            assert stranger.post(f"/jobs/{job_id}/cancel", data={"csrf": token}).status_code == 403
        foreign = client.post(
            f"/jobs/{job_id}/cancel", data={"csrf": token}, headers={"origin": "https://evil.example"}
        )
        assert foreign.status_code == 403
        assert _state(dsn, job_id) == "scheduled"
        done = client.post(f"/jobs/{job_id}/cancel", data={"csrf": token})
        assert done.status_code == 303, done.text
        assert _state(dsn, job_id) == "cancelled"
        # the page it leads to says what happened
        assert f"job {job_id}: cancelled" in client.get(done.headers["location"]).text
        # an operation on a job in a state it does not act on is refused with why, and changes nothing
        query(dsn, "UPDATE fastjobs_jobs_all SET state = 'running' WHERE id = %s", (job_id,))
        again = client.post(f"/jobs/{job_id}/delete", data={"csrf": token})
        assert again.status_code == 409 and "a running job cannot be deleted" in again.text
        assert client.post(f"/jobs/{job_id}/explode", data={"csrf": token}).status_code == 404


def test_read_only_hides_and_refuses_every_write(app: App, dsn: str, tmp_path: Path) -> None:
    app.declare("mail.send")
    job_id = app.enqueue("mail.send", args={"to": 1}, delay=3600)
    with web(dsn, tmp_path, "--read-only") as base, _client(base) as client:
        for path in ("/", "/jobs", f"/jobs/{job_id}", "/engine"):
            page = client.get(path).text
            assert 'method="post"' not in page and "read-only" in page
        token = _csrf_cookie(client)
        for path, data in (
            (f"/jobs/{job_id}/cancel", {}),
            (f"/jobs/{job_id}/delete", {}),
            ("/jobs/bulk", {"action": "cancel"}),
        ):
            refused = client.post(path, data={"csrf": token, **data})
            assert refused.status_code == 403 and "read-only" in refused.text
        assert client.get("/jobs/bulk", params={"action": "cancel"}).status_code == 403
    assert _state(dsn, job_id) == "scheduled"


def _csrf_cookie(client: httpx.Client) -> str:
    client.get("/")
    return str(client.cookies["fastjobs_csrf"])


def test_a_public_address_needs_authentication(dsn: str, tmp_path: Path) -> None:
    command = ["--dsn", dsn, "web", "--host", "0.0.0.0", "--port", str(free_port())]
    refused = subprocess.run(
        [sys.executable, "-m", "fastjobs.cli", *command],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("FASTJOBS_WEB")},
    )
    assert refused.returncode == 3, refused.stderr
    assert "will not serve 0.0.0.0" in refused.stderr and "--auth" in refused.stderr

    env = {"FASTJOBS_WEB_AUTH": "ops:pw-1", "FASTJOBS_WEB_TOKEN": "tok-2"}
    with web(dsn, tmp_path, env=env, host="0.0.0.0") as base:
        for path in ("/", "/jobs", "/static/style.css", "/jobs/1"):
            answer = httpx.get(base + path)
            assert answer.status_code == 401 and "basic" in answer.headers["www-authenticate"].lower()
            assert "fastjobs_csrf" not in answer.headers.get("set-cookie", "")
        assert httpx.get(base + "/", auth=("ops", "wrong")).status_code == 401
        assert httpx.get(base + "/", auth=("wrong", "pw-1")).status_code == 401
        assert httpx.get(base + "/", headers={"authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(base + "/", headers={"authorization": "Basic !!!"}).status_code == 401
        assert httpx.get(base + "/", auth=("ops", "pw-1")).status_code == 200
        assert httpx.get(base + "/", headers={"authorization": "Bearer tok-2"}).status_code == 200


def _finished(page: str) -> str | None:
    return page if "done." in page else None


def test_a_bulk_operation_acts_on_every_match_not_only_the_page(app: App, dsn: str, tmp_path: Path) -> None:
    """120 matching jobs (more than a page of 50) cancelled by filter, in the order of the command
    line's operation: the jobs of another args value, queue or state are left alone."""
    app.declare("mail.send")
    app.enqueue_many("mail.send", [{"batch": 7, "n": i} for i in range(120)], delay=3600)
    app.enqueue_many("mail.send", [{"batch": 8, "n": i} for i in range(5)], delay=3600)
    app.enqueue_many("mail.send", [{"batch": 7, "n": i} for i in range(3)], delay=3600, queue="other")
    filters = {"state": "scheduled", "queue": "default", "args": '{"batch": 7}'}
    with web(dsn, tmp_path) as base, _client(base) as client:
        listing = client.get("/jobs", params=filters).text
        assert listing.count('<tr class="state-scheduled">') == reads.PAGE
        confirm = client.get("/jobs/bulk", params={**filters, "action": "cancel"})
        assert "every job matching state scheduled, queue default, args containing" in confirm.text
        token = re.search(r'name="csrf" value="([^"]+)"', confirm.text).group(1)  # type: ignore[union-attr]
        started = client.post("/jobs/bulk", data={**filters, "action": "cancel", "csrf": token})
        assert started.status_code == 303
        progress = started.headers["location"]
        done = wait_for(lambda: _finished(client.get(progress).text), "the operation to finish")
        assert "120 of 120 jobs: done." in done and "120 cancelled" in done
    counts = query(
        dsn,
        "SELECT queue, args->>'batch' AS batch, state::text, count(*) AS n FROM fastjobs_jobs_all"
        " GROUP BY 1, 2, 3 ORDER BY 1, 2, 3",
    )
    assert [(r["queue"], r["batch"], r["state"], r["n"]) for r in counts] == [
        ("default", "7", "cancelled", 120),
        ("default", "8", "scheduled", 5),
        ("other", "7", "scheduled", 3),
    ]


def test_a_bulk_operation_says_which_jobs_it_left(app: App, dsn: str, tmp_path: Path) -> None:
    """Discard by filter on running jobs: none acts (a running job is not discardable), and one it
    cannot act on (a state it acts on, but running by the time it comes) is named."""
    with web(dsn, tmp_path) as base, _client(base) as client:
        token = _csrf_cookie(client)
        answer = client.get("/jobs/bulk", params={"state": "running", "action": "discard"})
        assert "acts on jobs in available, cancelled, retryable, scheduled, not running" in answer.text
        assert client.post("/jobs/bulk", data={"action": "explode", "csrf": token}).status_code == 400
        bad = client.post("/jobs/bulk", data={"action": "retry", "args": "{nope", "csrf": token})
        assert bad.status_code == 400 and "not JSON" in bad.text


def test_the_jobs_list_reads_a_window_and_pages_by_id(app: App, dsn: str, monkeypatch: Any) -> None:
    app.declare("a.b")
    ids = [app.enqueue("a.b", args={"n": i, "tag": "even" if i % 2 == 0 else "odd"}) for i in range(30)]
    monkeypatch.setattr(reads, "PAGE", 4)
    monkeypatch.setattr(reads, "WINDOW", 10)
    with psycopg.connect(dsn, autocommit=True) as conn:
        page = reads.jobs_page(conn, reads.Filters(), None, sql)
        assert [j["id"] for j in page.jobs] == ids[::-1][:4] and page.next_before == ids[-4]
        page = reads.jobs_page(conn, reads.Filters(), page.next_before, sql)
        assert [j["id"] for j in page.jobs] == ids[::-1][4:8]
        # a filter matching one job in three: a page reads a window of 10 and stops there
        odd = reads.Filters(args={"tag": "odd"}, args_text='{"tag": "odd"}')
        seen: list[int] = []
        before = None
        for _ in range(20):
            page = reads.jobs_page(conn, odd, before, sql)
            assert page.read <= 10
            seen += [j["id"] for j in page.jobs]
            before = page.next_before
            if before is None:
                break
        assert seen == [i for n, i in enumerate(ids) if n % 2 == 1][::-1]
        assert reads.jobs_page(conn, reads.Filters(state="completed"), None, sql).jobs == []
        # nothing matches: each page reads its window and says where it stopped, down to the oldest
        page = reads.jobs_page(conn, reads.Filters(kind="a.b", queue="nope"), None, sql)
        assert page.jobs == [] and page.read == 10 and page.window_end == page.next_before == ids[-10]
        page = reads.jobs_page(conn, reads.Filters(kind="a.b", queue="nope"), ids[9], sql)
        assert page.jobs == [] and page.read == 9 and page.next_before is None


def test_the_overview_estimates_big_states_and_counts_small_ones(app: App, dsn: str, monkeypatch: Any):
    app.declare("a.b")
    app.enqueue_many("a.b", [{"n": i} for i in range(40)])
    app.enqueue_many("a.b", [{"n": i} for i in range(3)], delay=600, queue="later")
    with psycopg.connect(dsn, autocommit=True) as conn:
        exact, is_exact = reads.depths(conn, 43, sql)
        assert is_exact and exact["default"].counts == {"available": 40}
        assert exact["later"].counts == {"scheduled": 3}
        # as on a big table: states of at most BOUND jobs counted, the others sampled (here: all pages)
        monkeypatch.setattr(reads, "BOUND", 10)
        monkeypatch.setattr(reads, "SAMPLE_ROWS", 10**9)
        found, is_exact = reads.depths(conn, reads.EXACT_BELOW, sql)
        assert not is_exact
        assert found["default"].counts == {"available": 40} and found["default"].estimated == {"available"}
        # "later" has no available job the sample found: estimated too, shown as fewer than `below`
        assert found["later"].counts == {"scheduled": 3} and found["later"].estimated == {"available"}
        assert found["later"].below == 1  # a sample of every page: each row stands for one
        assert found["default"].oldest_available is not None and found["default"].oldest_estimated


def test_samples_sum_the_heartbeats_and_stay_bounded(dsn: str) -> None:
    def beat(worker: str, completed: int, retried: int) -> None:
        counters = {"kinds": [["q1", "k", completed, retried, 1, 0, 0]], "completed": completed}
        query(
            dsn,
            "INSERT INTO fastjobs_workers (id, host, pid, queues, counters) VALUES (%s, 'h', 1, '{q1}', %s)"
            " ON CONFLICT (id) DO UPDATE SET counters = excluded.counters",
            (worker, json.dumps(counters)),
        )

    start = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    config = samples.SamplesConfig(retention=60.0)
    with psycopg.connect(dsn, autocommit=True) as conn:
        beat("w1", 10, 2)
        beat("w2", 5, 0)
        assert samples.run_once(conn, start, config) == {"written": 1, "pruned": 0}
        beat("w1", 70, 4)
        assert samples.run_once(conn, start + dt.timedelta(seconds=30), config)["written"] == 1
        rows = query(dsn, "SELECT at, queue, completed, failed FROM fastjobs_samples ORDER BY at")
        assert [(r["queue"], r["completed"], r["failed"]) for r in rows] == [("q1", 15, 4), ("q1", 75, 6)]
        beat("w2", 0, 0)  # restarted: its sum falls
        assert samples.run_once(conn, start + dt.timedelta(seconds=90), config) == {"written": 1, "pruned": 1}
        beat("w1", 100, 4)
        samples.run_once(conn, start + dt.timedelta(seconds=150), samples.SamplesConfig(retention=3600.0))
        # the overview's chart, per minute between samples: 60/30 s, a fall read as nothing, 30/60 s
        conn.execute("UPDATE fastjobs_samples SET at = at + (now() - %s)", (start,))  # into the last hour
        found: dict[str, reads.QueueRow] = {}
        reads._charts(conn, found, sql)
        assert found["q1"].completed == [0.0, 30.0] and found["q1"].failed == [0.0, 0.0]


def test_control_delete_and_the_command_line_share_the_operation(app: App, dsn: str) -> None:
    app.declare("a.b")
    ids = [app.enqueue("a.b", args={"n": i}) for i in range(3)]
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert control.act(conn, "delete", ids[0]) == ("deleted", {"id": ids[0], "state": "deleted"})
        assert control.act(conn, "cancel", ids[1])[0] == "cancelled"
        selection = control.select(conn, control.ACTS_ON["delete"], args={"n": 2})
        assert list(control.pages(conn, selection)) == [[ids[2]]]
        conn.execute("UPDATE fastjobs_jobs_all SET state = 'running' WHERE id = %s", (ids[2],))
        with pytest.raises(ValueError, match="running job cannot be deleted"):
            control.delete(conn, ids[2])
    assert [r["id"] for r in query(dsn, "SELECT id FROM fastjobs_jobs_all ORDER BY id")] == ids[1:]
    assert "job_delete" in sql.STATEMENTS


MOUNTED = """
import fastjobs
from fastjobs.web import asgi_app
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, Route

app = fastjobs.App()
api = Starlette(routes=[
    Route("/", lambda request: PlainTextResponse("the application")),
    Mount("/ops/jobs", app=asgi_app(app, token="t0k")),
])
"""


def test_asgi_app_mounted_in_an_application_answers_under_its_path(dsn: str, tmp_path: Path) -> None:
    (tmp_path / "mounted.py").write_text(textwrap.dedent(MOUNTED))
    port = free_port()
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    env = {**os.environ, "FASTJOBS_DSN": psycopg.conninfo.make_conninfo(**info)}  # type: ignore[arg-type]
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "mounted:api", "--port", str(port)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            try:
                return httpx.get(base + "/").status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, "uvicorn")
        assert httpx.get(base + "/ops/jobs/").status_code == 401
        page = httpx.get(base + "/ops/jobs/jobs", headers={"authorization": "Bearer t0k"})
        assert page.status_code == 200
        assert 'href="/ops/jobs/static/style.css"' in page.text and 'href="/ops/jobs/jobs"' in page.text
        css = httpx.get(base + "/ops/jobs/static/style.css", headers={"authorization": "Bearer t0k"})
        assert css.status_code == 200 and "tabular-nums" in css.text
    finally:
        proc.terminate()
        proc.wait(30)


def _queue(dsn: str, name: str) -> dict[str, Any] | None:
    statement = "SELECT paused_at, concurrency, rate_limit, max_backlog FROM fastjobs_queues WHERE name = %s"
    rows = query(dsn, statement, (name,))
    return rows[0] if rows else None


def test_queues_are_paused_resumed_and_limited_as_the_command_line_does(app: App, dsn: str, tmp_path: Path):
    app.declare("mail.send", queue="mail")
    app.enqueue("mail.send", {"to": 1}, delay=3600)
    with web(dsn, tmp_path) as base, _client(base) as client:
        page = client.get("/queues").text
        assert "mail" in page and "running" in page
        token = _csrf(client, "/queues")
        assert client.post("/queues", data={"action": "pause", "queue": "mail"}).status_code == 403
        assert _queue(dsn, "mail") is None
        paused = client.post("/queues", data={"action": "pause", "queue": "mail", "csrf": token})
        assert paused.status_code == 303
        assert _queue(dsn, "mail")["paused_at"] is not None  # type: ignore[index]
        assert "queue mail: paused since" in client.get(paused.headers["location"]).text
        assert 'class="badge paused"' in client.get("/").text
        limited = client.post(
            "/queues",
            data={
                "action": "limit",
                "queue": "mail",
                "concurrency": "3",
                "rate_limit": "200/min",
                "max_backlog": "500",
                "csrf": token,
            },
        )
        assert limited.status_code == 303, limited.text
        assert _queue(dsn, "mail") == {
            **{"paused_at": mock.ANY, "concurrency": 3},
            **{"rate_limit": "200/min", "max_backlog": 500},
        }
        said = client.get(limited.headers["location"]).text
        assert "queue mail: concurrency 3, rate_limit 200/min, max_backlog 500" in said
        for bad in ("-1", "0", "1e3", "9" * 30, str(2**31)):
            refused = client.post(
                "/queues", data={"action": "limit", "queue": "mail", "max_backlog": bad, "csrf": token}
            )
            assert refused.status_code == 400 and "max_backlog" in refused.text
        assert _queue(dsn, "mail")["max_backlog"] == 500  # type: ignore[index]
        client.post("/queues", data={"action": "limit", "queue": "mail", "csrf": token})  # all empty: none
        assert _queue(dsn, "mail") == {
            **{"paused_at": mock.ANY, "concurrency": None},
            **{"rate_limit": None, "max_backlog": None},
        }
        bad_rate = client.post(
            "/queues", data={"action": "limit", "queue": "mail", "rate_limit": "<b>fast</b>", "csrf": token}
        )
        assert bad_rate.status_code == 400 and "&lt;b&gt;fast&lt;/b&gt;" in bad_rate.text
        bad_rate = client.post(
            "/queues", data={"action": "limit", "queue": "mail", "rate_limit": "<b>fast</b>", "csrf": token}
        )
        assert bad_rate.status_code == 400 and "&lt;b&gt;fast&lt;/b&gt;" in bad_rate.text
        resumed = client.post("/queues", data={"action": "resume", "queue": "mail", "csrf": token})
        assert resumed.status_code == 303 and _queue(dsn, "mail")["paused_at"] is None  # type: ignore[index]
        bad_queue = client.post("/queues", data={"action": "pause", "queue": "q" * 200, "csrf": token})
        assert bad_queue.status_code == 400 and "at most 128 characters" in bad_queue.text
    with web(dsn, tmp_path, "--read-only") as base, _client(base) as client:
        assert 'method="post"' not in client.get("/queues").text
        token = _csrf_cookie(client)
        refused = client.post("/queues", data={"action": "pause", "queue": "mail", "csrf": token})
        assert refused.status_code == 403 and _queue(dsn, "mail")["paused_at"] is None  # type: ignore[index]


def test_the_engine_page_gives_each_queue_its_lane_and_why(dsn: str) -> None:
    app = App(dsn)

    @app.job(queue="quick")
    def quick() -> None: ...

    @app.job(queue="slow", timeout=2.5)
    def bounded() -> None: ...

    @app.job(queue="slow")
    async def waits() -> None: ...

    found = {lane.queue: lane for lane in reads.lanes(app)}
    assert found["quick"].lane == "fast" and "every kind is sync" in found["quick"].why
    assert found["slow"].lane == "state"
    assert found["slow"].why == f"{bounded.kind} is timeout=2.5, {waits.kind} is async"


# -- an App in a schema of its own


def test_the_dashboard_shows_the_jobs_of_its_apps_schema_not_the_default_ones(
    app: App, dsn: str, tmp_path: Path
) -> None:
    """`fastjobs web --schema tenant` beside the default schema's jobs, whose ids are the same (each
    schema has its own sequence): every page reads, and every write acts, in the tenant's schema."""
    with psycopg.connect(dsn) as conn:
        schema.migrate(conn, schema="tenant")
    tenant = App(dsn, schema="tenant")
    try:
        tenant.declare("bill.charge", queue="billing")
        app.declare("mail.send", queue="mailq")
        mine = [tenant.enqueue("bill.charge", {"who": "tenant", "n": n}, delay=3600) for n in range(3)]
        theirs = [app.enqueue("mail.send", {"who": "default", "n": n}, delay=3600) for n in range(3)]
        assert mine == theirs  # the same ids: a page reading the wrong schema shows the wrong job
        with web(dsn, tmp_path, "--schema", "tenant") as base, _client(base) as client:
            for path in ("/", "/jobs", "/queues", "/engine", "/periodic"):
                page = client.get(path)
                assert page.status_code == 200, (path, page.text)
                assert "mailq" not in page.text and "mail.send" not in page.text, path
            assert "billing" in client.get("/").text
            assert client.get("/jobs").text.count("bill.charge") == 3
            job_page = client.get(f"/jobs/{mine[0]}").text
            assert "bill.charge" in job_page and "tenant" in job_page
            token = _csrf(client, f"/jobs/{mine[0]}")
            assert client.post(f"/jobs/{mine[0]}/retry", data={"csrf": token}).status_code == 303
            assert client.post("/queues", data={"action": "pause", "queue": "billing", "csrf": token})
            started = client.post(
                "/jobs/bulk",
                data={"action": "cancel", "queue": "billing", "state": "scheduled", "csrf": token},
            )
            done = wait_for(lambda: _finished(client.get(started.headers["location"]).text), "the cancel")
            assert "2 of 2 jobs: done." in done
    finally:
        tenant.close()
    tenant_rows = query(dsn, "SELECT id, state::text FROM tenant.fastjobs_jobs_all ORDER BY id")
    assert [r["state"] for r in tenant_rows] == ["available", "cancelled", "cancelled"]
    assert query(dsn, "SELECT name FROM tenant.fastjobs_queues WHERE paused_at IS NOT NULL") == [
        {"name": "billing"}
    ]
    default_rows = query(dsn, "SELECT state::text FROM fastjobs_jobs_all ORDER BY id")
    assert [r["state"] for r in default_rows] == ["scheduled"] * 3
    assert query(dsn, "SELECT name FROM fastjobs_queues") == []


# -- operations by filter, page by page


def test_an_operation_by_filter_goes_page_by_page_and_leaves_later_jobs(
    app: App, dsn: str, monkeypatch: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Pages of 3 ids and counts of 4 jobs per statement over 10 matching jobs: the dashboard's
    operation and the command line's act on every match, never on a job enqueued after the
    selection, never reading more than a page of ids at a time."""
    monkeypatch.setattr(control, "SELECT_PAGE", 3)
    monkeypatch.setattr(control, "COUNT_PAGE", 4)
    app.declare("a.b")
    app.enqueue_many("a.b", [{"n": n, "tag": "x"} for n in range(10)], delay=3600)
    ids = query_ids(dsn, "scheduled")
    app.enqueue("a.b", {"tag": "y"}, delay=3600)
    with psycopg.connect(dsn, autocommit=True) as conn:
        selection = control.select(conn, control.ACTS_ON["cancel"], args={"tag": "x"})
        later = app.enqueue("a.b", {"tag": "x"}, delay=3600)
        assert control.count(conn, selection) == 10
        assert [len(p) for p in control.pages(conn, selection)] == [3, 3, 3, 1]
    # The dashboard's, on its thread.
    operations = Operations(app.connection, lambda: app.sql)
    op = operations.start("cancel", reads.Filters(args={"tag": "x"}, args_text='{"tag": "x"}'))
    wait_for(lambda: not op.running, "the operation")
    assert (op.selected, op.done, op.states, op.crashed) == (11, 11, {"cancelled": 11}, None)
    assert later in query_ids(dsn, "cancelled")
    # The command line's: 12 retried (the 11 cancelled and one more), page by page.
    code = main(["--dsn", dsn, "jobs", "retry", "--state", "cancelled", "--yes"])
    assert code == 0, capsys.readouterr().err
    assert "retry of 11 jobs: 11 jobs available" in capsys.readouterr().err
    assert set(query_ids(dsn, "available")) == {*ids, later}


def query_ids(dsn: str, state: str) -> list[int]:
    return [
        int(r["id"]) for r in query(dsn, "SELECT id FROM fastjobs_jobs_all WHERE state::text = %s", (state,))
    ]


# -- the engine's own events, from a real worker

CAREFUL = '''
"""Jobs that fail, their failures held up by the database (SLOW_OUTCOME's trigger)."""

from fjjobs import _record, app


@app.job("poison")
def poison(n):
    _record(n)
    raise RuntimeError("held-outcome")
'''
# A trigger that holds up the statement writing the poison jobs' failures, so the worker can be
# killed while it writes them: a worker that dies writing several failed jobs' outcomes.
SLOW_OUTCOME = """
CREATE FUNCTION held_outcome() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.errors::text LIKE '%held-outcome%' THEN PERFORM pg_sleep(20); END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER held_outcome BEFORE UPDATE ON fastjobs_jobs_all FOR EACH ROW EXECUTE FUNCTION held_outcome();
"""


def _engine_page_with(client: httpx.Client, text: str) -> str | None:
    page = client.get("/engine").text
    return page if text in page else None


def test_a_slow_job_shows_on_the_engine_page_in_stats_and_metrics(
    masters: procs.Masters, app: App, dsn: str, tmp_path: Path
) -> None:
    """A job that runs 3 s in a batch of quick ones: the guard hands back the jobs behind it, and
    the worker's heartbeat carries that to the engine page, `fastjobs stats` and the metrics."""
    app.enqueue_many("record", ({"n": n} for n in range(40)))
    app.enqueue("record", {"n": 99, "sleep": 3.0})
    app.enqueue_many("record", ({"n": n} for n in range(100, 140)))
    port = free_port()
    master = masters.start("--processes", "1", "--metrics-port", str(port))
    with web(dsn, tmp_path) as base, _client(base) as client:
        page = wait_for(
            lambda: _engine_page_with(client, '<tr class="slow-queue"><td>default</td>'),
            "the slow job on the engine page",
        )
        assert "none: no live worker has met a slow job" not in page
    found = procs.stats_json(dsn)["slow_jobs"]
    assert [(e["queue"], e["slow_jobs"] >= 1) for e in found] == [("default", True)]
    text = procs.cli(dsn, "stats").stdout
    assert "slow jobs (handed back by the guard)" in text
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    assert re.search(
        r'^fastjobs_cluster_slow_jobs_total\{host="[^"]+",queue="default"\} [1-9]', metrics, re.M
    )
    assert master.stop() == 0, master.stderr()


def test_careful_mode_shows_on_the_engine_page_and_in_stats(
    masters: procs.Masters, app: App, dsn: str, db: psycopg.Connection[Any], tmp_path: Path
) -> None:
    """A worker killed while it writes two failed jobs' outcomes: its replacement runs in careful
    mode, which the engine page and `fastjobs stats` show."""
    (tmp_path / "carefuljobs.py").write_text(CAREFUL)
    db.execute(SLOW_OUTCOME)
    app.enqueue_many("poison", ({"n": n} for n in range(2)))
    # Two threads: the first claim takes both; a long --rescue-after keeps them from running again.
    master = masters.start(
        "--processes", "1", "--queues", "default:2", "--rescue-after", "120", module="carefuljobs"
    )
    sleeping = (
        "SELECT pid FROM pg_stat_activity WHERE wait_event = 'PgSleep' AND datname = current_database()"
    )
    try:
        wait_for(lambda: db.execute(sleeping).fetchall(), "the worker to write the two failures")
        (pid,) = db.execute("SELECT pid FROM fastjobs_workers").fetchone()  # type: ignore[misc]
        os.kill(pid, signal.SIGKILL)
        master.wait_stderr(
            "died writing the outcomes of 2 failed jobs; its replacement runs one job per batch"
        )
        with web(dsn, tmp_path) as base, _client(base) as client:
            page = wait_for(
                lambda: _engine_page_with(client, 'class="careful-worker"'), "careful mode on the page"
            )
            assert re.search(r"ago</td><td>\d", page), page  # began ... ago, and the seconds left
        careful = procs.stats_json(dsn)["careful_workers"]
        assert len(careful) == 1 and 0 < careful[0]["left"] <= 60, careful
        assert "careful mode: worker" in procs.cli(dsn, "stats").stdout
        assert master.stop() == 0, master.stderr()
    finally:
        db.execute(f"SELECT pg_terminate_backend(pid) FROM ({sleeping}) AS s")
