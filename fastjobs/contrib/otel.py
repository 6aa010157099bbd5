"""OpenTelemetry tracing (`fastjobs[otel]`): a producer span per enqueue, a consumer span per job.

`instrument(app)` registers enqueue middleware and job middleware (each in
its def and async def form) on the app:

- each enqueue call gets one PRODUCER span, `send <queue>` (one per
  `enqueue_many`, however many rows its COPY writes), and its W3C trace
  context goes into every job's meta under "otel" ({"traceparent": ...});
- each execution of a job gets one CONSUMER span, `process <queue>`: a child
  of the producer's span on the job's first attempt, so one trace runs from
  the request that enqueued to the worker that ran it; on a retry a span of
  a trace of its own, linked to the producer's (the OpenTelemetry messaging
  conventions' advice for a message processed more than once).

Attributes follow the messaging semantic conventions: `messaging.system`
"fastjobs" (the queue the application talks to; PostgreSQL underneath is a
database, described by database spans if the application has them),
`messaging.destination.name` the queue, `messaging.message.id` the job id,
`messaging.operation.type` "send" or "process" (the conventions' current
names; "publish" is their deprecated one), `messaging.batch.message_count`
for enqueue_many; and `messaging.fastjobs.kind` and
`messaging.fastjobs.attempt`. A failed attempt records its exception and an
ERROR status; Snooze and Cancel, asked for by the handler, are no error.

Spans go to the global TracerProvider, or the one given: configure the SDK
in the module `fastjobs run` imports (the master imports it once and forks
the workers) or in each worker process.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ..app import App
from ..context import JobContext
from ..errors import Cancel, Snooze
from ..middleware import Enqueue

__all__ = ["META_KEY", "SYSTEM", "instrument"]

SYSTEM = "fastjobs"
# The key of a job's meta holding the trace context of the enqueue.
META_KEY = "otel"

_PROPAGATOR = TraceContextTextMapPropagator()
_instrumented: weakref.WeakSet[App] = weakref.WeakSet()


def instrument(app: App, tracer_provider: trace.TracerProvider | None = None) -> None:
    """Trace `app`'s enqueues and job executions (once: a second call changes nothing)."""
    if app in _instrumented:
        return
    _instrumented.add(app)
    tracer = trace.get_tracer(__name__, tracer_provider=tracer_provider)

    def producer(enqueue: Enqueue) -> Any:
        operation = "enqueue_many" if enqueue.many else "enqueue"
        return tracer.start_as_current_span(
            f"send {enqueue.queue}",
            kind=SpanKind.PRODUCER,
            attributes={
                "messaging.system": SYSTEM,
                "messaging.destination.name": enqueue.queue,
                "messaging.operation.type": "send",
                "messaging.operation.name": operation,
                "messaging.fastjobs.kind": enqueue.kind,
            },
        )

    def sent(enqueue: Enqueue, span: Span, result: Any) -> None:
        if enqueue.many:
            span.set_attribute("messaging.batch.message_count", int(result))
        else:
            span.set_attribute("messaging.message.id", str(result))

    def carry(enqueue: Enqueue) -> None:
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier)
        enqueue.meta[META_KEY] = carrier

    @app.enqueue_middleware
    def trace_enqueue(enqueue: Enqueue, call_next: Callable[[], Any]) -> Any:
        with producer(enqueue) as span:
            carry(enqueue)
            result = call_next()
            sent(enqueue, span, result)
            return result

    @app.enqueue_middleware
    async def trace_enqueue_async(enqueue: Enqueue, call_next: Callable[[], Any]) -> Any:
        with producer(enqueue) as span:
            carry(enqueue)
            result = await call_next()
            sent(enqueue, span, result)
            return result

    def consumer(job: JobContext) -> Any:
        context, links = _origin(job)
        return tracer.start_as_current_span(
            f"process {job.queue}",
            context=context,
            kind=SpanKind.CONSUMER,
            links=links,
            attributes={
                "messaging.system": SYSTEM,
                "messaging.destination.name": job.queue or "",
                "messaging.operation.type": "process",
                "messaging.operation.name": "process",
                "messaging.message.id": str(job.id),
                "messaging.fastjobs.kind": job.kind,
                "messaging.fastjobs.attempt": job.attempt,
            },
            record_exception=False,
            set_status_on_exception=False,
        )

    @app.middleware
    def trace_job(job: JobContext, call_next: Callable[[], Any]) -> Any:
        with consumer(job) as span:
            try:
                return call_next()
            except BaseException as exc:
                _failed(span, exc)
                raise

    @app.middleware
    async def trace_job_async(job: JobContext, call_next: Callable[[], Any]) -> Any:
        with consumer(job) as span:
            try:
                return await call_next()
            except BaseException as exc:
                _failed(span, exc)
                raise


def _origin(job: JobContext) -> tuple[Context, list[Link]]:
    """The consumer span's parent context and links: the producer's on the first attempt, a link after.

    Never the worker's current context: a job's span belongs to its enqueue's trace or to none.
    """
    carrier = (job.meta or {}).get(META_KEY)
    if not isinstance(carrier, dict):
        return Context(), []
    extracted = _PROPAGATOR.extract(carrier, context=Context())
    producer = trace.get_current_span(extracted).get_span_context()
    if not producer.is_valid:
        return Context(), []
    if job.attempt == 1:
        return extracted, []
    return Context(), [Link(producer, {"messaging.fastjobs.attempt": job.attempt})]


def _failed(span: Span, exc: BaseException) -> None:
    if isinstance(exc, Snooze | Cancel):
        span.set_attribute(
            "messaging.fastjobs.outcome", "snoozed" if isinstance(exc, Snooze) else "cancelled"
        )
        return
    span.record_exception(exc)
    span.set_attribute("error.type", type(exc).__qualname__)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
