"""The benchmark's server: a throw-away database on a given or embedded server, a one-shard
queue in it, and the server facts every JSON report carries."""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from queue_manager.db.migrate import set_identity, upgrade
from queue_manager.domain.topology import KeyRange, Shard, Topology

logger = logging.getLogger("bench")

#: the queue of the one-shard benchmarks (e2e, held snapshot, churn, fairness)
QUEUE = "bench_q"


@contextlib.contextmanager
def bench_server(
    admin_dsn: str | None, prefix: str, settings: Mapping[str, str] | None = None
) -> Iterator[tuple[str, str]]:
    """(admin DSN, DSN of a fresh database) on the given server, or on a dedicated embedded one
    with the default durability (fsync and synchronous_commit on) plus ``settings``; all removed
    at the end."""
    tmpdir: str | None = None
    server: Any = None
    try:
        if admin_dsn is None:
            from queue_manager.local.embedded import LocalServer

            tmpdir = tempfile.mkdtemp(prefix=f"qm-bench-{prefix}-")
            server = LocalServer(Path(tmpdir) / "pgdata", settings=settings)
            admin_dsn = server.start()
            logger.info("started an embedded PostgreSQL server: %s", admin_dsn)
        name = f"qm_bench_{secrets.token_hex(4)}"
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        try:
            yield admin_dsn, make_conninfo(admin_dsn, dbname=name)
        finally:
            with psycopg.connect(admin_dsn, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
    finally:
        if server is not None:
            server.stop()
            logger.info("stopped the embedded PostgreSQL server")
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)


def one_shard_queue(dsn: str, queue: str, settings: Mapping[str, Any]) -> None:
    """Migrate ``dsn``, make it the only shard (the whole keyspace), and create ``queue``."""
    upgrade(dsn)
    shard = Shard("s0", dsn, KeyRange.parse("-"))
    set_identity(dsn, shard, Topology((shard,)))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT qm.create_queue(%s, %s::jsonb)", (queue, json.dumps(dict(settings))))


def server_info(dsn: str) -> dict[str, Any]:
    """Server version and the durability settings that shape every figure."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        version = conn.execute("SHOW server_version").fetchone()
        settings = {}
        for name in ("fsync", "synchronous_commit", "full_page_writes", "wal_sync_method", "shared_buffers"):
            row = conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()
            settings[name] = row[0] if row else None
    return {"postgres": version[0] if version else None, "settings": settings}


#: run by another checkout's own interpreter, in that checkout: migrate the database ``argv[1]``,
#: make it the only shard, create the queue ``argv[2]`` with the settings ``argv[3]`` (JSON), its
#: code's way, then run each further argument as a statement. Through queue_manager alone, which
#: every checkout has.
_CHECKOUT_SETUP = """
import sys
import psycopg
from queue_manager.db.migrate import set_identity, upgrade
from queue_manager.domain.topology import KeyRange, Shard, Topology
dsn = sys.argv[1]
upgrade(dsn)
shard = Shard('s0', dsn, KeyRange.parse('-'))
set_identity(dsn, shard, Topology((shard,)))
with psycopg.connect(dsn, autocommit=True) as conn:
    conn.execute("SELECT qm.create_queue(%s, %s::jsonb)", (sys.argv[2], sys.argv[3]))
    for statement in sys.argv[4:]:
        conn.execute(statement)
"""


def checkout_database(
    checkout: Path, admin_dsn: str, name: str, queue: str, settings: Mapping[str, Any], *statements: str
) -> str:
    """A fresh database ``name`` set up by another checkout's code (its ``.venv``) as one shard with
    ``queue``, then ``statements``; its DSN. For benchmarks that compare with an older build."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = make_conninfo(admin_dsn, dbname=name)
    python = str(checkout / ".venv" / "bin" / "python")
    subprocess.run(
        [python, "-c", _CHECKOUT_SETUP, dsn, queue, json.dumps(dict(settings)), *statements], cwd=checkout, check=True
    )
    return dsn
