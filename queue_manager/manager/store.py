"""The manager's database work: every statement comes from ``sql/manager.sql``.

Each function runs one statement on an autocommit psycopg connection, so each is its own
transaction: a fire commits before anything is pushed, and an ack is confirmed only after
its commit. Every state change carries the manager's term and is fenced by ``qm.fence``, except
the maintenance slices' (``slice_*``): deleting a settled event and re-anchoring a load counter
under its lock are right whichever manager process does them, leader or standby.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import class_row

from queue_manager.db.sqlfiles import query
from queue_manager.domain.names import check_queue_name
from queue_manager.domain.settings import PRIORITY_LEVELS, KeySettings, QueueSettings, TenantSettings
from queue_manager.manager.fairness import CAP_LOOKAHEAD, FairPick, candidate_quota
from queue_manager.manager.keys import UNLIMITED, KeyRooms

AsyncConn = psycopg.AsyncConnection[Any]

#: SQLSTATE raised by qm.fence when the manager's term is no longer current
FENCED_SQLSTATE = "QMF01"
SWEEP_PAGE = 1000
#: a maintenance slice's statement gives up after this long (a page of deletes; a reconciliation
#: slice's count has a shorter bound of its own, RECONCILE_SLICE_TIMEOUT_MS)
SLICE_STATEMENT_TIMEOUT_MS = 1000
#: and after waiting this long for a lock (a table lock of a CREATE INDEX, say): a slice waiting in
#: a lock queue would hold up everyone queued behind it
SLICE_LOCK_TIMEOUT_MS = 100


def _static(name: str) -> sql.SQL:
    return sql.SQL(query(name, "manager.sql"))


@cache
def queue_sql(name: str, queue: str) -> sql.Composed:
    """A manager statement for one queue table (the name is allow-listed first)."""
    return sql.SQL(query(name, "manager.sql")).format(queue=sql.Identifier(check_queue_name(queue)))


#: per connection, the statements executed on it with ``prepare=True`` at least once
_PREPARED: weakref.WeakKeyDictionary[AsyncConn, set[str]] = weakref.WeakKeyDictionary()


async def _execute_prepared(
    conn: AsyncConn, key: str, statement: sql.SQL | sql.Composed, params: Mapping[str, Any], *, binary: bool = False
) -> psycopg.AsyncCursor[Any]:
    """``conn.execute(statement, params, prepare=True)``; its first time on a connection (``key``
    names the statement) inside a pipeline. Outside one, psycopg prepares a statement in a round
    trip of its own (Parse, wait, then Bind and Execute): on a new session's connections the
    dispatcher's probe, scan and fire each cost two round trips instead of one, and a restart on a
    slow or lossy link waits for every one of them (docs/faults.md, "A cheaper restart")."""
    known = _PREPARED.setdefault(conn, set())
    if key in known:
        return await conn.execute(statement, params, prepare=True, binary=binary)
    async with conn.pipeline():
        cur = await conn.execute(statement, params, prepare=True, binary=binary)
    known.add(key)
    return cur


def is_fenced(exc: BaseException) -> bool:
    return isinstance(exc, psycopg.Error) and exc.sqlstate == FENCED_SQLSTATE


#: marks the manager's own sessions: the queue tables' qm_settled trigger ignores their writes
MANAGER_ROLE_OPTION = "-c qm.role=manager"


#: planner settings of the manager's sessions (the plan tests use them too):
#: - plan_cache_mode: a generic plan of the ack/release statements joins unnest(ids) by walking
#:   the whole fired index (measured: ~40 ms instead of ~3 ms for 500 acks);
#: - enable_bitmapscan: a pick bounded below by a floor (``fire_at >= <floor of partition g.i>``)
#:   and above by now() is estimated as a range of unknown bounds (0.5 % of the partition), so the
#:   planner read every due row of each partition with a bitmap scan and sorted them instead of
#:   walking the due index in order and stopping at the quota: 13.5 ms instead of 4.2 ms for 1 000
#:   of a 50 000-event backlog, the whole drain 35 % slower. Every statement of the manager is
#:   built for ordered index scans or primary-key probes.
PLANNER_SETTINGS = {"plan_cache_mode": "force_custom_plan", "enable_bitmapscan": "off"}


async def connect(dsn: str, application_name: str, *, durable: bool = True, connect_timeout: int = 5) -> AsyncConn:
    """An autocommit connection with guards: no statement or idle transaction may hang for long.

    ``durable=False`` turns ``synchronous_commit`` off for the connection (see docs/manager.md,
    "Durable fires", for when the dispatcher's connection may use it).
    """
    options = (
        "-c statement_timeout=30000 -c idle_in_transaction_session_timeout=5000 -c lock_timeout=10000 "
        + " ".join(f"-c {name}={value}" for name, value in PLANNER_SETTINGS.items())
        + " "
        + MANAGER_ROLE_OPTION
    )
    if not durable:
        options += " -c synchronous_commit=off"
    return await psycopg.AsyncConnection.connect(
        dsn, autocommit=True, application_name=application_name[:63], options=options, connect_timeout=connect_timeout
    )


async def connect_waiter(dsn: str, application_name: str) -> AsyncConn:
    """A connection that may wait for a wake-up lock for as long as a producer keeps it (no timeouts)."""
    options = "-c statement_timeout=0 -c lock_timeout=0 " + MANAGER_ROLE_OPTION
    return await psycopg.AsyncConnection.connect(
        dsn, autocommit=True, application_name=application_name[:63], options=options, connect_timeout=5
    )


async def shard_name(conn: AsyncConn) -> str | None:
    row = await (await conn.execute(_static("mgr_shard"))).fetchone()
    return None if row is None else str(row[0])


async def load_queues(conn: AsyncConn) -> list[QueueSettings]:
    async with conn.cursor(row_factory=class_row(QueueSettings)) as cur:
        await cur.execute(_static("mgr_queues"))
        return await cur.fetchall()


async def load_tenant_settings(conn: AsyncConn) -> list[TenantSettings]:
    async with conn.cursor(row_factory=class_row(TenantSettings)) as cur:
        await cur.execute(_static("mgr_tenant_settings"))
        return await cur.fetchall()


async def load_settings(
    conn: AsyncConn,
) -> tuple[list[QueueSettings], list[TenantSettings], list[KeySettings], float]:
    """The queues, the tenant overrides, the keys' limits and the database clock, in one round trip
    (a pipeline): on a slow link to the database every round trip of the dispatcher's periodic
    reload held up its fires."""
    async with conn.pipeline():
        queues = conn.cursor(row_factory=class_row(QueueSettings))
        tenants = conn.cursor(row_factory=class_row(TenantSettings))
        keys = conn.cursor(row_factory=class_row(KeySettings))
        clock = conn.cursor()
        await queues.execute(_static("mgr_queues"))
        await tenants.execute(_static("mgr_tenant_settings"))
        await keys.execute(_static("mgr_key_settings"))
        await clock.execute(_static("mgr_db_now"))
    try:
        row = await clock.fetchone()
        assert row is not None
        return await queues.fetchall(), await tenants.fetchall(), await keys.fetchall(), float(row[0])
    finally:
        for cur in (queues, tenants, keys, clock):
            await cur.close()


async def acquire(conn: AsyncConn, holder: str, ttl: float) -> int | None:
    row = await (await conn.execute(_static("mgr_acquire"), {"holder": holder, "ttl": ttl})).fetchone()
    return None if row is None or row[0] is None else int(row[0])


@dataclass(frozen=True, slots=True)
class LeaseView:
    """The lease as a standby reads it on each poll (``mgr_lease``)."""

    term: int
    #: the backend its holder renewed it from last (None: no holder, or a reshard's)
    holder_pid: int | None
    #: seconds until it expires by the database's clock; negative once it has
    expires_in: float
    #: that backend is still connected
    connected: bool


async def lease(conn: AsyncConn) -> LeaseView:
    row = await (await conn.execute(_static("mgr_lease"))).fetchone()
    assert row is not None, "qm.leader has its one row from the baseline revision on"
    return LeaseView(int(row[0]), None if row[1] is None else int(row[1]), float(row[2]), bool(row[3]))


async def take_over(conn: AsyncConn, holder: str, ttl: float, from_term: int, from_pid: int) -> int | None:
    """Take the lease of ``from_term`` whose holder's backend ``from_pid`` is gone (or any expired
    lease): the new term, or None (qm.take_over_leadership)."""
    params = {"holder": holder, "ttl": ttl, "from_term": from_term, "from_pid": from_pid}
    row = await (await conn.execute(_static("mgr_take_over"), params)).fetchone()
    return None if row is None or row[0] is None else int(row[0])


async def renew(conn: AsyncConn, holder: str, term: int, ttl: float) -> bool:
    row = await (await conn.execute(_static("mgr_renew"), {"holder": holder, "term": term, "ttl": ttl})).fetchone()
    return bool(row and row[0])


async def resign(conn: AsyncConn, holder: str, term: int) -> bool:
    row = await (await conn.execute(_static("mgr_resign"), {"holder": holder, "term": term})).fetchone()
    return bool(row and row[0])


async def arm(conn: AsyncConn, queue_ids: Sequence[int]) -> set[int]:
    """Take the wake locks that are free right now (never waits); returns the ids taken."""
    row = await (await conn.execute(_static("mgr_arm"), {"ids": list(queue_ids)})).fetchone()
    return set(row[0] or []) if row else set()


async def disarm(conn: AsyncConn, queue_id: int) -> float:
    """Give the queue's wake lock back; returns the database time before the release (epoch
    seconds): rows of producers that take the lock from then on are no older than it, less
    floors.HOLDER_MARGIN."""
    row = await (await conn.execute(_static("mgr_disarm"), {"id": queue_id})).fetchone()
    assert row is not None
    return float(row[0])


async def waiting_pids(conn: AsyncConn, pids: list[int]) -> list[int]:
    """Which of these backends wait for a wake-up lock right now."""
    cur = await conn.execute(_static("mgr_wake_lock_waiters"), {"pids": pids})
    return [int(r[0]) for r in await cur.fetchall()]


async def wait_wake_lock(conn: AsyncConn, queue_id: int) -> None:
    """Wait for the queue's wake-up lock (exclusive, for the session); disarm gives it back."""
    await conn.execute(_static("mgr_wait_wake_lock"), {"id": queue_id})


