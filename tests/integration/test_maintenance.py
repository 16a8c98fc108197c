"""Maintenance by work stealing: retention and reconciliation slices, taken by the leader's baseline pass, in
its idle moments and by standbys; each slice bounded, given up at the first conflict, counted.

Slices are taken directly through a manager's :class:`~queue_manager.manager.slices.Slicer` where
the test needs one exact partition, and through running managers (in-process, and real processes
for SIGSTOP) where it is about who takes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from queue_manager import admin
from queue_manager.domain.settings import QueueSettings
from queue_manager.domain.topology import Shard, Topology
from queue_manager.manager import Manager, ManagerConfig, store
from queue_manager.manager import slices as slices_module
from queue_manager.manager.recruit import Job
from queue_manager.manager.slices import Slicer, SliceResult
from tests.conftest import tenants_of
from tests.managerkit import (
    FAST,
    insert,
    leading_manager,
    running_manager,
    running_receiver,
    tokens,
    url,
    wait_for,
)
from tests.processkit import ManagerProcess, lease, write_config

pytestmark = pytest.mark.timeout(120)


@contextlib.asynccontextmanager
async def slicer(dsn: str, **overrides: Any) -> AsyncIterator[tuple[Manager, Slicer]]:
    """A manager's slicer, without running the manager (nothing else touches the database)."""
    m = Manager(ManagerConfig(dsn=dsn, tokens=tokens(), **{**FAST, **overrides}))
    m.signals.init()
    try:
        yield m, m.slicer
    finally:
        await m.slicer.close()


async def settings_of(dsn: str, queue: str) -> QueueSettings:
    conn = await store.connect(dsn, "test")
    try:
        [q] = [q for q in await store.load_queues(conn) if q.name == queue]
    finally:
        await conn.close()
    return q


async def execute(dsn: str, statement: str, params: Any = None) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(statement, params)


async def settle(dsn: str, ids: list[int], state: str, age: str, queue: str = "orders") -> None:
    """Make events acked or failed as if it happened ``age`` (an interval) ago."""
    if state == "acked":
        stmt = f"UPDATE {queue} SET state = 'acked', attempts = 1, fired_at = now() - %(age)s::interval, acked_at = now() - %(age)s::interval WHERE id = ANY(%(ids)s)"  # noqa: E501
    else:
        stmt = f"UPDATE {queue} SET state = 'failed', attempts = 1, fired_at = now() - %(age)s::interval, last_error = 'x' WHERE id = ANY(%(ids)s)"  # noqa: E501
    await execute(dsn, stmt, {"age": age, "ids": ids})


async def acked_an_hour_ago(shard: Shard, tenants: list[str]) -> list[int]:
    """One event per tenant, acked an hour ago (past the tests' retention): their ids."""
    ids = await insert(shard.dsn, [(t, {}) for t in tenants], fire_in=3600)
    await settle(shard.dsn, ids, "acked", "1 hour")
    return ids


async def states(dsn: str, queue: str = "orders") -> dict[int, str]:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cur = await conn.execute(f"SELECT id, state::text FROM {queue}")
        return {int(r[0]): str(r[1]) for r in await cur.fetchall()}


async def partitions_of(dsn: str, ids: list[int], queue: str = "orders") -> set[int]:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cur = await conn.execute(f"SELECT DISTINCT partition FROM {queue} WHERE id = ANY(%s)", (ids,))
        return {int(r[0]) for r in await cur.fetchall()}


async def counts(dsn: str) -> dict[str, tuple[int, int, int, int]]:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cur = await conn.execute("SELECT job, recruited, finished, aborted, events FROM qm.maintenance_counts()")
        return {str(r[0]): (int(r[1]), int(r[2]), int(r[3]), int(r[4])) for r in await cur.fetchall()}


async def drain_partitions(s: Slicer, q: QueueSettings, source: str = "baseline") -> list[SliceResult]:
    """Retention slices on every partition until none comes back full."""
    out = []
    for p in range(q.partitions_physical):
        for _ in range(50):
            r = await s.take(Job.RETENTION, q, p, source)
            out.append(r)
            assert not r.aborted, r
            if not r.full:
                break
        else:
            raise AssertionError(f"partition {p}: still full after 50 slices")
    return out


