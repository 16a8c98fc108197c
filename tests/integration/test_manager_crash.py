"""A PostgreSQL crash right after a fire: the attempt number still identifies one delivery.

Fires commit durably by default (``ManagerConfig.durable_fires``). When they did not wait for
their WAL flush, a crash lost the fire, the event was still ``to_be_fired`` with its old attempt
count, and it was delivered again with the same attempt number, contrary to docs/protocol.md.
This test runs its own server with the default durability and a WAL writer that flushes only
every 10 s, so that a fire that does not flush by itself is lost in an immediate shutdown.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from queue_manager import admin
from queue_manager.db.migrate import set_identity, upgrade
from queue_manager.domain.topology import KeyRange, Shard, Topology
from queue_manager.local.embedded import LocalServer
from queue_manager.wire import frames as f
from tests.managerkit import insert, leading_manager, recv_type, subscribed

pytestmark = [pytest.mark.timeout(180), pytest.mark.cluster]


@pytest.fixture
def crashable(server_dir: Path) -> Iterator[tuple[LocalServer, Shard]]:
    server = LocalServer(server_dir / "pgdata", settings={"wal_writer_delay": "10000"})
    admin_dsn = server.start()
    try:
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute("CREATE DATABASE crash")
        dsn = server.dsn("crash")
        upgrade(dsn)
        shard = Shard("s0", dsn, KeyRange.parse("-"))
        topology = Topology((shard,))
        set_identity(dsn, shard, topology)
        admin.create_queue(topology, "orders", {"partitions": 2, "shuffle": 1, "ack_timeout_seconds": 1})
        yield server, shard
    finally:
        server.stop(mode="immediate")


async def test_after_a_postgres_crash_a_refire_gets_a_new_attempt_number(
    crashable: tuple[LocalServer, Shard],
) -> None:
    server, shard = crashable
    async with leading_manager(shard.dsn, lease_ttl=30.0) as m:
        async with subscribed(m, "orders", credit=2) as ws:
            [ident] = await insert(shard.dsn, [("acme", {"n": 1})])
            first = (await recv_type(ws, "deliver"))["events"][0]
            assert (first["id"], first["attempt"]) == (ident, 1)
            # crash: no shutdown checkpoint, WAL not yet written is lost
            server.stop(mode="immediate")
            server.start()
            # the manager reconnects under the same term; the collector takes the event back after
            # its 1 s ack deadline and fires it again: as attempt 2, never as attempt 1 again
            again = (await recv_type(ws, "deliver", timeout=30))["events"][0]
            assert (again["id"], again["attempt"]) == (ident, 2), again
            await ws.send(f.Ack(((ident, 2),), ref=1).to_json())
            assert (await recv_type(ws, "ack_result", timeout=10))["acked"] == [ident]
    with psycopg.connect(shard.dsn) as conn:
        assert conn.execute("SELECT state::text, attempts FROM orders").fetchall() == [("acked", 2)]
