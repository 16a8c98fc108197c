"""One trace from the producer's request to the receiver's handler (docs/observability.md, "Traces").

Real PostgreSQL, a real manager and a real Receiver; the spans go to the OpenTelemetry SDK's
in-memory exporter. The SDK's provider is this process's global one: its sampler records only
while a test of this module runs (the ``spans`` fixture), so the other tests of a worker that
imported this module see OpenTelemetry in use but record nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
from opentelemetry.trace import Link, SpanKind, TraceState
from opentelemetry.util.types import Attributes

from queue_manager.domain.topology import Shard, Topology
from queue_manager.errors import InvalidEventError
from queue_manager.producer import Event as NewEvent
from queue_manager.producer import Router, enqueue, enqueue_batch
from receivers import Event, Retry
from tests.conftest import tenants_of
from tests.framecheck import delivered
from tests.integration.test_receiver_library import receiving
from tests.managerkit import leading_manager, url, wait_for

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
RECORDING = threading.Event()


class _WhileRecording(Sampler):
    """Samples only while a test of this module runs."""

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> SamplingResult:
        return SamplingResult(Decision.RECORD_AND_SAMPLE if RECORDING.is_set() else Decision.DROP, attributes)

    def get_description(self) -> str:
        return "while a tracing test records"


EXPORTER = InMemorySpanExporter()
_provider = TracerProvider(sampler=_WhileRecording())
_provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
trace.set_tracer_provider(_provider)


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    EXPORTER.clear()
    RECORDING.set()
    try:
        yield EXPORTER
    finally:
        RECORDING.clear()
        EXPORTER.clear()


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def ctx_of(span: ReadableSpan) -> trace.SpanContext:
    sc = span.context
    assert sc is not None
    return sc


def parent_id(span: ReadableSpan) -> int | None:
    return None if span.parent is None else span.parent.span_id


async def test_a_request_enqueues_by_the_helper_by_sql_and_by_a_batch_and_each_handler_is_its_child(
    shards: Topology, make_queue: Any, spans: InMemorySpanExporter
) -> None:
    """Inside an HTTP-style SERVER span, four events go in: by ``enqueue``, by a plain SQL INSERT that
    writes the traceparent itself, and two by ``Router.enqueue_batch`` (COPY). Each handler's
    ``process`` span is the child of its creation context (the helper's ``send`` span, the request
    span itself, the batch's ``send`` span), all in the request's trace; each ack has its ``settle``
    span; and the handler sees the request's baggage."""
    make_queue("orders", partitions=4, shuffle=2)
    shard = shards.shards[0]
    tenants = tenants_of(shard, 3)
    tracer = trace.get_tracer("tests")
    seen: dict[str, Event] = {}
    baggage_seen: dict[str, Any] = {}

    def handle(event: Event) -> None:  # a sync handler: runs in a thread with the span's context
        from opentelemetry import baggage

        seen[event.payload["by"]] = event
        baggage_seen[event.payload["by"]] = baggage.get_baggage("customer")

    from opentelemetry import baggage, context

    token = context.attach(baggage.set_baggage("customer", "c-42"))
    try:
        with tracer.start_as_current_span("GET /orders", kind=SpanKind.SERVER) as request:
            with psycopg.connect(shard.dsn) as conn:
                enqueue(conn, "orders", tenants[0], {"by": "helper"})
                carrier: dict[str, str] = {}
                propagate.inject(carrier)
                conn.execute(
                    "INSERT INTO orders (tenant, payload, traceparent, tracestate, baggage)"
                    " VALUES (%s, %s, %s, %s, %s)",
                    (
                        tenants[1],
                        json.dumps({"by": "sql"}),
                        carrier["traceparent"],
                        carrier.get("tracestate"),
                        carrier.get("baggage"),
                    ),
                )
            with Router(shards) as router:
                router.enqueue_batch(
                    "orders", [NewEvent(tenants[2], {"by": "batch"}), NewEvent(tenants[0], {"by": "batch2"})]
                )
    finally:
        context.detach(token)
    req = ctx_of(request)

    async with leading_manager(shard.dsn) as m:
        async with receiving({"s0": [url(m)]}, handle) as r:
            await wait_for(lambda: r.stats.acked == 4, what="4 acks")

    sends = named(spans, "send orders")
    assert len(sends) == 2 and all(s.kind == SpanKind.PRODUCER and parent_id(s) == req.span_id for s in sends)
    helper_send = next(s for s in sends if "messaging.batch.message_count" not in (s.attributes or {}))
    batch_send = next(s for s in sends if (s.attributes or {}).get("messaging.batch.message_count") == 2)
    processes = {s.attributes["messaging.message.id"]: s for s in named(spans, "process orders") if s.attributes}
    assert len(processes) == 4
    expected_parent = {
        "helper": ctx_of(helper_send).span_id,
        "sql": req.span_id,
        "batch": ctx_of(batch_send).span_id,
        "batch2": ctx_of(batch_send).span_id,
    }
    for by, event in seen.items():
        span = processes[str(event.id)]
        assert span.kind == SpanKind.CONSUMER
        assert ctx_of(span).trace_id == req.trace_id, by
        assert parent_id(span) == expected_parent[by], by
        assert not span.links
        assert dict(span.attributes or {}) == {
            "messaging.system": "queue_manager",
            "messaging.destination.name": "orders",
            "messaging.operation.name": "process",
            "messaging.operation.type": "process",
            "messaging.message.id": str(event.id),
            "messaging.destination.partition.id": str(event.partition),
            "qm.attempt": 1,
            "qm.tenant": event.tenant,
            "qm.shard": "s0",
        }
        assert event.traceparent is not None and event.traceparent.split("-")[1] == format(req.trace_id, "032x")
        assert baggage_seen[by] == "c-42", by
    acks = named(spans, "ack orders")
    assert sorted(parent_id(s) for s in acks) == sorted(ctx_of(s).span_id for s in processes.values())
    assert all(s.kind == SpanKind.CLIENT and (s.attributes or {})["messaging.operation.type"] == "settle" for s in acks)


@pytest.mark.parametrize("mode", ["first_parent", "parent", "link"])
async def test_a_nack_and_refire_make_a_second_process_span_in_the_mode_configured(
    shard: Shard, make_queue: Any, spans: InMemorySpanExporter, mode: str
) -> None:
    """The handler fails its first attempt (a nack: a ``nack`` settle span, the process span marked
    as an error); the re-fire runs it again. first_parent: the first attempt is the creation
    context's child, the second a new trace linked to it; parent: both children; link: both new
    traces linked to it."""
    make_queue("orders", partitions=2, shuffle=1)
    tracer = trace.get_tracer("tests")
    attempts: list[int] = []

    async def handle(event: Event) -> None:
        attempts.append(event.attempt)
        if event.attempt == 1:
            raise Retry("not yet", delay=0)

    with (
        tracer.start_as_current_span("POST /jobs", kind=SpanKind.SERVER) as request,
        psycopg.connect(shard.dsn) as conn,
    ):
        enqueue(conn, "orders", tenants_of(shard, 1)[0], {"n": 1})
    (send,) = named(spans, "send orders")
    creation = ctx_of(send)
    assert creation.trace_id == ctx_of(request).trace_id

    async with leading_manager(shard.dsn) as m:
        async with receiving(url(m), handle, trace_mode=mode) as r:
            await wait_for(lambda: r.stats.acked == 1, what="the re-fire's ack")
    assert attempts == [1, 2]

    first, second = sorted(named(spans, "process orders"), key=lambda s: (s.attributes or {})["qm.attempt"])
    assert first.status.status_code == trace.StatusCode.ERROR and (first.attributes or {})["error.type"] == "Retry"
    assert second.status.status_code == trace.StatusCode.UNSET
    for span, attempt in ((first, 1), (second, 2)):
        as_child = mode == "parent" or (mode == "first_parent" and attempt == 1)
        if as_child:
            assert parent_id(span) == creation.span_id and ctx_of(span).trace_id == creation.trace_id
            assert not span.links
        else:
            assert span.parent is None and ctx_of(span).trace_id != creation.trace_id
            assert [(lk.context.trace_id, lk.context.span_id) for lk in span.links] == [
                (creation.trace_id, creation.span_id)
            ]
    (nack,) = named(spans, "nack orders")
    assert parent_id(nack) == ctx_of(first).span_id
    (ack,) = named(spans, "ack orders")
    assert parent_id(ack) == ctx_of(second).span_id


async def test_a_malformed_trace_context_is_a_clear_error_and_loses_nothing_else(shard: Shard, make_queue: Any) -> None:
    """By the helper, by SQL and in a batch (COPY): refused with an error naming the column; the
    transaction's other writes are as the caller decides (the helper's statement alone failed)."""
    make_queue("orders", partitions=2, shuffle=1)
    tenant = tenants_of(shard, 1)[0]
    bad = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-1"  # a flag of one digit
    with psycopg.connect(shard.dsn) as conn:
        with pytest.raises(InvalidEventError, match=r"traceparent is malformed: expected W3C traceparent"):
            enqueue(conn, "orders", tenant, {"n": 1}, trace_context={"traceparent": bad})
        conn.rollback()
        with pytest.raises(InvalidEventError, match=r"unknown key\(s\) 'trace_id'"):
            enqueue(conn, "orders", tenant, {"n": 1}, trace_context={"trace_id": "x"})
        with pytest.raises(psycopg.errors.CheckViolation, match="orders_traceparent_w3c"):
            conn.execute("INSERT INTO orders (tenant, payload, traceparent) VALUES (%s, '{}', %s)", (tenant, bad))
        conn.rollback()
        with pytest.raises(psycopg.errors.CheckViolation, match="orders_tracestate_w3c"):
            conn.execute(
                "INSERT INTO orders (tenant, payload, traceparent, tracestate) VALUES (%s, '{}', %s, %s)",
                (tenant, "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "x=\u00e9"),
            )
        conn.rollback()
        with pytest.raises(InvalidEventError, match=r"traceparent is malformed"):
            enqueue_batch(
                conn,
                "orders",
                [
                    NewEvent(tenant, {"n": 2}),
                    NewEvent(
                        tenant, {"n": 3}, trace_context={"traceparent": "00-" + "0" * 32 + "-b7ad6b7169203331-01"}
                    ),
                ],
            )
        conn.rollback()
        # a good context by each path, and none
        good = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        enqueue(
            conn, "orders", tenant, {"n": 4}, trace_context={"traceparent": good, "tracestate": "congo=t61rcWkgMzE"}
        )
        enqueue(conn, "orders", tenant, {"n": 5}, trace_context={})
        enqueue_batch(
            conn,
            "orders",
            [NewEvent(tenant, {"n": 6}, trace_context={"traceparent": good}), NewEvent(tenant, {"n": 7})],
        )
        conn.commit()
        stored = conn.execute("SELECT payload->>'n', traceparent, tracestate FROM orders ORDER BY 1").fetchall()
    # OpenTelemetry is in use in this process (not recording): event 7 has its batch's send span's context
    assert stored[:3] == [("4", good, "congo=t61rcWkgMzE"), ("5", None, None), ("6", good, None)]
    assert stored[3][0] == "7" and stored[3][1] not in (None, good) and stored[3][2] is None


@pytest.mark.parametrize("retention", [{}, {"retention_seconds": 0}], ids=["kept", "deleted-on-ack"])
async def test_the_manager_traces_a_sample_of_its_fire_and_ack_batches_linked_to_the_events(
    shard: Shard, make_queue: Any, spans: InMemorySpanExporter, retention: dict[str, int]
) -> None:
    # without retention an ack deletes the rows: the span's contexts are read before it
    make_queue("orders", partitions=2, shuffle=1, **retention)
    tenants = tenants_of(shard, 2)
    tracer = trace.get_tracer("tests")
    with tracer.start_as_current_span("GET /batch", kind=SpanKind.SERVER), psycopg.connect(shard.dsn) as conn:
        enqueue_batch(conn, "orders", [NewEvent(tenants[i % 2], {"i": i}) for i in range(5)])
    (send,) = named(spans, "send orders")

    async def handle(event: Event) -> None:
        pass

    async with leading_manager(shard.dsn, trace_sample=1.0) as m:
        async with receiving(url(m), handle) as r:
            await wait_for(lambda: r.stats.acked == 5, what="5 acks")
            await wait_for(
                lambda: sum(len(s.links) for s in named(spans, "ack orders") if s.kind == SpanKind.SERVER) == 5,
                what="the ack batches' spans",
            )
    fires = named(spans, "fire orders")
    assert sum((s.attributes or {})["messaging.batch.message_count"] for s in fires) == 5
    linked = {(lk.context.trace_id, lk.context.span_id) for s in fires for lk in s.links}
    assert linked == {(ctx_of(send).trace_id, ctx_of(send).span_id)}
    assert all(
        s.kind == SpanKind.PRODUCER and s.parent is None and (s.attributes or {})["qm.shard"] == "s0" for s in fires
    )


def test_without_tracing_configured_nothing_imports_opentelemetry_and_without_it_nothing_changes(
    shard: Shard, make_queue: Any
) -> None:
    """In a fresh interpreter: the packages, a manager, a producer and a receiver run an event
    through without importing OpenTelemetry; then, with OpenTelemetry made unimportable, the same
    runs (no context stored) and only asking for tracing explicitly is an error saying what to install."""
    make_queue("orders", partitions=2, shuffle=1)
    tenant = tenants_of(shard, 1)[0]
    script = f"""
import asyncio, sys
BLOCK = sys.argv[1] == "absent"
if BLOCK:
    class NoOtel:
        def find_spec(self, name, path=None, target=None):
            if name == "opentelemetry" or name.startswith("opentelemetry."):
                raise ImportError("blocked: " + name)
    sys.meta_path.insert(0, NoOtel())
import psycopg
import queue_manager, receivers
from queue_manager.producer import enqueue, enqueue_batch, Event as NewEvent
from receivers import Receiver
from tests.integration.test_receiver_library import receiving
from tests.managerkit import leading_manager, url, wait_for

async def main():
    with psycopg.connect({shard.dsn!r}) as conn:
        enqueue(conn, "orders", {tenant!r}, {{"n": sys.argv[1]}})
        enqueue_batch(conn, "orders", [NewEvent({tenant!r}, {{"n": "b"}})])
    seen = []
    async with leading_manager({shard.dsn!r}) as m:
        async with receiving(url(m), lambda e: seen.append(e)) as r:
            await wait_for(lambda: r.stats.acked == 2, what="2 acks")
            assert r.tracer is None
    assert all(e.traceparent is None for e in seen)
    if BLOCK:
        try:
            Receiver(url(m), "orders", lambda e: None, tracing=True)
        except Exception as exc:
            assert "pip install 'queue-manager[otel]'" in str(exc), exc
        else:
            raise AssertionError("tracing=True without OpenTelemetry was accepted")
    loaded = sorted(n for n in sys.modules if n.split(".")[0] == "opentelemetry")
    assert not loaded, loaded
    print("ok")

asyncio.run(main())
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for how in ("installed", "absent"):
        out = subprocess.run(
            [sys.executable, "-c", script, how], cwd=ROOT, env=env, capture_output=True, text=True, timeout=90
        )
        assert out.returncode == 0 and out.stdout.strip().endswith("ok"), (how, out.stdout[-2000:], out.stderr[-3000:])
    with psycopg.connect(shard.dsn) as conn:
        rows = conn.execute("SELECT state::text, traceparent FROM orders").fetchall()
    assert rows == [("acked", None)] * 4


def test_an_old_style_delivery_without_trace_members_still_works_and_old_receivers_ignore_them() -> None:
    from queue_manager.wire import frames
    from queue_manager.wire.client import ClientSession, Start

    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    old = frames.event(1, 1, "t", 0, 1.5, '{"a":1}')
    new = frames.event(2, 1, "t", 0, 1.5, '{"a":2}', 3, tp, 'k="v"\\', None)
    old_read, new_read = delivered(old, new)
    assert new_read["tracestate"] == 'k="v"\\' and "baggage" not in new_read
    assert "traceparent" not in old_read

    class Stats:
        delivered = acked = nacked = dead_lettered = extended = dropped = 0

    made: list[dict[str, Any]] = []

    def old_make_event(queue: str, raw: Any) -> Any:  # a receiver that knows only the six members
        made.append({k: raw[k] for k in ("id", "attempt", "tenant", "partition", "fire_at", "payload")})

        class E:
            id = raw["id"]
            attempt = raw["attempt"]

        return E()

    session: ClientSession[Any] = ClientSession("s0", "orders", slots=5, make_event=old_make_event, stats=Stats())
    session.connected()
    session.receive(frames.Welcome(frames.PROTOCOL, "s0", 1, "m", frames.limits(500)).to_json())
    (frame,) = frames.deliver_frames("orders", [old, new], 10)
    effects = session.receive(frame)
    assert [type(e) for e in effects] == [Start, Start] and [m["payload"] for m in made] == [{"a": 1}, {"a": 2}]


def test_the_receivers_event_reads_the_trace_members_and_none_without_them() -> None:
    from queue_manager.wire import frames
    from receivers.receiver import _Link

    class R:
        queue = "orders"
        concurrency = 1
        stats = None
        tenants = None
        handler_is_async = True
        backoff_factory = staticmethod(lambda: None)
        stopping = asyncio.Event()

    link = _Link(R(), "s0", ["ws://x"])  # type: ignore[arg-type]
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    old_read, new_read = delivered(
        frames.event(1, 1, "t", 0, 1.5, "{}"), frames.event(2, 1, "t", 0, 1.5, "{}", 3, tp, None, "a=b")
    )
    old = link._event("orders", old_read)
    new = link._event("orders", new_read)
    assert (old.traceparent, old.tracestate, old.baggage) == (None, None, None)
    assert (new.traceparent, new.tracestate, new.baggage) == (tp, None, "a=b")


async def test_an_event_enqueued_while_the_manager_runs_and_traces_reaches_its_handler_with_its_context(
    shard: Shard, make_queue: Any, spans: InMemorySpanExporter
) -> None:
    """The live path (a wake-up, not a backlog): the manager tracing every batch, the event enqueued
    by the helper while it runs arrives with the ``send`` span's context and is processed as its child."""
    make_queue("orders", partitions=2, shuffle=1)
    got: list[Event] = []

    async def handle(event: Event) -> None:
        got.append(event)

    async with leading_manager(shard.dsn, trace_sample=1.0) as m:
        async with receiving(url(m), handle) as r:
            with trace.get_tracer("t").start_as_current_span("POST"), psycopg.connect(shard.dsn) as conn:
                enqueue(conn, "orders", tenants_of(shard, 1)[0], {"n": 1})
            await wait_for(lambda: r.stats.acked == 1, what="ack")
    (send,) = named(spans, "send orders")
    (process,) = named(spans, "process orders")
    assert got[0].traceparent is not None
    assert got[0].traceparent.startswith(f"00-{ctx_of(send).trace_id:032x}-{ctx_of(send).span_id:016x}-")
    assert parent_id(process) == ctx_of(send).span_id


def test_with_the_api_alone_the_incoming_context_is_stored(shard: Shard, make_queue: Any) -> None:
    """An application with OpenTelemetry's API but no SDK (its spans are no-ops) still passes on the
    context of the request it serves: the helper stores the current context, not its invalid span's."""
    make_queue("orders", partitions=2, shuffle=1)
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    script = f"""
import psycopg
from opentelemetry import context, propagate
from queue_manager.producer import enqueue
context.attach(propagate.extract({{"traceparent": {tp!r}, "baggage": "k=v"}}))
with psycopg.connect({shard.dsn!r}) as conn:
    enqueue(conn, "orders", {tenants_of(shard, 1)[0]!r}, {{}})
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    with psycopg.connect(shard.dsn) as conn:
        assert conn.execute("SELECT traceparent, baggage FROM orders").fetchall() == [(tp, "k=v")]
