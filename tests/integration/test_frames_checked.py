"""The frames of a real manager and its receivers (the library, the minimal client and a raw
socket) are all checked against docs/protocol.schema.json by the suite's frame check
(tests/framecheck.py), every kind of frame of both sides included."""

from __future__ import annotations

import asyncio
import json

import psycopg
import pytest

from queue_manager.domain.topology import Shard
from queue_manager.wire import frames as f
from receivers import Event, Receiver, Retry
from tests.conftest import tenants_of
from tests.framecheck import FrameCheck
from tests.managerkit import (
    SECRET_ALL,
    insert,
    leading_manager,
    raw_client,
    recv_type,
    running_receiver,
    states,
    subscribe,
    url,
    wait_for,
)


async def acked(dsn: str, ids: list[int], timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not all(s == "acked" for i, (s, _) in (await states(dsn)).items() if i in ids):
        assert asyncio.get_running_loop().time() < deadline, f"events {ids} not acked within {timeout} s"
        await asyncio.sleep(0.05)


@pytest.fixture
def queue(make_queue, shard: Shard) -> str:  # type: ignore[no-untyped-def]
    return str(make_queue("orders", partitions=4, shuffle=2, ack_timeout_seconds=30, backoff_min_seconds=0.1))


async def test_every_frame_both_sides_send_is_checked_against_the_schema(
    shard: Shard, queue: str, _frames_match_the_schema: FrameCheck
) -> None:
    check = _frames_match_the_schema
    tenants = tenants_of(shard, 4)
    seen: list[tuple[int, int]] = []

    async def handle(event: Event) -> None:
        seen.append((event.id, event.attempt))
        if event.attempt == 1 and event.id % 2:
            raise Retry("once more", delay=0)  # a nack, then an ack of attempt 2

    async with leading_manager(shard.dsn) as m:
        lib = Receiver({"s0": [url(m)]}, "orders", handle, token=SECRET_ALL)
        task = asyncio.create_task(lib.run())
        try:
            await lib.wait_subscribed(10)
            ids = await insert(shard.dsn, [(tenants[i % 4], {"i": i}) for i in range(20)])
            await wait_for(lambda: set(ids) <= {i for i, a in seen if a == 2 or i % 2 == 0}, what="every event")
            await acked(shard.dsn, ids)
        finally:
            lib.stop()
            await asyncio.wait_for(task, 15)
        async with running_receiver(url(m)):  # the minimal client
            more = await insert(shard.dsn, [(tenants[0], {"more": True})])
            await acked(shard.dsn, more)
        async with raw_client(m) as ws:
            sub = await subscribe(ws, "orders", tenants=(tenants[0],), credit=2, ref="s", features=("cancel",))
            assert sub["tenants"] == [tenants[0]]
            [ident] = await insert(shard.dsn, [(tenants[0], {"raw": True})])
            ev = (await recv_type(ws, "deliver"))["events"][0]
            await ws.send(f.Extend((f.ExtendItem(ev["id"], ev["attempt"], 60),), ref=1).to_json())
            assert (await recv_type(ws, "extend_result"))["extended"][0]["id"] == ident
            await ws.send(f.Credit(1, ref=2).to_json())
            await recv_type(ws, "credit_set")
            await ws.send(f.Ping("p").to_json())
            await recv_type(ws, "pong")
            await ws.send(f.Ack(((ident, ev["attempt"]), (ident, ev["attempt"])), ref=3).to_json())
            result = await recv_type(ws, "ack_result")
            assert result["acked"] == [ident] and result["errors"][0]["code"] == "duplicate"
            await ws.send(f.Nack((f.NackItem(ident, 1, 0, "late"),), ref=4).to_json())
            assert (await recv_type(ws, "nack_result"))["errors"][0]["code"] == "unknown_id"
            [doomed] = await insert(shard.dsn, [(tenants[0], {"cancelled": True})])
            assert (await recv_type(ws, "deliver"))["events"][0]["id"] == doomed
            async with await psycopg.AsyncConnection.connect(shard.dsn, autocommit=True) as conn:
                await conn.execute("SELECT qm.cancel('orders', ARRAY[%s]::bigint[])", (doomed,))
            assert (await recv_type(ws, "cancel"))["events"][0]["id"] == doomed
            await ws.send(json.dumps({"type": "credit", "credit": -1}))  # malformed on purpose: refused, not checked
            assert (await recv_type(ws, "error"))["code"] == f.BAD_FRAME
    assert {state for state, _ in (await states(shard.dsn)).values()} == {"acked", "cancelled"}
    assert check.verify() == []
    assert check.types["client"] == {c.TYPE for c in f.CLIENT_FRAMES}
    assert check.types["server"] == {c.TYPE for c in f.SERVER_FRAMES}
    assert check.checked["server"] >= 20 and check.checked["client"] >= 10, check.checked
