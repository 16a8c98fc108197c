"""The receiver library (receivers.Receiver, receivers.sql, qm receive) against real managers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest

from queue_manager.domain.topology import Shard
from receivers import Backoff, Event, Receiver, Retry
from tests.conftest import tenants_of
from tests.managerkit import SECRET_ALL, insert, rescanned, running_manager, url, wait_for, wait_leader

pytestmark = pytest.mark.timeout(120)


def fast_backoff() -> Backoff:
    return Backoff(initial=0.05, maximum=0.5)


@contextlib.asynccontextmanager
async def receiving(urls: Any, handler: Any, queue: str = "orders", **kwargs: Any) -> AsyncIterator[Receiver]:
    """A Receiver running in this loop; stopped (drained) on exit."""
    kwargs.setdefault("token", SECRET_ALL)
    kwargs.setdefault("backoff", fast_backoff)
    kwargs.setdefault("drain_timeout", 5.0)
    receiver = Receiver(urls, queue, handler, **kwargs)
    task = asyncio.create_task(receiver.run())
    try:
        await receiver.wait_subscribed(10)
        yield receiver
    finally:
        receiver.stop()
        async with asyncio.timeout(15):
            await task


async def rows(dsn: str, queue: str = "orders") -> dict[int, tuple[str, int, str | None]]:
    """id -> (state, attempts, last_error)."""
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cur = await conn.execute(f"SELECT id, state::text, attempts, last_error FROM {queue}")
        return {int(r[0]): (str(r[1]), int(r[2]), r[3]) for r in await cur.fetchall()}


async def test_a_receiver_acks_what_its_handler_returns(shard: Shard, make_queue) -> None:  # type: ignore[no-untyped-def]
    make_queue("orders", partitions=4, shuffle=2)
    tenants = tenants_of(shard, 4)
    seen: list[Event] = []

    async def handle(event: Event) -> None:
        seen.append(event)

    async with running_manager(shard.dsn) as m:
        await wait_leader(m)
        async with receiving({"s0": [url(m)]}, handle, concurrency=3) as r:
            ids = await insert(shard.dsn, [(tenants[i % 4], {"i": i}) for i in range(20)])
            await wait_for(lambda: r.stats.acked == 20, what="20 acks")
            assert sorted(e.id for e in seen) == sorted(ids)
            assert all(e.shard == "s0" and e.attempt == 1 for e in seen)
        assert {v[:2] for v in (await rows(shard.dsn)).values()} == {("acked", 1)}


async def test_credit_follows_free_handler_slots(shard: Shard, make_queue) -> None:  # type: ignore[no-untyped-def]
    """With 3 slots and 10 due events, 3 handlers run and the manager holds back the rest: no
    event is delivered for a busy slot; when one handler returns, exactly one more arrives."""
    make_queue("orders", partitions=4, shuffle=2)
    tenants = tenants_of(shard, 4)
    release: dict[int, asyncio.Event] = {}
    started: list[int] = []
    free_run = False

    async def handle(event: Event) -> None:
        started.append(event.id)
        release[event.id] = asyncio.Event()
        if not free_run:
            await release[event.id].wait()

    async def fired() -> int:
        async with await psycopg.AsyncConnection.connect(shard.dsn) as conn:
            cur = await conn.execute("SELECT count(*) FROM orders WHERE state = 'fired'")
            return int((await cur.fetchone())[0])  # type: ignore[index]

    async with running_manager(shard.dsn) as m:
        await wait_leader(m)
        async with receiving(url(m), handle, concurrency=3) as r:
            await insert(shard.dsn, [(tenants[i % 4], {"i": i}) for i in range(10)])
            await wait_for(lambda: len(started) == 3, what="3 handlers running")
            await rescanned(m)  # whatever was due, the dispatcher has seen it
            assert await fired() == 3 and r.stats.delivered == 3 and r.credit("default") == 3
            release[started[0]].set()
            await wait_for(lambda: r.stats.acked == 1, what="the first ack")
            await wait_for(lambda: len(started) == 4, what="a fourth delivery")
            await wait_for(lambda: r.credit("default") == 3, what="the credit back to 3")
            await rescanned(m)
            assert await fired() == 3 and r.stats.delivered == 4 and r.in_hand("default") == 3
            free_run = True
            for ev in release.values():
                ev.set()
            await wait_for(lambda: r.stats.acked == 10, what="10 acks")
            assert r.stats.delivered == 10


async def test_a_failing_handler_is_nacked_retried_then_dead_lettered(shard: Shard, make_queue) -> None:  # type: ignore[no-untyped-def]
    make_queue("orders", partitions=2, shuffle=1, max_attempts=3, backoff_min_seconds=0.05, backoff_max_seconds=0.1)
    [tenant] = tenants_of(shard, 1)
    attempts: list[int] = []

    def handle(event: Event) -> None:  # a plain function: run in the thread pool
        attempts.append(event.attempt)
        raise ValueError(f"cannot handle {event.payload['n']}")

    async with running_manager(shard.dsn) as m:
        await wait_leader(m)
        async with receiving(url(m), handle, concurrency=2) as r:
            [ident] = await insert(shard.dsn, [(tenant, {"n": 7})])
            await wait_for(lambda: r.stats.dead_lettered == 1, what="the dead letter")
            assert attempts == [1, 2, 3] and r.stats.nacked == 2
        state, tries, error = (await rows(shard.dsn))[ident]
        assert (state, tries, error) == ("failed", 3, "ValueError: cannot handle 7")


async def test_retry_asks_for_a_delay(shard: Shard, make_queue) -> None:  # type: ignore[no-untyped-def]
    """Retry(delay=...) sets when the event is due again, whatever the queue's back-off (60 s here)."""
    make_queue("orders", partitions=2, shuffle=1, backoff_min_seconds=60, backoff_max_seconds=60)
    [tenant] = tenants_of(shard, 1)
    seen: list[tuple[int, float]] = []

    async def handle(event: Event) -> None:
        seen.append((event.attempt, event.fire_at))
        if event.attempt == 1:
            raise Retry("not yet", delay=0.3)

    async with running_manager(shard.dsn) as m:
        await wait_leader(m)
        async with receiving(url(m), handle) as r:
            [ident] = await insert(shard.dsn, [(tenant, {})])
            await wait_for(lambda: r.stats.acked == 1, what="the second attempt acked")
        assert [a for a, _ in seen] == [1, 2]
        assert 0.25 <= seen[1][1] - seen[0][1] < 5  # due again 0.3 s after the nack, not 60 s
        assert (await rows(shard.dsn))[ident] == ("acked", 2, "not yet")


