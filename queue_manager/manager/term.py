"""One leadership term's session: its connections and tasks, which never outlive it.

A session holds six connections, opened at once: the dispatcher's (scans, fires, wake-up locks),
the writer's (acks, nacks, extends, releases, maintenance), the listener's (LISTEN ``qm_wake``),
the budget's (the lease rows of the queues' limits, ``budget.py``), the settings' (the
dispatcher's periodic reload, read beside its rounds) and the schedules' (``schedules.py``), plus
the waiter's when a producer transaction keeps a wake-up lock, and the budget's links to the other
shards' databases. Any failure of one of its tasks fails the session (the leadership loop then
starts a new one, or gives the lease up), and only that session: a task reports to the session
that started it, never to the manager as a whole, and a session that has ended ignores its tasks'
last words.
:meth:`TermSession.close` cancels every task and waits until each has finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

from queue_manager.manager import store
from queue_manager.manager.budget import Budget
from queue_manager.manager.dispatch import Dispatcher
from queue_manager.manager.keys import RateBuckets
from queue_manager.manager.maintenance import Maintenance
from queue_manager.manager.queues import Reason
from queue_manager.manager.runtime import Runtime
from queue_manager.manager.schedules import Scheduler
from queue_manager.manager.slices import Slicer
from queue_manager.manager.store import AsyncConn
from queue_manager.manager.wakeups import Listener, Waiter
from queue_manager.manager.writer import Unavailable, Writer
from queue_manager.wire.session import ReleaseItem

logger = logging.getLogger(__name__)

#: a task that ignores this many cancellations in a row is given up on (and logged)
_CANCEL_ROUNDS = 10


class TermSession:
    """The connections and tasks of one leadership term."""

    def __init__(self, rt: Runtime, term: int, slicer: Slicer) -> None:
        self.rt = rt
        self.term = term
        self.slicer = slicer
        self.failed: BaseException | None = None
        self.failed_event = asyncio.Event()
        self.ended = False
        #: the session's connections by role: work (dispatcher), write (writer), listen
        self.conns: dict[str, AsyncConn] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._writer: Writer | None = None
        self._dispatcher: Dispatcher | None = None
        self._waiter: Waiter | None = None
        self._budget: Budget | None = None
        self.maintenance: Maintenance | None = None

    @property
    def writer(self) -> Writer:
        assert self._writer is not None
        return self._writer

    def request_reload(self) -> None:
        if self._dispatcher is not None:
            self._dispatcher.request_reload()

    def stalled(self, now: float, after: float) -> bool:
        """The dispatcher has not started a round for ``after`` seconds."""
        d = self._dispatcher
        return d is not None and now - d.heartbeat > after

    @classmethod
    async def open(cls, rt: Runtime, term: int, slicer: Slicer) -> TermSession:
        """Connect, load the queues and start the tasks; on any error nothing is left open.

        ``slicer`` is the process's maintenance slicer (it outlives the session): the session's
        maintenance runs its floors."""
        s = cls(rt, term, slicer)
        try:
            await s._open()
        except BaseException:
            await s.close()
            raise
        return s

    async def _open(self) -> None:
        rt = self.rt
        cfg = rt.config
        # at once, not one after the other: a takeover waits for them (on a loaded machine each
        # connection took 0.1 s and more). Every attempt ends before this goes on, so that a
        # failure leaves no connection opened after close() ran
        opened = await asyncio.gather(
            self._connect("work", durable=cfg.durable_fires),
            self._connect("write", durable=True),
            self._connect("listen", durable=True),
            # the lease rows of the queues' limits need no WAL flush: they are renewed ten times a second
            self._connect("limits", durable=False),
            # the dispatcher's periodic reload of the settings: off its own connection, where each
            # round trip would hold up the fires behind it on a slow link
            self._connect("settings", durable=True),
            # the periodic schedules' (opened after the others, it held up the session's first fire)
            self._connect("schedules", durable=True),
            return_exceptions=True,
        )
        for result in opened:
            if isinstance(result, BaseException):
                raise result
        work, write, listen, limits, settings, schedules = (
            self.conns[r] for r in ("work", "write", "listen", "limits", "settings", "schedules")
        )
        self._writer = Writer(write, self.term, tracer=rt.tracer)
        self._waiter = waiter = Waiter(cfg.dsn, f"qm-manager-wait {cfg.holder}", self._wake_lock_granted)
        self._dispatcher = dispatcher = Dispatcher(rt, work, self.term, waiter, settings)
        listener = Listener(
            listen,
            on_wake=self._on_wake,
            on_settled=rt.settled_by_sql,
            on_unknown=dispatcher.request_reload,
            on_settings=dispatcher.request_reload,
            known=rt.queues.__contains__,
            loop_time=rt.clock.monotonic,
        )
        await listen.execute("LISTEN qm_wake")  # before the reads: nothing committed after them is missed
        # after the LISTEN, the settings (on their connection) and, at once on the dispatcher's, the
        # events in flight of the queues already known (store.in_flight, every queue in one round
        # trip; a session started again has them all): one round trip, not two. A queue the
        # settings bring that was not known is read after them
        restarted = rt.session_term == self.term
        term = self.term if restarted else None
        asks = [(q, q.ledger.in_hand()) for q in rt.queues.values()]
        # both end before this goes on (as the connections' opening), the first error raised
        reloaded, flying = await asyncio.gather(
            dispatcher.reload(),
            store.in_flight(work, [(q.settings, held) for q, held in asks], term),
            return_exceptions=True,
        )
        if isinstance(reloaded, BaseException):
            raise reloaded
        if isinstance(flying, BaseException):
            raise flying
        found = {id(q): (set(held), seen) for (q, held), seen in zip(asks, flying, strict=True)}
        new = [q for q in rt.queues.values() if id(q) not in found]
        if new:
            seen_new = await store.in_flight(work, [(q.settings, ()) for q in new], term)
            found.update((id(q), (set(), seen)) for q, seen in zip(new, seen_new, strict=True))
        unanswered: dict[str, list[ReleaseItem]] = {}
        for q in rt.queues.values():
            asked, seen = found[id(q)]
            # events in hand that were settled while no session listened (notices are not kept for
            # a listener that comes later): their slots are free, as a notice would have freed them
            gone = [h for h in q.ledger.in_hand() if h in asked and h[0] not in seen.still]
            if gone:
                rt.settled_unheard(q, gone)
            # started again under the term of a session that failed: what it fired and never pushed
            # (the fire committed, its answer was lost with the connection) goes again now, not at
            # its ack deadline. A fire of this term that no receiver of ours holds was never
            # delivered by us (read before any fire of this session: none of them is among these)
            if restarted:
                holding = {i for i, _ in q.ledger.in_hand()}
                unanswered[q.name] = [
                    (i, a, 0.0, "its fire's answer was lost") for i, a in seen.in_term if i not in holding
                ]
            # events fired with a concurrency key that no connection of ours holds (the previous
            # leader's, still in its receivers' hands until settled or collected): they count for
            # their keys from the first pick on, so that a failover never admits more than a key's limit
            rt.strays_found(q, seen.keys)
            # nor what it fired of a rate key: every key starts with an empty bucket
            q.rates = RateBuckets(rt.clock.monotonic())
        rt.session_term = self.term
        for q in rt.queues.values():
            q.reset()
        self._spawn(dispatcher.run(), "qm-dispatch")
        self._spawn(self._writer.run(), "qm-writer")
        self._spawn(listener.run(), "qm-listen")
        self._budget = Budget(rt, limits, self.term, rt.shard_name or cfg.shard or "")
        self._spawn(self._budget.run(), "qm-limits")
        # periodic schedules: their slots enqueued ahead, fenced by the term (schedules.py)
        self._spawn(Scheduler(rt, schedules, self.term).run(), "qm-schedules")
        self.maintenance = Maintenance(rt, self.slicer)
        rt.session = self
        for name, items in unanswered.items():
            lost = rt.queues.get(name)
            if lost is not None and items:
                logger.info(
                    "fires whose answer was lost released",
                    extra={"action": "release_unanswered", "queue": name, "events": len(items)},
                )
                rt.release_soon(lost, items, "unanswered")
        self.maintenance.start()
        rt.signals.session_started.emit(self.term)
        rt.wake.set()
        rt.role_changed()

    async def _connect(self, role: str, durable: bool) -> AsyncConn:
        cfg = self.rt.config
        conn = await store.connect(cfg.dsn, f"qm-manager-{role} {cfg.holder}", durable=durable)
        self.conns[role] = conn
        return conn

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        self._tasks.append(asyncio.get_running_loop().create_task(self._guard(work), name=name))

    async def _guard(self, work: Coroutine[Any, Any, None]) -> None:
        try:
            await work
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self.fail(exc)

    def _on_wake(self, queue: str, due: bool, since: float | None, now: float) -> None:
        rt = self.rt
        q = rt.queues.get(queue)
        if q is not None:
            q.wake_state.woken(now)
            if since is None:  # a notice without a time (an operator's): look a second back
                since = rt.db_clock.now() - 1.0
            elif not due and since > q.cache.horizon(q.settings.partitions_physical):
                # every event announced is due after what the window cache holds: the rescans that
                # follow (periodic slices, refills) find them in time; a rescan of the whole
                # window for each scheduled event would only hold up the cached events' fires
                q.wake_state.lower_floors(since)
                return
            rt.nudge(q, Reason.DUE if due else Reason.NOTIFIED, since)

    def _wake_lock_granted(self, queue_id: int) -> None:
        if not self.ended and self._dispatcher is not None:
            self._dispatcher.wake_lock_granted(queue_id)

    def fail(self, exc: BaseException) -> None:
        """A task of this session failed: the session is over (the leadership loop acts on it)."""
        if self.ended or self.failed is not None:
            return
        if store.is_fenced(exc):
            self.rt.metrics.fences.inc()
            logger.warning("write fenced: term no longer current", extra={"action": "fenced", "term": self.term})
        else:
            logger.warning(
                "session failed", extra={"action": "session_failed", "term": self.term, "error": repr(exc)[:300]}
            )
        self.failed = exc
        self.failed_event.set()
        if self._writer is not None:
            self._writer.close(exc)

    async def close(self) -> None:
        """End the session: no task of it runs once this returns."""
        if self.ended:
            return
        self.ended = True
        rt = self.rt
        if rt.session is self:
            rt.session = None
        if self._writer is not None:
            self._writer.close(Unavailable("the manager lost its database session"))
        if self.maintenance is not None:
            await self.maintenance.close()
        pending = {t for t in self._tasks if not t.done()}
        for _ in range(_CANCEL_ROUNDS):
            if not pending:
                break
            for t in pending:
                t.cancel()
            _, pending = await asyncio.wait(pending, timeout=1)
        if pending:
            logger.error(
                "session tasks did not stop",
                extra={"action": "session_close", "tasks": [t.get_name() for t in pending]},
            )
        if self._budget is not None:
            await self._budget.resign()  # the dispatcher is gone: nothing more is fired under these slices
        if self._waiter is not None:
            await self._waiter.close()
        for conn in self.conns.values():
            with contextlib.suppress(Exception):
                await conn.close()
        for q in rt.queues.values():
            q.reset()
