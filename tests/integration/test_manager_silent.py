"""A receiver that is alive but silent: a stopped process, or a client that no longer reads its
socket. The socket stays open, so the manager learns of it only from a missed ack deadline. From
then on the connection is sent nothing until it shows life (a frame, or the pong to the ping the
manager sends it), and what timed out on it goes to the receivers with credit (docs/manager.md,
"Re-fire and the old-event collector").
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from typing import Any

import psycopg
import pytest

from queue_manager.domain.topology import Shard
from queue_manager.local import fleet
from queue_manager.manager import Manager
from queue_manager.wire import frames as f
from tests.conftest import tenants_of
from tests.managerkit import (
    ACK_BY_SQL,
    SECRET_ALL,
    insert,
    leading_manager,
    raw_client,
    recv_type,
    rescanned,
    running_receiver,
    subscribe,
    subscribed,
    url,
    wait_for,
)

pytestmark = pytest.mark.timeout(60)

ACK_TIMEOUT = 1.0
BACKOFF_MAX = 0.3
#: every event is acked by a healthy receiver this long after its commit at most, a frozen one
#: beside them or not: its ack deadline, the back-off, and 1 s for the collector's sweep (every
#: 0.2 s here), the re-fire and the ack
ACKED_WITHIN = ACK_TIMEOUT + BACKOFF_MAX + 1.0
#: a silent receiver that shows life gets events again within this many seconds
BACK_WITHIN = 2.0


@pytest.fixture
def orders(make_queue) -> str:  # type: ignore[no-untyped-def]
    return str(
        make_queue(
            "orders",
            partitions=4,
            shuffle=2,
            ack_timeout_seconds=ACK_TIMEOUT,
            backoff_min_seconds=0.1,
            backoff_max_seconds=BACKOFF_MAX,
            max_attempts=10,
        )
    )


class Sent:
    """The deliveries the manager sends on one of its connections, and when (monotonic)."""

    def __init__(self, conn: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.frames: list[tuple[float, list[tuple[int, int]]]] = []
        send = conn.send

        def spy(text: str) -> None:
            frame = json.loads(text)
            if frame["type"] == "deliver":
                self.frames.append((time.monotonic(), [(e["id"], e["attempt"]) for e in frame["events"]]))
            send(text)

        monkeypatch.setattr(conn, "send", spy)

    def between(self, start: float, end: float = float("inf")) -> list[tuple[int, int]]:
        return [d for at, events in self.frames if start <= at < end for d in events]


def first_timeout(m: Manager, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Filled with the monotonic time at which the collector first takes events back."""
    when: list[float] = []
    refired = m.rt.refired

    def spy(q: Any, moved: set[int], failed: set[int], at: float | None) -> None:
        if moved and not when:
            when.append(time.monotonic())
        refired(q, moved, failed, at)

    monkeypatch.setattr(m.rt, "refired", spy)
    return when


async def until_acked(dsn: str, ids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        while True:
            cur = await conn.execute("SELECT count(*) FROM orders WHERE id = ANY(%s) AND state = 'acked'", (ids,))
            row = await cur.fetchone()
            if row is not None and row[0] == len(ids):
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)


async def until_due(dsn: str, timeout: float) -> bool:
    """Whether every event of the queue is due (by the database clock) within ``timeout``."""
    deadline = time.monotonic() + timeout
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        while True:
            cur = await conn.execute("SELECT max(fire_at) <= now() FROM orders")
            row = await cur.fetchone()
            if row is not None and row[0]:
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)