async def db_now(conn: AsyncConn) -> float:
    row = await (await conn.execute(_static("mgr_db_now"))).fetchone()
    assert row is not None
    return float(row[0])


#: a row of the window: id, tenant, partition, fire_at (epoch seconds), priority, concurrency_key, rate_key
ScanRow = tuple[int, str, int, float, int, str | None, str | None]


#: a fired event: id, tenant, partition, attempt, fire_at (epoch seconds), payload (JSON text), its
#: trace context (traceparent, tracestate, baggage; NULL when it has none), its priority and its keys
#: (concurrency_key, rate_key; NULL when it has none)
FiredRow = tuple[int, str, int, int, float, str, str | None, str | None, str | None, int, str | None, str | None]


async def scan(
    conn: AsyncConn,
    q: QueueSettings,
    future_only: bool = False,
    parts: Sequence[int] | None = None,
    floors: Sequence[float | None] | None = None,
    *,
    fire_first: tuple[int, list[int]] | None = None,
) -> tuple[list[ScanRow], int, float | None, list[FiredRow]]:
    """The queue's window (all partitions, or ``parts``): its rows, the per-partition quota, the
    database clock, and the rows fired by ``fire_first``. ``floors`` (by slot: partition *
    PRIORITY_LEVELS + level - 1) bound the scan below when it is not ``future_only``.

    ``fire_first``: (term, ids) of cached events due now, fired (as :func:`fire`) before the scan in the
    same round trip (a pipeline). The two statements then form one transaction (a pipeline's
    statements up to its sync do): the scan sees the fired rows as fired, both commit at the sync,
    and the sync's answer comes before any row is returned, so a fire still commits before anything
    is pushed. The scan takes no lock that the fire does not hold first (its queue table, which the
    fire locks before its fence: the lock order of docs/operations.md). On a slow link each round
    trip of the dispatcher holds up every fire queued behind it: a rescan that follows a notice no
    longer costs a round trip of its own before the due events of the cache go."""
    quota = max(1, math.ceil(q.cache_size / max(1, q.partitions_physical)))
    partitions = list(range(q.partitions_physical)) if parts is None else list(parts)
    params = {
        "parts": partitions,
        "levels": PRIORITY_LEVELS,
        "floors": _array(floors or ()),
        "window": q.window_seconds,
        "quota": quota,
        "future_only": future_only,
    }
    fired: list[FiredRow] = []
    if fire_first:
        async with conn.pipeline():
            fire_cur = conn.cursor()
            cur = conn.cursor()
            await fire_cur.execute(
                queue_sql("mgr_fire", q.name), _fire_params(q, *fire_first), prepare=True, binary=True
            )
            await cur.execute(queue_sql("mgr_scan", q.name), params, prepare=True)
        fired = await fire_cur.fetchall()
    else:
        cur = await _execute_prepared(conn, f"mgr_scan {q.name}", queue_sql("mgr_scan", q.name), params)
    rows = await cur.fetchall()
    clock = float(rows[0][4]) if rows else None
    return [(r[0], r[1], r[2], r[3], r[5], r[6], r[7]) for r in rows], quota, clock, fired


