"""The producers' load counters stay exact under concurrent enqueues, socket acks and SQL acks.

load(p) = enqueue counter - done counter, both sequences. No reconciliation runs here (no floor, no idle slices): the
counters must be right by themselves once every event is settled.
"""

from __future__ import annotations

import asyncio
import json
import random

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
