"""The batched writer of one leadership session: every ack, nack, extend, release and old-event
collector statement, one statement per (kind, queue) and batch, on one connection. (The retention
and reconciliation slices run on a connection of their own: see slices.py.)

Receivers hear of an outcome only after its commit. The next batch collects while one runs,
like group commit, with no timer. One connection: two that took turns were measured and were no
faster (drain only, 100k events, three alternating pairs: 45.9k/s with 1 receiver and 53.9k/s
with 2, against 52.4k/s and 55.9k/s with one). Ack statements of one queue serialise on its
done-counter row anyway, and the extra backend competes for the same two cores.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import psycopg

from queue_manager.domain.settings import QueueSettings
from queue_manager.manager import store
from queue_manager.manager.store import AsyncConn
from queue_manager.tracing import ManagerTracer

logger = logging.getLogger(__name__)


class Unavailable(Exception):
    """The manager cannot write to its database right now (or is not leading); the client may retry."""


class OpKind(Enum):
    """What the writer does; the first three come from receivers' frames (``WriteKind`` values)."""

    ACK = "ack"
    RELEASE = "release"
    EXTEND = "extend"
    #: events an application settled by SQL: count them done (items: their partitions)
    SETTLED = "settled"
    #: items: where the collector's sweep of this queue resumes (one item, or none: from the start)
    SWEEP = "sweep"


_StoreCall = Callable[[AsyncConn, QueueSettings, int, list[Any]], Awaitable[Any]]

#: the store call of each kind; items are the batch's items, concatenated (none for maintenance).
#: Looked up in the module at call time, so that the benchmark's timing wrappers see every call.
_CALLS: dict[OpKind, _StoreCall] = {
    OpKind.ACK: lambda conn, q, term, items: store.ack(conn, q, term, items),
    OpKind.RELEASE: lambda conn, q, term, items: store.release(conn, q, term, items),
    OpKind.EXTEND: lambda conn, q, term, items: store.extend(conn, q, term, items),
    OpKind.SETTLED: lambda conn, q, term, items: store.settled(conn, q, term, items),
    OpKind.SWEEP: lambda conn, q, term, items: store.sweep(conn, q, term, min(items, default=None)),
}


#: the kinds a manager's sampled spans cover, and their span's operation
_TRACED = {OpKind.ACK: "ack", OpKind.RELEASE: "nack"}


@dataclass(slots=True)
class _Op:
    kind: OpKind
    queue: QueueSettings
    items: list[Any]
    future: asyncio.Future[Any]


class Writer:
    """Collects ops from anywhere in the process; :meth:`run` writes them in batches."""

    def __init__(self, conn: AsyncConn, term: int, *, tracer: ManagerTracer | None = None) -> None:
        self.conn = conn
        self.term = term
        #: spans for a share of the ack and release batches (queue_manager.tracing)
        self.tracer = tracer
        self._ops: list[_Op] = []
        self._ready = asyncio.Event()
        self._closed: BaseException | None = None

    def submit(self, kind: OpKind, queue: QueueSettings, items: list[Any]) -> asyncio.Future[Any]:
        """The result of ``kind`` for ``items``, once committed; Unavailable if it could not be."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self._closed is not None:
            fut.set_exception(Unavailable(str(self._closed)))
            return fut
        self._ops.append(_Op(kind, queue, items, fut))
        self._ready.set()
        return fut

    def close(self, reason: BaseException) -> None:
        """No more writes: pending and later ops fail with ``reason``."""
        if self._closed is None:
            self._closed = reason
        self._fail(self._ops, Unavailable(str(reason)))
        self._ops = []

    async def run(self) -> None:
        while True:
            while not self._ops:
                self._ready.clear()
                await self._ready.wait()
            ops, self._ops = self._ops, []
            groups: dict[tuple[OpKind, int], list[_Op]] = {}
            for op in ops:
                groups.setdefault((op.kind, op.queue.id), []).append(op)
            for (kind, _), group in groups.items():
                tracer = self.tracer
                traced = tracer is not None and kind in _TRACED and tracer.sampled()
                started = ManagerTracer.now_ns() if traced else 0
                items = [i for op in group for i in op.items]
                # read before the batch: an ack of a queue without retention deletes the rows
                contexts = await self._contexts(group[0].queue, items) if traced else []
                try:
                    result = await _CALLS[kind](self.conn, group[0].queue, self.term, items)
                except Exception as exc:
                    unavailable = Unavailable(f"database error: {str(exc).strip()[:200]}")
                    self._fail(group, unavailable)
                    if store.is_fenced(exc) or isinstance(exc, psycopg.OperationalError) or self.conn.closed:
                        self._fail(ops, unavailable)  # the rest of this batch cannot succeed either
                        raise
                    continue
                for op in group:
                    if not op.future.done():
                        op.future.set_result(result)
                if traced and tracer is not None:
                    tracer.batch(_TRACED[kind], group[0].queue.name, len(items), contexts, started)

    async def _contexts(self, q: QueueSettings, items: list[Any]) -> list[str | None]:
        """A sampled batch's events' trace contexts, for its span's links (read by id: the writer
        does not keep them)."""
        try:
            return await store.trace_contexts(self.conn, q, [i[0] for i in items])
        except psycopg.Error as exc:  # a span's read must not cost the batch anything
            logger.debug("no trace contexts for a batch span: %s", exc, extra={"action": "trace_batch"})
            return []

    @staticmethod
    def _fail(ops: list[_Op], exc: BaseException) -> None:
        for op in ops:
            if not op.future.done():
                op.future.set_exception(exc)
