"""The benchmark's server: a throw-away database on a given or embedded server, a one-shard
queue in it, and the server facts every JSON report carries."""

from __future__ import annotations

import contextlib
import json
import logging
import os
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


def proc_cpu_seconds(pid: int, *, reaped_children: bool = False) -> float:
    """CPU seconds (user + system) of one process, and of its children it has waited for."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])
    if reaped_children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    """The pids of the live children of ``pid`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError):
                continue
    return out


class ServerCpu:
    """CPU seconds of a PostgreSQL server: the postmaster, its live processes and the backends it
    has reaped."""

    def __init__(self, dsn: str) -> None:
        with psycopg.connect(dsn) as conn:  # a backend's parent is the postmaster
            row = conn.execute("SELECT pg_backend_pid()").fetchone()
            assert row is not None
            with open(f"/proc/{row[0]}/stat") as f:
                self.postmaster = int(f.read().rsplit(")", 1)[1].split()[1])

    def read(self) -> float:
        pg = proc_cpu_seconds(self.postmaster, reaped_children=True)
        for child in child_pids(self.postmaster):
            try:
                pg += proc_cpu_seconds(child)
            except OSError:  # gone (and reaped: counted above) between the listing and the read
                continue
        return pg


def two_shards(admin_dsn: str, first_dsn: str) -> tuple[Topology, str]:
    """A two-shard topology (``s0``: ``-80``, ``s1``: ``80-``): the given database and a second one
    on the same server, both migrated with their identities; the second's name is returned (to drop)."""
    second = f"{psycopg.conninfo.conninfo_to_dict(first_dsn)['dbname']}_s1"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(second)))
    topology = Topology(
        (
            Shard("s0", first_dsn, KeyRange.parse("-80")),
            Shard("s1", make_conninfo(admin_dsn, dbname=second), KeyRange.parse("80-")),
        )
    )
    for shard in topology.shards:
        upgrade(shard.dsn)
        set_identity(shard.dsn, shard, topology)
    return topology, second


def tenants_for(key_range: KeyRange, count: int) -> list[str]:
    """The first ``count`` tenants ``tenant-<i>`` in ``key_range``."""
    out: list[str] = []
    i = 0
    while len(out) < count:
        if key_range.contains(f"tenant-{i}"):
            out.append(f"tenant-{i}")
        i += 1
    return out