# ---------------------------------------------------------------------------------------------------------
# what a retention slice deletes


async def test_retention_slices_delete_settled_events_past_their_own_retention(shard: Shard, make_queue) -> None:  # type: ignore[no-untyped-def]
    """Acked events go after the queue's retention, failed ones after their own, longer one; younger
    settled events and every live event stay. A slice deletes at most slice_rows of each state."""
    make_queue("orders", partitions=2, shuffle=1, retention_seconds=600, failed_retention_seconds=3600)
    tenants = tenants_of(shard, 4)
    ids = await insert(shard.dsn, [(tenants[i % 4], {"i": i}) for i in range(12)], fire_in=3600)
    old_acked, young_acked, old_failed, young_failed, pending = ids[0:3], ids[3:5], ids[5:8], ids[8:10], ids[10:]
    await settle(shard.dsn, old_acked, "acked", "1 hour")
    await settle(shard.dsn, young_acked, "acked", "5 minutes")
    await settle(shard.dsn, old_failed, "failed", "2 hours")
    await settle(shard.dsn, young_failed, "failed", "30 minutes")
    q = await settings_of(shard.dsn, "orders")
    assert (q.retention_seconds, q.failed_retention_seconds) == (600, 3600)

    async with slicer(shard.dsn, slice_rows=1) as (m, s):
        results = await drain_partitions(s, q)
    left = await states(shard.dsn)
    assert sorted(left) == sorted(young_acked + young_failed + pending)
    assert sum(r.events for r in results) == 6
    # one row of each state per slice: at least 3 slices for the 3 old acked events
    assert len([r for r in results if r.events]) >= 3
    assert m.metrics.purged.get(queue="orders", state="acked") == 3
    assert m.metrics.purged.get(queue="orders", state="failed") == 3


async def test_a_null_failed_retention_keeps_dead_letters(shard: Shard, make_queue) -> None:  # type: ignore[no-untyped-def]
    make_queue("orders", partitions=2, shuffle=1, retention_seconds=0, failed_retention_seconds=None)
    tenants = tenants_of(shard, 2)
    ids = await insert(shard.dsn, [(tenants[i % 2], {"i": i}) for i in range(4)], fire_in=3600)
    await settle(shard.dsn, ids[:2], "failed", "3650 days")
    await settle(shard.dsn, ids[2:], "acked", "1 second")
    q = await settings_of(shard.dsn, "orders")
    assert q.failed_retention_seconds is None
    async with slicer(shard.dsn) as (_, s):
        await drain_partitions(s, q)
    assert await states(shard.dsn) == {ids[0]: "failed", ids[1]: "failed"}


async def test_a_slice_never_deletes_a_live_event_however_old(shard: Shard, make_queue) -> None:  # type: ignore[no-untyped-def]
    """to_be_fired and fired events with every timestamp ten years old (acked_at too, as a careless
    UPDATE could leave it), zero retentions: the slices delete every settled event and no live one."""
    make_queue("orders", partitions=2, shuffle=1, retention_seconds=0, failed_retention_seconds=0)
    tenants = tenants_of(shard, 4)
    ids = await insert(shard.dsn, [(tenants[i % 4], {"i": i}) for i in range(16)])
    live, settled = ids[:8], ids[8:]
    ancient = "now() - interval '3650 days'"
    await execute(
        shard.dsn,
        f"UPDATE orders SET fire_at = {ancient}, created_at = {ancient}, fired_at = {ancient}, "
        f"acked_at = {ancient}, ack_deadline = {ancient}",
    )
    await execute(shard.dsn, "UPDATE orders SET state = 'fired', attempts = 1 WHERE id = ANY(%s)", (live[:4],))
    await execute(shard.dsn, "UPDATE orders SET state = 'acked', attempts = 1 WHERE id = ANY(%s)", (settled[:4],))
    await execute(shard.dsn, "UPDATE orders SET state = 'failed', attempts = 1 WHERE id = ANY(%s)", (settled[4:],))
    before = await states(shard.dsn)
    assert await partitions_of(shard.dsn, live) == {0, 1}
    q = await settings_of(shard.dsn, "orders")
    async with slicer(shard.dsn, slice_rows=3) as (_, s):
        for _ in range(3):  # again and again: nothing more goes
            await drain_partitions(s, q)
    assert await states(shard.dsn) == {i: before[i] for i in live}
    assert sorted(before[i] for i in live) == ["fired"] * 4 + ["to_be_fired"] * 4