async def test_a_long_handler_gets_its_lease_extended_and_is_not_fired_again(shard: Shard, make_queue) -> None:  # type: ignore[no-untyped-def]
    """ack_timeout 1 s; the handler runs until the original deadline has passed and the collector
    has swept after it; it is extended, acked at attempt 1, never re-fired."""
    make_queue("orders", partitions=2, shuffle=1, ack_timeout_seconds=1, backoff_min_seconds=0.05)
    [tenant] = tenants_of(shard, 1)
    done = asyncio.Event()
    calls: list[int] = []

    async def handle(event: Event) -> None:
        calls.append(event.attempt)
        await done.wait()

    async with running_manager(shard.dsn) as m:
        await wait_leader(m)
        async with receiving(url(m), handle, extend_after=0.2, extend_by=2.0) as r:
            [ident] = await insert(shard.dsn, [(tenant, {})])
            await wait_for(lambda: r.stats.extended >= 1, what="a lease extension")
            async with await psycopg.AsyncConnection.connect(shard.dsn, autocommit=True) as conn:
                cur = await conn.execute(
                    "SELECT extract(epoch FROM fired_at + interval '1 second' - now()) FROM orders WHERE id = %s",
                    (ident,),
                )
                left = float((await cur.fetchone())[0])  # type: ignore[index]
                # past the original deadline, then a whole collector run
                await asyncio.sleep(max(0.0, left) + 0.1)
                m.signals.swept.clear()
                await m.signals.swept.wait()
                await m.signals.swept.wait()
                cur = await conn.execute("SELECT state::text, attempts FROM orders WHERE id = %s", (ident,))
                assert await cur.fetchone() == ("fired", 1)
            assert r.stats.extended >= 2  # renewed every extend_by / 2
            done.set()
            await wait_for(lambda: r.stats.acked == 1, what="the ack")
        assert calls == [1]
        assert (await rows(shard.dsn))[ident][:2] == ("acked", 1)


@pytest.mark.parametrize("kind", ["async", "thread"])
async def test_a_handler_timeout_nacks(shard: Shard, make_queue, kind: str) -> None:  # type: ignore[no-untyped-def]
    make_queue("orders", partitions=2, shuffle=1, backoff_min_seconds=0.05, backoff_max_seconds=0.1)
    [tenant] = tenants_of(shard, 1)
    calls: list[int] = []
    unblock = asyncio.Event()
    import threading

    thread_unblock = threading.Event()

    async def handle_async(event: Event) -> None:
        calls.append(event.attempt)
        if event.attempt == 1:
            await unblock.wait()

    def handle_thread(event: Event) -> None:
        calls.append(event.attempt)
        if event.attempt == 1:
            thread_unblock.wait(10)

    handler = handle_async if kind == "async" else handle_thread
    async with running_manager(shard.dsn) as m:
        await wait_leader(m)
        async with receiving(url(m), handler, handler_timeout=0.3, concurrency=2) as r:
            [ident] = await insert(shard.dsn, [(tenant, {})])
            await wait_for(lambda: r.stats.acked == 1, what="the second attempt acked")
            assert r.stats.timeouts == 1 and r.stats.nacked == 1 and calls == [1, 2]
            thread_unblock.set()
        assert (await rows(shard.dsn))[ident] == ("acked", 2, "handler timed out after 0.3 s")
