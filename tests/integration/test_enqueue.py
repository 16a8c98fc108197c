"""Enqueue by plain SQL and from Python against real PostgreSQL: routing, validation, dedup, batches."""

from __future__ import annotations

import json
import threading
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from queue_manager.domain import routing
from queue_manager.domain.topology import Shard, Topology
from queue_manager.errors import InvalidEventError, MisroutedTenantError, UnknownQueueError
from queue_manager.producer import Event, Router, aenqueue, enqueue, enqueue_batch
from tests.conftest import tenants_of

VECTORS = json.loads((Path(__file__).parents[1] / "vectors" / "routing_vectors.json").read_text())


def count(conn: psycopg.Connection[Any], where: str = "true", params: tuple[Any, ...] = ()) -> int:
    row = conn.execute(f"SELECT count(*) FROM orders WHERE {where}", params).fetchone()
    assert row is not None
    return int(row[0])


def test_rolled_back_insert_leaves_nothing_and_commit_lands(shard: Shard, make_queue: Any) -> None:
    make_queue("orders")
    (t,) = tenants_of(shard, 1)
    with psycopg.connect(shard.dsn) as c:
        with c.transaction(force_rollback=True):
            c.execute("INSERT INTO orders (tenant, payload) VALUES (%s, '{\"a\": 1}')", (t,))
            assert count(c) == 1
        assert count(c) == 0
        assert c.execute("SELECT qm.reconcile_load('orders')").fetchone() == ([0] * 16,)
        with c.transaction():
            row = c.execute("INSERT INTO orders (tenant, payload) VALUES (%s, '{}') RETURNING id, partition", (t,))
            event_id, partition = row.fetchone() or (None, None)
        assert event_id is not None
        assert partition in routing.shuffle_set(t, 16, 4)
        state = c.execute("SELECT state::text, attempts, fire_at <= now() FROM orders WHERE id = %s", (event_id,))
        assert state.fetchone() == ("to_be_fired", 0, True)


def test_sql_routing_matches_vectors(conn: psycopg.Connection[Any], make_queue: Any) -> None:
    for v in VECTORS["vectors"]:
        row = conn.execute("SELECT md5(%s), qm.keyspace_hex(%s)", (v["tenant"], v["tenant"])).fetchone()
        assert row == (v["md5"], v["keyspace_hex"])
        for shape, expected in v["shuffle"].items():
            n, k = map(int, shape.split("/"))
            got = conn.execute("SELECT qm.shuffle_set(%s, %s, %s)", (v["tenant"], n, k)).fetchone()
            assert got == (expected,), (v["tenant"], shape)


@pytest.mark.parametrize(("n", "k"), [(16, 4), (10, 3), (7, 2), (5, 5)])
def test_check_constraint_membership_matches_python(shard: Shard, make_queue: Any, n: int, k: int) -> None:
    """Every (tenant, partition) pair: the CHECK accepts exactly the Python shuffle set."""
    make_queue("orders", partitions=n, shuffle=k)
    tenants = tenants_of(shard, 12)
    with psycopg.connect(shard.dsn, autocommit=True) as c:
        for t in tenants:
            allowed = set(routing.shuffle_set(t, n, k))
            for p in range(-1, n + 1):
                try:
                    with c.transaction(force_rollback=True):
                        c.execute("INSERT INTO orders (tenant, partition, payload) VALUES (%s, %s, '{}')", (t, p))
                    accepted = True
                except psycopg.errors.CheckViolation as exc:
                    assert exc.diag.constraint_name == "orders_partition_in_shuffle_set"
                    accepted = False
                assert accepted == (p in allowed), (t, p)


def test_database_picks_least_loaded_partition_of_the_shuffle_set(shard: Shard, make_queue: Any) -> None:
    make_queue("orders", partitions=8, shuffle=4)
    (t,) = tenants_of(shard, 1)
    with psycopg.connect(shard.dsn, autocommit=True) as c:
        parts = [
            c.execute("INSERT INTO orders (tenant) VALUES (%s) RETURNING partition", (t,)).fetchone() for _ in range(40)
        ]
    used = Counter(p[0] for p in parts if p)
    assert set(used) == set(routing.shuffle_set(t, 8, 4))
    assert max(used.values()) - min(used.values()) <= 1  # one tenant alone fills its k partitions evenly


