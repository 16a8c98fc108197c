"""Maintenance by work stealing (seed 002): the retention purge and the load reconciliation run as
small slices that every manager process of the shard takes, the leader and its standbys alike.

A slice works on one partition of one queue, in one statement on the process's own maintenance
connection (never the leader's writer, so acks never queue behind it):

- **retention**: deletes up to ``slice_rows`` acked events older than the queue's retention and up
  to ``slice_rows`` failed events older than its failed retention, oldest first, ``FOR UPDATE SKIP
  LOCKED`` (a row another transaction holds is skipped, not waited for). The DELETE itself states
  that the row is acked or failed, so no slice ever deletes a to_be_fired or fired event;
- **reconciliation**: re-anchors the partition's load counter on a count of its live events
  (``qm.reconcile_partition``). It takes no lock, and nothing waits for it: the load only steers
  inserts, so it is approximate by design (docs/design.md, "Shuffle sharding", states the bound).

Neither is fenced by the leader's term: deleting a settled event and re-anchoring an approximate
counter are right whoever does them, which is what lets a standby take slices while the leader
leads, or while it is stopped. A slice gives up at the first conflict (``lock_timeout``,
``statement_timeout``, a serialization failure, a lost connection) and is counted aborted; it is
never retried: the next recruit draws its own partition (seed 002: "don't retry, just exit and let
the next worker make an attempt").

Who takes slices (``recruit.py`` decides which job, and where):

- the **baseline pass**: the leader's session runs :meth:`Slicer.baseline_pass` every
  ``purge_interval`` and ``reconcile_interval`` (maintenance.py). It walks the
  partitions in order, so that every partition is served even when the manager is never idle and
  has no standby;
- **idle moments**: each time the leader's dispatcher finds nothing to do, :meth:`Slicer.on_idle`
  enlists the process (at most once per ``slice_interval``), and a recruited slice runs as a task
  of its own: the dispatcher does not wait for it. A moment when due events wait for credit is not
  idle in this sense (``plan.credit_bound``): the next ack ends it;
- **standbys**: :meth:`Slicer.run_standby` enlists a standby every ``slice_interval``.

Each slice is counted in the process's metrics (``qm_maintenance_slices_total{job,outcome,source}``)
and shard-wide in sequences (``qm.maintenance_counts()``, shown by ``qm status``): recruited when
it starts, finished or aborted when it ends, and the events it deleted or corrected. The counts are
sequences, not rows: a few increments a second leave no row versions behind, under a held
snapshot as at any other time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import errors as pg

from queue_manager.domain.settings import QueueSettings
from queue_manager.manager import recruit, store
from queue_manager.manager.recruit import Job
from queue_manager.manager.runtime import Runtime
from queue_manager.manager.store import AsyncConn

logger = logging.getLogger(__name__)

#: the queue list a process slices is re-read this often, seconds (a standby has no dispatcher
#: that would keep it fresh)
QUEUES_TTL = 5.0
#: most retention slices one baseline pass takes per queue: every partition once when there are no
#: more (and nothing is full), the rest for partitions whose pages come back full
PASS_RETENTION_SLICES = 32


@dataclass(frozen=True, slots=True)
class SliceResult:
    """How one slice ended."""

    job: Job
    queue: str
    partition: int
    #: baseline | idle | standby
    source: str
    #: finished | aborted
    outcome: str
    #: events deleted (retention) or the load's correction, |before - live| (reconciliation)
    events: int = 0
    #: retention: a page came back full, more may wait in this partition
    full: bool = False
    #: why it was aborted: lock | conflict | timeout | connection | error
    reason: str | None = None

    @property
    def aborted(self) -> bool:
        return self.outcome == "aborted"


@dataclass
class PassResult:
    """What one baseline pass did."""

    slices: int = 0
    aborted_slices: int = 0
    events: int = 0
    #: the run stopped early (the database could not be reached)
    aborted: bool = False

    def add(self, r: SliceResult) -> None:
        self.slices += 1
        self.events += r.events
        if r.aborted:
            self.aborted_slices += 1


#: after a reconciliation slice gave up on its time bound (store.RECONCILE_SLICE_TIMEOUT_MS), this
#: process takes none for this long (seconds), doubled at each further one up to RECONCILE_REST_MAX,
#: back to this after one finishes. Under a held snapshot every count walks dead index entries and
#: every try fails, spending its whole bound in the server: 135 of them in 3 minutes at 2 000
#: events/s before the rest (docs/benchmarks-history.md).
RECONCILE_REST_MIN = 10.0
RECONCILE_REST_MAX = 300.0
#: a reconciliation slice that finished but took longer than this in the server (seconds) rests the
#: process as a timeout does. The count holds up no producer or ack, but under a held
#: snapshot it walks its partition's dead index entries, and each such count takes the server's CPU
#: that dispatch needs: at 500 events/s on 2 cores, without this rule 41 to 59 counts of 20 to 113 ms
#: ran in a 90 s held phase (8 to 10 with it), and the held phase's p99 rose to 2.3-2.8x the clean
#: phase's in 2 runs of 4 (docs/benchmarks-history.md, "Held snapshot").
RECONCILE_SLOW = 0.020


def abort_reason(exc: BaseException) -> str:
    """Why a slice gave up, from the error that stopped it."""
    if isinstance(exc, pg.LockNotAvailable):
        return "lock"
    if isinstance(exc, pg.SerializationFailure | pg.DeadlockDetected):
        return "conflict"
    if isinstance(exc, pg.QueryCanceled):
        return "timeout"
    if isinstance(exc, psycopg.OperationalError | OSError):
        return "connection"
    return "error"


class Slicer:
    """The maintenance slices of one manager process, whatever its role; one slice at a time."""

    def __init__(self, rt: Runtime, rng: random.Random | None = None) -> None:
        self.rt = rt
        self._rng = rng or random.Random()
        #: each job's share of enlistments (recruit.RATES)
        self.rates: tuple[tuple[Job, float], ...] = recruit.RATES
        self._conn: AsyncConn | None = None
        #: one slice at a time on the one connection (the baseline pass waits for it, a recruit does not)
        self._lock = asyncio.Lock()
        self._queues: list[QueueSettings] = []
        self._queues_at: float | None = None
        #: the baseline pass's next partition of each queue (retention)
        self._cursor: dict[str, int] = {}
        #: the correction this process's last reconciliation slice of (queue, partition) found
        self._drift: dict[tuple[str, int], int] = {}
        self._next_enlist = 0.0
        #: reconciliation slices rest until then (monotonic), after one gave up on its time bound
        self._reconcile_rest_until = 0.0
        self._reconcile_rest = RECONCILE_REST_MIN
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    # ------------------------------------------------------------------ recruiting

    def on_idle(self) -> None:
        """The leader's dispatcher has nothing to do: maybe recruit this process for one slice.

        Returns at once; a recruited slice runs as a task of its own."""
        rt = self.rt
        if self._closed or not rt.config.idle_slices or self._lock.locked():
            return
        now = rt.clock.monotonic()
        if now < self._next_enlist:
            return
        self._next_enlist = now + rt.config.slice_interval
        job = self._resting(recruit.recruit(self._rng.random(), self.rates))
        if job is not None:
            self._spawn(self.take_random(job, "idle"))

    def _reconciled(self, seconds: float) -> None:
        """A reconciliation slice finished in ``seconds``: a quick one ends the rests, a slow one
        (RECONCILE_SLOW) rests the process as a timeout does."""
        if seconds > RECONCILE_SLOW:
            self._rest_reconciliation()
        else:
            self._reconcile_rest = RECONCILE_REST_MIN

    def _rest_reconciliation(self) -> None:
        """No reconciliation slice for the current rest; the next rest twice as long, up to the most."""
        self._reconcile_rest_until = self.rt.clock.monotonic() + self._reconcile_rest
        self._reconcile_rest = min(self._reconcile_rest * 2, RECONCILE_REST_MAX)

    def _resting(self, job: Job | None) -> Job | None:
        """``job``, or None while reconciliation rests (see RECONCILE_REST_MIN)."""
        if job is Job.RECONCILIATION and self.rt.clock.monotonic() < self._reconcile_rest_until:
            return None
        return job

    async def run_standby(self) -> None:
        """A standby's maintenance loop: enlisted every ``slice_interval`` while it does not lead
        (and only once the leadership loop has checked that the database is the configured shard)."""
        rt = self.rt
        while True:
            await asyncio.sleep(rt.config.slice_interval)
            if not rt.config.standby_slices or not rt.shard_checked or rt.lease.term is not None or rt.draining:
                continue
            job = self._resting(recruit.recruit(self._rng.random(), self.rates))
            if job is not None:
                await self.take_random(job, "standby")

    async def take_random(self, job: Job, source: str) -> SliceResult | None:
        """One slice of ``job`` on a random partition of a random queue (None: no queue)."""
        async with self._lock:
            try:
                queues = await self._load_queues()
            except (psycopg.Error, OSError) as exc:
                return await self._aborted(job, "", -1, source, exc, counted=False)
            t = recruit.target([q.partitions_physical for q in queues], self._rng.random(), self._rng.random())
            if t is None:
                return None
            return await self._take(job, queues[t.queue], t.partition, source)

    async def take(self, job: Job, queue: QueueSettings, partition: int, source: str) -> SliceResult:
        """One slice of ``job`` on this partition (the baseline pass's way, and the tests')."""
        async with self._lock:
            return await self._take(job, queue, partition, source)

    # ------------------------------------------------------------------ the baseline pass

    async def baseline_pass(self, job: Job) -> PassResult:
        """One baseline pass: every queue, partitions in order from where the last pass stopped.

        Reconciliation: one slice per partition. Retention: a slice per partition, and more for a
        partition whose page came back full, up to PASS_RETENTION_SLICES per queue. A slice that
        aborts is not retried; the pass goes on with the next partition (the next pass, or a
        recruit, comes back to it). A lost connection ends the pass."""
        result = PassResult()
        async with self._lock:
            try:
                queues = await self._load_queues(fresh=True)
            except (psycopg.Error, OSError) as exc:
                await self._drop_connection()
                logger.info("baseline pass: no database", extra={"action": "baseline_pass", "error": str(exc)[:200]})
                result.aborted = True
                return result
        for q in queues:
            n = max(1, q.partitions_physical)
            if job is Job.RECONCILIATION:
                for p in range(n):
                    if self._resting(job) is None:
                        return result
                    r = await self.take(job, q, p, "baseline")
                    result.add(r)
                    if r.reason == "connection":
                        result.aborted = True
                        return result
                continue
            cursor = self._cursor.get(q.name, 0) % n
            budget = max(PASS_RETENTION_SLICES, 1)
            visited = 0
            while budget > 0 and visited < n:
                r = await self.take(job, q, cursor, "baseline")
                result.add(r)
                budget -= 1
                if r.reason == "connection":
                    result.aborted = True
                    return result
                cursor, advanced = recruit.pass_walk(cursor, n, r.full and not r.aborted)
                visited += advanced
            self._cursor[q.name] = cursor
        return result

    # ------------------------------------------------------------------ one slice

    async def _take(self, job: Job, q: QueueSettings, partition: int, source: str) -> SliceResult:
        rt = self.rt
        rt.metrics.slices.inc(job=job.value, outcome="recruited", source=source)
        try:
            conn = await self._connection()
            await store.count_maintenance(conn, job.value, "recruited")
            if job is Job.RETENTION:
                acked, failed, full = await store.slice_purge(conn, q, partition, rt.config.slice_rows)
                result = SliceResult(job, q.name, partition, source, "finished", acked + failed, full)
                if acked:
                    rt.metrics.purged.inc(acked, queue=q.name, state="acked")
                if failed:
                    rt.metrics.purged.inc(failed, queue=q.name, state="failed")
            else:
                before, live, seconds = await store.slice_reconcile(conn, q, partition)
                self._reconciled(seconds)
                result = SliceResult(job, q.name, partition, source, "finished", abs(before - live))
                self._drift[(q.name, partition)] = result.events
                rt.metrics.load_drift.set(
                    sum(d for (name, _), d in self._drift.items() if name == q.name), queue=q.name
                )
        except asyncio.CancelledError:
            await self._drop_connection()  # a statement may still be running on it
            raise
        except (psycopg.Error, OSError) as exc:
            return await self._aborted(job, q.name, partition, source, exc)
        rt.metrics.slices.inc(job=job.value, outcome="finished", source=source)
        with contextlib.suppress(psycopg.Error, OSError):
            # the slice's work is committed: a count that cannot be written does not undo it
            await store.count_maintenance(conn, job.value, "finished")
            if result.events:
                await store.count_maintenance(conn, job.value, "events", result.events)
        rt.signals.sliced.emit(result)
        return result

    async def _aborted(
        self, job: Job, queue: str, partition: int, source: str, exc: BaseException, counted: bool = True
    ) -> SliceResult:
        """Count a slice that gave up; no retry. ``counted``: its recruitment was counted already."""
        rt = self.rt
        reason = abort_reason(exc)
        if job is Job.RECONCILIATION and reason == "timeout":
            # the count outgrew its bound (store.slice_reconcile): dead entries vacuum cannot
            # remove yet, most likely; every try would spend its whole bound in the server again
            self._rest_reconciliation()
        if not counted:
            rt.metrics.slices.inc(job=job.value, outcome="recruited", source=source)
        rt.metrics.slices.inc(job=job.value, outcome="aborted", source=source)
        rt.metrics.slice_aborts.inc(job=job.value, reason=reason)
        logger.debug(
            "maintenance slice aborted",
            extra={
                "action": "slice_aborted",
                "job": job.value,
                "queue": queue,
                "partition": partition,
                "reason": reason,
                "error": str(exc).strip()[:200],
            },
        )
        if reason == "connection":
            await self._drop_connection()
        elif counted and self._conn is not None:
            with contextlib.suppress(psycopg.Error, OSError):
                await store.count_maintenance(self._conn, job.value, "aborted")
        result = SliceResult(job, queue, partition, source, "aborted", reason=reason)
        rt.signals.sliced.emit(result)
        return result

    # ------------------------------------------------------------------ the collector's counts

    def count_soon(self, job: str, what: str, n: int = 1) -> None:
        """Count a run of a job that is not sliced (the collector) shard-wide, without waiting."""
        if not self._closed and n > 0:
            self._spawn(self._count(job, what, n))

    async def _count(self, job: str, what: str, n: int) -> None:
        async with self._lock:
            with contextlib.suppress(psycopg.Error, OSError):
                await store.count_maintenance(await self._connection(), job, what, n)

    # ------------------------------------------------------------------ plumbing

    async def _connection(self) -> AsyncConn:
        if self._conn is None or self._conn.closed:
            cfg = self.rt.config
            self._conn = await store.connect_maintenance(cfg.dsn, f"qm-manager-maint {cfg.holder}")
        return self._conn

    async def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        self._queues_at = None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()

    async def _load_queues(self, fresh: bool = False) -> list[QueueSettings]:
        now = self.rt.clock.monotonic()
        if fresh or self._queues_at is None or now - self._queues_at >= QUEUES_TTL:
            try:
                self._queues = await store.load_queues(await self._connection())
            except (psycopg.OperationalError, OSError):
                await self._drop_connection()
                raise
            self._queues_at = now
        return self._queues

    def _spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(self._guard(work), name="qm-maintenance-slice")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _guard(work: Coroutine[Any, Any, Any]) -> None:
        try:
            await work
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("maintenance slice failed", extra={"action": "slice"})

    async def close(self) -> None:
        """Stop: recruited slices are cancelled, the connection closed."""
        self._closed = True
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        await self._drop_connection()
