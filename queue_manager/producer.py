"""Enqueue from Python: join the caller's transaction, route to the right shard, load in bulk.

``enqueue`` runs one ``INSERT INTO <queue>`` on the connection it is given, inside whatever
transaction that connection has open, so the event commits or rolls back with the caller's
own writes. It accepts a psycopg ``Connection``, a SQLAlchemy ``Connection`` or ``Session``;
``aenqueue`` does the same for psycopg's ``AsyncConnection``.

``enqueue_batch`` loads many events with COPY. It places each event itself (least-loaded
partition of the tenant's shuffle set, with the loads read once per batch and kept up to
date as it assigns), and the database checks every row the COPY wrote (the queue's
``qm_verify`` statement trigger), so a batch is all-or-nothing and a bad row is refused with
the same rules as a plain INSERT.

Every path stores the W3C trace context of each event (columns ``traceparent``, ``tracestate``,
``baggage``; docs/observability.md): the one given (``trace_context=``, ``Event.trace_context``)
or, when the process uses OpenTelemetry, that of a PRODUCER span ``send <queue>`` opened around the
insert (one per call, or per batch and shard) in the current context (queue_manager.tracing).
Without OpenTelemetry nothing is imported and the columns stay NULL.

``Router`` holds one connection pool per shard of a topology and sends each tenant to its
shard. Given the topology file (``Router.from_file``), it follows a reshard: an enqueue refused
because the tenant's range moved (``TenantMovedError``) or belongs elsewhere reloads the file,
waits a bounded time for it to name another shard for the tenant (a switch rewrites the file at
its end), and retries once there.
"""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb
from psycopg_pool import ConnectionPool

from queue_manager import tracing
from queue_manager.db.errors import translate
from queue_manager.db.sqlfiles import query
from queue_manager.domain import routing
from queue_manager.domain.names import check_queue_name
from queue_manager.domain.topology import KeyRange, Shard, Topology
from queue_manager.errors import InvalidEventError, MisroutedTenantError, TopologyError, UnknownQueueError

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection as SAConnection
    from sqlalchemy.orm import Session as SASession


@dataclass(frozen=True)
class Event:
    """One event to enqueue."""

    #: the tenant key: picks the shard and the shuffle set
    tenant: str
    #: any JSON-serialisable value
    payload: Any
    #: earliest firing time (timezone-aware); None = as soon as possible (database clock)
    fire_at: datetime | None = None
    #: producer deduplication key, unique per (queue, tenant) while the event is kept
    dedup_key: str | None = None
    #: the W3C trace context to store with the event (``traceparent``, optionally ``tracestate`` and
    #: ``baggage``); None: the batch's (its ``send`` span's, when OpenTelemetry is in use); {}: none
    trace_context: Mapping[str, str] | None = None
    #: 1 (highest) to 5; None = the queue's default_priority
    priority: int | None = None
    #: a key of the tenant whose events fired and unsettled at once the queue's key_max_in_flight bounds
    concurrency_key: str | None = None
    #: a key of the tenant whose fires per second the queue's key_max_qps bounds
    rate_key: str | None = None


def _statement(name: str, queue: str) -> sql.Composed:
    return sql.SQL(query(name)).format(queue=sql.Identifier(check_queue_name(queue)))


@dataclass(frozen=True)
class _Keys:
    """An event's priority and keys, as ``enqueue`` takes them."""

    priority: int | None = None
    concurrency_key: str | None = None
    rate_key: str | None = None

    def statement(self) -> str:
        """The enqueue statement: the column default gives the queue's priority when none is named."""
        return "enqueue" if self.priority is None else "enqueue_priority"


def _params(
    tenant: str,
    payload: Any,
    fire_at: datetime | None,
    dedup_key: str | None,
    context: tracing.Context,
    keys: _Keys,
) -> dict[str, Any]:
    if fire_at is not None and fire_at.tzinfo is None:
        raise InvalidEventError("fire_at must be timezone-aware (a naive datetime is ambiguous)")
    traceparent, tracestate, baggage = context
    return {
        "tenant": tenant,
        "payload": Jsonb(payload),
        "fire_at": fire_at,
        "dedup_key": dedup_key,
        "traceparent": traceparent,
        "tracestate": tracestate,
        "baggage": baggage,
        "priority": keys.priority,
        "concurrency_key": keys.concurrency_key,
        "rate_key": keys.rate_key,
    }


