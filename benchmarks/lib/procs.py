"""Process entry points of the one-shard benchmarks (importable, so ``multiprocessing`` spawn can
start them; the parent's side is :mod:`benchmarks.lib.fleet`).

Three kinds of process, each with its own asyncio loop:

* :func:`manager_main`: one :class:`queue_manager.manager.Manager` serving the benchmark shard,
  with timing counters around its database calls (and cProfile when asked);
* :func:`receiver`: one :class:`receivers.testing.MinimalClient` with a no-op handler that
  records what the test needs (nothing, the producer's sequence number, or the event's fire_at);
* :func:`produce`: an open-loop paced producer, one transaction (autocommit INSERT) per event.

The last two run under :func:`spawned`, which gives them an event loop and reports a failure.

Timestamps that cross processes are ``time.time()``: every process (and the database server) runs
on the same machine, so they share one clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import inspect
import json
import logging
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from benchmarks.lib.server import QUEUE
from queue_manager.local import fleet

SECRET = "e2e-benchmark-secret-0001"
TENANTS = tuple(f"tenant-{i:04d}" for i in range(1000))
#: how often a receiver publishes its ack count to the parent (seconds)
ACK_POLL = 0.002
#: how long the manager process waits for Manager.run() to return after request_stop()
STOP_TIMEOUT = 5.0


def token_entries() -> list[dict[str, Any]]:
    return [fleet.Token("bench", SECRET, (QUEUE,)).entry()]


def _logging() -> None:
    import faulthandler
    import signal

    from queue_manager.logs import ExtraFormatter

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 <pid>: stacks on stderr
    handler = logging.StreamHandler(sys.stderr)
    # the records' extra fields (action, term, error, ...) are kept in the line
    handler.setFormatter(ExtraFormatter("%(asctime)s %(processName)s %(name)s %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])


async def _wait_mp_event(ev: Any, poll: float = 0.01) -> None:
    """Wait for a multiprocessing Event without blocking the loop (polls: a thread blocked in
    ``ev.wait()`` would keep ``asyncio.run`` from returning when the event is never set)."""
    while not ev.is_set():
        await asyncio.sleep(poll)


# --------------------------------------------------------------------------- manager


#: a manager database call (or an event-loop stall) longer than this is recorded with its time
SLOW_CALL = 0.02
#: most slow calls kept (the latest)
SLOW_KEEP = 20_000


def _instrument_store(counters: dict[str, list[float]], slow: list[tuple[str, float, float]] | None = None) -> None:
    """Time every database call of the manager (count, seconds awaited, items) by wrapping ``store``.

    Every coroutine function of ``queue_manager.manager.store`` except the ``connect*`` ones and
    ``wait_wake_lock`` (which waits as long as a producer keeps its transaction open) is wrapped. The
    manager calls them through the module, so replacing the module's attributes in this process is
    enough. Items: the rows of a result that is a tuple of rows and more (a scan, fire_due), else
    the length of a list 4th argument (the ids of fire, ack, release, extend), else of a list
    result (rows). The seconds are wall time from the call to its
    result, which includes the time other tasks of the loop ran before this one resumed. Calls
    longer than SLOW_CALL go to ``slow`` as (name, wall-clock start, seconds).
    """
    from queue_manager.manager import store

    def items_of(args: tuple[Any, ...], result: Any) -> int:
        if isinstance(result, tuple) and result and isinstance(result[0], list):
            return len(result[0])  # rows (and more): a scan, a fire_due
        if len(args) > 3 and isinstance(args[3], list | tuple):
            return len(args[3])
        if isinstance(result, list):
            return len(result)
        return 0

    def make(name: str, original: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            result = None
            try:
                result = await original(*args, **kwargs)
                return result
            finally:
                took = time.perf_counter() - t
                c = counters.setdefault(name, [0, 0.0, 0])
                c[0] += 1
                c[1] += took
                c[2] += items_of(args, result)
                if slow is not None and took > SLOW_CALL:
                    slow.append((name, time.time() - took, took))
                    if len(slow) > SLOW_KEEP:
                        del slow[: len(slow) - SLOW_KEEP]

        return timed

    for name, obj in list(vars(store).items()):
        own = getattr(obj, "__module__", None) == store.__name__
        if not name.startswith("connect") and name != "wait_wake_lock" and own and inspect.iscoroutinefunction(obj):
            setattr(store, name, make(name, obj))


def _instrument_frames(counters: dict[str, list[float]]) -> None:
    """Count deliver frames and the events in them (wraps ``frames.deliver_frames``)."""
    from queue_manager.wire import frames as protocol

    original = protocol.deliver_frames

    def counted(queue: str, events: list[dict[str, Any]], per_frame: int) -> list[str]:
        texts = original(queue, events, per_frame)
        c = counters.setdefault("deliver_frames", [0, 0.0, 0])
        c[0] += len(texts)
        c[2] += len(events)
        return texts

    protocol.deliver_frames = counted


def otel_sdk() -> None:
    """Give this process the OpenTelemetry SDK's tracer provider with a batch processor and an
    exporter that drops the spans: the cost of making and batching them, without a network."""
    from collections.abc import Sequence

    from opentelemetry import trace
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Dropped(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Dropped()))
    trace.set_tracer_provider(provider)


def manager_main(
    dsn: str, overrides: dict[str, Any], status_q: Any, stop_ev: Any, reset_ev: Any, profile_path: str | None
) -> None:
    """Run a manager until ``stop_ev``; report ("ready", port) then ("done", counters)."""
    _logging()
    try:
        asyncio.run(_manager(dsn, overrides, status_q, stop_ev, reset_ev, profile_path))
    except BaseException as exc:
        status_q.put(("error", f"{type(exc).__name__}: {exc}"))
        raise


async def _manager(
    dsn: str, overrides: dict[str, Any], status_q: Any, stop_ev: Any, reset_ev: Any, profile_path: str | None
) -> None:
    from queue_manager.manager import Manager, ManagerConfig
    from queue_manager.manager.auth import TokenStore

    def dump_tasks() -> None:  # kill -USR2 <pid>: every task's stack on stderr
        for t in asyncio.all_tasks():
            t.print_stack(limit=8, file=sys.stderr)
        print(
            "manager role",
            manager.role,
            "receivers",
            len(manager.connections),
            "stop",
            stop_ev.is_set(),
            file=sys.stderr,
            flush=True,
        )

    import signal

    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR2, dump_tasks)
    counters: dict[str, list[float]] = {}
    slow: list[tuple[str, float, float]] = []
    _instrument_store(counters, slow)
    _instrument_frames(counters)
    if overrides.get("trace_sample"):
        otel_sdk()
    manager = Manager(ManagerConfig(dsn=dsn, tokens=TokenStore.from_entries(token_entries()), **overrides))
    task = asyncio.create_task(manager.run())
    await asyncio.wait_for(manager.ready.wait(), 30)
    deadline = time.monotonic() + 30
    while not (manager.role == "leader" and QUEUE in manager.queues):
        if task.done():
            await task  # raises what stopped it
            raise RuntimeError("the manager stopped before leading")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the manager did not lead within 30 s (role {manager.role})")
        await asyncio.sleep(0.01)

    async def on_reset() -> None:  # the parent's "go": count from here
        await _wait_mp_event(reset_ev)
        counters.clear()

    async def loop_lag() -> None:  # event-loop stalls: a 5 ms sleep that took much longer
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            lag = time.perf_counter() - t - 0.005
            if lag > SLOW_CALL:
                slow.append(("loop_lag", time.time() - lag, lag))

    resetter = asyncio.create_task(on_reset())
    lagger = asyncio.create_task(loop_lag())
    profiler = cProfile.Profile() if profile_path else None
    status_q.put(("ready", manager.port))
    if profiler is not None:
        profiler.enable()
    await _wait_mp_event(stop_ev, 0.05)
    if profiler is not None and profile_path is not None:
        profiler.disable()
        profiler.dump_stats(profile_path)
    resetter.cancel()
    lagger.cancel()
    snapshot = {k: list(v) for k, v in counters.items()}
    manager.request_stop()
    # asyncio.wait, not wait_for: wait_for would cancel the task on timeout and then wait for it
    done, _ = await asyncio.wait({task}, timeout=STOP_TIMEOUT)
    hung = not done
    if done and not task.cancelled() and task.exception() is not None:
        logging.getLogger("bench.manager").warning("manager.run() raised %r", task.exception())
    status_q.put(("done", {"counters": snapshot, "slow": slow[-SLOW_KEEP:], "role": manager.role, "stop_hung": hung}))
    if hung:
        # Manager.run() did not return after request_stop(): report, then leave without waiting
        # for its tasks (asyncio.run would wait for them again at exit).
        logging.getLogger("bench.manager").warning(
            "the manager did not stop within %.0f s of request_stop() (role %s); exiting its process",
            STOP_TIMEOUT,
            manager.role,
        )
        status_q.close()
        status_q.join_thread()
        sys.stderr.flush()
        os._exit(3)


# --------------------------------------------------------------------------- receivers


def spawned(main: Callable[..., Coroutine[Any, Any, None]], out_q: Any, tag: dict[str, Any], *args: Any) -> None:
    """Entry point of a receiver or producer process: ``main(*args)`` in its own event loop.

    A failure is put on ``out_q`` as ``{**tag, "error": ...}`` (the parent reads results there) and
    re-raised.
    """
    _logging()
    try:
        asyncio.run(main(*args))
    except BaseException as exc:
        out_q.put({**tag, "error": f"{type(exc).__name__}: {exc}"})
        raise


async def receiver(
    idx: int,
    url: str,
    mode: str,
    credit: int,
    concurrency: int,
    ready_ev: Any,
    go_ev: Any,
    stop_ev: Any,
    handled: Any,
    acked: Any,
    last_ack: Any,
    out_q: Any,
    profile_path: str | None,
    library: bool = False,
    service: float = 0.0,
    tracing: bool = False,
) -> None:
    """One receiver connection in its own process.

    ``tracing`` (with ``library``): the Receiver makes its spans, into the SDK (:func:`otel_sdk`).

    ``library``: the receiver library's :class:`receivers.Receiver` (credit = its free handler
    slots: ``credit`` of them) instead of the bare benchmark client.

    ``mode`` is ``drain`` (connect at go; no-op handler), ``latency`` (connect first; record
    (payload seq, handler start)), ``fire`` (connect first; record (id, fire_at, handler start)) or
    ``tenant`` (connect first; record (tenant, id, fire_at, handler start), then take ``service``
    seconds: a handler of fixed service time, which keeps the receiver's slots busy).
    ``handled``/``acked`` are shared counters; ``last_ack`` the time.time() the ack count last moved.
    """
    from receivers.testing import Delivery as Event
    from receivers.testing import MinimalClient

    records: list[tuple[Any, ...]] = []
    now = time.time

    if mode == "drain":

        async def handler(event: Event) -> None:
            handled.value += 1

    elif mode == "latency":

        async def handler(event: Event) -> None:
            t = now()
            records.append((event.payload["seq"], t))
            handled.value += 1

    elif mode == "fire":

        async def handler(event: Event) -> None:
            t = now()
            records.append((event.id, event.fire_at, t, event.attempt))
            handled.value += 1

    elif mode == "tenant":

        async def handler(event: Event) -> None:
            t = now()
            records.append((event.tenant, event.id, event.fire_at, t))
            handled.value += 1
            if service > 0:
                await asyncio.sleep(service)

    else:  # pragma: no cover
        raise ValueError(mode)

    def make_receiver() -> Any:
        if library:
            from receivers import Receiver as LibraryReceiver

            if tracing:
                otel_sdk()
            return LibraryReceiver({"s0": [url]}, QUEUE, handler, concurrency=credit, token=SECRET, tracing=tracing)
        return MinimalClient(url, SECRET, QUEUE, handler, credit=credit, concurrency=concurrency, reconnect_delay=0.05)

    receiver: Any = None
    task: asyncio.Task[None] | None = None
    if mode != "drain":  # connect and subscribe first, then idle until the test starts
        receiver = make_receiver()
        task = asyncio.create_task(receiver.run())
        if library:
            await receiver.wait_subscribed(30)
        else:
            await asyncio.wait_for(receiver.connected.wait(), 30)
    ready_ev.set()
    await _wait_mp_event(go_ev, 0.001)
    t_go = now()
    profiler = cProfile.Profile() if profile_path else None
    if profiler is not None:
        profiler.enable()
    if receiver is None:
        receiver = make_receiver()
        task = asyncio.create_task(receiver.run())
    assert task is not None
    stop_task = asyncio.create_task(_wait_mp_event(stop_ev, 0.05))
    seen = 0
    while not stop_task.done():
        n = receiver.stats.acked
        if n != seen:
            seen = n
            last_ack.value = now()
            acked.value = n
        if task.done():
            break
        await asyncio.sleep(ACK_POLL)
    if profiler is not None and profile_path is not None:
        profiler.disable()
        profiler.dump_stats(profile_path)
    receiver.stop()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(task, 10)
    error = None
    if task.done() and not task.cancelled() and task.exception() is not None:
        error = repr(task.exception())
    if not stop_task.done():
        await stop_task
    stats = receiver.stats
    out_q.put(
        {
            "idx": idx,
            "t_go": t_go,
            "delivered": stats.delivered,
            "acked": stats.acked,
            "nacked": stats.nacked,
            "connects": getattr(stats, "connects", None),
            "refused": getattr(stats, "refused", None),
            "errors": list(getattr(stats, "errors", []))[:20],
            "error_count": len(getattr(stats, "errors", [])),
            "records": records,
            "error": error,
        }
    )


# --------------------------------------------------------------------------- producer

INSERT = f"INSERT INTO {QUEUE} (tenant, payload) VALUES (%s, %s)"
INSERT_PRIORITY = f"INSERT INTO {QUEUE} (tenant, payload, priority) VALUES (%s, %s, %s)"


async def produce(
    dsn: str,
    n: int,
    warmup: int,
    rate: float,
    conns: int,
    seed: int,
    ready_ev: Any,
    go_ev: Any,
    out_q: Any,
    tenant: str | None = None,
    priority: int | None = None,
) -> None:
    """Open-loop pacing: event k is due at t0 + k/rate; ``conns`` connections take turns (k mod conns).

    Each event is one autocommit INSERT (one transaction) for a random tenant of TENANTS, or for
    ``tenant`` when given, at ``priority`` when given; its payload carries the sequence number
    (negative for warm-up events) and the time.time() the call started. Reports seq -> (call start,
    commit returned) for every event.
    """
    import psycopg

    rng = random.Random(seed)
    total = warmup + n
    tenants = [tenant or rng.choice(TENANTS) for _ in range(total)]
    connections = [await psycopg.AsyncConnection.connect(dsn, autocommit=True) for _ in range(conns)]
    sent: dict[int, tuple[float, float]] = {}
    ready_ev.set()
    await _wait_mp_event(go_ev, 0.001)
    start = time.monotonic() + 0.01
    now = time.time

    async def worker(j: int, conn: Any) -> None:
        cur = conn.cursor()
        for k in range(j, total, conns):
            delay = start + k / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            seq = k - warmup
            t_call = now()
            payload = json.dumps({"seq": seq, "t": t_call})
            if priority is None:
                await cur.execute(INSERT, (tenants[k], payload), prepare=True)
            else:
                await cur.execute(INSERT_PRIORITY, (tenants[k], payload, priority), prepare=True)
            sent[seq] = (t_call, now())

    await asyncio.gather(*(worker(j, c) for j, c in enumerate(connections)))
    elapsed = time.monotonic() - start
    for c in connections:
        await c.close()
    out_q.put({"sent": sent, "elapsed": elapsed, "pid": os.getpid()})
