"""Ack an event in the handler's own database transaction.

    def handle(event: Event) -> None:                 # a plain function: the receiver runs it in a thread
        with psycopg.connect(DSN) as conn:            # one transaction, committed when the block ends
            conn.execute("INSERT INTO invoices ...", ...)
            ack_in_transaction(conn, "orders", event)

The handler's effects and its ack then commit together, or roll back together:

- committed: the event is ``acked`` and never fires again, even if this receiver dies a moment
  later; the manager learns it from the queue table's ``qm_settled`` trigger at commit, frees the
  connection's credit slot and counts the event done for the producers' load counters. The
  receiver sends no ack frame for it.
- rolled back (the handler raised): the event is still ``fired`` at this attempt; the receiver
  nacks it as for any exception, and it is delivered again. If the transaction rolls back but the
  handler returns normally, the event is fired again after its ack deadline.

The ack is guarded by id, attempt and state: it applies only while the event is ``fired`` at the
attempt this delivery carries. Otherwise (acked already, re-fired after a missed deadline,
deleted) it raises :class:`~receivers.errors.EventNotFiredError`, and the caller should roll back.

The connection is any psycopg 3 connection (``psycopg.Connection`` for
:func:`ack_in_transaction`, ``psycopg.AsyncConnection`` for :func:`ack_in_transaction_async`),
or anything with the same ``execute``. It must be inside a transaction: a psycopg connection in
autocommit mode is refused unless a ``conn.transaction()`` block is open.
"""

from __future__ import annotations

import re
from typing import Any, Protocol

from receivers.errors import EventNotFiredError
from receivers.receiver import Event

_QUEUE_RE = re.compile(r"^[a-z][a-z0-9_]{0,39}$")
#: psycopg.pq.TransactionStatus.IDLE: no transaction open
_IDLE = 0


class _Cursor(Protocol):
    def fetchone(self) -> Any: ...


class _AsyncCursor(Protocol):
    async def fetchone(self) -> Any: ...


class SyncConnection(Protocol):
    """What :func:`ack_in_transaction` needs of a connection (``psycopg.Connection`` has it)."""

    def execute(self, query: Any, params: Any = ...) -> Any: ...


class AsyncConnection(Protocol):
    """What :func:`ack_in_transaction_async` needs of a connection (``psycopg.AsyncConnection`` has it)."""

    async def execute(self, query: Any, params: Any = ...) -> Any: ...


def _statements(queue: str) -> tuple[str, str]:
    if not isinstance(queue, str) or not _QUEUE_RE.match(queue):
        raise ValueError(f"invalid queue name {queue!r}")
    table = f'"{queue}"'
    ack = (
        f"UPDATE {table} SET state = 'acked', acked_at = now() "
        "WHERE id = %s AND attempts = %s AND state = 'fired' RETURNING id"
    )
    look = f"SELECT state::text, attempts FROM {table} WHERE id = %s"
    return ack, look


def _check_in_transaction(conn: Any) -> None:
    """Refuse a connection whose statement would commit alone (autocommit, no transaction block)."""
    if not getattr(conn, "autocommit", False):
        return
    status = getattr(getattr(conn, "info", None), "transaction_status", None)
    if status is None or int(status) == _IDLE:
        raise ValueError(
            "ack_in_transaction needs a transaction: this connection is in autocommit mode; "
            "use a connection without autocommit or open a conn.transaction() block"
        )


def _not_fired(queue: str, event: Event, row: Any) -> EventNotFiredError:
    what = f"event {event.id} of queue {queue!r} (attempt {event.attempt})"
    if row is None:
        return EventNotFiredError(f"cannot ack {what} by SQL: no such event (deleted?)")
    state, attempts = str(row[0]), int(row[1])
    if state == "fired":
        why = f"it was fired again meanwhile (now attempt {attempts}, after a missed ack deadline?)"
    elif state == "acked":
        why = f"it is acked already (attempt {attempts})"
    elif state == "cancelled":
        why = "an operator cancelled it (qm events cancel)"
    else:
        why = f"it is {state} at attempt {attempts} (taken back after a missed ack deadline or a disconnect?)"
    return EventNotFiredError(
        f"cannot ack {what} by SQL: {why}; it is no longer this delivery's to settle: roll back",
        state=state,
        attempts=attempts,
    )


def ack_in_transaction(conn: SyncConnection, queue: str, event: Event) -> None:
    """Mark ``event`` acked in ``conn``'s open transaction, guarded by id, attempt and state ``fired``.

    Raises :class:`EventNotFiredError` if the event is not fired at this attempt any more. On
    success the event is marked (:attr:`Event.settled_by_sql`), so the receiver sends no ack for
    it; the ack takes effect when the caller commits."""
    ack, look = _statements(queue)
    _check_in_transaction(conn)
    if conn.execute(ack, (event.id, event.attempt)).fetchone() is None:
        raise _not_fired(queue, event, conn.execute(look, (event.id,)).fetchone())
    event.mark_settled_by_sql()


async def ack_in_transaction_async(conn: AsyncConnection, queue: str, event: Event) -> None:
    """:func:`ack_in_transaction` for an async connection (``psycopg.AsyncConnection``)."""
    ack, look = _statements(queue)
    _check_in_transaction(conn)
    cur = await conn.execute(ack, (event.id, event.attempt))
    if await cur.fetchone() is None:
        cur = await conn.execute(look, (event.id,))
        raise _not_fired(queue, event, await cur.fetchone())
    event.mark_settled_by_sql()
