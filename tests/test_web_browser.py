"""The dashboard in a real browser: headless Chromium (Debian's, /usr/bin/chromium) through Playwright,
against `fastjobs web` and a real `fastjobs run` on a real database, checking the database after each step.

Screenshots of each step are saved in $FASTJOBS_WEB_SCREENSHOTS (.ci/run sets
it), else in the test's tmp_path.
"""

from __future__ import annotations

import json
import os
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from fastjobs import App
from tests.helpers import query
from tests.procs import Masters, wait_for
from tests.web_server import web

CHROMIUM = os.environ.get("FASTJOBS_CHROMIUM", "/usr/bin/chromium")

JOBS = '''
"""The jobs of the browser test: one that fails its first attempt, and jobs to cancel in bulk."""

import fastjobs

app = fastjobs.App()


@app.job(queue="mail", max_attempts=1, keep_result=3600)
def flaky(n: int) -> int:
    if fastjobs.current_job().attempt == 1:
        raise RuntimeError(f"flaky {n} failed on its first attempt <b>bold?</b>")
    return n * 2


@app.job(queue="bulk")
def later(batch: int, n: int) -> None:
    pass
'''


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM)
        yield chromium
        chromium.close()


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    where = Path(os.environ.get("FASTJOBS_WEB_SCREENSHOTS") or tmp_path / "screenshots")
    where.mkdir(parents=True, exist_ok=True)
    return where


def _rows(dsn: str, statement: str, *params: Any) -> list[dict[str, Any]]:
    return query(dsn, statement, params or None)


def test_an_operator_finds_a_failed_job_retries_it_cancels_a_filtered_set_and_pauses_a_queue(
    browser: Browser, dsn: str, tmp_path: Path, shots: Path
) -> None:
    (tmp_path / "webjobs.py").write_text(textwrap.dedent(JOBS))
    app = App(dsn)
    try:
        app.declare("webjobs.later", queue="bulk")
        app.declare("webjobs.flaky", queue="mail", max_attempts=1, keep_result=3600)
        app.enqueue_many("webjobs.later", [{"batch": 7, "n": i} for i in range(40)], delay=3600)
        app.enqueue_many("webjobs.later", [{"batch": 8, "n": i} for i in range(5)], delay=3600)
        with Masters(tmp_path, dsn) as masters:
            master = masters.start("--processes", "1", module="webjobs")
            failed = int(app.enqueue("webjobs.flaky", {"n": 5}))
            wait_for(
                lambda: _rows(
                    dsn, "SELECT 1 FROM fastjobs_jobs_all WHERE id = %s AND state = 'discarded'", failed
                ),
                f"job {failed} to fail and be discarded; the master's log:\n{master.stderr()}",
            )
            with web(dsn, tmp_path, "webjobs") as base:
                page = browser.new_page(viewport={"width": 1280, "height": 860})
                try:
                    _steps(page, base, dsn, failed, shots)
                finally:
                    page.close()
            master.stop()
    finally:
        app.close()


