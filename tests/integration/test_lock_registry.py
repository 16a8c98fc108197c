"""The registry of advisory locks in a migrated database: qm.lock_class agrees with
queue_manager/db/locks.py, every function and trigger (each queue's generated ones included) takes
its advisory locks by a registered class, and the locks an enqueue holds have registered classes,
never a queue id (tests/unit/test_lock_registry.py checks the sources)."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from queue_manager import admin
from queue_manager.db.locks import LockClass
from queue_manager.domain.topology import KeyRange, Shard, Topology
from tests.conftest import DatabaseFactory, tenants_of
from tests.unit.test_lock_registry import advisory_calls

Conn = psycopg.Connection[Any]


def test_the_sql_registry_is_the_python_one(conn: Conn) -> None:
    rows = dict(conn.execute("SELECT purpose, lock_class FROM qm.lock_classes()").fetchall())
    assert rows == {c.purpose: int(c) for c in LockClass}
    for c in LockClass:
        assert conn.execute("SELECT qm.lock_class(%s)", (c.purpose,)).fetchone() == (int(c),)
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="no advisory lock class named 'wakeup'"):
        conn.execute("SELECT qm.lock_class('wakeup')")


def _definitions(dsn: str) -> dict[str, str]:
    """The text of every function and trigger outside PostgreSQL's own schemas."""
    with psycopg.connect(dsn) as conn:
        return _definitions_on(conn)


def _definitions_on(conn: Conn) -> dict[str, str]:
    found = dict(
        conn.execute(
            "SELECT p.oid::regprocedure::text, pg_get_functiondef(p.oid) FROM pg_proc p "
            "WHERE p.pronamespace NOT IN ('pg_catalog'::regnamespace, 'information_schema'::regnamespace) "
            "AND p.prokind IN ('f', 'p')"
        ).fetchall()
    )
    found.update(
        conn.execute(
            "SELECT tgrelid::regclass::text || ' ' || tgname, pg_get_triggerdef(oid) "
            "FROM pg_trigger WHERE NOT tgisinternal"
        ).fetchall()
    )
    return found


def test_every_function_and_trigger_takes_its_locks_by_a_registered_class(
    shards: Topology, new_database: DatabaseFactory
) -> None:
    # queues of every shape the generator knows: k = 1, k = N, k > 8 (two draw words), N = 1024;
    # and one on a database without a shard identity (its generated code only refuses)
    for name, settings in {
        "one": {"partitions": 1, "shuffle": 1},
        "orders": {"partitions": 8, "shuffle": 2},
        "square": {"partitions": 4, "shuffle": 4},
        "wide": {"partitions": 1024, "shuffle": 16},
        "nine": {"partitions": 40, "shuffle": 9},
    }.items():
        admin.create_queue(shards, name, settings)
    bare = new_database()
    admin.create_queue(Topology((Shard("s0", bare, KeyRange.parse("-")),)), "orders", {})

    purposes = {c.purpose for c in LockClass}
    for dsn in (bare, shards.shards[0].dsn):
        calls = {name: advisory_calls(text) for name, text in _definitions(dsn).items()}
        wrong = [f"{name}: {call}" for name, found in calls.items() for call, p in found if p not in purposes]
        assert not wrong, "\n".join(wrong)
    # the scan sees the locks where they are taken (it would pass vacuously otherwise): the generated
    # route and verify functions of queue 4 ("wide"), and a function of the source
    assert {p for _, p in calls["qm.q4_route()"]} == {"dedup"}
    assert {p for _, p in calls["qm.q4_verify()"]} == {"wake"}
    assert {p for _, p in calls["qm.count_maintenance(text,text,bigint)"]} == {"maintenance"}
    # the load counters take no lock: approximate by design (docs/design.md, "Shuffle sharding")
    for counters in ("qm.reconcile_partition(text,integer)", "qm.add_done(integer,smallint[])"):
        assert calls[counters] == [], counters


def test_an_enqueue_holds_advisory_locks_of_registered_classes_only(shard: Shard, make_queue: Any) -> None:
    """A producer's transaction (a routed insert with a dedup key) holds the dedup lock and tries the
    wake-up lock, both of registered classes: no lock takes the queue id as its class, and the load
    counters take none."""
    make_queue("orders", partitions=8, shuffle=2)
    tenant = tenants_of(shard, 1)[0]
    with psycopg.connect(shard.dsn) as producer:
        producer.execute("INSERT INTO orders (tenant, payload, dedup_key) VALUES (%s, '{}', 'k-1')", (tenant,))
        held = producer.execute(
            "SELECT classid::integer, objid::bigint, mode FROM pg_locks "
            "WHERE locktype = 'advisory' AND pid = pg_backend_pid() ORDER BY 1"
        ).fetchall()
        producer.rollback()
    qid = _queue_id(shard.dsn, "orders")
    assert {c for c, _, _ in held} == {int(LockClass.DEDUP), int(LockClass.WAKE)}, held
    assert (int(LockClass.WAKE), qid, "ShareLock") in held
    assert all(c != qid for c, _, _ in held)


def _queue_id(dsn: str, name: str) -> int:
    with psycopg.connect(dsn) as c:
        row = c.execute("SELECT id FROM qm.queues WHERE name = %s", (name,)).fetchone()
    assert row is not None
    return int(row[0])
