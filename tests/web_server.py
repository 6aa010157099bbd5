"""A real `fastjobs web` for the dashboard's tests: the subprocess on a free port, its log, its stop."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.procs import wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def web(
    dsn: str, cwd: Path, *args: str, env: dict[str, str] | None = None, host: str = "127.0.0.1"
) -> Iterator[str]:
    """`fastjobs --dsn DSN web ARGS --port P` in `cwd` until the block ends; yields its base URL."""
    port = free_port()
    log = cwd / f"web-{port}.log"
    environ = {k: v for k, v in os.environ.items() if k not in ("FASTJOBS_WEB_AUTH", "FASTJOBS_WEB_TOKEN")}
    environ.update(env or {})
    cmd = [sys.executable, "-m", "fastjobs.cli", "--dsn", dsn, "web", *args]
    cmd += ["--host", host, "--port", str(port)]
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=environ,
            stdout=stderr,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if proc.poll() is not None:
            return True
        try:
            httpx.get(f"{base}/static/style.css", timeout=1)
            return True
        except httpx.TransportError:
            return False

    try:
        wait_for(up, f"fastjobs web on port {port}")
        assert proc.poll() is None, log.read_text()
        yield base
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
