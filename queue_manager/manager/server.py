"""The manager process of one shard: leadership, window cache, firing, websocket dispatch, acks.

One asyncio process. Its parts, each a task:

- the **leadership loop** takes the shard's lease (``qm.acquire_leadership``) or waits as a
  standby, renews it every ``lease_ttl / 3``, and trusts it locally only until the renewal's
  start + TTL - margin. A lease lost, or a database it cannot reach past that point, stops the
  session: no more fires until it holds a current term again;
- while leading, a **session** holds three connections: the dispatcher's (scans, fires, wake
  locks), the writer's (acks, nacks, extends, releases, sweeps) and the listener's (LISTEN
  ``qm_wake``). Any database error ends the session and dispatch stops at once;
- the **dispatcher** keeps each subscribed queue's window in a :class:`WindowCache`, fires due
  events in round-robin partition order to the least busy receiver with credit (the UPDATE
  commits first, then frames go out) and sleeps until the next fire_at, a wake-up or the next
  safety rescan;
- the **writer** batches every ack/nack/extend/release of all receivers into one statement per
  queue and kind; receivers hear of an outcome only after its commit;
- an APScheduler job runs the **old-event collector** (events fired past their ack deadline go
  back to to_be_fired with back-off, or to failed at max attempts);
- the **websocket server** authenticates before the upgrade (HTTP 401/403/503), serves
  ``/metrics`` and ``/health`` on the same port, and speaks protocol ``qm.v1`` (docs/protocol.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import json
import logging
import os
import secrets
import socket
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from queue_manager.manager import protocol as proto
from queue_manager.manager import store
from queue_manager.manager.auth import Grant, TokenStore
from queue_manager.manager.cache import Entry, WindowCache
from queue_manager.manager.metrics import Registry
from queue_manager.manager.store import AsyncConn, QueueSettings

logger = logging.getLogger("queue_manager.manager")

#: how close to the lease's end the manager stops trusting it (seconds)
LEASE_MARGIN = 0.5
#: times a cached event is put back after the database found it not yet due
MAX_REFUSALS = 20
#: the periodic rescan covers 1/RESCAN_SLICES of a queue's partitions per tick
RESCAN_SLICES = 4
#: maintenance ops the writer runs once per queue: the store call for each (same signature)
_MAINTENANCE: dict[str, Callable[[AsyncConn, QueueSettings, int], Awaitable[Any]]] = {
    "sweep": store.sweep,
    "purge": store.purge,
    "reconcile": store.reconcile,
}
#: Poll mode. A NOTIFY makes the producer's commit take a database-wide lock held through its
#: WAL flush, so while the manager waits on a queue that gets many single-row transactions, those
#: producers commit one at a time (measured: 8 connections could not reach 2 000 inserts/s). When
#: POLL_ENTER_WAKES wake-ups of a queue come within POLL_ENTER_SPAN seconds (>= 500/s), the
#: dispatcher releases the queue's wake lock (producers stop notifying) and fires due events every
#: POLL_INTERVAL instead, until POLL_LINGER passes with nothing found; then it arms again.
POLL_ENTER_WAKES = 8
POLL_ENTER_SPAN = 0.016
POLL_INTERVAL = 0.001
POLL_LINGER = 0.05
#: frames queued for one connection before it counts as not reading (and is closed)
MAX_OUTBOX = 4096
#: close code for subscribers of a queue that was dropped
CLOSE_QUEUE_DROPPED = 4004


@dataclass
class ManagerConfig:
    """Settings of one manager process (``qm manager`` maps its flags onto these)."""

    dsn: str
    tokens: TokenStore
    shard: str | None = None  # expected shard name; checked against qm.shard
    host: str = "127.0.0.1"
    port: int = 0  # 0 = any free port (see Manager.port)
    allowed_origins: frozenset[str] | None = None  # None = any Origin (non-browser clients send none)
    lease_ttl: float = 5.0
    standby_poll: float = 0.5
    sweep_interval: float = 1.0
    #: how often the retention purge runs (deletes acked events older than the queue's retention)
    purge_interval: float = 5.0
    #: how often the producers' load counters are re-anchored on a count of live events
    reconcile_interval: float = 60.0
    rescan_interval: float = 2.0
    fire_batch: int = 1000
    drain_timeout: float = 30.0
    max_events_per_frame: int = 500
    ping_interval: float = 10.0
    ping_timeout: float = 10.0
    holder: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}")

    def __post_init__(self) -> None:
        if self.lease_ttl < 1.0:
            raise ValueError("lease_ttl must be at least 1 second")
        if not 1 <= self.fire_batch <= 10_000:
            raise ValueError("fire_batch must be between 1 and 10000")
        for name in ("sweep_interval", "purge_interval", "reconcile_interval", "rescan_interval"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be a positive number of seconds")

    @property
    def renew_interval(self) -> float:
        return self.lease_ttl / 3


def _err(ident: int, attempt: int, code: str, message: str) -> dict[str, Any]:
    """A per-item error of an ack/nack/extend result."""
    return {"id": ident, "attempt": attempt, "code": code, "message": message}


class Unavailable(Exception):
    """The manager cannot reach its database (or is not leading) right now; the client may retry."""


@dataclass(slots=True)
class Delivery:
    attempt: int
    pushed_at: float  # loop time
    fire_at: float


class QueueRuntime:
    """A queue's settings, window cache and subscribers, as the active manager sees them."""

    def __init__(self, settings: QueueSettings) -> None:
        self.settings = settings
        self.cache = WindowCache()
        self.subscribers: list[ReceiverConn] = []
        self.in_flight = 0
        #: something may have changed beyond what the cache knows: fire due events and rescan
        self.dirty = True
        #: a producer committed events that were all due at once (NOTIFY '<queue> due'): a direct
        #: fire finds them, no rescan is needed
        self.due_hint = False
        self.armed = False
        self.next_scan = 0.0
        #: the last direct fire was full: more events are due now
        self.backlog = False
        #: the last scan left due events to mgr_fire_due (future_only)
        self.scanned_future_only = False
        #: round-robin position of mgr_fire_due, kept across batches
        self.cursor = 0
        #: the slice of partitions the next periodic rescan covers (see RESCAN_SLICES)
        self.rescan_slice = 0
        #: loop times of the latest NOTIFY wake-ups, and poll mode's end (see POLL_ENTER_WAKES)
        self.wake_times: deque[float] = deque(maxlen=POLL_ENTER_WAKES)
        self.poll_until = 0.0
        #: the connection each in-flight event was pushed to (the collector's re-fires clear it)
        self.holders: dict[int, ReceiverConn] = {}

    def polling(self, now: float) -> bool:
        """In poll mode (see POLL_ENTER_WAKES): wake lock released, due events fetched every POLL_INTERVAL."""
        return now < self.poll_until

    def next_slice(self) -> list[int]:
        """The partitions of the next periodic rescan; the slices take turns."""
        i = self.rescan_slice
        self.rescan_slice = (i + 1) % RESCAN_SLICES
        return [p for p in range(self.settings.partitions_physical) if p % RESCAN_SLICES == i]

    def direct(self) -> bool:
        """Due events go by mgr_fire_due when every subscriber takes every tenant."""
        return all(c.tenants is None for c in self.subscribers)

    @property
    def name(self) -> str:
        return self.settings.name

    @property
    def id(self) -> int:
        return self.settings.id


