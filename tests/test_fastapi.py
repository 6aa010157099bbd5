"""examples/fastapi_app under uvicorn, with a `fastjobs run` worker, driven over real HTTP (httpx)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("greenlet")

from tests.helpers import wait_for  # noqa: E402

EXAMPLE = Path(__file__).parent.parent / "examples" / "fastapi_app"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _start(args: list[str], dsn: str, log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k not in ("FASTJOBS_DSN", "DATABASE_URL")}
    info = psycopg.conninfo.conninfo_to_dict(dsn)  # the tests' DSNs are key=value; the example takes a URL
    user, host, port = info.get("user", "postgres"), info.get("host", "127.0.0.1"), info.get("port", 5432)
    url = f"postgresql://{user}@{host}:{port}/{info['dbname']}"
    env.update(DATABASE_URL=url, PYTHONPATH=str(EXAMPLE.parent.parent))
    with log.open("w") as stderr:  # the child has its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, *args],
            cwd=EXAMPLE,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
        )


def _stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    return proc.wait(30)


@pytest.fixture
def service(dsn: str, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The API on a free port, and one worker; yields the API's base URL and the logs' directory."""
    port = _free_port()
    api = _start(["-m", "uvicorn", "main:api", "--port", str(port)], dsn, tmp_path / "api.log")
    worker = _start(["-m", "fastjobs.cli", "run", "jobs"], dsn, tmp_path / "worker.log")
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if api.poll() is not None:
            return True
        try:
            return bool(httpx.get(f"{base}/docs", timeout=1).status_code == 200)
        except httpx.TransportError:
            return False

    try:
        assert wait_for(up, timeout=30) and api.poll() is None, (tmp_path / "api.log").read_text()
        yield base, tmp_path
    finally:
        codes = _stop(api), _stop(worker)
    # uvicorn ends a graceful shutdown by raising the signal again (-15); fastjobs exits 0.
    logs = (tmp_path / "api.log").read_text() + (tmp_path / "worker.log").read_text()
    assert codes[0] in (0, -signal.SIGTERM) and codes[1] == 0, logs


def test_an_endpoint_enqueues_with_its_writes_and_another_returns_the_result(dsn, service):
    base, logs = service
    with httpx.Client(base_url=base, timeout=30) as client:
        created = client.post("/orders", json={"email": "a@example.com", "amounts": [1, 2, 39]})
        assert created.status_code == 200, created.text
        order, job = created.json()["order"], created.json()["job"]
        done = client.get(f"/jobs/{job}", params={"wait": 20})
        expected = {"job": job, "state": "completed", "value": 42}
        assert done.json() == expected, (logs / "worker.log").read_text()

        # The request fails after its enqueue: the order and the job are rolled back together.
        failed = client.post(
            "/orders", json={"email": "b@example.com", "amounts": [1], "fail_after_enqueue": True}
        )
        assert failed.status_code == 500

        # A job that fails: its errors through the same endpoint; an unknown one is a 404.
        bad = client.post("/orders", json={"email": "c@example.com", "amounts": [-5]}).json()
        failure = client.get(f"/jobs/{bad['job']}", params={"wait": 20}).json()
        assert failure == {"job": bad["job"], "state": "discarded", "errors": [failure["errors"][0]]}
        assert "a negative total (-5)" in failure["errors"][0]
        assert client.get("/jobs/999999").status_code == 404

    with psycopg.connect(dsn) as conn:
        orders = conn.execute("SELECT id, email, total FROM orders ORDER BY id").fetchall()
        jobs = conn.execute("SELECT count(*) FROM fastjobs_jobs_all").fetchone()
    assert orders[0] == (order, "a@example.com", 42)
    assert [o[1] for o in orders] == ["a@example.com", "c@example.com"]  # b@ was rolled back
    assert jobs is not None