# ---------------------------------------------------------------------------------------------------------
# conflicts: a slice gives up, is counted aborted, and is not retried


async def test_a_reconciliation_slice_beside_an_ack_in_progress_neither_waits_nor_loses_more_than_that_ack(
    shard: Shard, make_queue
) -> None:  # type: ignore[no-untyped-def]
    """An ack statement counts its events done (qm.add_done) before it commits. A reconciliation
    slice in between takes no lock: it finishes at once, sees the event still fired, and anchors the
    counter on that, so once the ack commits the load is one too high: off by the one settle in
    flight during the slice, no more (docs/design.md, "Shuffle sharding"). The next slice, with
    nothing in flight, makes it exact."""
    make_queue("orders", partitions=1, shuffle=1)
    tenants = tenants_of(shard, 3)
    ids = await insert(shard.dsn, [(t, {}) for t in tenants], fire_in=3600)
    await execute(shard.dsn, "UPDATE orders SET state = 'fired', attempts = 1 WHERE id = %s", (ids[0],))
    q = await settings_of(shard.dsn, "orders")
    assert await _loads(shard.dsn) == [3]
    async with await psycopg.AsyncConnection.connect(shard.dsn, options="-c qm.role=manager") as ack:
        # what mgr_ack does, left uncommitted
        await ack.execute("UPDATE orders SET state = 'acked', acked_at = now() WHERE id = %s", (ids[0],))
        await ack.execute("SELECT qm.add_done(%s, ARRAY[0]::smallint[])", (q.id,))
        assert await _loads(shard.dsn) == [2]
        async with slicer(shard.dsn) as (m, s):
            started = time.monotonic()
            r = await s.take(Job.RECONCILIATION, q, 0, "idle")
            took = time.monotonic() - started
            assert r.outcome == "finished" and r.events == 1, r  # it took the ack's count back
            assert took < 0.5, f"the slice took {took:.2f}s"
            assert m.metrics.slices.get(job="reconciliation", outcome="finished", source="idle") == 1
            assert m.metrics.slices.get(job="reconciliation", outcome="aborted", source="idle") == 0
            assert (await counts(shard.dsn))["reconciliation"] == (1, 1, 0, 1)
            await ack.commit()
            assert await _live(shard.dsn, 1) == [2]
            assert await _loads(shard.dsn) == [3], "off by more than the settle in flight"
            # the next slice (of any manager), nothing in flight: exact again
            async with await psycopg.AsyncConnection.connect(shard.dsn) as conn:  # a rolled-back insert: +1
                await conn.execute("INSERT INTO orders (tenant) VALUES (%s)", (tenants[0],))
                await conn.rollback()
            r = await s.take(Job.RECONCILIATION, q, 0, "idle")
    assert r.outcome == "finished" and r.events == 2, r
    assert await _loads(shard.dsn) == [2] == await _live(shard.dsn, 1)
    assert (await counts(shard.dsn))["reconciliation"] == (2, 2, 0, 3)


