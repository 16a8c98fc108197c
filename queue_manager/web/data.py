"""What the dashboard reads from the shards: the only module of the web package that touches
PostgreSQL (its actions are the admin API's, ``queue_manager.admin``, given the same pools).

Every shard has a connection pool (:class:`Shards`, psycopg_pool) whose connections run under a
statement timeout (:func:`guarded`). Queries are the named blocks of ``db/sql/web.sql``.

The overview's reading (:func:`live`) scans no queue table: live events come from the
partitions' load counters, the rest from bounded reads of the partial indexes and from the index
statistics (labelled as estimates), so its cost does not grow with the tables.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import psycopg
from psycopg import errors as pg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool, PoolTimeout

from queue_manager import admin
from queue_manager.db.health import read_health
from queue_manager.db.sqlfiles import query
from queue_manager.domain.health import as_data as health_data
from queue_manager.domain.health import warnings as health_warnings
from queue_manager.domain.names import check_queue_name
from queue_manager.domain.topology import Shard, Topology
from queue_manager.errors import ConfigurationError, InvalidInputError, QueueManagerError, UnknownQueueError
from queue_manager.web.browse import MergedPage, ShardPage, merge
from queue_manager.web.filters import EventFilter
from queue_manager.web.readings import live_counts

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
    #: a bulk action's confirmation counts the events matching up to this many per shard
    bulk_count_cap: int = 1_000_000
    #: connections each shard's pool keeps open at most
    pool_size: int = 4
    #: how long a request waits for a pooled connection before it opens one of its own, seconds
    pool_wait_seconds: float = 1.0
    #: events in hand and dead letters are counted exactly up to this many per queue and shard
    count_cap: int = 10_000
    #: due events are counted up to this many per queue and shard (shared among its partitions)
    due_cap: int = 10_000
    #: the pickup delay is read from at most this many of the newest acked events per partition...
    pickup_sample: int = 16
    #: ...acked within this many seconds
    pickup_window_seconds: float = 300.0

    def __post_init__(self) -> None:
        if self.bulk_count_cap < self.bulk_cap:
            raise ConfigurationError("bulk_count_cap counts what bulk_cap binds: give bulk_count_cap >= bulk_cap")


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


class ShardUnavailable(QueueManagerError):
    """A shard did not answer (down, unreachable, or its connection lost)."""


class StatementTimeout(QueueManagerError):
    """A query ran past the dashboard's statement timeout."""


def _q(name: str) -> Any:
    """A named query of web.sql, the event filters (``event_filters`` of admin.sql, the operator
    actions' own) put in where it says ``{filters}``: the browser selects as the actions do."""
    text = query(name, WEB_SQL)
    if "{filters}" in text:
        filters = query("event_filters", "admin.sql")
        text = text.replace("{filters}", "\n".join(x for x in filters.splitlines() if not x.lstrip().startswith("--")))
    return text


class Shards:
    """The shards of the guarded topology, each with a connection pool (psycopg_pool; opened at
    the first use, closed by :meth:`close`). A pooled connection is in autocommit mode with
    ``dict_row`` rows and the statement timeout of its DSN. A request that gets none within
    ``pool_wait_seconds`` (the pool busy, or the shard unreachable) opens one of its own, so it is
    never stuck behind the pool, and a shard that is down fails with the driver's own reason."""

    def __init__(self, topology: Topology, limits: Limits) -> None:
        #: the guarded topology (what the admin functions are given)
        self.topology = topology
        self.limits = limits
        self.shards = topology.shards
        self._lock = threading.Lock()
        self._pools: dict[str, ConnectionPool[psycopg.Connection[dict[str, Any]]]] = {}
        self._closed = False

    def by_name(self, name: str) -> Shard:
        return self.topology.by_name(name)

    def shard_for(self, tenant: str) -> Shard:
        return self.topology.shard_for(tenant)

    def _pool(self, shard: Shard) -> ConnectionPool[psycopg.Connection[dict[str, Any]]] | None:
        with self._lock:
            if self._closed:
                return None
            pool = self._pools.get(shard.name)
            if pool is None:
                pool = ConnectionPool(
                    shard.dsn,
                    connection_class=psycopg.Connection[dict[str, Any]],
                    kwargs={"autocommit": True, "row_factory": dict_row, "connect_timeout": 5},
                    min_size=1,
                    max_size=self.limits.pool_size,
                    open=False,
                    check=ConnectionPool.check_connection,
                    name=f"qm-web-{shard.name}",
                )
                pool.open(wait=False)
                self._pools[shard.name] = pool
            return pool

    @contextmanager
    def connect(self, shard: Shard) -> Iterator[psycopg.Connection[dict[str, Any]]]:
        """A connection to ``shard`` (by name: always with the guarded DSN): a pooled one, or one of
        its own when the pool has none to give."""
        shard = self.topology.by_name(shard.name)
        pool = self._pool(shard)
        if pool is not None:
            # a pool with no connection at all is still connecting, or its shard is down: don't wait for it
            wait = self.limits.pool_wait_seconds if pool.get_stats().get("pool_size", 0) else 0.1
            try:
                conn = pool.getconn(timeout=wait)
            except PoolTimeout:
                pass
            else:
                try:
                    yield conn
                finally:
                    pool.putconn(conn)
                return
        with psycopg.connect(shard.dsn, autocommit=True, row_factory=dict_row, connect_timeout=5) as own:
            yield own

    def close(self) -> None:
        """Close every pool (later requests open connections of their own)."""
        with self._lock:
            self._closed = True
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close(timeout=5)