def _fire_params(q: QueueSettings, term: int, ids: list[int]) -> dict[str, Any]:
    return {"term": term, "ids": _ints(ids), "ack_timeout": q.ack_timeout_seconds, "queue_id": q.id}


async def fire(conn: AsyncConn, q: QueueSettings, term: int, ids: list[int]) -> list[FiredRow]:
    """Mark events fired; returns the rows fired (:data:`FiredRow`)."""
    statement = queue_sql("mgr_fire", q.name)
    # rows in binary: see fire_due
    cur = await _execute_prepared(conn, f"mgr_fire {q.name}", statement, _fire_params(q, term, ids), binary=True)
    return await cur.fetchall()


async def fire_due(
    conn: AsyncConn,
    q: QueueSettings,
    term: int,
    start: int,
    limit: int,
    floors: Sequence[float | None] | None = None,
    since: float | None = None,
    counts: Sequence[int] = tuple(range(1, PRIORITY_LEVELS + 1)),
    ties: Sequence[int] = tuple(range(PRIORITY_LEVELS)),
    caps: Mapping[tuple[int, int], int] | None = None,
) -> tuple[list[FiredRow], list[float | None], int]:
    """Fire up to ``limit`` events due now, the levels of the lowest count first (``counts`` of
    levels 1, 2, ..., levels of one count taking turns, ``ties`` saying which goes first:
    priority.py), within a level round-robin over partitions from ``start``, each (partition,
    level) from its floor (by slot, epoch seconds; None or missing = from the start) and up to its
    cap (``caps``; others: the quota); within a level, the streams whose earliest due event is not older than ``since``
    (database epoch seconds: the previous pick's time) first (plan.sparse_partitions).

    Returns the rows (as fire()), each level's oldest due event the pick read (epoch seconds, None:
    none; empty when nothing was fired), and the quota of each stream.
    """
    partitions = max(1, q.partitions_physical)
    quota = max(1, math.ceil(limit / partitions))
    cap_slots: list[int | None] = []
    for (p, v), n in (caps or {}).items():
        if p < partitions:
            slot = p * PRIORITY_LEVELS + v - 1
            cap_slots.extend([None] * (slot + 1 - len(cap_slots)))
            cap_slots[slot] = n
    cur = await _execute_prepared(
        conn,
        f"mgr_fire_due {q.name}",
        queue_sql("mgr_fire_due", q.name),
        {
            "term": term,
            "start": start % partitions,
            "partitions": partitions,
            "levels": PRIORITY_LEVELS,
            "quota": quota,
            "limit": limit,
            "floors": _array(floors or ()),
            "caps": _array(cap_slots),
            "counts": _ints(counts),
            "ties": _ints(ties),
            "since": since,
            "ack_timeout": q.ack_timeout_seconds,
            "queue_id": q.id,
        },
        # rows in binary: the numbers and the levels' array are not parsed from text (0.2 us of
        # the manager's CPU a fired event, docs/benchmarks.md, "End to end")
        binary=True,
    )
    rows = await cur.fetchall()
    return [r[:12] for r in rows], list(rows[0][12]) if rows else [], quota


