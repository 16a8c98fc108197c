"""OpenTelemetry traces: the one module that imports OpenTelemetry (docs/observability.md, "Traces").

OpenTelemetry is optional (``pip install queue-manager[otel]``) and nothing here imports it when
this module is imported. Each event may carry the W3C trace context of its creation in three
columns of its queue table (``traceparent``, ``tracestate``, ``baggage``), which the manager
sends to the receiver in the delivery frame. Three users:

- **producers** (:func:`send`): the Python helpers fill the columns from a PRODUCER span
  ``send <queue>`` opened in the current context, when the process uses OpenTelemetry (its API
  has been imported, :func:`in_use`); otherwise nothing is imported and the columns stay NULL;
- **receivers** (:class:`ReceiverTracer`): a CONSUMER span ``process <queue>`` around each handler
  call, its relation to the creation context set by :data:`TraceMode`, and a CLIENT span
  ``ack <queue>`` / ``nack <queue>`` for each settle;
- **the manager** (:class:`ManagerTracer`): off by default; with a sample rate, a span for a share
  of its fire and ack batches, linked to the contexts of the batch's events.

The attribute names follow the OpenTelemetry messaging conventions (``messaging.*``), with the
queue manager's own under ``qm.*``.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

from queue_manager.errors import ConfigurationError, InvalidEventError

if TYPE_CHECKING:
    from opentelemetry.trace import Link, Span

#: ``messaging.system`` of every span
SYSTEM = "queue_manager"
#: the instrumentation scope of the spans
SCOPE = "queue_manager"
#: the W3C fields an event carries, in the order of its columns
TRACE_KEYS = ("traceparent", "tracestate", "baggage")
#: the most links a manager's batch span gets (the SDK's default limit of links per span)
MAX_LINKS = 128

#: How a receiver's ``process`` span relates to the event's creation context:
#: ``first_parent`` (default): its child on the first attempt, a new trace linked to it on a re-fire
#: (a retry after a back-off does not stretch the request's trace, and is sampled on its own);
#: ``parent``: its child on every attempt; ``link``: a new trace linked to it on every attempt;
#: ``none``: a new trace, unrelated.
TraceMode = Literal["first_parent", "parent", "link", "none"]
TRACE_MODES: tuple[str, ...] = ("first_parent", "parent", "link", "none")

#: a trace context as stored: (traceparent, tracestate, baggage), each None when absent
Context = tuple[str | None, str | None, str | None]
NO_CONTEXT: Context = (None, None, None)


def in_use() -> bool:
    """Whether this process uses OpenTelemetry: its tracing API has been imported (by the
    application, its SDK set-up, or a receiver or manager told to trace). Without it there is no
    current span to carry, and this module imports nothing."""
    return "opentelemetry.trace" in sys.modules


def _require() -> None:
    try:
        import opentelemetry.propagate
        import opentelemetry.trace  # noqa: F401
    except ImportError:
        raise ConfigurationError(
            "tracing needs OpenTelemetry: pip install 'queue-manager[otel]' (or opentelemetry-api)"
        ) from None


def given(carrier: Mapping[str, str] | None) -> Context | None:
    """The context a producer gave for an event (a W3C carrier: ``traceparent`` and optionally
    ``tracestate`` and ``baggage``), or None when it gave none (then the current one is used).
    An empty mapping means "no context". The values are checked by the database."""
    if carrier is None:
        return None
    unknown = set(carrier) - set(TRACE_KEYS)
    if unknown:
        raise InvalidEventError(
            f"trace_context has unknown key(s) {', '.join(sorted(map(repr, unknown)))}: give traceparent, "
            "tracestate and baggage (W3C)"
        )
    for key, value in carrier.items():
        if not isinstance(value, str):
            raise InvalidEventError(f"trace_context[{key!r}] must be a string, got {type(value).__name__}")
    return (carrier.get("traceparent"), carrier.get("tracestate"), carrier.get("baggage"))


# ----------------------------------------------------------------------------------- producers


@contextmanager
def send(queue: str, *, count: int | None = None, shard: str | None = None) -> Iterator[Context]:
    """A PRODUCER span ``send <queue>`` around an enqueue (``count``: the events of a batch), and the
    context to store with the events: the span's, injected by the global propagator (so tracestate
    and baggage come too); without an SDK (the API's no-op spans) the current context's. NO_CONTEXT
    when OpenTelemetry is not in use, or when there is no valid context (nothing would stitch)."""
    if not in_use():
        yield NO_CONTEXT
        return
    from opentelemetry import context, propagate, trace

    outer = context.get_current()
    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM,
        "messaging.destination.name": queue,
        "messaging.operation.name": "send",
        "messaging.operation.type": "send",
    }
    if count is not None:
        attributes["messaging.batch.message_count"] = count
    if shard is not None:
        attributes["qm.shard"] = shard
    tracer = trace.get_tracer(SCOPE)
    with tracer.start_as_current_span(f"send {queue}", kind=trace.SpanKind.PRODUCER, attributes=attributes) as span:
        carrier: dict[str, str] = {}
        # without an SDK the span is invalid: the current context (an incoming request's) goes instead
        propagate.inject(carrier, context=None if span.get_span_context().is_valid else outer)
        yield (carrier.get("traceparent"), carrier.get("tracestate"), carrier.get("baggage"))


# ----------------------------------------------------------------------------------- receivers


def check_mode(mode: str) -> TraceMode:
    if mode not in TRACE_MODES:
        raise ValueError(f"trace_mode must be one of {', '.join(TRACE_MODES)}, got {mode!r}")
    return mode  # type: ignore[return-value]


def _creation(traceparent: str | None, tracestate: str | None, baggage: str | None) -> Any:
    """The OpenTelemetry context extracted from an event's stored fields (None when it has none)."""
    from opentelemetry import propagate

    if traceparent is None and baggage is None:
        return None
    carrier = {k: v for k, v in zip(TRACE_KEYS, (traceparent, tracestate, baggage), strict=True) if v is not None}
    return propagate.extract(carrier)


def _link_to(ctx: Any) -> list[Link]:
    from opentelemetry import trace

    if ctx is None:
        return []
    sc = trace.get_current_span(ctx).get_span_context()
    return [trace.Link(sc)] if sc.is_valid else []


class ReceiverTracer:
    """The spans of a receiver (one per receiver; see :data:`TraceMode` for ``mode``)."""

    def __init__(self, queue: str, mode: TraceMode = "first_parent") -> None:
        _require()
        from opentelemetry import trace

        self.queue = queue
        self.mode = check_mode(mode)
        self._trace = trace
        self._tracer = trace.get_tracer(SCOPE)

    def _attributes(self, operation: str, kind: str, event: Any) -> dict[str, Any]:
        return {
            "messaging.system": SYSTEM,
            "messaging.destination.name": self.queue,
            "messaging.operation.name": operation,
            "messaging.operation.type": kind,
            "messaging.message.id": str(event.id),
            "messaging.destination.partition.id": str(event.partition),
            "qm.attempt": event.attempt,
            "qm.tenant": event.tenant,
            "qm.shard": event.shard,
        }

    @contextmanager
    def process(self, event: Any) -> Iterator[Span]:
        """The CONSUMER span ``process <queue>`` around one handler call, current while it runs
        (a sync handler's thread gets it with the context copied into it). The event's baggage, when
        it has some, is in the handler's context whatever the mode but ``none``."""
        from opentelemetry import context

        trace = self._trace
        creation = None if self.mode == "none" else _creation(event.traceparent, event.tracestate, event.baggage)
        as_parent = self.mode == "parent" or (self.mode == "first_parent" and event.attempt == 1)
        if as_parent:
            base, links = creation, []
        else:
            links = _link_to(creation)
            # a new trace: no parent span (not even an ambient one), the creation context's baggage kept
            base = trace.set_span_in_context(trace.INVALID_SPAN, creation)
        # the base context is made current, so that the handler sees its baggage too
        token = context.attach(base) if base is not None else None
        try:
            with self._tracer.start_as_current_span(
                f"process {self.queue}",
                kind=trace.SpanKind.CONSUMER,
                links=links,
                attributes=self._attributes("process", "process", event),
                record_exception=True,
                set_status_on_exception=True,
            ) as span:
                yield span
        finally:
            if token is not None:
                context.detach(token)

    def failed(self, error: BaseException | str) -> None:
        """The handler of the current ``process`` span failed (an exception it raised, which the
        receiver turns into a nack, or a timeout): mark the span."""
        from opentelemetry.trace import Status, StatusCode

        span = self._trace.get_current_span()
        if isinstance(error, BaseException):
            span.record_exception(error)
            span.set_attribute("error.type", type(error).__qualname__)
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"[:200]))
        else:
            span.set_attribute("error.type", error)
            span.set_status(Status(StatusCode.ERROR, error))

    def settle(self, event: Any, operation: str, parent: Span | None) -> None:
        """A CLIENT span ``ack <queue>`` or ``nack <queue>`` (operation type ``settle``): the
        outcome handed to the connection, which sends it in its next frame. A child of the process
        span when given."""
        trace = self._trace
        ctx = trace.set_span_in_context(parent) if parent is not None else None
        # fewer attributes than the process span's: its parent has the rest (each costs the SDK time)
        span = self._tracer.start_span(
            f"{operation} {self.queue}",
            context=ctx,
            kind=trace.SpanKind.CLIENT,
            attributes={
                "messaging.system": SYSTEM,
                "messaging.destination.name": self.queue,
                "messaging.operation.name": operation,
                "messaging.operation.type": "settle",
                "messaging.message.id": str(event.id),
            },
        )
        span.end()


# ----------------------------------------------------------------------------------- the manager


class ManagerTracer:
    """A manager's spans: for a ``sample`` share of its fire and ack batches (0 < sample <= 1), a
    span linked to the creation contexts of the batch's events (at most :data:`MAX_LINKS`)."""

    def __init__(self, sample: float, *, shard: str | None, rng: random.Random | None = None) -> None:
        if not 0 < sample <= 1:
            raise ValueError(f"trace sample must be in (0, 1], got {sample!r}")
        _require()
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.sample = sample
        #: the shard's name (``qm.shard``), once the manager knows it
        self.shard = shard
        self._rng = rng or random.Random()
        self._trace = trace
        self._tracer = trace.get_tracer(SCOPE)
        self._w3c = TraceContextTextMapPropagator()

    @staticmethod
    def now_ns() -> int:
        """A span's timestamp: the wall clock in nanoseconds."""
        return time.time_ns()

    def sampled(self) -> bool:
        """Whether to trace the next batch."""
        return self.sample >= 1 or self._rng.random() < self.sample

    def _links(self, traceparents: Iterable[str | None]) -> list[Link]:
        trace = self._trace
        links = []
        for tp in traceparents:
            if tp is None:
                continue
            sc = trace.get_current_span(self._w3c.extract({"traceparent": tp})).get_span_context()
            if sc.is_valid:
                links.append(trace.Link(sc))
                if len(links) >= MAX_LINKS:
                    break
        return links

    def batch(self, operation: str, queue: str, count: int, traceparents: Iterable[str | None], start_ns: int) -> None:
        """Record one batch span (``fire <queue>``: PRODUCER, the events pushed; ``ack <queue>``:
        SERVER, the acks committed) from ``start_ns`` (time.time_ns) to now, a new trace each."""
        trace = self._trace
        kind = trace.SpanKind.PRODUCER if operation == "fire" else trace.SpanKind.SERVER
        span = self._tracer.start_span(
            f"{operation} {queue}",
            context=trace.set_span_in_context(trace.INVALID_SPAN),
            kind=kind,
            links=self._links(traceparents),
            start_time=start_ns,
            attributes={
                "messaging.system": SYSTEM,
                "messaging.destination.name": queue,
                "messaging.operation.name": operation,
                "messaging.operation.type": "send" if operation == "fire" else "settle",
                "messaging.batch.message_count": count,
                "qm.shard": self.shard or "",
            },
        )
        span.end()


def setup_exporter(service: str) -> None:
    """Give a process that has no tracer provider yet (the ``qm manager`` command) the SDK's, with
    an OTLP/HTTP exporter (endpoint from the standard ``OTEL_EXPORTER_OTLP_*`` variables), or the
    console exporter when ``OTEL_TRACES_EXPORTER=console``."""
    import os

    _require()
    from opentelemetry import trace

    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
    except ImportError:
        raise ConfigurationError(
            "a manager's spans need the OpenTelemetry SDK: pip install 'queue-manager[otel]'"
        ) from None
    exporter: SpanExporter
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp") == "console":
        exporter = ConsoleSpanExporter()
    else:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ConfigurationError(
                "a manager's spans need the OTLP exporter: pip install 'queue-manager[otel]'"
            ) from None
        exporter = OTLPSpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service)}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