def _on(shard: Shard, queue: str, exc: psycopg.Error) -> QueueManagerError | psycopg.Error:
    """The error to show for ``exc`` from ``shard``: only a shard that did not answer is
    ShardUnavailable; a value it refused is InvalidInputError (the request's fault, never the
    shard's); an error that is neither stays itself (a fault of the dashboard: HTTP 500)."""
    if isinstance(exc, pg.UndefinedTable):
        return UnknownQueueError(f"no queue named {queue!r} on shard {shard.name!r}")
    if isinstance(exc, pg.QueryCanceled):
        return StatementTimeout(
            f"shard {shard.name!r}: the query ran past the dashboard's statement timeout; narrow the filter "
            "(an id, or a tenant and a dedup key, are looked up by index)"
        )
    if isinstance(exc, psycopg.DataError | psycopg.IntegrityError):
        return InvalidInputError(f"shard {shard.name!r} refused a value: {exc.diag.message_primary or exc}")
    if isinstance(exc, psycopg.OperationalError):
        return ShardUnavailable(f"shard {shard.name!r} did not answer: {str(exc).strip() or type(exc).__name__}")
    return exc


# ------------------------------------------------------------------------------------ reading


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
                entry["leader"] = conn.execute(_q("web_leader")).fetchone()
                entry["queues"] = [_live_queue(conn, row, limits) for row in conn.execute(_q("web_live_queues"))]
        except psycopg.Error as exc:
            entry["error"] = f"unreachable: {str(exc).strip() or type(exc).__name__}"
        shards.append(entry)
    return {"shards": shards, "cap": limits.count_cap}


def _live_queue(conn: psycopg.Connection[dict[str, Any]], row: dict[str, Any], limits: Limits) -> dict[str, Any]:
    parts = int(row["partitions_physical"])
    bounded = conn.execute(
        sql.SQL(_q("web_live_queue")).format(queue=sql.Identifier(row["name"])),
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
                entry["spark_runs"] = conn.execute(_q("web_spark_runs"), {"limit": 10}).fetchall()
                entry["prepared"] = conn.execute(_q("web_prepared"), {"limit": 10}).fetchall()
                entry["archive_runs"] = conn.execute(_q("web_archive_runs"), {"limit": 10}).fetchall()
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
                rows = conn.execute(sql.SQL(_q("web_exact_counts")).format(queue=sql.Identifier(queue))).fetchall()
        except psycopg.Error as exc:
            out[shard.name] = str(_on(shard, queue, exc))
            continue
        counts = {state: 0 for state in ("to_be_fired", "fired", "acked", "failed")}
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
    return merge(cursor, pages, limits.page_size)


def event(db: Shards, queue: str, shard_name: str, event_id: int) -> dict[str, Any] | None:
    """One event, whole, or None."""
    check_queue_name(queue)
    shard = db.by_name(shard_name)
    try:
        with db.connect(shard) as conn:
            return conn.execute(
                sql.SQL(_q("web_event")).format(queue=sql.Identifier(queue)), {"id": event_id}
            ).fetchone()
    except psycopg.Error as exc:
        raise _on(shard, queue, exc) from None


def ping(db: Shards) -> dict[str, str | None]:
    """Each shard: None when it answers ``SELECT 1``, else why not."""
    out: dict[str, str | None] = {}
    for shard in db.shards:
        try:
            with db.connect(shard) as conn:
                conn.execute("SELECT 1")
            out[shard.name] = None
        except psycopg.Error as exc:
            out[shard.name] = str(exc).strip() or type(exc).__name__
    return out


def listen(shard: Shard, stop: threading.Event, heard: Callable[[], None], retry_seconds: float = 2.0) -> None:
    """LISTEN on ``qm_wake`` on ``shard`` until ``stop`` is set: ``heard()`` at each notification,
    and once after each connection (notifications sent while it was away are lost). The connection
    is checked every 30 s and opened again after a failure, ``retry_seconds`` later."""
    while not stop.is_set():
        try:
            with psycopg.connect(
                shard.dsn,
                autocommit=True,
                application_name="qm-web-listen",
                connect_timeout=5,
                keepalives_idle=10,
                keepalives_interval=5,
                keepalives_count=3,
            ) as conn:
                conn.execute(_q("web_listen"))
                heard()
                checked = time.monotonic()
                while not stop.is_set():
                    for _ in conn.notifies(timeout=0.5):
                        heard()
                    if time.monotonic() - checked >= 30:
                        conn.execute(_q("web_alive"))
                        checked = time.monotonic()
        except psycopg.Error as exc:
            logger.info(
                "dashboard listener lost its shard",
                extra={"action": "web_listen_lost", "shard": shard.name, "error": str(exc)},
            )
            stop.wait(retry_seconds)
