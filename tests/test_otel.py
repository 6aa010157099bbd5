"""fastjobs.contrib.otel: producer spans per enqueue, consumer spans per execution, one trace between."""

from __future__ import annotations

import asyncio
import json
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from fastjobs import App, Snooze, current_job
from fastjobs.contrib import otel

from . import procs
from .helpers import drain, query


@pytest.fixture
def exporter() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def _by_kind(spans: tuple[ReadableSpan, ...], kind: SpanKind) -> list[ReadableSpan]:
    return [s for s in spans if s.kind == kind]


def test_a_job_continues_its_enqueues_trace_and_a_retry_links_to_it(
    app: App, exporter: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, spans = exporter
    otel.instrument(app, tracer_provider=provider)
    otel.instrument(app, tracer_provider=provider)  # once only

    @app.job(kind="flaky", queue="traced")
    def flaky(n: int) -> None:
        job = current_job()
        if job is not None and job.attempt == 1:
            raise ValueError("first attempt fails")

    job_id = app.enqueue("flaky", {"n": 1}, queue="traced")
    [meta] = [r["meta"] for r in query(app.dsn, "SELECT meta FROM fastjobs_jobs_all")]
    [producer] = spans.get_finished_spans()
    assert producer.kind == SpanKind.PRODUCER and producer.name == "send traced"
    assert dict(producer.attributes or {}) == {
        "messaging.system": "fastjobs",
        "messaging.destination.name": "traced",
        "messaging.operation.type": "send",
        "messaging.operation.name": "enqueue",
        "messaging.fastjobs.kind": "flaky",
        "messaging.message.id": str(job_id),
    }
    ctx = producer.get_span_context()
    assert ctx is not None
    assert meta == {
        "otel": {"traceparent": f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"}
    }

    drain(app, ["traced"])  # attempt 1, retried after its backoff: made due at once
    query(app.dsn, "UPDATE fastjobs_jobs_all SET run_at = now(), state = 'available'")
    drain(app, ["traced"])
    first, second = _by_kind(spans.get_finished_spans(), SpanKind.CONSUMER)
    assert first.name == second.name == "process traced"
    assert first.context is not None and second.context is not None
    # Attempt 1: a child of the producer, in its trace, failed with the exception recorded.
    assert first.parent is not None and first.parent.span_id == ctx.span_id
    assert first.context.trace_id == ctx.trace_id
    assert first.status.status_code == StatusCode.ERROR
    assert [e.name for e in first.events] == ["exception"]
    assert (first.attributes or {})["error.type"] == "ValueError"
    # Attempt 2: a trace of its own, linked to the producer.
    assert second.parent is None and second.context.trace_id != ctx.trace_id
    assert [(link.context.trace_id, link.context.span_id) for link in second.links] == [
        (ctx.trace_id, ctx.span_id)
    ]
    assert second.status.status_code == StatusCode.UNSET
    assert dict(second.attributes or {}) == {
        "messaging.system": "fastjobs",
        "messaging.destination.name": "traced",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.message.id": str(job_id),
        "messaging.fastjobs.kind": "flaky",
        "messaging.fastjobs.attempt": 2,
    }


def test_enqueue_many_is_one_span_whose_context_every_row_carries(
    app: App, exporter: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, spans = exporter
    otel.instrument(app, tracer_provider=provider)

    @app.job(kind="each")
    async def each(n: int) -> None:
        if n == 2:
            raise Snooze(3600)  # asked for: no error

    assert app.enqueue_many("each", [{"n": n} for n in range(3)]) == 3  # binary COPY

    async def enqueue_async() -> int:
        try:
            return await app.enqueue_many_async("each", [{"n": 3}])
        finally:
            await app.aclose()

    assert asyncio.run(enqueue_async()) == 1
    producers = spans.get_finished_spans()
    assert [(p.kind, (p.attributes or {})["messaging.batch.message_count"]) for p in producers] == [
        (SpanKind.PRODUCER, 3),
        (SpanKind.PRODUCER, 1),
    ]
    assert [(p.attributes or {})["messaging.operation.name"] for p in producers] == ["enqueue_many"] * 2
    drain(app)
    consumers = _by_kind(spans.get_finished_spans(), SpanKind.CONSUMER)
    parents = sorted(
        (c.parent.span_id if c.parent else None, (c.attributes or {})["messaging.message.id"])
        for c in consumers
    )
    ids = [str(r["id"]) for r in query(app.dsn, "SELECT id FROM fastjobs_jobs_all")]  # the snoozed one
    one, two = (p.get_span_context().span_id for p in producers)  # type: ignore[union-attr]
    assert [parent for parent, _ in parents] == sorted([one, one, one, two])
    snoozed = [c for c in consumers if (c.attributes or {}).get("messaging.fastjobs.outcome") == "snoozed"]
    assert [(c.attributes or {})["messaging.message.id"] for c in snoozed] == ids
    assert snoozed[0].status.status_code == StatusCode.UNSET


MODULE = "fjotel"
SOURCE = '''
"""A traced app for `fastjobs run`: the worker's spans, as JSON lines, go to $FJ_TEST_SPANS."""

import os

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

import fastjobs
from fastjobs.contrib import otel


class FileExporter(SpanExporter):
    def export(self, spans):
        with open(os.environ["FJ_TEST_SPANS"], "a") as out:
            for span in spans:
                out.write(span.to_json(indent=None) + "\\n")
        return SpanExportResult.SUCCESS


provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(FileExporter()))
trace.set_tracer_provider(provider)

app = fastjobs.App()
otel.instrument(app)


@app.job(kind="flaky", queue="traced")
def flaky(n):
    if fastjobs.current_job().attempt == 1:
        raise fastjobs.Retry(0)


@app.job(kind="flaky_async", queue="traced")
async def flaky_async(n):
    if fastjobs.current_job().attempt == 1:
        raise fastjobs.Retry(0)
'''


def test_spans_of_jobs_run_by_fastjobs_run_join_their_enqueues_traces(
    masters: procs.Masters,
    app: App,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    exporter: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    spans_path = tmp_path / "spans.jsonl"
    monkeypatch.setenv("FJ_TEST_SPANS", str(spans_path))
    (tmp_path / f"{MODULE}.py").write_text(textwrap.dedent(SOURCE))
    provider, memory = exporter
    otel.instrument(app, tracer_provider=provider)  # the producer: this process
    master = masters.start("--processes", "1", "--queues", "traced", module=MODULE)
    master.wait_stderr(r"leader elected")
    sync_id = app.enqueue("flaky", {"n": 1}, queue="traced")
    assert app.enqueue_many("flaky_async", [{"n": 2}, {"n": 3}], queue="traced") == 2

    def consumers() -> list[dict[str, Any]]:
        if not spans_path.exists():
            return []
        return [json.loads(line) for line in spans_path.read_text().splitlines()]

    procs.wait_for(lambda: len(consumers()) == 6, f"six consumer spans in {spans_path}")
    assert master.stop() == 0, master.stderr()
    one, many = memory.get_finished_spans()
    traces = {}
    for producer in (one, many):
        ctx = producer.get_span_context()
        assert ctx is not None
        traces[f"0x{ctx.trace_id:032x}"] = f"0x{ctx.span_id:016x}"
    seen = []
    for span in consumers():
        attributes = span["attributes"]
        assert span["kind"] == "SpanKind.CONSUMER" and span["name"] == "process traced"
        assert attributes["messaging.system"] == "fastjobs"
        assert attributes["messaging.destination.name"] == "traced"
        assert attributes["messaging.operation.type"] == "process"
        trace_id, parent = span["context"]["trace_id"], span["parent_id"]
        links = [(link["context"]["trace_id"], link["context"]["span_id"]) for link in span["links"]]
        if attributes["messaging.fastjobs.attempt"] == 1:
            assert traces[trace_id] == parent and links == []
            assert span["status"]["status_code"] == "ERROR"  # Retry: a failed attempt
        else:
            assert trace_id not in traces and parent is None
            assert [trace_id for trace_id, _ in links] == [t for t in traces if (t, traces[t]) in links]
            assert len(links) == 1 and links[0][1] == traces[links[0][0]]
        seen.append((attributes["messaging.fastjobs.kind"], attributes["messaging.fastjobs.attempt"]))
    assert sorted(seen) == sorted([("flaky", 1), ("flaky", 2)] + [("flaky_async", 1), ("flaky_async", 2)] * 2)
    ids = {span["attributes"]["messaging.message.id"] for span in consumers()}
    assert str(sync_id) in ids and len(ids) == 3
