"""What the parts of one manager process share: configuration, clocks, metrics, test signals, the
queues it knows, the lease, and the door to the current leadership session's writer.

Parts reach each other only through this object and the narrow protocols below, so that the
rooms (leadership, dispatch, wake-ups, writer, maintenance, connections, HTTP) import no one
another in a circle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from queue_manager import tracing
from queue_manager.clock import Clock, DatabaseClock
from queue_manager.domain.settings import KeySettings, QueueSettings, TenantSettings
from queue_manager.manager.config import LEASE_MARGIN, ManagerConfig
from queue_manager.manager.fairness import TenantPolicy
from queue_manager.manager.keys import SEP, KeyPolicy
from queue_manager.manager.metrics import ManagerMetrics
from queue_manager.manager.queues import QueueRuntime, Reason
from queue_manager.manager.signals import ManagerSignals
from queue_manager.manager.writer import OpKind, Unavailable, Writer
from queue_manager.wire import frames
from queue_manager.wire.session import ReleaseItem

logger = logging.getLogger(__name__)

#: close code for subscribers of a queue that was dropped
CLOSE_QUEUE_DROPPED = 4004


class Lease:
    """The leadership lease as this process trusts it: a term, until a monotonic deadline.

    Trust runs from the *start* of the renewal that granted it plus TTL minus a margin, so a
    renewal that took long (or a process paused in the middle of one) never extends it.
    """

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self.term: int | None = None
        self.trusted_until = 0.0

    def trusted(self, now: float) -> bool:
        return self.term is not None and now < self.trusted_until

    def granted(self, term: int, renewal_started: float) -> None:
        self.term = term
        self.trusted_until = renewal_started + self.ttl - LEASE_MARGIN

    def dropped(self) -> None:
        self.term = None
        self.trusted_until = 0.0


class Session(Protocol):
    """The current leadership session, as the other parts see it."""

    @property
    def term(self) -> int: ...

    @property
    def writer(self) -> Writer: ...

    @property
    def failed(self) -> BaseException | None: ...

    def request_reload(self) -> None: ...


class Runtime:
    """Shared state of one manager process."""

    def __init__(self, config: ManagerConfig, clock: Clock, metrics: ManagerMetrics, signals: ManagerSignals) -> None:
        self.config = config
        self.clock = clock
        self.db_clock = DatabaseClock(clock)
        self.metrics = metrics
        self.signals = signals
        self.lease = Lease(config.lease_ttl)
        #: spans of a share of the fire and ack batches (None: off, OpenTelemetry not imported)
        self.tracer = (
            tracing.ManagerTracer(config.trace_sample, shard=config.shard) if config.trace_sample > 0 else None
        )
        self.queues: dict[str, QueueRuntime] = {}
        self.session: Session | None = None
        #: the term of the last session started (a session of the same term starts again after a failure)
        self.session_term: int | None = None
        self.shard_name: str | None = config.shard
        #: the database was checked to be the configured shard (the leadership loop's first connection)
        self.shard_checked = False
        #: stop dispatching new events (SIGTERM); acks keep flowing
        self.draining = False
        #: the dispatcher's one wake-up: set by every nudge
        self.wake = asyncio.Event()
        #: set by every nudge too, for waiters other than the dispatcher (the drain)
        self._changed = asyncio.Event()
        #: resolved by the next settings reload
        self._reload_waiters: list[asyncio.Future[None]] = []
        #: replaced (after being set) each time this process may have become the leader (a session
        #: started, or a renewal restored the lease's trust) or stops: /health/leader's held probes
        #: wait on it
        self._role = asyncio.Event()
        #: called each time the dispatcher finds nothing to do and the moment is spare (no queue
        #: waits for credit with events due): maintenance slices enlist there; each must return at once
        self.idle_listeners: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ leading

    def leading(self) -> bool:
        """May this process fire events now? A lease trusted by time, a working session, not draining."""
        s = self.session
        return (
            not self.draining
            and s is not None
            and s.failed is None
            and s.term == self.lease.term
            and self.lease.trusted(self.clock.monotonic())
        )

    def role_changed(self) -> None:
        """This process may lead from now on, or stops: wake whoever waits in :meth:`role_change`."""
        self._role.set()
        self._role = asyncio.Event()

    async def role_change(self, timeout: float) -> None:
        """Return at the next :meth:`role_changed`, or after ``timeout`` seconds."""
        event = self._role
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await event.wait()

    def went_idle(self, spare: bool) -> None:
        """The dispatcher found nothing to do and is about to sleep; ``spare``: no events wait for
        it either (only then are the idle listeners called)."""
        self.signals.idle.emit(None)
        if not spare:
            return
        for listener in self.idle_listeners:
            listener()

    # ------------------------------------------------------------------ the dispatcher's wake-up

    def nudge(self, q: QueueRuntime | None, reason: Reason, since: float | None = None) -> None:
        """Make the dispatcher look at ``q`` (or just wake it) again, for ``reason``; ``since``:
        rows due from then on (database clock) may have appeared."""
        if q is not None:
            q.nudge(reason, since)
        self.wake.set()
        self._changed.set()

    async def wait_changed(self, timeout: float) -> bool:
        """Wait until the next nudge (an ack, a release, a credit...); False after ``timeout``."""
        self._changed.clear()
        try:
            async with asyncio.timeout(timeout):
                await self._changed.wait()
        except TimeoutError:
            return False
        return True

    def queue_by_id(self, queue_id: int) -> QueueRuntime | None:
        for q in self.queues.values():
            if q.id == queue_id:
                return q
        return None

    # ------------------------------------------------------------------ settings

    async def next_reload(self, timeout: float) -> bool:
        """Ask the session to reload the queue settings and wait for it; False after ``timeout``."""
        s = self.session
        if s is None:
            return False
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._reload_waiters.append(fut)
        s.request_reload()
        try:
            async with asyncio.timeout(timeout):
                await fut
        except TimeoutError:
            return False
        finally:
            if fut in self._reload_waiters:
                self._reload_waiters.remove(fut)
        return True

    def reload_starts(self) -> list[asyncio.Future[None]]:
        """A reload reads the settings now: it answers the waiters registered before this moment."""
        waiters, self._reload_waiters = self._reload_waiters, []
        return waiters

    @staticmethod
    def reload_done(waiters: list[asyncio.Future[None]]) -> None:
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def apply_settings(
        self, rows: Iterable[QueueSettings], tenants: Iterable[TenantSettings] = (), keys: Iterable[KeySettings] = ()
    ) -> None:
        """Install freshly loaded queue settings, tenant overrides and key limits; subscribers of
        dropped queues are told and closed."""
        seen = set()
        by_queue: dict[int, list[TenantSettings]] = {}
        for t in tenants:
            by_queue.setdefault(t.queue_id, []).append(t)
        keys_by_queue: dict[int, list[KeySettings]] = {}
        for k in keys:
            keys_by_queue.setdefault(k.queue_id, []).append(k)
        for settings in rows:
            seen.add(settings.name)
            q = self.queues.get(settings.name)
            policy = TenantPolicy.build(by_queue.get(settings.id, ()), settings.tenant_max_in_flight)
            key_policy = KeyPolicy.build(
                keys_by_queue.get(settings.id, ()), settings.key_max_in_flight, settings.key_max_qps
            )
            if q is None:
                q = self.queues[settings.name] = QueueRuntime(settings)
                q.policy = policy
                q.keys = key_policy
                continue
            if policy != q.policy or key_policy != q.keys:
                q.policy = policy
                q.keys = key_policy
                q.pick.policy_changed()
                self.nudge(q, Reason.DUE)  # caps may have been raised
            old = q.settings
            q.settings = settings
            q.wake_state.resize(settings.partitions_physical)
            if (
                settings.partitions_physical != old.partitions_physical
                or settings.window_seconds != old.window_seconds
                or (old.paused and not settings.paused)
            ):
                self.nudge(q, Reason.SETTINGS)
        for name in list(self.queues):
            if name not in seen:
                q = self.queues.pop(name)
                for c in list(q.subscribers):
                    c.send(frames.Error(frames.UNKNOWN_QUEUE, f"queue {name!r} was dropped").to_json())
                    c.close_soon(CLOSE_QUEUE_DROPPED, f"queue {name} was dropped")

    # ------------------------------------------------------------------ writes

    def submit(self, kind: OpKind, q: QueueRuntime, items: list[Any]) -> asyncio.Future[Any]:
        """Have the current session's writer do ``kind``; fails with Unavailable without one."""
        s = self.session
        if s is None or s.failed is not None:
            fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            fut.set_exception(Unavailable("the manager is not connected to its shard as leader"))
            return fut
        return s.writer.submit(kind, q.settings, items)

    async def release(self, q: QueueRuntime, items: Sequence[ReleaseItem], reason: str) -> None:
        """Put events back to to_be_fired (due at once), counting them as re-fired for ``reason``.

        When no write is possible the collector re-fires them after their ack deadline instead.
        """
        try:
            moved, failed, at = await self.submit(OpKind.RELEASE, q, list(items))
        except Unavailable:
            # not fired back: they stay fired in the table, and the next session recounts them
            self._released(q, items)
            return
        self._released(q, items)
        self.metrics.refired.inc(len(moved - failed), queue=q.name, reason=reason)
        if failed:
            self.metrics.dead.inc(len(failed), queue=q.name)
        self.nudge(q, Reason.REQUEUED, since=at)

    @staticmethod
    def _released(q: QueueRuntime, items: Sequence[ReleaseItem]) -> None:
        """A release's write was answered: its events are no longer fired at those attempts (or no
        session will count them): their keys' slots are free."""
        for ident, attempt, *_ in items:
            q.ledger.drop(ident, attempt)

    def strays_found(self, q: QueueRuntime, fired: Sequence[tuple[int, int, str, str]]) -> None:
        """A session starts: ``fired`` (id, attempt, tenant, concurrency key) are the queue's fired
        events with a concurrency key; those no connection holds count for their keys from now on."""
        n = q.ledger.strays_found([(i, a, t + SEP + k) for i, a, t, k in fired])
        if n:
            logger.info(
                "events in hand of no connection counted for their keys",
                extra={"action": "key_strays", "queue": q.name, "events": n},
            )

    def release_soon(self, q: QueueRuntime, items: Sequence[ReleaseItem], reason: str) -> None:
        if items:
            asyncio.get_running_loop().create_task(self.release(q, items, reason))

    # ------------------------------------------------------------------ events that left their holder

    def settled_by_sql(self, queue: str, ident: int, attempt: int, partition: int, state: str) -> None:
        """An application settled (ident, attempt) by SQL (``state``: acked, failed, deleted,
        cancelled by an operator, or to_be_fired for an event it put back): its holder's credit
        slot is free, and an event that left the queue counts as done for the producers' load."""
        q = self.queues.get(queue)
        if q is None:
            return
        if state == "cancelled":  # its holder is told, and refuses its ack with its own code
            d = q.ledger.get(ident)
            holder = None if d is None else next((c for c in q.subscribers if c.id == d.holder), None)
            if holder is not None:
                holder.cancelled(ident, attempt)
        if q.ledger.drop(ident, attempt) is not None:
            self.metrics.settled_by_sql.inc(queue=queue)
            self.nudge(q, Reason.CREDIT)
        if state in ("acked", "failed", "deleted", "cancelled"):
            fut = self.submit(OpKind.SETTLED, q, [partition])
            # not recorded (no session): the reconciliation re-anchors the count
            fut.add_done_callback(lambda f: f.exception())
        else:
            self.nudge(q, Reason.REQUEUED, since=self.db_clock.now() - 1.0)

    def settled_unheard(self, q: QueueRuntime, items: Iterable[tuple[int, int]]) -> None:
        """A session starts and finds these deliveries no longer fired at their attempt in the
        database: they were settled while no session listened (an ack by SQL whose notice reached
        nobody). Their credit and concurrency slots are free. They are not counted done here (a
        notice that still comes counts them; otherwise the reconciliation re-anchors the load)."""
        gone = sum(1 for ident, attempt in items if q.ledger.drop(ident, attempt) is not None)
        if gone:
            logger.info(
                "deliveries settled while no session listened",
                extra={"action": "settled_unheard", "queue": q.name, "events": gone},
            )
            self.nudge(q, Reason.CREDIT)

    def refired(self, q: QueueRuntime, moved: set[int], failed: set[int], at: float | None) -> None:
        """The collector moved these fired events back (or to failed) at database time ``at``:
        nobody holds them now, and the connections that held them are silent until they show life
        (``ReceiverSession.timed_out``): the re-fires go to others."""
        holders = set()
        for ident in moved:
            d = q.ledger.drop(ident)
            if d is not None:
                holders.add(d.holder)
        for c in q.subscribers:
            if c.id in holders:
                c.timed_out()
        self.metrics.refired.inc(len(moved - failed), queue=q.name, reason="ack_timeout")
        if failed:
            self.metrics.dead.inc(len(failed), queue=q.name)
        self.nudge(q, Reason.REQUEUED, since=at)
