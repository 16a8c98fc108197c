"""Helpers for manager tests: in-process managers, recording receivers, raw protocol clients."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from websockets.asyncio.client import ClientConnection, connect

from queue_manager.clock import Clock
from queue_manager.manager import Manager, ManagerConfig
from queue_manager.manager.auth import TokenStore
from queue_manager.wire import frames as f
from receivers.testing import Delivery as Event
from receivers.testing import MinimalClient

SECRET_ALL = "secret-all-queues-0001"
SECRET_ORDERS = "secret-orders-only-01"
SECRET_OTHER = "secret-other-queue-01"
SECRET_TENANT = "secret-one-tenant-001"

#: an ack by SQL of (id, attempt) in the test queue "orders", as docs/manager.md documents it
ACK_BY_SQL = "UPDATE orders SET state = 'acked', acked_at = now() WHERE id = %s AND attempts = %s AND state = 'fired'"

#: fast settings for tests: short lease, frequent sweeps, purges and rescans
FAST = {
    "lease_ttl": 2.0,
    "standby_poll": 0.1,
    "sweep_interval": 0.2,
    "purge_interval": 0.2,
    "reconcile_interval": 0.3,
    "rescan_interval": 0.5,
    "drain_timeout": 5.0,
}


def tokens(tenant: str = "tenant-0") -> TokenStore:
    return TokenStore.from_entries(
        [
            {"name": "all", "secret": SECRET_ALL, "queues": ["*"]},
            {"name": "orders", "secret": SECRET_ORDERS, "queues": ["orders"]},
            {"name": "other", "secret": SECRET_OTHER, "queues": ["other"]},
            {"name": "one-tenant", "secret": SECRET_TENANT, "queues": ["orders"], "tenants": [tenant]},
        ]
    )


@contextlib.asynccontextmanager
async def running_manager(
    dsn: str, store: TokenStore | None = None, clock: Clock | None = None, **overrides: Any
) -> AsyncIterator[Manager]:
    """An in-process manager serving on a free port; stopped (drained) on exit."""
    settings = {**FAST, **overrides}
    manager = Manager(ManagerConfig(dsn=dsn, tokens=store or tokens(), **settings), clock)
    manager.signals.init()
    task = asyncio.create_task(manager.run())
    await asyncio.wait_for(manager.ready.wait(), 10)
    try:
        yield manager
    finally:
        manager.request_stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 30)


@contextlib.asynccontextmanager
async def leading_manager(
    dsn: str, store: TokenStore | None = None, clock: Clock | None = None, **overrides: Any
) -> AsyncIterator[Manager]:
    """A :func:`running_manager` that leads its shard (waited for, 10 s at the most)."""
    async with running_manager(dsn, store, clock, **overrides) as manager:
        await wait_leader(manager)
        yield manager


async def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


async def rescanned(manager: Manager, queue: str = "orders", timeout: float = 10.0) -> None:
    """Wait until scans that started after this call have covered every partition of the queue:
    whatever the database held before then, the dispatcher has seen (a test signal, no sleep)."""
    manager.signals.scanned.clear()
    partitions = set(range(manager.queues[queue].settings.partitions_physical))
    seen: set[int] = set()

    def covers(scan: tuple[str, tuple[int, ...] | None]) -> bool:
        name, parts = scan
        if name == queue:
            seen.update(partitions if parts is None else parts)
        return seen >= partitions

    await manager.signals.scanned.wait_for(covers, timeout)


async def wait_leader(manager: Manager, timeout: float = 10.0) -> None:
    await wait_for(lambda: manager.role == "leader", timeout, "leadership")


def url(manager: Manager) -> str:
    return f"ws://127.0.0.1:{manager.port}/"


@dataclass
class Recorder:
    """A receiver that records what it gets; ``mode`` is ack, hold (never answer) or fail (nack)."""

    mode: str = "ack"
    events: list[Event] = field(default_factory=list)
    received_at: list[float] = field(default_factory=list)

    async def __call__(self, event: Event) -> None:
        self.events.append(event)
        self.received_at.append(time.time())
        if self.mode == "hold":
            await asyncio.Event().wait()
        if self.mode == "fail":
            raise RuntimeError(f"handler failed on {event.id}")

    def ids(self) -> list[int]:
        return [e.id for e in self.events]


@contextlib.asynccontextmanager
async def running_receiver(
    urls: str | list[str], queue: str = "orders", secret: str = SECRET_ALL, **kwargs: Any
) -> AsyncIterator[tuple[MinimalClient, Recorder]]:
    recorder = kwargs.pop("recorder", None) or Recorder(kwargs.pop("mode", "ack"))
    receiver = MinimalClient(urls, secret, queue, recorder, reconnect_delay=0.05, **kwargs)
    task = asyncio.create_task(receiver.run())
    try:
        await asyncio.wait_for(receiver.connected.wait(), 10)
        yield receiver, recorder
    finally:
        receiver.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)


@contextlib.asynccontextmanager
async def raw_client(manager: Manager, secret: str | None = SECRET_ALL) -> AsyncIterator[ClientConnection]:
    """A websocket to the manager whose welcome was read: the test speaks the protocol itself."""
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    async with connect(url(manager), additional_headers=headers, subprotocols=[f.PROTOCOL], open_timeout=5) as ws:  # type: ignore[list-item]
        welcome = f.parse_server(await asyncio.wait_for(ws.recv(), 5))
        assert isinstance(welcome, f.Welcome), welcome
        yield ws


async def subscribe(
    ws: ClientConnection,
    queue: str = "orders",
    tenants: tuple[str, ...] | None = None,
    credit: int | None = None,
    ref: str | int | None = None,
    timeout: float = 5.0,
    features: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """Subscribe ``ws`` (a :func:`raw_client`) and wait for its ``subscribed``, which is returned."""
    await ws.send(f.Subscribe(queue, tenants, credit, ref, features).to_json())
    return await recv_type(ws, "subscribed", timeout)


@contextlib.asynccontextmanager
async def subscribed(manager: Manager, queue: str = "orders", **kwargs: Any) -> AsyncIterator[ClientConnection]:
    """A :func:`raw_client` subscribed to ``queue`` (``kwargs``: :func:`subscribe`'s), its ``subscribed`` read."""
    async with raw_client(manager) as ws:
        await subscribe(ws, queue, **kwargs)
        yield ws


async def recv_type(ws: ClientConnection, kind: str, timeout: float = 5.0) -> dict[str, Any]:
    """The next frame of type ``kind`` (frames of other types in between are skipped)."""
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"no {kind!r} frame within {timeout}s")
        frame: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), remaining))
        if frame["type"] == kind:
            return frame


async def insert(
    dsn: str, rows: list[tuple[str, Any]], queue: str = "orders", fire_in: float | None = None
) -> list[int]:
    """Insert (tenant, payload) rows in one committed transaction; returns their ids."""
    ids = []
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        for tenant, payload in rows:
            if fire_in is None:
                cur = await conn.execute(
                    f"INSERT INTO {queue} (tenant, payload) VALUES (%s, %s) RETURNING id", (tenant, json.dumps(payload))
                )
            else:
                cur = await conn.execute(
                    f"INSERT INTO {queue} (tenant, payload, fire_at) "
                    "VALUES (%s, %s, now() + make_interval(secs => %s)) RETURNING id",
                    (tenant, json.dumps(payload), fire_in),
                )
            row = await cur.fetchone()
            assert row is not None
            ids.append(int(row[0]))
    return ids


async def states(dsn: str, queue: str = "orders") -> dict[int, tuple[str, int]]:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cur = await conn.execute(f"SELECT id, state::text, attempts FROM {queue}")
        return {int(r[0]): (str(r[1]), int(r[2])) for r in await cur.fetchall()}