class ReceiverConn:
    """One authenticated websocket connection, subscribed to at most one queue."""

    _ids = 0

    def __init__(self, ws: ServerConnection, grant: Grant) -> None:
        ReceiverConn._ids += 1
        self.id = ReceiverConn._ids
        self.ws = ws
        self.grant = grant
        self.queue: QueueRuntime | None = None
        self.tenants: frozenset[str] | None = None
        self.credit = 0
        self.in_flight: dict[int, Delivery] = {}
        self.settling: set[int] = set()  # ids with an ack/nack on its way to the database
        self.outbox: asyncio.Queue[str | None] = asyncio.Queue()
        self.closed = False
        self.subscribing = False

    @property
    def free(self) -> int:
        return self.credit - len(self.in_flight)

    def send(self, text: str) -> None:
        if self.closed:
            return
        if self.outbox.qsize() >= MAX_OUTBOX:
            # the client sends frames but does not read our replies: cut it off (its events re-fire)
            self.closed = True
            self.ws.transport.abort()
            return
        self.outbox.put_nowait(text)


@dataclass
class _Op:
    kind: str  # ack | release | extend | sweep
    queue: QueueRuntime
    items: list[Any]
    future: asyncio.Future[Any]


class _Session:
    """The connections and tasks of one leadership term."""

    def __init__(self, term: int) -> None:
        self.term = term
        self.work: AsyncConn | None = None
        self.write: AsyncConn | None = None
        self.listen: AsyncConn | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self.scheduler: AsyncIOScheduler | None = None
        self.failed: BaseException | None = None
        self.next_reload = 0.0


