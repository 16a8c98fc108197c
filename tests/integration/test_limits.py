"""A queue's max_qps and max_concurrency across shards, and pause/resume, with real managers.

Rates are measured from the databases' ``fired_at`` (both shards live on one PostgreSQL server
here, so one clock). These tests run in real time, a few seconds each, at rates low enough for a
busy machine; the full-rate figures are ``make bench-ratelimit``'s (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest

from queue_manager import admin
from queue_manager.domain.topology import Shard, Topology
from queue_manager.manager import Manager
from receivers.testing import Delivery as Event
from tests.conftest import tenants_of
from tests.managerkit import Recorder, leading_manager, running_manager, running_receiver, url, wait_for, wait_leader
from tests.processkit import ManagerProcess, write_config

pytestmark = pytest.mark.timeout(180)

#: how long a silent peer's slice lives (the managers' rate_lease_ttl here)
LEASE = 0.6


async def backlog(shard: Shard, n: int, queue: str = "orders", fire_in: float | None = None) -> None:
    """``n`` events of the shard's tenants, committed at once (due now, or in ``fire_in`` s)."""
    tenants = tenants_of(shard, 20)
    fire_at = "now()" if fire_in is None else f"now() + make_interval(secs => {fire_in})"
    async with await psycopg.AsyncConnection.connect(shard.dsn, autocommit=True) as conn:
        await conn.execute(
            f"INSERT INTO {queue} (tenant, payload, fire_at) "
            f"SELECT (%s::text[])[g %% 20 + 1], '{{}}', {fire_at} FROM generate_series(1, %s) g",
            (tenants, n),
        )


async def fire_times(dsns: Sequence[str], queue: str = "orders") -> list[float]:
    """Every fire's database time (epoch seconds), of all shards, in order."""
    out: list[float] = []
    for dsn in dsns:
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            cur = await conn.execute(
                f"SELECT extract(epoch FROM fired_at)::float8 FROM {queue} WHERE fired_at IS NOT NULL"
            )
            out += [float(r[0]) for r in await cur.fetchall()]
    return sorted(out)


