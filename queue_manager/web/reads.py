"""What the dashboard reads from the shards, page by page (its actions are the admin API's,
``queue_manager.admin``, given the same pools). Queries are the named blocks of ``db/sql/web.sql``.

The overview's reading (:func:`live`) scans no queue table: live events come from the
partitions' load counters, the rest from bounded reads of the partial indexes and from the index
statistics (labelled as estimates), so its cost does not grow with the tables.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import psycopg
from psycopg import sql

from queue_manager import admin
from queue_manager.db.health import read_health
from queue_manager.db.sqlfiles import query
from queue_manager.domain.health import as_data as health_data
from queue_manager.domain.health import warnings as health_warnings
from queue_manager.domain.names import check_queue_name
from queue_manager.domain.topology import Shard
from queue_manager.errors import UnknownQueueError
from queue_manager.web.browse import MergedPage, ShardPage, merge
from queue_manager.web.filters import EventFilter
from queue_manager.web.readings import live_counts
from queue_manager.web.shards import Limits, Shards, on_error, web_query


def live(db: Shards, limits: Limits) -> dict[str, Any]:
    """The overview's reading of every shard, without a scan of a queue table (web.sql,
    ``web_live_queues`` and ``web_live_queue``): per queue, live events from the load counters
    (enqueued - done, per partition: approximate by design, docs/design.md "Shuffle sharding"),
    events in hand and dead letters counted up to ``count_cap``, due events up to ``due_cap``, the
    oldest due event's age, the pickup delay of the newest acked events, and acked (and dead
    letters past the cap) as estimates from the index statistics; per shard, the leader's lease.
    A shard that cannot be read gets ``error``."""
    shards: list[dict[str, Any]] = []
    for shard in db.shards:
        entry: dict[str, Any] = {"shard": shard.name, "range": str(shard.key_range)}
        try:
            with db.connect(shard) as conn:
                entry["leader"] = conn.execute(web_query("web_leader")).fetchone()
                entry["queues"] = [_live_queue(conn, row, limits) for row in conn.execute(web_query("web_live_queues"))]
        except psycopg.Error as exc:
            entry["error"] = f"unreachable: {str(exc).strip() or type(exc).__name__}"
        shards.append(entry)
    return {"shards": shards, "cap": limits.count_cap}


def _live_queue(conn: psycopg.Connection[dict[str, Any]], row: dict[str, Any], limits: Limits) -> dict[str, Any]:
    parts = int(row["partitions_physical"])
    bounded = conn.execute(
        sql.SQL(web_query("web_live_queue")).format(queue=sql.Identifier(row["name"])),
        {
            "cap": limits.count_cap,
            "parts": parts,
            "due_cap": max(1, limits.due_cap // parts),
            "recent": limits.pickup_sample,
            "recent_seconds": limits.pickup_window_seconds,
        },
    ).fetchone()
    assert bounded is not None
    enq = [int(v) for v in row["enq"] or []]
    done = [int(v) for v in row["done"] or []]
    return live_counts(
        row["name"],
        paused=bool(row["paused"]),
        partitions=int(row["partitions"]),
        enq=enq,
        done=done,
        fired=int(bounded["fired"]),
        failed=int(bounded["failed"]),
        cap=limits.count_cap,
        due_now=int(bounded["due_now"]),
        due_capped=bool(bounded["due_capped"]),
        oldest_due_age_seconds=bounded["oldest_due_age_seconds"],
        pickup_delays=list(bounded["pickup_delays"] or []),
        acked_estimate=row["acked_estimate"],
        failed_estimate=row["failed_estimate"],
    )


def database(db: Shards) -> dict[str, Any]:
    """The health page's reading of every shard: ``qm status``'s database health (catalog and
    statistics reads only: no queue table is scanned) and warnings, the maintenance slices, the
    newest Spark enqueue and archive runs and the transactions left prepared."""
    shards: list[dict[str, Any]] = []
    for shard in db.shards:
        entry: dict[str, Any] = {"shard": shard.name, "range": str(shard.key_range)}
        try:
            with db.connect(shard) as conn:
                reading = read_health(conn)
                entry["maintenance"] = {
                    str(r["job"]): {k: int(r[k]) for k in ("recruited", "finished", "aborted", "events")}
                    for r in conn.execute(query("maintenance_counts"))
                }
                entry["spark_runs"] = conn.execute(web_query("web_spark_runs"), {"limit": 10}).fetchall()
                entry["prepared"] = conn.execute(web_query("web_prepared"), {"limit": 10}).fetchall()
                entry["archive_runs"] = conn.execute(web_query("web_archive_runs"), {"limit": 10}).fetchall()
        except psycopg.Error as exc:
            entry["error"] = f"unreachable: {str(exc).strip() or type(exc).__name__}"
            shards.append(entry)
            continue
        entry["xmin_horizon"] = None if reading.horizon is None else asdict(reading.horizon)
        entry["health"] = health_data(reading)
        entry["warnings"] = health_warnings(reading)
        shards.append(entry)
    return {"shards": shards}


def exact_counts(db: Shards, queue: str) -> dict[str, dict[str, int] | str]:
    """A queue's exact counts by state per shard: a scan of each table (on demand), or why not."""
    check_queue_name(queue)
    out: dict[str, dict[str, int] | str] = {}
    for shard in db.shards:
        try:
            with db.connect(shard) as conn:
                statement = sql.SQL(web_query("web_exact_counts")).format(queue=sql.Identifier(queue))
                rows = conn.execute(statement).fetchall()
        except psycopg.Error as exc:
            out[shard.name] = str(on_error(shard, queue, exc))
            continue
        counts = {state: 0 for state in ("to_be_fired", "fired", "acked", "cancelled", "failed")}
        counts.update({r["state"]: int(r["n"]) for r in rows})
        out[shard.name] = counts
    return out


