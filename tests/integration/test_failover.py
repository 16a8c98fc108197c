"""How soon a shard is led again, and its receivers on the new leader: a killed leader at the default
lease, a leader whose connections are cut, a pair paused past its lease. Real ``qm manager``
processes (they are killed and paused), the receivers library with its default back-off."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from queue_manager.domain.topology import Shard, Topology
from queue_manager.manager.config import ManagerConfig
from queue_manager.manager.leadership import DEAD_HOLDER_GRACE
from receivers import Backoff, Event, Receiver
from tests.conftest import tenants_of
from tests.integration.test_receiver_library import receiving
from tests.managerkit import insert, wait_for
from tests.processkit import ManagerProcess, write_config

pytestmark = pytest.mark.timeout(120)

#: the default lease (5 s): the point is how the defaults fail over
DEFAULT_TTL = float(ManagerConfig.default("lease_ttl"))


@contextlib.contextmanager
def managers(tmp_path: Path, shards: Topology, ttl: float, n: int = 2) -> Iterator[list[ManagerProcess]]:
    topo, tokens = write_config(tmp_path, shards)
    procs = [ManagerProcess(topo, tokens, "s0", ttl) for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


async def lease_row(dsn: str) -> tuple[int, str | None, float | None, bool]:
    """term, holder, acquired_at (epoch seconds), unexpired."""
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cur = await conn.execute(
            "SELECT term, holder, extract(epoch FROM acquired_at)::float8, expires_at > clock_timestamp() "
            "FROM qm.leader"
        )
        row = await cur.fetchone()
    assert row is not None
    return int(row[0]), row[1], row[2], bool(row[3])


async def leading(procs: list[ManagerProcess], dsn: str, timeout: float = 20.0) -> ManagerProcess:
    """The manager that holds the lease and answers /health/leader 200."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, holder, _, live = await lease_row(dsn)
        if live and holder:
            pid = int(holder.split(":")[1])
            for p in procs:
                if p.pid == pid and (await asyncio.to_thread(p.health, "/health/leader"))[0] == 200:
                    return p
        await asyncio.sleep(0.02)
    raise AssertionError(f"no manager led within {timeout} s")


async def moved_to(receiver: Receiver, url: str, timeout: float) -> float:
    """The wall-clock time the receiver's connection was first seen on ``url``."""
    await wait_for(lambda: receiver.leader("s0") == url, timeout, f"the receiver on {url}")
    return time.time()