async def test_a_retention_slice_gives_up_behind_a_table_lock_and_skips_locked_rows(shard: Shard, make_queue) -> None:  # type: ignore[no-untyped-def]
    """A lock its DELETE must wait for (SHARE, as a CREATE INDEX takes) aborts the slice after the
    short lock_timeout instead of queueing it (and everyone behind it); a row an application holds
    is skipped: the slice deletes the rest, and the row goes in a later slice."""
    make_queue("orders", partitions=1, shuffle=1, retention_seconds=60)
    tenants = tenants_of(shard, 3)
    ids = await acked_an_hour_ago(shard, tenants)
    q = await settings_of(shard.dsn, "orders")
    async with slicer(shard.dsn) as (m, s):
        async with await psycopg.AsyncConnection.connect(shard.dsn) as holder:
            await holder.execute("LOCK TABLE orders IN SHARE MODE")
            started = time.monotonic()
            r = await s.take(Job.RETENTION, q, 0, "standby")
            took = time.monotonic() - started
            assert r.aborted and r.reason == "lock", r
            assert took < 1.0, f"the slice queued {took:.2f}s behind the lock"
            assert len(await states(shard.dsn)) == 3
            await holder.rollback()

            await holder.execute("SELECT id FROM orders WHERE id = %s FOR UPDATE", (ids[0],))
            r = await s.take(Job.RETENTION, q, 0, "standby")
            assert r.outcome == "finished" and r.events == 2, r
            assert sorted(await states(shard.dsn)) == [ids[0]]
            await holder.rollback()
        r = await s.take(Job.RETENTION, q, 0, "standby")
        assert r.events == 1 and await states(shard.dsn) == {}
    assert m.metrics.slices.get(job="retention", outcome="recruited", source="standby") == 3
    assert m.metrics.slices.get(job="retention", outcome="aborted", source="standby") == 1
    assert m.metrics.slices.get(job="retention", outcome="finished", source="standby") == 2
    assert (await counts(shard.dsn))["retention"] == (3, 2, 1, 3)


async def _loads(dsn: str) -> list[int]:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cur = await conn.execute("SELECT qm.partition_loads('orders')")
        row = await cur.fetchone()
    assert row is not None
    return [int(x) for x in row[0]]


async def _live(dsn: str, partitions: int) -> list[int]:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cur = await conn.execute(
            "SELECT array_agg((SELECT count(*) FROM orders WHERE partition = p "
            "AND state IN ('to_be_fired', 'fired')) ORDER BY p) FROM generate_series(0, %s - 1) p",
            (partitions,),
        )
        row = await cur.fetchone()
    assert row is not None
    return [int(x) for x in row[0]]


# ---------------------------------------------------------------------------------------------------------
# who takes slices: the baseline pass, idle moments, standbys


async def test_the_baseline_pass_purges_and_reconciles_when_the_manager_is_never_idle(shard: Shard, make_queue) -> None:  # type: ignore[no-untyped-def]
    """With no idle slices (a dispatcher that is never idle) and no standby, the leader's baseline passes
    still purge every partition and remove the drift of rollbacks and SQL acks."""
    make_queue("orders", partitions=4, shuffle=2, retention_seconds=60)
    tenants = tenants_of(shard, 8)
    async with leading_manager(shard.dsn, idle_slices=False) as m:
        ids = await insert(shard.dsn, [(t, {}) for t in tenants], fire_in=3600)
        await settle(shard.dsn, ids[:6], "acked", "1 hour")
        async with await psycopg.AsyncConnection.connect(shard.dsn) as conn:  # drift: 3 rolled back
            for t in tenants[:3]:
                await conn.execute("INSERT INTO orders (tenant) VALUES (%s)", (t,))
            await conn.rollback()
        await wait_for(
            lambda: m.metrics.purged.get(queue="orders", state="acked") == 6, what="the baseline pass's purge"
        )
        runs = m.metrics.maintenance.get(job="reconciliation", outcome="finished")
        await wait_for(
            lambda: m.metrics.maintenance.get(job="reconciliation", outcome="finished") >= runs + 2,
            what="two reconciliation baseline passes",
        )
        assert await _loads(shard.dsn) == await _live(shard.dsn, 4)
        assert m.metrics.load_drift.get(queue="orders") == 0
    assert sorted(await states(shard.dsn)) == sorted(ids[6:])
    for job in ("retention", "reconciliation"):
        assert m.metrics.slices.get(job=job, outcome="finished", source="baseline") >= 4
        assert m.metrics.slices.get(job=job, outcome="recruited", source="idle") == 0


