"""One trace from a web request to the handler that ran its event, sent to an OTLP viewer.

Starts one embedded PostgreSQL shard (in a temporary directory), a manager (in this process,
tracing a sample of 1: every fire and ack batch) and a receiver (``receivers.Receiver``, spans on,
``trace_mode`` first_parent). Inside a SERVER span ``POST /orders`` (what a web framework's
instrumentation would open) it enqueues one event by ``Router.enqueue``; the handler fails its
first attempt (``Retry``, no delay) and succeeds on the re-fire. So the trace shows the request, the
``send`` span, the first ``process`` span as its child with its ``nack``; the re-fire's
``process`` span is a trace of its own, linked to the ``send`` span.

The spans go to the OTLP/HTTP endpoint of ``OTEL_EXPORTER_OTLP_ENDPOINT`` (default
http://localhost:6006, where a local viewer listens; docs/observability.md), or to stdout with
``--console``. Needs the [otel] extra (``make setup`` installs it).

    .venv/bin/python scripts/trace_demo.py [--console]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

from queue_manager import admin
from queue_manager.domain.topology import Topology
from queue_manager.local.embedded import LocalCluster
from queue_manager.local.fleet import start_shards
from queue_manager.manager import Manager, ManagerConfig
from queue_manager.manager.auth import TokenStore
from queue_manager.producer import Router
from receivers import Event, Receiver, Retry

SECRET = "trace-demo-secret"


def provider(console: bool) -> TracerProvider:
    exporter: SpanExporter
    if console:
        exporter = ConsoleSpanExporter()
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:6006")
        exporter = OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces")
    p = TracerProvider(resource=Resource.create({"service.name": "shop (web, producer and receiver)"}))
    p.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(p)
    return p


async def run(topology: Topology) -> None:
    shard = topology.shards[0]
    tokens = TokenStore.from_entries([{"name": "demo", "secret": SECRET, "queues": ["*"]}])
    manager = Manager(ManagerConfig(dsn=shard.dsn, shard=shard.name, tokens=tokens, trace_sample=1.0))
    manager_task = asyncio.create_task(manager.run())
    await asyncio.wait_for(manager.ready.wait(), 30)
    handled = asyncio.Event()

    async def handle(event: Event) -> None:
        with trace.get_tracer("shop").start_as_current_span("charge card"):
            await asyncio.sleep(0.02)
            if event.attempt == 1:
                raise Retry("card processor timed out", delay=0)
        handled.set()

    receiver = Receiver({shard.name: [f"ws://127.0.0.1:{manager.port}/"]}, "orders", handle, token=SECRET, tracing=True)
    receiver_task = asyncio.create_task(receiver.run())
    await receiver.wait_subscribed(30)

    tracer = trace.get_tracer("shop")
    with Router(topology) as router, tracer.start_as_current_span("POST /orders", kind=trace.SpanKind.SERVER) as span:
        span.set_attribute("http.request.method", "POST")
        span.set_attribute("url.path", "/orders")
        with tracer.start_as_current_span("INSERT orders_app"):
            await asyncio.sleep(0.005)  # the application's own write, beside the enqueue
        await asyncio.to_thread(router.enqueue, "orders", "customer-42", {"order": 1042, "amount_cents": 2599})
    await asyncio.wait_for(handled.wait(), 30)
    receiver.stop()
    await receiver_task
    manager.request_stop()
    await manager_task


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--console", action="store_true", help="print the spans instead of sending them by OTLP")
    parser.add_argument("--verbose", action="store_true", help="the manager's and receiver's logs on stderr")
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(name)s %(message)s"
    )
    p = provider(args.console)
    with tempfile.TemporaryDirectory(prefix="qm-trace-demo-") as tmp:
        topology = start_shards(Path(tmp), 1)
        try:
            admin.create_queue(topology, "orders", {"partitions": 4, "shuffle": 2})
            asyncio.run(run(topology))
        finally:
            LocalCluster(Path(tmp), 1).stop()
    p.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