def test_bad_input_is_refused_clearly_and_costs_nothing_else(shards: Topology, make_queue: Any) -> None:
    make_queue("orders", payload_limit_bytes=1024)
    s0, s1 = shards.shards
    mine, foreign = tenants_of(s0, 1)[0], tenants_of(s1, 1)[0]
    cases: list[tuple[str, tuple[Any, ...], type[psycopg.Error], str]] = [
        (
            "INSERT INTO orders (tenant, payload) VALUES (%s, '{}')",
            (foreign,),
            psycopg.errors.CheckViolation,
            'belongs to shard "s1", not to this shard "s0"',
        ),
        (
            "INSERT INTO orders (tenant, payload) VALUES (NULL, '{}')",
            (),
            psycopg.errors.CheckViolation,
            "tenant must be a non-empty string, got NULL",
        ),
        (
            "INSERT INTO orders (tenant, payload) VALUES ('', '{}')",
            (),
            psycopg.errors.CheckViolation,
            "tenant must be a non-empty string, got an empty string",
        ),
        (
            "INSERT INTO orders (tenant, payload) VALUES (%s, %s)",
            (mine, json.dumps({"x": "y" * 2000})),
            psycopg.errors.ProgramLimitExceeded,
            "exceeds the queue's limit of 1024 bytes",
        ),
        (
            "INSERT INTO orders (tenant, payload, fire_at) VALUES (%s, '{}', NULL)",
            (mine,),
            psycopg.errors.CheckViolation,
            "fire_at must not be NULL",
        ),
        (
            "INSERT INTO orders (tenant, payload, fire_at) VALUES (%s, '{}', 'infinity')",
            (mine,),
            psycopg.errors.DatetimeFieldOverflow,
            "fire_at infinity is out of range",
        ),
        (
            "INSERT INTO orders (tenant, payload, fire_at) VALUES (%s, '{}', '1970-01-01')",
            (mine,),
            psycopg.errors.DatetimeFieldOverflow,
            "is out of range",
        ),
        (
            "INSERT INTO orders (tenant, payload, fire_at) VALUES (%s, '{}', now() + interval '50 years')",
            (mine,),
            psycopg.errors.DatetimeFieldOverflow,
            "is out of range",
        ),
        (
            "INSERT INTO orders (tenant, payload, state) VALUES (%s, '{}', 'acked')",
            (mine,),
            psycopg.errors.CheckViolation,
            "new events must start as to_be_fired",
        ),
        (
            "INSERT INTO orders (tenant, payload, attempts) VALUES (%s, '{}', 3)",
            (mine,),
            psycopg.errors.CheckViolation,
            "new events must start as to_be_fired",
        ),
        # the bulk path (partition preset, trigger skipped) is guarded by CHECK constraints
        (
            "INSERT INTO orders (tenant, partition, payload) VALUES (%s, %s, '{}')",
            (foreign, routing.shuffle_set(foreign, 16, 4)[0]),
            psycopg.errors.CheckViolation,
            "orders_tenant_on_this_shard",
        ),
        (
            "INSERT INTO orders (tenant, partition, payload) VALUES (%s, %s, %s)",
            (mine, routing.shuffle_set(mine, 16, 4)[0], json.dumps({"x": "y" * 2000})),
            psycopg.errors.CheckViolation,
            "orders_payload_within_limit",
        ),
        (
            "INSERT INTO orders (tenant, partition, payload, fire_at) VALUES (%s, %s, '{}', 'infinity')",
            (mine, routing.shuffle_set(mine, 16, 4)[0]),
            psycopg.errors.CheckViolation,
            "orders_fire_at_in_range",
        ),
        (
            "INSERT INTO orders (tenant, partition, payload) VALUES ('', 0, '{}')",
            (),
            psycopg.errors.CheckViolation,
            "orders_tenant_not_empty",
        ),
    ]
    with psycopg.connect(s0.dsn) as c:
        c.execute("INSERT INTO orders (tenant, payload) VALUES (%s, '{\"keep\": 1}')", (mine,))
        c.commit()
        for stmt, params, error, text in cases:
            with c.transaction():
                c.execute("INSERT INTO orders (tenant, payload) VALUES (%s, '{\"keep\": 2}')", (mine,))
                with pytest.raises(error) as info:
                    with c.transaction():  # a savepoint: the bad row alone is refused
                        c.execute(stmt, params)
                assert text in str(info.value), stmt
        assert count(c) == 1 + len(cases)
        assert count(c, "payload ? 'x'") == 0