def enqueue(
    conn: psycopg.Connection[Any] | SAConnection | SASession,
    queue: str,
    tenant: str,
    payload: Any,
    fire_at: datetime | None = None,
    dedup_key: str | None = None,
    *,
    trace_context: Mapping[str, str] | None = None,
    priority: int | None = None,
    concurrency_key: str | None = None,
    rate_key: str | None = None,
) -> int | None:
    """Insert one event in the caller's current transaction.

    Returns the new event's id, or None when an event with the same ``dedup_key`` already
    exists for this tenant (the insert then does nothing). Raises MisroutedTenantError,
    InvalidEventError or UnknownQueueError when the database refuses the event; as with any
    failed statement, the caller's transaction must then be rolled back.

    ``trace_context``: the W3C context to store (``traceparent``, ``tracestate``, ``baggage``);
    None: a ``send`` span's in the current context when OpenTelemetry is in use; {}: none.
    ``priority``: 1 (highest) to 5, None: the queue's default_priority. ``concurrency_key`` and
    ``rate_key``: keys of the tenant that the queue's key limits count (docs/sql.md).
    """
    keys = _Keys(priority, concurrency_key, rate_key)
    stmt = _statement(keys.statement(), queue)
    context = tracing.given(trace_context)
    with tracing.send(queue) if context is None else _given(context) as ctx:
        params = _params(tenant, payload, fire_at, dedup_key, ctx, keys)
        if isinstance(conn, psycopg.Connection):
            try:
                row = conn.execute(stmt, params).fetchone()
            except psycopg.Error as exc:
                raise translate(exc, queue=queue) from exc
            return None if row is None else int(row[0])
        return _enqueue_sqlalchemy(conn, stmt, params, queue)


@contextmanager
def _given(context: tracing.Context) -> Iterator[tracing.Context]:
    yield context


def _enqueue_sqlalchemy(
    conn: SAConnection | SASession, stmt: sql.Composed, params: dict[str, Any], queue: str
) -> int | None:
    from sqlalchemy.engine import Connection as SAConnection
    from sqlalchemy.exc import DBAPIError
    from sqlalchemy.orm import Session as SASession

    if isinstance(conn, SASession):
        conn = conn.connection()
    if not isinstance(conn, SAConnection):
        raise TypeError(f"enqueue needs a psycopg or SQLAlchemy connection or session, got {type(conn).__name__}")
    driver = conn.connection.driver_connection
    if not isinstance(driver, psycopg.Connection):
        raise TypeError("enqueue through SQLAlchemy needs the psycopg driver (postgresql+psycopg://)")
    try:
        row = conn.exec_driver_sql(stmt.as_string(driver), params).fetchone()
    except DBAPIError as exc:
        if isinstance(exc.orig, psycopg.Error):
            raise translate(exc.orig, queue=queue) from exc
        raise
    return None if row is None else int(row[0])


async def aenqueue(
    conn: psycopg.AsyncConnection[Any],
    queue: str,
    tenant: str,
    payload: Any,
    fire_at: datetime | None = None,
    dedup_key: str | None = None,
    *,
    trace_context: Mapping[str, str] | None = None,
    priority: int | None = None,
    concurrency_key: str | None = None,
    rate_key: str | None = None,
) -> int | None:
    """``enqueue`` for a psycopg AsyncConnection, in the caller's current transaction."""
    keys = _Keys(priority, concurrency_key, rate_key)
    stmt = _statement(keys.statement(), queue)
    context = tracing.given(trace_context)
    with tracing.send(queue) if context is None else _given(context) as ctx:
        try:
            cur = await conn.execute(stmt, _params(tenant, payload, fire_at, dedup_key, ctx, keys))
            row = await cur.fetchone()
        except psycopg.Error as exc:
            raise translate(exc, queue=queue) from exc
        return None if row is None else int(row[0])


