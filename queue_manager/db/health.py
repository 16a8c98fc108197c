"""Reading a shard's database health (the statements of ``sql/health.sql``), for ``qm status``
(synchronous) and the manager's health gauges (asynchronous): the same statements, the same result."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import psycopg
from psycopg.rows import dict_row

from queue_manager.db.sqlfiles import query
from queue_manager.domain.health import Horizon, ShardHealth, Slot, TableHealth, from_row

#: the statements of one reading, in order
STATEMENTS: tuple[tuple[str, str], ...] = (
    ("xmin_horizon", "queries.sql"),
    ("health_notify", "health.sql"),
    ("health_slots", "health.sql"),
    ("health_tables", "health.sql"),
    ("health_indexes", "health.sql"),
)

Rows = Sequence[Mapping[str, Any]]


def assemble(results: Sequence[Rows]) -> ShardHealth:
    """A :class:`ShardHealth` from the rows of :data:`STATEMENTS`, in their order."""
    horizon, notify, slots, tables, indexes = results
    by_queue: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for r in indexes:
        by_queue[r["queue"]].append(r)
    return ShardHealth(
        horizon=from_row(Horizon, horizon[0]) if horizon else None,
        notify_queue_usage=float(notify[0]["usage"]) if notify else 0.0,
        slots=tuple(from_row(Slot, r) for r in slots),
        tables=tuple(TableHealth.from_rows(r, by_queue.get(r["queue"], [])) for r in tables),
    )


def read_health(conn: psycopg.Connection[Any]) -> ShardHealth:
    """One reading on ``conn`` (any connection to the shard's database)."""
    results = []
    with conn.cursor(row_factory=dict_row) as cur:
        for name, filename in STATEMENTS:
            results.append(cur.execute(query(name, filename)).fetchall())
    return assemble(results)


async def aread_health(conn: psycopg.AsyncConnection[Any]) -> ShardHealth:
    """:func:`read_health` on an asynchronous connection."""
    results = []
    async with conn.cursor(row_factory=dict_row) as cur:
        for name, filename in STATEMENTS:
            await cur.execute(query(name, filename))
            results.append(await cur.fetchall())
    return assemble(results)