async def test_idle_moments_take_slices(shard: Shard, make_queue) -> None:  # type: ignore[no-untyped-def]
    """No baseline pass for an hour: the purge comes from slices the leader takes when it has nothing to do.

    An idle dispatcher sleeps up to its rescan interval (2 s by default) and each wake-up recruits
    at most one slice, for a random job and partition: with the default, covering the 3-4
    partitions that hold the events took 3-8 s of the 10 s allowed. A 0.2 s rescan gives the idle
    moments ten times as often."""
    make_queue("orders", partitions=4, shuffle=2, retention_seconds=60)
    tenants = tenants_of(shard, 8)
    quick = {"purge_interval": 3600.0, "reconcile_interval": 3600.0, "slice_interval": 0.02, "rescan_interval": 0.2}
    async with leading_manager(shard.dsn, **quick) as m:
        await acked_an_hour_ago(shard, tenants)
        await wait_for(lambda: m.metrics.purged.get(queue="orders", state="acked") == 8, what="the idle slices' purge")
    assert await states(shard.dsn) == {}
    assert m.metrics.slices.get(job="retention", outcome="finished", source="idle") >= 1
    assert m.metrics.slices.get(job="retention", outcome="recruited", source="baseline") == 0


async def test_no_idle_slices_while_due_events_wait_for_credit(shard: Shard, make_queue) -> None:  # type: ignore[no-untyped-def]
    """A receiver with one credit that holds its event, and more events due: the dispatcher goes
    idle at every look (nothing it can fire), but such moments are not spare, and it enlists for no
    slice until the backlog has credit again."""
    make_queue("orders", partitions=4, shuffle=2, retention_seconds=60)
    tenants = tenants_of(shard, 8)
    quick = {"purge_interval": 3600.0, "reconcile_interval": 3600.0, "slice_interval": 0.02, "rescan_interval": 0.2}
    async with leading_manager(shard.dsn, **quick) as m:
        async with running_receiver(url(m), credit=1, mode="hold") as (_, recorder):
            await insert(shard.dsn, [(t, {}) for t in tenants])
            await wait_for(lambda: len(recorder.events) == 1, what="the one event the credit allows")
            idle = m.signals.idle
            looks = 0

            def recruited() -> float:
                return sum(
                    m.metrics.slices.get(job=j, outcome="recruited", source="idle")
                    for j in ("retention", "reconciliation")
                )

            before = recruited()
            idle.clear()
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                with contextlib.suppress(AssertionError):
                    await idle.wait(0.5)
                    looks += 1
            after = recruited()
        assert looks >= 5, f"the dispatcher went idle only {looks} times"
        assert after == before, f"{after - before} idle slices beside a backlog without credit"
        assert len(recorder.events) == 1


async def test_a_standby_takes_slices_while_the_leader_leads(shard: Shard, make_queue) -> None:  # type: ignore[no-untyped-def]
    """The leader takes no slice (no idle slices, no baseline pass for an hour); the standby's loop purges
    and reconciles, and the leader keeps its term all along."""
    make_queue("orders", partitions=4, shuffle=2, retention_seconds=60)
    tenants = tenants_of(shard, 8)
    quiet = {"idle_slices": False, "purge_interval": 3600.0, "reconcile_interval": 3600.0}
    async with leading_manager(shard.dsn, **quiet) as leader:
        term = leader.term
        async with running_manager(shard.dsn, slice_interval=0.02) as standby:
            await wait_for(lambda: standby.role == "standby", what="the standby")
            before = await counts(shard.dsn)
            await acked_an_hour_ago(shard, tenants)
            await wait_for(
                lambda: standby.metrics.purged.get(queue="orders", state="acked") == 8, what="the standby's purge"
            )
            await wait_for(
                lambda: standby.metrics.slices.get(job="reconciliation", outcome="finished", source="standby") >= 2,
                what="reconciliation slices on the standby",
            )

            def finished() -> dict[str, float]:
                jobs = ("retention", "reconciliation")
                return {j: standby.metrics.slices.get(job=j, outcome="finished", source="standby") for j in jobs}

            seen_before, after, seen_after = finished(), await counts(shard.dsn), finished()
            assert leader.role == "leader" and leader.term == term and standby.role == "standby"
    assert await states(shard.dsn) == {}
    assert leader.metrics.purged.total() == 0
    assert leader.metrics.slices.get(job="retention", outcome="recruited", source="idle") == 0
    assert standby.metrics.slices.get(job="retention", outcome="finished", source="standby") >= 1
    # the shard-wide counts rose by the standby's slices, and by nothing else: the database counts a
    # slice just after the metric, and one slice at a time, so at most one may be counted late
    for job in ("retention", "reconciliation"):
        assert seen_before[job] - 1 <= after[job][1] - before[job][1] <= seen_after[job], job


