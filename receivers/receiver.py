"""The receiver library: receive a queue's events from every shard, run a handler, ack.

    async def handle(event: Event) -> None:
        ...                                  # return: ack; raise: nack; raise Retry(delay=30): nack, due in 30 s

    receiver = Receiver({"s0": ["ws://mgr-a:8765/", "ws://mgr-b:8765/"], "s1": [...]},
                        "orders", handle, concurrency=8, token="...")
    await receiver.run()                     # until receiver.stop() (or SIGTERM with handle_signals=True)

One connection per shard (protocol ``qm.v1``, docs/protocol.md). For each shard the receiver
probes its managers' ``/health/leader`` and connects to the one that answers 200. A manager that
does not lead holds the probe (``?wait=``) until it takes over or for HOLD seconds, so when the
connection ends (the manager drains, loses leadership, crashes or the network drops) the receiver
hears of the next leader the moment its session starts. Managers that cannot be reached (a dead
one refuses at once) are probed again only after a jittered exponential back-off.

Per shard it runs at most ``concurrency`` handlers at once and grants credit so that the manager
sends an event only when a handler slot is free for it (:mod:`queue_manager.wire.credit`). Handlers may be
coroutine functions or plain functions (run in a thread pool). A handler that runs longer than
``extend_after`` seconds gets its ack deadline extended (``extend`` frames, every ``extend_by / 2``
seconds); one that runs longer than ``handler_timeout`` is nacked. :meth:`Receiver.stop` drains: credit 0, the
handlers in hand finish and are acked, then the connections close.

An operator may cancel an event while its handler runs (``qm events cancel``): the manager sends a
``cancel`` frame (this library asks for the feature in its subscribe), and the handler is stopped:
a coroutine handler's task is cancelled (``asyncio.CancelledError`` inside it), a plain function's
``event.cancelled`` turns true (poll it, or wait on ``event.cancel_requested``). Nothing is sent for
a cancelled event: it is ``cancelled`` in the database, and never fired again.

Delivery is at least once: an event in hand when its connection drops is fired again, to this
receiver or another, and its old handler's ack is dropped. Handlers must be idempotent, or settle
the event in their own transaction with :func:`receivers.sql.ack_in_transaction`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import json
import logging
import signal
import ssl
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from queue_manager.domain.topology import Topology, TopologyFile
from queue_manager.errors import TopologyError
from queue_manager.tracing import ReceiverTracer, TraceMode, check_mode, in_use
from queue_manager.wire.client import (
    ACK,
    SETTLED,
    Cancelled,
    ClientSession,
    Effect,
    Outcome,
    Refused,
    RetryLater,
    Send,
    ServerFrameError,
    Start,
    Subscribed,
)
from queue_manager.wire.frames import MAX_ERROR_TEXT, MAX_EXTEND_SECONDS, PROTOCOL
from receivers.backoff import Backoff
from receivers.errors import ReceiverError

logger = logging.getLogger("receivers")

#: seconds a manager that does not lead holds a ``/health/leader`` probe (it answers 200 the moment
#: it takes over): the receivers hear of a new leader at once, at one request per manager per HOLD
HOLD = 5.0
#: seconds before a manager that answered a probe at once (it does not lead, or cannot be reached)
#: is asked again while another manager holds its probe; doubled each time up to REPROBE_MAX
REPROBE_FIRST = 0.1
REPROBE_MAX = 0.4

#: a handler: ``async def handler(event) -> None`` or ``def handler(event) -> None``
Handler = Callable[["Event"], Awaitable[None]] | Callable[["Event"], None]


class Retry(Exception):
    """Raise it from a handler to nack the event and have it due again after ``delay`` seconds
    (``None``: the queue's back-off). The message becomes the event's ``last_error``.
    At the queue's ``max_attempts`` the event is dead-lettered, as for any nack."""

    def __init__(self, message: str = "retry requested by the handler", *, delay: float | None = None) -> None:
        super().__init__(message)
        if delay is not None and not 0 <= delay <= 315_576_000:
            raise ValueError(f"Retry delay must be 0 to 315576000 seconds, got {delay!r}")
        self.delay = delay


@dataclass(eq=False)
class Event:
    """One delivered event (one attempt of it)."""

    queue: str
    #: the shard it came from (the key of ``urls_by_shard``); ids are unique per queue and shard
    shard: str
    id: int
    #: which delivery this is (1, 2, ...); an ack names (id, attempt)
    attempt: int
    tenant: str
    partition: int
    #: when the event was due, epoch seconds by the database clock
    fire_at: float
    payload: Any
    #: its W3C trace context, as the producer stored it (None when it has none; docs/observability.md)
    traceparent: str | None = field(default=None, repr=False)
    tracestate: str | None = field(default=None, repr=False)
    baggage: str | None = field(default=None, repr=False)
    #: its priority, 1 (highest) to 5 (docs/protocol.md, "deliver"; 3 from a manager that sends none)
    priority: int = 3
    #: when it arrived, by this process's monotonic clock
    received_at: float = field(default_factory=time.monotonic, repr=False)
    _settled_by_sql: bool = field(default=False, repr=False)
    #: set when an operator cancels this delivery (a thread may wait on it: :attr:`cancel_requested`)
    cancel_requested: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def cancelled(self) -> bool:
        """True once an operator cancelled this delivery: a plain function handler polls it and
        returns (whatever it returns, nothing is sent: the event is cancelled in the database)."""
        return self.cancel_requested.is_set()

    @property
    def settled_by_sql(self) -> bool:
        """True once :func:`receivers.sql.ack_in_transaction` has acked it in the handler's transaction."""
        return self._settled_by_sql

    def mark_settled_by_sql(self) -> None:
        """The handler settled this event in its own transaction: the receiver sends no ack for it
        (when the handler returns normally; if the handler raises, it is nacked as usual)."""
        self._settled_by_sql = True


@dataclass
class ReceiverStats:
    """Counters over every shard, since the receiver started."""

    delivered: int = 0
    acked: int = 0
    #: nacks that put the event back (requeued)
    nacked: int = 0
    #: nacks that dead-lettered the event (its last attempt)
    dead_lettered: int = 0
    #: events the handler settled by SQL (no ack frame sent)
    settled_by_sql: int = 0
    #: handlers stopped by ``handler_timeout``
    timeouts: int = 0
    #: deliveries an operator cancelled while this receiver held them (their handlers told to stop)
    cancelled: int = 0
    #: lease extensions the manager confirmed
    extended: int = 0
    #: results dropped because the event was no longer this connection's (stale, unknown_id, reconnect)
    dropped: int = 0
    #: successful subscriptions (first connections and reconnections)
    connects: int = 0
    #: HTTP refusals of the websocket handshake, by status
    refused: dict[int, int] = field(default_factory=dict)
    #: the last error frames and per-item errors (at most 100 kept)
    errors: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=100))


