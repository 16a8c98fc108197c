"""What the dashboard reads from and does to the shards: the only module of the web package that
touches PostgreSQL.

Every connection runs under a statement timeout (:func:`guarded`), and the admin functions
(``queue_manager.admin``) are reused through that guarded topology: the overview's counts and
database health are ``qm status``'s. Queries are the named blocks of ``db/sql/web.sql``.

Bulk actions are safe against a running manager: they change only rows in a state no manager
holds in hand (``failed``), with UPDATEs whose WHERE clause states that state, in slices of their
own short transactions, each slice counted in the audit row in the same transaction.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg import errors as pg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import dict_row

from queue_manager import admin
from queue_manager.db.sqlfiles import query
from queue_manager.domain.names import check_queue_name
from queue_manager.domain.topology import Shard, Topology
from queue_manager.errors import QueueManagerError, UnknownQueueError
from queue_manager.web.browse import MergedPage, ShardPage, merge
from queue_manager.web.filters import EventFilter

logger = logging.getLogger(__name__)

WEB_SQL = "web.sql"


@dataclass(frozen=True)
class Limits:
    """The dashboard's cost guards (docs/dashboard.md, "Cost guards")."""

    #: every statement of the dashboard is cancelled after this long, milliseconds
    statement_timeout_ms: int = 5000
    #: rows per page of the event browser
    page_size: int = 50
    #: newest rows one page of the event browser looks at per shard, at most
    scan_rows: int = 20_000
    #: live events the top-tenants table looks at per shard, at most
    tenant_scan_rows: int = 20_000
    #: most events one bulk action may change
    bulk_cap: int = 10_000
    #: events changed per transaction of a bulk action
    bulk_slice: int = 500


def guarded(topology: Topology, limits: Limits) -> Topology:
    """The topology with every DSN carrying the statement timeout and an application name."""
    shards = []
    for s in topology.shards:
        params = conninfo_to_dict(s.dsn)
        options = str(params.get("options") or "")
        options = f"{options} -c statement_timeout={int(limits.statement_timeout_ms)}".strip()
        dsn = make_conninfo(s.dsn, options=options, application_name="qm-web")
        shards.append(Shard(s.name, dsn, s.key_range))
    return Topology(tuple(shards))


class DashboardError(QueueManagerError):
    """A dashboard request failed in a way the person can act on."""


def _q(name: str) -> Any:
    """A named query of web.sql, the event filters (block ``web_event_filters``) put in where it
    says ``{filters}``: one text for the browser's page, its id lookup and the bulk actions."""
    text = query(name, WEB_SQL)
    if "{filters}" in text:
        filters = query("web_event_filters", WEB_SQL)
        text = text.replace("{filters}", "\n".join(x for x in filters.splitlines() if not x.lstrip().startswith("--")))
    return text


@contextmanager
def _connect(shard: Shard, autocommit: bool = True) -> Iterator[psycopg.Connection[dict[str, Any]]]:
    with psycopg.connect(shard.dsn, autocommit=autocommit, row_factory=dict_row, connect_timeout=5) as conn:
        yield conn


def _on(shard: Shard, queue: str, exc: psycopg.Error) -> QueueManagerError:
    if isinstance(exc, pg.UndefinedTable):
        return UnknownQueueError(f"no queue named {queue!r} on shard {shard.name!r}")
    if isinstance(exc, pg.QueryCanceled):
        return DashboardError(
            f"shard {shard.name!r}: the query ran past the dashboard's statement timeout; narrow the filter "
            "(an id, or a tenant and a dedup key, are looked up by index)"
        )
    return DashboardError(f"shard {shard.name!r}: {str(exc).strip()}")


# ------------------------------------------------------------------------------------ reading


def overview(topology: Topology) -> dict[str, Any]:
    """``qm status`` (counts by state, depth, oldest due age, database health), each shard's lease,
    its newest Spark enqueue runs and the transactions left prepared."""
    data = admin.status(topology)
    for entry in data["shards"]:
        if "error" in entry:
            continue
        try:
            with _connect(topology.by_name(entry["shard"])) as conn:
                entry["leader"] = conn.execute(_q("web_leader")).fetchone()
                entry["spark_runs"] = conn.execute(_q("web_spark_runs"), {"limit": 10}).fetchall()
                entry["prepared"] = conn.execute(_q("web_prepared"), {"limit": 10}).fetchall()
        except psycopg.Error as exc:
            entry["leader"] = None
            entry["leader_error"] = str(exc).strip()
    return data