async def test_reconciliation_slices_beside_a_stream_of_acks_leave_the_counters_within_the_bound(
    shard: Shard, make_queue, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """A standby reconciles the partitions as fast as it can while the leader acks a stream of
    events, then stops; the acks go on. Neither waits for the other. Once everything is acked, each
    load is off by at most what was in flight during its partition's last slice: the enqueues (one
    statement of 20 rows at a time) and the settles (at most the receiver's credit, 20, in hand or
    in the writer's statement); one slice per partition, now that nothing is in flight, makes every
    load exactly zero (docs/design.md, "Shuffle sharding")."""
    make_queue("orders", partitions=4, shuffle=2)
    # as many slices as the standby can take: a count slowed by a busy machine must not rest it
    # (slices.RECONCILE_SLOW, for held snapshots; tests/unit/test_slices_rest.py covers the rule)
    monkeypatch.setattr(slices_module, "RECONCILE_SLOW", 60.0)
    tenants = tenants_of(shard, 16)
    inserted = 0
    streaming = True

    async def produce() -> None:
        nonlocal inserted
        async with await psycopg.AsyncConnection.connect(shard.dsn, autocommit=True) as conn:
            while streaming:
                await conn.execute(
                    "INSERT INTO orders (tenant, payload) SELECT t, '{}' FROM unnest(%s::text[]) t",
                    ([tenants[(inserted + j) % 16] for j in range(20)],),
                )
                inserted += 20
                await asyncio.sleep(0.005)

    quiet = {"idle_slices": False, "reconcile_interval": 3600.0}
    async with leading_manager(shard.dsn, **quiet) as leader:
        async with running_receiver(url(leader), credit=20) as (receiver, _):
            producer = asyncio.create_task(produce())
            try:
                async with running_manager(shard.dsn, slice_interval=0.001) as standby:
                    standby.slicer.rates = ((Job.RECONCILIATION, 1.0),)
                    await wait_for(lambda: standby.role == "standby", what="the standby")
                    await asyncio.sleep(3.0)
                    assert receiver.stats.acked > 500, "no stream of acks beside the slices"
                slices = standby.metrics.slices.get(job="reconciliation", outcome="finished", source="standby")
                aborted = standby.metrics.slices.get(job="reconciliation", outcome="aborted", source="standby")
                await asyncio.sleep(0.5)  # acks go on with no slice
            finally:
                streaming = False
                await producer
            await wait_for(lambda: receiver.stats.acked >= inserted, timeout=60, what="every ack")
        # every ack has committed (its count in its own statement): nothing is in flight any more
        loads = await _loads(shard.dsn)
        assert await _live(shard.dsn, 4) == [0, 0, 0, 0]
        assert all(abs(load) <= 20 + 20 for load in loads), f"drift past the bound: {loads} ({slices} slices)"
        async with slicer(shard.dsn) as (_, s):
            q = await settings_of(shard.dsn, "orders")
            for p in range(4):
                r = await s.take(Job.RECONCILIATION, q, p, "baseline")
                assert r.outcome == "finished", r
    assert slices >= 50, f"only {slices} reconciliation slices beside the acks"
    assert aborted == 0, f"{aborted} slices aborted: nothing should conflict with them"
    assert await _loads(shard.dsn) == [0, 0, 0, 0], f"not exact after a quiet reconciliation (before: {loads})"


# ---------------------------------------------------------------------------------------------------------
# counts in qm status


async def test_qm_status_shows_the_slices_of_every_manager(shards: Topology, shard: Shard, make_queue) -> None:  # type: ignore[no-untyped-def]
    make_queue("orders", partitions=2, shuffle=1, retention_seconds=60)
    tenants = tenants_of(shard, 2)
    await acked_an_hour_ago(shard, tenants)
    q = await settings_of(shard.dsn, "orders")
    async with slicer(shard.dsn) as (_, s):
        await drain_partitions(s, q)
        await s.take(Job.RECONCILIATION, q, 0, "baseline")
        async with await psycopg.AsyncConnection.connect(shard.dsn) as holder:
            # a table lock the count would queue for: the slice gives up on its time bound
            await holder.execute("LOCK TABLE orders IN ACCESS EXCLUSIVE MODE")
            await s.take(Job.RECONCILIATION, q, 1, "baseline")
    data = await asyncio.to_thread(admin.status, shards)
    entry = next(e for e in data["shards"] if e["shard"] == shard.name)
    assert entry["maintenance"]["retention"] == {"recruited": 2, "finished": 2, "aborted": 0, "events": 2}
    assert entry["maintenance"]["reconciliation"] == {"recruited": 2, "finished": 1, "aborted": 1, "events": 0}
    assert entry["maintenance"]["collector"] == {"recruited": 0, "finished": 0, "aborted": 0, "events": 0}
    text = admin.render_status(data)
    assert "maintenance slices (all managers):" in text
    assert re.search(r"retention\s+recruited 2  finished 2  aborted 0  events 2", text), text
    assert re.search(r"reconciliation\s+recruited 2  finished 1  aborted 1  events 0", text), text


# ---------------------------------------------------------------------------------------------------------
# maintenance is no single point of failure: real processes, the leader stopped


STOP_LEASE_TTL = 30.0
#: the standby's slices must purge within this long while the leader is stopped
PURGE_WITHIN = 10.0


@pytest.fixture
def leader_and_standby(tmp_path: Path, shards: Topology) -> Iterator[list[ManagerProcess]]:
    topo, tokens_file = write_config(tmp_path, shards)
    procs = [ManagerProcess(topo, tokens_file, "s0", STOP_LEASE_TTL)]
    yield procs
    for p in procs:
        p.stop()


def _metric(port: int, name: str, labels: dict[str, str]) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
        text = resp.read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} "):
            return float(line.split()[-1])
    return 0.0


