"""Per-tenant caps and weights, and the per-tenant metrics, with a real manager, PostgreSQL and
websockets (queue_manager/manager/fairness.py; docs/design.md, "Fair dispatch")."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from typing import Any

import psycopg
import pytest

from queue_manager import admin
from queue_manager.domain.routing import shuffle_set
from queue_manager.domain.topology import Shard, Topology
from receivers.testing import Delivery as Event
from tests.conftest import tenants_of
from tests.managerkit import (
    insert,
    leading_manager,
    rescanned,
    running_receiver,
    url,
    wait_for,
)

pytestmark = pytest.mark.timeout(120)


def disjoint(shard: Shard, n: int, k: int, count: int = 2) -> list[str]:
    """``count`` tenants of the shard whose shuffle sets share no partition."""
    out: list[str] = []
    used: set[int] = set()
    for t in tenants_of(shard, 400):
        s = set(shuffle_set(t, n, k))
        if not s & used:
            out.append(t)
            used |= s
            if len(out) == count:
                return out
    raise AssertionError("no disjoint tenants")


class Gate:
    """A handler that holds some tenants' events until opened and records how many of each it held at once."""

    def __init__(self, *tenants: str) -> None:
        self.tenants = set(tenants)
        self.open = asyncio.Event()
        self.events: list[Event] = []
        self.holding: dict[str, int] = {t: 0 for t in tenants}
        self.most: dict[str, int] = {t: 0 for t in tenants}

    async def __call__(self, event: Event) -> None:
        self.events.append(event)
        t = event.tenant
        if t not in self.tenants:
            return
        self.holding[t] += 1
        self.most[t] = max(self.most[t], self.holding[t])
        try:
            await self.open.wait()
        finally:
            self.holding[t] -= 1

    def ids(self) -> list[int]:
        return [e.id for e in self.events]

    def of(self, tenant: str) -> list[int]:
        return [e.id for e in self.events if e.tenant == tenant]


@pytest.mark.parametrize("path", ["direct", "cached"])
async def test_a_tenant_at_its_cap_gets_no_more_fires_until_an_ack_and_others_keep_flowing(
    shards: Topology, shard: Shard, make_queue: Any, path: str
) -> None:
    make_queue("orders", partitions=4, shuffle=2, tenant_max_in_flight=3)
    capped, default, free = tenants_of(shard, 3)
    admin.set_tenant(shards, "orders", capped, {"max_in_flight": 2})
    # the receiver holds the events of two tenants until the gate opens: one capped by its own
    # override (2), one by the queue's default (3); a third tenant's events are acked at once
    gate = Gate(capped, default)
    # a tenant filter sends every event through the window cache (the cached path)
    tenants = [capped, default, free] if path == "cached" else None
    async with leading_manager(shard.dsn) as m:
        async with running_receiver(url(m), recorder=gate, credit=50, tenants=tenants) as (receiver, _):
            held = await insert(shard.dsn, [(capped, {"n": i}) for i in range(10)])
            held += await insert(shard.dsn, [(default, {"n": i}) for i in range(6)])
            flowing = await insert(shard.dsn, [(free, {"n": i}) for i in range(5)])
            await wait_for(lambda: set(flowing) <= set(gate.ids()), what="the uncapped tenant's events")
            await wait_for(lambda: receiver.stats.acked >= 5, what="their acks")
            await rescanned(m)  # the dispatcher has looked at every partition since
            await rescanned(m)
            assert len(gate.of(capped)) == 2, "the tenant got more than its own cap"
            assert len(gate.of(default)) == 3, "the tenant got more than the queue's default cap"
            assert m.queues["orders"].ledger.by_tenant() == {capped: 2, default: 3}
            more = await insert(shard.dsn, [(free, {"late": True})])
            await wait_for(lambda: set(more) <= set(gate.ids()), what="an uncapped event committed later")
            # acks free the slots: the capped tenants' events flow, never more than their caps at once
            gate.open.set()
            await wait_for(lambda: set(held) <= set(gate.ids()), what="the capped tenants' events")
            await wait_for(lambda: receiver.stats.acked >= 22, what="every ack")
    assert gate.most == {capped: 2, default: 3}


