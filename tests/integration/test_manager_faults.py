"""Manager faults: kill -9 of the active manager under load, a shard that becomes unreachable."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from websockets.exceptions import ConnectionClosed

from queue_manager.domain.topology import Shard, Topology
from tests.conftest import tenants_of
from tests.faultkit import TcpProxy
from tests.managerkit import (
    leading_manager,
    running_receiver,
    subscribed,
    url,
    wait_for,
    wait_leader,
)
from tests.processkit import ManagerProcess, lease, write_config

pytestmark = pytest.mark.timeout(180)

LEASE_TTL = 2.0
#: the receiver's credit in the kill -9 test
CREDIT = 50


@pytest.fixture
def manager_procs(tmp_path: Path, shards: Topology) -> Iterator[list[ManagerProcess]]:
    topo, tokens = write_config(tmp_path, shards)
    procs = [ManagerProcess(topo, tokens, "s0", LEASE_TTL), ManagerProcess(topo, tokens, "s0", LEASE_TTL)]
    yield procs
    for p in procs:
        p.stop()


async def test_kill_9_of_the_active_manager_under_load_loses_nothing(
    shard: Shard,
    make_queue,
    manager_procs: list[ManagerProcess],  # type: ignore[no-untyped-def]
) -> None:
    make_queue(
        "orders", partitions=8, shuffle=2, ack_timeout_seconds=2, backoff_min_seconds=0.1, backoff_max_seconds=0.5
    )
    tenants = tenants_of(shard, 50)
    deadline = asyncio.get_running_loop().time() + 15
    leader = None
    while leader is None and asyncio.get_running_loop().time() < deadline:
        _, leader = await lease(shard.dsn)
        await asyncio.sleep(0.05)
    active = next(p for p in manager_procs if p.proc.pid == leader)
    committed: list[int] = []

    async def produce(n: int) -> None:
        async with await psycopg.AsyncConnection.connect(shard.dsn, autocommit=True) as conn:
            for i in range(n):
                cur = await conn.execute(
                    "INSERT INTO orders (tenant, payload) VALUES (%s, %s) RETURNING id",
                    (tenants[i % 50], f'{{"i": {i}}}'),
                )
                committed.append(int((await cur.fetchone())[0]))  # type: ignore[index]
                await asyncio.sleep(0.004)

    async with running_receiver([p.url for p in manager_procs], credit=CREDIT) as (_, rec):
        producer = asyncio.create_task(produce(800))
        await wait_for(lambda: len(rec.events) >= 200, timeout=30, what="deliveries before the kill")
        async with await psycopg.AsyncConnection.connect(shard.dsn) as conn:
            killed_at = (await (await conn.execute("SELECT clock_timestamp()")).fetchone())[0]  # type: ignore[index]
        os.kill(active.proc.pid, signal.SIGKILL)
        active.proc.wait()
        await producer
        await wait_for(lambda: set(committed) <= set(rec.ids()), timeout=60, what="every committed event delivered")
        async with await psycopg.AsyncConnection.connect(shard.dsn) as conn:

            async def all_acked() -> bool:
                cur = await conn.execute("SELECT count(*) FILTER (WHERE state = 'acked'), count(*) FROM orders")
                acked, total = await cur.fetchone()  # type: ignore[misc]
                await conn.commit()
                return bool(acked == total == len(committed))

            for _ in range(600):
                if await all_acked():
                    break
                await asyncio.sleep(0.05)
            assert await all_acked(), "some committed events were never acked"
            cur = await conn.execute("SELECT term, holder, acquired_at FROM qm.leader")
            term, holder, acquired_at = await cur.fetchone()  # type: ignore[misc]
    survivor = next(p for p in manager_procs if p is not active)
    assert int(holder.split(":")[1]) == survivor.proc.pid
    assert term >= 2
    takeover = (acquired_at - killed_at).total_seconds()
    assert takeover <= LEASE_TTL + 1.0, f"the standby took over {takeover:.2f}s after the kill"
    # only events in hand at the kill come again: those being handled (at most the credit) and
    # those whose acks had not committed (at most the credit more: ReceiverSession.free)
    duplicates = len(rec.events) - len(set(rec.ids()))
    assert duplicates <= 2 * CREDIT, f"{duplicates} duplicate deliveries after one kill, with credit {CREDIT}"


async def test_unreachable_shard_stops_dispatch_and_recovery_resumes_it(shard: Shard, make_queue) -> None:  # type: ignore[no-untyped-def]
    make_queue("orders", partitions=4, shuffle=2)
    tenants = tenants_of(shard, 20)
    proxy = TcpProxy.for_dsn(shard.dsn)
    await proxy.start()
    try:
        async with leading_manager(proxy.proxied(shard.dsn)) as m:
            async with running_receiver(url(m)) as (receiver, rec):
                async with await psycopg.AsyncConnection.connect(shard.dsn, autocommit=True) as conn:
                    for t in tenants[:10]:
                        await conn.execute("INSERT INTO orders (tenant, payload) VALUES (%s, '{}')", (t,))
                    await wait_for(lambda: receiver.stats.acked == 10, what="acks before the cut")
                    proxy.cut()
                    await wait_for(lambda: m.role != "leader", timeout=10, what="dispatch to stop")
                    for t in tenants[10:]:
                        await conn.execute("INSERT INTO orders (tenant, payload) VALUES (%s, '{}')", (t,))
                    await asyncio.sleep(LEASE_TTL + 1.0)
                    assert len(rec.events) == 10, "events were delivered while the shard was unreachable"
                    proxy.restore()
                    await wait_for(lambda: m.role == "leader", timeout=15, what="leadership after recovery")
                    await wait_for(lambda: len(set(rec.ids())) == 20, timeout=15, what="dispatch after recovery")
                    await wait_for(lambda: receiver.stats.acked >= 20, timeout=15, what="acks after recovery")
                    cur = await conn.execute("SELECT count(*) FROM orders WHERE state = 'acked'")
                    assert await cur.fetchone() == (20,)
    finally:
        await proxy.close()


async def test_a_leader_whose_database_link_goes_silent_closes_its_receivers_within_the_lease(  # type: ignore[no-untyped-def]
    shard: Shard, make_queue
) -> None:
    """A partition that drops packets instead of connections (the fault suite's db-link-partition):
    the leader's renewal would wait for TCP to give up, and its receivers would stay on a manager
    that no longer leads while a standby takes the shard. The renewal gets no longer than the trust
    left, so the leader steps down and closes its receivers (4001) within the lease TTL."""
    make_queue("orders", partitions=2, shuffle=1)
    proxy = TcpProxy.for_dsn(shard.dsn)
    await proxy.start()
    try:
        async with leading_manager(proxy.proxied(shard.dsn)) as m:
            async with subscribed(m, "orders", credit=10) as ws:
                stalled_at = time.monotonic()
                proxy.stall()
                with pytest.raises(ConnectionClosed) as closed:
                    while True:
                        await asyncio.wait_for(ws.recv(), LEASE_TTL + 1.5)
                took = time.monotonic() - stalled_at
                assert closed.value.rcvd is not None and closed.value.rcvd.code == 4001, closed.value
                assert took <= LEASE_TTL + 1.0, f"receivers closed {took:.2f} s after the link went silent"
                assert m.role != "leader"
            proxy.restore()
            await wait_leader(m, timeout=15)
    finally:
        await proxy.close()


async def test_read_only_shard_stops_dispatch_and_writable_again_resumes(shard: Shard, make_queue) -> None:  # type: ignore[no-untyped-def]
    make_queue("orders", partitions=4, shuffle=2)
    tenants = tenants_of(shard, 10)
    dbname = psycopg.conninfo.conninfo_to_dict(shard.dsn)["dbname"]

    async def set_read_only(on: bool) -> None:
        async with await psycopg.AsyncConnection.connect(shard.dsn, autocommit=True) as conn:
            await conn.execute("SET default_transaction_read_only = off")
            verb = "SET default_transaction_read_only = on" if on else "RESET default_transaction_read_only"
            await conn.execute(f'ALTER DATABASE "{dbname}" {verb}')
            # existing sessions keep their setting: drop the manager's, as a failover would
            await conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND application_name LIKE 'qm-manager%%'"
            )

    async with leading_manager(shard.dsn) as m:
        async with running_receiver(url(m)) as (receiver, rec):
            async with await psycopg.AsyncConnection.connect(shard.dsn, autocommit=True) as conn:
                for t in tenants[:5]:
                    await conn.execute("INSERT INTO orders (tenant, payload) VALUES (%s, '{}')", (t,))
                await wait_for(lambda: receiver.stats.acked == 5, what="acks while writable")
                await set_read_only(True)
                await wait_for(lambda: m.role != "leader", timeout=10, what="dispatch to stop")
                for t in tenants[5:]:
                    await conn.execute("INSERT INTO orders (tenant, payload) VALUES (%s, '{}')", (t,))
                await asyncio.sleep(1.0)
                assert m.role != "leader"
                assert len(rec.events) == 5, "events were fired while the shard was read-only"
                await set_read_only(False)
                await wait_for(lambda: len(set(rec.ids())) == 10, timeout=20, what="dispatch once writable")
                await wait_for(lambda: receiver.stats.acked >= 10, timeout=10, what="acks once writable")


async def test_collector_pages_past_rows_it_cannot_lock(shard: Shard, make_queue) -> None:  # type: ignore[no-untyped-def]
    make_queue(
        "orders", partitions=4, shuffle=2, ack_timeout_seconds=0.5, backoff_min_seconds=0.05, backoff_max_seconds=0.1
    )
    tenants = tenants_of(shard, 6)
    async with leading_manager(shard.dsn) as m:
        async with running_receiver(url(m), mode="hold") as (holder, held):
            async with await psycopg.AsyncConnection.connect(shard.dsn, autocommit=True) as conn:
                for t in tenants:
                    await conn.execute("INSERT INTO orders (tenant, payload) VALUES (%s, '{}')", (t,))
            await wait_for(lambda: len(held.events) == 6, what="first deliveries")
            locked_id = held.events[0].id
            # an application transaction holds one fired row: the collector must skip it, not stall
            async with await psycopg.AsyncConnection.connect(shard.dsn) as app:
                await app.execute("SELECT 1 FROM orders WHERE id = %s FOR UPDATE", (locked_id,))
                await wait_for(lambda: len(held.events) >= 11, timeout=10, what="re-fires of the unlocked rows")
                refired = {e.id for e in held.events[6:]}
                assert locked_id not in refired and len(refired) == 5
                await app.rollback()
            await wait_for(lambda: locked_id in {e.id for e in held.events[6:]}, timeout=10, what="the released row")
            holder.stop()


async def test_a_statement_waiting_on_an_application_lock_does_not_cost_the_lease(shard: Shard, make_queue) -> None:  # type: ignore[no-untyped-def]
    make_queue("orders", partitions=4, shuffle=2)
    tenants = tenants_of(shard, 3)
    async with leading_manager(shard.dsn) as m:
        term = m.term
        async with running_receiver(url(m), mode="hold") as (holder, held):
            async with await psycopg.AsyncConnection.connect(shard.dsn, autocommit=True) as conn:
                for t in tenants:
                    await conn.execute("INSERT INTO orders (tenant, payload) VALUES (%s, '{}')", (t,))
            await wait_for(lambda: len(held.events) == 3, what="deliveries")
            async with await psycopg.AsyncConnection.connect(shard.dsn) as app:
                await app.execute("SELECT 1 FROM orders WHERE id = %s FOR UPDATE", (held.events[0].id,))
                holder.stop()  # the manager's release of the held events now waits on the app's row lock
                await asyncio.sleep(LEASE_TTL * 2)
                assert (m.role, m.term) == ("leader", term), "the manager lost its lease behind a row lock"
                # and it still trusts its lease: new events keep firing while the lock is held
                async with running_receiver(url(m), mode="hold") as (_, fresh):
                    async with await psycopg.AsyncConnection.connect(shard.dsn, autocommit=True) as conn:
                        await conn.execute("INSERT INTO orders (tenant, payload) VALUES (%s, '{}')", (tenants[0],))
                    await wait_for(lambda: len(fresh.events) >= 1, timeout=3, what="a fire behind the row lock")
                await app.rollback()
        async with running_receiver(url(m)) as (_, rec):
            try:
                await wait_for(lambda: len(set(rec.ids())) == 4, timeout=10, what="re-fired events")
            except AssertionError:
                async with await psycopg.AsyncConnection.connect(shard.dsn) as conn:
                    cur = await conn.execute(
                        "SELECT id, state, attempts, fire_at - now(), ack_deadline - now() FROM orders"
                    )
                    raise AssertionError(f"{await cur.fetchall()} {rec.ids()} {m.health()}") from None
        assert m.term == term
