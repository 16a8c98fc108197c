"""Embedded PostgreSQL servers on TCP: a 2-shard local cluster, restart with persisted data, crash recovery."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from queue_manager.errors import LocalClusterError
from queue_manager.local.embedded import LocalCluster, LocalServer

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]

# fsync off for speed; synchronous_commit stays on so that a SIGKILL loses no committed row
FAST = {"fsync": "off"}


@pytest.fixture
def cluster_dir(server_dir: Path) -> Iterator[Path]:
    directory = server_dir / "cluster"
    yield directory
    # whatever happened in the test, leave no server behind
    for server in LocalCluster(directory, 2).servers:
        server.stop("immediate")


@pytest.fixture
def server(server_dir: Path) -> Iterator[LocalServer]:
    srv = LocalServer(server_dir / "pg" / "pgdata", settings=FAST)
    yield srv
    srv.stop("immediate")


def test_cluster_starts_restarts_and_keeps_data(cluster_dir: Path) -> None:
    cluster = LocalCluster(cluster_dir, 2, settings=FAST)
    dsns = cluster.start()

    assert len(dsns) == 2
    ports = [int(str(conninfo_to_dict(dsn)["port"])) for dsn in dsns]
    assert len(set(ports)) == 2, f"shards share a port: {dsns}"
    assert all(server.is_running() for server in cluster.servers)
    for shard, dsn in enumerate(dsns):
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
            assert conn.execute("SELECT current_database()").fetchone() == ("qm",)
            conn.execute("CREATE TABLE marker (shard int PRIMARY KEY)")
            conn.execute("INSERT INTO marker VALUES (%s)", (shard,))
    assert cluster.start() == dsns, "starting a running cluster must be a no-op"

    cluster.stop()
    assert not any(server.is_running() for server in cluster.servers)
    cluster.stop()  # stopping a stopped cluster is fine

    again = LocalCluster.from_directory(cluster_dir)
    assert again.shards == 2
    assert again.settings == FAST
    dsns_again = again.start()
    assert dsns_again == dsns, "the ports of the previous run should be reused when free"
    for shard, dsn in enumerate(dsns_again):
        with psycopg.connect(dsn) as conn:
            assert conn.execute("SELECT shard FROM marker").fetchall() == [(shard,)]
    again.stop()
    assert not any(server.is_running() for server in again.servers)


def test_cluster_refuses_another_shard_count(cluster_dir: Path) -> None:
    with pytest.raises(LocalClusterError, match="no local cluster"):
        LocalCluster.from_directory(cluster_dir)
    cluster_dir.mkdir(parents=True)
    (cluster_dir / "cluster.json").write_text('{"shards": 3, "settings": {}}')
    with pytest.raises(LocalClusterError, match="3-shard"):
        LocalCluster(cluster_dir, 2).start()


def test_kill_then_start_recovers(server: LocalServer) -> None:
    dsn = server.start()
    assert server.is_running()
    assert server.port is not None and dsn == server.dsn()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE survived (v text)")
        conn.execute("INSERT INTO survived VALUES ('before the crash')")
    idle = psycopg.connect(dsn)  # a live session while the postmaster dies

    server.kill()
    assert not server.is_running()
    idle.close()

    dsn = server.start()
    assert server.is_running()
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT v FROM survived").fetchall() == [("before the crash",)]

    server.stop()
    assert not server.is_running()
    server.stop()  # no error when not running


def test_start_failure_reports_the_log(server_dir: Path) -> None:
    server = LocalServer(server_dir / "pgdata", settings={**FAST, "shared_buffers": "not-a-size"})
    with pytest.raises(LocalClusterError, match="shared_buffers"):
        server.start()
    assert not server.is_running()


def test_a_synchronous_standby_has_every_commit_and_is_promoted(server: LocalServer, server_dir: Path) -> None:
    """The fault suite's replica promotion: a COMMIT the client saw is on the synchronous standby,
    which refuses writes until promoted and accepts them after, with the primary gone."""
    server.start()
    standby = LocalServer(server_dir / "standby" / "pgdata", settings=FAST)
    try:
        with pytest.raises(LocalClusterError, match=r"primary .* is not running"):
            LocalServer(server_dir / "other" / "pgdata").start_standby_of(standby)
        standby.start_standby_of(server)
        with pytest.raises(LocalClusterError, match="is running"):
            standby.start_standby_of(server)
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
            conn.execute("SELECT pg_reload_conf()")
            conn.execute("CREATE TABLE seen (v int)")
            for v in range(20):
                conn.execute("INSERT INTO seen VALUES (%s)", (v,))
            row = conn.execute("SELECT sync_state FROM pg_stat_replication").fetchone()
            assert row == ("sync",)
        server.stop("immediate")
        with psycopg.connect(standby.dsn(), autocommit=True) as conn:
            with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
                conn.execute("INSERT INTO seen VALUES (-1)")
        standby.promote()
        with psycopg.connect(standby.dsn(), autocommit=True) as conn:
            assert conn.execute("SELECT count(*) FROM seen").fetchone() == (20,)
            conn.execute("INSERT INTO seen VALUES (20)")
            assert conn.execute("SELECT pg_is_in_recovery()").fetchone() == (False,)
    finally:
        standby.stop("immediate")
