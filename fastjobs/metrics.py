"""The metrics process: a child of the master serving the counters as Prometheus text over HTTP.

Why a process of its own: the endpoint faces whatever connects to it. Served
from threads of the master, idle connections took its threads and file
descriptors until it spun at the fd limit, its listening socket leaked into
every child forked after it (a killed master left the port taken while
orphans lived), and a scrape's query could wait forever behind a lock. Here
one thread multiplexes at most MAX_CONNECTIONS connections, each given
REQUEST_TIMEOUT to send its request and take its answer; a connection
beyond the bound closes the oldest one still silent. The database's part
(queue depths, MVCC health) is read on one connection, kept open, whose
statements give up after LOCK_TIMEOUT and STATEMENT_TIMEOUT: a scrape then
answers with the shared-memory counters and says the rest is missing
(`fastjobs_scrape_database_ok 0`). While its master's leader leads the
cluster, a scrape also reads the workers' heartbeats of every host (the
fastjobs_cluster_* series): one master's endpoint shows the whole cluster.

The master forks it before any worker and waits until it listens (a port it
cannot bind stops the master), restarts it when it dies, and kills it after
its last worker: it serves through a graceful stop. It ignores the stop
signals a terminal or a service manager sends the whole process group, and
dies with the master (PR_SET_PDEATHSIG). Its sockets are its own: no other
process of the master has them.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import selectors
import signal
import socket
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import psycopg

from . import database, keys, queues, sql
from .children import EXIT_BOOT_ERROR, EXIT_CRASH, Backoff, die_with, fork, how_it_ended
from .errors import FastjobsError
from .exposition import prometheus
from .report import ClusterHost, Health, QueueDepth, cluster, health, queue_depths
from .scoreboard import Scoreboard
from .stats import LEADER

__all__ = [
    "CONNECT_TIMEOUT",
    "CONTENT_TYPE",
    "FRESH",
    "LOCK_TIMEOUT",
    "MAX_CONNECTIONS",
    "MAX_REQUEST",
    "READY_TIMEOUT",
    "REQUEST_TIMEOUT",
    "RETRY_AFTER",
    "STATEMENT_TIMEOUT",
    "DatabaseReader",
    "MetricsProcess",
    "Reading",
    "listen",
    "scrape",
    "serve",
]

logger = logging.getLogger(__name__)

MAX_CONNECTIONS = 32
REQUEST_TIMEOUT = 10.0  # a connection's whole life: its request in, the answer out
MAX_REQUEST = 8192  # bytes of request line and headers
LOCK_TIMEOUT = 0.5
STATEMENT_TIMEOUT = 2.0
CONNECT_TIMEOUT = 2  # libpq's least
# What a scrape reads of the database: queue depths, MVCC health, the hosts
# (the leader's process only) and the paused queues.
Reading = tuple[
    list[QueueDepth], Health, list[ClusterHost] | None, list[queues.QueueState], list[keys.KeyUsage]
]
FRESH = 1.0  # a burst of scrapes within this many seconds costs one read of the database
RETRY_AFTER = 2.0  # after a failed read, scrapes answer without the database this long
READY_TIMEOUT = 30.0  # the master's wait for the first metrics process to listen

_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGQUIT, signal.SIGCHLD}
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class MetricsProcess:
    """The master's handle on its metrics process: start, notice its exit, restart, stop."""

    def __init__(
        self,
        host: str,
        port: int,
        board: Scoreboard,
        dsn: str,
        sql: ModuleType = sql,
        close_in_child: Sequence[int] = (),
    ) -> None:
        self.sql = sql  # the catalogue of the app's schema
        self.host = host
        self.port = port
        self.board = board
        self.dsn = dsn
        self.close_in_child = tuple(close_in_child)
        self.pid = 0
        self.backoff = Backoff()
        self.restart_at: float | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def start(self) -> None:
        """Fork the process and wait until it listens (then `port` is the one it got for port 0).

        FastjobsError naming host and port if it cannot.
        """
        read_end, write_end = os.pipe()
        try:
            self._fork(write_end, read_end)
        finally:
            os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            ready, _, _ = select.select([pipe], [], [], READY_TIMEOUT)
            answer = pipe.readline().decode(errors="replace").strip() if ready else ""
        kind, _, value = answer.partition(" ")
        if kind == "listening":
            self.port = int(value)
            return
        self.stop()
        why = value if kind == "error" else "the metrics process did not start (see its error above)"
        raise FastjobsError(f"cannot serve metrics on {self.host}:{self.port}: {why}")

    def exited(self, pid: int, status: int, stopping: bool) -> bool:
        """Whether `pid` was the metrics process; if so schedule its restart (unless stopping)."""
        if not pid or pid != self.pid:
            return False
        self.pid = 0
        if stopping:
            return True
        delay = self.backoff.delay()
        how = how_it_ended(os.waitstatus_to_exitcode(status))
        logger.warning("metrics process %s; restarting in %gs", how, delay)
        self.restart_at = time.monotonic() + delay
        return True

    def restart_due(self, now: float) -> None:
        if self.pid == 0 and self.restart_at is not None and now >= self.restart_at:
            self.restart_at = None
            self._fork(None)

    def stop(self) -> None:
        """Kill it and reap it: it holds nothing a graceful stop would save."""
        if self.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)
            self.pid = 0
        self.restart_at = None

    def _fork(self, ready: int | None, *close: int) -> None:
        master = os.getpid()

        def main() -> int:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT):
                signal.signal(sig, signal.SIG_IGN)  # the master stops it, after its workers
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            die_with(master, signal.SIGKILL)  # the port must be free for the next master
            for fd in self.close_in_child + close:
                os.close(fd)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)
            return _main(self.host, self.port, self.board, self.dsn, ready, self.sql)

        self.pid = fork(_SIGNALS, main)
        self.backoff.start()