async def fire_due_fair(
    conn: AsyncConn,
    q: QueueSettings,
    term: int,
    start: int,
    limit: int,
    pick: FairPick,
    floors: Sequence[float | None] | None = None,
    ckeys: KeyRooms = UNLIMITED,
    rkeys: KeyRooms = UNLIMITED,
    counts: Sequence[int] = tuple(range(1, PRIORITY_LEVELS + 1)),
    ties: Sequence[int] = tuple(range(PRIORITY_LEVELS)),
) -> tuple[list[FiredRow], int, int, list[float | None]]:
    """As :func:`fire_due`, within the tenants' shares and caps (``mgr_fire_due_fair``, see
    fairness.py) and the keys' rooms (``ckeys`` of concurrency keys, ``rkeys`` of rate keys, see
    keys.py): returns the rows, the per-partition quota of candidates, how many candidates were
    seen and each level's oldest candidate (as :func:`fire_due`)."""
    partitions = max(1, q.partitions_physical)
    quota, candidates = candidate_quota(limit, partitions)
    passed = bool(pick.capped or ckeys.blocked or rkeys.blocked)
    cur = await _execute_prepared(
        conn,
        f"mgr_fire_due_fair {q.name}",
        queue_sql("mgr_fire_due_fair", q.name),
        {
            "term": term,
            "start": start % partitions,
            "partitions": partitions,
            "levels": PRIORITY_LEVELS,
            "quota": quota,
            "window": quota + (CAP_LOOKAHEAD if passed else 0),
            "candidates": candidates,
            "limit": limit,
            "floors": _array(floors or ()),
            "counts": _ints(counts),
            "ties": _ints(ties),
            "capped": list(pick.capped),
            "tenants": list(pick.tenants),
            "ahead": _array(pick.ahead),
            "weights": _array(pick.weights),
            "rooms": _array(pick.rooms),
            "default_room": pick.default_room,
            "cblocked": list(ckeys.blocked),
            "ckeys": list(ckeys.keys),
            "crooms": _ints(ckeys.rooms),
            "cdefault": ckeys.default,
            "rblocked": list(rkeys.blocked),
            "rkeys": list(rkeys.keys),
            "rrooms": _ints(rkeys.rooms),
            "rdefault": rkeys.default,
            "ack_timeout": q.ack_timeout_seconds,
            "queue_id": q.id,
        },
    )
    rows = await cur.fetchall()
    seen = int(rows[0][12]) if rows else 0
    return [r[:12] for r in rows], quota, seen, list(rows[0][13]) if rows else []


