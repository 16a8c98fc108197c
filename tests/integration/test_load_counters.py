"""The producers' load counters stay exact under concurrent enqueues, socket acks and SQL acks.

load(p) = enqueue counter - done counter, both sequences. No reconciliation runs here (no floor, no idle slices): the
counters must be right by themselves once every event is settled.
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import psycopg
import pytest

from queue_manager.domain.topology import Shard
from receivers.client import Event
from tests.conftest import tenants_of
from tests.managerkit import Recorder, running_manager, running_receiver, url, wait_for, wait_leader

pytestmark = pytest.mark.timeout(120)

PRODUCERS = 4
EVENTS_EACH = 150


async def test_load_counters_stay_exact_under_concurrent_enqueue_and_acks(shard: Shard, make_queue) -> None:  # type: ignore[no-untyped-def]
    make_queue("orders", partitions=8, shuffle=3)
    tenants = tenants_of(shard, 30)
    rng = random.Random(5)

    class SometimesBySql(Recorder):
        """Acks one event in three by SQL in its own transaction (the manager is told at commit)."""

        def __init__(self, dsn: str) -> None:
            super().__init__()
            self.dsn = dsn

        async def __call__(self, event: Event) -> None:
            self.events.append(event)
            if event.id % 3 == 0:
                async with await psycopg.AsyncConnection.connect(self.dsn) as app:
                    await app.execute(
                        "UPDATE orders SET state = 'acked', acked_at = now() "
                        "WHERE id = %s AND attempts = %s AND state = 'fired'",
                        (event.id, event.attempt),
                    )
                    await app.commit()

    async def produce(j: int) -> None:
        async with await psycopg.AsyncConnection.connect(shard.dsn, autocommit=True) as conn:
            for i in range(EVENTS_EACH):
                await conn.execute(
                    "INSERT INTO orders (tenant, payload) VALUES (%s, %s)",
                    (rng.choice(tenants), json.dumps({"j": j, "i": i})),
                )
                if i % 25 == 0:
                    await asyncio.sleep(0)

    total = PRODUCERS * EVENTS_EACH
    async with running_manager(shard.dsn, reconcile_interval=3600.0, idle_slices=False) as m:
        await wait_leader(m)
        recorder = SometimesBySql(shard.dsn)
        async with running_receiver(url(m), recorder=recorder, credit=40):
            await asyncio.gather(*(produce(j) for j in range(PRODUCERS)))
            async with await psycopg.AsyncConnection.connect(shard.dsn, autocommit=True) as conn:

                async def settled() -> int:
                    cur = await conn.execute("SELECT count(*) FROM orders WHERE state = 'acked'")
                    return int((await cur.fetchone())[0])  # type: ignore[index]

                deadline = asyncio.get_running_loop().time() + 60
                while await settled() < total:
                    assert asyncio.get_running_loop().time() < deadline, "not every event was settled"
                    await asyncio.sleep(0.05)
                # the SQL acks' done counts are written by the manager after their notices
                await wait_for(lambda: m.metrics.settled_by_sql.total() >= 1, what="SQL acks seen")
                by_sql = sum(1 for e in recorder.events if e.id % 3 == 0)
                assert by_sql > 100

                async def loads() -> list[int]:
                    cur = await conn.execute("SELECT qm.partition_loads('orders')")
                    return list((await cur.fetchone())[0])  # type: ignore[index]

                for _ in range(100):
                    if not any(await loads()):
                        break
                    await asyncio.sleep(0.05)
                assert await loads() == [0] * 8, "the counters drifted"
        # no reconciliation ran: the counters were right by themselves
        assert m.metrics.maintenance.get(job="reconciliation", outcome="finished") <= 1


# ---------------------------------------------------------------------------------------------------------
# reconciliation beside enqueues that are not committed yet (the enqueue lock)


async def _partition_of(conn: psycopg.AsyncConnection[Any], tenant: str) -> int:
    """The partition the route trigger gives ``tenant`` (a queue with shuffle 1 has one per tenant)."""
    cur = await conn.execute("INSERT INTO orders (tenant, payload) VALUES (%s, '{}') RETURNING partition", (tenant,))
    return int((await cur.fetchone())[0])  # type: ignore[index]


async def _counts(dsn: str) -> tuple[list[int], list[int]]:
    """(the load counters, the live events) per partition, read without reconciling anything."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute("SELECT qm.partition_loads('orders')")
        loads = list((await cur.fetchone())[0])  # type: ignore[index]
        cur = await conn.execute(
            "SELECT count(*) FILTER (WHERE o.state IN ('to_be_fired', 'fired')) "
            "FROM generate_series(0, %s - 1) p LEFT JOIN orders o ON o.partition = p GROUP BY p ORDER BY p",
            (len(loads),),
        )
        return loads, [int(r[0]) for r in await cur.fetchall()]


