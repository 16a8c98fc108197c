"""The producers' load counters: load(p) = enqueue counter - done counter, both sequences.

They only steer inserts, so they are approximate by design and take no lock. The contract
(docs/design.md, "Shuffle sharding"): with no reconciliation, enqueues and acks keep them exact once
everything has committed; after a reconciliation slice a partition is off by at most what was in
flight during the slice, plus what rolled back since; and once nothing is in flight, one slice per
partition makes every counter exact. Nothing waits for a slice, and a slice waits for nothing.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest

from queue_manager.domain.topology import Shard
from receivers.testing import Delivery as Event
from tests.conftest import tenants_of
from tests.managerkit import Recorder, leading_manager, running_receiver, url, wait_for

pytestmark = pytest.mark.timeout(120)

PRODUCERS = 4
EVENTS_EACH = 150


async def test_load_counters_stay_exact_under_concurrent_enqueue_and_acks(shard: Shard, make_queue) -> None:  # type: ignore[no-untyped-def]
    """No reconciliation runs here (no baseline pass, no idle slices): the counters must be right by
    themselves once every event is settled."""
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
    async with leading_manager(shard.dsn, reconcile_interval=3600.0, idle_slices=False) as m:
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
# reconciliation beside enqueues and acks that are not committed yet


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


async def _queue_id(conn: psycopg.AsyncConnection[Any]) -> int:
    cur = await conn.execute("SELECT id FROM qm.queues WHERE name = 'orders'")
    return int((await cur.fetchone())[0])  # type: ignore[index]


async def test_a_slice_beside_an_uncommitted_enqueue_does_not_wait_and_is_off_by_that_enqueue_only(
    shard: Shard, make_queue
) -> None:  # type: ignore[no-untyped-def]
    """The enqueue counter moves at the insert, the row is seen at the commit: a slice between the
    two takes the event for done. It does not wait for the producer; once the insert commits the
    load is one too low, the one enqueue in flight during the slice, and the next slice makes it
    exact. The operator's whole-queue form does not wait either."""
    make_queue("orders", partitions=4, shuffle=1)
    tenant = tenants_of(shard, 1)[0]
    async with (
        await psycopg.AsyncConnection.connect(shard.dsn) as producer,
        await psycopg.AsyncConnection.connect(shard.dsn, autocommit=True) as slicer,
    ):
        await slicer.execute("SET statement_timeout = '2s'")
        p = await _partition_of(producer, tenant)  # in an open transaction
        cur = await slicer.execute("SELECT qm.reconcile_partition('orders', %s)", (p,))
        assert (await cur.fetchone())[0] == [1, 0]  # type: ignore[index]
        cur = await slicer.execute("SELECT qm.reconcile_load('orders')")
        assert (await cur.fetchone())[0] == [0, 0, 0, 0]  # type: ignore[index]
        await producer.commit()
        loads, live = await _counts(shard.dsn)
        assert live[p] == 1 and loads[p] == 0, (loads, live)  # off by the enqueue in flight
        cur = await slicer.execute("SELECT qm.reconcile_partition('orders', %s)", (p,))
        assert (await cur.fetchone())[0] == [0, 1]  # type: ignore[index]
    loads, live = await _counts(shard.dsn)
    assert loads == live and live[p] == 1


async def test_nothing_waits_for_a_slice_and_a_slice_holds_no_lock(shard: Shard, make_queue) -> None:  # type: ignore[no-untyped-def]
    """A slice's transaction left open after its count holds no advisory lock; a routed insert into
    its partition, a bulk load's counter bump and an ack's done count go on at once."""
    make_queue("orders", partitions=4, shuffle=1)
    tenant = tenants_of(shard, 1)[0]
    async with (
        await psycopg.AsyncConnection.connect(shard.dsn, autocommit=True) as producer,
        await psycopg.AsyncConnection.connect(shard.dsn) as slice_,
    ):
        p = await _partition_of(producer, tenant)
        qid = await _queue_id(producer)
        await slice_.execute("SELECT qm.reconcile_partition('orders', %s)", (p,))  # left open
        cur = await slice_.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
        )
        assert (await cur.fetchone())[0] == 0  # type: ignore[index]
        await producer.execute("SET statement_timeout = '1s'")
        for statement, args in (
            ("INSERT INTO orders (tenant, payload) VALUES (%s, '{}')", (tenant,)),
            ("SELECT qm.add_load('orders', ARRAY[%s], ARRAY[1])", (p,)),
            ("SELECT qm.add_done(%s, ARRAY[%s]::smallint[])", (qid, p)),
        ):
            started = time.monotonic()
            await producer.execute(statement, args)
            assert time.monotonic() - started < 0.5, statement
        await slice_.rollback()
    loads, live = await _counts(shard.dsn)
    assert live[p] == 2 and loads[p] == 2  # the bulk bump without a row, the done count without an ack


