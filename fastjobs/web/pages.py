"""The dashboard's pages and forms: a Starlette application rendering Jinja2 templates."""

from __future__ import annotations

import datetime as dt
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

import orjson
from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from .. import control, logs
from .. import queues as fastjobs_queues
from ..errors import JobNotFound
from . import reads
from .bulk import Operations
from .security import CSRF_FIELD, Credentials, Guard, csrf_ok, csrf_token

__all__ = ["BIGINT_MAX", "HERE", "REFRESH", "Dashboard", "asgi_app"]

if TYPE_CHECKING:
    from ..app import App

logger = logging.getLogger(__name__)

HERE = Path(__file__).parent
# A job id past this is no job's (the ids are bigint).
BIGINT_MAX = 2**63 - 1
# Auto-refresh of the pages that show live figures (htmx polls the page, swaps its #live part).
REFRESH = "5s"

# Job input (args, errors, kinds) shown on a page: C0 and C1 controls print as \xNN (newlines and
# tabs kept), as `fastjobs jobs show` prints them; the rest is HTML-escaped by the templates.
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0)) if c not in (0x09, 0x0A)}


def _text(value: Any) -> str:
    return str(value).translate(_CONTROLS)


def _json(value: Any) -> str:
    return _text(json.dumps(value, indent=2, ensure_ascii=False, default=str))


def _age(seconds: float | None) -> str:
    return "-" if seconds is None else logs.duration(seconds)


def _when(at: Any) -> str:
    if isinstance(at, dt.datetime):
        return f"{at.astimezone(dt.UTC):%Y-%m-%d %H:%M:%S} UTC"
    return "-" if at is None else _text(at)


def _size(n: int) -> str:
    size = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:,.0f} {unit}" if unit == "B" else f"{size:,.1f} {unit}"
        size /= 1024
    return f"{size:,.1f} GB"


def _spark(completed: list[float], failed: list[float]) -> Markup:
    """Both series as an inline SVG (no script): completed in green, failed in red, per minute."""
    width, height = 240, 40
    top = max([*completed, *failed, 1.0])

    def line(values: list[float], css: str) -> str:
        if len(values) < 2:
            return ""
        step = width / (len(values) - 1)
        points = " ".join(
            f"{i * step:.1f},{height - 2 - v / top * (height - 4):.1f}" for i, v in enumerate(values)
        )
        return f'<polyline class="{css}" points="{points}"/>'

    last_c = completed[-1] if completed else 0.0
    last_f = failed[-1] if failed else 0.0
    label = f"last minute: {last_c:,.0f} completed, {last_f:,.0f} failed; peak {top:,.0f}/min"
    return Markup(
        f'<svg class="spark" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img">'
        f"<title>{label}</title>{line(completed, 'ok')}{line(failed, 'bad')}</svg>"
    )


