"""The receiver library (receivers.Receiver, receivers.sql, qm receive) against real managers."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest

from queue_manager.domain.topology import Shard
from receivers import Backoff, Event, Receiver, Retry
from tests.conftest import tenants_of
from tests.managerkit import SECRET_ALL, insert, running_manager, url, wait_for, wait_leader

pytestmark = pytest.mark.timeout(120)


def fast_backoff() -> Backoff:
    return Backoff(initial=0.05, maximum=0.5)


@contextlib.asynccontextmanager
async def receiving(urls: Any, handler: Any, queue: str = "orders", **kwargs: Any) -> AsyncIterator[Receiver]:
    """A Receiver running in this loop; stopped (drained) on exit."""
    kwargs.setdefault("token", SECRET_ALL)
    kwargs.setdefault("backoff", fast_backoff)
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
