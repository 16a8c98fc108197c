"""Schema revisions applied to a shard that already holds queues and events."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from queue_manager import admin
from queue_manager.db.migrate import set_identity, upgrade
from queue_manager.domain import routing
from queue_manager.domain.topology import KeyRange, Shard, Topology
from tests import pgtest

#: the head revision of the alembic history
HEAD = "0013_enqueue_lock"


def _old_shuffle_set(tenant: str, n: int, k: int) -> tuple[int, ...]:
    """The rule before revision 0005: draws of 16 div k digits of md5's second half."""
    h = hashlib.md5(tenant.encode("utf-8")).hexdigest()
    w = min(16 // k, 7)
    return tuple(
        (j * n) // k + int(h[16 + j * w : 16 + (j + 1) * w], 16) % (((j + 1) * n) // k - (j * n) // k) for j in range(k)
    )


@pytest.fixture
def shard_at_0004(pg_admin_dsn: str) -> Iterator[Shard]:
    name = f"qm_m_{uuid.uuid4().hex[:12]}"
    dsn = pgtest.fresh_database(pg_admin_dsn, None, name)
    upgrade(dsn, "0004")
    shard = Shard("s0", dsn, KeyRange.parse("-"))
    set_identity(dsn, shard, Topology((shard,)))
    yield shard
    pgtest.drop_database(pg_admin_dsn, name)


def test_0005_regenerates_routing_and_keeps_stored_events(shard_at_0004: Shard) -> None:
    n, k = 512, 16
    topology = Topology((shard_at_0004,))
    admin.create_queue(topology, "orders", {"partitions": n, "shuffle": k})
    tenants = [f"tenant-{i}" for i in range(2000)]
    with psycopg.connect(shard_at_0004.dsn, autocommit=True) as c:
        c.execute("INSERT INTO orders (tenant, payload) SELECT t, '{}' FROM unnest(%s::text[]) AS t", (tenants,))
        before: dict[int, tuple[str, int]] = {
            r[0]: (r[1], r[2]) for r in c.execute("SELECT id, tenant, partition FROM orders").fetchall()
        }
        # the old rule: only one partition in two is ever used
        assert all(p in _old_shuffle_set(t, n, k) for t, p in before.values())
        assert len({p for _, p in before.values()}) <= n // 2
        # one event in hand, so that the upgrade meets every state
        c.execute("UPDATE orders SET state = 'fired', fired_at = now(), attempts = 1 WHERE id = %s", (min(before),))

    upgrade(shard_at_0004.dsn)

    with psycopg.connect(shard_at_0004.dsn, autocommit=True) as c:
        rev = c.execute("SELECT version_num FROM qm.alembic_version").fetchone()
        assert rev == (HEAD,)
        after = {r[0]: (r[1], r[2]) for r in c.execute("SELECT id, tenant, partition FROM orders").fetchall()}
        assert after == before  # nothing refused, nothing moved
        c.execute("INSERT INTO orders (tenant, payload) SELECT t, '{}' FROM unnest(%s::text[]) AS t", (tenants,))
        new = c.execute("SELECT tenant, partition FROM orders WHERE id > %s", (max(before),)).fetchall()
        # a tenant's old partition that is not in its new set is refused for new rows
        moved = next((t, p) for t, p in before.values() if p not in routing.shuffle_set(t, n, k))
        with pytest.raises(psycopg.errors.CheckViolation) as refused:
            c.execute("INSERT INTO orders (tenant, partition, payload) VALUES (%s, %s, '{}')", moved)
        assert refused.value.diag.constraint_name == "orders_partition_in_shuffle_set"
    assert len(new) == len(tenants)
    assert all(p in routing.shuffle_set(t, n, k) for t, p in new)
    # the partitions the old rule never used take the new rows (they are the least loaded)
    unused_before = set(range(n)) - {p for _, p in before.values()}
    assert unused_before <= {p for _, p in new}


def test_head_is_the_latest_revision(shard: Shard) -> None:
    with psycopg.connect(shard.dsn) as c:
        row: Any = c.execute("SELECT version_num FROM qm.alembic_version").fetchone()
    assert row == (HEAD,)


@pytest.fixture
def shard_at_0007(pg_admin_dsn: str) -> Iterator[Shard]:
    name = f"qm_m_{uuid.uuid4().hex[:12]}"
    dsn = pgtest.fresh_database(pg_admin_dsn, None, name)
    upgrade(dsn, "0007")
    shard = Shard("s0", dsn, KeyRange.parse("-"))
    set_identity(dsn, shard, Topology((shard,)))
    yield shard
    pgtest.drop_database(pg_admin_dsn, name)


def _index_definitions(c: psycopg.Connection[Any], table: str) -> dict[str, str]:
    rows = c.execute("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s", (table,)).fetchall()
    return {str(r[0]): str(r[1]) for r in rows}


def test_0009_keeps_the_dead_letters_of_existing_queues_and_indexes_retention_by_partition(
    shard_at_0007: Shard,
) -> None:
    topology = Topology((shard_at_0007,))
    admin.create_queue(topology, "orders", {"partitions": 4, "shuffle": 2})
    with psycopg.connect(shard_at_0007.dsn, autocommit=True) as c:
        c.execute("INSERT INTO orders (tenant) SELECT 'tenant-' || i FROM generate_series(1, 20) i")
        c.execute(
            "UPDATE orders SET state = 'failed', attempts = 1, fired_at = now() - interval '400 days' "
            "WHERE id IN (SELECT id FROM orders ORDER BY id LIMIT 5)"
        )
        assert "(acked_at)" in _index_definitions(c, "orders")["orders_acked"]

    upgrade(shard_at_0007.dsn)

    admin.create_queue(topology, "fresh", {})
    with psycopg.connect(shard_at_0007.dsn, autocommit=True) as c:
        rows = dict(c.execute("SELECT name, failed_retention_seconds FROM qm.queues").fetchall())
        # an existing queue keeps its dead letters as before; a new one takes the 30-day default
        assert rows == {"orders": None, "fresh": 2_592_000.0}
        for table in ("orders", "fresh"):
            defs = _index_definitions(c, table)
            assert "(partition, acked_at) WHERE (state = 'acked'" in defs[f"{table}_acked"]
            assert "WHERE (state = 'failed'" in defs[f"{table}_failed"]
        counts = c.execute("SELECT * FROM qm.maintenance_counts()").fetchall()
        assert [r[0] for r in counts] == ["collector", "retention", "reconciliation"]
        assert all(r[1:] == (0, 0, 0, 0) for r in counts)
        assert c.execute("SELECT count(*) FROM orders WHERE state = 'failed'").fetchone() == (5,)


#: the storage parameters revision 0012_table_health gives every queue table (qm.tune_queue_tables)
TUNED = {
    "autovacuum_vacuum_scale_factor=0.02",
    "autovacuum_analyze_scale_factor=0.02",
    "autovacuum_vacuum_cost_limit=2000",
}


def _reloptions(dsn: str, table: str) -> set[str]:
    with psycopg.connect(dsn) as c:
        row: Any = c.execute("SELECT reloptions FROM pg_class WHERE oid = %s::regclass", (table,)).fetchone()
    return set(row[0] or [])


def test_0012_tunes_existing_queue_tables_and_new_queues_get_the_same(pg_admin_dsn: str) -> None:
    name = f"qm_m_{uuid.uuid4().hex[:12]}"
    dsn = pgtest.fresh_database(pg_admin_dsn, None, name)
    try:
        upgrade(dsn, "0007")
        shard = Shard("s0", dsn, KeyRange.parse("-"))
        topology = Topology((shard,))
        set_identity(dsn, shard, topology)
        admin.create_queue(topology, "orders", {"partitions": 4, "shuffle": 2})
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute("INSERT INTO orders (tenant, payload) VALUES ('t', '{}')")
            # an operator's own parameter survives the upgrade
            c.execute("ALTER TABLE orders SET (autovacuum_vacuum_threshold = 500)")
        assert "autovacuum_vacuum_cost_limit=2000" not in _reloptions(dsn, "orders")

        upgrade(dsn)

        assert _reloptions(dsn, "orders") == TUNED | {"autovacuum_vacuum_threshold=500"}
        admin.create_queue(topology, "emails", {})
        assert _reloptions(dsn, "emails") == TUNED
        # and qm queue alter / qm migrate leave an operator's change alone
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute("ALTER TABLE emails SET (autovacuum_vacuum_cost_limit = 500)")
        admin.alter_queue(topology, "emails", {"partitions": 8})
        set_identity(dsn, shard, topology)
        assert "autovacuum_vacuum_cost_limit=500" in _reloptions(dsn, "emails")
        with psycopg.connect(dsn, autocommit=True) as c:
            assert c.execute("SELECT count(*) FROM orders").fetchone() == (1,)
            with pytest.raises(psycopg.errors.UndefinedTable):
                c.execute("SELECT qm.tune_queue_tables(-1)")
    finally:
        pgtest.drop_database(pg_admin_dsn, name)