@dataclass(frozen=True)
class _Placement:
    partitions: int
    shuffle: int
    shard: str
    key_range: KeyRange
    loads: list[int]
    #: the time the placement was read: the fire_at of events that give none, in a batch where others do
    now: datetime
    #: the queue's default_priority: the priority of events that give none, in a batch where others do
    priority: int


def _placement(conn: psycopg.Connection[Any], queue: str) -> _Placement:
    row = conn.execute(query("queue_routing_info"), {"queue": queue}).fetchone()
    if row is None:
        raise UnknownQueueError(f"queue {queue!r} does not exist on this shard: create it with 'qm queue create'")
    n, k, _limit, shard, start, end, loads, now, priority = row
    if shard is None:
        raise UnknownQueueError("this database has no shard identity yet: run 'qm migrate --topology <file>'")
    return _Placement(n, k, shard, KeyRange(start, end), list(loads), now, priority)


def enqueue_batch(conn: psycopg.Connection[Any], queue: str, events: Iterable[Event]) -> int:
    """Load events with COPY in the caller's transaction; returns how many were inserted.

    All events must belong to this connection's shard (``Router.enqueue_batch`` splits a
    mixed batch by shard). Events whose ``dedup_key`` already exists are skipped. Placement
    caches each tenant's shuffle set. The COPY carries only the columns the batch uses:
    ``fire_at`` only when some event sets it (the others then get the current time, as the column
    default would give them), ``dedup_key`` only when some event has one, the trace context when
    some event has one: its own ``trace_context``, or else the batch's ``send`` span's (when
    OpenTelemetry is in use), ``priority`` only when some event sets it (the others then get the
    queue's default_priority), the keys only when some event has one.
    """
    check_queue_name(queue)
    events = events if isinstance(events, list | tuple) else list(events)
    with tracing.send(queue, count=len(events)) as batch_context:
        return _enqueue_batch(conn, queue, events, batch_context)


def _enqueue_batch(
    conn: psycopg.Connection[Any], queue: str, events: list[Event] | tuple[Event, ...], batch_context: tracing.Context
) -> int:
    given = tracing.given
    traced = batch_context != tracing.NO_CONTEXT or any(ev.trace_context for ev in events)
    place = _placement(conn, queue)
    load = place.loads
    counts = [0] * len(load)
    sets: dict[str, tuple[int, ...]] = {}
    with_fire_at = any(ev.fire_at is not None for ev in events)
    staged = any(ev.dedup_key is not None for ev in events)
    with_priority = any(ev.priority is not None for ev in events)
    with_keys = any(ev.concurrency_key is not None or ev.rate_key is not None for ev in events)

    columns = ["tenant", "partition", "payload"]
    if with_fire_at:
        columns.append("fire_at")
    if staged:
        columns.append("dedup_key")
    if traced:
        columns.extend(tracing.TRACE_KEYS)
    if with_priority:
        columns.append("priority")
    if with_keys:
        columns.extend(("concurrency_key", "rate_key"))
    simple = len(columns) == 3
    default_priority = place.priority
    now = place.now
    dumps = json.dumps

    def candidates_of(i: int, tenant: str) -> tuple[int, ...]:
        if not tenant:
            raise InvalidEventError(f"event #{i}: tenant must be a non-empty string")
        h = routing.tenant_hash(tenant)
        if not place.key_range.contains_hex(h[: routing.KEYSPACE_HEX_DIGITS]):
            raise MisroutedTenantError(
                f"event #{i}: tenant {tenant!r} does not belong to shard {place.shard!r} ({place.key_range})"
            )
        candidates = sets[tenant] = routing.shuffle_set_from_hash(
            routing.draw_hash(tenant), place.partitions, place.shuffle
        )
        return candidates

    def rows() -> Iterator[tuple[Any, ...]]:
        for i, ev in enumerate(events):
            tenant = ev.tenant
            candidates = sets.get(tenant) or candidates_of(i, tenant)
            # the least-loaded partition of the set, ties to the lowest (candidates ascend)
            best = candidates[0]
            best_load = load[best]
            for p in candidates:
                if load[p] < best_load:
                    best = p
                    best_load = load[p]
            load[best] = best_load + 1
            counts[best] += 1
            if simple:  # the common case: fire_at comes from the column default
                yield tenant, best, dumps(ev.payload)
                continue
            row: tuple[Any, ...] = (tenant, best, dumps(ev.payload))
            if with_fire_at:
                fire_at = ev.fire_at
                if fire_at is None:
                    fire_at = now
                elif fire_at.tzinfo is None:
                    raise InvalidEventError(f"event #{i}: fire_at must be timezone-aware")
                row += (fire_at,)
            if staged:
                row += (ev.dedup_key,)
            if traced:
                context = batch_context if ev.trace_context is None else given(ev.trace_context)
                row += context or tracing.NO_CONTEXT
            if with_priority:
                row += (default_priority if ev.priority is None else ev.priority,)
            if with_keys:
                row += (ev.concurrency_key, ev.rate_key)
            yield row

    try:
        inserted = _copy_rows(conn, queue, rows(), columns, staged=staged, default_priority=default_priority)
    except psycopg.Error as exc:
        raise translate(exc, queue=queue) from exc
    if inserted:
        used = [p for p, c in enumerate(counts) if c]
        conn.execute(query("add_load"), {"queue": queue, "partitions": used, "counts": [counts[p] for p in used]})
    return inserted