def queue_detail(topology: Topology, queue: str, limits: Limits, snapshot: dict[str, Any]) -> dict[str, Any]:
    """A queue's settings, status per shard (from ``snapshot``, the shared overview reading),
    top tenants per shard and tenant overrides."""
    check_queue_name(queue)
    registry = admin.list_queues(topology)
    settings = {name: next((r for r in rows if r["name"] == queue), None) for name, rows in registry.items()}
    if all(v is None for v in settings.values()):
        raise UnknownQueueError(f"no queue named {queue!r} on any shard")
    shards: list[dict[str, Any]] = []
    for shard in topology.shards:
        entry: dict[str, Any] = {"shard": shard.name, "settings": settings.get(shard.name)}
        read: dict[str, Any] = next((e for e in snapshot.get("shards", []) if e["shard"] == shard.name), {})
        entry["status"] = next((q for q in read.get("queues", []) if q["queue"] == queue), None)
        try:
            with _connect(shard) as conn:
                entry["tenants"] = conn.execute(
                    sql.SQL(_q("web_top_tenants")).format(queue=sql.Identifier(queue)),
                    {"scan": limits.tenant_scan_rows, "limit": 10},
                ).fetchall()
        except psycopg.Error as exc:
            entry["error"] = str(_on(shard, queue, exc))
        shards.append(entry)
    first = next(v for v in settings.values() if v is not None)
    return {
        "queue": queue,
        "settings": first,
        "shards": shards,
        "overrides": admin.list_tenants(topology, queue),
        "audit": audit(topology, limit=10, queue=queue),
        "snapshot": snapshot,
        "tenant_scan": limits.tenant_scan_rows,
    }


def events_page(
    topology: Topology, queue: str, flt: EventFilter, cursor: dict[str, int | None], limits: Limits
) -> MergedPage:
    """One page of the event browser: newest first across the shards, keyset-paged (browse.py)."""
    check_queue_name(queue)
    table = sql.Identifier(queue)
    base = flt.params()
    pages: dict[str, ShardPage] = {}
    for shard in topology.shards:
        position = cursor.get(shard.name)
        if position is None or (flt.shard is not None and flt.shard != shard.name):
            continue
        before = position or None
        try:
            with _connect(shard) as conn:
                if flt.event_id is not None:
                    rows = conn.execute(sql.SQL(_q("web_events_by_id")).format(queue=table), base).fetchall()
                    rows = [r for r in rows if before is None or r["id"] < before]
                    pages[shard.name] = ShardPage(rows, True, None)
                    continue
                params = {**base, "before": before, "scan": limits.scan_rows, "limit": limits.page_size}
                rows = conn.execute(sql.SQL(_q("web_events_page")).format(queue=table), params).fetchall()
                if len(rows) == limits.page_size:
                    pages[shard.name] = ShardPage(rows, False, rows[-1]["id"])
                    continue
                scanned = conn.execute(sql.SQL(_q("web_events_scanned")).format(queue=table), params).fetchone()
        except psycopg.Error as exc:
            raise _on(shard, queue, exc) from None
        assert scanned is not None
        capped = scanned["scanned"] >= limits.scan_rows
        pages[shard.name] = ShardPage(rows, not capped, scanned["floor"] if capped else None)
    if flt.shard is not None:
        cursor = {name: (v if name == flt.shard else None) for name, v in cursor.items()}
    return merge(cursor, pages, limits.page_size)


def event(topology: Topology, queue: str, shard_name: str, event_id: int) -> dict[str, Any] | None:
    """One event, whole, or None."""
    check_queue_name(queue)
    shard = topology.by_name(shard_name)
    try:
        with _connect(shard) as conn:
            return conn.execute(
                sql.SQL(_q("web_event")).format(queue=sql.Identifier(queue)), {"id": event_id}
            ).fetchone()
    except psycopg.Error as exc:
        raise _on(shard, queue, exc) from None


def audit(topology: Topology, limit: int = 50, queue: str | None = None) -> list[dict[str, Any]]:
    """The newest audit rows of every shard, newest first."""
    out: list[dict[str, Any]] = []
    for shard in topology.shards:
        try:
            with _connect(shard) as conn:
                rows = conn.execute(_q("web_audit_recent"), {"limit": limit}).fetchall()
        except psycopg.Error:
            continue
        out += [{"shard": shard.name, **r} for r in rows if queue is None or r["queue"] == queue]
    out.sort(key=lambda r: r["at"], reverse=True)
    return out[:limit]


def health(topology: Topology) -> dict[str, Any]:
    """Database health per shard, as ``qm status`` computes it."""
    return admin.status(topology)


# ------------------------------------------------------------------------------------ actions


Selection = dict[str, list[int]]


@dataclass(frozen=True)
class BulkAction:
    """A bulk action of the event browser: the one state of the events it may change (a state no
    manager holds in hand) and how the pages name it."""

    #: the action's name in forms and in the audit table
    name: str
    #: the state of the events it changes
    target: str
    #: only events not yet due
    future: bool
    #: "Retry 12 dead letters", "Fire 12 scheduled events now", ...
    verb: str
    noun: str
    #: what it does, on the confirmation page
    effect: str


