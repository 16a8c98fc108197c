"""The benchmark queue's contents between measurements: emptied, preloaded, counted."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql

from benchmarks.lib.server import QUEUE
from queue_manager.producer import Event, enqueue_batch

logger = logging.getLogger("bench")


def reset(dsn: str, queue: str = QUEUE) -> None:
    """Empty the queue, re-anchor its load counters and flush dirty pages (no manager may run)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("TRUNCATE {}").format(sql.Identifier(queue)))
        conn.execute("SELECT qm.reconcile_load(%s)", (queue,))
        checkpoint(conn)


def checkpoint(conn: psycopg.Connection[Any]) -> None:
    """CHECKPOINT, so a measurement does not pay for the writes of the one before."""
    try:
        conn.execute("CHECKPOINT")
    except psycopg.errors.InsufficientPrivilege:
        logger.warning("CHECKPOINT refused (needs superuser or pg_checkpoint); measuring without it")


def preload(dsn: str, events: Sequence[Event], queue: str = QUEUE) -> float:
    """Insert the events in one transaction (COPY), then ANALYZE and CHECKPOINT; returns the load time."""
    t = time.perf_counter()
    with psycopg.connect(dsn) as conn:
        inserted = enqueue_batch(conn, queue, events)
        conn.commit()
    elapsed = time.perf_counter() - t
    if inserted != len(events):
        raise RuntimeError(f"preload inserted {inserted} of {len(events)} events")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("ANALYZE {}").format(sql.Identifier(queue)))
        checkpoint(conn)
    return elapsed


def state_counts(dsn: str, queue: str = QUEUE) -> dict[str, Any]:
    """Events per state, and how many were fired more than once."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            sql.SQL("SELECT state::text, count(*), count(*) FILTER (WHERE attempts > 1) FROM {} GROUP BY 1").format(
                sql.Identifier(queue)
            )
        ).fetchall()
    return {"states": {r[0]: int(r[1]) for r in rows}, "refired": sum(int(r[2]) for r in rows)}


def count_where(dsn: str, where: str, *params: Any, queue: str = QUEUE) -> int:
    """How many events match ``where`` (a fixed condition, its %s parameters ``params``)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            sql.SQL("SELECT count(*) FROM {} WHERE " + where).format(sql.Identifier(queue)), params
        ).fetchone()
    return int(row[0]) if row else 0


def wait_none_left(dsn: str, where: str, *params: Any, timeout: float = 30.0, queue: str = QUEUE) -> None:
    """Wait until no event matches ``where`` (:func:`count_where`), ``timeout`` seconds at the most:
    the run's report then shows what was not received."""
    deadline = time.monotonic() + timeout
    while count_where(dsn, where, *params, queue=queue) and time.monotonic() < deadline:
        time.sleep(0.1)


def event_rows(dsn: str, where: str, param: Any, queue: str = QUEUE) -> list[dict[str, Any]]:
    """Up to 10 events matching ``where`` (a fixed condition with one %s parameter), as the
    database has them now: what a report shows of events that went missing."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            sql.SQL(
                "SELECT id, state::text, attempts, partition, payload::text, extract(epoch FROM fire_at)::float8, "
                "extract(epoch FROM created_at)::float8, extract(epoch FROM fired_at)::float8, "
                "extract(epoch FROM now())::float8 FROM {} WHERE " + where + " ORDER BY id LIMIT 10"
            ).format(sql.Identifier(queue)),
            (param,),
        ).fetchall()
    keys = ("id", "state", "attempts", "partition", "payload", "fire_at", "created_at", "fired_at", "db_now")
    return [dict(zip(keys, r, strict=True)) for r in rows]