def _array(values: Iterable[int | float | None]) -> str:
    """A numeric array as PostgreSQL's text literal, for a ``%(x)s::bigint[]``-style parameter.

    The statements cast the parameter, so it goes out as text of unknown type. Measured: 0.08 ms
    for two 500-element arrays, against 1.1 ms for psycopg's list dumper, on the manager's event
    loop for every ack batch. The values are ints and finite floats the manager produced itself.
    """
    return "{" + ",".join("NULL" if v is None else repr(v) for v in values) + "}"


def _ints(values: Iterable[int]) -> str:
    """As :func:`_array`, for ints only (the common case, without the per-value test)."""
    return "{" + ",".join(map(str, values)) + "}"


async def ack(conn: AsyncConn, q: QueueSettings, term: int, items: Sequence[tuple[int, int]]) -> set[int]:
    """fired -> acked for (id, attempt) pairs still fired at that attempt; returns the ids acked.
    A queue without retention (``retention_seconds`` 0) deletes them instead (``mgr_ack_delete``)."""
    cur = await conn.execute(
        queue_sql("mgr_ack_delete" if q.retention_seconds <= 0 else "mgr_ack", q.name),
        {"term": term, "ids": _ints(i for i, _ in items), "attempts": _ints(a for _, a in items), "queue_id": q.id},
        prepare=True,
    )
    row = await cur.fetchone()
    return set(row[0]) if row else set()


