"""PostgreSQL for the test-suite: where the server comes from, and throw-away databases on it.

:func:`test_server` returns the DSN of an administrative database (``postgres``) on:

* ``QM_TEST_DSN`` when set: an existing server, used as is;
* a ``postgres:17`` testcontainer when ``QM_TEST_POSTGRES=docker``;
* otherwise an embedded server (:class:`queue_manager.local.embedded.LocalServer`) in
  ``QM_TEST_PGDIR`` (default ``/dev/shm/qm-test-pg-<user>``, see :func:`scratch_root`), tuned for speed
  over durability: one per pytest-xdist worker (``QM_TEST_PGDIR/gw0``, ...), so that what is
  server-wide (the xmin horizon, ``pg_stat_activity``, prepared transactions, the NOTIFY queue,
  checkpoints) is one worker's alone.

The server is started once per process and stopped at exit (unless it was already running when
this process found it: then it belongs to someone else).
"""

from __future__ import annotations

import atexit
import getpass
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo


def scratch_root() -> Path:
    """Where throw-away servers keep their data: ``/dev/shm`` (tmpfs) when it is there, else ``/tmp``.

    A test database is made per test (``CREATE DATABASE ... TEMPLATE``: about a thousand files)
    and dropped at its end. On ext4, creating files among many recently deleted ones is slow in
    the kernel's inode allocator: 0.25-0.3 s of CPU per database, measured, against 0.012 s on
    tmpfs; with two databases per test that was most of the suite's CPU time."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK) else Path(tempfile.gettempdir())


#: one per OS user: another user's servers there are not ours to reuse (nor writable)
DEFAULT_PGDIR = str(scratch_root() / f"qm-test-pg-{getpass.getuser()}")
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
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ... under pytest -n
    if worker:
        directory = directory / worker
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
    """``CREATE DATABASE name [TEMPLATE template]`` on the server of `admin_dsn`; return the new database's DSN.

    A copy of the template is made by ``STRATEGY FILE_COPY`` (its files copied, then a checkpoint, cheap
    on a server without fsync): half the CPU and a third of the time of the default ``WAL_LOG`` (every
    block through the WAL) for a create and a drop, 13 against 26 ms of CPU and 20-30 against 50-70 ms,
    measured; a test of two shards makes two."""
    query = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if template is not None:
        query = sql.SQL("{} TEMPLATE {} STRATEGY FILE_COPY").format(query, sql.Identifier(template))
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(query)
    return _with_dbname(admin_dsn, name)


def drop_database(admin_dsn: str, name: str) -> None:
    """``DROP DATABASE IF EXISTS name WITH (FORCE)`` on the server of `admin_dsn` (disconnects its sessions)."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
