"""The asyncio side of one receiver connection: it moves bytes and runs the session's actions.

Everything the protocol decides is in :class:`queue_manager.wire.session.ReceiverSession`; this
adapter reads messages, hands them over, and carries out what comes back: frames to send,
queue lookups, database writes through the session's writer, releases, pings and wake-ups.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from queue_manager.manager.auth import Grant
from queue_manager.manager.queues import QueueRuntime, Reason
from queue_manager.manager.runtime import Runtime
from queue_manager.manager.writer import OpKind, Unavailable
from queue_manager.wire import frames
from queue_manager.wire.session import (
    Action,
    Probe,
    ReceiverSession,
    Release,
    Resolve,
    Send,
    Wake,
    WakeUp,
    Write,
)

logger = logging.getLogger(__name__)

#: frames queued for one connection before it counts as not reading (and is cut off)
MAX_OUTBOX = 4096
#: frames waiting for the database per connection; beyond, the socket is not read (back-pressure)
MAX_PENDING = 64
#: on close, how long the connection's writes in progress are waited for before its events go back
SETTLE_ON_CLOSE = 10.0
#: a subscribe to an unknown queue has the settings reloaded, waiting at most this long
RESOLVE_WITHIN = 1.0

_WAKE_REASONS = {
    Wake.CREDIT: Reason.CREDIT,
    Wake.SETTLED: Reason.CREDIT,
    Wake.REQUEUED: Reason.REQUEUED,
    Wake.SUBSCRIBED: Reason.SUBSCRIBED,
    # events may be due that no one could take while this connection was the one with room
    Wake.ALIVE: Reason.DUE,
}

_ids = itertools.count(1)


class ReceiverConnection:
    """One authenticated websocket connection, subscribed to at most one queue."""

    def __init__(self, ws: ServerConnection, grant: Grant, rt: Runtime) -> None:
        self.id = next(_ids)
        self.ws = ws
        self.rt = rt
        self.session = ReceiverSession(self.id, grant, db_time=rt.db_clock.now, metrics=rt.metrics)
        self.queue: QueueRuntime | None = None
        self.outbox: asyncio.Queue[str | None] = asyncio.Queue()
        self.closed = False
        self._pending: set[asyncio.Task[None]] = set()
        #: the ping of a Probe, until its pong (kept apart from _pending: it is no frame's work)
        self._probe: asyncio.Task[None] | None = None

    def describe(self) -> dict[str, Any]:
        """This connection as ``/health`` lists it: its queue, token, credit, events in hand, tenant
        filter size and whether it went silent or lapsed (the dashboard shows them)."""
        s = self.session
        peer = self.ws.remote_address
        return {
            "id": self.id,
            "token": s.scope.name,
            "peer": f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else None,
            "queue": s.queue,
            "credit": s.credit,
            "in_hand": s.ledger.held_by(self.id) if s.ledger is not None else 0,
            "tenants": None if s.tenants is None else len(s.tenants),
            "silent": s.silent,
            "lapsed": s.lapsed,
        }

    # the dispatcher's view (queues.Subscriber)

    @property
    def free(self) -> int:
        return self.session.free

    @property
    def silent(self) -> bool:
        return self.session.silent

    @property
    def lapsed(self) -> bool:
        return self.session.lapsed

    def timed_out(self) -> None:
        """The collector took back an event this connection held, past its ack deadline."""
        self._run(self.session.timed_out())

    def cancelled(self, ident: int, attempt: int) -> None:
        """An operator cancelled (ident, attempt), which this connection holds."""
        self._run(self.session.cancelled(ident, attempt))

    @property
    def tenants(self) -> frozenset[str] | None:
        return self.session.tenants

    def send(self, text: str) -> None:
        if self.closed:
            return
        if self.outbox.qsize() >= MAX_OUTBOX:
            # the client sends frames but does not read our replies: cut it off (its events re-fire)
            self.closed = True
            self.ws.transport.abort()
            return
        self.outbox.put_nowait(text)

    def close_soon(self, code: int, reason: str) -> None:
        asyncio.get_running_loop().create_task(self.close(code, reason))

    async def close(self, code: int, reason: str) -> None:
        with contextlib.suppress(Exception):
            await self.ws.close(code, reason)

    # the connection's life

    async def serve(self, welcome: str) -> None:
        """Read and answer frames until the connection ends; then give back what it held."""
        sender = asyncio.create_task(self._send_loop())
        try:
            self.send(welcome)
            async for message in self.ws:
                self._run(self.session.receive(message, self.rt.clock.monotonic()))
                if len(self._pending) >= MAX_PENDING:
                    await asyncio.wait(self._pending, return_when=asyncio.FIRST_COMPLETED)
        except ConnectionClosed:
            pass
        finally:
            self.closed = True  # the dispatcher sends it nothing more
            if self._probe is not None:
                self._probe.cancel()
            if self._pending:
                await asyncio.wait(self._pending, timeout=SETTLE_ON_CLOSE)
            q = self.queue
            if q is not None and self in q.subscribers:
                q.subscribers.remove(self)
            self._run(self.session.closed())
            self.outbox.put_nowait(None)
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await sender

    async def _send_loop(self) -> None:
        while True:
            text = await self.outbox.get()
            if text is None:
                return
            try:
                await self.ws.send(text)
            except ConnectionClosed:
                return
            except Exception:  # never leave a connection open that can no longer send
                logger.exception("sending to a receiver failed", extra={"action": "send"})
                self.closed = True
                with contextlib.suppress(Exception):
                    await self.ws.close(1011, "internal error while sending")
                return

    def _run(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Send):
                self.send(action.text)
            elif isinstance(action, WakeUp):
                self.rt.nudge(self.queue, _WAKE_REASONS[action.reason], action.since)
            elif isinstance(action, Write):
                self._spawn(self._write(action))
            elif isinstance(action, Resolve):
                self._spawn(self._resolve(action))
            elif isinstance(action, Release):
                if self.queue is not None:
                    self.rt.release_soon(self.queue, action.items, "disconnect")
            elif isinstance(action, Probe):
                self._ping()
            else:  # pragma: no cover
                raise AssertionError(action)

    def _ping(self) -> None:
        """Ping the client; its pong shows it reads again. One ping at a time: a ping still
        unanswered from an earlier silence is answered only once the client reads again, too."""
        if self.closed or (self._probe is not None and not self._probe.done()):
            return
        self._probe = asyncio.get_running_loop().create_task(self._await_pong())

    async def _await_pong(self) -> None:
        try:
            pong = await self.ws.ping()
            await pong
        except ConnectionClosed:
            return  # the keepalive's timeout, or the client, closed it: its events go back
        except Exception:  # never let the probe take the connection down
            logger.exception("pinging a silent receiver failed", extra={"action": "probe"})
            return
        if not self.closed:
            self._run(self.session.answered())

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(self._guarded(work))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _guarded(self, work: Any) -> None:
        try:
            await work
        except Exception as exc:  # keep serving; tell the client what happened
            logger.exception("frame handling failed", extra={"action": "frame"})
            self.send(frames.Error(frames.UNAVAILABLE, f"internal error: {type(exc).__name__}").to_json())

    async def _write(self, op: Write) -> None:
        q = self.queue
        assert q is not None
        try:
            result = await self.rt.submit(OpKind(op.kind.value), q, op.items)
        except Unavailable as exc:
            self._run(self.session.write_failed(op, str(exc)))
            return
        self._run(self.session.settled(op, result, self.rt.clock.monotonic()))

    async def _resolve(self, resolve: Resolve) -> None:
        rt = self.rt
        q = rt.queues.get(resolve.queue)
        if q is None and await rt.next_reload(RESOLVE_WITHIN):  # a queue created a moment ago
            q = rt.queues.get(resolve.queue)
        if q is None:
            message = f"no queue named {resolve.queue!r} on shard {rt.shard_name!r}"
            self._run(self.session.subscribe_failed(resolve, frames.UNKNOWN_QUEUE, message))
            return
        self.queue = q
        if not self.closed:
            q.subscribers.append(self)
        self._run(self.session.subscribed(resolve, q.ledger))
