"""Scheduled fires in rounds, with maintenance slices due and a standby reading the lease: no fire is
held back (issue 36, "Scheduled events, once in a while, fire 200 ms late"). The figures (p99 and
max over many rounds, on a server with the default durability) are ``make bench-fire``'s; this test
holds a generous bound on every fire, so that a stall of a fifth of a second cannot pass."""

from __future__ import annotations

import json
import random

import psycopg
import pytest

from queue_manager.domain.topology import Shard
from tests.conftest import tenants_of
from tests.managerkit import leading_manager, running_manager, running_receiver, url, wait_for

pytestmark = pytest.mark.timeout(120)

ROUNDS = 6
EVENTS = 60
TXNS = 5
AHEAD = (0.2, 1.2)
#: no fire may be later than this (the stall was 200 ms; a quiet run's max is a few ms)
BOUND = 0.150
#: an event received before its fire_at by more than this counts as early (the readings' rounding)
EARLY = 0.002


async def insert_scheduled(dsn: str, rows: list[tuple[str, float]]) -> list[int]:
    """(tenant, seconds ahead) rows in one transaction; their ids."""
    ids = []
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        for tenant, ahead in rows:
            cur = await conn.execute(
                "INSERT INTO orders (tenant, payload, fire_at) "
                "VALUES (%s, %s, clock_timestamp() + make_interval(secs => %s)) RETURNING id",
                (tenant, json.dumps({"ahead": ahead}), ahead),
            )
            row = await cur.fetchone()
            assert row is not None
            ids.append(int(row[0]))
    return ids


async def test_scheduled_fires_in_rounds_beside_maintenance_and_a_standby_are_never_held_back(  # type: ignore[no-untyped-def]
    shard: Shard, make_queue
) -> None:
    """ROUNDS rounds of EVENTS events TXNS transactions apart, each 0.2 to 1.2 s ahead; acked events
    kept 1 s, so the retention slices (idle ones and the baseline pass, every 0.2 s) delete the
    rounds before while these fall due, beside the reconciliation's pass, the collector and the
    health reading; a standby reads the lease all along. Every event is received within BOUND of
    its fire_at, none before it."""
    make_queue("orders", partitions=8, shuffle=2, retention_seconds=1)
    tenants = tenants_of(shard, 16)
    rng = random.Random(36)
    async with leading_manager(shard.dsn) as leader:
        async with running_manager(shard.dsn) as standby, running_receiver(url(leader), credit=1000) as (_, rec):
            await standby.signals.lease_tried.wait_for(lambda term: term is None)
            ids: list[int] = []
            for _ in range(ROUNDS):
                for _txn in range(TXNS):
                    rows = [(rng.choice(tenants), rng.uniform(*AHEAD)) for _ in range(EVENTS // TXNS)]
                    ids.extend(await insert_scheduled(shard.dsn, rows))
                await wait_for(lambda: set(ids) <= set(rec.ids()), 10, "the round's events")
            assert standby.role == "standby"
            purged = sum(m.metrics.purged.get(queue="orders", state="acked") for m in (leader, standby))
    late = sorted((t - e.fire_at, e.id) for e, t in zip(rec.events, rec.received_at, strict=True) if e.attempt == 1)
    assert len(late) == ROUNDS * EVENTS
    assert late[0][0] >= -EARLY, f"event {late[0][1]} received {-late[0][0] * 1000:.1f} ms before its fire_at"
    worst = late[-5:]
    assert late[-1][0] <= BOUND, f"the latest receipts (s, id): {worst}"
    # the maintenance was due indeed: the rounds before were being purged meanwhile
    assert purged > 0
