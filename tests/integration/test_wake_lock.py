"""The database times the manager's wake-lock statements report bound what producers do after them
(queue_manager/manager/floors.py, HolderWatch: a pick never starts above the reading before the
latest, so a reading's time must not follow anything it did not see)."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg

from queue_manager.domain.topology import Shard
from queue_manager.manager import store


async def _lock_time(prod: psycopg.AsyncConnection[Any], qid: int) -> float:
    """A producer's statement that takes the wake lock in shared mode, as the verify trigger does
    (blocking here, so that it takes it the instant it is free); the database time it got it."""
    async with prod.transaction():
        await prod.execute("SELECT pg_advisory_xact_lock_shared(qm.lock_class('wake'), %s)", (qid,))
        cur = await prod.execute("SELECT extract(epoch FROM clock_timestamp())::double precision")
        row = await cur.fetchone()
        assert row is not None
        return float(row[0])


async def _waits(conn: psycopg.AsyncConnection[Any], pid: int) -> bool:
    cur = await conn.execute("SELECT count(*) FROM pg_locks WHERE pid = %s AND NOT granted", (pid,))
    row = await cur.fetchone()
    return row is not None and row[0] > 0


async def test_the_release_time_of_a_wake_lock_precedes_every_producer_that_takes_it_after(
    shard: Shard, make_queue: Any
) -> None:
    """The dispatcher stamped a release with its estimate of the database clock once the answer
    was back: on a loaded machine that ran tens of ms past the release, so the rows of a producer
    that took the lock and committed before the first holder reading lay below every pick's start
    until the safety lookback found them (18 to 30 s in the fault suite). The release now reports
    the database's time before it; the manager's link is slowed here by holding the answer."""
    make_queue("orders", partitions=2, shuffle=1)
    async with (
        await psycopg.AsyncConnection.connect(shard.dsn, autocommit=True) as mgr,
        await psycopg.AsyncConnection.connect(shard.dsn, autocommit=True) as prod,
    ):
        row = await (await mgr.execute("SELECT id FROM qm.queues WHERE name = 'orders'")).fetchone()
        assert row is not None
        qid = int(row[0])
        for _ in range(3):
            assert await store.arm(mgr, [qid]) == {qid}
            producer = asyncio.create_task(_lock_time(prod, qid))
            for _ in range(200):
                if await _waits(mgr, prod.info.backend_pid):
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("the producer never waited for the wake lock")
            released_at = await store.disarm(mgr, qid)
            took_at = await asyncio.wait_for(producer, 5)
            assert released_at <= took_at, (released_at, took_at)
