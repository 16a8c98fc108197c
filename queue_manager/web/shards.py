"""How the dashboard reaches the shards: each through a pool of connections that carry its
statement timeout (:class:`Shards`, which the admin API's actions are given too), what it makes of
the driver's errors, its cost guards (:class:`Limits`), and the listeners of the live reading.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import errors as pg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool, PoolTimeout

from queue_manager.db.sqlfiles import query
from queue_manager.domain.topology import Shard, Topology
from queue_manager.errors import ConfigurationError, InvalidInputError, QueueManagerError, UnknownQueueError

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


class ShardUnavailable(QueueManagerError):
    """A shard did not answer (down, unreachable, or its connection lost)."""


class StatementTimeout(QueueManagerError):
    """A query ran past the dashboard's statement timeout."""


def web_query(name: str) -> Any:
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


def on_error(shard: Shard, queue: str, exc: psycopg.Error) -> QueueManagerError | psycopg.Error:
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
                conn.execute(web_query("web_listen"))
                heard()
                checked = time.monotonic()
                while not stop.is_set():
                    for _ in conn.notifies(timeout=0.5):
                        heard()
                    if time.monotonic() - checked >= 30:
                        conn.execute(web_query("web_alive"))
                        checked = time.monotonic()
        except psycopg.Error as exc:
            logger.info(
                "dashboard listener lost its shard",
                extra={"action": "web_listen_lost", "shard": shard.name, "error": str(exc)},
            )
            stop.wait(retry_seconds)
