"""Maintenance of the active manager: the old-event collector, the retention purge, the load
reconciliation, and the database health reading for the gauges (:mod:`.health`). Each is a job
with a ``run_once()`` that returns its counts (tests call it directly); :func:`schedule` runs them
periodically with APScheduler (``max_instances=1``, ``coalesce=True``), as tasks that end with
their session.

Every write goes through the session's writer, fenced like any other write, so maintenance never
runs beside a deposed term's writes and never holds a second writing connection. The health
reading only reads, on a connection of its own, so acks never wait behind it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from apscheduler.schedulers.asyncio import AsyncIOScheduler

from queue_manager.manager.health import HealthMonitor
from queue_manager.manager.queues import QueueRuntime
from queue_manager.manager.runtime import Runtime
from queue_manager.manager.writer import OpKind, Unavailable

logger = logging.getLogger(__name__)


@dataclass
class RunResult:
    """What one run did: queues done, and whether it stopped early (the session was ending)."""

    queues: int = 0
    aborted: bool = False


@dataclass
class CollectorResult(RunResult):
    #: events back to to_be_fired after their ack deadline, and events dead-lettered
    requeued: int = 0
    dead: int = 0


@dataclass
class RetentionResult(RunResult):
    deleted: int = 0


@dataclass
class ReconciliationResult(RunResult):
    #: per queue, the sum over partitions of |load - live events| the run corrected
    drift: dict[str, int] = field(default_factory=dict)


class _Job:
    """Run one writer op per queue, in turn; stop at the first the database cannot serve."""

    name = ""
    kind = OpKind.SWEEP

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def _items(self, q: QueueRuntime) -> list[Any]:
        return []

    async def _each(self, result: RunResult, apply: Callable[[QueueRuntime, Any], None]) -> None:
        rt = self.rt
        if not rt.leading():
            result.aborted = True
            return
        for q in list(rt.queues.values()):
            try:
                outcome = await rt.submit(self.kind, q, self._items(q))
            except Unavailable:
                rt.metrics.maintenance.inc(job=self.name, outcome="aborted")
                result.aborted = True
                return
            rt.metrics.maintenance.inc(job=self.name, outcome="finished")
            result.queues += 1
            apply(q, outcome)


#: the collector starts this far before where its last run stopped: a deadline set by a fire or an
#: extend that committed after that run is no earlier than its statement's start (each is a single
#: short statement), and the deadlines of events fired ack_timeout ago, all acked, are dead index
#: entries the sweep would walk again (5 s of them cost 25 000 buffer hits per sweep at 2 000/s)
SWEEP_MARGIN = 1.0
#: and from the start every this many runs (a row an application kept locked is then found; under
#: a held snapshot such a run walks every dead entry of the fired index once)
SWEEP_FULL_EVERY = 300


class Collector(_Job):
    """Events left fired past their ack deadline go back to to_be_fired (or failed).

    Each queue's sweep starts a little before where the last one stopped, not at the low end of
    the fired index, whose dead entries (every event acked since the last vacuum) pile up while a
    transaction holds back vacuum.
    """

    name = "collector"
    kind = OpKind.SWEEP

    def __init__(self, rt: Runtime) -> None:
        super().__init__(rt)
        self._floors: dict[str, float] = {}
        self._runs = 0

    def _items(self, q: QueueRuntime) -> list[Any]:
        floor = self._floors.get(q.name)
        return [] if floor is None else [floor]

    async def run_once(self) -> CollectorResult:
        result = CollectorResult()
        self._runs += 1
        if self._runs % SWEEP_FULL_EVERY == 1:
            self._floors.clear()

        def apply(q: QueueRuntime, outcome: tuple[set[int], set[int], int, float | None]) -> None:
            moved, failed, _pages, at = outcome
            if at is not None:
                self._floors[q.name] = at - SWEEP_MARGIN
            if moved:
                self.rt.refired(q, moved, failed, at)
                result.requeued += len(moved - failed)
                result.dead += len(failed)

        await self._each(result, apply)
        self.rt.signals.swept.emit(result.requeued)
        return result


class Retention(_Job):
    """Acked events older than each queue's retention are deleted, a bounded slice per run."""

    name = "retention"
    kind = OpKind.PURGE

    async def run_once(self) -> RetentionResult:
        result = RetentionResult()

        def apply(q: QueueRuntime, deleted: int) -> None:
            if deleted:
                self.rt.metrics.purged.inc(deleted, queue=q.name)
                result.deleted += deleted

        await self._each(result, apply)
        self.rt.signals.purged.emit(result.deleted)
        return result


class Reconciliation(_Job):
    """Each queue's load counters are re-anchored on a count of its live events.

    The counters drift by design: a rolled-back insert has already bumped its enqueue sequence,
    and a published done counter of a rolled-back ack stays until that partition's next ack.
    """

    name = "reconciliation"
    kind = OpKind.RECONCILE

    async def run_once(self) -> ReconciliationResult:
        result = ReconciliationResult()

        def apply(q: QueueRuntime, drift: int) -> None:
            self.rt.metrics.load_drift.set(drift, queue=q.name)
            result.drift[q.name] = drift

        await self._each(result, apply)
        self.rt.signals.reconciled.emit(sum(result.drift.values()))
        return result


class Maintenance:
    """The jobs of one session, run by APScheduler; :meth:`close` ends every run in progress."""

    def __init__(self, rt: Runtime) -> None:
        self.collector = Collector(rt)
        self.retention = Retention(rt)
        self.reconciliation = Reconciliation(rt)
        self.health = HealthMonitor(rt)
        self._scheduler = AsyncIOScheduler()
        self._running: set[asyncio.Task[Any]] = set()
        cfg = rt.config
        jobs: list[tuple[Callable[[], Awaitable[Any]], float]] = [
            (self.collector.run_once, cfg.sweep_interval),
            (self.retention.run_once, cfg.purge_interval),
            (self.reconciliation.run_once, cfg.reconcile_interval),
            (self.health.run_once, cfg.health_interval),
        ]
        for run_once, seconds in jobs:
            self._scheduler.add_job(
                self._tracked(run_once), "interval", seconds=seconds, max_instances=1, coalesce=True
            )

    def _tracked(self, run_once: Callable[[], Awaitable[Any]]) -> Callable[[], Coroutine[Any, Any, None]]:
        async def job() -> None:
            task = asyncio.current_task()
            assert task is not None
            self._running.add(task)
            try:
                await run_once()
            except Exception:
                logger.exception("maintenance run failed", extra={"action": "maintenance"})
            finally:
                self._running.discard(task)

        return job

    def start(self) -> None:
        self._scheduler.start()
        # the collector runs at once on takeover: events a crashed manager left fired
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._tracked(self.collector.run_once)())
        self._running.add(task)
        # and the health gauges are filled at once, not one interval into the term
        task = loop.create_task(self._tracked(self.health.run_once)())
        self._running.add(task)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            self._scheduler.shutdown(wait=False)
        running = list(self._running)
        for t in running:
            t.cancel()
        if running:
            await asyncio.wait(running, timeout=5)
        await self.health.close()