async def test_a_slice_gives_up_while_an_enqueue_into_its_partition_is_uncommitted(shard: Shard, make_queue) -> None:  # type: ignore[no-untyped-def]
    """The enqueue counter moves at the insert, the row is seen at the commit: a slice between the
    two would count the event as done, and once acked it would be counted done twice."""
    make_queue("orders", partitions=4, shuffle=1)
    tenant = tenants_of(shard, 1)[0]
    async with (
        await psycopg.AsyncConnection.connect(shard.dsn) as producer,
        await psycopg.AsyncConnection.connect(shard.dsn, autocommit=True) as slicer,
    ):
        p = await _partition_of(producer, tenant)  # in an open transaction
        with pytest.raises(psycopg.errors.LockNotAvailable, match="still open"):
            await slicer.execute("SELECT qm.reconcile_partition('orders', %s)", (p,))
        # the other partitions are not held up by it
        other = (p + 1) % 4
        cur = await slicer.execute("SELECT qm.reconcile_partition('orders', %s)", (other,))
        assert (await cur.fetchone())[0] == [0, 0]  # type: ignore[index]
        await producer.commit()
        cur = await slicer.execute("SELECT qm.reconcile_partition('orders', %s)", (p,))
        assert (await cur.fetchone())[0] == [1, 1]  # type: ignore[index]
        # the operator's whole-queue form gives up too, naming the partition
        await _partition_of(producer, tenant)
        with pytest.raises(psycopg.errors.LockNotAvailable, match=f"partition {p} of queue"):
            await slicer.execute("SELECT qm.reconcile_load('orders')")
        await producer.commit()
        cur = await slicer.execute("SELECT qm.reconcile_load('orders')")
        assert (await cur.fetchone())[0][p] == 2  # type: ignore[index]
    loads, live = await _counts(shard.dsn)
    assert loads == live and live[p] == 2


async def test_a_producer_that_meets_a_slice_waits_for_its_count(shard: Shard, make_queue) -> None:  # type: ignore[no-untyped-def]
    """A slice counting a partition holds its enqueue lock exclusively: an insert into that
    partition (routed, or a bulk load's counter bump) waits until the slice ends, then goes on;
    inserts into the other partitions do not wait."""
    make_queue("orders", partitions=4, shuffle=1)
    tenants = tenants_of(shard, 12)
    async with (
        await psycopg.AsyncConnection.connect(shard.dsn, autocommit=True) as producer,
        await psycopg.AsyncConnection.connect(shard.dsn) as slice_,
    ):
        parts = {t: await _partition_of(producer, t) for t in tenants}
        tenant = tenants[0]
        p = parts[tenant]
        elsewhere = next(t for t in tenants if parts[t] != p)
        cur = await producer.execute("SELECT id FROM qm.queues WHERE name = 'orders'")
        qid = int((await cur.fetchone())[0])  # type: ignore[index]
        # what qm.reconcile_partition holds while it counts, left open
        await slice_.execute("SELECT pg_advisory_xact_lock(qm.lock_class('enqueue'), %s * 64 + %s %% 64)", (qid, p))
        await producer.execute("SET statement_timeout = '2s'")
        await producer.execute("INSERT INTO orders (tenant, payload) VALUES (%s, '{}')", (elsewhere,))
        for statement, args in (
            ("INSERT INTO orders (tenant, payload) VALUES (%s, '{}')", (tenant,)),
            ("SELECT qm.add_load('orders', ARRAY[%s], ARRAY[1])", (p,)),
        ):
            waiting = asyncio.create_task(producer.execute(statement, args))
            await asyncio.sleep(0.3)
            assert not waiting.done(), statement
            await slice_.rollback()
            await asyncio.wait_for(waiting, 2)
            await slice_.execute("SELECT pg_advisory_xact_lock(qm.lock_class('enqueue'), %s * 64 + %s %% 64)", (qid, p))
        await slice_.rollback()
    loads, live = await _counts(shard.dsn)
    assert live[p] == sum(1 for t in tenants if parts[t] == p) + 1
    assert loads[p] == live[p] + 1  # the bulk load's bump has no row


