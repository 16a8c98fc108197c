"""PostgreSQL for the test-suite: where the server comes from, and throw-away databases on it.

:func:`test_server` returns the DSN of an administrative database (``postgres``) on:

* ``QM_TEST_DSN`` when set: an existing server, used as is;
* a ``postgres:17`` testcontainer when ``QM_TEST_POSTGRES=docker``;
* otherwise an embedded server (:class:`queue_manager.local.embedded.LocalServer`) in
  ``QM_TEST_PGDIR`` (default ``/tmp/qm-test-pg``), tuned for speed over durability.

The server is started once per process and stopped at exit (unless it was already running when
this process found it: then it belongs to someone else).
"""

from __future__ import annotations

import atexit
import os
import threading
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

DEFAULT_PGDIR = "/tmp/qm-test-pg"
#: durability off: a test server holds nothing worth an fsync
TEST_SETTINGS = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "300",
    # the Spark loader's two-phase runs (--atomic) prepare one transaction per shard
    "max_prepared_transactions": "20",
}

_lock = threading.Lock()
_dsn: str | None = None


def test_server() -> str:
    """The DSN of a PostgreSQL server for the tests (database ``postgres``), started once per process."""
    global _dsn
    explicit = os.environ.get("QM_TEST_DSN")
    if explicit:
        return explicit
    with _lock:
        if _dsn is None:
            docker = os.environ.get("QM_TEST_POSTGRES", "").lower() == "docker"
            _dsn = _start_container() if docker else _start_local()
        return _dsn


# not a test, despite its name: keep pytest from collecting it where it is imported into a test module
test_server.__test__ = False  # type: ignore[attr-defined]


def _start_container() -> str:
    # lazy: needs Docker and the testcontainers dev dependency
    try:  # testcontainers >= 4.14 moved the module; the old path is a deprecated shim
        from testcontainers.community.postgres import PostgresContainer
    except ImportError:
        from testcontainers.postgres import PostgresContainer

    container: Any = PostgresContainer("postgres:17", driver=None)
    container.start()
    atexit.register(container.stop)
    url: str = container.get_connection_url()  # postgresql://test:test@host:port/test, no "+driver"
    return url


def _start_local() -> str:
    from queue_manager.local.embedded import LocalServer

    directory = Path(os.environ.get("QM_TEST_PGDIR") or DEFAULT_PGDIR)
    server = LocalServer(directory / "pgdata", settings=TEST_SETTINGS)
    already_running = server.is_running()
    dsn = server.start()
    if not already_running:
        atexit.register(server.stop)
    return dsn


def _with_dbname(dsn: str, dbname: str) -> str:
    """`dsn` (URI or key=value) with its database replaced by `dbname`, as a key=value string."""
    return make_conninfo(dsn, dbname=dbname)


def fresh_database(admin_dsn: str, template: str | None, name: str) -> str:
    """``CREATE DATABASE name [TEMPLATE template]`` on the server of `admin_dsn`; return the new database's DSN."""
    query = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if template is not None:
        query = sql.SQL("{} TEMPLATE {}").format(query, sql.Identifier(template))
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(query)
    return _with_dbname(admin_dsn, name)


def drop_database(admin_dsn: str, name: str) -> None:
    """``DROP DATABASE IF EXISTS name WITH (FORCE)`` on the server of `admin_dsn` (disconnects its sessions)."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
