"""Database health on a real shard: what ``qm status`` and the leader's gauges read, and when they warn."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from queue_manager import admin
from queue_manager.db.health import read_health
from queue_manager.domain.health import Thresholds
from queue_manager.domain.topology import Shard, Topology
from tests.conftest import tenants_of
from tests.managerkit import leading_manager, running_manager, wait_for

pytestmark = pytest.mark.timeout(120)

#: warnings on dead tuples from the first one (the defaults need 100 000)
DEAD_AT_ONCE = Thresholds(dead_min=1, dead_ratio=0.1)


@pytest.fixture
def orders(make_queue: Any, shard: Shard) -> Iterator[psycopg.Connection[Any]]:
    make_queue("orders", partitions=4, shuffle=2)
    with psycopg.connect(shard.dsn, autocommit=True) as c:
        yield c


def _flushed(conn: psycopg.Connection[Any], statement: str, params: Any = None) -> None:
    """Run ``statement`` and publish its statistics at its commit (not up to a second later)."""
    with conn.transaction():
        conn.execute(statement, params)
        conn.execute("SELECT pg_stat_force_next_flush()")


def _insert(conn: psycopg.Connection[Any], shard: Shard, n: int) -> None:
    tenants = tenants_of(shard, 20)
    _flushed(
        conn,
        "INSERT INTO orders (tenant, payload) SELECT (%s::text[])[1 + g %% 20], '{}' FROM generate_series(1, %s) g",
        (tenants, n),
    )


def _table(shards: Topology, thresholds: Thresholds | None = None) -> tuple[dict[str, Any], list[str]]:
    data = admin.status(shards, thresholds)
    s0 = data["shards"][0]
    (table,) = s0["health"]["tables"]
    return table, s0["warnings"]


def test_dead_tuples_appear_after_deletes_and_a_held_snapshot_keeps_them(
    shards: Topology, shard: Shard, orders: psycopg.Connection[Any]
) -> None:
    _insert(orders, shard, 2000)
    table, warnings = _table(shards, DEAD_AT_ONCE)
    assert table["queue"] == "orders" and table["dead_tuples"] == 0 and warnings == []
    assert table["table_bytes"] > 0 and table["index_bytes"] > 0
    assert {i["name"] for i in table["indexes"]} >= {"orders_pkey", "orders_due", "orders_fired", "orders_acked"}

    _flushed(orders, "DELETE FROM orders WHERE id <= 1000")
    table, warnings = _table(shards, DEAD_AT_ONCE)
    assert table["dead_tuples"] == 1000 and table["live_tuples"] == 1000
    (w,) = warnings
    assert "orders: 1000 dead tuples, 50% of the table" in w

    with psycopg.connect(shard.dsn, application_name="nightly-report") as holder:
        holder.execute("SELECT txid_current()")  # then idle in transaction: vacuum keeps what it may see
        _flushed(orders, "DELETE FROM orders WHERE id <= 1500")
        orders.execute("VACUUM orders")
        data = admin.status(shards, Thresholds(xmin_seconds=0.0, dead_min=1, dead_ratio=0.1))
        s0 = data["shards"][0]
        (table,) = s0["health"]["tables"]
        assert table["dead_tuples"] == 500  # the 1000 deleted before the snapshot are gone, not these
        assert table["vacuum_age_seconds"] is not None and table["vacuum_age_seconds"] < 60
        assert s0["xmin_horizon"]["holder"] == "nightly-report"
        assert s0["xmin_horizon"]["pid"] == holder.info.backend_pid
        held, dead = s0["warnings"]
        assert "session 'nightly-report'" in held and "held back vacuum" in held
        assert "orders: 500 dead tuples" in dead
        text = admin.render_status(data)
        assert "oldest xmin: session 'nightly-report'" in text
        assert re.search(r"tuples live 500 dead 500 \(autovacuum at \d+\)", text), text
        assert "vacuum: last 0s ago" in text or "vacuum: last 1s ago" in text
        holder.rollback()

    orders.execute("VACUUM orders")
    table, warnings = _table(shards, Thresholds(xmin_seconds=0.0, dead_min=1, dead_ratio=0.1))
    assert table["dead_tuples"] == 0 and warnings == []


def test_autovacuum_trigger_follows_the_tables_settings(shards: Topology, orders: psycopg.Connection[Any]) -> None:
    orders.execute("ALTER TABLE orders SET (autovacuum_vacuum_threshold = 123, autovacuum_vacuum_scale_factor = 0)")
    table, _ = _table(shards)
    assert table["autovacuum_trigger"] == 123
    assert "autovacuum_vacuum_threshold=123" in table["reloptions"]
    orders.execute("ALTER TABLE orders SET (autovacuum_enabled = off)")
    table, warnings = _table(shards)
    assert table["autovacuum_enabled"] is False
    (w,) = warnings
    assert "orders: autovacuum is off" in w


def test_index_bloat_estimate_is_close_to_what_pgstattuple_measures(
    shards: Topology, shard: Shard, orders: psycopg.Connection[Any]
) -> None:
    try:
        orders.execute("CREATE EXTENSION IF NOT EXISTS pgstattuple")
    except psycopg.Error:
        pytest.skip("the pgstattuple extension is not available on this server")
    _insert(orders, shard, 20_000)
    orders.execute("VACUUM ANALYZE orders")
    table, _ = _table(shards)
    fresh = {i["name"]: i for i in table["indexes"]}
    # a freshly built index has no bloat beyond its fillfactor's reserve
    assert fresh["orders_pkey"]["bloat_ratio"] < 0.1 and fresh["orders_due"]["bloat_ratio"] < 0.1

    # three rows in four deleted: vacuum empties their index entries, the pages stay
    _flushed(orders, "DELETE FROM orders WHERE id % 4 <> 0")
    orders.execute("VACUUM ANALYZE orders")
    table, warnings = _table(shards, Thresholds(index_bloat_min_bytes=0))
    est = {i["name"]: i for i in table["indexes"]}
    for name in ("orders_pkey", "orders_due"):
        row = orders.execute(
            "SELECT leaf_pages, avg_leaf_density, deleted_pages + empty_pages FROM pgstatindex(%s::regclass)", (name,)
        ).fetchone()
        assert row is not None
        leaf, density, empty = row
        pages = est[name]["size_bytes"] // 8192
        # measured waste: leaf space below the fillfactor (90) plus wholly empty pages, of the whole index
        measured = (leaf * (1 - min(density, 90.0) / 90.0) + empty) / pages
        # measured: 0.737 estimated against 0.723 (pkey), 0.744 against 0.740 (due)
        assert abs(est[name]["bloat_ratio"] - measured) < 0.05, (name, est[name], measured)
        assert est[name]["bloat_ratio"] > 0.5
    assert any("index orders_pkey is about" in w and "REINDEX INDEX CONCURRENTLY orders_pkey" in w for w in warnings)


def test_notify_queue_usage_and_slots_are_read(shard: Shard, orders: psycopg.Connection[Any]) -> None:
    reading = read_health(orders)
    assert 0.0 <= reading.notify_queue_usage < 0.01
    assert reading.slots == ()  # the test server has no replication slot


async def test_the_leader_publishes_health_gauges_and_a_standby_none(
    shard: Shard, orders: psycopg.Connection[Any]
) -> None:
    orders.execute("INSERT INTO orders (tenant, payload) VALUES (%s, '{}')", (tenants_of(shard, 1)[0],))
    async with leading_manager(shard.dsn, health_interval=0.2) as leader:
        await leader.signals.health_read.wait(10)
        text = leader.metrics.render()
        for series in (
            'qm_table_live_tuples{queue="orders"}',
            'qm_table_dead_tuples{queue="orders"}',
            'qm_table_autovacuum_trigger_tuples{queue="orders"}',
            'qm_table_size_bytes{queue="orders"}',
            'qm_table_index_size_bytes{queue="orders"}',
            'qm_index_size_bytes{index="orders_pkey",queue="orders"}',
            "qm_db_notify_queue_usage_ratio 0",
            "qm_db_health_warnings 0",
            "qm_db_xmin_horizon_age_seconds 0",
        ):
            assert series in text, series
        assert 'qm_maintenance_runs_total{job="health",outcome="finished"}' in text

        # a held snapshot shows in the next reading, with its age
        with psycopg.connect(shard.dsn) as holder:
            holder.execute("SELECT txid_current()")
            await asyncio.sleep(0.3)
            leader.signals.health_read.clear()
            await leader.signals.health_read.wait(10)
            age = _gauge(leader.metrics.render(), "qm_db_xmin_horizon_age_seconds")
            assert age > 0.2
            holder.rollback()

        # a warning counts in the gauge (and is the one qm status prints)
        orders.execute("ALTER TABLE orders SET (autovacuum_enabled = off)")
        warnings = await leader.signals.health_read.wait_for(lambda w: len(w) == 1, 10)
        assert "autovacuum is off" in warnings[0]
        assert _gauge(leader.metrics.render(), "qm_db_health_warnings") == 1

        async with running_manager(shard.dsn, health_interval=0.2) as standby:
            await asyncio.sleep(0.5)
            assert standby.role == "standby"
            assert "qm_table_dead_tuples{" not in standby.metrics.render()
    # a manager that stopped leading exports no stale reading
    assert "qm_table_dead_tuples{" not in leader.metrics.render()


def _gauge(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert m is not None, name
    return float(m.group(1))


def _vacuum_count(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT vacuum_count FROM pg_stat_user_tables WHERE relid = 'orders'::regclass").fetchone()
    assert row is not None
    return int(row[0])


async def test_the_leader_vacuums_a_queue_table_autovacuum_is_late_for(
    shard: Shard, orders: psycopg.Connection[Any]
) -> None:
    orders.execute("ALTER TABLE orders SET (autovacuum_vacuum_threshold = 100, autovacuum_vacuum_scale_factor = 0)")
    _insert(orders, shard, 1000)
    async with leading_manager(shard.dsn, health_interval=0.2, vacuum_after=0.5) as m:
        # under the trigger: nothing to do
        m.signals.health_read.clear()
        for _ in range(3):
            await m.signals.health_read.wait(10)
        assert m.metrics.vacuums.total() == 0
        for attempt in range(3):
            _flushed(orders, "DELETE FROM orders WHERE id <= %s", (500 + 100 * attempt,))
            try:
                assert await m.signals.vacuumed.wait(3) == "orders"
                break
            except AssertionError:  # autovacuum (once a minute) came first: the leader had nothing to do
                continue
        else:
            pytest.fail("the leader never vacuumed the table")
        assert _vacuum_count(orders) == 1
        assert read_health(orders).tables[0].dead_tuples == 0

        # under a held snapshot: at most one vacuum (it removes what is older), then none while
        # the same transaction holds the horizon, since another would remove nothing
        with psycopg.connect(shard.dsn) as holder:
            holder.execute("SELECT txid_current()")
            _flushed(orders, "DELETE FROM orders WHERE id <= 900")
            before = m.metrics.vacuums.get(queue="orders")
            m.signals.health_read.clear()
            for _ in range(8):  # 1.6 s of readings, over three times vacuum_after
                await m.signals.health_read.wait(10)
            assert read_health(orders).tables[0].dead_tuples == 900 - (500 + 100 * attempt)
            assert m.metrics.vacuums.get(queue="orders") - before <= 1
            holder.rollback()
        # released: the next vacuum removes them
        await wait_for(lambda: read_health(orders).tables[0].dead_tuples == 0, 10, "the dead tuples removed")
        assert 'qm_queue_vacuums_total{queue="orders"}' in m.metrics.render()


async def test_vacuum_after_zero_leaves_vacuum_to_autovacuum(shard: Shard, orders: psycopg.Connection[Any]) -> None:
    orders.execute("ALTER TABLE orders SET (autovacuum_vacuum_threshold = 100, autovacuum_vacuum_scale_factor = 0)")
    _insert(orders, shard, 1000)
    _flushed(orders, "DELETE FROM orders WHERE id <= 500")
    async with leading_manager(shard.dsn, health_interval=0.2, vacuum_after=0) as m:
        for _ in range(5):
            await m.signals.health_read.wait(10)
    assert m.metrics.vacuums.total() == 0 and _vacuum_count(orders) == 0


def test_the_holder_is_named_not_a_later_snapshot_that_shares_its_xmin(
    shards: Topology, shard: Shard, orders: psycopg.Connection[Any]
) -> None:
    with psycopg.connect(shard.dsn, application_name="the-holder") as holder:
        holder.execute("SELECT txid_current()")
        with psycopg.connect(shard.dsn, application_name="a-later-reader") as reader:
            reader.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            reader.execute("SELECT count(*) FROM orders")  # its snapshot's xmin is the holder's xid
            row = orders.execute(
                "SELECT age(backend_xmin) FROM pg_stat_activity WHERE application_name = 'a-later-reader'"
            ).fetchone()
            assert row is not None and row[0] is not None
            horizon = admin.status(shards)["shards"][0]["xmin_horizon"]
            assert horizon["holder"] == "the-holder" and horizon["pid"] == holder.info.backend_pid
            reader.rollback()
        holder.rollback()