def _copy_rows(
    conn: psycopg.Connection[Any],
    queue: str,
    rows: Iterator[tuple[Any, ...]],
    columns: list[str],
    *,
    staged: bool,
    default_priority: int,
) -> int:
    """Stream rows into COPY as they are placed, so placement (client) and COPY (server) overlap.

    With dedup keys (``staged``) the rows go to a temp table first, then one INSERT ... SELECT
    ... ON CONFLICT DO NOTHING, since COPY has no ON CONFLICT.
    """
    target = sql.SQL("qm_staging") if staged else sql.Identifier(queue)
    if staged:
        conn.execute(query("create_staging"))
        conn.execute(query("truncate_staging"))
    written = 0
    statement = sql.SQL("COPY {} ({}) FROM STDIN").format(target, sql.SQL(", ").join(map(sql.Identifier, columns)))
    with conn.cursor().copy(statement) as cp:
        write_row = cp.write_row
        for row in rows:
            write_row(row)
            written += 1
    if not staged:
        return written
    return conn.execute(_statement("insert_from_staging", queue), {"default_priority": default_priority}).rowcount


_T = TypeVar("_T")


class Router:
    """Routes tenants to their shard and keeps a connection pool per shard.

    Use it as a context manager (or call ``close``). Pools open lazily on first use. With
    ``topology_file`` (or ``Router.from_file``) it follows a reshard: see ``refresh``.
    """

    def __init__(
        self,
        topology: Topology,
        *,
        min_size: int = 1,
        max_size: int = 8,
        topology_file: str | Path | None = None,
        moved_wait: float = 5.0,
        poll_interval: float = 0.05,
    ) -> None:
        self.topology = topology
        self._min_size = min_size
        self._max_size = max_size
        self._pools: dict[str, ConnectionPool[psycopg.Connection[Any]]] = {}
        #: the topology file to reload when a shard says a tenant is not its own
        self.topology_file = Path(topology_file) if topology_file is not None else None
        #: how long an enqueue refused as moved waits for the file to name another shard (a switch
        #: blocks the moved range's writes for about a second, then rewrites the file)
        self.moved_wait = moved_wait
        self._poll_interval = poll_interval
        # pools are opened and the topology reloaded by whichever thread needs it first
        self._lock = threading.RLock()

    @classmethod
    def from_file(cls, path: str | Path, **options: Any) -> Router:
        """A router over the topology file at ``path`` that follows changes of the file."""
        return cls(Topology.load(path), topology_file=path, **options)

    def refresh(self) -> bool:
        """Reload the topology file; True when it changed. Pools of shards that left it (or whose
        DSN changed) are closed. A file caught half-written or invalid keeps the topology in use."""
        if self.topology_file is None:
            return False
        try:
            fresh = Topology.load(self.topology_file)
        except TopologyError:
            return False
        with self._lock:
            if fresh == self.topology:
                return False
            kept = {s.name: s.dsn for s in fresh.shards}
            gone = [self._pools.pop(n) for n in list(self._pools) if kept.get(n) != self._dsn_of(n)]
            self.topology = fresh
        for pool in gone:
            pool.close()
        return True

    def _dsn_of(self, name: str) -> str | None:
        for s in self.topology.shards:
            if s.name == name:
                return s.dsn
        return None

    def _follow(self, tenant: str, refused_by: str) -> bool:
        """After a shard refused the tenant: reload the topology until it names another shard for
        it, for at most ``moved_wait``; True if it does (the caller retries once)."""
        if self.topology_file is None:
            return False
        deadline = time.monotonic() + self.moved_wait
        while True:
            self.refresh()
            if self.shard_for(tenant).name != refused_by:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(self._poll_interval)

    def _routed(self, tenant: str, attempt: Callable[[Shard], _T]) -> _T:
        shard = self.shard_for(tenant)
        try:
            return attempt(shard)
        except MisroutedTenantError:
            if not self._follow(tenant, shard.name):
                raise
        return attempt(self.shard_for(tenant))

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every pool."""
        with self._lock:
            pools = list(self._pools.values())
            self._pools.clear()
        for pool in pools:
            pool.close()

    def shard_for(self, tenant: str) -> Shard:
        """The shard that owns the tenant."""
        return self.topology.shard_for(tenant)

    def pool(self, shard: Shard) -> ConnectionPool[psycopg.Connection[Any]]:
        """The (lazily opened) connection pool of a shard."""
        pool = self._pools.get(shard.name)
        if pool is None:
            with self._lock:
                pool = self._pools.get(shard.name)
                if pool is None:
                    pool = ConnectionPool(
                        shard.dsn, min_size=self._min_size, max_size=self._max_size, open=True, name=f"qm-{shard.name}"
                    )
                    self._pools[shard.name] = pool
        return pool

    @contextmanager
    def transaction(self, tenant: str) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection to the tenant's shard inside a transaction (commits on success).

        Do the application's own writes and ``enqueue`` calls on it, and they commit together.
        """
        with self.pool(self.shard_for(tenant)).connection() as conn, conn.transaction():
            yield conn

    def enqueue(
        self,
        queue: str,
        tenant: str,
        payload: Any,
        fire_at: datetime | None = None,
        dedup_key: str | None = None,
        *,
        trace_context: Mapping[str, str] | None = None,
        priority: int | None = None,
        concurrency_key: str | None = None,
        rate_key: str | None = None,
    ) -> int | None:
        """Enqueue one event in its own transaction on the tenant's shard (retried once on the
        shard the topology file names after a reshard moved the tenant). ``trace_context``,
        ``priority`` and the keys as for :func:`enqueue`."""

        def attempt(shard: Shard) -> int | None:
            with self.pool(shard).connection() as conn, conn.transaction():
                return enqueue(
                    conn,
                    queue,
                    tenant,
                    payload,
                    fire_at,
                    dedup_key,
                    trace_context=trace_context,
                    priority=priority,
                    concurrency_key=concurrency_key,
                    rate_key=rate_key,
                )

        return self._routed(tenant, attempt)

    def enqueue_batch(self, queue: str, events: Iterable[Event]) -> int:
        """Split events by shard and load each part with COPY, one transaction per shard.

        Each shard's part commits on its own: a failure on one shard leaves the parts already
        committed on others in place (re-run with dedup keys to make retries safe).
        """
        by_shard: dict[str, list[Event]] = defaultdict(list)
        for ev in events:
            by_shard[self.shard_for(ev.tenant).name].append(ev)
        total = 0
        for name, part in by_shard.items():
            try:
                with self.pool(self.topology.by_name(name)).connection() as conn, conn.transaction():
                    total += enqueue_batch(conn, queue, part)
            except MisroutedTenantError:
                # the shard's range moved: follow the topology file, then send the part where it says
                if not self._follow(part[0].tenant, name):
                    raise
                regrouped: dict[str, list[Event]] = defaultdict(list)
                for ev in part:
                    regrouped[self.shard_for(ev.tenant).name].append(ev)
                for new_name, new_part in regrouped.items():
                    with self.pool(self.topology.by_name(new_name)).connection() as conn, conn.transaction():
                        total += enqueue_batch(conn, queue, new_part)
        return total