async def db_time(dsn: str) -> float:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        row = await (await conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8")).fetchone()
    assert row is not None
    return float(row[0])


def burst(rate: float) -> float:
    """The documented depth of a manager's bucket: 40 ms of its rate, at least one event
    (design.md, "The bucket"); written out here so that a deeper bucket fails these tests."""
    return max(1.0, 0.04 * rate)


def most_in_window(times: Sequence[float], width: float) -> int:
    """The most events in any window [t, t + width) that starts at an event."""
    best, j = 0, 0
    for i, t in enumerate(times):
        while j < len(times) and times[j] < t + width:
            j += 1
        best = max(best, j - i)
    return best


def count_between(times: Sequence[float], start: float, end: float) -> int:
    return sum(1 for t in times if start <= t < end)


class Gate(Recorder):
    """Records each event and holds it until ``release`` is set (then acks)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def __call__(self, event: Event) -> None:
        await super().__call__(event)
        await self.release.wait()


def shares(m: Manager, queue: str = "orders") -> dict[str, Any]:
    return {k: v for k, v in m.health()["queues"].get(queue, {}).items() if k.endswith("_share")}


# --------------------------------------------------------------------------------------- one shard


async def test_one_shard_fires_a_backlog_at_the_queues_max_qps(shard: Shard, make_queue) -> None:  # type: ignore[no-untyped-def]
    """No topology: the manager takes the whole limit, through both fire paths (a backlog due
    now, and scheduled events due later), never faster in any second, never early."""
    make_queue("orders", partitions=4, shuffle=2, max_qps=40)
    await backlog(shard, 120)
    await backlog(shard, 60, fire_in=1.0)
    async with leading_manager(shard.dsn) as m:
        async with running_receiver(url(m), credit=500) as (receiver, rec):
            await wait_for(lambda: len(rec.events) >= 180, timeout=30, what="the backlog at 40/s")
            # leaving sooner closes the receiver before its last acks are out: those events go back
            # to the queue with a back-off fire_at after their fired_at, which reads as an early fire
            await wait_for(lambda: receiver.stats.acked >= 180, what="acks")
    times = await fire_times([shard.dsn])
    assert len(times) == 180
    span = times[-1] - times[0]
    assert 179 / span == pytest.approx(40, rel=0.1)  # the rate it was given, not less
    assert most_in_window(times, 1.0) <= 40 + burst(40) + 1
    async with await psycopg.AsyncConnection.connect(shard.dsn) as conn:
        cur = await conn.execute("SELECT count(*) FROM orders WHERE fired_at < fire_at")
        assert (await cur.fetchone()) == (0,)


# ------------------------------------------------------------------------------------- two shards


async def test_two_shards_share_the_limit_and_a_stopped_one_gives_its_share_back(
    shards: Topology,
    make_queue,  # type: ignore[no-untyped-def]
) -> None:
    """Backlogs on both shards: together they fire at max_qps, about half each, in no second
    above it. The one that stops (as on SIGTERM: it drains, then gives its slices back) leaves
    the whole limit to the other at once (sooner than its rows would expire)."""
    s0, s1 = shards.shards
    limit = 60.0
    make_queue("orders", partitions=4, shuffle=2, max_qps=limit)
    await backlog(s0, 600)
    await backlog(s1, 600)
    cfg = {"topology": shards, "rate_lease_ttl": LEASE}
    async with (
        running_manager(s0.dsn, shard="s0", **cfg) as m0,
        running_receiver(url(m0), credit=500) as (_, rec0),
    ):
        await wait_leader(m0)
        async with leading_manager(s1.dsn, shard="s1", **cfg) as m1, running_receiver(url(m1), credit=500):
            await wait_for(lambda: 0 < shares(m1).get("qps_share", 0) < limit, timeout=10, what="s1 takes a share")
            start = await db_time(s0.dsn)
            await asyncio.sleep(4.0)
            end = await db_time(s0.dsn)
        stopped = await db_time(s0.dsn)  # m1 drained and resigned
        await wait_for(lambda: shares(m0).get("qps_share") == limit, timeout=LEASE + 1, what="s0 takes it all")
        took_all = await db_time(s0.dsn)
        await asyncio.sleep(2.0)
        after = await db_time(s0.dsn)
        assert len(rec0.events) < 600  # s0's backlog lasted
    times0, times1 = await fire_times([s0.dsn]), await fire_times([s1.dsn])
    both = sorted(times0 + times1)
    together = count_between(both, start, end) / (end - start)
    assert together == pytest.approx(limit, rel=0.1)
    assert count_between(times1, start, end) / (end - start) == pytest.approx(limit / 2, rel=0.25)
    # no second above the limit, whatever the hand-over did (two buckets: two bursts at most)
    assert most_in_window(both, 1.0) <= limit + 2 * burst(limit) + 1
    # a draining manager wants nothing: its share went back sooner than its rows would expire
    assert took_all - stopped < LEASE * 0.75
    async with await psycopg.AsyncConnection.connect(s0.dsn) as conn:
        cur = await conn.execute("SELECT resigned FROM qm.rate_leases WHERE queue = 'orders' AND shard = 's1'")
        assert await cur.fetchone() == (True,)  # and its session gave its slices back when it ended
    assert count_between(times0, took_all, after) / (after - took_all) == pytest.approx(limit, rel=0.1)


async def test_a_manager_beside_a_silent_shard_waits_a_lease_before_it_fires(shards: Topology, make_queue) -> None:  # type: ignore[no-untyped-def]
    """The other shard's database is up but has no manager yet: one may be starting that has not
    seen us. Ours fires only once its rows have been in that database for a whole lease."""
    s0, _ = shards.shards
    make_queue("orders", partitions=2, shuffle=1, max_qps=100)
    await backlog(s0, 20)
    async with running_manager(s0.dsn, shard="s0", topology=shards, rate_lease_ttl=LEASE) as m:
        async with running_receiver(url(m), credit=100) as (_, rec):
            await wait_for(lambda: len(rec.events) >= 20, timeout=10, what="the events")
    async with await psycopg.AsyncConnection.connect(s0.dsn) as conn:
        cur = await conn.execute(
            "SELECT extract(epoch FROM (SELECT min(fired_at) FROM orders) - acquired_at)::float8 FROM qm.leader"
        )
        row = await cur.fetchone()
    assert row is not None and row[0] >= LEASE


@pytest.fixture
def topology_files(tmp_path: Path, shards: Topology) -> tuple[Path, Path]:
    return write_config(tmp_path, shards)


async def test_a_killed_managers_share_is_taken_by_its_peer_and_shared_again_after_a_restart(
    shards: Topology,
    make_queue,  # type: ignore[no-untyped-def]
    topology_files: tuple[Path, Path],
) -> None:
    """Real manager processes. After a kill -9 of one (its slices cannot be given back), the other
    takes the whole limit within LEASE + 1 s; the restarted one takes its share again, and no
    second goes above the limit at any point."""
    s0, s1 = shards.shards
    limit = 60.0
    make_queue("orders", partitions=4, shuffle=2, max_qps=limit, ack_timeout_seconds=2)
    await backlog(s0, 1500)
    await backlog(s1, 1500)
    topo, tokens = topology_files
    ttl = ("--rate-lease-ttl", str(LEASE))
    p0 = ManagerProcess(topo, tokens, "s0", 2.0, *ttl)
    p1 = ManagerProcess(topo, tokens, "s1", 2.0, *ttl)
    p1b: ManagerProcess | None = None

    def share(p: ManagerProcess) -> float:
        status, body = p.health()
        return float(body["queues"].get("orders", {}).get("qps_share", 0.0)) if status == 200 else -1.0

    try:
        async with running_receiver(p0.url, credit=500), running_receiver(p1.url, credit=500) as (r1, _):
            await wait_for(lambda: 0 < share(p1) < limit and 0 < share(p0) < limit, 15, "both take a share")
            await asyncio.sleep(2.0)
            os.kill(p1.pid, signal.SIGKILL)
            killed = await db_time(s0.dsn)
            p1.proc.wait()
            r1.stop()
            await wait_for(lambda: share(p0) == limit, timeout=LEASE + 1.0, what="s0 takes the whole limit")
            took_all = await db_time(s0.dsn)
            await asyncio.sleep(2.0)
            p1b = ManagerProcess(topo, tokens, "s1", 2.0, *ttl)
            async with running_receiver(p1b.url, credit=500):
                # the new manager leads once the killed one's leadership lease (2 s) ran out
                await wait_for(lambda: 0 < share(p1b) < limit, timeout=10, what="the restarted manager's share")
                back = await db_time(s1.dsn)
                await asyncio.sleep(2.0)
                end = await db_time(s1.dsn)
    finally:
        for p in (p0, p1, p1b):
            if p is not None:
                p.stop()
    times0, times1 = await fire_times([s0.dsn]), await fire_times([s1.dsn])
    both = sorted(times0 + times1)
    assert most_in_window(both, 1.0) <= limit + 2 * burst(limit) + 1
    assert took_all - killed < LEASE + 1.0
    assert count_between(times0, took_all + 0.2, took_all + 2.0) / 1.8 == pytest.approx(limit, rel=0.1)
    assert count_between(times1, back, end) > 0.25 * limit * (end - back)  # shared again
    assert count_between(both, back, end) / (end - back) == pytest.approx(limit, rel=0.15)


async def test_max_concurrency_holds_across_shards(shards: Topology, make_queue) -> None:  # type: ignore[no-untyped-def]
    """Receivers that never ack: the events in flight on both shards together stay within
    max_concurrency, and reach it."""
    s0, s1 = shards.shards
    make_queue("orders", partitions=4, shuffle=2, max_concurrency=6)
    await backlog(s0, 50)
    await backlog(s1, 50)
    seen: list[int] = []

    async def in_flight() -> int:
        total = 0
        for dsn in (s0.dsn, s1.dsn):  # counts only grow here (nothing is acked), so this never overcounts
            async with await psycopg.AsyncConnection.connect(dsn) as conn:
                row = await (await conn.execute("SELECT count(*) FROM orders WHERE state = 'fired'")).fetchone()
                total += int(row[0])  # type: ignore[index]
        return total

    cfg = {"topology": shards, "rate_lease_ttl": LEASE}
    async with (
        running_manager(s0.dsn, shard="s0", **cfg) as m0,
        running_manager(s1.dsn, shard="s1", **cfg) as m1,
        running_receiver(url(m0), credit=100, mode="hold"),
        running_receiver(url(m1), credit=100, mode="hold"),
    ):
        await wait_leader(m0)
        await wait_leader(m1)
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline:
            seen.append(await in_flight())
            await asyncio.sleep(0.02)
        assert m0.queues["orders"].in_flight > 0 and m1.queues["orders"].in_flight > 0
    assert max(seen) == 6


# ----------------------------------------------------------------------------------- pause, resume


async def test_pause_stops_fires_at_once_acks_still_work_and_resume_picks_up(
    shards: Topology,
    shard: Shard,
    make_queue,  # type: ignore[no-untyped-def]
) -> None:
    """The periodic reload is 30 s away: the manager hears of the pause by NOTIFY. No fire starts
    after the pause commits; events in hand are acked meanwhile; resume delivers the rest."""
    make_queue("orders", partitions=4, shuffle=2, max_qps=50)
    await backlog(shard, 200)
    gate = Gate()  # events stay in hand until the test lets them go
    async with leading_manager(shard.dsn, rescan_interval=30.0) as m:
        async with running_receiver(url(m), credit=20, recorder=gate) as (receiver, rec):
            await wait_for(lambda: len(rec.events) >= 20, timeout=10, what="20 events in hand")
            m.signals.reloaded.clear()
            await asyncio.to_thread(admin.alter_queue, shards, "orders", {"paused": True})
            paused_at = await db_time(shard.dsn)
            await m.signals.reloaded.wait(timeout=1.0)  # well under the 30 s periodic reload
            reloaded_in = await db_time(shard.dsn) - paused_at
            in_hand = m.queues["orders"].in_flight
            gate.release.set()  # the receiver acks what it holds, and its credit comes back
            await wait_for(lambda: receiver.stats.acked >= len(rec.events), timeout=10, what="acks while paused")
            acked_while_paused = receiver.stats.acked
            delivered = len(rec.events)
            await asyncio.sleep(1.0)
            assert len(rec.events) == delivered  # free credit, a due backlog: nothing while paused
            await asyncio.to_thread(admin.alter_queue, shards, "orders", {"paused": False})
            await wait_for(lambda: len(rec.events) >= 200, timeout=15, what="the rest after resume")
    times = await fire_times([shard.dsn])
    assert not [t for t in times if paused_at < t < paused_at + 1.0]
    assert reloaded_in < 0.5
    assert in_hand > 0 and acked_while_paused >= in_hand
    async with await psycopg.AsyncConnection.connect(shard.dsn) as conn:
        row = await (
            await conn.execute("SELECT count(*) FILTER (WHERE state = 'acked'), count(*) FROM orders")
        ).fetchone()
    assert row == (200, 200)
    assert len(set(rec.ids())) == 200  # each once


async def test_after_a_pause_scheduled_events_fire_no_earlier_and_no_faster(
    shards: Topology,
    shard: Shard,
    make_queue,  # type: ignore[no-untyped-def]
) -> None:
    """Events due during a pause fire at resume, at or after their fire_at, and at the queue's
    rate: the pause earned no credit to catch up with."""
    limit = 30.0
    make_queue("orders", partitions=4, shuffle=2, max_qps=limit)
    async with leading_manager(shard.dsn, rescan_interval=30.0) as m:
        async with running_receiver(url(m), credit=500) as (receiver, rec):
            await backlog(shard, 15)  # the queue's bucket runs before the pause
            await wait_for(lambda: len(rec.events) >= 15, timeout=10, what="the first events")
            await asyncio.to_thread(admin.alter_queue, shards, "orders", {"paused": True})
            await backlog(shard, 60, fire_in=0.5)  # cached by the window scan, due while paused
            await asyncio.sleep(2.0)
            assert len(rec.events) == 15
            resumed = await db_time(shard.dsn)
            await asyncio.to_thread(admin.alter_queue, shards, "orders", {"paused": False})
            await wait_for(lambda: len(rec.events) >= 75, timeout=15, what="the events after resume")
            await wait_for(lambda: receiver.stats.acked >= 75, what="acks")  # none left to go back
    times = await fire_times([shard.dsn])
    after = [t for t in times if t >= resumed]
    assert len(after) == 60  # none fired while paused
    assert most_in_window(after, 1.0) <= limit + burst(limit) + 1  # two paused seconds earned nothing
    async with await psycopg.AsyncConnection.connect(shard.dsn) as conn:
        cur = await conn.execute("SELECT count(*) FROM orders WHERE fired_at < fire_at")
        assert (await cur.fetchone()) == (0,)


async def test_the_fire_statements_fire_nothing_of_a_paused_queue(shards: Topology, shard: Shard, make_queue) -> None:  # type: ignore[no-untyped-def]
    """Whatever the manager believes: a fire statement that starts after the pause commits fires
    nothing (both paths), and fires again after the resume."""
    from queue_manager.manager import store

    make_queue("orders", partitions=2, shuffle=1)
    await backlog(shard, 10)
    async with await store.connect(shard.dsn, "test") as conn:
        term = await store.acquire(conn, "test-holder", 30.0)
        assert term is not None
        settings = {q.name: q for q in await store.load_queues(conn)}["orders"]
        ids = [int(r[0]) for r in await (await conn.execute("SELECT id FROM orders ORDER BY id")).fetchall()]
        await asyncio.to_thread(admin.alter_queue, shards, "orders", {"paused": True})
        assert await store.fire(conn, settings, term, ids[:5]) == []
        assert (await store.fire_due(conn, settings, term, 0, 10))[0] == []
        await asyncio.to_thread(admin.alter_queue, shards, "orders", {"paused": False})
        assert len(await store.fire(conn, settings, term, ids[:5])) == 5
        assert len((await store.fire_due(conn, settings, term, 0, 10))[0]) == 5


async def test_tenant_overrides_and_every_setting_reach_the_manager_at_once(
    shards: Topology,
    shard: Shard,
    make_queue,  # type: ignore[no-untyped-def]
) -> None:
    """The periodic reload is 30 s away: a tenant override (qm.tenant_settings) and a setting added
    after the settings notices (tenant_max_in_flight) still reach the manager within half a second;
    the counters' bookkeeping sends nothing."""
    make_queue("orders", partitions=4, shuffle=2)
    async with leading_manager(shard.dsn, rescan_interval=30.0) as m:
        q = m.queues["orders"]
        for change in (
            lambda: admin.set_tenant(shards, "orders", "acme", {"weight": 3}),
            lambda: admin.alter_queue(shards, "orders", {"tenant_max_in_flight": 7}),
            lambda: admin.unset_tenant(shards, "orders", "acme"),
        ):
            m.signals.reloaded.clear()
            await asyncio.to_thread(change)
            await m.signals.reloaded.wait(timeout=0.5)
        assert q.policy.weight("acme") == 1.0 and q.settings.tenant_max_in_flight == 7
        m.signals.reloaded.clear()
        await backlog(shard, 5)  # enqueue counters move (sequences): no settings notice
        with pytest.raises(AssertionError, match="no signal"):
            await m.signals.reloaded.wait(timeout=0.3)