async def trace_contexts(conn: AsyncConn, q: QueueSettings, ids: Sequence[int]) -> list[str | None]:
    """The traceparents of these events (those that have one), for a sampled batch span."""
    cur = await conn.execute(queue_sql("mgr_trace_contexts", q.name), {"ids": _ints(ids)}, prepare=False)
    return [r[0] for r in await cur.fetchall()]


async def release(
    conn: AsyncConn, q: QueueSettings, term: int, items: Sequence[tuple[int, int, float | None, str | None]]
) -> tuple[set[int], set[int], float]:
    """Back to to_be_fired (or failed at max attempts); returns (moved ids, of which dead-lettered,
    the database time of the release: no moved event is due before it)."""
    cur = await conn.execute(
        queue_sql("mgr_release", q.name),
        {
            "term": term,
            "ids": _ints(i[0] for i in items),
            "attempts": _ints(i[1] for i in items),
            "delays": _array(i[2] for i in items),
            "errors": [i[3] for i in items],
            "max_attempts": q.max_attempts,
            "backoff_min": q.backoff_min_seconds,
            "backoff_max": q.backoff_max_seconds,
            "queue_id": q.id,
        },
    )
    row = await cur.fetchone()
    assert row is not None  # an aggregate: always one row
    return set(row[0]), set(row[1]), float(row[3])


async def extend(
    conn: AsyncConn, q: QueueSettings, term: int, items: Sequence[tuple[int, int, float]]
) -> dict[int, float]:
    cur = await conn.execute(
        queue_sql("mgr_extend", q.name),
        {
            "term": term,
            "ids": _ints(i[0] for i in items),
            "attempts": _ints(i[1] for i in items),
            "seconds": _array(i[2] for i in items),
        },
    )
    return {int(r[0]): float(r[1]) for r in await cur.fetchall()}


async def sweep(
    conn: AsyncConn, q: QueueSettings, term: int, resume_at: float | None = None, page: int = SWEEP_PAGE
) -> tuple[set[int], set[int], int, float | None, float | None]:
    """Re-fire events past their ack deadline (deadlines from ``resume_at`` on, epoch seconds), page by page;
    returns (moved, dead-lettered, pages, the database time of the first page, the earliest
    deadline of an overdue event the last page left fired: one an application holds locked)."""
    moved: set[int] = set()
    failed: set[int] = set()
    pages = 0
    at: float | None = None
    held: float | None = None
    while True:
        cur = await conn.execute(
            queue_sql("mgr_sweep", q.name),
            {
                "term": term,
                "resume_at": resume_at,
                "limit": page,
                "max_attempts": q.max_attempts,
                "backoff_min": q.backoff_min_seconds,
                "backoff_max": q.backoff_max_seconds,
                "queue_id": q.id,
            },
        )
        row = await cur.fetchone()
        pages += 1
        if row is None:
            break
        if at is None:
            at = float(row[4])
        held = None if row[5] is None else float(row[5])
        moved.update(row[0])
        failed.update(row[1])
        # a full page of candidates means more may wait; rows it could not lock were skipped
        if int(row[3]) < page or not row[0]:
            break
    return moved, failed, pages, at, held


@dataclass(frozen=True, slots=True)
class InFlight:
    """What a session starting finds of one queue's fired events (:func:`in_flight`)."""

    #: the ids of the deliveries asked about that are still fired at their attempt (``mgr_in_hand``)
    still: set[int]
    #: (id, attempt) fired under the term asked about (``mgr_fired_in_term``), empty when not asked
    in_term: list[tuple[int, int]]
    #: (id, attempt, tenant, concurrency key) of the fired events with a key (``mgr_fired_keys``)
    keys: list[tuple[int, int, str, str]]