def queue_detail(db: Shards, queue: str, limits: Limits, snapshot: dict[str, Any]) -> dict[str, Any]:
    """A queue's settings, status per shard (from ``snapshot``, the shared overview reading),
    top tenants per shard and tenant overrides."""
    check_queue_name(queue)
    registry = admin.list_queues(db)
    settings = {name: next((r for r in rows if r["name"] == queue), None) for name, rows in registry.items()}
    if all(v is None for v in settings.values()):
        raise UnknownQueueError(f"no queue named {queue!r} on any shard")
    shards: list[dict[str, Any]] = []
    for shard in db.shards:
        entry: dict[str, Any] = {"shard": shard.name, "settings": settings.get(shard.name)}
        read: dict[str, Any] = next((e for e in snapshot.get("shards", []) if e["shard"] == shard.name), {})
        entry["status"] = next((q for q in read.get("queues", []) if q["queue"] == queue), None)
        try:
            with db.connect(shard) as conn:
                entry["tenants"] = conn.execute(
                    sql.SQL(web_query("web_top_tenants")).format(queue=sql.Identifier(queue)),
                    {"scan": limits.tenant_scan_rows, "limit": 10},
                ).fetchall()
                # the concurrency keys with the most events in hand, as qm status shows them
                entry["keys"] = conn.execute(
                    sql.SQL(query("queue_keys_in_hand")).format(queue=sql.Identifier(queue)),
                    {"queue": queue, "cap": limits.tenant_scan_rows, "top": 10},
                ).fetchall()
        except psycopg.Error as exc:
            entry["error"] = str(on_error(shard, queue, exc))
        shards.append(entry)
    first = next(v for v in settings.values() if v is not None)
    return {
        "queue": queue,
        "settings": first,
        "shards": shards,
        "overrides": admin.list_tenants(db, queue),
        "audit": admin.recent(db, limit=10, queue=queue),
        "snapshot": snapshot,
        "tenant_scan": limits.tenant_scan_rows,
    }


def filter_shards(db: Shards, flt: EventFilter | None) -> list[Shard]:
    """The shards where events matching ``flt`` can be: the one it names, and for a tenant only
    the tenant's own shard (the topology's), since a tenant lives on one shard."""
    shards = list(db.shards)
    if flt is None:
        return shards
    if flt.shard is not None:
        shards = [s for s in shards if s.name == flt.shard]
    if flt.tenant is not None:
        home = db.shard_for(flt.tenant).name
        shards = [s for s in shards if s.name == home]
    return shards


def events_page(db: Shards, queue: str, flt: EventFilter, cursor: dict[str, int | None], limits: Limits) -> MergedPage:
    """One page of the event browser: newest first across the shards the filter can match on,
    keyset-paged (browse.py)."""
    check_queue_name(queue)
    table = sql.Identifier(queue)
    base = flt.params()
    looked = {s.name for s in filter_shards(db, flt)}
    cursor = {name: (v if name in looked else None) for name, v in cursor.items()}
    pages: dict[str, ShardPage] = {}
    for shard in db.shards:
        position = cursor.get(shard.name)
        if position is None:
            continue
        before = position or None
        try:
            with db.connect(shard) as conn:
                if flt.event_id is not None:
                    rows = conn.execute(sql.SQL(web_query("web_events_by_id")).format(queue=table), base).fetchall()
                    rows = [r for r in rows if before is None or r["id"] < before]
                    pages[shard.name] = ShardPage(rows, True, None)
                    continue
                params = {**base, "before": before, "scan": limits.scan_rows, "limit": limits.page_size}
                rows = conn.execute(sql.SQL(web_query("web_events_page")).format(queue=table), params).fetchall()
                if len(rows) == limits.page_size:
                    pages[shard.name] = ShardPage(rows, False, rows[-1]["id"])
                    continue
                scanned = conn.execute(sql.SQL(web_query("web_events_scanned")).format(queue=table), params).fetchone()
        except psycopg.Error as exc:
            raise on_error(shard, queue, exc) from None
        assert scanned is not None
        capped = scanned["scanned"] >= limits.scan_rows
        pages[shard.name] = ShardPage(rows, not capped, scanned["floor"] if capped else None)
    return merge(cursor, pages, limits.page_size)


def event(db: Shards, queue: str, shard_name: str, event_id: int) -> dict[str, Any] | None:
    """One event, whole, or None."""
    check_queue_name(queue)
    shard = db.by_name(shard_name)
    try:
        with db.connect(shard) as conn:
            return conn.execute(
                sql.SQL(web_query("web_event")).format(queue=sql.Identifier(queue)), {"id": event_id}
            ).fetchone()
    except psycopg.Error as exc:
        raise on_error(shard, queue, exc) from None


