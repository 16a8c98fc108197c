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
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from queue_manager.domain.settings import KeySettings, QueueSettings, TenantSettings
from queue_manager.manager import plan, store
from queue_manager.manager.cache import Entry
from queue_manager.manager.floors import holder_interval
from queue_manager.manager.keys import SEP, UNLIMITED, KeyAdmission, KeyRooms, concurrency_rooms, scoped
from queue_manager.manager.priority import level_counts, level_ties, next_caps
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
_INF = float("inf")

_Row = store.FiredRow


def streams_fired(
    rows: list[_Row], levels: int, counts: Sequence[int]
) -> tuple[dict[int, int], dict[int, float], dict[int, float], dict[int, float], dict[int, int]]:
    """What a ``mgr_fire_due`` pick fired, by stream (slot ``partition * levels + level - 1``, as
    the floors' slots, WakeState.slot): the events per slot, the latest fire_at per slot, the
    earliest per partition and per level, and the events per partition of the levels of the last
    count served, where the batch was cut (the cursor turns at those; the levels before them gave
    all they had, or their streams' caps). One dictionary step per event, the rest per stream."""
    stats: dict[int, list[Any]] = {}  # slot -> [events, latest fire_at, earliest fire_at]
    for r in rows:
        fire_at = r[4]
        slot = r[2] * levels + r[9] - 1
        st = stats.get(slot)
        if st is None:
            stats[slot] = [1, fire_at, fire_at]
        else:
            st[0] += 1
            if fire_at > st[1]:
                st[1] = fire_at
            elif fire_at < st[2]:
                st[2] = fire_at
    per_slot: dict[int, int] = {}
    tops: dict[int, float] = {}
    heads: dict[int, float] = {}
    lows: dict[int, float] = {}
    per_part: dict[int, int] = {}
    last = max((counts[slot % levels] for slot in stats), default=0)
    for slot, (n, top, first) in stats.items():
        p, v = divmod(slot, levels)
        per_slot[slot] = n
        tops[slot] = top
        if first < heads.get(p, _INF):
            heads[p] = first
        if first < lows.get(v + 1, _INF):
            lows[v + 1] = first
        if counts[v] == last:
            per_part[p] = per_part.get(p, 0) + n
    return per_slot, tops, heads, lows, per_part


@dataclass(frozen=True, slots=True)
class _Loaded:
    """The settings read for a reload, and the reload's waiters they answer."""

    queues: list[QueueSettings]
    tenants: list[TenantSettings]
    keys: list[KeySettings]
    waiters: list[asyncio.Future[None]]


@dataclass(frozen=True, slots=True)
class _Taken:
    """Cached events taken for a fire, and what its answer needs."""

    #: each event and the subscriber it goes to
    entries: list[tuple[Entry, Subscriber]]
    #: the database clock's estimate when they were taken
    now_db: float
    #: the keys' rooms passed over some event (keys.py)
    passed: bool
    ckeys: KeyRooms
    rkeys: KeyRooms
    #: the fire's start, when traced (0: not)
    started: int