def http_url(base: str, path: str) -> str:
    """``path`` on the manager at ``base`` (``ws``/``wss``/``http``/``https``), as an http(s) URL."""
    parts = urlsplit(base)
    scheme = {"ws": "http", "wss": "https", "http": "http", "https": "https"}.get(parts.scheme)
    if scheme is None or not parts.hostname:
        raise ValueError(f"manager URL {base!r}: use ws://host:port/ (or wss://, http://, https://)")
    return urlunsplit((scheme, parts.netloc, path, "", ""))


def ws_url(base: str) -> str:
    """The websocket URL of the manager at ``base``."""
    parts = urlsplit(base)
    scheme = {"ws": "ws", "wss": "wss", "http": "ws", "https": "wss"}.get(parts.scheme)
    if scheme is None or not parts.hostname:
        raise ValueError(f"manager URL {base!r}: use ws://host:port/ (or wss://, http://, https://)")
    return urlunsplit((scheme, parts.netloc, parts.path or "/", "", ""))


async def probe_leader(base: str, timeout: float = 1.0, hold: float = 0.0) -> tuple[int, int | None] | None:
    """GET ``/health/leader`` of one manager: (HTTP status, term), or None when it cannot be reached.

    ``hold``: a manager that does not lead answers when it takes over, or after ``hold`` seconds
    (``?wait=``); ``timeout`` counts on top of it."""
    target = urlsplit(http_url(base, f"/health/leader?wait={hold:g}" if hold > 0 else "/health/leader"))
    host = target.hostname
    assert host is not None
    tls = target.scheme == "https"
    port = target.port or (443 if tls else 80)
    writer = None
    try:
        async with asyncio.timeout(timeout + hold):
            reader, writer = await asyncio.open_connection(
                host, port, ssl=ssl.create_default_context() if tls else None
            )
            path = f"{target.path}?{target.query}" if target.query else target.path
            writer.write(
                f"GET {path} HTTP/1.1\r\nHost: {target.netloc}\r\nConnection: close\r\n"
                "Accept: application/json\r\n\r\n".encode("ascii")
            )
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            length = None
            for line in lines[1:]:
                key, _, value = line.partition(":")
                if key.strip().lower() == "content-length":
                    length = int(value)
            body = await (reader.readexactly(length) if length is not None else reader.read(1 << 16))
    except (OSError, TimeoutError, ValueError, IndexError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        return None
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
    term: int | None = None
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        value = json.loads(body).get("term")
        term = int(value) if value is not None else None
    return status, term


def is_async_handler(handler: Callable[..., Any]) -> bool:
    """Whether ``handler`` is a coroutine function (or an object whose ``__call__`` is one)."""
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(type(handler).__call__)


@dataclass(eq=False)
class _Running:
    event: Event
    #: the connection it was delivered on (its generation number)
    gen: int
    #: when its ack deadline was last extended (monotonic), None before the first extension
    extended_at: float | None = None


class _Link:
    """The receiver's side of one shard: leader discovery, one connection at a time, its handlers.

    The asyncio adapter of the shard's :class:`~queue_manager.wire.client.ClientSession`, which
    keeps the protocol's state: this class moves its frames over the websocket, runs the handlers
    it starts and keeps the clocks (lease extensions, drain, retries)."""

    def __init__(self, receiver: Receiver, shard: str, urls: Sequence[str]) -> None:
        self.r = receiver
        self.shard = shard
        self.urls = list(urls)
        self.session: ClientSession[Event] = ClientSession(
            shard,
            receiver.queue,
            slots=receiver.concurrency,
            make_event=self._event,
            stats=receiver.stats,
            tenants=receiver.tenants,
            cancellable=True,
        )
        self.backoff = receiver.backoff_factory()
        #: set when the receiver stops or the shard leaves the topology file: drain, then close
        self.stopping = asyncio.Event()
        if receiver.stopping.is_set():
            self.stopping.set()
        #: the threads of a plain function handler
        self.pool = (
            None
            if receiver.handler_is_async
            else ThreadPoolExecutor(receiver.concurrency, thread_name_prefix=f"qm-handler-{shard}")
        )
        self.ws: ClientConnection | None = None
        self.url: str | None = None
        #: the manager to try first on the next connection (the one a leader check found leading)
        self.hint: str | None = None
        #: probe rounds in a row that found no leader (the first is logged at INFO, the rest at DEBUG)
        self._leaderless_rounds = 0
        self.term: int | None = None
        self.subscribed = asyncio.Event()
        self.running: dict[asyncio.Future[Any], _Running] = {}
        #: the writer should look at the session's frames
        self.wake = asyncio.Event()
        #: something was settled or a connection ended (the drain waits on it)
        self.changed = asyncio.Event()

    def _event(self, queue: str, raw: Mapping[str, Any]) -> Event:
        r = raw
        event = Event(queue, self.shard, r["id"], r["attempt"], r["tenant"], r["partition"], r["fire_at"], r["payload"])
        event.priority = r.get("priority", 3)
        if len(r) > 7:  # the optional trace context members (docs/protocol.md, "deliver")
            event.traceparent = r.get("traceparent")
            event.tracestate = r.get("tracestate")
            event.baggage = r.get("baggage")
        return event

    # ------------------------------------------------------------------ the connection loop

    async def run(self) -> None:
        try:
            while not self.stopping.is_set():
                url, self.hint = self.hint, None
                held = False
                if url is None:
                    url, held = await self._find_leader()
                if url is not None and not self.stopping.is_set():
                    try:
                        await self._connect(url)
                    finally:
                        self._lost()
                    held = False
                if self.stopping.is_set():
                    break
                # no pause after a round of held probes (it was the wait), nor before the manager a
                # leader check found leading; after a connection, a short one (the back-off starts
                # again from its first step at every subscribe)
                if not held and self.hint is None:
                    await self._pause()
        finally:
            await self._finish_handlers()
            if self.pool is not None:
                self.pool.shutdown(wait=False, cancel_futures=True)

    async def _find_leader(self) -> tuple[str | None, bool]:
        """Probe every manager at once, each probe held by a manager that does not lead until it
        takes over (HOLD): the first to answer 200 wins (the highest term of those that answer
        together). Returns its URL (None: none leads), and whether a manager held a probe: then
        it is alive and will answer the moment it leads, so the next round needs no back-off."""
        loop = asyncio.get_running_loop()

        async def probe(url: str, after: float) -> tuple[int, int | None] | None:
            await asyncio.sleep(after)
            return await probe_leader(url, self.r.probe_timeout, HOLD)

        probes = {asyncio.ensure_future(probe(u, 0.0)): (i, loop.time(), 0) for i, u in enumerate(self.urls)}
        answers: list[int | None] = [None] * len(self.urls)
        held = False
        pending = set(probes)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                leaders = []
                for t in done:
                    i, started, again = probes[t]
                    a = t.result()
                    answers[i] = None if a is None else a[0]
                    held_this = loop.time() - started >= HOLD / 2
                    held = held or held_this
                    if a is not None and a[0] == 200:
                        leaders.append((a[1] or 0, i))
                    elif not held_this and pending:
                        # a manager that answered at once (unreachable: restarting, say) while
                        # another holds its probe is asked again, soon, until that one answers: a
                        # restarted manager that takes over is found within REPROBE_MAX, not HOLD
                        after = min(REPROBE_FIRST * 2**again, REPROBE_MAX)
                        retry = asyncio.ensure_future(probe(self.urls[i], after))
                        probes[retry] = (i, loop.time() + after, again + 1)
                        pending.add(retry)
                if leaders:
                    self._leaderless_rounds = 0
                    return self.urls[max(leaders)[1]], True
        finally:
            for t in pending:
                t.cancel()
        # told once at INFO per gap (managers starting, a failover); every later round at DEBUG
        self._leaderless_rounds += 1
        logger.log(
            logging.INFO if self._leaderless_rounds == 1 else logging.DEBUG,
            "no active manager for shard %s yet",
            self.shard,
            extra={"shard": self.shard, "answers": answers},
        )
        return None, held

    async def _pause(self) -> None:
        delay = self.backoff.next()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await self.stopping.wait()

    async def _connect(self, url: str) -> None:
        headers = {"Authorization": f"Bearer {self.r.token}"} if self.r.token else None
        try:
            async with connect(
                ws_url(url),
                additional_headers=headers,
                subprotocols=[PROTOCOL],  # type: ignore[list-item]
                max_size=self.r.max_size,
                compression=None,
                open_timeout=self.r.probe_timeout * 5,
            ) as ws:
                self.ws, self.url = ws, url
                await self._session(ws)
        except InvalidStatus as exc:
            status = exc.response.status_code
            self.r.stats.refused[status] = self.r.stats.refused.get(status, 0) + 1
            if status in (401, 403):
                raise ReceiverError(
                    f"shard {self.shard}: manager {url} refused the token (HTTP {status}): "
                    f"{exc.response.body.decode('utf-8', 'replace').strip()}"
                ) from None
            logger.info("manager %s refused the connection: HTTP %s", url, status, extra={"shard": self.shard})
        except (OSError, TimeoutError, ConnectionClosed, InvalidURI, InvalidHandshake) as exc:
            logger.info("connection to %s ended: %r", url, exc, extra={"shard": self.shard})
        except ServerFrameError as exc:  # a frame this client cannot read
            logger.warning(
                "protocol error from %s, reconnecting: %r", url, exc, extra={"shard": self.shard}, exc_info=True
            )

    async def _session(self, ws: ClientConnection) -> None:
        self.session.connected(draining=self.stopping.is_set())
        async with asyncio.timeout(self.r.probe_timeout * 5):
            welcome = await ws.recv()
        for effect in self.session.receive(welcome):  # the subscribe
            if isinstance(effect, Send):
                await ws.send(effect.text)
        tasks = [
            asyncio.create_task(self._writer(ws)),
            asyncio.create_task(self._extender()),
            asyncio.create_task(self._drainer(ws)),
        ]
        if self.r.leader_check is not None and len(self.urls) > 1:
            tasks.append(asyncio.create_task(self._watch_leader(ws, self.r.leader_check)))
        try:
            async for message in ws:
                self._apply(self.session.receive(message))
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await t
            if ws.close_code is not None:
                logger.info(
                    "connection to %s closed: %s %s",
                    self.url,
                    ws.close_code,
                    ws.close_reason,
                    extra={"shard": self.shard},
                )

    async def _watch_leader(self, ws: ClientConnection, every: float) -> None:
        """Leave a manager that another one has deposed. A leader frozen with its socket open
        (SIGSTOP, a stalled VM) cannot close its receivers when a standby takes over, and the
        websocket's pings take tens of seconds to notice; so each of the other URLs is watched by
        a held probe (a standby answers it the moment it takes over; a new one follows each
        answer), or probed every ``every`` seconds when it does not hold probes (unreachable), and
        one that leads under a higher term than this connection's ends it at once (its events in
        hand fire again after their ack deadline, as after a crash)."""
        loop = asyncio.get_running_loop()

        async def watch(url: str) -> tuple[int, str]:
            while True:
                started = loop.time()
                a = await probe_leader(url, self.r.probe_timeout, HOLD)
                if a is not None and a[0] == 200 and (a[1] or 0) > (self.term or 0):
                    return a[1] or 0, url
                if loop.time() - started < HOLD / 2:  # not held: look again later
                    await asyncio.sleep(every)

        watches = [asyncio.ensure_future(watch(u)) for u in self.urls if u != self.url]
        if not watches:
            return
        try:
            done, _ = await asyncio.wait(watches, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in watches:
                w.cancel()
        newer = [w.result() for w in done if not w.cancelled() and w.exception() is None]
        if not newer:
            return
        term, url = max(newer)
        logger.warning(
            "manager %s leads shard %s under a newer term %s than this connection's (%s): leaving %s",
            url,
            self.shard,
            term,
            self.term,
            self.url,
            extra={"shard": self.shard, "term": self.term},
        )
        # go straight to it: probing every URL again would wait out the frozen one's timeout
        self.hint = url
        ws.transport.abort()  # a close handshake would wait for the frozen peer

    def _apply(self, effects: list[Effect[Event]]) -> None:
        for effect in effects:
            if isinstance(effect, Start):
                self._start(effect)
            elif isinstance(effect, Cancelled):
                self._cancel(effect)
            elif isinstance(effect, RetryLater):
                asyncio.get_running_loop().call_later(effect.seconds, self.wake.set)
            elif isinstance(effect, Subscribed):
                self.term = effect.term
                self.backoff.reset()
                self.subscribed.set()
                self.r.any_subscribed.set()
                logger.info(
                    "subscribed to %s on shard %s at %s (term %s)",
                    self.r.queue,
                    self.shard,
                    self.url,
                    effect.term,
                    extra={"shard": self.shard, "term": effect.term},
                )
            elif isinstance(effect, Refused):
                if effect.fatal:
                    raise ReceiverError(f"shard {self.shard}: subscribe to {self.r.queue!r} refused: {effect.message}")
                # unknown_queue (maybe created in a moment), draining: try again after the back-off
                logger.warning(
                    "shard %s: subscribe refused: %s: %s",
                    self.shard,
                    effect.code,
                    effect.message,
                    extra={"shard": self.shard},
                )
                raise ConnectionError(f"subscribe refused: {effect.code}")
        self.wake.set()
        self.changed.set()

    def _lost(self) -> None:
        """The connection is gone: forget what it held; the manager re-fires it."""
        held = self.session.connection_lost()
        if held:
            logger.info(
                "connection of shard %s ended with %d event(s) in hand: they will be fired again",
                self.shard,
                held,
                extra={"shard": self.shard},
            )
        self.ws = None
        self.subscribed.clear()
        self.changed.set()

    # ------------------------------------------------------------------ handlers

    def _start(self, start: Start[Event]) -> None:
        task = asyncio.ensure_future(self._handle(start.event, start.gen))
        self.running[task] = _Running(start.event, start.gen)

    def _cancel(self, c: Cancelled) -> None:
        """An operator cancelled a delivery in hand: stop its handler (a task is cancelled, a thread
        sees the event's flag); its slot frees when the handler ends, and nothing is sent for it."""
        self.r.stats.cancelled += 1
        for task, run in list(self.running.items()):
            if run.gen == c.gen and run.event.id == c.id and run.event.attempt == c.attempt:
                run.event.cancel_requested.set()
                if self.r.handler_is_async:
                    task.cancel()
        logger.info(
            "event %s (attempt %s) cancelled by an operator: its handler is stopped",
            c.id,
            c.attempt,
            extra={"shard": self.shard},
        )

    def _slot_freed(self, event: Event) -> None:
        for start in self.session.slot_freed(event):
            self._start(start)
        self.wake.set()
        self.changed.set()

    async def _handle(self, event: Event, gen: int) -> None:
        slot_kept = False
        tracer = self.r.tracer
        try:
            if tracer is None:
                outcome, slot_kept = await self._invoke(event)
            else:
                with tracer.process(event) as span:
                    outcome, slot_kept = await self._invoke(event)
                    if outcome.kind != "settled":
                        tracer.settle(event, outcome.kind, span)
        except asyncio.CancelledError:
            slot_kept = False
            raise
        finally:
            me = asyncio.current_task()
            if me is not None:
                self.running.pop(me, None)
            if not slot_kept:
                self._slot_freed(event)
        self.session.completed(event, gen, outcome)
        self.wake.set()
        self.changed.set()

    async def _invoke(self, event: Event) -> tuple[Outcome, bool]:
        """Run the handler; (what to answer, whether the slot stays taken by a thread still running)."""
        timeout = self.r.handler_timeout
        try:
            if self.r.handler_is_async:
                cm = asyncio.timeout(timeout)
                try:
                    async with cm:
                        await self.r.handler(event)  # type: ignore[misc]
                except TimeoutError:
                    if not cm.expired():
                        raise
                    return self._timed_out(event), False
            else:
                loop = asyncio.get_running_loop()
                ctx = contextvars.copy_context()
                fut = loop.run_in_executor(self.pool, ctx.run, self.r.handler, event)
                done, _ = await asyncio.wait({fut}, timeout=timeout)
                if not done:
                    # a thread cannot be stopped: it keeps its slot until it returns, its result ignored
                    fut.add_done_callback(lambda f: self._thread_returned(f, event))
                    return self._timed_out(event), True
                fut.result()
        except Retry as exc:
            if self.r.tracer is not None:
                self.r.tracer.failed(exc)
            return Outcome("nack", exc.delay, str(exc)[:MAX_ERROR_TEXT]), False
        except Exception as exc:
            if self.r.tracer is not None:
                self.r.tracer.failed(exc)
            text = f"{type(exc).__name__}: {exc}"
            logger.warning(
                "handler failed on event %s (attempt %s): %s",
                event.id,
                event.attempt,
                text,
                extra={"shard": self.shard, "tenant": event.tenant},
                exc_info=True,
            )
            return Outcome("nack", None, text[:MAX_ERROR_TEXT]), False
        if event.settled_by_sql:
            return SETTLED, False
        return ACK, False

    def _timed_out(self, event: Event) -> Outcome:
        self.r.stats.timeouts += 1
        text = f"handler timed out after {self.r.handler_timeout:g} s"
        if self.r.tracer is not None:
            self.r.tracer.failed("timeout")
        logger.warning("event %s (attempt %s): %s", event.id, event.attempt, text, extra={"shard": self.shard})
        return Outcome("nack", None, text)

    def _thread_returned(self, fut: asyncio.Future[Any], event: Event) -> None:
        if not fut.cancelled():
            fut.exception()  # retrieved: a late failure of a timed-out handler is not reported
        self._slot_freed(event)

    async def _finish_handlers(self) -> None:
        """The link ends: let running handlers finish (their results cannot be sent), up to the drain timeout."""
        if not self.running:
            return
        tasks = list(self.running)
        _, pending = await asyncio.wait(tasks, timeout=self.r.drain_timeout)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending, timeout=1.0)

    # ------------------------------------------------------------------ frames out

    async def _writer(self, ws: ClientConnection) -> None:
        """The one task that sends: whatever frames the session has, whenever it may have some."""
        while True:
            await self.wake.wait()
            self.wake.clear()
            for text in self.session.frames():
                await ws.send(text)

    async def _extender(self) -> None:
        """Extend the ack deadline of handlers that run long: first after ``extend_after`` seconds
        from delivery, then every ``extend_by / 2`` seconds, each time to now + ``extend_by``."""
        after, by = self.r.extend_after, self.r.extend_by
        if after is None:
            return
        tick = max(0.05, min(1.0, after / 2, by / 4))
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for run in list(self.running.values()):
                ev = run.event
                if not self.session.holds(ev, run.gen):
                    continue
                due = ev.received_at + after if run.extended_at is None else run.extended_at + by / 2
                if now >= due:
                    run.extended_at = now
                    self.session.extend(ev, run.gen, by)
                    self.wake.set()

    async def _drainer(self, ws: ClientConnection) -> None:
        """On stop: credit 0, wait until nothing is in hand and every result came back, then close."""
        await self.stopping.wait()
        self.session.drain()
        self.wake.set()
        logger.info(
            "draining shard %s: %d event(s) in hand", self.shard, self.session.in_hand, extra={"shard": self.shard}
        )
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.r.drain_timeout):
                while self.session.busy:
                    self.changed.clear()
                    await self.changed.wait()
        if self.session.in_hand:
            logger.warning(
                "drain timeout on shard %s: %d event(s) still in hand will be fired again",
                self.shard,
                self.session.in_hand,
                extra={"shard": self.shard},
            )
        else:
            logger.info("drained shard %s: every event in hand settled", self.shard, extra={"shard": self.shard})
        await ws.close()