async def in_flight(
    conn: AsyncConn, asks: Sequence[tuple[QueueSettings, Sequence[tuple[int, int]]]], term: int | None
) -> list[InFlight]:
    """For each (queue, deliveries in hand): which are still fired, what was fired under ``term``
    (when given) and the fired events with a concurrency key (:class:`InFlight`), every queue's in
    one round trip (a pipeline).
    A session's start read them one after the other, three round trips a queue, each one more wait
    of a restart on a slow or lossy link."""
    if not asks:
        return []
    cursors = []
    async with conn.pipeline():
        for q, held in asks:
            still = None
            if held:
                still = await conn.execute(
                    queue_sql("mgr_in_hand", q.name),
                    {"ids": _ints(i for i, _ in held), "attempts": _ints(a for _, a in held)},
                )
            in_term = None
            if term is not None:
                in_term = await conn.execute(queue_sql("mgr_fired_in_term", q.name), {"term": term})
            cursors.append((still, in_term, await conn.execute(queue_sql("mgr_fired_keys", q.name))))
    out = []
    for still, in_term, keys in cursors:
        out.append(
            InFlight(
                still=set() if still is None else {int(r[0]) for r in await still.fetchall()},
                in_term=[] if in_term is None else [(int(r[0]), int(r[1])) for r in await in_term.fetchall()],
                keys=[(int(r[0]), int(r[1]), str(r[2]), str(r[3])) for r in await keys.fetchall()],
            )
        )
    return out


async def settled(conn: AsyncConn, q: QueueSettings, term: int, parts: Sequence[int]) -> None:
    """Count events settled by SQL as done (one partition entry each)."""
    await conn.execute(queue_sql("mgr_settled", q.name), {"term": term, "queue_id": q.id, "parts": _ints(parts)})


async def wake_lock_holders(
    conn: AsyncConn, queue_ids: Sequence[int]
) -> tuple[dict[int, dict[int, float | None]], float]:
    """Per queue, the producer transactions holding its wake-up lock (pid -> transaction start,
    epoch seconds; None for one caught while it commits), and the database time of the reading.

    A cheap probe first (a try of each lock, given back at once); the lock table is read only for
    the queues whose lock is held, which a drain without producers never pays."""
    cur = await _execute_prepared(conn, "mgr_wake_lock_probe", _static("mgr_wake_lock_probe"), {"ids": list(queue_ids)})
    out: dict[int, dict[int, float | None]] = {qid: {} for qid in queue_ids}
    held = []
    at = 0.0
    for qid, is_held, clock in await cur.fetchall():
        at = float(clock)
        if is_held:
            held.append(int(qid))
    if not held:
        return out, at
    cur = await _execute_prepared(conn, "mgr_wake_lock_holders", _static("mgr_wake_lock_holders"), {"ids": held})
    for qid, pid, start, clock in await cur.fetchall():
        at = float(clock)
        if qid is not None:
            out[int(qid)][int(pid)] = None if start is None else float(start)
    return out, at


#: how long a reconciliation slice's count may run, ms: a partition of 10 000 live events is counted
#: in 2-10 ms (docs/manager.md, "Maintenance slices"); under a held snapshot a count walks dead index
#: entries for 100-400 ms, and this bound keeps such tries cheap until vacuum has run
RECONCILE_SLICE_TIMEOUT_MS = 50


async def connect_maintenance(dsn: str, application_name: str) -> AsyncConn:
    """The connection of a process's maintenance slices: short lock and statement timeouts, so that
    a slice that meets a conflict gives up (and is counted aborted) instead of queueing behind it."""
    options = (
        f"-c statement_timeout={SLICE_STATEMENT_TIMEOUT_MS} -c lock_timeout={SLICE_LOCK_TIMEOUT_MS} "
        "-c idle_in_transaction_session_timeout=5000 "
        + " ".join(f"-c {name}={value}" for name, value in PLANNER_SETTINGS.items())
        + " "
        + MANAGER_ROLE_OPTION
    )
    return await psycopg.AsyncConnection.connect(
        dsn, autocommit=True, application_name=application_name[:63], options=options, connect_timeout=5
    )


async def slice_purge(conn: AsyncConn, q: QueueSettings, partition: int, limit: int) -> tuple[int, int, bool]:
    """A retention slice of one partition: (acked deleted, failed deleted, whether a page was full)."""
    cur = await conn.execute(
        queue_sql("mgr_slice_purge", q.name),
        {
            "partition": partition,
            "retention": q.retention_seconds,
            "failed_retention": q.failed_retention_seconds,
            "limit": limit,
        },
        prepare=True,
    )
    row = await cur.fetchone()
    assert row is not None  # an aggregate: always one row
    return int(row[0]), int(row[1]), int(row[2]) >= limit