async def test_with_the_leader_stopped_the_standby_still_purges(
    shard: Shard,
    make_queue,  # type: ignore[no-untyped-def]
    leader_and_standby: list[ManagerProcess],
    tmp_path: Path,
    shards: Topology,
) -> None:
    """SIGSTOP the leader (its lease runs 30 s): the standby's slices purge what expires meanwhile,
    within PURGE_WITHIN seconds, while the stopped leader still holds the lease."""
    make_queue("orders", partitions=4, shuffle=2, retention_seconds=60)
    [leader] = leader_and_standby
    await wait_for_lease(shard.dsn, leader.pid)
    topo, tokens_file = write_config(tmp_path, shards)
    standby = ManagerProcess(topo, tokens_file, "s0", STOP_LEASE_TTL)
    leader_and_standby.append(standby)
    term, _ = await lease(shard.dsn)
    os.kill(leader.pid, signal.SIGSTOP)
    try:
        await acked_an_hour_ago(shard, tenants_of(shard, 8))
        started = time.monotonic()
        while await states(shard.dsn):
            assert time.monotonic() - started < PURGE_WITHIN, "the standby did not purge while the leader was stopped"
            await asyncio.sleep(0.1)
        assert await lease(shard.dsn) == (term, leader.pid)  # the stopped leader still holds the shard
        finished = await asyncio.to_thread(
            _metric,
            standby.port,
            "qm_maintenance_slices_total",
            {"job": "retention", "outcome": "finished", "source": "standby"},
        )
        assert finished >= 1
        assert (
            await asyncio.to_thread(
                _metric, standby.port, "qm_events_purged_total", {"queue": "orders", "state": "acked"}
            )
            == 8
        )
    finally:
        os.kill(leader.pid, signal.SIGCONT)


async def wait_for_lease(dsn: str, pid: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while (await lease(dsn))[1] != pid:
        assert time.monotonic() < deadline, "the first manager did not take the lease"
        await asyncio.sleep(0.05)