def _steps(page: Page, base: str, dsn: str, failed: int, shots: Path) -> None:
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)

    # the overview: queues with their jobs by state, the workers, MVCC health
    page.goto(base + "/")
    expect(page.locator("h1", has_text="Queues")).to_be_visible()
    expect(page.locator("table.queues a", has_text="bulk")).to_be_visible()
    expect(page.locator("table.queues a", has_text="mail")).to_be_visible()
    expect(page.locator("h1", has_text="MVCC health")).to_be_visible()
    page.screenshot(path=shots / "1-overview.png", full_page=True)

    # filter the jobs: the discarded ones
    page.click("nav >> text=Jobs")
    page.select_option("select[name=state]", "discarded")
    page.click("form.filters button[type=submit]")
    expect(page).to_have_url(f"{base}/jobs?state=discarded&queue=&kind=&args=")
    rows = page.locator("table.jobs tbody tr")
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text("webjobs.flaky")
    page.screenshot(path=shots / "2-jobs-discarded.png", full_page=True)

    # open the failed job: its error, escaped, with its traceback
    page.click(f"table.jobs a[href='/jobs/{failed}']")
    expect(page.locator("h1")).to_have_text(f"Job {failed}")
    expect(page.locator(".error .message")).to_contain_text(
        "flaky 5 failed on its first attempt <b>bold?</b>"
    )
    expect(page.locator(".error pre.traceback")).to_contain_text("RuntimeError")
    expect(page.locator("#field-state")).to_have_text("discarded")
    page.screenshot(path=shots / "3-job-failed.png", full_page=True)

    # retry it: the page says so, the database has it run again, and its result is kept
    page.click("form[action$='/retry'] button")
    expect(page.locator("#done")).to_contain_text(
        f"job {failed}: discarded, now available: runs now as attempt 2"
    )
    kept = wait_for(
        lambda: _rows(dsn, "SELECT state::text, value FROM fastjobs_results WHERE id = %s", failed),
        f"job {failed} to complete on its retry",
    )
    assert kept == [{"state": "completed", "value": 10}]
    page.reload()
    expect(page.locator("#result")).to_have_text("10")
    expect(page.locator("p.note", has_text="Only its kept outcome remains")).to_be_visible()
    expect(page.locator("form[action$='/retry']")).to_have_count(0)  # nothing left to act on
    page.screenshot(path=shots / "4-job-retried.png", full_page=True)

    # bulk-cancel a filtered set: the scheduled jobs of queue bulk whose args contain batch 7
    page.goto(base + "/jobs")
    page.select_option("select[name=state]", "scheduled")
    page.fill("input[name=queue]", "bulk")
    page.fill("input[name=args]", json.dumps({"batch": 7}))
    page.click("form.filters button[type=submit]")
    expect(page.locator("table.jobs tbody tr")).to_have_count(40)
    page.click("form.bulk button[value=cancel]")
    expect(page.locator("h1")).to_contain_text("Cancel every job matching state scheduled, queue bulk")
    page.click("#confirm")
    expect(page.locator("#progress")).to_have_text("40 of 40 jobs: done.", timeout=30_000)
    expect(page.locator("#outcome")).to_have_text("40 cancelled.")
    page.screenshot(path=shots / "5-bulk-cancelled.png", full_page=True)
    counts = _rows(
        dsn,
        "SELECT args->>'batch' AS batch, state::text, count(*) AS n FROM fastjobs_jobs_all"
        " WHERE kind = 'webjobs.later' GROUP BY 1, 2 ORDER BY 1, 2",
    )
    assert counts == [
        {"batch": "7", "state": "cancelled", "n": 40},
        {"batch": "8", "state": "scheduled", "n": 5},
    ]

    # pause a queue: the database has it paused, and the overview says so
    page.click("nav >> text=Queues")
    row = page.locator("table.queues tr", has=page.locator("a", has_text="bulk"))
    row.locator("button[value=pause]").click()
    expect(page.locator("#done")).to_contain_text("queue bulk: paused since")
    paused = _rows(dsn, "SELECT paused_at IS NOT NULL AS paused FROM fastjobs_queues WHERE name = 'bulk'")
    assert paused == [{"paused": True}]
    expect(row.locator(".queue-state")).to_contain_text("paused since")
    page.screenshot(path=shots / "6-queue-paused.png", full_page=True)
    page.goto(base + "/")
    expect(
        page.locator("table.queues tr", has=page.locator("a", has_text="bulk")).locator(".badge")
    ).to_have_text("paused")

    # the other pages render, and refresh in place (htmx swapped #live without a reload)
    page.goto(base + "/periodic")
    expect(page.locator("h1")).to_have_text("Periodic jobs")
    page.goto(base + "/engine")
    expect(page.locator("td", has_text="webjobs.flaky is")).to_have_count(0)
    expect(page.locator("table td", has_text="fast").first).to_be_visible()
    page.evaluate("document.getElementById('live').dataset.mark = 'before'")
    wait_for(lambda: page.evaluate("document.getElementById('live').dataset.mark") is None, "a refresh", 15)
    page.screenshot(path=shots / "7-engine.png", full_page=True)
    assert errors == []