async def slice_reconcile(conn: AsyncConn, q: QueueSettings, partition: int) -> tuple[int, int, float]:
    """A reconciliation slice of one partition: (load before, live events, seconds in the server);
    the load is now the live events, up to what was in flight (docs/design.md, "Shuffle sharding").

    The count takes no lock and holds up no producer or ack, but it may run at most
    RECONCILE_SLICE_TIMEOUT_MS and gives up (statement timeout: counted aborted) beyond: under a
    held snapshot every count walks its partition's dead index entries (100-400 ms at 2 000
    events/s, docs/benchmarks-history.md, "Held snapshot"). A partition is reconciled again once its count
    is cheap (vacuum has run)."""
    # the connection's own timeout for this one statement (no transaction block around it)
    reset = f"SET statement_timeout = {SLICE_STATEMENT_TIMEOUT_MS}"
    await conn.execute(f"SET statement_timeout = {RECONCILE_SLICE_TIMEOUT_MS}")
    try:
        cur = await conn.execute(
            _static("mgr_slice_reconcile"), {"queue": q.name, "partition": partition}, prepare=True
        )
        row = await cur.fetchone()
    except psycopg.Error:
        if not conn.closed:
            with contextlib.suppress(psycopg.Error):
                await conn.execute(reset)
        raise
    await conn.execute(reset)
    assert row is not None and row[0] is not None
    before, live = row[0]
    return int(before), int(live), float(row[1])


async def count_maintenance(conn: AsyncConn, job: str, what: str, n: int = 1) -> None:
    """Count a maintenance slice shard-wide (``what``: recruited, finished, aborted or events)."""
    await conn.execute(_static("mgr_count_maintenance"), {"job": job, "what": what, "n": n}, prepare=True)


@dataclass(frozen=True, slots=True)
class LeaseRow:
    """One limited queue's lease row, as this manager publishes it (``None``: no such limit)."""

    queue: str
    want_qps: float | None
    claim_qps: float | None
    pending_qps: bool
    want_concurrency: float | None
    claim_concurrency: float | None
    pending_concurrency: bool


@dataclass(frozen=True, slots=True)
class PeerLease:
    """Another shard's lease row of one queue, as one database holds it."""

    queue: str
    shard: str
    term: int
    seq: int
    resigned: bool
    ttl_seconds: float
    #: by that database's own clock
    live: bool
    want_qps: float | None
    claim_qps: float | None
    pending_qps: bool
    want_concurrency: float | None
    claim_concurrency: float | None
    pending_concurrency: bool


async def rate_publish(
    conn: AsyncConn,
    shard: str,
    holder: str,
    term: int,
    ttl: float,
    rows: Sequence[LeaseRow],
    resigned: bool = False,
) -> int:
    """Write this manager's lease rows into ``conn``'s database; how many were written (fewer when
    a newer leader of this shard wrote them there)."""
    cur = await conn.execute(
        _static("mgr_rate_publish"),
        {
            "shard": shard,
            "holder": holder,
            "term": term,
            "ttl": ttl,
            "resigned": resigned,
            "queues": [r.queue for r in rows],
            "want_qps": [r.want_qps for r in rows],
            "claim_qps": [r.claim_qps for r in rows],
            "pending_qps": [r.pending_qps for r in rows],
            "want_c": [r.want_concurrency for r in rows],
            "claim_c": [r.claim_concurrency for r in rows],
            "pending_c": [r.pending_concurrency for r in rows],
        },
        prepare=True,
    )
    row = await cur.fetchone()
    return int(row[0]) if row else 0


async def rate_view(conn: AsyncConn, shard: str, queues: Sequence[str]) -> list[PeerLease]:
    """The other shards' lease rows of ``queues`` in this database."""
    async with conn.cursor(row_factory=class_row(PeerLease)) as cur:
        await cur.execute(_static("mgr_rate_view"), {"shard": shard, "queues": list(queues)}, prepare=True)
        return await cur.fetchall()
