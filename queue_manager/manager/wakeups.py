"""How producers wake the dispatcher, without a lost wake-up and without waiting on each other.

The protocol (design.md, "Waking the manager without a NOTIFY per producer"): an idle dispatcher
holds each idle queue's exclusive advisory lock, the *wake-up lock*; a producer's statement
trigger tries the shared form and, when that fails, sends a notice on ``qm_wake`` (``'<queue>
due|at <t>'``). A producer whose try succeeds holds the shared lock until it commits, so the
dispatcher can take the exclusive lock only after that commit, and its rescan then sees the rows:
nothing is missed. (Which state the lock of each queue is in, and the transitions: wakestate.py.)

The catch: a producer transaction that stays open holds the shared lock, and the dispatcher's
try fails for as long as it is open. Until 2026-11 the dispatcher kept trying, and meanwhile
every other producer's try succeeded too, so nobody notified and their events waited for the
next safety-net rescan (measured: 235 ms p50, 470 ms max, and 3.7 s with a slow rescan). Now a
:class:`Waiter` asks for the lock with a *blocking* request on a connection of its own. While a
request waits, PostgreSQL refuses every new conflicting try (a new lock request conflicts with
the waiting ones), so every other producer notifies and is served at once. Two rescans close
the remaining gaps:

- once the request is *seen waiting* in ``pg_locks`` (:meth:`Waiter.confirm`): a producer that
  took the shared lock before the request was queued and committed before it was, notified
  nobody; the rescan after the confirmation sees its rows;
- once the request is *granted* (the open transaction ended): the waiter gives the lock back at
  once and tells the dispatcher, which rescans (that transaction's rows) and tries to arm again.

:class:`Listener` turns ``qm_wake`` notifications (their shapes and senders: notices.py) into
nudges, notices of events settled by SQL into freed credit, and notices of changed queue
settings (pause, resume, alter) into an immediate reload.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import psycopg

from queue_manager.manager import notices, store
from queue_manager.manager.store import AsyncConn

logger = logging.getLogger(__name__)

#: at most this many queues wait for their wake-up lock at once (one connection each); others retry
MAX_WAITERS = 4
#: a silent listening connection is probed after this many seconds
LISTEN_PROBE = 5.0


class Listener:
    """LISTEN ``qm_wake`` on its own connection and hand each notification over."""

    def __init__(
        self,
        conn: AsyncConn,
        *,
        on_wake: Callable[[str, bool, float | None, float], None],
        on_settled: Callable[[str, int, int, int, str], None],
        on_unknown: Callable[[], None],
        on_settings: Callable[[], None],
        known: Callable[[str], bool],
        loop_time: Callable[[], float],
    ) -> None:
        self.conn = conn
        self._on_wake = on_wake
        self._on_settled = on_settled
        self._on_unknown = on_unknown
        self._on_settings = on_settings
        self._known = known
        self._time = loop_time

    async def run(self) -> None:
        """Hand notifications over until cancelled (the session has already run LISTEN)."""
        while True:
            got_any = False
            async for n in self.conn.notifies(timeout=LISTEN_PROBE):
                got_any = True
                self.handle(n.payload)
            if not got_any:
                # probe the connection: a silent half-open socket must not hide wake-ups
                await self.conn.execute("SELECT 1")

    def handle(self, payload: str) -> None:
        """Hand one notification over (its shapes and senders: notices.py); a malformed one is
        logged and ignored."""
        try:
            n = notices.parse(payload)
        except notices.MalformedNotice as exc:
            logger.warning("malformed notice", extra={"action": "listen", "payload": payload[:200], "error": str(exc)})
            return
        if isinstance(n, notices.SettingsChanged):
            self._on_settings()  # also for a queue we do not know yet (created)
        elif not self._known(n.queue):
            self._on_unknown()  # a queue we do not know yet: reload settings
        elif isinstance(n, notices.Settled):
            self._on_settled(n.queue, n.id, n.attempt, n.partition, n.state)
        elif isinstance(n, notices.Poke):
            self._on_wake(n.queue, False, None, self._time())
        else:
            self._on_wake(n.queue, isinstance(n, notices.Due), n.since, self._time())


class Waiter:
    """Wait, on connections of its own, for queues' wake-up locks held by open producer transactions."""

    def __init__(self, dsn: str, application_name: str, granted: Callable[[int], None]) -> None:
        self._dsn = dsn
        self._name = application_name
        self._granted = granted
        self._idle: list[AsyncConn] = []
        self._tasks: dict[int, asyncio.Task[None]] = {}
        #: queue id -> backend pid of its request, until the request is seen waiting
        self._unconfirmed: dict[int, int] = {}

    def start(self, queue_id: int) -> bool:
        """Start waiting for the queue's lock; False when MAX_WAITERS already wait."""
        if queue_id in self._tasks:
            return True
        if len(self._tasks) >= MAX_WAITERS:
            return False
        task = asyncio.get_running_loop().create_task(self._wait(queue_id), name=f"qm-wake-wait-{queue_id}")
        self._tasks[queue_id] = task
        return True

    async def cancel(self, queue_id: int) -> None:
        """Stop waiting (the queue is polled now: producers need not notify)."""
        task = self._tasks.pop(queue_id, None)
        self._unconfirmed.pop(queue_id, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def unconfirmed(self) -> bool:
        """Some request is not yet known to wait (it may not be queued in the server yet)."""
        return bool(self._unconfirmed)

    async def confirm(self, conn: AsyncConn) -> list[int]:
        """The queues whose requests are now seen waiting in ``pg_locks`` (checked on ``conn``)."""
        pids = {pid: qid for qid, pid in self._unconfirmed.items() if pid}
        if not pids:
            return []
        seen = await store.waiting_pids(conn, list(pids))
        out = []
        for pid in seen:
            qid = pids[pid]
            if self._unconfirmed.pop(qid, None) is not None:
                out.append(qid)
        return out

    async def _wait(self, queue_id: int) -> None:
        conn: AsyncConn | None = None
        self._unconfirmed[queue_id] = 0
        try:
            conn = self._idle.pop() if self._idle else await store.connect_waiter(self._dsn, self._name)
            if queue_id in self._unconfirmed:
                self._unconfirmed[queue_id] = conn.info.backend_pid
            # Cancelling this task cancels the statement in the server too (psycopg does that
            # when its wait is interrupted), so no request is left in the lock queue.
            await store.wait_wake_lock(conn, queue_id)
            await store.disarm(conn, queue_id)
            self._idle.append(conn)
            conn = None
        except asyncio.CancelledError:
            raise
        except (psycopg.Error, OSError) as exc:
            logger.warning(
                "waiting for a wake-up lock failed", extra={"action": "wake_wait", "error": str(exc).strip()[:200]}
            )
        finally:
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()
            if self._tasks.get(queue_id) is asyncio.current_task():
                del self._tasks[queue_id]
                self._unconfirmed.pop(queue_id, None)
        self._granted(queue_id)

    async def close(self) -> None:
        for qid in list(self._tasks):
            await self.cancel(qid)
        for conn in self._idle:
            with contextlib.suppress(Exception):
                await conn.close()
        self._idle.clear()