ACTIONS = {
    a.name: a
    for a in (
        BulkAction(
            "retry_dead",
            "failed",
            False,
            "Retry",
            "dead letters",
            "back in the queue, due now, with a fresh attempt budget",
        ),
        BulkAction(
            "fire_now",
            "to_be_fired",
            True,
            "Fire now",
            "scheduled events",
            "due now instead of at their fire_at: the manager fires each once",
        ),
        BulkAction(
            "reschedule",
            "to_be_fired",
            False,
            "Reschedule",
            "events not yet fired",
            "due at the new time (never fired before it)",
        ),
        BulkAction(
            "cancel",
            "to_be_fired",
            True,
            "Cancel",
            "scheduled events",
            "deleted before they fire: never delivered, counted done in their partitions' load",
        ),
    )
}


def _action_params(action: BulkAction, flt: EventFilter | None, ids: Sequence[int] | None) -> dict[str, Any]:
    params = (flt or EventFilter()).params()
    params.update(ids=list(ids) if ids is not None else None, target=action.target, future=action.future)
    return params


def _targets(topology: Topology, flt: EventFilter | None, selection: Selection | None) -> list[Shard]:
    if selection is not None:
        return [s for s in topology.shards if selection.get(s.name)]
    if flt is not None and flt.shard is not None:
        return [topology.by_name(flt.shard)]
    return list(topology.shards)


def count_targets(
    topology: Topology,
    queue: str,
    action: BulkAction,
    flt: EventFilter | None,
    selection: Selection | None,
    cap: int,
) -> dict[str, int]:
    """How many events ``action`` would change, per shard (each at most ``cap + 1``: more than
    the cap shows as cap + 1)."""
    check_queue_name(queue)
    table = sql.Identifier(queue)
    out: dict[str, int] = {}
    for shard in _targets(topology, flt, selection):
        params = _action_params(action, flt, None if selection is None else selection[shard.name])
        params.update(below=None, limit=cap + 1)
        try:
            with _connect(shard) as conn:
                found = conn.execute(sql.SQL(_q("web_action_ids")).format(queue=table), params).fetchall()
        except psycopg.Error as exc:
            raise _on(shard, queue, exc) from None
        out[shard.name] = len(found)
    return out


def _change(
    conn: psycopg.Connection[dict[str, Any]],
    table: sql.Identifier,
    queue: str,
    action: BulkAction,
    ids: list[int],
    fire_at: datetime | None,
) -> int:
    """One slice's change, in the caller's transaction; how many events changed."""
    if action.name == "retry_dead":
        # qm events retry's statement: failed -> to_be_fired, the partitions' load counters bumped
        done = conn.execute(
            sql.SQL(query("events_retry", "manager.sql")).format(queue=table),
            {"ids": ids, "tenant": None, "queue": queue},
        ).fetchall()
        if done:  # delivered at commit: the manager fires them without waiting for a rescan
            conn.execute(query("events_wake", "manager.sql"), {"queue": queue})
        return len(done)
    if action.name == "fire_now":
        return len(conn.execute(sql.SQL(_q("web_fire_now")).format(queue=table), {"ids": ids}).fetchall())
    if action.name == "reschedule":
        assert fire_at is not None
        return len(
            conn.execute(sql.SQL(_q("web_reschedule")).format(queue=table), {"ids": ids, "fire_at": fire_at}).fetchall()
        )
    if action.name == "cancel":
        row = conn.execute(sql.SQL(_q("web_cancel")).format(queue=table), {"ids": ids, "queue": queue}).fetchone()
        assert row is not None
        return len(row["ids"])
    raise AssertionError(f"unknown action {action.name!r}")  # pragma: no cover