class Receiver:
    """Receive one queue's events from every shard and run ``handler`` on each.

    ``urls_by_shard`` maps each shard's name to the base URLs of its managers (the active one and
    its standbys; ``ws://host:port/``). A plain list of URLs (or one URL) means a single shard
    named ``"default"``.

    Options:

    - ``concurrency``: handlers run at once, **per shard**; the credit of each shard's connection
      follows its free handler slots;
    - ``tenants``: only these tenants' events (the token may restrict them further);
    - ``token``: the bearer secret (docs/protocol.md, tokens);
    - ``handler_timeout``: seconds; a handler still running then is nacked (an async handler is
      cancelled; a thread cannot be, so it keeps its slot until it returns, its result ignored);
    - ``extend_after`` / ``extend_by``: a handler still running ``extend_after`` seconds after its
      event arrived gets its ack deadline set to now + ``extend_by``, again every ``extend_by / 2``
      seconds. Keep ``extend_after`` well below the queue's ``ack_timeout_seconds`` (default 30).
      ``None`` turns extensions off;
    - ``drain_timeout``: on :meth:`stop`, how long to wait for the handlers in hand and their acks;
    - ``backoff``: makes the :class:`Backoff` of each shard's reconnections;
    - ``probe_timeout``: seconds for one ``/health/leader`` probe (the handshake gets 5 times that);
    - ``leader_check``: while connected, probe the shard's other URLs this often (seconds) and leave
      the connection when one leads under a newer term (a frozen leader cannot say it was deposed);
      ``None`` turns it off;
    - ``topology_file``: follow this topology file (docs/operations.md, "Topology file"): the shards
      are the file's, their managers its ``managers`` keys, which ``urls_by_shard`` overrides (it may
      then be empty). The file is looked at (a ``stat``) every ``topology_check`` seconds; when it
      changed, a link opens for each new shard and the link of each shard no longer in it drains and
      closes, as on :meth:`stop`. A file that cannot be read or names a shard without managers is
      logged and the shards stay as they are. See also :meth:`from_topology`;
    - ``tracing``: OpenTelemetry spans (docs/observability.md, "Traces"): a CONSUMER span ``process
      <queue>`` around each handler call and a CLIENT span ``ack <queue>`` / ``nack <queue>`` for its
      settle. None (default): on when the process uses OpenTelemetry (its API is imported when the
      receiver is made), else off and nothing imported; True: on (the [otel] extra needed); False: off;
    - ``trace_mode``: how a ``process`` span relates to the event's creation context:
      ``"first_parent"`` (default: its child on the first attempt, a new trace linked to it on a
      re-fire), ``"parent"`` (always its child), ``"link"`` (always a new trace linked to it) or
      ``"none"``.
    """

    def __init__(
        self,
        urls_by_shard: Mapping[str, Sequence[str]] | Sequence[str] | str,
        queue: str,
        handler: Handler,
        *,
        concurrency: int = 10,
        tenants: Sequence[str] | None = None,
        token: str | None = None,
        handler_timeout: float | None = None,
        extend_after: float | None = 5.0,
        extend_by: float = 60.0,
        drain_timeout: float = 30.0,
        backoff: Callable[[], Backoff] | None = None,
        probe_timeout: float = 1.0,
        leader_check: float | None = 1.0,
        max_size: int = 16 << 20,
        topology_file: str | Path | None = None,
        topology_check: float = 1.0,
        tracing: bool | None = None,
        trace_mode: TraceMode = "first_parent",
    ) -> None:
        if isinstance(urls_by_shard, str):
            shards: dict[str, list[str]] = {"default": [urls_by_shard]}
        elif isinstance(urls_by_shard, Mapping):
            shards = {str(k): [v] if isinstance(v, str) else list(v) for k, v in urls_by_shard.items()}
        else:
            shards = {"default": list(urls_by_shard)}
        if not shards and topology_file is None:
            raise ValueError("give the manager URLs of at least one shard")
        for name, urls in shards.items():
            if not urls:
                raise ValueError(f"shard {name!r}: give at least one manager URL")
            for u in urls:
                ws_url(u)  # ValueError for a URL of another kind
        if not topology_check > 0:
            raise ValueError(f"topology_check must be positive, got {topology_check!r}")
        self.topology_file = Path(topology_file) if topology_file is not None else None
        self.topology_check = topology_check
        #: the URLs given for shards, which win over the file's ``managers``
        self.overrides = shards
        self._file = TopologyFile(self.topology_file) if self.topology_file is not None else None
        if self._file is not None:
            shards = self._shards_of(self._file.load())
            unknown = sorted(set(self.overrides) - set(shards))
            if unknown:
                raise ValueError(
                    f"manager URLs given for shard(s) the topology file {self.topology_file} does not have: "
                    f"{', '.join(unknown)} (shards: {', '.join(shards)})"
                )
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        if handler_timeout is not None and not handler_timeout > 0:
            raise ValueError(f"handler_timeout must be positive, got {handler_timeout!r}")
        if extend_after is not None and not extend_after > 0:
            raise ValueError(f"extend_after must be positive, got {extend_after!r}")
        if not 0 < extend_by <= MAX_EXTEND_SECONDS:
            raise ValueError(f"extend_by must be in (0, {MAX_EXTEND_SECONDS:g}] seconds, got {extend_by!r}")
        if not callable(handler):
            raise TypeError(f"handler must be callable, got {handler!r}")
        self.shards = shards
        self.queue = queue
        self.handler = handler
        self.handler_is_async = is_async_handler(handler)
        self.concurrency = concurrency
        self.tenants = list(tenants) if tenants is not None else None
        self.token = token
        self.handler_timeout = handler_timeout
        self.extend_after = extend_after
        self.extend_by = extend_by
        self.drain_timeout = drain_timeout
        self.backoff_factory: Callable[[], Backoff] = backoff or Backoff
        self.probe_timeout = probe_timeout
        if leader_check is not None and not leader_check > 0:
            raise ValueError(f"leader_check must be positive or None, got {leader_check!r}")
        self.leader_check = leader_check
        self.max_size = max_size
        check_mode(trace_mode)
        on = in_use() if tracing is None else tracing
        #: the spans of each handler call (None: off)
        self.tracer = ReceiverTracer(queue, trace_mode) if on else None
        self.stats = ReceiverStats()
        self.stopping = asyncio.Event()
        #: set once any shard's connection has subscribed
        self.any_subscribed = asyncio.Event()
        #: the link of each shard (one leaving the topology stays until it has drained)
        self._links: dict[str, _Link] = {}
        #: every link still running, and its task
        self._tasks: dict[asyncio.Task[None], _Link] = {}
        #: set when ``_tasks`` gains a link
        self._opened = asyncio.Event()

    @classmethod
    def from_topology(
        cls,
        path: str | Path,
        queue: str,
        handler: Handler,
        *,
        managers: Mapping[str, Sequence[str]] | None = None,
        **options: Any,
    ) -> Receiver:
        """A receiver of the shards of the topology file at ``path``, following its changes
        (``topology_file``); ``managers`` overrides the file's manager URLs of some shards."""
        return cls(managers or {}, queue, handler, topology_file=path, **options)

    def stop(self) -> None:
        """Drain and stop: no new events; the handlers in hand finish and are acked; then close."""
        if not self.stopping.is_set():
            logger.info("receiver stopping: draining")
        self.stopping.set()
        for link in self._tasks.values():
            link.stopping.set()

    # ------------------------------------------------------------------ following the topology file

    def _shards_of(self, topology: Topology) -> dict[str, list[str]]:
        """The shards of the topology file and their managers (the overrides first); raises
        ValueError saying what is wrong."""
        out = {s.name: self.overrides.get(s.name) or list(s.managers) for s in topology.shards}
        missing = sorted(name for name, urls in out.items() if not urls)
        if missing:
            raise ValueError(
                f"the topology file {self.topology_file} names no managers for shard(s) {', '.join(missing)}: "
                'add managers = ["ws://host:port/", ...] to them, or give their URLs (--manager SHARD=URL)'
            )
        for urls in out.values():
            for u in urls:
                ws_url(u)
        return out

    async def _follow(self) -> None:
        """Every ``topology_check`` seconds: if the file changed, open and close links to match it."""
        while not self.stopping.is_set():
            await asyncio.sleep(self.topology_check)
            assert self._file is not None
            try:
                topology = self._file.changed()
                if topology is None:
                    continue
                shards = self._shards_of(topology)
            except (TopologyError, ValueError, OSError) as exc:
                logger.warning("topology file changed but cannot be used, the shards stay as they are: %s", exc)
                continue
            for name in [n for n in self.shards if n not in shards]:
                logger.info("shard %s left the topology file: draining its link", name, extra={"shard": name})
                self._links[name].stopping.set()
            for name in [n for n in shards if n not in self.shards]:
                logger.info("shard %s joined the topology file: opening its link", name, extra={"shard": name})
                self._open(name, shards[name])
            for name, urls in shards.items():
                if name in self.shards and urls != self._links[name].urls:
                    logger.info("shard %s: managers now %s", name, ", ".join(urls), extra={"shard": name})
                    self._links[name].urls = list(urls)
            self.shards = shards

    def _open(self, name: str, urls: Sequence[str]) -> None:
        link = _Link(self, name, urls)
        self._links[name] = link
        self._tasks[asyncio.create_task(link.run(), name=f"receiver-{name}")] = link
        self._opened.set()

    def leader(self, shard: str) -> str | None:
        """The manager URL the shard's connection is on (None while disconnected)."""
        link = self._links.get(shard)
        return link.url if link is not None and link.ws is not None else None

    def in_hand(self, shard: str) -> int:
        """Events in hand on the shard's current connection."""
        link = self._links.get(shard)
        return link.session.in_hand if link is not None else 0

    def credit(self, shard: str) -> int | None:
        """The credit last granted on the shard's current connection."""
        link = self._links.get(shard)
        return link.session.last_credit if link is not None else None

    async def wait_subscribed(self, timeout: float = 10.0, shards: Sequence[str] | None = None) -> None:
        """Wait until the connections of these shards (all by default) are subscribed."""
        async with asyncio.timeout(timeout):
            for name in shards or list(self.shards):
                while name not in self._links:
                    await asyncio.sleep(0.01)
                await self._links[name].subscribed.wait()

    async def run(self, *, handle_signals: bool = False) -> None:
        """Receive until :meth:`stop` (or SIGTERM/SIGINT with ``handle_signals``), then drain.

        Raises :class:`ReceiverError` when a manager refuses the token or the queue."""
        loop = asyncio.get_running_loop()
        if handle_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.stop)
        for name, urls in self.shards.items():
            self._open(name, urls)
        follower = asyncio.create_task(self._follow()) if self.topology_file is not None else None
        try:
            while self._tasks:  # a link ends when it has drained (stop, or its shard left the file)
                self._opened.clear()
                opened = asyncio.create_task(_wait(self._opened))
                try:
                    done, _ = await asyncio.wait([*self._tasks, opened], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    opened.cancel()
                for t in done:
                    if t is opened:
                        continue
                    link = self._tasks.pop(t)
                    if t.exception() is not None:
                        self.stop()
                        raise t.exception()  # type: ignore[misc]
                    if link.shard not in self.shards and self._links.get(link.shard) is link:
                        del self._links[link.shard]
        finally:
            tasks = [*self._tasks, *([follower] if follower is not None else [])]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._tasks.clear()
            if handle_signals:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)


async def _wait(event: asyncio.Event) -> None:
    await event.wait()


def run_receiver(
    urls_by_shard: Mapping[str, Sequence[str]] | Sequence[str] | str,
    queue: str,
    handler: Handler,
    **options: Any,
) -> ReceiverStats:
    """Run a :class:`Receiver` in a new event loop until SIGTERM or SIGINT, drain, and return its stats."""
    receiver = Receiver(urls_by_shard, queue, handler, **options)
    asyncio.run(receiver.run(handle_signals=True))
    return receiver.stats
