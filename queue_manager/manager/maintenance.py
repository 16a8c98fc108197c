"""Maintenance of the active manager: the old-event collector, and the baseline passes of the sliced jobs.

- The **old-event collector** moves fired events past their ack deadline back to to_be_fired (or
  to failed). It stays the leader's, on the session's writer and fenced by its term, and is not
  sliced for the standbys: it changes *fired* rows, whose holder is the leader's in-flight ledger
  (it frees their credit slots and lowers the dispatcher's floors when it moves them), and a
  deposed leader must not move them. It is no single point of failure all the same: every
  takeover runs it at once, so a standby that takes the lease collects what a stopped leader left.
- The **database health** reading (:mod:`.health`) fills the gauges every ``health_interval``
  and vacuums a queue table autovacuum is late for. It only reads (and vacuums), on a connection
  of its own, so acks never wait behind it.
- The **retention purge** and the **load reconciliation** run in slices that any manager process
  takes (slices.py). The leader's session adds their baseline passes here: every ``purge_interval``
  and ``reconcile_interval`` a run over every partition, so that they progress even when the leader
  is never idle and has no standby.

Each job has a ``run_once()`` that returns its counts (tests call it directly); :class:`Maintenance`
runs each one in a loop of its own, a task that ends with the session: a run starts on the job's
grid (every ``interval`` from the session's start), never while the job's previous run is still
going. A run that overruns its interval (a sweep waiting behind a busy writer, say) is normal under
load: the runs it covered are skipped, and the next one starts at the next point of the grid.
(APScheduler did this before, with a warning "maximum number of running instances reached" for
every skipped run and two INFO lines for every run.)
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from queue_manager.manager.health import HealthMonitor
from queue_manager.manager.recruit import Job
from queue_manager.manager.runtime import Runtime
from queue_manager.manager.slices import PassResult, Slicer
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


#: the collector starts this far before where its last run stopped: a deadline set by a fire or an
#: extend that committed after that run is no earlier than its statement's start (each is a single
#: short statement), and the deadlines of events fired ack_timeout ago, all acked, are dead index
#: entries the sweep would walk again (5 s of them cost 25 000 buffer hits per sweep at 2 000/s).
#: It never starts past an overdue event it had to skip (an application holds its row, say for an
#: ack by SQL not yet committed): that row is looked at again on every run until it is settled or
#: collected.
SWEEP_MARGIN = 1.0
#: and from the start every this many runs (a deadline that committed later than the margin allows,
#: after a statement that ran long; under a held snapshot such a run walks every dead entry of the
#: fired index once)
SWEEP_FULL_EVERY = 300


class Collector:
    """Events left fired past their ack deadline go back to to_be_fired (or failed): one writer op
    per queue, in turn, stopping at the first the database cannot serve.

    Each queue's sweep starts a little before where the last one stopped, not at the low end of
    the fired index, whose dead entries (every event acked since the last vacuum) pile up while a
    transaction holds back vacuum, and never past an overdue event it skipped because an
    application held its row: when that transaction rolls back, the next run fires the event
    again (once a run had passed such a row, only a full sweep, 300 runs later, found it). A run
    counts as one slice of the job ``collector`` (source ``leader``), in the metrics and
    shard-wide.
    """

    name = "collector"

    def __init__(self, rt: Runtime, slicer: Slicer | None = None) -> None:
        self.rt = rt
        self.slicer = slicer
        #: where each queue's next sweep starts (a deadline, epoch seconds); none: from the start
        self._resume_at: dict[str, float] = {}
        self._runs = 0

    async def run_once(self) -> CollectorResult:
        rt = self.rt
        result = CollectorResult()
        self._runs += 1
        if self._runs % SWEEP_FULL_EVERY == 1:
            self._resume_at.clear()
        self._count("recruited")
        if not rt.leading():
            result.aborted = True
        for q in list(rt.queues.values()) if not result.aborted else []:
            start = self._resume_at.get(q.name)
            try:
                moved, failed, _pages, at, held = await rt.submit(OpKind.SWEEP, q, [] if start is None else [start])
            except Unavailable:
                rt.metrics.maintenance.inc(job=self.name, outcome="aborted")
                result.aborted = True
                break
            rt.metrics.maintenance.inc(job=self.name, outcome="finished")
            result.queues += 1
            if at is not None:
                self._resume_at[q.name] = (at if held is None else min(at, held)) - SWEEP_MARGIN
            if moved:
                rt.refired(q, moved, failed, at)
                result.requeued += len(moved - failed)
                result.dead += len(failed)
        self._count("aborted" if result.aborted else "finished", result.requeued + result.dead)
        if self._runs == 1 and (result.requeued or result.dead):
            # the takeover's run: what an earlier leader (or this one's last term) left in flight
            logger.info(
                "takeover: events left fired past their ack deadline go back to the queue",
                extra={"action": "takeover_collect", "requeued": result.requeued, "dead": result.dead},
            )
        rt.signals.swept.emit(result.requeued)
        return result

    def _count(self, outcome: str, events: int = 0) -> None:
        self.rt.metrics.slices.inc(job=self.name, outcome=outcome, source="leader")
        if self.slicer is not None:
            self.slicer.count_soon(self.name, outcome)
            self.slicer.count_soon(self.name, "events", events)


class BaselinePass:
    """The baseline pass of one sliced job: a periodic run over every partition of every queue, in
    slices (slices.py), so that the job progresses even when the leader is never idle and no standby
    runs."""

    def __init__(self, rt: Runtime, slicer: Slicer, job: Job) -> None:
        self.rt = rt
        self.slicer = slicer
        self.job = job

    async def run_once(self) -> PassResult:
        result = await self.slicer.baseline_pass(self.job)
        self.rt.metrics.maintenance.inc(job=self.job.value, outcome="aborted" if result.aborted else "finished")
        signal = self.rt.signals.purged if self.job is Job.RETENTION else self.rt.signals.reconciled
        signal.emit(result.events)
        return result


class Maintenance:
    """The leader's jobs of one session, each in its own loop; :meth:`close` ends them and any run in progress."""

    def __init__(self, rt: Runtime, slicer: Slicer) -> None:
        self.collector = Collector(rt, slicer)
        self.retention = BaselinePass(rt, slicer, Job.RETENTION)
        self.reconciliation = BaselinePass(rt, slicer, Job.RECONCILIATION)
        self.health = HealthMonitor(rt)
        self._loops: set[asyncio.Task[None]] = set()
        cfg = rt.config
        #: (name, run_once, interval, whether the first run is at once): the collector runs at once
        #: on takeover (events a crashed manager left fired), and the health gauges are filled at
        #: once, not one interval into the term
        self._jobs: list[tuple[str, Callable[[], Awaitable[Any]], float, bool]] = [
            ("collector", self.collector.run_once, cfg.sweep_interval, True),
            ("retention", self.retention.run_once, cfg.purge_interval, False),
            ("reconciliation", self.reconciliation.run_once, cfg.reconcile_interval, False),
            ("health", self.health.run_once, cfg.health_interval, True),
        ]

    async def _every(self, name: str, run_once: Callable[[], Awaitable[Any]], seconds: float, at_once: bool) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time() + (0.0 if at_once else seconds)
        while True:
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            try:
                await run_once()
            except asyncio.CancelledError:
                raise  # the session's end (close()): an end, not a failure
            except Exception:
                logger.exception("maintenance run failed", extra={"action": "maintenance", "job": name})
            next_at += seconds
            late = loop.time() - next_at
            if late > 0:  # the run overran: skip the points of the grid it covered
                skipped = math.ceil(late / seconds)
                next_at += skipped * seconds
                logger.debug(
                    "maintenance run overran its interval",
                    extra={"action": "maintenance_overrun", "job": name, "interval": seconds, "skipped": skipped},
                )

    def start(self) -> None:
        for name, run_once, seconds, at_once in self._jobs:
            task = asyncio.get_running_loop().create_task(
                self._every(name, run_once, seconds, at_once), name=f"qm-maintenance-{name}"
            )
            self._loops.add(task)

    async def close(self) -> None:
        loops = list(self._loops)
        for t in loops:
            t.cancel()
        if loops:
            await asyncio.wait(loops, timeout=5)
        self._loops.clear()
        await self.health.close()