def _environment() -> Environment:
    env = Environment(
        loader=FileSystemLoader(HERE / "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(text=_text, json=_json, age=_age, when=_when, size=_size)
    env.globals.update(spark=_spark, states=reads.STATES, refresh=REFRESH, actions=control.ACTS_ON)
    return env


class Dashboard:
    """The pages of one App's database; `asgi_app` wraps them in Guard."""

    def __init__(self, app: App, *, read_only: bool = False) -> None:
        self.app = app
        self.read_only = read_only
        self.env = _environment()
        self.operations = Operations(app.connection, lambda: app.sql)

    def render(self, request: Request, name: str, status: int = 200, **context: Any) -> HTMLResponse:
        base = request.scope.get("root_path", "")
        page = self.env.get_template(name).render(
            request=request,
            base=base,
            path=request.url.path,
            here=request.url.path + (f"?{request.url.query}" if request.url.query else ""),
            read_only=self.read_only,
            csrf_field=CSRF_FIELD,
            csrf=csrf_token(request.scope),
            **context,
        )
        return HTMLResponse(page, status_code=status)

    def routes(self) -> list[Any]:
        return [
            Route("/", self.overview),
            Route("/jobs", self.jobs),
            Route("/jobs/bulk", self.bulk, methods=["GET", "POST"]),
            Route("/jobs/{job_id:int}", self.job),
            Route("/jobs/{job_id:int}/{action:str}", self.job_action, methods=["POST"]),
            Route("/operations/{operation_id:int}", self.operation),
            Route("/operations/{operation_id:int}/stop", self.operation_stop, methods=["POST"]),
            Route("/queues", self.queues, methods=["GET", "POST"]),
            Route("/periodic", self.periodic),
            Route("/engine", self.engine),
            Route("/favicon.ico", lambda request: Response(status_code=204)),
            Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
        ]

    # -- reading ---------------------------------------------------------------------------------

    def overview(self, request: Request) -> Response:
        with self.app.connection() as conn:
            found = reads.overview(conn, self.app.dsn, self.app.sql)
        return self.render(
            request, "overview.html", o=found, exact_below=reads.EXACT_BELOW, bound=reads.BOUND
        )

    def _filters(self, request: Request) -> tuple[reads.Filters, str | None]:
        """The jobs list's filters from the query string, and what is wrong with them (None: nothing)."""
        q = request.query_params
        state = q.get("state") or None
        problem = None
        if state is not None and state not in reads.STATES:
            problem, state = f"no state {state!r}: one of {', '.join(reads.STATES)}", None
        args_text = (q.get("args") or "").strip()
        args = None
        if args_text:
            try:
                args = orjson.loads(args_text)
            except orjson.JSONDecodeError as exc:
                problem, args_text = f'the args search is not JSON ({exc}): try {{"user_id": 1}}', ""
        filters = reads.Filters(state, q.get("queue") or None, q.get("kind") or None, args, args_text)
        return filters, problem

    def jobs(self, request: Request) -> Response:
        filters, problem = self._filters(request)
        before = request.query_params.get("before")
        cursor = int(before) if before and before.isdigit() and len(before) < 20 else None
        with self.app.connection() as conn:
            page = reads.jobs_page(conn, filters, cursor, self.app.sql)
            total, _ = reads.estimate(conn, self.app.sql)
        return self.render(
            request,
            "jobs.html",
            status=400 if problem else 200,
            f=filters,
            page=page,
            before=cursor,
            problem=problem,
            total=total,
            window=reads.WINDOW,
        )

    def job(self, request: Request) -> Response:
        job_id = request.path_params["job_id"]
        try:
            if job_id > BIGINT_MAX:
                raise JobNotFound(f"no job with id {job_id}")
            with self.app.connection() as conn:
                found = reads.job(conn, job_id, self.app.sql)
        except JobNotFound as exc:
            return self.render(request, "error.html", status=404, message=str(exc))
        return self.render(request, "job.html", job=found, done=request.query_params.get("done"))

    def operation(self, request: Request) -> Response:
        op = self.operations.get(request.path_params["operation_id"])
        if op is None:
            return self.render(
                request, "error.html", status=404, message="no such operation (the server restarted?)"
            )
        return self.render(request, "operation.html", op=op)

    async def queues(self, request: Request) -> Response:
        """GET: every queue with its flow control; POST: pause, resume or limit one (fastjobs.queues,
        as `fastjobs queues pause|resume|limit`)."""
        if request.method == "POST":
            fields = await self._form(request)
            if isinstance(fields, Response):
                return fields
            done = await run_in_threadpool(self._steer, fields)
            if isinstance(done, str):
                return self.render(request, "error.html", status=400, message=done)
            base = request.scope.get("root_path", "")
            return RedirectResponse(f"{base}/queues?{urlencode({'done': done[0]})}", status_code=303)
        return await run_in_threadpool(self._queues_page, request)

    def _queues_page(self, request: Request) -> Response:
        with self.app.connection() as conn:
            rows, _ = reads.estimate(conn, self.app.sql)
            found, exact = reads.queue_rows(conn, rows, self.app.sql)
        for spec in self.app.jobs.values():  # registered queues without jobs yet
            found.setdefault(spec.queue, reads.QueueRow(spec.queue))
        return self.render(
            request,
            "queues.html",
            queues=[found[k] for k in sorted(found)],
            exact=exact,
            done=request.query_params.get("done"),
        )

    def _steer(self, fields: dict[str, str]) -> tuple[str] | str:
        """One queue operation of the posted form: what it did, or what is wrong with the form."""
        action, queue = fields.get("action", ""), fields.get("queue", "")
        try:
            with self.app.connection() as conn:
                if action == "pause":
                    since = fastjobs_queues.pause(conn, queue, self.app.sql)
                    done = f"queue {queue}: paused since {_when(since)}"
                elif action == "resume":
                    was = fastjobs_queues.resume(conn, queue, self.app.sql)
                    done = f"queue {queue}: resumed" if was else f"queue {queue}: was not paused"
                elif action == "limit":
                    counts: dict[str, int | None] = {}
                    for name in ("concurrency", "max_backlog"):
                        text = fields.get(name, "").strip()
                        if text and not (text.isascii() and text.isdigit() and len(text) < 19):
                            return f"{name} is a positive whole number (empty: no limit), not {text!r}"
                        counts[name] = int(text) if text else None
                    rate = fields.get("rate_limit", "").strip() or None
                    fastjobs_queues.limit(
                        conn,
                        queue,
                        concurrency=counts["concurrency"],
                        max_backlog=counts["max_backlog"],
                        rate_limit=rate,
                        sql=self.app.sql,
                    )
                    limits = {"concurrency": counts["concurrency"], "rate_limit": rate, **counts}
                    done = f"queue {queue}: " + ", ".join(
                        f"{name} {value:,}"
                        if isinstance(value, int)
                        else f"{name} {value}"
                        if value
                        else f"no {name}"
                        for name, value in limits.items()
                    )
                else:
                    return f"no queue operation {action!r}: pause, resume or limit"
        except ValueError as exc:
            return str(exc)
        logger.info("dashboard: %s", done)
        return (done,)

    def periodic(self, request: Request) -> Response:
        with self.app.connection() as conn:
            found, others = reads.periodic(conn, self.app)
        return self.render(
            request, "periodic.html", periodic=found, others=others, module=bool(self.app.jobs)
        )

    def engine(self, request: Request) -> Response:
        with self.app.connection() as conn:
            found = reads.engine(conn, self.app.dsn, self.app.sql)
        return self.render(
            request, "engine.html", e=found, lanes=reads.lanes(self.app), module=bool(self.app.jobs)
        )

    # -- writing: every one a POST with the CSRF token, refused in read-only mode ----------------

    async def _form(self, request: Request) -> dict[str, str] | Response:
        """The posted form, or the answer refusing it."""
        if self.read_only:
            return self.render(request, "error.html", status=403, message="this dashboard is read-only")
        form = await request.form()
        fields = {k: v for k, v in form.items() if isinstance(v, str)}
        if not csrf_ok(request.scope, fields.get(CSRF_FIELD)):
            return self.render(
                request,
                "error.html",
                status=403,
                message="the form's CSRF token does not match this browser's: reload the page and try again",
            )
        return fields

    async def job_action(self, request: Request) -> Response:
        fields = await self._form(request)
        if isinstance(fields, Response):
            return fields
        job_id, action = request.path_params["job_id"], request.path_params["action"]
        if action not in control.ACTS_ON:
            return self.render(request, "error.html", status=404, message=f"no operation {action!r}")
        base = request.scope.get("root_path", "")

        def act() -> tuple[str, dict[str, Any]]:
            if job_id > BIGINT_MAX:
                raise JobNotFound(f"no job with id {job_id}")
            with self.app.connection() as conn:
                return control.act(conn, action, job_id, self.app.sql)

        try:
            state, doc = await run_in_threadpool(act)
        except JobNotFound as exc:
            return self.render(request, "error.html", status=404, message=str(exc))
        except ValueError as exc:
            return self.render(request, "error.html", status=409, message=str(exc))
        logger.info("dashboard: job %d: %s: %s", job_id, action, state)
        if state == "deleted":
            return RedirectResponse(f"{base}/jobs", status_code=303)
        done = control.Retried(**doc).describe() if action == "retry" else f"job {job_id}: {state}"
        return RedirectResponse(f"{base}/jobs/{job_id}?{urlencode({'done': done})}", status_code=303)

    async def bulk(self, request: Request) -> Response:
        """GET: what an operation by filter would act on, to confirm; POST: start it."""
        if request.method == "GET":
            if self.read_only:
                return self.render(request, "error.html", status=403, message="this dashboard is read-only")
            filters, problem = self._filters(request)
            action = request.query_params.get("action", "")
            if problem or action not in control.ACTS_ON:
                message = problem or f"no operation {action!r}"
                return self.render(request, "error.html", status=400, message=message)
            acts_on = control.ACTS_ON[action]
            states = sorted(acts_on if filters.state is None else acts_on & {filters.state})
            return self.render(request, "confirm.html", f=filters, action=action, states=states)
        fields = await self._form(request)
        if isinstance(fields, Response):
            return fields
        state = fields.get("state") or None
        args_text = (fields.get("args") or "").strip()
        try:
            args = orjson.loads(args_text) if args_text else None
        except orjson.JSONDecodeError:
            return self.render(request, "error.html", status=400, message="the args search is not JSON")
        if state is not None and state not in reads.STATES:
            return self.render(request, "error.html", status=400, message=f"no state {state!r}")
        filters = reads.Filters(
            state, fields.get("queue") or None, fields.get("kind") or None, args, args_text
        )
        try:
            op = self.operations.start(fields.get("action", ""), filters)
        except ValueError as exc:
            return self.render(request, "error.html", status=400, message=str(exc))
        base = request.scope.get("root_path", "")
        return RedirectResponse(f"{base}/operations/{op.id}", status_code=303)

    async def operation_stop(self, request: Request) -> Response:
        fields = await self._form(request)
        if isinstance(fields, Response):
            return fields
        op = self.operations.get(request.path_params["operation_id"])
        if op is None:
            return self.render(request, "error.html", status=404, message="no such operation")
        op.stop = True
        base = request.scope.get("root_path", "")
        return RedirectResponse(f"{base}/operations/{op.id}", status_code=303)


def asgi_app(
    app: App,
    *,
    read_only: bool = False,
    auth: tuple[str, str] | None = None,
    token: str | None = None,
) -> Any:
    """The dashboard of `app`'s database as an ASGI application, to serve or mount.

    Mounted in FastAPI or Starlette (`Mount("/jobs", app=asgi_app(app))`) or
    Django's ASGI router, it answers under that path. `auth` (user,
    password) requires HTTP basic credentials, `token` a bearer token
    (`Authorization: Bearer ...`), either when both are given; with neither,
    it requires nothing: put it behind your application's own
    authentication. `read_only` hides every form and refuses every write.
    Every write is a POST checked against a CSRF token.
    An App with a schema of its own (`App(schema=...)`) shows that schema's
    jobs, queues and workers.
    """
    dashboard = Dashboard(app, read_only=read_only)
    credentials = Credentials(auth, token) if auth or token else None
    return Guard(Starlette(routes=dashboard.routes()), credentials)
