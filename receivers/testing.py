"""A minimal client of protocol ``qm.v1`` (docs/protocol.md), for tests and benchmarks of the manager:
connect, subscribe, handle, ack. Applications use :class:`receivers.Receiver` (the library).

    async def handle(event: Delivery) -> None:
        ...                      # raise to nack (the event is re-fired after the back-off)

    client = MinimalClient(["ws://127.0.0.1:8765/"], token="...", queue="orders", handler=handle)
    await client.run()           # until client.stop()

It connects to the first manager URL that accepts (standbys answer 503), reconnects with a short
pause when the connection drops or the manager loses leadership, keeps at most ``credit`` events
unacked, runs the handler on up to ``concurrency`` events at once, and batches acks and nacks.
Events in hand when a connection drops are forgotten: the manager re-fires them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, InvalidURI

from queue_manager.wire import frames as f
from queue_manager.wire.frames import PROTOCOL

logger = logging.getLogger("receivers")


@dataclass(slots=True)
class Delivery:
    """One delivered event (not frozen: a frozen dataclass's construction, on every event's path,
    costs three times as much)."""

    queue: str
    id: int
    attempt: int
    tenant: str
    partition: int
    fire_at: float  # epoch seconds, database clock
    payload: Any
    priority: int = 3  # 1 (highest) to 5


@dataclass
class MinimalStats:
    delivered: int = 0
    acked: int = 0
    nacked: int = 0
    connects: int = 0
    refused: dict[int, int] = field(default_factory=dict)  # HTTP status -> count
    errors: list[dict[str, Any]] = field(default_factory=list)  # error frames and per-item errors


class MinimalClient:
    """Receive events of one queue from a shard's manager(s)."""

    def __init__(
        self,
        urls: str | Sequence[str],
        token: str,
        queue: str,
        handler: Callable[[Delivery], Awaitable[None]],
        *,
        credit: int = 100,
        concurrency: int | None = None,
        tenants: Sequence[str] | None = None,
        reconnect_delay: float = 0.2,
        max_size: int = 16 << 20,
    ) -> None:
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        if not self.urls:
            raise ValueError("give at least one manager URL")
        if credit < 1:
            raise ValueError("credit must be at least 1")
        self.token = token
        self.queue = queue
        self.handler = handler
        self.credit = credit
        self.concurrency = concurrency or credit
        self.tenants = list(tenants) if tenants is not None else None
        self.reconnect_delay = reconnect_delay
        self.max_size = max_size
        self.stats = MinimalStats()
        self.connected = asyncio.Event()
        self.welcome: f.Welcome | None = None
        self._stop = asyncio.Event()
        self._refs = itertools.count(1)

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        """Receive until :meth:`stop`, moving to another manager URL whenever one fails."""
        for url in itertools.cycle(self.urls):
            if self._stop.is_set():
                return
            try:
                async with connect(
                    url,
                    additional_headers={"Authorization": f"Bearer {self.token}"},
                    subprotocols=[PROTOCOL],  # type: ignore[list-item]
                    max_size=self.max_size,
                    compression=None,
                    open_timeout=5,
                ) as ws:
                    self.stats.connects += 1
                    await self._session(ws)
            except InvalidStatus as exc:
                status = exc.response.status_code
                self.stats.refused[status] = self.stats.refused.get(status, 0) + 1
                if status in (401, 403):
                    raise PermissionError(f"{url}: the manager refused the token (HTTP {status})") from exc
            except (TimeoutError, OSError, ConnectionClosed, InvalidURI) as exc:
                logger.info("connection to %s ended: %r", url, exc)
            finally:
                self.connected.clear()
            if self._stop.is_set():
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.reconnect_delay)

    async def _session(self, ws: ClientConnection) -> None:
        # events to handle, and the idle handlers' wake-ups: a frame of n events wakes at most n of
        # them (not every idle one: with concurrency 1 000, waking all of them for each frame cost
        # the receiver tens of milliseconds a frame), and a handler that does not suspend handles a
        # whole deliver frame in one go, without a task switch per event
        work: collections.deque[Delivery] = collections.deque()
        idle: collections.deque[asyncio.Future[None]] = collections.deque()
        loop = asyncio.get_running_loop()

        def wake(n: int) -> None:
            while n and idle:
                waiter = idle.popleft()
                if not waiter.done():  # a handler cancelled while idle
                    waiter.set_result(None)
                    n -= 1
        acks: list[tuple[int, int]] = []
        nacks: list[f.NackItem] = []
        flush = asyncio.Event()

        async def worker() -> None:
            while True:
                while not work:
                    waiter = loop.create_future()
                    idle.append(waiter)
                    await waiter
                event = work.popleft()
                try:
                    await self.handler(event)
                except Exception as exc:
                    nacks.append(f.NackItem(event.id, event.attempt, error=f"{type(exc).__name__}: {exc}"[:4000]))
                else:
                    acks.append((event.id, event.attempt))
                flush.set()

        async def flusher() -> None:
            while True:
                await flush.wait()
                flush.clear()
                await asyncio.sleep(0)  # let the other handlers of this batch finish first
                if acks:
                    batch = acks[:10_000]
                    del acks[: len(batch)]
                    await ws.send(f.Ack(tuple(batch), next(self._refs)).to_json())
                if nacks:
                    batch_n = nacks[:10_000]
                    del nacks[: len(batch_n)]
                    await ws.send(f.Nack(tuple(batch_n), next(self._refs)).to_json())
                if acks or nacks:
                    flush.set()

        async def watch_stop() -> None:
            await self._stop.wait()
            await ws.close()

        tenants = tuple(self.tenants) if self.tenants is not None else None
        sub = f.Subscribe(self.queue, tenants, self.credit, "subscribe")
        tasks = [asyncio.create_task(worker()) for _ in range(self.concurrency)]
        tasks += [asyncio.create_task(flusher()), asyncio.create_task(watch_stop())]
        try:
            await ws.send(sub.to_json())
            async for message in ws:
                frame = f.parse_server(message)
                if isinstance(frame, f.Deliver):
                    queue = frame.queue
                    work.extend(
                        Delivery(
                            queue,
                            e["id"],
                            e["attempt"],
                            e["tenant"],
                            e["partition"],
                            e["fire_at"],
                            e["payload"],
                            e.get("priority", 3),
                        )
                        for e in frame.events
                    )
                    self.stats.delivered += len(frame.events)
                    wake(len(frame.events))
                elif isinstance(frame, f.AckResult):
                    self.stats.acked += len(frame.acked)
                    self._record_errors(frame.errors, acks)
                elif isinstance(frame, f.NackResult):
                    self.stats.nacked += len(frame.requeued) + len(frame.failed)
                    self._record_errors(frame.errors, None)
                elif isinstance(frame, f.Welcome):
                    self.welcome = frame
                elif isinstance(frame, f.Subscribed):
                    self.connected.set()
                elif isinstance(frame, f.Error):
                    self.stats.errors.append({"type": "error", "code": frame.code, "message": frame.message})
                    if frame.ref == "subscribe":
                        raise PermissionError(f"subscribe refused: {frame.code}: {frame.message}")
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t

    def _record_errors(self, errors: list[f.ItemError], retry_into: list[tuple[int, int]] | None) -> None:
        for err in errors:
            self.stats.errors.append(dict(err))
            # an ack the manager could not record (database briefly unreachable) is worth a retry
            if retry_into is not None and err.get("code") == f.UNAVAILABLE:
                retry_into.append((err["id"], err["attempt"]))
