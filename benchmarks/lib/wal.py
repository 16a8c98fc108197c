"""What a measured interval wrote to the WAL: its bytes, and its commit records (the commits that
wrote something, each of which waits for a WAL flush by default). The driver only (psycopg), so the
peers' benchmarks (``benchmarks/peers``, run in their own virtualenv) measure it the same way."""

from __future__ import annotations

import logging
from typing import Any

import psycopg

logger = logging.getLogger("bench.wal")


def insert_lsn(conn: psycopg.Connection[Any]) -> str:
    row = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
    assert row is not None
    return str(row[0])


def wal_cost(dsn: str, start: str, end: str) -> dict[str, int | None]:
    """``bytes`` of WAL between two positions and ``commits``: its transaction commit records
    (``pg_walinspect``; None when the extension is missing or the WAL is gone)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_wal_lsn_diff(%s::pg_lsn, %s::pg_lsn)::bigint", (end, start)).fetchone()
        assert row is not None
        out: dict[str, int | None] = {"bytes": int(row[0]), "commits": None}
        try:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
            got = conn.execute(
                "SELECT coalesce(sum(count), 0)::bigint FROM pg_get_wal_stats(%s::pg_lsn, %s::pg_lsn, true) "
                "WHERE \"resource_manager/record_type\" = 'Transaction/COMMIT'",
                (start, end),
            ).fetchone()
            out["commits"] = int(got[0]) if got else None
        except psycopg.Error as exc:
            logger.warning("WAL commit records not read: %s", str(exc).strip()[:200])
    return out