@dataclass
class _InFlight:
    """What the test's producers and ackers have under way, per partition: the figures the bound of
    docs/design.md is made of. Every figure is an upper bound (an op counts from before its
    statement is sent until its commit or rollback has returned)."""

    partitions: int
    #: ops (rows enqueued, events acked) started and not yet committed or rolled back
    open: list[int] = field(default_factory=list)
    #: ops started so far
    started: list[int] = field(default_factory=list)
    #: ops whose counter moved and whose transaction rolled back, so far
    rolled_back: list[int] = field(default_factory=list)
    #: per partition, for its last slice: (open at its start, started at its start, started at its
    #: end, rolled back at its start)
    last_slice: dict[int, tuple[int, int, int, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.open = [0] * self.partitions
        self.started = [0] * self.partitions
        self.rolled_back = [0] * self.partitions

    def start(self, p: int, n: int) -> None:
        self.open[p] += n
        self.started[p] += n

    def end(self, p: int, n: int, rolled_back: bool) -> None:
        self.open[p] -= n
        if rolled_back:
            self.rolled_back[p] += n

    def bound(self, p: int) -> int:
        """In flight during p's last slice, plus rolled back since it began."""
        open0, started0, started1, rolled0 = self.last_slice[p]
        return open0 + (started1 - started0) + (self.rolled_back[p] - rolled0)


async def test_slices_beside_enqueues_and_acks_keep_the_documented_bound_and_a_quiet_pass_is_exact(
    shard: Shard, make_queue
) -> None:  # type: ignore[no-untyped-def]
    """Producers that wait 20 ms between their insert and its commit (one in five rolls back), ackers
    that count their events done in the ack statement and commit 10 ms later (one in six rolls
    back), and slices of every partition back to back. When everyone has stopped, each partition's
    load is off its live events by at most what was in flight during its last slice plus what rolled
    back since; then one slice per partition, nothing in flight, makes every load exact."""
    partitions = 4
    make_queue("orders", partitions=partitions, shuffle=1)
    tenants = tenants_of(shard, 12)
    async with await psycopg.AsyncConnection.connect(shard.dsn, autocommit=True) as conn:
        part = {t: await _partition_of(conn, t) for t in tenants}
        qid = await _queue_id(conn)
        await conn.execute("SELECT qm.reconcile_load('orders')")
    going = True
    flight = _InFlight(partitions)
    slices = 0
    worst: list[tuple[int, int, int]] = []  # (drift, bound, partition) at the end of each round

    async def produce(j: int) -> None:
        rng = random.Random(j)
        async with await psycopg.AsyncConnection.connect(shard.dsn) as conn:
            while going:
                batch = rng.sample(tenants, 3)
                for t in batch:
                    flight.start(part[t], 1)
                await conn.execute(
                    "INSERT INTO orders (tenant, payload) SELECT t, '{}' FROM unnest(%s::text[]) t", (batch,)
                )
                await asyncio.sleep(0.02)
                undo = rng.random() < 0.2
                await (conn.rollback() if undo else conn.commit())
                for t in batch:
                    flight.end(part[t], 1, undo)
                await asyncio.sleep(rng.random() * 0.01)

    async def ack(j: int) -> None:
        rng = random.Random(100 + j)
        async with await psycopg.AsyncConnection.connect(shard.dsn, options="-c qm.role=manager") as conn:
            while going:
                p = rng.randrange(partitions)
                flight.start(p, 3)
                cur = await conn.execute(
                    "WITH done AS (UPDATE orders SET state = 'acked', acked_at = now() WHERE id IN ("
                    "  SELECT id FROM orders WHERE partition = %s AND state = 'to_be_fired' ORDER BY id LIMIT 3"
                    "  FOR UPDATE SKIP LOCKED) RETURNING partition) "
                    "SELECT count(*), qm.add_done(%s, coalesce(array_agg(partition), '{}')::smallint[])::text "
                    "FROM done",
                    (p, qid),
                )
                n = int((await cur.fetchone())[0])  # type: ignore[index]
                await asyncio.sleep(0.01)
                undo = rng.random() < 1 / 6
                await (conn.rollback() if undo else conn.commit())
                flight.end(p, 3, False)
                if undo:
                    flight.rolled_back[p] += n  # the events it counted done
                await asyncio.sleep(rng.random() * 0.01)

    async def reconcile() -> None:
        nonlocal slices
        async with await psycopg.AsyncConnection.connect(shard.dsn, autocommit=True) as conn:
            while going:
                for p in range(partitions):
                    marks = (flight.open[p], flight.started[p], flight.rolled_back[p])
                    await conn.execute("SELECT qm.reconcile_partition('orders', %s)", (p,))
                    flight.last_slice[p] = (marks[0], marks[1], flight.started[p], marks[2])
                    slices += 1
                await asyncio.sleep(0)

    for _ in range(3):
        tasks = [asyncio.create_task(produce(j)) for j in range(3)]
        tasks += [asyncio.create_task(ack(j)) for j in range(2)] + [asyncio.create_task(reconcile())]
        await asyncio.sleep(2.0)
        going = False
        await asyncio.gather(*tasks)
        assert flight.open == [0] * partitions
        loads, live = await _counts(shard.dsn)
        for p in range(partitions):
            drift, bound = abs(loads[p] - live[p]), flight.bound(p)
            worst.append((drift, bound, p))
            assert drift <= bound, f"partition {p}: load {loads[p]}, live {live[p]}, bound {bound}"
        going = True
    assert slices >= 50 and sum(flight.rolled_back) >= 20, (slices, flight.rolled_back)
    # quiet: one slice per partition makes every counter exact
    async with await psycopg.AsyncConnection.connect(shard.dsn, autocommit=True) as conn:
        for p in range(partitions):
            await conn.execute("SELECT qm.reconcile_partition('orders', %s)", (p,))
    loads, live = await _counts(shard.dsn)
    assert loads == live, f"a quiet reconciliation left {loads} for {live} live events (drift, bound: {worst})"


async def test_an_insert_into_every_partition_of_a_wide_queue_holds_no_counter_lock(shard: Shard, make_queue) -> None:  # type: ignore[no-untyped-def]
    """The routed insert and a bulk load's counter bump hold no advisory lock for the counters (the
    statement trigger's try of the wake-up lock is all an insert without a dedup key may hold)."""
    make_queue("orders", partitions=256, shuffle=16)
    tenants = tenants_of(shard, 400)
    held = (
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid <> qm.lock_class('wake') "
        "AND pid = pg_backend_pid()"
    )
    async with await psycopg.AsyncConnection.connect(shard.dsn) as conn:
        await conn.execute("INSERT INTO orders (tenant, payload) SELECT t, '{}' FROM unnest(%s::text[]) t", (tenants,))
        cur = await conn.execute("SELECT count(DISTINCT partition) FROM orders")
        assert int((await cur.fetchone())[0]) > 64  # type: ignore[index]
        cur = await conn.execute(held)
        assert int((await cur.fetchone())[0]) == 0  # type: ignore[index]
        await conn.rollback()
        await conn.execute(
            "SELECT qm.add_load('orders', (SELECT array_agg(p) FROM generate_series(0, 255) p), "
            "array_fill(1, ARRAY[256]))"
        )
        cur = await conn.execute(held)
        assert int((await cur.fetchone())[0]) == 0  # type: ignore[index]
        await conn.rollback()