async def test_slices_beside_slow_committing_enqueues_leave_the_counters_exact(shard: Shard, make_queue) -> None:  # type: ignore[no-untyped-def]
    """Producers that wait 20 ms between their insert and its commit, and slices of every
    partition back to back: whatever each slice saw, the counters equal the live events after
    the last one (no slice after it repairs anything). Before revision 0013 nearly every round
    ended with a partition counted short."""
    make_queue("orders", partitions=4, shuffle=1)
    tenants = tenants_of(shard, 12)
    going = True
    outcomes = {"finished": 0, "aborted": 0}

    async def produce(j: int) -> None:
        rng = random.Random(j)
        async with await psycopg.AsyncConnection.connect(shard.dsn) as conn:
            while going:
                await conn.execute(
                    "INSERT INTO orders (tenant, payload) SELECT t, '{}' FROM unnest(%s::text[]) t",
                    (rng.sample(tenants, 3),),
                )
                await asyncio.sleep(0.02)
                await conn.commit()
                await asyncio.sleep(rng.random() * 0.01)

    async def reconcile() -> None:
        async with await psycopg.AsyncConnection.connect(shard.dsn, autocommit=True) as conn:
            while going:
                for p in range(4):
                    try:
                        await conn.execute("SELECT qm.reconcile_partition('orders', %s)", (p,))
                        outcomes["finished"] += 1
                    except psycopg.errors.LockNotAvailable:
                        outcomes["aborted"] += 1
                await asyncio.sleep(0)

    for _ in range(3):
        tasks = [asyncio.create_task(produce(j)) for j in range(3)] + [asyncio.create_task(reconcile())]
        await asyncio.sleep(2.0)
        going = False
        await asyncio.gather(*tasks)
        loads, live = await _counts(shard.dsn)
        assert loads == live, f"the counters drifted: loads {loads}, live events {live} ({outcomes})"
        going = True
    assert outcomes["finished"] >= 50 and outcomes["aborted"] >= 10, outcomes


async def test_an_insert_into_every_partition_of_a_wide_queue_holds_at_most_64_enqueue_locks(
    shard: Shard, make_queue
) -> None:  # type: ignore[no-untyped-def]
    """Advisory locks take room in the shared lock table: partitions share their enqueue lock by
    partition % 64, however wide the queue."""
    make_queue("orders", partitions=256, shuffle=16)
    tenants = tenants_of(shard, 400)
    held = (
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = qm.lock_class('enqueue') "
        "AND pid = pg_backend_pid()"
    )
    async with await psycopg.AsyncConnection.connect(shard.dsn) as conn:
        await conn.execute("INSERT INTO orders (tenant, payload) SELECT t, '{}' FROM unnest(%s::text[]) t", (tenants,))
        cur = await conn.execute("SELECT count(DISTINCT partition) FROM orders")
        assert int((await cur.fetchone())[0]) > 64  # type: ignore[index]
        cur = await conn.execute(held)
        assert int((await cur.fetchone())[0]) == 64  # type: ignore[index]
        await conn.rollback()
        await conn.execute(
            "SELECT qm.add_load('orders', (SELECT array_agg(p) FROM generate_series(0, 255) p), "
            "array_fill(1, ARRAY[256]))"
        )
        cur = await conn.execute(held)
        assert int((await cur.fetchone())[0]) == 64  # type: ignore[index]
        await conn.rollback()