async def test_weights_share_fires_one_to_three_under_saturation(
    shards: Topology, shard: Shard, make_queue: Any
) -> None:
    make_queue("orders", partitions=8, shuffle=2)
    light, heavy = disjoint(shard, 8, 2)
    admin.set_tenant(shards, "orders", heavy, {"weight": 3})
    await insert(shard.dsn, [(t, {"n": i}) for i in range(300) for t in (light, heavy)])
    async with leading_manager(shard.dsn) as m:
        # credit 4: the receiver is the bottleneck, so every batch is small and both tenants stay backlogged
        async with running_receiver(url(m), credit=4) as (_, rec):
            await wait_for(lambda: len(rec.events) >= 200, what="200 events")
            first = [e.tenant for e in rec.events[:200]]
    ratio = first.count(heavy) / max(1, first.count(light))
    assert 2.4 <= ratio <= 3.6, (first.count(heavy), first.count(light))


async def test_per_tenant_dwell_and_the_over_fair_share_gauge_are_published(shard: Shard, make_queue: Any) -> None:
    make_queue("orders", partitions=4, shuffle=2)
    noisy, q1, q2 = tenants_of(shard, 3)
    async with leading_manager(shard.dsn) as m:
        async with running_receiver(url(m), mode="hold", credit=50) as (_, rec):
            await insert(shard.dsn, [(noisy, {"n": i}) for i in range(10)] + [(q1, {}), (q2, {})])
            await wait_for(lambda: len(rec.events) == 12, what="12 events in hand")
            base = f"http://127.0.0.1:{m.port}"
            text = await asyncio.to_thread(lambda: urllib.request.urlopen(base + "/metrics", timeout=5).read().decode())
    # 10 of 12 in flight: over twice its share (4); the quiet ones are not
    assert 'qm_tenants_over_fair_share{queue="orders"} 1' in text
    for tenant in (noisy, q1, q2):
        for quantile in ("0.5", "0.99"):
            line = re.search(
                rf'^qm_tenant_dwell_seconds\{{quantile="{quantile}",queue="orders",tenant="{tenant}"\}} (\S+)$',
                text,
                re.M,
            )
            assert line is not None and 0 <= float(line.group(1)) < 30, (tenant, quantile)
    assert f'qm_tenant_dwell_events{{queue="orders",tenant="{noisy}"}} 10' in text
    assert 'tenant="other"' not in text  # 3 tenants: all among the top 10


def _plan_nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    nodes = [plan]
    for child in plan.get("Plans", []):
        nodes += _plan_nodes(child)
    return nodes


def test_the_fair_pick_walks_the_due_index_in_order_and_fires_by_primary_key(shard: Shard, make_queue: Any) -> None:
    """As mgr_fire_due (test_manager.py): no bitmap scan and sort of every due row of a partition's
    level, no sequential scan of the table, with or without floors, capped tenants and key limits."""
    from queue_manager.manager import store
    from queue_manager.producer import Event, enqueue_batch

    make_queue("orders", partitions=4, shuffle=2)
    tenants = tenants_of(shard, 50)
    with psycopg.connect(shard.dsn) as c:
        enqueue_batch(c, "orders", [Event(tenants[i % 50], {"n": i}) for i in range(20_000)])
        c.commit()
        c.execute("ANALYZE orders")
        for setting, value in store.PLANNER_SETTINGS.items():
            c.execute(f"SET {setting} = {value}")
        row = c.execute("SELECT extract(epoch FROM min(fire_at))::float8 + 0.001 FROM orders").fetchone()
        assert row is not None
        low = row[0]
        stmt = store.queue_sql("mgr_fire_due_fair", "orders").as_string(c)
        base = {
            "term": 1,
            "start": 0,
            "partitions": 4,
            "levels": 5,
            "quota": 250,
            "window": 250,
            "candidates": 1000,
            "limit": 500,
            "counts": "{2,2,1,4,5}",
            "ties": "{1,2,3,4,0}",
            "ack_timeout": 30.0,
            "queue_id": 1,
            "capped": [],
            "tenants": [tenants[1]],
            "ahead": "{0.5}",
            "weights": "{3}",
            "rooms": "{NULL}",
            "default_room": None,
            "cblocked": [],
            "ckeys": [tenants[2] + "\x1fk"],
            "crooms": "{2}",
            "cdefault": 3,
            "rblocked": [tenants[3] + "\x1fr"],
            "rkeys": [],
            "rrooms": "{}",
            "rdefault": 1,
        }
        floors_at = "{" + ",".join(str(low) if i % 5 == 2 else "NULL" for i in range(20)) + "}"
        for floors, capped in (("{}", []), (floors_at, tenants[:3])):
            args = {**base, "floors": floors, "capped": capped, "window": 250 + (32 if capped else 0)}
            plan = c.execute("EXPLAIN (FORMAT JSON) " + stmt, args).fetchone()[0][0]["Plan"]  # type: ignore[index]
            nodes = _plan_nodes(plan)
            scans = [(n["Node Type"], n.get("Index Name")) for n in nodes if n.get("Relation Name") == "orders"]
            assert ("Seq Scan", None) not in scans, scans
            assert ("Index Scan", "orders_due") in scans, scans
            assert ("Index Scan", "orders_pkey") in scans, scans
            assert not [n for n in nodes if n["Node Type"] == "Bitmap Heap Scan"], scans
            # a sort of the candidates (at most 1 000 rows) ranks them; none below the due index's scan
            due = next(n for n in nodes if n.get("Index Name") == "orders_due")
            assert not [n for n in _plan_nodes(due) if n["Node Type"] == "Sort"]