def test_misrouted_tenant_names_the_right_shard_through_the_api(shards: Topology, make_queue: Any) -> None:
    make_queue("orders")
    s0, s1 = shards.shards
    foreign = tenants_of(s1, 1)[0]
    with psycopg.connect(s0.dsn) as c, pytest.raises(MisroutedTenantError) as info:
        enqueue(c, "orders", foreign, {})
    assert info.value.right_shard == "s1"
    with psycopg.connect(s0.dsn) as c, pytest.raises(MisroutedTenantError, match="does not belong to shard 's0'"):
        enqueue_batch(c, "orders", [Event(tenants_of(s0, 1)[0], {}), Event(foreign, {})])
    with psycopg.connect(s0.dsn) as c:
        assert count(c) == 0


def test_unknown_queue_and_bad_names(shard: Shard, make_queue: Any) -> None:
    with psycopg.connect(shard.dsn) as c, pytest.raises(UnknownQueueError):
        enqueue(c, "nope", "t", {})
    with psycopg.connect(shard.dsn) as c:
        from queue_manager.errors import InvalidNameError

        with pytest.raises(InvalidNameError):
            enqueue(c, "orders; DROP TABLE x", "t", {})
        with pytest.raises(psycopg.errors.InvalidName):
            c.execute("SELECT qm.create_queue('Bad-Name')")


def test_dedup_key_second_insert_does_nothing(shard: Shard, make_queue: Any) -> None:
    make_queue("orders")
    t, other = tenants_of(shard, 2)
    with psycopg.connect(shard.dsn, autocommit=True) as c:
        first = enqueue(c, "orders", t, {"n": 1}, dedup_key="k1")
        assert first is not None
        assert enqueue(c, "orders", t, {"n": 2}, dedup_key="k1") is None
        assert enqueue(c, "orders", other, {"n": 3}, dedup_key="k1") is not None  # keys are per tenant
        assert count(c, "dedup_key = 'k1'") == 2