async def test_a_frozen_receiver_gets_nothing_after_a_missed_deadline_until_it_wakes(  # type: ignore[no-untyped-def]
    shard: Shard, orders: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``qm receive`` (8 handler slots) is stopped with SIGSTOP beside two healthy receivers (4
    credits each) while events come in for 2.5 s. After the first event times out on it, it is
    sent nothing more; every event is acked by the others within ACKED_WITHIN of its commit;
    after SIGCONT it gets events again within BACK_WITHIN."""
    tenants = tenants_of(shard, 8)
    async with leading_manager(shard.dsn) as m:
        proc = fleet.ReceiverProcess(
            "orders",
            "receivers.demo:handle",
            managers={"s0": [url(m)]},
            token=SECRET_ALL,
            concurrency=8,
            drain_timeout=2,
            log_level="WARNING",
        )
        try:
            await wait_for(
                lambda: any(c.queue is not None and c.session.credit == 8 for c in m.connections),
                timeout=20,
                what="the receiver process to subscribe",
            )
            [frozen] = list(m.connections)
            sent = Sent(frozen, monkeypatch)
            timed_out = first_timeout(m, monkeypatch)
            os.kill(proc.pid, signal.SIGSTOP)
            async with running_receiver(url(m), credit=4), running_receiver(url(m), credit=4):
                ids: list[int] = []
                for i in range(25):  # 4 events every 0.1 s
                    ids += await insert(shard.dsn, [(tenants[(4 * i + k) % 8], {"i": i}) for k in range(4)])
                    await asyncio.sleep(0.1)
                all_acked = await until_acked(shard.dsn, ids, ACKED_WITHIN + 2)
                woke = time.monotonic()
                os.kill(proc.pid, signal.SIGCONT)
                assert sent.between(0, woke), "the frozen receiver never got an event"
                assert timed_out, "no event timed out on the frozen receiver"
                late = sent.between(timed_out[0], woke)
                assert not late, (
                    f"{len(late)} deliveries went to the frozen receiver after its first missed deadline, "
                    f"{sum(a > 1 for _, a in late)} of them re-fires: {sorted(late)[:10]}"
                )
                assert all_acked, "events stayed unacked beside two healthy receivers"
                async with await psycopg.AsyncConnection.connect(shard.dsn) as conn:
                    cur = await conn.execute(
                        "SELECT max(extract(epoch FROM acked_at - created_at)) FROM orders WHERE id = ANY(%s)", (ids,)
                    )
                    row = await cur.fetchone()
                assert row is not None and float(row[0]) <= ACKED_WITHIN, f"an event was acked {row} s after its commit"

                # awake again: once it has answered, it is the receiver with most room
                more: list[int] = []
                while not sent.between(woke):
                    assert time.monotonic() < woke + BACK_WITHIN, f"no event for the woken receiver in {BACK_WITHIN}s"
                    more += await insert(shard.dsn, [(tenants[len(more) % 8], {"after": True})])
                    await asyncio.sleep(0.05)
                assert await until_acked(shard.dsn, more, 5), "events committed after the wake-up stayed unacked"
        finally:
            await asyncio.to_thread(proc.stop, 10)


async def test_a_lone_silent_receiver_gets_its_events_again_once_it_answers_a_ping(  # type: ignore[no-untyped-def]
    shard: Shard, orders: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The only receiver stops reading its socket (no frame, no pong: as a frozen process). Its
    events time out and are not fired again while it stays silent; when it reads again, the pong
    to the manager's ping (it sends no frame) brings them back to it within BACK_WITHIN."""
    tenants = tenants_of(shard, 3)
    async with leading_manager(shard.dsn) as m:
        async with subscribed(m, "orders", credit=5) as ws:
            [conn] = list(m.connections)
            sent = Sent(conn, monkeypatch)
            timed_out = first_timeout(m, monkeypatch)
            ws.transport.pause_reading()
            ids = await insert(shard.dsn, [(t, {}) for t in tenants])
            await wait_for(
                lambda: m.metrics.refired.get(queue="orders", reason="ack_timeout") >= len(ids),
                timeout=ACK_TIMEOUT + 3,
                what="the missed deadlines",
            )
            assert sent.between(0, timed_out[0]), "the events were never delivered"
            # due again after the back-off, and the dispatcher has looked at every partition since
            assert await until_due(shard.dsn, BACKOFF_MAX + 1), "the events never came due again"
            await rescanned(m)
            m.signals.idle.clear()
            await m.signals.idle.wait()
            late = sent.between(timed_out[0])
            assert not late, f"re-fired into the silent connection: {late}"
            resumed = time.monotonic()
            ws.transport.resume_reading()
            got: dict[int, int] = {}
            while set(got) != set(ids):
                remaining = resumed + BACK_WITHIN - time.monotonic()
                frame = await recv_type(ws, "deliver", timeout=max(0.01, remaining))
                got.update((e["id"], e["attempt"]) for e in frame["events"] if e["attempt"] > 1)
            await ws.send(f.Ack(tuple((i, a) for (i, a) in got.items()), ref="a").to_json())
            assert sorted((await recv_type(ws, "ack_result"))["acked"]) == sorted(ids)


async def test_an_event_a_live_receiver_sits_on_goes_to_another_one_after_its_deadline(  # type: ignore[no-untyped-def]
    shard: Shard, make_queue
) -> None:
    """max_concurrency 1. Receiver A acks its event by SQL (committed), then stays connected and
    sends nothing, though its event loop runs (it answers pings). Receiver B subscribes. The next
    event may go to A, which has as much room as B; A sits on it, and after its ack deadline it
    goes to B, not back to A: A has settled nothing since. B gets it within ACKED_WITHIN of its
    commit, and the queue's one slot is free again once B acks."""
    make_queue(
        "orders",
        partitions=4,
        shuffle=2,
        max_concurrency=1,
        ack_timeout_seconds=ACK_TIMEOUT,
        backoff_min_seconds=0.1,
        backoff_max_seconds=BACKOFF_MAX,
    )
    first_tenant, second_tenant = tenants_of(shard, 2)
    async with leading_manager(shard.dsn) as m:
        async with raw_client(m) as a, raw_client(m) as b:
            await subscribe(a, "orders", credit=1)
            [first] = await insert(shard.dsn, [(first_tenant, {"n": 1})])
            event = (await recv_type(a, "deliver"))["events"][0]
            async with await psycopg.AsyncConnection.connect(shard.dsn) as app:
                cur = await app.execute(
                    ACK_BY_SQL,
                    (first, event["attempt"]),
                )
                assert cur.rowcount == 1
                await app.commit()
            await wait_for(lambda: m.health()["queues"]["orders"]["in_flight"] == 0, 3, "the SQL ack's slot freed")
            await subscribe(b, "orders", credit=1)
            committed = time.monotonic()
            [second] = await insert(shard.dsn, [(second_tenant, {"n": 2})])
            got = (await recv_type(b, "deliver", timeout=ACKED_WITHIN))["events"][0]
            assert got["id"] == second and time.monotonic() - committed <= ACKED_WITHIN
            await b.send(f.Ack(((second, got["attempt"]),), ref="b").to_json())
            assert (await recv_type(b, "ack_result"))["acked"] == [second]
            await wait_for(lambda: m.health()["queues"]["orders"]["in_flight"] == 0, 3, "the slot free again")
