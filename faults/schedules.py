"""The periodic schedules of the ``schedules`` scenario: added on the shards before the rounds,
removed before the drain, and their slot events read back into the history (the checker then
holds them to every check, and to one more: each slot of each schedule's grid enqueued once).

A slot event's payload names its schedule, not a key of its own: the key the checker follows is
its dedup key (``qm:schedule:<id>:<slot>``), which the receivers cannot see. So the harness reads
every slot event's (shard, id) and dedup key after the run into ``enqueued`` records, and
:func:`relabel` gives the receivers' records of those events that key.
"""

from __future__ import annotations

from collections.abc import Iterable

import psycopg

from faults.cluster import QUEUE, Deployment, plain_tenants
from faults.history import Record

#: seconds between slots
INTERVAL = 1.0


async def add(dep: Deployment, count: int) -> None:
    """``count`` schedules of INTERVAL seconds, spread over the shards, each for a tenant every
    receiver takes; they skip missed slots, so any slot missing from the grid is a fault."""
    shards = list(dep.topology.shards)
    for i in range(count):
        shard = shards[i % len(shards)]
        tenant = plain_tenants(str(shard.key_range))[i // len(shards)]
        async with await psycopg.AsyncConnection.connect(shard.dsn, autocommit=True) as conn:
            cur = await conn.execute(
                "SELECT (qm.schedule_add(%s, %s, %s, %s::jsonb, interval_seconds => %s, misfire => 'skip')).id",
                (f"sched-{i}", QUEUE, tenant, f'{{"schedule": "sched-{i}"}}', INTERVAL),
            )
            row = await cur.fetchone()
            assert row is not None
        dep.history.write("schedule", schedule_id=str(row[0]), shard=shard.name, tenant=tenant, interval_s=INTERVAL)


async def remove(dep: Deployment) -> None:
    """Remove every schedule (their slots not yet due go with them), so that the run can drain."""
    for shard in dep.topology.shards:
        async with await psycopg.AsyncConnection.connect(shard.dsn, autocommit=True) as conn:
            await conn.execute("SELECT qm.schedule_remove(name) FROM qm.schedules")


async def record_slots(dep: Deployment) -> None:
    """Write an ``enqueued`` record for every slot event on the shards (committed at its row's
    creation, due at its slot's instant), with its row's id."""
    for shard in dep.topology.shards:
        async with await psycopg.AsyncConnection.connect(shard.dsn) as conn:
            cur = await conn.execute(
                f"SELECT id, tenant, dedup_key, extract(epoch FROM created_at)::float8"
                f" FROM {QUEUE} WHERE dedup_key LIKE 'qm:schedule:%%'"
            )
            for ident, tenant, key, created in await cur.fetchall():
                # due at its slot, which its key names (a nack since may have moved the row's fire_at)
                fire_at = int(key.rsplit(":", 1)[1]) / 1_000_000
                dep.history.write(
                    "enqueued", t=created, k=key, shard=shard.name, tenant=tenant, fire_at=fire_at, outcome="commit",
                    op="schedule", id=int(ident),
                )  # fmt: skip


def relabel(records: Iterable[Record]) -> list[Record]:
    """The records of the receivers (deliveries, acks, nacks) of slot events under their slot's key
    (from the slot events' ``enqueued`` records: shard and id)."""
    records = list(records)
    keys = {(str(r["shard"]), int(r["id"])): str(r["k"]) for r in records if r.get("op") == "schedule"}
    out: list[Record] = []
    for r in records:
        key = keys.get((str(r.get("shard")), int(r["id"]))) if r.get("id") is not None else None
        out.append({**r, "k": key} if key is not None else r)
    return out


def final_key_sql() -> str:
    """The key of every row in the final read: a slot event's is its dedup key."""
    return "coalesce(payload->>'k', CASE WHEN dedup_key LIKE 'qm:schedule:%%' THEN dedup_key END)"