class Manager:
    """The manager of one shard; ``await Manager(config).run()`` serves until stopped."""

    def __init__(self, config: ManagerConfig) -> None:
        self.config = config
        self.role = "starting"  # starting | standby | leader | degraded | draining | stopped
        self.term: int | None = None
        self.trusted_until = 0.0
        self.shard_name: str | None = config.shard
        self.queues: dict[str, QueueRuntime] = {}
        self.receivers: set[ReceiverConn] = set()
        self.port: int | None = None
        self.ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        self._ops: list[_Op] = []
        self._ops_ready = asyncio.Event()
        self._session: _Session | None = None
        self._ctl: AsyncConn | None = None
        self._server: Server | None = None
        self._skew = 0.0  # database clock - local clock (seconds)
        self._skew_rtt = float("inf")
        self._build_metrics()

    # ------------------------------------------------------------------ metrics

    def _build_metrics(self) -> None:
        r = self.metrics = Registry()
        self.m_fired = r.counter("qm_events_fired_total", "Events marked fired and pushed to a receiver.")
        self.m_acked = r.counter("qm_events_acked_total", "Events acked (commit confirmed).")
        self.m_nacked = r.counter("qm_events_nacked_total", "Events nacked by a receiver.")
        self.m_refired = r.counter(
            "qm_events_refired_total",
            "Events put back to to_be_fired, by reason (nack, disconnect, ack_timeout, drain).",
        )
        self.m_dead = r.counter("qm_events_dead_lettered_total", "Events moved to failed after max attempts.")
        self.m_pickup = r.histogram(
            "qm_pickup_delay_seconds", "Delay from an event's fire_at to its push (database clock)."
        )
        self.m_ack_latency = r.histogram("qm_ack_latency_seconds", "Time from push to the committed ack.")
        self.m_frame_errors = r.counter("qm_protocol_errors_total", "Client frames refused, by error code.")
        self.m_maintenance = r.counter("qm_maintenance_runs_total", "Maintenance job runs by job and outcome.")
        self.m_purged = r.counter("qm_events_purged_total", "Acked events deleted by the retention purge.")
        self.m_load_drift = r.gauge(
            "qm_load_drift_events",
            "Sum over partitions of |counted load - live events| found by the last load reconciliation.",
        )
        self.m_fences = r.counter("qm_fenced_writes_total", "Writes the database refused because the term was stale.")
        self.m_poll = r.counter(
            "qm_poll_mode_entries_total", "Times a queue's wake-ups came so fast that dispatch switched to polling."
        )
        r.gauge(
            "qm_in_flight",
            "Events fired and not yet settled, per queue.",
            lambda: [({"queue": q.name}, q.in_flight) for q in self.queues.values()],
        )
        r.gauge(
            "qm_cache_events",
            "Events held in the window cache, per queue.",
            lambda: [({"queue": q.name}, len(q.cache)) for q in self.queues.values()],
        )
        r.gauge(
            "qm_leader",
            "1 while this manager is the shard's active manager.",
            lambda: [({}, 1.0 if self.role == "leader" else 0.0)],
        )
        r.gauge("qm_term", "Current leadership term (0 when not leading).", lambda: [({}, float(self.term or 0))])
        r.gauge("qm_receivers_connected", "Open receiver connections.", lambda: [({}, float(len(self.receivers)))])

    # ------------------------------------------------------------------ clock

    def db_now(self) -> float:
        """The database clock, estimated from the last measurement with the smallest round trip."""
        return time.time() + self._skew

    def _measure_skew(self, db_clock: float, t0: float, t1: float) -> None:
        rtt = t1 - t0
        # prefer tight measurements, but let old ones age out
        if rtt <= self._skew_rtt * 1.5 or rtt < 0.002:
            self._skew = db_clock - (t0 + t1) / 2
            self._skew_rtt = rtt
        else:
            self._skew_rtt *= 1.1

    # ------------------------------------------------------------------ lifecycle

    def request_stop(self) -> None:
        """Drain and stop (what SIGTERM does)."""
        self._stop.set()

    async def run(self) -> None:
        """Serve until :meth:`request_stop`; then drain, release leadership and return."""
        cfg = self.config
        self._server = await serve(
            self._handle,
            cfg.host,
            cfg.port,
            process_request=self._process_request,
            subprotocols=[proto.PROTOCOL],  # type: ignore[list-item]
            max_size=proto.MAX_FRAME_BYTES,
            max_queue=64,
            ping_interval=cfg.ping_interval,
            ping_timeout=cfg.ping_timeout,
            compression=None,
            server_header=None,
        )
        sock = next(iter(self._server.sockets))
        self.port = int(sock.getsockname()[1])
        self.role = "standby"
        self.ready.set()
        logger.info("manager listening", extra={"port": self.port, "holder": cfg.holder})
        lead = asyncio.create_task(self._lead_loop(), name="qm-lead")
        try:
            await self._stop.wait()
        finally:
            await self._shutdown(lead)

    async def _shutdown(self, lead: asyncio.Task[None]) -> None:
        was_leader = self.role == "leader"
        self.role = "draining"
        self._wake.set()
        if was_leader:
            deadline = asyncio.get_running_loop().time() + self.config.drain_timeout
            while any(c.in_flight for c in self.receivers) and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            leftover = [(c, dict(c.in_flight)) for c in self.receivers if c.in_flight]
            for c, flights in leftover:
                if c.queue is not None:
                    items = [
                        (i, d.attempt, 0.0, "manager stopped before the ack")
                        for i, d in flights.items()
                        if i not in c.settling
                    ]
                    if items:
                        with contextlib.suppress(Exception):
                            await self._submit("release", c.queue, items)
                            self.m_refired.inc(len(items), queue=c.queue.name, reason="drain")
        lead.cancel()
        # bounded: a cancellation swallowed inside the task must not hang the shutdown
        await asyncio.wait({lead}, timeout=5)
        await self._end_session()
        if self.term is not None and self._ctl is not None:
            with contextlib.suppress(Exception):
                await store.resign(self._ctl, self.config.holder, self.term)
                logger.info("leadership released", extra={"term": self.term})
        self.term = None
        for c in list(self.receivers):
            with contextlib.suppress(Exception):
                await c.ws.close(proto.CLOSE_GOING_AWAY, "manager stopping")
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
        if self._ctl is not None:
            with contextlib.suppress(Exception):
                await self._ctl.close()
        self.role = "stopped"

    # ------------------------------------------------------------------ leadership

    async def _lead_loop(self) -> None:
        loop = asyncio.get_running_loop()
        cfg = self.config
        while True:
            try:
                if self._ctl is None or self._ctl.closed:
                    self._ctl = await store.connect(cfg.dsn, f"qm-manager-ctl {cfg.holder}")
                    name = await store.shard_name(self._ctl)
                    if cfg.shard is not None and name != cfg.shard:
                        logger.error("wrong shard", extra={"expected": cfg.shard, "found": name})
                        raise SystemExit(f"the database is shard {name!r}, not {cfg.shard!r}")
                    self.shard_name = name
                if self.term is None:
                    started = loop.time()
                    term = await store.acquire(self._ctl, cfg.holder, cfg.lease_ttl)
                    if term is None:
                        self.role = "standby"
                        await self._sleep(cfg.standby_poll)
                        continue
                    self.term = term
                    self.trusted_until = started + cfg.lease_ttl - LEASE_MARGIN
                    logger.info("leadership acquired", extra={"term": term})
                    await self._start_session(term)
                    continue
                # leading (or degraded): renew on schedule, restart a failed session
                session = self._session
                if session is None or session.failed is not None:
                    await self._end_session()
                    started = loop.time()
                    if await store.renew(self._ctl, cfg.holder, self.term, cfg.lease_ttl):
                        self.trusted_until = started + cfg.lease_ttl - LEASE_MARGIN
                        await self._start_session(self.term)
                    else:
                        await self._step_down("lease taken over")
                    continue
                await self._sleep(cfg.renew_interval)
                started = loop.time()
                if await store.renew(self._ctl, cfg.holder, self.term, cfg.lease_ttl):
                    self.trusted_until = started + cfg.lease_ttl - LEASE_MARGIN
                else:
                    await self._step_down("lease taken over")
            except asyncio.CancelledError:
                raise
            except (psycopg.Error, OSError) as exc:
                logger.warning("shard database unreachable", extra={"error": str(exc).strip()[:300]})
                if self._ctl is not None:
                    with contextlib.suppress(Exception):
                        await self._ctl.close()
                self._ctl = None
                if self._session is not None:
                    await self._end_session()
                    if self.role == "leader":
                        self.role = "degraded"
                if self.term is not None and loop.time() >= self.trusted_until:
                    await self._step_down("lease could not be renewed")
                await self._sleep(0.25)

    async def _sleep(self, seconds: float) -> None:
        """Sleep, waking early when the current session fails.

        A plain polling loop, not ``wait_for``: on Python 3.11 ``wait_for`` can swallow a
        cancellation that races with its inner coroutine finishing, and the loop keeps renewing
        while a drain goes on (the shutdown cancels it afterwards).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while (remaining := deadline - loop.time()) > 0:
            s = self._session
            if s is not None and s.failed is not None:
                return
            await asyncio.sleep(min(0.05, remaining))

    async def _step_down(self, why: str) -> None:
        logger.warning("stepping down", extra={"term": self.term, "reason": why})
        await self._end_session()
        self.term = None
        self.role = "standby"
        for c in list(self.receivers):
            with contextlib.suppress(Exception):
                await c.ws.close(proto.CLOSE_NOT_LEADER, "this manager is no longer the shard's active manager")

    async def _start_session(self, term: int) -> None:
        cfg = self.config
        s = _Session(term)
        self._session = s
        try:
            s.work = await store.connect(cfg.dsn, f"qm-manager-work {cfg.holder}", durable=False)
            s.write = await store.connect(cfg.dsn, f"qm-manager-write {cfg.holder}")
            s.listen = await store.connect(cfg.dsn, f"qm-manager-listen {cfg.holder}")
            await s.listen.execute("LISTEN qm_wake")
            await self._reload_queues(s.work)
        except BaseException:
            self._session = None
            await self._close_session_conns(s)
            raise
        for q in self.queues.values():
            q.dirty = True
            q.armed = False
        s.tasks = [
            asyncio.create_task(self._guard(s, self._dispatch_loop(s)), name="qm-dispatch"),
            asyncio.create_task(self._guard(s, self._writer_loop(s)), name="qm-writer"),
            asyncio.create_task(self._guard(s, self._listen_loop(s)), name="qm-listen"),
        ]
        s.scheduler = AsyncIOScheduler()
        s.scheduler.add_job(self._sweep_all, "interval", seconds=cfg.sweep_interval, max_instances=1, coalesce=True)
        s.scheduler.add_job(self._purge_all, "interval", seconds=cfg.purge_interval, max_instances=1, coalesce=True)
        s.scheduler.add_job(
            self._reconcile_all, "interval", seconds=cfg.reconcile_interval, max_instances=1, coalesce=True
        )
        s.scheduler.start()
        self.role = "leader"
        # the collector runs at once on takeover: events a crashed manager left fired
        asyncio.get_running_loop().create_task(self._sweep_all())
        self._wake.set()

    async def _guard(self, s: _Session, work: Awaitable[None]) -> None:
        try:
            await work
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            if store.is_fenced(exc):
                self.m_fences.inc()
                logger.warning("write fenced: term no longer current", extra={"term": s.term})
            else:
                logger.warning("session failed", extra={"error": repr(exc)[:300]})
            s.failed = exc
            if self.role == "leader":
                self.role = "degraded"
            self._fail_ops(Unavailable(str(exc)))

    async def _end_session(self) -> None:
        s = self._session
        if s is None:
            return
        self._session = None
        if s.scheduler is not None:
            with contextlib.suppress(Exception):
                s.scheduler.shutdown(wait=False)
        for t in s.tasks:
            t.cancel()
        if s.tasks:
            await asyncio.wait(s.tasks, timeout=5)
        await self._close_session_conns(s)
        self._fail_ops(Unavailable("the manager lost its database session"))
        for q in self.queues.values():
            q.cache.clear()
            q.armed = False
            q.dirty = True

    async def _close_session_conns(self, s: _Session) -> None:
        for conn in (s.work, s.write, s.listen):
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()

    def _leading(self) -> bool:
        return self.role == "leader" and asyncio.get_running_loop().time() < self.trusted_until

    # ------------------------------------------------------------------ queues

    async def _reload_queues(self, conn: AsyncConn) -> None:
        t0 = time.time()
        rows = await store.load_queues(conn)
        t1 = time.time()
        clock = await store.db_now(conn)
        self._measure_skew(clock, t1, time.time())
        del t0
        seen = set()
        for settings in rows:
            seen.add(settings.name)
            q = self.queues.get(settings.name)
            if q is None:
                self.queues[settings.name] = QueueRuntime(settings)
            else:
                if (
                    settings.partitions_physical != q.settings.partitions_physical
                    or settings.window_seconds != q.settings.window_seconds
                ):
                    q.dirty = True
                if q.settings.paused and not settings.paused:
                    q.dirty = True
                q.settings = settings
        for name in list(self.queues):
            if name not in seen:
                q = self.queues.pop(name)
                for c in list(q.subscribers):
                    c.send(proto.error_frame(proto.UNKNOWN_QUEUE, f"queue {name!r} was dropped"))
                    asyncio.get_running_loop().create_task(c.ws.close(CLOSE_QUEUE_DROPPED, f"queue {name} was dropped"))

    # ------------------------------------------------------------------ dispatcher

    async def _dispatch_loop(self, s: _Session) -> None:
        assert s.work is not None
        conn = s.work
        loop = asyncio.get_running_loop()
        cfg = self.config
        while True:
            self._wake.clear()
            if not self._leading():
                await self._wait(0.05)
                continue
            now = loop.time()
            if now >= s.next_reload:
                await self._reload_queues(conn)
                s.next_reload = now + cfg.rescan_interval
            progressed = False
            active = [q for q in self.queues.values() if q.subscribers and not q.settings.paused]
            for q in active:
                direct = q.direct()
                periodic = now >= q.next_scan
                # take the flag before any await: a wake-up that arrives meanwhile sets it again
                dirty, q.dirty = q.dirty, False
                hint, q.due_hint = q.due_hint, False
                if hint and not direct:
                    dirty = True  # tenant-filtered subscribers: due events go through the cache
                wakes = q.wake_times
                if direct and len(wakes) == POLL_ENTER_WAKES and wakes[-1] - wakes[0] < POLL_ENTER_SPAN:
                    q.poll_until = now + POLL_LINGER
                    wakes.clear()
                    self.m_poll.inc(queue=q.name)
                polling = direct and q.polling(now)
                full = dirty or q.cache.needs_refill() or direct != q.scanned_future_only
                if full or periodic:
                    await self._scan(conn, q, future_only=direct, parts=None if full else q.next_slice())
                # Scan first, then fire directly: an event that falls due between the two is in
                # the scan (still future) and then fired here (and dropped from the cache), so
                # nothing waits for the next rescan, in two round trips.
                if direct and (dirty or hint or q.backlog or periodic or polling):
                    fired = await self._fire_direct(conn, s.term, q)
                    if fired and polling:
                        q.poll_until = now + POLL_LINGER
                    # a poll that emptied the queue waits POLL_INTERVAL before the next one
                    if fired and (q.backlog or not polling):
                        progressed = True
                if await self._fire(conn, s.term, q):
                    progressed = True
            if progressed:
                await asyncio.sleep(0)
                continue
            # Nothing fired. A queue with due events it cannot fire for want of credit is busy:
            # producers' NOTIFYs would only cost them, and its next scan comes with the next
            # refill or rescan. Any other queue is idle, or waits for a cached fire_at: its wake
            # lock stays armed, or is armed now (try, never wait) and the queue rescanned, so
            # that nothing committed before the lock was taken is missed. (A queue that kept
            # firing cached events would otherwise disarm and re-arm, and so rescan its whole
            # window, between every two scheduled events.)
            db_now = self.db_now()
            retry_arm = False
            to_arm = []
            for q in active:
                busy = (
                    q.backlog
                    or q.polling(now)
                    or (q.cache.has_due(db_now) and not any(c.free > 0 for c in q.subscribers))
                )
                if busy and q.armed:
                    await store.disarm(conn, q.id)
                    q.armed = False
                elif not busy and not q.armed:
                    to_arm.append(q)
            if to_arm:
                got = await store.arm(conn, [q.id for q in to_arm])
                for q in to_arm:
                    if q.id in got:
                        q.armed = True
                        q.dirty = True
                    else:
                        retry_arm = True  # a producer's transaction holds the shared lock right now
                if got:
                    continue
            timeout = 0.002 if retry_arm else cfg.rescan_interval
            for q in active:
                timeout = min(timeout, max(0.0, q.next_scan - now))
                if q.polling(now):
                    timeout = min(timeout, POLL_INTERVAL)
                nxt = q.cache.next_fire_at()
                if nxt is not None and any(c.free > 0 for c in q.subscribers):
                    timeout = min(timeout, max(0.0, nxt - db_now))
            timeout = min(timeout, max(0.0, s.next_reload - now))
            if timeout > 0:
                await self._wait(timeout)

    async def _wait(self, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)

    async def _scan(self, conn: AsyncConn, q: QueueRuntime, future_only: bool, parts: list[int] | None = None) -> None:
        """Rescan the queue's window into its cache: every partition, or only ``parts``.

        The periodic safety-net rescan covers one slice of the partitions per tick, so every
        partition is rescanned every ``rescan_interval`` while no single scan of a large window
        holds up the timers of the cached events (a full 2 000-event window took 6 to 10 ms).
        """
        t0 = time.time()
        rows, quota, clock = await store.scan(conn, q.settings, future_only, parts)
        if parts is None:
            q.scanned_future_only = future_only
        if clock is not None:
            self._measure_skew(clock, t0, time.time())
        counts: dict[int, int] = {}
        entries = []
        for ident, tenant, part, fire_at in rows:
            counts[part] = counts.get(part, 0) + 1
            entries.append(Entry(ident, tenant, part, fire_at))
        q.cache.replace(entries, [p for p, n in counts.items() if n >= quota], parts)
        q.next_scan = (
            asyncio.get_running_loop().time()
            + min(self.config.rescan_interval, q.settings.window_seconds / 2) / RESCAN_SLICES
        )

    def _capacity(self, q: QueueRuntime) -> tuple[list[ReceiverConn], int]:
        """Subscribers with free credit, and how many events may be fired to them now."""
        subs = [c for c in q.subscribers if c.free > 0 and not c.closed]
        if not subs:
            return subs, 0
        limit = min(sum(c.free for c in subs), self.config.fire_batch)
        if q.settings.max_concurrency is not None:
            limit = min(limit, q.settings.max_concurrency - q.in_flight)
        return subs, limit

    @staticmethod
    def _chooser(subs: list[ReceiverConn]) -> Callable[[str], ReceiverConn | None]:
        """Pick the least busy receiver (most free credit) that takes a tenant, and reserve a slot."""
        reserved = {c: c.free for c in subs}

        def choose(tenant: str) -> ReceiverConn | None:
            best = None
            best_free = 0
            for c in subs:
                f = reserved[c]
                if f > best_free and (c.tenants is None or tenant in c.tenants):
                    best, best_free = c, f
            if best is not None:
                reserved[best] -= 1
            return best

        return choose

    async def _fire_direct(self, conn: AsyncConn, term: int, q: QueueRuntime) -> int:
        """Fire events due now straight from the table (no scan round trip first)."""
        subs, limit = self._capacity(q)
        if limit <= 0:
            return 0
        rows, quota = await store.fire_due(conn, q.settings, term, q.cursor, limit)
        # more are due if the batch was full or some partition gave its whole quota
        per_part: dict[int, int] = {}
        for r in rows:
            per_part[r[2]] = per_part.get(r[2], 0) + 1
        q.backlog = len(rows) >= limit or any(n >= quota for n in per_part.values())
        if rows:
            q.cursor = (rows[-1][2] + 1) % max(1, q.settings.partitions_physical)
            if len(q.cache):
                q.cache.discard_heads({r[0] for r in rows})
            choose = self._chooser(subs)
            assign = {r[0]: choose(r[1]) or subs[0] for r in rows}
            self._push(q, rows, assign)
        return len(rows)

    async def _fire(self, conn: AsyncConn, term: int, q: QueueRuntime) -> int:
        """Fire due events of the window cache (scheduled events reach here at their fire_at)."""
        if not len(q.cache):
            return 0
        subs, limit = self._capacity(q)
        if limit <= 0:
            return 0
        choose = self._chooser(subs)
        now_db = self.db_now()
        taken = q.cache.take(now_db, limit, lambda e: choose(e.tenant))
        if not taken:
            return 0
        rows = await store.fire(conn, q.settings, term, [e.id for e, _ in taken])
        by_id = {e.id: (e, c) for e, c in taken}
        self._push(q, rows, {i: c for i, (_, c) in by_id.items()})
        for r in rows:
            by_id.pop(r[0], None)
        # not fired: already taken elsewhere, or a hair too early for the database clock
        put_back = [e for e, _ in by_id.values() if e.refusals < MAX_REFUSALS and e.fire_at > now_db - 0.5]
        for e in put_back:
            e.refusals += 1
        if put_back:
            q.cache.put_back(put_back)
            self._skew -= 0.0005  # we were ahead of the database: lean later
        return len(rows)

    def _push(
        self, q: QueueRuntime, rows: list[tuple[int, str, int, int, float, str]], assign: dict[int, ReceiverConn]
    ) -> None:
        """Record fired rows as in flight and send them, one or more deliver frames per receiver."""
        pushed_db = self.db_now()
        mono = asyncio.get_running_loop().time()
        out: dict[ReceiverConn, list[str]] = {}
        orphans: list[tuple[int, int, float | None, str | None]] = []
        holders = q.holders
        delays = []
        event_json = proto.event_json
        for ident, tenant, part, attempt, fire_at, payload in rows:
            c = assign[ident]
            if c.closed:
                orphans.append((ident, attempt, 0.0, "receiver went away before the push"))
                continue
            c.in_flight[ident] = Delivery(attempt, mono, fire_at)
            holders[ident] = c
            events = out.get(c)
            if events is None:
                events = out[c] = []
            events.append(event_json(ident, attempt, tenant, part, fire_at, payload))
            delays.append(pushed_db - fire_at if pushed_db > fire_at else 0.0)
        q.in_flight += len(delays)
        if delays:
            self.m_pickup.observe_many(delays, queue=q.name)
            self.m_fired.inc(len(delays), queue=q.name)
        per_frame = self.config.max_events_per_frame
        for c, events in out.items():
            chunk: list[str] = []
            size = 0
            for ev in events:
                if chunk and (len(chunk) >= per_frame or size + len(ev) > proto.MAX_FRAME_BYTES):
                    c.send(proto.deliver_frame(q.name, chunk))
                    chunk, size = [], 0
                chunk.append(ev)
                size += len(ev) + 1
            if chunk:
                c.send(proto.deliver_frame(q.name, chunk))
        if orphans:
            asyncio.get_running_loop().create_task(self._release_quietly(q, orphans, "disconnect"))

    async def _release_quietly(
        self, q: QueueRuntime, items: list[tuple[int, int, float | None, str | None]], reason: str
    ) -> None:
        try:
            moved, failed = await self._submit("release", q, items)
        except Unavailable:
            return  # the collector re-fires them after their ack deadline
        self.m_refired.inc(len(moved - failed), queue=q.name, reason=reason)
        if failed:
            self.m_dead.inc(len(failed), queue=q.name)
        q.dirty = True
        self._wake.set()

    # ------------------------------------------------------------------ listener

    async def _listen_loop(self, s: _Session) -> None:
        assert s.listen is not None
        conn = s.listen
        loop = asyncio.get_running_loop()
        while True:
            got_any = False
            async for n in conn.notifies(timeout=5.0):
                got_any = True
                name, _, kind = n.payload.partition(" ")
                q = self.queues.get(name)
                if q is not None:
                    q.wake_times.append(loop.time())
                    if kind == "due":
                        q.due_hint = True
                    else:
                        q.dirty = True
                else:
                    s.next_reload = 0.0  # a queue we do not know yet: reload settings
                self._wake.set()
            if not got_any:
                # probe the listening connection: a silent half-open socket must not hide wake-ups
                await conn.execute("SELECT 1")

    # ------------------------------------------------------------------ writer

    def _submit(self, kind: str, q: QueueRuntime, items: list[Any]) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self._session is None or self._session.failed is not None:
            fut.set_exception(Unavailable("the manager is not connected to its shard as leader"))
            return fut
        self._ops.append(_Op(kind, q, items, fut))
        self._ops_ready.set()
        return fut

    def _fail_ops(self, exc: BaseException) -> None:
        ops, self._ops = self._ops, []
        for op in ops:
            if not op.future.done():
                op.future.set_exception(exc)

    async def _writer_loop(self, s: _Session) -> None:
        """Run every ack/nack/extend/release/sweep/purge/reconcile submitted so far, one statement per (kind, queue).

        One connection. Two connections that took turns were measured and were no faster (drain
        only, 100k events, three alternating pairs: 45.9k/s with 1 receiver and 53.9k/s with 2,
        against 52.4k/s and 55.9k/s with one). Ack statements of one queue serialise on its
        done-counter row anyway, and the extra backend competes for the same two cores.
        """
        assert s.write is not None
        conn = s.write
        while True:
            while not self._ops:
                self._ops_ready.clear()
                await self._ops_ready.wait()
            ops, self._ops = self._ops, []
            groups: dict[tuple[str, int], list[_Op]] = {}
            for op in ops:
                groups.setdefault((op.kind, op.queue.id), []).append(op)
            for (kind, _), group in groups.items():
                try:
                    await self._run_group(conn, s.term, kind, group)
                except Exception as exc:
                    unavailable = Unavailable(f"database error: {str(exc).strip()[:200]}")
                    for op in group:
                        if not op.future.done():
                            op.future.set_exception(unavailable)
                    if store.is_fenced(exc) or isinstance(exc, psycopg.OperationalError) or conn.closed:
                        # the rest of this batch cannot succeed either
                        for rest in ops:
                            if not rest.future.done():
                                rest.future.set_exception(unavailable)
                        raise

    async def _run_group(self, conn: AsyncConn, term: int, kind: str, group: list[_Op]) -> None:
        q = group[0].queue
        items = [it for op in group for it in op.items]
        if kind == "ack":
            done = await store.ack(conn, q.settings, term, items)
            for op in group:
                op.future.set_result(done)
        elif kind == "release":
            result = await store.release(conn, q.settings, term, items)
            for op in group:
                op.future.set_result(result)
        elif kind == "extend":
            deadlines = await store.extend(conn, q.settings, term, items)
            for op in group:
                op.future.set_result(deadlines)
        elif kind in _MAINTENANCE:
            res = await _MAINTENANCE[kind](conn, q.settings, term)
            for op in group:
                if not op.future.done():
                    op.future.set_result(res)
        else:  # pragma: no cover - programming error
            raise AssertionError(kind)

    # ------------------------------------------------------------------ collector

    async def _maintain(self, job: str, kind: str) -> AsyncIterator[tuple[QueueRuntime, Any]]:
        """Run one maintenance op of `kind` per queue on the writer, counting runs as `job`.

        Yields each queue with its result. Stops at the first queue the database cannot serve (the
        session is ending); nothing runs unless this manager leads.
        """
        if self.role != "leader":
            return
        for q in list(self.queues.values()):
            try:
                result = await self._submit(kind, q, [])
            except Unavailable:
                self.m_maintenance.inc(job=job, outcome="aborted")
                return
            self.m_maintenance.inc(job=job, outcome="finished")
            yield q, result

    async def _sweep_all(self) -> None:
        """Old-event collector: re-fire events left fired past their ack deadline."""
        async for q, (moved, failed, _pages) in self._maintain("collector", "sweep"):
            if not moved:
                continue
            for ident in moved:
                c = q.holders.pop(ident, None)
                if c is not None and c.in_flight.pop(ident, None) is not None:
                    q.in_flight -= 1
            self.m_refired.inc(len(moved - failed), queue=q.name, reason="ack_timeout")
            if failed:
                self.m_dead.inc(len(failed), queue=q.name)
            q.dirty = True
            self._wake.set()

    async def _purge_all(self) -> None:
        """Retention: delete acked events older than each queue's retention, a bounded slice per run."""
        async for q, deleted in self._maintain("retention", "purge"):
            if deleted:
                self.m_purged.inc(deleted, queue=q.name)

    async def _reconcile_all(self) -> None:
        """Re-anchor each queue's load counters on a count of its live events.

        The counters drift by design: a rolled-back insert has already bumped its enqueue sequence,
        acks done by SQL in application transactions bump no done counter, and a published done
        counter of a rolled-back ack stays until that partition's next ack.
        """
        async for q, drift in self._maintain("reconciliation", "reconcile"):
            self.m_load_drift.set(drift, queue=q.name)

    # ------------------------------------------------------------------ websocket side

    def _http(
        self,
        connection: ServerConnection,
        status: http.HTTPStatus,
        body: str,
        content_type: str = "text/plain; charset=utf-8",
        **headers: str,
    ) -> Response:
        response = connection.respond(status, body)
        response.headers["Content-Type"] = content_type
        for k, v in headers.items():
            response.headers[k.replace("_", "-")] = v
        return response

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "role": self.role,
            "term": self.term,
            "shard": self.shard_name,
            "holder": self.config.holder,
            "receivers": len(self.receivers),
            "queues": {
                q.name: {"cache": len(q.cache), "in_flight": q.in_flight, "subscribers": len(q.subscribers)}
                for q in self.queues.values()
            },
        }

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        path = request.path.split("?", 1)[0]
        if path == "/metrics":
            return self._http(
                connection, http.HTTPStatus.OK, self.metrics.render(), "text/plain; version=0.0.4; charset=utf-8"
            )
        if path == "/health":
            return self._http(connection, http.HTTPStatus.OK, json.dumps(self.health()), "application/json")
        if path == "/health/leader":
            status = http.HTTPStatus.OK if self.role == "leader" else http.HTTPStatus.SERVICE_UNAVAILABLE
            return self._http(connection, status, json.dumps(self.health()), "application/json")
        if path not in ("/", "/v1"):
            return self._http(
                connection, http.HTTPStatus.NOT_FOUND, "not found: use / (websocket), /metrics or /health\n"
            )
        origin = request.headers.get("Origin")
        if self.config.allowed_origins is not None and origin is not None and origin not in self.config.allowed_origins:
            return self._http(connection, http.HTTPStatus.FORBIDDEN, f"origin {origin!r} is not allowed\n")
        grant = self.config.tokens.from_authorization(request.headers.get("Authorization"))
        if grant is None:
            return self._http(
                connection,
                http.HTTPStatus.UNAUTHORIZED,
                "missing or unknown bearer token\n",
                WWW_Authenticate='Bearer realm="qm"',
            )
        if self.role != "leader":
            return self._http(
                connection,
                http.HTTPStatus.SERVICE_UNAVAILABLE,
                f"this manager is {self.role}, not the shard's active manager; try another\n",
                Retry_After="1",
            )
        return None

    async def _handle(self, ws: ServerConnection) -> None:
        headers: Headers = ws.request.headers if ws.request is not None else Headers()
        grant = self.config.tokens.from_authorization(headers.get("Authorization"))
        if grant is None:  # process_request already refused it; belt and braces
            await ws.close(1008, "unauthorized")
            return
        c = ReceiverConn(ws, grant)
        self.receivers.add(c)
        sender = asyncio.create_task(self._send_loop(c))
        pending: set[asyncio.Task[None]] = set()
        try:
            c.send(
                proto.dumps(
                    {
                        "type": "welcome",
                        "protocol": proto.PROTOCOL,
                        "shard": self.shard_name,
                        "term": self.term,
                        "manager": self.config.holder,
                        "limits": {
                            "max_frame_bytes": proto.MAX_FRAME_BYTES,
                            "max_items_per_frame": proto.MAX_ITEMS_PER_FRAME,
                            "max_credit": proto.MAX_CREDIT,
                            "max_events_per_deliver": self.config.max_events_per_frame,
                            "max_tenants_per_subscription": proto.MAX_TENANTS_PER_SUBSCRIPTION,
                            "max_error_text": proto.MAX_ERROR_TEXT,
                            "max_ref_length": proto.MAX_REF_LENGTH,
                            "max_extend_seconds": proto.MAX_EXTEND_SECONDS,
                        },
                    }
                )
            )
            async for message in ws:
                try:
                    frame = proto.parse(message)
                    handler = self._frame_handler(c, frame)
                except proto.FrameError as err:
                    self.m_frame_errors.inc(code=err.code)
                    c.send(proto.error_frame(err.code, err.message, err.ref))
                    continue
                if handler is not None:
                    task = asyncio.create_task(self._settle_guarded(c, handler, getattr(frame, "ref", None)))
                    pending.add(task)
                    task.add_done_callback(pending.discard)
                    if len(pending) >= 64:
                        await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        except ConnectionClosed:
            pass
        finally:
            c.closed = True
            self.receivers.discard(c)
            if c.queue is not None and c in c.queue.subscribers:
                c.queue.subscribers.remove(c)
            if pending:
                await asyncio.wait(pending, timeout=10)
            self._on_disconnect(c)
            c.outbox.put_nowait(None)
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await sender

    async def _send_loop(self, c: ReceiverConn) -> None:
        while True:
            text = await c.outbox.get()
            if text is None:
                return
            try:
                await c.ws.send(text)
            except ConnectionClosed:
                return
            except Exception:  # never leave a connection open that can no longer send
                logger.exception("sending to a receiver failed")
                c.closed = True
                with contextlib.suppress(Exception):
                    await c.ws.close(1011, "internal error while sending")
                return

    def _on_disconnect(self, c: ReceiverConn) -> None:
        q = c.queue
        if q is None or not c.in_flight:
            return
        items: list[tuple[int, int, float | None, str | None]] = []
        for ident, d in list(c.in_flight.items()):
            if ident in c.settling:
                continue
            items.append((ident, d.attempt, 0.0, "receiver disconnected before acking"))
            del c.in_flight[ident]
            q.holders.pop(ident, None)
            q.in_flight -= 1
        if items:
            asyncio.get_running_loop().create_task(self._release_quietly(q, items, "disconnect"))

    async def _settle_guarded(self, c: ReceiverConn, handler: Callable[[], Awaitable[None]], ref: Any) -> None:
        try:
            await handler()
        except proto.FrameError as err:
            self.m_frame_errors.inc(code=err.code)
            c.send(proto.error_frame(err.code, err.message, err.ref))
        except Exception as exc:  # keep serving; tell the client what happened
            logger.exception("frame handling failed")
            c.send(proto.error_frame(proto.UNAVAILABLE, f"internal error: {type(exc).__name__}", ref))

    def _frame_handler(self, c: ReceiverConn, frame: proto.Frame) -> Callable[[], Awaitable[None]] | None:
        """Handle cheap frames inline; return a coroutine factory for frames that touch the database."""
        if isinstance(frame, proto.Ping):
            body: dict[str, Any] = {"type": "pong", "time": self.db_now()}
            if frame.ref is not None:
                body["ref"] = frame.ref
            c.send(proto.dumps(body))
            return None
        if isinstance(frame, proto.Subscribe):
            if c.queue is not None or c.subscribing:
                name = c.queue.name if c.queue is not None else "a queue"
                raise proto.FrameError(
                    proto.ALREADY_SUBSCRIBED,
                    f"this connection is subscribed to {name}; open another connection for another queue",
                    frame.ref,
                )
            if self.role == "draining":
                raise proto.FrameError(proto.DRAINING, "this manager is draining; connect to another one", frame.ref)
            c.subscribing = True
            return lambda: self._on_subscribe(c, frame)
        if isinstance(frame, proto.Credit):
            if c.queue is None and not c.subscribing:
                raise proto.FrameError(proto.NOT_SUBSCRIBED, "subscribe to a queue before granting credit", frame.ref)
            c.credit = frame.credit
            self._reply(c, "credit_set", frame.ref, credit=c.credit)
            self._wake.set()
            return None
        if c.queue is None:
            raise proto.FrameError(proto.NOT_SUBSCRIBED, "subscribe to a queue first", getattr(frame, "ref", None))
        if isinstance(frame, proto.Ack):
            return lambda: self._on_ack(c, frame)
        if isinstance(frame, proto.Nack):
            return lambda: self._on_nack(c, frame)
        if isinstance(frame, proto.Extend):
            return lambda: self._on_extend(c, frame)
        raise AssertionError(frame)  # pragma: no cover

    def _reply(self, c: ReceiverConn, kind: str, ref: Any, **body: Any) -> None:
        msg: dict[str, Any] = {"type": kind}
        if ref is not None:
            msg["ref"] = ref
        msg.update(body)
        c.send(proto.dumps(msg))

    async def _on_subscribe(self, c: ReceiverConn, frame: proto.Subscribe) -> None:
        try:
            await self._subscribe(c, frame)
        finally:
            c.subscribing = False

    async def _subscribe(self, c: ReceiverConn, frame: proto.Subscribe) -> None:
        if not c.grant.allows_queue(frame.queue):
            raise proto.FrameError(
                proto.FORBIDDEN, f"token {c.grant.name!r} may not read queue {frame.queue!r}", frame.ref
            )
        try:
            tenants = c.grant.allowed_tenants(frame.tenants)
        except PermissionError as exc:
            raise proto.FrameError(proto.FORBIDDEN, str(exc), frame.ref) from None
        q = self.queues.get(frame.queue)
        if q is None and self._session is not None and self._session.work is not None:
            self._session.next_reload = 0.0
            self._wake.set()
            for _ in range(40):  # the dispatcher reloads settings within a moment
                await asyncio.sleep(0.025)
                q = self.queues.get(frame.queue)
                if q is not None:
                    break
        if q is None:
            raise proto.FrameError(
                proto.UNKNOWN_QUEUE, f"no queue named {frame.queue!r} on shard {self.shard_name!r}", frame.ref
            )
        c.queue = q
        c.tenants = tenants
        if frame.credit is not None:
            c.credit = frame.credit
        q.subscribers.append(c)
        q.dirty = True
        self._reply(
            c,
            "subscribed",
            frame.ref,
            queue=q.name,
            tenants=None if tenants is None else sorted(tenants),
            credit=c.credit,
        )
        self._wake.set()

    def _claim(self, c: ReceiverConn, ident: int, attempt: int, errors: list[dict[str, Any]]) -> bool:
        """Check that (id, attempt) was delivered on this connection and is not being settled."""
        d = c.in_flight.get(ident)
        if d is None:
            errors.append(
                _err(
                    ident,
                    attempt,
                    proto.UNKNOWN_ID,
                    "not in flight on this connection (never delivered here, already settled, or re-fired)",
                )
            )
            return False
        if d.attempt != attempt:
            errors.append(
                _err(
                    ident, attempt, proto.STALE, f"attempt {attempt} is not the current delivery (attempt {d.attempt})"
                )
            )
            return False
        if ident in c.settling:
            errors.append(_err(ident, attempt, proto.DUPLICATE, "an ack or nack for this event is already in progress"))
            return False
        c.settling.add(ident)
        return True

    def _settled(self, c: ReceiverConn, q: QueueRuntime, ident: int) -> Delivery | None:
        c.settling.discard(ident)
        d = c.in_flight.pop(ident, None)
        if d is not None:
            q.in_flight -= 1
            q.holders.pop(ident, None)
        return d

    async def _on_ack(self, c: ReceiverConn, frame: proto.Ack) -> None:
        q = c.queue
        assert q is not None
        errors: list[dict[str, Any]] = []
        valid = [(i, a) for i, a in frame.items if self._claim(c, i, a, errors)]
        acked: list[int] = []
        if valid:
            try:
                done = await self._submit("ack", q, valid)
            except Unavailable as exc:
                for i, a in valid:
                    c.settling.discard(i)
                    errors.append(_err(i, a, proto.UNAVAILABLE, f"not recorded, retry: {exc}"))
            else:
                now = asyncio.get_running_loop().time()
                latencies = []
                for i, a in valid:
                    d = self._settled(c, q, i)
                    if i in done:
                        acked.append(i)
                        if d is not None:
                            latencies.append(now - d.pushed_at)
                    else:
                        errors.append(
                            _err(
                                i,
                                a,
                                proto.STALE,
                                "the event is no longer fired at this attempt (re-fired after its deadline?)",
                            )
                        )
                if acked:
                    self.m_acked.inc(len(acked), queue=q.name)
                    self.m_ack_latency.observe_many(latencies, queue=q.name)
                self._wake.set()
        self._reply(c, "ack_result", frame.ref, acked=acked, errors=errors)

    async def _on_nack(self, c: ReceiverConn, frame: proto.Nack) -> None:
        q = c.queue
        assert q is not None
        errors: list[dict[str, Any]] = []
        valid = [it for it in frame.items if self._claim(c, it.id, it.attempt, errors)]
        requeued: list[int] = []
        failed: list[int] = []
        if valid:
            items = [(it.id, it.attempt, it.delay, it.error or "nacked by the receiver") for it in valid]
            try:
                moved, dead = await self._submit("release", q, items)
            except Unavailable as exc:
                for it in valid:
                    c.settling.discard(it.id)
                    errors.append(_err(it.id, it.attempt, proto.UNAVAILABLE, f"not recorded, retry: {exc}"))
            else:
                for it in valid:
                    self._settled(c, q, it.id)
                    if it.id in dead:
                        failed.append(it.id)
                    elif it.id in moved:
                        requeued.append(it.id)
                    else:
                        errors.append(
                            _err(it.id, it.attempt, proto.STALE, "the event is no longer fired at this attempt")
                        )
                self.m_nacked.inc(len(requeued) + len(failed), queue=q.name)
                if requeued:
                    self.m_refired.inc(len(requeued), queue=q.name, reason="nack")
                if failed:
                    self.m_dead.inc(len(failed), queue=q.name)
                q.dirty = True
                self._wake.set()
        self._reply(c, "nack_result", frame.ref, requeued=requeued, failed=failed, errors=errors)

    async def _on_extend(self, c: ReceiverConn, frame: proto.Extend) -> None:
        q = c.queue
        assert q is not None
        errors: list[dict[str, Any]] = []
        valid = []
        for it in frame.items:
            d = c.in_flight.get(it.id)
            if d is None:
                errors.append(_err(it.id, it.attempt, proto.UNKNOWN_ID, "not in flight on this connection"))
            elif d.attempt != it.attempt:
                errors.append(_err(it.id, it.attempt, proto.STALE, f"attempt {it.attempt} is not the current delivery"))
            else:
                valid.append((it.id, it.attempt, it.seconds))
        extended: list[dict[str, Any]] = []
        if valid:
            try:
                deadlines = await self._submit("extend", q, valid)
            except Unavailable as exc:
                errors.extend(_err(i, a, proto.UNAVAILABLE, f"not recorded, retry: {exc}") for i, a, _ in valid)
            else:
                for i, a, _ in valid:
                    if i in deadlines:
                        extended.append({"id": i, "ack_deadline": deadlines[i]})
                    else:
                        errors.append(_err(i, a, proto.STALE, "the event is no longer fired at this attempt"))
        self._reply(c, "extend_result", frame.ref, extended=extended, errors=errors)