def _main(host: str, port: int, board: Scoreboard, dsn: str, ready: int | None, sql: ModuleType) -> int:
    from setproctitle import setproctitle

    setproctitle("fastjobs: metrics")
    try:
        listener = listen(host, port)
    except OSError as exc:
        message = exc.strerror or str(exc)
        if ready is None:
            logger.error("metrics process: cannot listen on %s:%d: %s", host, port, message)
            return EXIT_CRASH
        os.write(ready, f"error {message}\n".encode())
        return EXIT_BOOT_ERROR
    if ready is not None:
        os.write(ready, f"listening {listener.getsockname()[1]}\n".encode())
        os.close(ready)
    reader = DatabaseReader(dsn, sql)
    serve(listener, lambda: scrape(board, reader))
    return 0


def listen(host: str, port: int) -> socket.socket:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    return socket.create_server((host, port), family=family, backlog=MAX_CONNECTIONS)


class DatabaseReader:
    """The metrics process's one connection to the database, and what it last read."""

    def __init__(self, dsn: str, sql: ModuleType = sql) -> None:
        self.dsn = dsn
        self.sql = sql
        self.conn: psycopg.Connection[Any] | None = None
        self.read_at = -FRESH
        self.last: Reading | None = None
        self.failed_at = -RETRY_AFTER
        self.failure = ""

    def read(self, hosts: bool = False) -> Reading | str:
        """Queue depths, MVCC health, (with `hosts`) the cluster's hosts and the paused queues, or why
        they are missing."""
        now = time.monotonic()
        if self.last is not None and now - self.read_at < FRESH and (self.last[2] is not None) == hosts:
            return self.last
        if now - self.failed_at < RETRY_AFTER:
            return self.failure
        self.last = None
        try:
            if self.conn is None:
                self.conn = self._connect()
            sql = self.sql
            result = (
                queue_depths(self.conn, sql),
                health(self.conn, sql),
                cluster(self.conn, sql=sql) if hosts else None,
                queues.states(self.conn, sql),
                keys.usage(self.conn, sql),
            )
        except (FastjobsError, psycopg.Error) as exc:
            slow = isinstance(exc, psycopg.errors.QueryCanceled | psycopg.errors.LockNotAvailable)
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            self.failure = f"the database is slow: {reason}" if slow else reason
            self.failed_at = time.monotonic()
            if self.conn is not None and (self.conn.broken or not slow):
                self.conn.close()
                self.conn = None
            return self.failure
        self.last, self.read_at = result, time.monotonic()
        return result

    def _connect(self) -> psycopg.Connection[Any]:
        # Keepalives and a TCP user timeout: statement_timeout is the server's,
        # and a server cut off by the network would otherwise hold a read here.
        conn = database.connect(
            self.dsn,
            autocommit=True,
            connect_timeout=CONNECT_TIMEOUT,
            application_name="fastjobs metrics",
            keepalives=1,
            keepalives_idle=5,
            keepalives_interval=2,
            keepalives_count=2,
            tcp_user_timeout=int(STATEMENT_TIMEOUT * 1000 + 3000),
        )
        try:
            with psycopg.RawCursor(conn) as cur:
                cur.execute(
                    self.sql.metrics_session,
                    (f"{LOCK_TIMEOUT * 1000:.0f}", f"{STATEMENT_TIMEOUT * 1000:.0f}"),
                )
        except BaseException:
            conn.close()
            raise
        return conn


