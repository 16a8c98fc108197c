"""The dispatcher of one leadership session: keeps each queue's window cache, fires due events and
pushes them, in rounds planned by ``plan.py``.

A fire is one UPDATE that commits before anything is pushed. Due events of a queue whose
subscribers all take every tenant go by ``mgr_fire_due`` (round-robin over partitions from a
cursor kept across batches, no scan first); scheduled events wait in the window cache and are
fired at their fire_at (``WindowCache.take``: round-robin too). Each event goes to the least busy
subscriber with credit that accepts its tenant, and is recorded in the queue's ledger. A subscriber
the collector found silent (an event it held passed its ack deadline) has no credit until it shows
life (``ReceiverSession.timed_out``), so the events taken back from it go to others.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from queue_manager.manager import plan, store
from queue_manager.manager.cache import Entry
from queue_manager.manager.floors import holder_interval
from queue_manager.manager.queues import QueueRuntime, Reason, Subscriber, active
from queue_manager.manager.runtime import Runtime
from queue_manager.manager.store import AsyncConn
from queue_manager.manager.wakeups import Waiter
from queue_manager.wire import frames
from queue_manager.wire.session import ReleaseItem

#: times a cached event is put back after the database found it not yet due
MAX_REFUSALS = 20
#: how much later the database clock is assumed after a fire refused as a hair early
LEAN_LATER = 0.0005

_Row = store.FiredRow


class Dispatcher:
    """Runs rounds until cancelled; only while the runtime says this process leads."""

    def __init__(self, rt: Runtime, conn: AsyncConn, term: int, waiter: Waiter) -> None:
        self.rt = rt
        self.conn = conn
        self.term = term
        self.waiter = waiter
        self.next_reload = 0.0
        #: monotonic time of the last round's start (the leadership loop's stall check)
        self.heartbeat = rt.clock.monotonic()

    def request_reload(self) -> None:
        """Reload queue settings in the next round (a queue we do not know was named)."""
        self.next_reload = 0.0
        self.rt.wake.set()

    def wake_lock_granted(self, queue_id: int) -> None:
        """The waiter got (and gave back) the queue's wake-up lock: the open producer transaction
        ended. Rescan what it committed, and arm the queue again."""
        q = self.rt.queue_by_id(queue_id)
        if q is not None:
            self.rt.nudge(q, Reason.ARMED, since=q.wake_state.wait_ended())

    async def reload(self) -> None:
        rt = self.rt
        # set first: a request that comes while this reload runs asks for one more
        self.next_reload = rt.clock.monotonic() + rt.config.rescan_interval
        waiters = rt.reload_starts()
        rows, tenants = await store.load_settings(self.conn)
        sent = rt.clock.wall()
        clock = await store.db_now(self.conn)
        rt.db_clock.observe(clock, sent, rt.clock.wall())
        rt.apply_settings(rows, tenants)
        rt.reload_done(waiters)
        rt.signals.reloaded.emit(None)

    async def run(self) -> None:
        rt = self.rt
        cfg = rt.config
        while True:
            now = self.heartbeat = rt.clock.monotonic()
            rt.wake.clear()
            if not rt.leading():
                # the leadership loop wakes us when the lease is trusted again
                await self._sleep(cfg.rescan_interval)
                continue
            if now >= self.next_reload:  # the session's opening reload counts: not twice at its start
                await self.reload()
            queues = active(rt.queues.values())
            watched = [q for q in queues if q.wake_state.reading_due(now)]
            if watched:
                await self._read_holders(watched)
            progressed = False
            for q in queues:
                if await self._round(q, now):
                    progressed = True
            if progressed:
                await asyncio.sleep(0)
                continue
            if await self._idle(queues, now):
                continue

    async def _read_holders(self, queues: list[QueueRuntime]) -> None:
        """Producers that hold a queue's wake-up lock did not notify: when one is gone, its rows
        may lie below the floors (see floors.py)."""
        clock = self.rt.clock
        started = clock.monotonic()
        holders, at = await store.wake_lock_holders(self.conn, [q.id for q in queues])
        done = clock.monotonic()
        # a slow reading (a busy server) spaces the next one out: the fires come first
        next_check = done + holder_interval(done - started)
        for q in queues:
            gone = q.wake_state.read_holders(holders.get(q.id, {}), at, next_check)
            if gone is not None:
                self.rt.nudge(q, Reason.DUE, since=gone)

    async def _round(self, q: QueueRuntime, now: float) -> bool:
        """One queue's steps; True when events were fired and more may follow at once."""
        wake = q.wake_state
        wake.safety_net(now)
        dirty, hint = q.take_nudges()
        if q.room_again():  # a tenant held back by its cap has room: its due events go now
            hint = True
        direct = q.direct()
        if direct and wake.burst(now):
            self.rt.metrics.poll.inc(queue=q.name)
        r = plan.plan_round(
            plan.QueueState(
                direct=direct,
                dirty=dirty,
                due_hint=hint,
                backlog=q.backlog,
                next_scan=q.next_scan,
                polling=wake.polling(now),
                needs_refill=False,  # a dry partition is one of the refills
                scanned_future_only=q.scanned_future_only,
                refill=q.cache.refills(self.rt.db_clock.now()),
            ),
            now,
        )
        if r.scan is plan.Scan.FULL:
            await self._scan(q, r.future_only, None)
        elif r.scan is plan.Scan.SLICE:
            await self._scan(q, r.future_only, q.next_slice())
        elif r.scan is plan.Scan.REFILL:
            next_slice = q.next_scan  # a refill alone does not put the safety net's next slice off
            parts = set(r.refill).union(q.next_slice()) if r.periodic else r.refill
            await self._scan(q, r.future_only, sorted(parts))
            if not r.periodic:
                q.next_scan = next_slice
        progressed = False
        if r.fire_direct:
            fired = await self._fire_direct(q)
            if not fired and q.limits.cut and (hint or dirty):
                q.due_hint = True  # held back by the queue's limits: fire when they admit it (limits.py)
            if fired and r.polling:
                wake.polled(now)
            # a poll that emptied the queue waits POLL_INTERVAL before the next one
            if fired and (q.backlog or not r.polling):
                progressed = True
        if await self._fire_cached(q):
            progressed = True
        return progressed

    async def _idle(self, queues: list[QueueRuntime], now: float) -> bool:
        """Nothing was fired: take or give back wake-up locks, then sleep. True to go on at once."""
        rt = self.rt
        db_now = rt.db_clock.now()
        idle = plan.plan_idle(
            [
                plan.IdleState(
                    id=q.id,
                    backlog=q.backlog,
                    polling=q.wake_state.polling(now),
                    has_due=q.cache.has_due(db_now),
                    has_free=not q.cache_held and any(c.free > 0 for c in q.subscribers),
                    next_fire_at=q.cache.next_fire_at(),
                    next_scan=q.next_scan,
                    armed=q.wake_state.armed,
                    waiting=q.wake_state.waiting,
                    limit_wait=self._limit_wait(q, now, db_now),
                )
                for q in queues
            ],
            now,
            db_now,
            rt.config.rescan_interval,
            self.next_reload,
        )
        by_id = {q.id: q for q in queues}
        for qid in idle.disarm:
            # the database's time before the release, not the estimate once the answer is back:
            # that ran late on a loaded machine, above the rows of a producer that took the lock
            # and committed before the first holder reading (they waited for the safety lookback)
            by_id[qid].wake_state.released(await store.disarm(self.conn, qid))
        for qid in idle.stop_waiting:
            await self.waiter.cancel(qid)
            by_id[qid].wake_state.wait_dropped()
        retry = False
        if self.waiter.unconfirmed():
            # rescan each queue whose waiter is now seen waiting: what committed before its
            # request was queued notified nobody (see wakeups.py)
            for qid in await self.waiter.confirm(self.conn):
                seen = rt.queue_by_id(qid)
                if seen is not None:
                    rt.nudge(seen, Reason.ARMED, since=seen.wake_state.wait_seen())
            if rt.wake.is_set():
                return True
            retry = self.waiter.unconfirmed()
        if idle.arm:
            got = await store.arm(self.conn, idle.arm)
            for qid in idle.arm:
                q = by_id[qid]
                if qid in got:
                    # rows of producers that did not notify, whether seen holding the lock or not
                    q.nudge(Reason.ARMED, since=q.wake_state.took_lock())
                    rt.signals.armed.emit(q.name)
                elif self.waiter.start(qid):
                    # an open producer transaction holds the lock: wait for it on the side, while
                    # every other producer notifies (see wakeups.py)
                    q.wake_state.wait_started()
                    rt.metrics.wake_waits.inc(queue=q.name)
                else:
                    retry = True
            if got:
                return True
        timeout = min(idle.timeout, plan.ARM_RETRY) if retry else idle.timeout
        for q in queues:  # producers that do not notify: read their locks on schedule
            timeout = min(timeout, q.wake_state.until_reading(now))
        rt.went_idle(spare=idle.spare)
        if timeout > 0:
            await self._sleep(timeout)
        return False

    async def _sleep(self, timeout: float) -> None:
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancellation that
        # races with the inner wait finishing, and the task then outlives its session
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self.rt.wake.wait()

    async def _scan(self, q: QueueRuntime, future_only: bool, parts: list[int] | None) -> None:
        """Rescan the queue's window into its cache: every partition, or only ``parts``.

        The periodic safety-net rescan covers one slice of the partitions per tick, so every
        partition is rescanned every ``rescan_interval`` while no single scan of a large window
        holds up the timers of the cached events (a full 2 000-event window took 6 to 10 ms).
        """
        rt = self.rt
        used = None if future_only else q.wake_state.pick_floors()
        pick_time = rt.db_clock.now()
        sent = rt.clock.wall()
        q.cache.begin_scan()
        rows, quota, clock = await store.scan(self.conn, q.settings, future_only, parts, used)
        if parts is None:
            q.scanned_future_only = future_only
        if clock is not None:
            rt.db_clock.observe(clock, sent, rt.clock.wall())
        counts: dict[int, int] = {}
        firsts: dict[int, float] = {}
        entries = []
        for ident, tenant, part, fire_at in rows:
            if part not in counts:
                firsts[part] = fire_at  # rows come in fire_at order per partition
            counts[part] = counts.get(part, 0) + 1
            entries.append(Entry(ident, tenant, part, fire_at))
        scanned = range(q.settings.partitions_physical) if parts is None else parts
        if not future_only:
            q.wake_state.picked(firsts, scanned, pick_time)
        q.cache.replace(entries, [p for p, n in counts.items() if n >= quota], parts)
        q.cache.cover(scanned, pick_time + q.settings.window_seconds)
        q.next_scan = plan.next_scan_at(rt.clock.monotonic(), rt.config.rescan_interval, q.settings.window_seconds)
        rt.signals.scanned.emit((q.name, None if parts is None else tuple(parts)))

    def _capacity(self, q: QueueRuntime) -> tuple[list[Subscriber], int]:
        """Subscribers with free credit, and how many events may be fired to them now."""
        subs = [c for c in q.subscribers if c.free > 0 and not c.closed]
        if not subs:
            return subs, 0
        s = q.settings
        limit = plan.capacity([c.free for c in subs], self.rt.config.fire_batch, s.max_concurrency, q.in_flight)
        # this shard's slices of max_qps and max_concurrency (budget.py, limits.py)
        return subs, q.limits.admit(limit, q.in_flight, s.max_qps, s.max_concurrency, self.rt.clock.monotonic())

    def _limit_wait(self, q: QueueRuntime, now: float, db_now: float) -> float:
        """Seconds until the queue's limits admit an event that is due (0: not held back by them)."""
        if not (q.backlog or q.due_hint or q.cache.has_due(db_now)):
            return 0.0
        s = q.settings
        return q.limits.wait(q.in_flight, s.max_qps, s.max_concurrency, now)

    @staticmethod
    def _chooser(q: QueueRuntime, subs: list[Subscriber]) -> Callable[[str], Subscriber | None]:
        """Who gets each event of a batch (plan.chooser); ties start one subscriber further on
        than the last batch's."""
        q.turn += 1
        return plan.chooser(subs, lambda c: c.free, lambda c: c.tenants, lambda c: c.lapsed, q.turn)

    async def _fire_direct(self, q: QueueRuntime) -> int:
        """Fire events due now straight from the table (no scan round trip first)."""
        subs, limit = self._capacity(q)
        if limit <= 0:
            return 0
        if q.policy.active:
            return await self._fire_direct_fair(q, subs, limit)
        used = q.wake_state.pick_floors()
        pick_time = self.rt.db_clock.now()
        started = self._started()
        # sparse partitions first only behind a backlog: after a pick that took everything due,
        # every partition's due events are new, and the walk's probes would buy nothing
        since = q.last_pick if q.backlog else None
        rows, quota = await store.fire_due(self.conn, q.settings, self.term, q.cursor, limit, used, since)
        q.last_pick = pick_time
        q.limits.spent(len(rows), self.rt.clock.monotonic())
        self.rt.signals.fired.emit(q.name)
        # more are due if the batch was full or some partition gave its whole quota
        per_part: dict[int, int] = {}
        tops: dict[int, float] = {}
        heads: dict[int, float] = {}
        for r in rows:
            p = r[2]
            per_part[p] = per_part.get(p, 0) + 1
            if r[4] > tops.get(p, float("-inf")):
                tops[p] = r[4]
            if r[4] < heads.get(p, float("inf")):
                heads[p] = r[4]
        # short of the limit: every partition was examined, and those that gave nothing have nothing due
        empty = range(q.settings.partitions_physical) if len(rows) < limit else ()
        q.wake_state.picked(tops, empty, pick_time)
        q.backlog = len(rows) >= limit or any(n >= quota for n in per_part.values())
        if rows:
            q.cursor = plan.cursor_after(q.cursor, per_part, heads, since, q.settings.partitions_physical)
            if len(q.cache):
                q.cache.discard_heads({r[0] for r in rows})
            choose = self._chooser(q, subs)
            self._push(q, rows, {r[0]: choose(r[1]) or subs[0] for r in rows}, started)
        return len(rows)

    def _started(self) -> int:
        """When a fire began, for its span when this batch is sampled (0: not traced)."""
        tracer = self.rt.tracer
        return tracer.now_ns() if tracer is not None and tracer.sampled() else 0

    async def _fire_direct_fair(self, q: QueueRuntime, subs: list[Subscriber], limit: int) -> int:
        """The direct path of a queue with tenant settings: a fair pick (fairness.py). It leaves the
        floors where they are: it may pass over rows below the ones it fires (a capped tenant's, or
        candidates the weights did not choose), so "nothing is due below what was fired" does not hold."""
        in_flight = q.ledger.by_tenant()
        pick = q.fair.pick(q.policy, in_flight, limit)
        used = q.wake_state.pick_floors()
        started = self._started()
        rows, quota, seen = await store.fire_due_fair(self.conn, q.settings, self.term, q.cursor, limit, pick, used)
        self.rt.signals.fired.emit(q.name)
        per_part: dict[int, int] = {}
        fired: dict[str, int] = {}
        for r in rows:
            per_part[r[2]] = per_part.get(r[2], 0) + 1
            fired[r[1]] = fired.get(r[1], 0) + 1
        # candidates left over, or a partition that gave its whole quota: more are due now
        q.backlog = len(rows) >= limit or seen > len(rows) or any(n >= quota for n in per_part.values())
        # tenants at their cap, or that reached it in this batch, may have more due: fire when they have room
        q.cap_blocked.update(pick.capped)
        for t, n in fired.items():
            room = q.policy.room(t, in_flight.get(t, 0))
            if room is not None and n >= room:
                q.cap_blocked.add(t)
        if rows:
            q.fair.charge((r[1] for r in rows), q.policy)
            q.cursor = plan.next_cursor(q.cursor, per_part, q.settings.partitions_physical)
            if len(q.cache):
                q.cache.discard_ids({r[0] for r in rows})
            choose = self._chooser(q, subs)
            self._push(q, rows, {r[0]: choose(r[1]) or subs[0] for r in rows}, started)
        return len(rows)

    async def _fire_cached(self, q: QueueRuntime) -> int:
        """Fire due events of the window cache (scheduled events reach here at their fire_at)."""
        if not len(q.cache):
            return 0
        subs, limit = self._capacity(q)
        if limit <= 0:
            return 0
        choose = self._chooser(q, subs)
        db_clock = self.rt.db_clock
        now_db = db_clock.now()
        if q.policy.active:
            in_flight = q.ledger.by_tenant()

            def order(cands: list[Entry], n: int) -> list[Entry]:
                return q.fair.order([(e, e.tenant, e.fire_at) for e in cands], q.policy, in_flight, n)

            taken = q.cache.take_ordered(now_db, limit, lambda e: choose(e.tenant), order)
            # due events held back by their tenants' caps: idle until an ack wakes the dispatcher
            q.cache_held = not taken and q.cache.has_due(now_db)
        else:
            taken = q.cache.take(now_db, limit, lambda e: choose(e.tenant))
        if not taken:
            # give the admitted tokens back now: held until the next admit, they would be lost to
            # the bucket's cap while it refills, and each round that found nothing due in the cache
            # would lower the queue's max_qps rate
            q.limits.spent(0, self.rt.clock.monotonic())
            return 0
        started = self._started()
        rows = await store.fire(self.conn, q.settings, self.term, [e.id for e, _ in taken])
        q.limits.spent(len(rows), self.rt.clock.monotonic())
        self.rt.signals.fired.emit(q.name)
        if q.policy.active and rows:
            q.fair.charge((r[1] for r in rows), q.policy)
        by_id = {e.id: (e, c) for e, c in taken}
        self._push(q, rows, {i: c for i, (_, c) in by_id.items()}, started)
        for r in rows:
            by_id.pop(r[0], None)
        # not fired: already taken elsewhere, or a hair too early for the database clock
        put_back = [e for e, _ in by_id.values() if e.refusals < MAX_REFUSALS and e.fire_at > now_db - 0.5]
        for e in put_back:
            e.refusals += 1
        if put_back:
            q.cache.put_back(put_back)
            db_clock.lean_later(LEAN_LATER)
        return len(rows)

    def _push(self, q: QueueRuntime, rows: list[_Row], assign: dict[int, Subscriber], started: int = 0) -> None:
        """Record fired rows in the ledger and send them, one or more deliver frames per receiver
        (with each event's trace context, when it has one). ``started``: the fire's start when this
        batch is traced (its span ends here)."""
        rt = self.rt
        pushed_db = rt.db_clock.now()
        mono = rt.clock.monotonic()
        out: dict[Subscriber, list[str]] = {}
        orphans: list[ReleaseItem] = []
        unheard: list[ReleaseItem] = []
        hold = q.ledger.hold
        delays = []
        tenants = []
        event_json = frames.event_json
        trace_json = frames.trace_json
        for ident, tenant, part, attempt, fire_at, payload, traceparent, tracestate, baggage in rows:
            c = assign[ident]
            if c.closed:
                orphans.append((ident, attempt, 0.0, "receiver went away before the push"))
                continue
            if c.silent:  # the collector found it silent while this fire was on its way
                unheard.append((ident, attempt, 0.0, "receiver fell silent before the push"))
                continue
            hold(c.id, ident, attempt, mono, tenant)
            events = out.get(c)
            if events is None:
                events = out[c] = []
            if traceparent is None and tracestate is None and baggage is None:
                events.append(event_json(ident, attempt, tenant, part, fire_at, payload))
            else:
                trace = trace_json(traceparent, tracestate, baggage)
                events.append(event_json(ident, attempt, tenant, part, fire_at, payload, trace))
            delays.append(pushed_db - fire_at if pushed_db > fire_at else 0.0)
            tenants.append(tenant)
        if delays:
            rt.metrics.pickup.observe_many(delays, queue=q.name)
            rt.metrics.observe_dwell(q.name, tenants, delays, mono)
            rt.metrics.fired.inc(len(delays), queue=q.name)
        per_frame = rt.config.max_events_per_frame
        for c, events in out.items():
            chunk: list[str] = []
            size = 0
            for ev in events:
                if chunk and (len(chunk) >= per_frame or size + len(ev) > frames.MAX_FRAME_BYTES):
                    c.send(frames.deliver_frame(q.name, chunk))
                    chunk, size = [], 0
                chunk.append(ev)
                size += len(ev) + 1
            if chunk:
                c.send(frames.deliver_frame(q.name, chunk))
        rt.release_soon(q, orphans, "disconnect")
        rt.release_soon(q, unheard, "silent")
        if started and rt.tracer is not None:
            rt.tracer.batch("fire", q.name, len(rows), (r[6] for r in rows), started)