async def test_a_partition_with_nothing_due_at_the_last_pick_goes_before_the_backlogged_ones(
    shard: Shard, make_queue: Any
) -> None:
    """mgr_fire_due with ``since``: an event that arrived after the previous pick (its partition
    had nothing due then) is fired first, whatever the round-robin cursor; without ``since``, or
    once its partition is backlogged too, the cursor's order holds. A stream given a larger cap
    (its level's backlog sits in few partitions) fills the batch."""
    from queue_manager.manager import store

    make_queue("orders", partitions=4, shuffle=1)
    noisy = next(t for t in tenants_of(shard, 400) if list(shuffle_set(t, 4, 1)) == [0])
    quiet = next(t for t in tenants_of(shard, 400) if list(shuffle_set(t, 4, 1)) == [2])
    with psycopg.connect(shard.dsn, autocommit=True) as c:
        c.execute(
            "INSERT INTO orders (tenant, payload, fire_at) "
            "SELECT %s, '{}', now() - interval '10 s' - g * interval '1 ms' FROM generate_series(1, 20) g",
            (noisy,),
        )
        c.execute("INSERT INTO orders (tenant, payload) VALUES (%s, '{}')", (quiet,))
        row = c.execute("SELECT extract(epoch FROM now() - interval '1 s')::float8").fetchone()
        assert row is not None
        since = row[0]
    async with await store.connect(shard.dsn, "test") as conn:
        term = await store.acquire(conn, "test-holder", 30.0)
        assert term is not None
        settings = {q.name: q for q in await store.load_queues(conn)}["orders"]
        # the cursor at the backlog's partition: round-robin alone gives it the turn
        rows, _, _ = await store.fire_due(conn, settings, term, 0, 1)
        assert [r[1] for r in rows] == [noisy]
        rows, _, _ = await store.fire_due(conn, settings, term, 0, 1, since=since)
        assert [r[1] for r in rows] == [quiet]
        # nothing sparse left: the backlog again, in fire_at order, its quota of 2
        rows, _, _ = await store.fire_due(conn, settings, term, 0, 8, since=since)
        assert [r[1] for r in rows] == [noisy, noisy]
        # its partition is the only one with events: the next pick may read it further (its cap,
        # priority.next_caps), and the batch goes to it
        rows, _, _ = await store.fire_due(conn, settings, term, 0, 8, since=since, caps={(0, 3): 8})
        assert [r[1] for r in rows] == [noisy] * 8
    with psycopg.connect(shard.dsn) as c:
        # the earliest of the backlog went first (FIFO within the partition)
        row = c.execute(
            "SELECT max(fire_at) < (SELECT min(fire_at) FROM orders WHERE state = 'to_be_fired') FROM orders "
            "WHERE state = 'fired' AND tenant = %s",
            (noisy,),
        ).fetchone()
        assert row == (True,)