def test_dedup_holds_between_concurrent_transactions(shard: Shard, make_queue: Any) -> None:
    make_queue("orders")
    (t,) = tenants_of(shard, 1)
    barrier = threading.Barrier(2)
    results: list[int | None] = []

    def produce() -> None:
        with psycopg.connect(shard.dsn) as c:
            barrier.wait()
            results.append(enqueue(c, "orders", t, {}, dedup_key="same"))
            c.commit()

    threads = [threading.Thread(target=produce) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    assert sorted(r is None for r in results) == [False, True]
    with psycopg.connect(shard.dsn) as c:
        assert count(c) == 1


def test_enqueue_joins_psycopg_and_sqlalchemy_transactions(shard: Shard, make_queue: Any) -> None:
    from sqlalchemy import text
    from sqlalchemy.orm import Session

    from queue_manager.db.migrate import engine_for

    make_queue("orders")
    (t,) = tenants_of(shard, 1)
    with psycopg.connect(shard.dsn) as c:
        c.execute("CREATE TABLE app (id int)")
        c.commit()
        with c.transaction(force_rollback=True):
            c.execute("INSERT INTO app VALUES (1)")
            assert enqueue(c, "orders", t, {"via": "psycopg"}) is not None
        with c.transaction():
            c.execute("INSERT INTO app VALUES (2)")
            enqueue(c, "orders", t, {"via": "psycopg"})
    engine = engine_for(shard.dsn)
    with engine.connect() as sa:
        enqueue(sa, "orders", t, {"via": "sa-rollback"})
        sa.rollback()
        sa.execute(text("INSERT INTO app VALUES (3)"))
        enqueue(sa, "orders", t, {"via": "sa-conn"})
        sa.commit()
    with Session(engine) as session:
        enqueue(session, "orders", t, {"via": "sa-session"})
        session.rollback()
        enqueue(session, "orders", t, {"via": "sa-session"}, fire_at=datetime.now(UTC) + timedelta(hours=1))
        session.commit()
    with psycopg.connect(shard.dsn) as c:
        vias = sorted(r[0] for r in c.execute("SELECT payload->>'via' FROM orders"))
        assert vias == ["psycopg", "sa-conn", "sa-session"]
        later = c.execute(
            "SELECT fire_at > now() + interval '50 minutes' FROM orders WHERE payload->>'via' = 'sa-session'"
        )
        assert later.fetchone() == (True,)


async def test_aenqueue_joins_async_transaction(shard: Shard, make_queue: Any) -> None:
    make_queue("orders")
    (t,) = tenants_of(shard, 1)
    async with await psycopg.AsyncConnection.connect(shard.dsn) as c:
        async with c.transaction(force_rollback=True):
            assert await aenqueue(c, "orders", t, {"n": 1}) is not None
        async with c.transaction():
            await aenqueue(c, "orders", t, {"n": 2})
    with psycopg.connect(shard.dsn) as c:
        assert [r[0] for r in c.execute("SELECT payload->>'n' FROM orders")] == ["2"]


def test_naive_fire_at_is_refused(shard: Shard, make_queue: Any) -> None:
    make_queue("orders")
    with psycopg.connect(shard.dsn) as c, pytest.raises(InvalidEventError, match="timezone-aware"):
        enqueue(c, "orders", tenants_of(shard, 1)[0], {}, fire_at=datetime(2030, 1, 1))


def test_batch_enqueue_copy_dedup_and_load_counters(shards: Topology, make_queue: Any) -> None:
    make_queue("orders", partitions=8, shuffle=2)
    s0 = shards.shards[0]
    tenants = tenants_of(s0, 20)
    later = datetime.now(UTC) + timedelta(minutes=5)
    events = [Event(t, {"i": i}, fire_at=later if i % 3 == 0 else None) for i, t in enumerate(tenants * 10)]
    with psycopg.connect(s0.dsn) as c:
        assert enqueue_batch(c, "orders", events) == 200
        c.commit()
        rows = c.execute("SELECT tenant, partition FROM orders").fetchall()
        assert len(rows) == 200
        assert all(p in routing.shuffle_set(t, 8, 2) for t, p in rows)
        assert count(c, "fire_at > now() + interval '4 minutes'") == sum(1 for e in events if e.fire_at)
        loads = c.execute("SELECT qm.partition_loads('orders')").fetchone()
        assert loads is not None and sum(loads[0]) == 200
        dup = [
            Event(tenants[0], {"d": 1}, dedup_key="x"),
            Event(tenants[0], {"d": 2}, dedup_key="x"),
            Event(tenants[1], {"d": 3}, dedup_key="x"),
        ]
        assert enqueue_batch(c, "orders", dup) == 2
        assert enqueue_batch(c, "orders", [Event(tenants[0], {"d": 4}, dedup_key="x")]) == 0
        c.commit()
        assert count(c, "dedup_key = 'x'") == 2


def test_router_sends_each_tenant_to_its_shard(shards: Topology, make_queue: Any) -> None:
    make_queue("orders")
    tenants = [f"r-{i}" for i in range(60)]
    with Router(shards) as router:
        for t in tenants:
            assert router.enqueue("orders", t, {"t": t}) is not None
        assert router.enqueue_batch("orders", [Event(t, {"b": 1}) for t in tenants]) == 60
    for s in shards.shards:
        with psycopg.connect(s.dsn) as c:
            got = Counter(r[0] for r in c.execute("SELECT tenant FROM orders"))
            assert set(got) == {t for t in tenants if s.key_range.contains(t)}
            assert set(got.values()) == {2}
