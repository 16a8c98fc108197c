"""The leader's periodic schedules: each pass enqueues the slots that come within reach.

A task of the term's session (term.py). Every ``PASS_INTERVAL`` it runs a pass, one transaction
fenced by the term (db/sql/schedules.sql): the schedules whose next slot falls within their
queue's window plus ``AHEAD`` seconds, locked; for each the slots to enqueue (domain/schedules.py:
the lookahead, the misfire policy); their events inserted with ``fire_at`` = the slot's instant and
the dedup key of schedule and slot; the cursors moved past them. A slot is thus enqueued exactly
once: the cursor and the events commit together, a deposed leader's pass fails on its fence, and
the dedup key makes a second insert of the same slot do nothing whatever happens to a cursor.

Slots are enqueued at least the queue's window ahead, so each one sits in the window cache before
it is due and fires at its instant like any scheduled event (docs/manager.md, "The window cache").
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from queue_manager.db.sqlfiles import query
from queue_manager.domain import routing
from queue_manager.domain import schedules as sch
from queue_manager.domain.names import check_queue_name
from queue_manager.errors import InvalidInputError
from queue_manager.manager.runtime import Runtime
from queue_manager.manager.store import AsyncConn, is_fenced

logger = logging.getLogger(__name__)

#: seconds between passes
PASS_INTERVAL = 1.0
#: slots are enqueued up to the queue's window plus this many seconds ahead
AHEAD = 2.0 * PASS_INTERVAL
#: a slot later than this past its instant was missed (the misfire policy decides): a pass that
#: runs late by less enqueues it, to fire at once
GRACE = 2.0 * PASS_INTERVAL
#: schedules per statement (a pass takes as many rounds as needed)
BATCH = 1000
#: slots of one schedule per transaction
SLOTS_PER_PASS = 500
#: slot events per transaction at most: a pass's transactions stay short (the schedules they lock
#: wait for them). Slots were routed inserts at first, each holding a dedup advisory lock to the
#: commit: 14 000 in one transaction ran the server's lock table out ("out of shared memory") in
#: the first measurement of 10 000 schedules
ROWS_PER_TRANSACTION = 500
_FILE = "schedules.sql"
#: schedules planned between two yields to the event loop: a pass shares the loop with the
#: dispatcher, whose timers fire the slots (about 40 us a schedule: 50 of them hold it 2 ms)
YIELD_EVERY = 50
#: what the database answers when a slot's event breaks a rule of its queue (or the fence)
_REFUSED = (psycopg.errors.DataError, psycopg.errors.IntegrityError, psycopg.errors.ProgramLimitExceeded,
            psycopg.errors.RaiseException)  # fmt: skip


@dataclass
class PassCounts:
    schedules: int = 0
    slots: int = 0
    enqueued: int = 0
    missed: int = 0
    errors: int = 0


class Scheduler:
    """Enqueues the slots of the shard's schedules while this process leads."""

    def __init__(self, rt: Runtime, conn: AsyncConn, term: int) -> None:
        self.rt = rt
        self.conn = conn
        self.term = term
        #: a schedule's trigger, by its definition (parsing a cron expression costs ~100 us)
        self._triggers: dict[tuple[Any, ...], sch.Trigger] = {}
        #: a tenant's shuffle set, by (tenant, N, k)
        self._sets: dict[tuple[str, int, int], tuple[int, ...]] = {}
        self.passes = 0

    async def run(self) -> None:
        """Passes while this process leads. A pass that one schedule's event breaks (a payload over
        the queue's new limit, a tenant a reshard moved away) is run again one schedule at a time,
        and the schedules at fault get their ``error`` (the others go on). A fenced pass or a lost
        connection fails the session, as any task's error does."""
        while True:
            if self.rt.leading():
                try:
                    await self.run_once()
                except _REFUSED as exc:
                    if is_fenced(exc):
                        raise
                    await self._isolate(exc)
            await asyncio.sleep(PASS_INTERVAL)

    async def _isolate(self, exc: psycopg.Error) -> None:
        logger.warning("a schedule's event was refused; finding which", extra={"action": "schedules_refused",
                                                                              "error": str(exc)[:300]})  # fmt: skip
        async with self.conn.transaction():
            cur = self.conn.cursor(row_factory=dict_row)
            await cur.execute(query("schedules_fence", _FILE), {"term": self.term})
            head = await cur.fetchone()
            assert head is not None
            await cur.execute(query("schedules_due", _FILE), {**self._due(head["now"]), "limit": BATCH})
            ids = [r["id"] for r in await cur.fetchall()]
        for sid in ids:
            try:
                await self.run_once(only=sid)
            except _REFUSED as e:
                if is_fenced(e):
                    raise
                await self.conn.execute(
                    query("schedules_error", _FILE), {"id": sid, "error": f"its event was refused: {e}"}
                )

    def _due(self, now: datetime, only: int | None = None) -> dict[str, Any]:
        return {"now": now, "ahead": AHEAD, "limit": BATCH, "only": only}

    async def run_once(self, only: int | None = None) -> PassCounts:
        """One pass, as many rounds of BATCH schedules as are due (only schedule ``only`` when given)."""
        total = PassCounts()
        while True:
            counts, full = await self._round(only)
            for k, v in vars(counts).items():
                setattr(total, k, getattr(total, k) + v)
            if not full:
                break
        self.passes += 1
        if total.enqueued or total.missed or total.errors:
            logger.debug("schedules pass", extra={"action": "schedules", "term": self.term, **vars(total)})
        return total

    async def _round(self, only: int | None) -> tuple[PassCounts, bool]:
        counts = PassCounts()
        failed: list[tuple[int, str]] = []
        conn = self.conn
        async with conn.transaction():
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(query("schedules_fence", _FILE), {"term": self.term})
            head = await cur.fetchone()
            assert head is not None
            now: datetime = head["now"]
            await cur.execute(query("schedules_due", _FILE), self._due(now, only))
            due = await cur.fetchall()
            inserts: dict[str, list[tuple[str, str, datetime, str, int | None]]] = defaultdict(list)
            key_of: dict[str, tuple[int, datetime]] = {}
            advance: dict[int, list[Any]] = {}
            left = False
            for n, s in enumerate(due):
                if n and not n % YIELD_EVERY:
                    await asyncio.sleep(0)  # the dispatcher's fires due meanwhile go first
                if counts.slots >= ROWS_PER_TRANSACTION:
                    left = True  # the rest keep their cursors: the next round takes them first
                    break
                try:
                    trig = self._trigger(s)
                except InvalidInputError as exc:
                    failed.append((s["id"], f"cannot compute its slots: {exc}"))
                    continue
                p = sch.plan(trig, _spec(s), s["next_at"], now, s["window_seconds"] + AHEAD, GRACE, SLOTS_PER_PASS)
                for slot in p.enqueue:
                    key = sch.dedup_key(s["id"], slot)
                    inserts[s["queue"]].append((s["tenant"], s["payload"], slot, key, s["priority"]))
                    key_of[key] = (s["id"], slot)
                advance[s["id"]] = [p.next_at, p.enqueue[-1] if p.enqueue else None, None, p.missed]
                counts.schedules += 1
                counts.slots += len(p.enqueue)
                counts.missed += p.missed
            for queue, rows in inserts.items():
                await cur.execute(query("schedules_placement", _FILE), {"queue": queue})
                place = await cur.fetchone()
                if place is None:
                    continue  # dropped meanwhile: its schedules went with it
                parts = self._place(place["partitions"], place["shuffle"], place["loads"], [r[0] for r in rows])
                stmt = sql.SQL(query("schedules_insert", _FILE)).format(queue=sql.Identifier(check_queue_name(queue)))
                tenants, payloads, fire_ats, keys, priorities = (list(c) for c in zip(*rows, strict=True))
                params = {"tenants": tenants, "partitions": parts, "payloads": payloads, "fire_ats": fire_ats,
                          "keys": keys, "priorities": priorities,
                          "default_priority": place["default_priority"]}  # fmt: skip
                await cur.execute(stmt, params)
                added: dict[int, int] = defaultdict(int)
                for r in await cur.fetchall():
                    sid, slot = key_of[r["dedup_key"]]
                    a = advance[sid]
                    if a[1] == slot:
                        a[2] = r["id"]
                    added[r["partition"]] += 1
                    counts.enqueued += 1
                if added:
                    load = {"queue": queue, "partitions": list(added), "counts": list(added.values())}
                    await cur.execute(query("schedules_load", _FILE), load)
            if advance:
                ids = list(advance)
                cols = list(zip(*advance.values(), strict=True))
                await cur.execute(
                    query("schedules_advance", _FILE),
                    {"ids": ids, "next_ats": list(cols[0]), "last_slots": list(cols[1]),
                     "last_events": list(cols[2]), "missed": list(cols[3])},
                )  # fmt: skip
            for sid, why in failed:
                await cur.execute(query("schedules_error", _FILE), {"id": sid, "error": why})
        counts.errors = len(failed)
        return counts, left or len(due) >= BATCH

    def _place(self, n: int, k: int, loads: list[int] | None, tenants: list[str]) -> list[int]:
        """Each slot event's partition: the least loaded of its tenant's shuffle set, counting the
        ones placed before it (as the routing trigger and a bulk load place events)."""
        load = dict(enumerate(loads or []))
        out = []
        for tenant in tenants:
            key = (tenant, n, k)
            candidates = self._sets.get(key)
            if candidates is None:
                if len(self._sets) > 100_000:
                    self._sets.clear()
                candidates = self._sets[key] = routing.shuffle_set(tenant, n, k)
            p = routing.least_loaded(candidates, load)
            load[p] = load.get(p, 0) + 1
            out.append(p)
        return out

    def _trigger(self, s: dict[str, Any]) -> sch.Trigger:
        key = (s["cron"], s["interval_seconds"], s["timezone"], s["anchor"])
        trig = self._triggers.get(key)
        if trig is None:
            if len(self._triggers) > 100_000:
                self._triggers.clear()
            trig = self._triggers[key] = sch.check(_spec(s))
        return trig


def _spec(s: dict[str, Any]) -> sch.Spec:
    return sch.Spec(s["cron"], s["interval_seconds"], s["timezone"], s["anchor"], s["misfire"], s["catch_up"])