def run_action(
    topology: Topology,
    queue: str,
    action: BulkAction,
    flt: EventFilter | None,
    selection: Selection | None,
    *,
    actor: str,
    description: str,
    cap: int,
    slice_size: int,
    fire_at: datetime | None = None,
    requested: dict[str, int] | None = None,
) -> dict[str, int]:
    """Do ``action`` in slices to the events of ``selection`` (shard -> ids) or all matching
    ``flt``, at most ``cap`` in all. Each slice selects its ids and changes them with a
    state-guarded UPDATE (a DELETE for cancel) in one transaction, with its count added to the
    shard's audit row; an event a manager or another action changed in between is simply not
    changed. Returns the events changed per shard."""
    check_queue_name(queue)
    if action.name == "reschedule" and fire_at is None:
        raise DashboardError("reschedule: give the new fire_at")
    table = sql.Identifier(queue)
    remaining = cap
    changed: dict[str, int] = {}
    for shard in _targets(topology, flt, selection):
        ids = None if selection is None else selection[shard.name]
        changed[shard.name] = 0
        audit_filter = description if fire_at is None else f"{description}; fire_at {fire_at.isoformat()}"
        try:
            with _connect(shard) as conn:
                row = conn.execute(
                    _q("web_audit_start"),
                    {
                        "actor": actor,
                        "action": action.name,
                        "queue": queue,
                        "filter": audit_filter,
                        "requested": len(ids) if ids is not None else (requested or {}).get(shard.name, remaining),
                    },
                ).fetchone()
                assert row is not None
                audit_id = row["id"]
                below = None
                while remaining > 0:
                    limit = min(slice_size, remaining)
                    with conn.transaction():
                        params = {**_action_params(action, flt, ids), "below": below, "limit": limit}
                        found = [
                            r["id"] for r in conn.execute(sql.SQL(_q("web_action_ids")).format(queue=table), params)
                        ]
                        if not found:
                            break
                        n = _change(conn, table, queue, action, found, fire_at)
                        conn.execute(_q("web_audit_progress"), {"n": n, "audit": audit_id})
                    below = min(found)
                    remaining -= n
                    changed[shard.name] += n
                    if len(found) < limit:
                        break
                conn.execute(_q("web_audit_finish"), {"audit": audit_id})
        except psycopg.Error as exc:
            raise _on(shard, queue, exc) from None
        logger.info(
            "dashboard bulk action",
            extra={"action": f"web_{action.name}", "queue": queue, "shard": shard.name, "changed": changed[shard.name]},
        )
    return changed


def _record(shards: Sequence[Shard], *, actor: str, action: str, queue: str, detail: dict[str, Any]) -> None:
    """One finished audit row for a settings change on each of ``shards``."""
    for shard in shards:
        try:
            with _connect(shard) as conn:
                row = conn.execute(
                    _q("web_audit_start"),
                    {
                        "actor": actor,
                        "action": action,
                        "queue": queue,
                        "filter": json.dumps(detail, sort_keys=True),
                        "requested": 1,
                    },
                ).fetchone()
                assert row is not None
                conn.execute(_q("web_audit_progress"), {"n": 1, "audit": row["id"]})
                conn.execute(_q("web_audit_finish"), {"audit": row["id"]})
        except psycopg.Error as exc:
            logger.warning(
                "could not record a dashboard action", extra={"action": "web_audit_failed", "error": str(exc)}
            )


def alter_queue(topology: Topology, queue: str, settings: dict[str, Any], *, actor: str, action: str) -> None:
    """Change a queue's settings on every shard (``admin.alter_queue``: the managers hear it at
    once), and record it in each shard's audit table."""
    admin.alter_queue(topology, queue, settings)
    _record(topology.shards, actor=actor, action=action, queue=queue, detail=settings)


def set_tenant(topology: Topology, queue: str, tenant: str, settings: dict[str, Any], *, actor: str) -> dict[str, Any]:
    """Set a tenant's overrides (``admin.set_tenant``, as ``qm queue tenant set``) on the tenant's
    shard, the one that holds them, and record it in that shard's audit table."""
    row = admin.set_tenant(topology, queue, tenant, settings)
    shard = topology.by_name(row["shard"])
    _record([shard], actor=actor, action="tenant_set", queue=queue, detail={"tenant": tenant, **settings})
    return row


def unset_tenant(topology: Topology, queue: str, tenant: str, *, actor: str) -> bool:
    """Drop a tenant's overrides (``admin.unset_tenant``, as ``qm queue tenant unset``) and record
    it in the tenant's shard's audit table; True when it had some."""
    removed = admin.unset_tenant(topology, queue, tenant)
    detail = {"tenant": tenant, "removed": removed}
    _record([topology.shard_for(tenant)], actor=actor, action="tenant_unset", queue=queue, detail=detail)
    return removed


def queue_settings(topology: Topology, queue: str) -> dict[str, Any]:
    """A queue's registry row (as the first shard that has it stores it)."""
    check_queue_name(queue)
    for rows in admin.list_queues(topology).values():
        for row in rows:
            if row["name"] == queue:
                return dict(row)
    raise UnknownQueueError(f"no queue named {queue!r} on any shard")


def ping(topology: Topology) -> dict[str, str | None]:
    """Each shard: None when it answers ``SELECT 1``, else why not."""
    out: dict[str, str | None] = {}
    for shard in topology.shards:
        try:
            with _connect(shard) as conn:
                conn.execute("SELECT 1")
            out[shard.name] = None
        except psycopg.Error as exc:
            out[shard.name] = str(exc).strip() or type(exc).__name__
    return out