class Dispatcher:
    """Runs rounds until cancelled; only while the runtime says this process leads."""

    def __init__(
        self, rt: Runtime, conn: AsyncConn, term: int, waiter: Waiter, settings_conn: AsyncConn | None = None
    ) -> None:
        self.rt = rt
        self.conn = conn
        #: where the settings are read (the periodic reload): not the dispatcher's own connection,
        #: so that no reload queues ahead of a fire on a slow link
        self.settings_conn = conn if settings_conn is None else settings_conn
        self.term = term
        self.waiter = waiter
        self.next_reload = 0.0
        #: the settings being read for the next reload, applied between two rounds
        self._loading: asyncio.Task[_Loaded] | None = None
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
        """Read the settings and apply them now (the session's opening reload)."""
        self._apply(await self._load())

    def _load(self) -> Coroutine[Any, Any, _Loaded]:
        rt = self.rt
        # set first: a request that comes while this reload runs asks for one more
        self.next_reload = rt.clock.monotonic() + rt.config.rescan_interval
        return self._read(rt.reload_starts())

    async def _read(self, waiters: list[asyncio.Future[None]]) -> _Loaded:
        rt = self.rt
        sent = rt.clock.wall()
        rows, tenants, keys, clock = await store.load_settings(self.settings_conn)
        rt.db_clock.observe(clock, sent, rt.clock.wall())
        return _Loaded(rows, tenants, keys, waiters)

    def _apply(self, loaded: _Loaded) -> None:
        rt = self.rt
        rt.apply_settings(loaded.queues, loaded.tenants, loaded.keys)
        rt.reload_done(loaded.waiters)
        rt.signals.reloaded.emit(None)

    def _reload_between_rounds(self, now: float) -> None:
        """Start reading the settings when a reload is due, on their own connection; apply them
        once read (here, between two rounds: a round never sees them change under it). A failed
        read fails the session, as any statement of the dispatcher does."""
        loading = self._loading
        if loading is not None and loading.done():
            self._loading = None
            self._apply(loading.result())
        if self._loading is None and now >= self.next_reload:
            self._loading = asyncio.get_running_loop().create_task(self._load())
            self._loading.add_done_callback(lambda _: self.rt.wake.set())

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            if self._loading is not None:
                self._loading.cancel()
                with contextlib.suppress(BaseException):
                    await self._loading

    async def _run(self) -> None:
        rt = self.rt
        cfg = rt.config
        while True:
            now = self.heartbeat = rt.clock.monotonic()
            rt.wake.clear()
            if not rt.leading():
                # the leadership loop wakes us when the lease is trusted again
                await self._sleep(cfg.rescan_interval)
                continue
            # the session's opening reload counts: not twice at its start
            self._reload_between_rounds(now)
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
        pick = q.pick
        dirty, hint = pick.take_nudges()
        if q.room_again(now):  # a tenant or a key held back by its limit has room: its due events go now
            hint = True
        direct = q.direct()
        if direct and wake.burst(now):
            self.rt.metrics.poll.inc(queue=q.name)
        r = plan.plan_round(
            plan.QueueState(
                direct=direct,
                dirty=dirty,
                due_hint=hint,
                backlog=pick.backlog,
                next_scan=pick.next_scan,
                polling=wake.polling(now),
                needs_refill=False,  # a dry partition is one of the refills
                scanned_future_only=pick.scanned_future_only,
                refill=q.cache.refills(self.rt.db_clock.now()),
            ),
            now,
        )
        # the cache's due events go in the scan's round trip (store.scan, fire_first), not after it
        taken = self._take_cached(q) if r.scan is not plan.Scan.NONE else None
        if r.scan is plan.Scan.FULL:
            await self._scan(q, r.future_only, None, taken)
        elif r.scan is plan.Scan.SLICE:
            await self._scan(q, r.future_only, q.next_slice(), taken)
        elif r.scan is plan.Scan.REFILL:
            next_slice = pick.next_scan  # a refill alone does not put the safety net's next slice off
            parts = set(r.refill).union(q.next_slice()) if r.periodic else r.refill
            await self._scan(q, r.future_only, sorted(parts), taken)
            if not r.periodic:
                pick.next_scan = next_slice
        progressed = taken is not None
        if r.scan is not plan.Scan.NONE and self._fire_with_next_scan(q, direct):
            return True
        if r.fire_direct:
            fired = await self._fire_direct(q)
            if not fired and q.limits.cut and (hint or dirty):
                pick.due_hint = True  # held back by the queue's limits: fire when they admit it (limits.py)
            if fired and r.polling:
                wake.polled(now, fired)
            # a poll that emptied the queue waits POLL_INTERVAL before the next one
            if fired and (pick.backlog or not r.polling):
                progressed = True
        if await self._fire_cached(q):
            progressed = True
        return progressed

    def _fire_with_next_scan(self, q: QueueRuntime, direct: bool) -> bool:
        """Nudged again while a scan ran, with cached events due: leave their fire to the next
        round, whose rescan carries it (store.scan, fire_first): one round trip for both instead
        of a fire and then a scan. On a slow link each round trip holds up everything behind it.
        Not for a direct queue: its due events go by the direct fire, which a rescan before every
        round would put off for as long as notices come."""
        pick = q.pick
        if direct or not plan.rescan_wanted(pick.dirty, pick.due_hint, direct):
            return False
        return q.cache.has_due(self.rt.db_clock.now()) and any(c.free > 0 and not c.closed for c in q.subscribers)

    async def _idle(self, queues: list[QueueRuntime], now: float) -> bool:
        """Nothing was fired: take or give back wake-up locks, then sleep. True to go on at once."""
        rt = self.rt
        db_now = rt.db_clock.now()
        idle = plan.plan_idle(
            [
                plan.IdleState(
                    id=q.id,
                    backlog=q.pick.backlog,
                    polling=q.wake_state.polling(now),
                    has_due=q.cache.has_due(db_now),
                    has_free=not q.pick.cache_held and any(c.free > 0 for c in q.subscribers),
                    next_fire_at=q.cache.next_fire_at(),
                    next_scan=q.pick.next_scan,
                    armed=q.wake_state.armed,
                    waiting=q.wake_state.waiting,
                    limit_wait=self._limit_wait(q, now, db_now),
                )
                for q in queues
            ],
            now,
            db_now,
            rt.config.rescan_interval,
            # a reload being read wakes the loop when it is done: a request meanwhile must not make
            # the loop spin without a wait until then (it starved the read: a subscribe to a queue
            # created a moment ago was answered unknown_queue)
            self.next_reload if self._loading is None else _INF,
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
            timeout = min(timeout, q.wake_state.until_reading(now), q.pick.rate_wait(now))
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

    async def _scan(self, q: QueueRuntime, future_only: bool, parts: list[int] | None, taken: _Taken | None) -> None:
        """Rescan the queue's window into its cache: every partition, or only ``parts``; fire the
        ``taken`` cached events first, in the same round trip.

        The periodic safety-net rescan covers one slice of the partitions per tick, so every
        partition is rescanned every ``rescan_interval`` while no single scan of a large window
        holds up the timers of the cached events (a full 2 000-event window took 6 to 10 ms).
        """
        rt = self.rt
        used = None if future_only else q.wake_state.pick_floors()
        pick_time = rt.db_clock.now()
        sent = rt.clock.wall()
        covers = pick_time + q.settings.window_seconds
        q.cache.begin_scan(covers)
        fire_first = None if taken is None else (self.term, [e.id for e, _ in taken.entries])
        rows, quota, clock, fired = await store.scan(
            self.conn, q.settings, future_only, parts, used, fire_first=fire_first
        )
        if clock is not None:
            rt.db_clock.observe(clock, sent, rt.clock.wall())
        if taken is not None:  # before the scan's rows replace the cache: those put back are in them
            self._fired_cached(q, taken, fired)
        counts: dict[int, int] = {}
        firsts: dict[int, float] = {}
        entries = []
        ws = q.wake_state
        for ident, tenant, part, fire_at, priority, ckey, rkey in rows:
            slot = ws.slot(part, priority)
            if slot not in firsts:
                firsts[slot] = fire_at  # rows come in fire_at order per partition
            counts[part] = counts.get(part, 0) + 1
            ck, rk = scoped(tenant, ckey), scoped(tenant, rkey)
            entries.append(Entry(ident, tenant, part, fire_at, priority=priority, ckey=ck, rkey=rk))
        scanned = range(q.settings.partitions_physical) if parts is None else parts
        if not future_only:
            # a partition cut short by its quota may hold rows of a level it did not return
            empty = [s for p in scanned if counts.get(p, 0) < quota for s in ws.slots_of(p)]
            ws.picked(firsts, empty, pick_time)
        q.cache.replace(entries, [p for p, n in counts.items() if n >= quota], parts)
        q.cache.cover(scanned, covers)
        next_scan = plan.next_scan_at(rt.clock.monotonic(), rt.config.rescan_interval, q.settings.window_seconds)
        q.pick.scanned(parts is None, future_only, next_scan)
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
        if not (q.pick.backlog or q.pick.due_hint or q.cache.has_due(db_now)):
            return 0.0
        s = q.settings
        return q.limits.wait(q.in_flight, s.max_qps, s.max_concurrency, now)

    @staticmethod
    def _chooser(q: QueueRuntime, subs: list[Subscriber]) -> Callable[[str], Subscriber | None]:
        """Who gets each event of a batch (plan.chooser); ties start one subscriber further on
        than the last batch's."""
        return plan.chooser(subs, lambda c: c.free, lambda c: c.tenants, lambda c: c.lapsed, q.pick.next_turn())

    async def _fire_direct(self, q: QueueRuntime) -> int:
        """Fire events due now straight from the table (no scan round trip first), by priority
        first (``mgr_fire_due``; priority.py)."""
        subs, limit = self._capacity(q)
        if limit <= 0:
            return 0
        if q.limited:
            return await self._fire_direct_fair(q, subs, limit)
        ws = q.wake_state
        used = ws.pick_floors()
        pick_time = self.rt.db_clock.now()
        started = self._started()
        cursor, since = q.pick.direct_start()
        counts = q.pick.level_counts(pick_time, q.settings.priority_aging_seconds)
        caps = q.pick.caps
        rows, oldest, quota = await store.fire_due(
            self.conn, q.settings, self.term, cursor, limit, used, since, counts, q.pick.level_ties(), caps
        )
        q.limits.spent(len(rows), self.rt.clock.monotonic())
        self.rt.signals.fired.emit(q.name)
        levels = ws.levels
        per_slot, tops, heads, lows, per_part = streams_fired(rows, levels, counts)
        if rows:
            # each level's oldest due event: its streams' heads probed (behind a backlog), or its
            # oldest fired
            probed = list(oldest) or [None] * levels
            q.pick.levels_read(
                [min(t, lows.get(v, _INF)) if t is not None else lows.get(v) for v, t in enumerate(probed, 1)]
            )
        per_stream = {(s // levels, s % levels + 1): n for s, n in per_slot.items()}
        # short of the limit: every stream was read, and those that gave nothing have nothing due
        empty = (
            [s for s in range(q.settings.partitions_physical * levels) if s not in per_slot]
            if len(rows) < limit
            else ()
        )
        ws.picked(tops, empty, pick_time)
        # more are due if the batch was full or some stream gave all it was allowed
        full = len(rows) >= limit or any(n >= caps.get(s, quota) for s, n in per_stream.items())
        q.pick.direct_fired(per_part, heads, since, pick_time, full, q.settings.partitions_physical)
        q.pick.caps = next_caps(per_stream, counts, caps, quota, limit)
        if rows:
            if len(q.cache):
                q.cache.discard_heads({r[0] for r in rows})
            choose = self._chooser(q, subs)
            self._push(q, rows, [choose(r[1]) or subs[0] for r in rows], started)
        return len(rows)

    def _started(self) -> int:
        """When a fire began, for its span when this batch is sampled (0: not traced)."""
        tracer = self.rt.tracer
        return tracer.now_ns() if tracer is not None and tracer.sampled() else 0

    def _key_rooms(self, q: QueueRuntime, limit: int) -> tuple[KeyRooms, KeyRooms]:
        """What a pick of ``limit`` may take of each concurrency key and each rate key now."""
        keys = q.keys
        if not keys.active:
            return UNLIMITED, UNLIMITED
        now = self.rt.clock.monotonic()
        q.rates.prune(keys, now)
        return concurrency_rooms(keys, q.ledger.by_key(), limit), q.rates.rooms_at(keys, now)

    def _keys_passed(self, q: QueueRuntime, ckeys: KeyRooms, rkeys: KeyRooms, rows: list[_Row]) -> None:
        """After a limited pick: the concurrency keys it passed over or filled, and when the rate
        keys it passed over have a token, so that the dispatcher fires again then."""
        if not q.keys.active:
            return
        blocked = list(ckeys.blocked)
        held = q.ledger.by_key()
        for r in rows:
            key = scoped(r[1], r[10])
            if key is not None:
                cap = q.keys.max_in_flight(key)
                if cap is not None and held.get(key, 0) >= cap:
                    blocked.append(key)
        now = self.rt.clock.monotonic()
        wait = q.rates.wait(q.keys, now) if rkeys.holds_back else float("inf")
        q.pick.keys_passed(blocked, None if wait == float("inf") else now + wait)

    async def _fire_direct_fair(self, q: QueueRuntime, subs: list[Subscriber], limit: int) -> int:
        """The direct path of a queue with tenant settings or key limits: the limited pick
        (fairness.py, keys.py). It leaves the floors where they are: it may pass over rows below the
        ones it fires (a capped tenant's or key's, or candidates the weights did not choose), so
        "nothing is due below what was fired" does not hold."""
        in_flight = q.ledger.by_tenant()
        pick = q.fair.pick(q.policy, in_flight, limit)
        ckeys, rkeys = self._key_rooms(q, limit)
        used = q.wake_state.pick_floors()
        started = self._started()
        counts = q.pick.level_counts(self.rt.db_clock.now(), q.settings.priority_aging_seconds)
        ties = q.pick.level_ties()
        rows, quota, seen, oldest = await store.fire_due_fair(
            self.conn, q.settings, self.term, q.pick.cursor, limit, pick, used, ckeys, rkeys, counts, ties
        )
        self.rt.signals.fired.emit(q.name)
        if rows:
            q.pick.levels_read(oldest)
        per_part: dict[int, int] = {}
        fired: dict[str, int] = {}
        for r in rows:
            per_part[r[2]] = per_part.get(r[2], 0) + 1
            fired[r[1]] = fired.get(r[1], 0) + 1
        # candidates left over, or a partition that gave its whole quota: more are due now
        full = len(rows) >= limit or seen > len(rows) or any(n >= quota for n in per_part.values())
        # tenants at their cap, or that reached it in this batch, may have more due: fire when they have room
        capped = list(pick.capped)
        for t, n in fired.items():
            room = q.policy.room(t, in_flight.get(t, 0))
            if room is not None and n >= room:
                capped.append(t)
        q.pick.fair_fired(per_part, full, capped, q.settings.partitions_physical)
        if rows:
            q.fair.charge((r[1] for r in rows), q.policy)
            if len(q.cache):
                q.cache.discard_ids({r[0] for r in rows})
            choose = self._chooser(q, subs)
            self._push(q, rows, [choose(r[1]) or subs[0] for r in rows], started)
        self._keys_passed(q, ckeys, rkeys, rows)
        return len(rows)

    async def _fire_cached(self, q: QueueRuntime) -> int:
        """Fire due events of the window cache (scheduled events reach here at their fire_at), by
        effective priority first, within the tenants' shares and the keys' rooms."""
        taken = self._take_cached(q)
        if taken is None:
            return 0
        rows = await store.fire(self.conn, q.settings, self.term, [e.id for e, _ in taken.entries])
        return self._fired_cached(q, taken, rows)

    def _take_cached(self, q: QueueRuntime) -> _Taken | None:
        """Take the cache's due events for the subscribers with credit (None: nothing to fire)."""
        if not len(q.cache):
            return None
        subs, limit = self._capacity(q)
        if limit <= 0:
            return None
        chooser = self._chooser(q, subs)
        now_db = self.rt.db_clock.now()
        ckeys, rkeys = self._key_rooms(q, limit)
        admit = KeyAdmission(ckeys, rkeys)

        def choose(e: Entry) -> Subscriber | None:
            if not admit.allows(e.ckey, e.rkey):
                return None
            c = chooser(e.tenant)
            if c is not None:
                admit.took(e.ckey, e.rkey)
            return c

        if q.policy.active:
            in_flight = q.ledger.by_tenant()

            aging = q.settings.priority_aging_seconds

            ties = level_ties(q.pick.turn)

            def order(cands: list[Entry], n: int) -> list[Entry]:
                oldest: dict[int, float | None] = {}
                for e in cands:
                    t = oldest.get(e.priority)
                    oldest[e.priority] = e.fire_at if t is None else min(e.fire_at, t)
                counts = level_counts(oldest, now_db, aging)
                return q.fair.order(
                    [(e, e.tenant, e.fire_at, counts[e.priority - 1], ties[e.priority - 1]) for e in cands],
                    q.policy,
                    in_flight,
                    n,
                )

            taken = q.cache.take_ordered(now_db, limit, choose, order)
            # due events held back by their tenants' caps: idle until an ack wakes the dispatcher
            q.pick.cache_held = not taken and q.cache.has_due(now_db)
        else:
            taken = q.cache.take(now_db, limit, choose, q.settings.priority_aging_seconds, q.pick.turn)
        if not taken:
            # give the admitted tokens back now: held until the next admit, they would be lost to
            # the bucket's cap while it refills, and each round that found nothing due in the cache
            # would lower the queue's max_qps rate
            q.limits.spent(0, self.rt.clock.monotonic())
            if admit.passed:
                self._keys_passed(q, ckeys, rkeys, [])
            return None
        return _Taken(taken, now_db, admit.passed, ckeys, rkeys, self._started())

    def _fired_cached(self, q: QueueRuntime, taken: _Taken, rows: list[_Row]) -> int:
        """The fire of ``taken`` came back with ``rows``: push them, put back what the database
        found not yet due."""
        q.limits.spent(len(rows), self.rt.clock.monotonic())
        self.rt.signals.fired.emit(q.name)
        if q.policy.active and rows:
            q.fair.charge((r[1] for r in rows), q.policy)
        by_id = {e.id: (e, c) for e, c in taken.entries}
        self._push(q, rows, [by_id[r[0]][1] for r in rows], taken.started)
        if taken.passed:
            self._keys_passed(q, taken.ckeys, taken.rkeys, rows)
        for r in rows:
            by_id.pop(r[0], None)
        # not fired: already taken elsewhere, or a hair too early for the database clock
        now_db = taken.now_db
        put_back = [e for e, _ in by_id.values() if e.refusals < MAX_REFUSALS and e.fire_at > now_db - 0.5]
        for e in put_back:
            e.refusals += 1
        if put_back:
            q.cache.put_back(put_back)
            self.rt.db_clock.lean_later(LEAN_LATER)
        return len(rows)

    def _push(self, q: QueueRuntime, rows: list[_Row], assign: list[Subscriber], started: int = 0) -> None:
        """Record fired rows in the ledger and send them, one or more deliver frames per receiver
        (with each event's trace context, when it has one); ``assign[i]`` takes ``rows[i]``.
        ``started``: the fire's start when this batch is traced (its span ends here)."""
        rt = self.rt
        pushed_db = rt.db_clock.now()
        mono = rt.clock.monotonic()
        #: per receiver of this batch, its events (frames.event) and ledger records; None: it went away or
        #: fell silent (a receiver's state does not change during this call)
        dest: dict[Subscriber, tuple[list[dict[str, Any]], list[tuple[int, int, str, str | None]]] | None] = {}
        orphans: list[ReleaseItem] = []
        unheard: list[ReleaseItem] = []
        ledger = q.ledger
        delays = []
        tenants = []
        event = frames.event
        rates = q.rates if q.keys.limits_rate else None
        for row, c in zip(rows, assign, strict=True):
            ident, tenant, part, attempt, fire_at, payload, traceparent, tracestate, baggage, priority, ck, rk = row
            key = None if ck is None else tenant + SEP + ck
            if rates is not None and rk is not None:
                rate_key = tenant + SEP + rk
                rate = q.keys.max_qps(rate_key)
                if rate is not None:
                    rates.spent(rate_key, rate, mono)
            try:
                to = dest[c]
            except KeyError:
                to = dest[c] = None if c.closed or c.silent else ([], [])
            if to is None:
                if c.closed:
                    orphans.append((ident, attempt, 0.0, "receiver went away before the push"))
                else:  # the collector found it silent while this fire was on its way
                    unheard.append((ident, attempt, 0.0, "receiver fell silent before the push"))
                ledger.stray(ident, attempt, key)  # its key counts it until the release commits
                continue
            to[0].append(
                event(ident, attempt, tenant, part, fire_at, payload, priority, traceparent, tracestate, baggage)
            )
            to[1].append((ident, attempt, tenant, key))
            delays.append(pushed_db - fire_at if pushed_db > fire_at else 0.0)
            tenants.append(tenant)
        per_frame = rt.config.max_events_per_frame
        for c, to in dest.items():
            if to is not None:
                ledger.hold_many(c.id, mono, to[1])
                for text in frames.deliver_frames(q.name, to[0], per_frame):
                    c.send(text)
        if delays:
            rt.metrics.pickup.observe_many(delays, queue=q.name)
            rt.metrics.observe_dwell(q.name, tenants, delays, mono)
            rt.metrics.fired.inc(len(delays), queue=q.name)
        rt.release_soon(q, orphans, "disconnect")
        rt.release_soon(q, unheard, "silent")
        if started and rt.tracer is not None:
            rt.tracer.batch("fire", q.name, len(rows), (r[6] for r in rows), started)