def scrape(board: Scoreboard, reader: DatabaseReader) -> bytes:
    """One scrape's body: the counters always; the database's part when it answers in time."""
    leading = any(card["role"] == LEADER and card["leading"] for card in board)
    found = reader.read(hosts=leading)
    if isinstance(found, str):
        note = f"# queue depths and MVCC health unavailable: {found}\n"
        text = note + prometheus(board, None, None)
    else:
        text = prometheus(board, *found)
    ok = 0 if isinstance(found, str) else 1
    text += (
        "# HELP fastjobs_scrape_database_ok 1 if this scrape read the database (queue depths, MVCC"
        " health), 0 if it answered without\n"
        f"# TYPE fastjobs_scrape_database_ok gauge\nfastjobs_scrape_database_ok {ok}\n"
    )
    return text.encode()


class _Client:
    __slots__ = ("inbox", "outbox", "since", "sock")

    def __init__(self, sock: socket.socket, since: float) -> None:
        self.sock = sock
        self.since = since
        self.inbox = b""
        self.outbox: memoryview | None = None  # the answer, once the request is in


def serve(listener: socket.socket, body: Callable[[], bytes]) -> None:
    """Answer HTTP GET /metrics on `listener` forever, from this one thread."""
    listener.setblocking(False)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    clients: dict[socket.socket, _Client] = {}  # oldest first

    def drop(client: _Client) -> None:
        selector.unregister(client.sock)
        client.sock.close()
        del clients[client.sock]

    def make_room() -> bool:
        """Close the oldest connection still silent (else the oldest): a new one is more likely a scrape."""
        if not clients:
            return False
        victim = next((c for c in clients.values() if c.outbox is None), next(iter(clients.values())))
        drop(victim)
        return True

    def accept() -> None:
        for _ in range(MAX_CONNECTIONS):
            try:
                sock, _ = listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                out_of = exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
                if out_of and not make_room():
                    time.sleep(0.1)  # nothing of ours to free: do not spin on the listener
                continue
            if len(clients) >= MAX_CONNECTIONS:
                make_room()
            sock.setblocking(False)
            client = _Client(sock, time.monotonic())
            clients[sock] = client
            selector.register(sock, selectors.EVENT_READ, client)

    def receive(client: _Client) -> None:
        try:
            data = client.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            drop(client)
            return
        client.inbox += data
        end = client.inbox.find(b"\r\n\r\n")
        if end < 0:
            end = client.inbox.find(b"\n\n")
        if end < 0:
            if len(client.inbox) > MAX_REQUEST:
                answer(client, _response("431 Request Header Fields Too Large"))
            return
        line = client.inbox.split(b"\n", 1)[0].split()
        method, target = (line[0], line[1].decode(errors="replace")) if len(line) >= 2 else (b"", "")
        if target.split("?")[0] not in ("/metrics", "/"):
            answer(client, _response("404 Not Found"))
        elif method not in (b"GET", b"HEAD"):
            answer(client, _response("405 Method Not Allowed"))
        else:
            answer(client, _response("200 OK", body(), head=method == b"HEAD"))

    def answer(client: _Client, response: bytes) -> None:
        client.outbox = memoryview(response)
        selector.modify(client.sock, selectors.EVENT_WRITE, client)
        send(client)

    def send(client: _Client) -> None:
        assert client.outbox is not None
        try:
            sent = client.sock.send(client.outbox)
        except BlockingIOError:
            return
        except OSError:
            drop(client)
            return
        client.outbox = client.outbox[sent:]
        if not client.outbox:
            with contextlib.suppress(OSError):
                client.sock.shutdown(socket.SHUT_WR)
            drop(client)

    while True:
        now = time.monotonic()
        for client in [c for c in clients.values() if now - c.since >= REQUEST_TIMEOUT]:
            drop(client)
        oldest = next(iter(clients.values()), None)
        timeout = None if oldest is None else max(0.0, oldest.since + REQUEST_TIMEOUT - now)
        for key, events in selector.select(timeout):
            if key.fileobj is listener:
                accept()
                continue
            client = key.data
            if client.sock not in clients:
                continue  # dropped earlier in this turn
            if events & selectors.EVENT_READ and client.outbox is None:
                receive(client)
            elif events & selectors.EVENT_WRITE and client.outbox is not None:
                send(client)


def _response(status: str, body: bytes = b"", head: bool = False) -> bytes:
    if not body and not status.startswith("200"):
        body = f"{status}\n".encode()
    headers = (
        f"HTTP/1.0 {status}\r\nContent-Type: {CONTENT_TYPE}\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return headers.encode() + (b"" if head else body)