@pytest.mark.parametrize("how", ["sigkill", "sigterm", "sigstop"])
async def test_at_the_default_lease_a_receiver_delivers_again_within_the_lease_after_its_leader_goes(  # type: ignore[no-untyped-def]
    shard: Shard, shards: Topology, make_queue, tmp_path: Path, how: str
) -> None:
    """Both managers at the default lease (5 s), the receiver library with its defaults; the leader
    is killed (SIGKILL), drained (SIGTERM) or frozen (SIGSTOP, its sockets left open). The must: an
    event committed at that moment is delivered within the lease + 1 s, and the receiver is on the
    new leader within 0.5 s of its takeover (1.5 s asserted, a margin for a loaded machine): the
    standby holds the receiver's probe and answers it as its session starts.

    - killed: its connections close with its process, so the standby takes over about
      DEAD_HOLDER_GRACE later, not a lease later. Before: the receiver's back-off had grown to
      3.6 s while it found nobody, and it reached the new leader 8.5 s after the kill;
    - drained: it releases the lease, and the standby takes it at its next poll (0.1 s);
    - frozen: its connections stay open, so the standby waits for the lease to expire."""
    make_queue("orders", partitions=2, shuffle=1, ack_timeout_seconds=2)
    tenants = tenants_of(shard, 4)
    handled: dict[int, float] = {}

    async def handle(event: Event) -> None:
        handled.setdefault(event.id, time.time())

    with managers(tmp_path, shards, DEFAULT_TTL) as procs:
        leader = await leading(procs, shard.dsn)
        [standby] = [p for p in procs if p is not leader]
        try:
            async with receiving({"s0": [p.url for p in procs]}, handle, backoff=Backoff, concurrency=4) as r:
                assert r.leader("s0") == leader.url
                before = await insert(shard.dsn, [(t, {}) for t in tenants])
                await wait_for(lambda: set(before) <= set(handled), 10, "the events before the fault")
                old_term, _, _, _ = await lease_row(shard.dsn)
                gone_at = time.time()
                os.kill(
                    leader.pid, {"sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM, "sigstop": signal.SIGSTOP}[how]
                )
                moved = asyncio.create_task(moved_to(r, standby.url, DEFAULT_TTL + 5))
                [during] = await insert(shard.dsn, [(tenants[0], {"at": how})])
                await wait_for(lambda: during in handled, DEFAULT_TTL + 5, "the event committed at the fault")
                subscribed_at = await moved
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(leader.pid, signal.SIGCONT)
        term, holder, acquired_at, _ = await lease_row(shard.dsn)
    assert term == old_term + 1 and holder is not None and int(holder.split(":")[1]) == standby.pid
    assert acquired_at is not None
    took_over = acquired_at - gone_at
    delivered = handled[during] - gone_at
    found = subscribed_at - acquired_at
    timings = (
        f"takeover {took_over:.2f} s and delivery {delivered:.2f} s after the {how}, "
        f"on the new leader {found:.2f} s after the takeover"
    )
    assert delivered <= DEFAULT_TTL + 1.0, timings
    assert found <= 1.5, timings
    if how == "sigkill":  # long before the lease would have run out: the holder was seen gone
        assert took_over <= DEAD_HOLDER_GRACE + 1.5, timings
    elif how == "sigterm":  # released after the drain: the next poll takes it
        assert took_over <= 2.0, timings


async def test_a_leader_whose_connections_are_all_cut_keeps_the_shard(  # type: ignore[no-untyped-def]
    shard: Shard, shards: Topology, make_queue, tmp_path: Path
) -> None:
    """Every backend of the leader is terminated (an operator, a pooler restart): it is alive, sees
    its session fail, reconnects and renews well within DEAD_HOLDER_GRACE, so the standby, which
    saw it without a connection for a moment, does not take over."""
    make_queue("orders", partitions=2, shuffle=1, ack_timeout_seconds=2)
    tenants = tenants_of(shard, 2)
    with managers(tmp_path, shards, DEFAULT_TTL) as procs:
        leader = await leading(procs, shard.dsn)
        [standby] = [p for p in procs if p is not leader]
        term, holder, _, _ = await lease_row(shard.dsn)
        async with await psycopg.AsyncConnection.connect(shard.dsn, autocommit=True) as conn:
            cur = await conn.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE application_name LIKE 'qm-manager-%% ' || %s",
                (holder,),
            )
            assert (await cur.fetchone())[0] >= 4  # type: ignore[index]
        cut_at = time.monotonic()
        await wait_for(lambda: leader.health("/health/leader")[0] != 200, 5, "the leader to notice")
        again = await leading(procs, shard.dsn)
        back_after = time.monotonic() - cut_at
        # a little longer than the grace: a takeover would have happened by now
        await asyncio.sleep(DEAD_HOLDER_GRACE)
        assert again is leader, f"the standby took over; the leader was back after {back_after:.2f} s"
        assert (await lease_row(shard.dsn))[0] == term
        assert standby.health("/health/leader")[0] == 503
        # and it dispatches again
        async with receiving({"s0": [p.url for p in procs]}, lambda e: None, backoff=Backoff) as r:
            assert r.leader("s0") == leader.url
            await insert(shard.dsn, [(t, {}) for t in tenants])
            await wait_for(lambda: r.stats.acked == len(tenants), 10, "the events after the cut")


async def test_a_pair_paused_past_its_lease_is_led_again_as_soon_as_it_wakes(  # type: ignore[no-untyped-def]
    shard: Shard, shards: Topology, make_queue, tmp_path: Path
) -> None:
    """Both managers of the shard are stopped (SIGSTOP) for longer than the lease (2 s), then
    continued. The leader no longer trusts its lease and checks its term with a renewal (given
    time to answer); whichever of the two wins, a manager leads again at once. Before: the
    renewal was given no time, was abandoned after it had been sent, and extended the lease in
    the database for a manager that had stepped down: nobody led for another 2.2-2.5 s (the fault
    suite's manager-pause-both, 6.17 s against its 6 s bound)."""
    make_queue("orders", partitions=2, shuffle=1)
    ttl = 2.0
    with managers(tmp_path, shards, ttl) as procs:
        await leading(procs, shard.dsn)
        for _ in range(2):
            for p in procs:
                os.kill(p.pid, signal.SIGSTOP)
            await asyncio.sleep(ttl + 1.0)  # the nemesis's hold: both frozen past the lease
            woke = time.monotonic()
            for p in procs:
                os.kill(p.pid, signal.SIGCONT)
            await leading(procs, shard.dsn, timeout=10)
            led_after = time.monotonic() - woke
            assert led_after <= 1.0, f"nobody led for {led_after:.2f} s after the pair woke"
