"""Enqueue by plain SQL and from Python against real PostgreSQL: routing, validation, dedup, batches."""

from __future__ import annotations

import json
import secrets
import threading
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from queue_manager.db.errors import translate
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
        state = c.execute(
            "SELECT state::text, attempts, fire_at <= clock_timestamp() FROM orders WHERE id = %s", (event_id,)
        )
        assert state.fetchone() == ("to_be_fired", 0, True)


def test_sql_routing_matches_vectors(conn: psycopg.Connection[Any], make_queue: Any) -> None:
    for v in VECTORS["vectors"]:
        row = conn.execute("SELECT md5(%s), qm.keyspace_hex(%s)", (v["tenant"], v["tenant"])).fetchone()
        assert row == (v["md5"], v["keyspace_hex"])
        for shape, expected in v["shuffle"].items():
            n, k = map(int, shape.split("/"))
            got = conn.execute("SELECT qm.shuffle_set(%s, %s, %s)", (v["tenant"], n, k)).fetchone()
            assert got == (expected,), (v["tenant"], shape)


@pytest.mark.parametrize(("n", "k"), [(16, 4), (10, 3), (7, 2), (5, 5), (64, 16), (40, 9)])
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
        # the bulk path (partition preset, routing trigger skipped) is guarded by the qm_verify statement trigger
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


def _copy(c: psycopg.Connection[Any], rows: list[tuple[Any, ...]], columns: str = "tenant, partition, payload") -> None:
    with c.cursor().copy(f"COPY orders ({columns}) FROM STDIN") as cp:
        for row in rows:
            cp.write_row(row)


def _multi_row_insert(c: psycopg.Connection[Any], rows: list[tuple[Any, ...]], columns: str) -> None:
    marks = ", ".join("(" + ", ".join(["%s"] * len(rows[0])) + ")" for _ in rows)
    c.execute(f"INSERT INTO orders ({columns}) VALUES {marks}", [v for row in rows for v in row])


def _insert_select(c: psycopg.Connection[Any], rows: list[tuple[Any, ...]], columns: str) -> None:
    c.execute(
        "CREATE TEMP TABLE IF NOT EXISTS src (tenant text, partition smallint, payload jsonb, fire_at timestamptz, "
        "attempts integer)"
    )
    c.execute("TRUNCATE src")
    with c.cursor().copy(f"COPY src ({columns}) FROM STDIN") as cp:
        for row in rows:
            cp.write_row(row)
    c.execute(f"INSERT INTO orders ({columns}) SELECT {columns} FROM src")


@pytest.mark.parametrize(
    "write", [_copy, _multi_row_insert, _insert_select], ids=["copy", "multi-row", "insert-select"]
)
def test_rows_with_a_preset_partition_are_checked_whatever_the_client(
    shards: Topology, make_queue: Any, write: Any
) -> None:
    """Bulk paths (partition set by the client): one bad row among good ones refuses the statement."""
    make_queue("orders", payload_limit_bytes=1024, max_delay_seconds=3600)
    s0, s1 = shards.shards
    mine = tenants_of(s0, 3)
    foreign = tenants_of(s1, 1)[0]
    good = [(t, routing.shuffle_set(t, 16, 4)[i % 4], json.dumps({"i": i}), None, 0) for i, t in enumerate(mine * 3)]
    columns = "tenant, partition, payload, fire_at, attempts"
    outside = next(p for p in range(16) if p not in routing.shuffle_set(mine[0], 16, 4))
    later = datetime.now(UTC) + timedelta(hours=2)
    cases: list[tuple[tuple[Any, ...], str]] = [
        ((foreign, routing.shuffle_set(foreign, 16, 4)[0], "{}", None, 0), "orders_tenant_on_this_shard"),
        ((mine[0], outside, "{}", None, 0), "orders_partition_in_shuffle_set"),
        ((mine[0], 16, "{}", None, 0), "orders_partition_in_shuffle_set"),
        ((mine[0], -1, "{}", None, 0), "orders_partition_in_shuffle_set"),
        # incompressible, so that its size is the same in every path (pg_column_size of the value as inserted)
        (
            (mine[0], routing.shuffle_set(mine[0], 16, 4)[0], json.dumps({"x": secrets.token_urlsafe(2000)}), None, 0),
            "orders_payload_within_limit",
        ),
        ((mine[0], routing.shuffle_set(mine[0], 16, 4)[0], "{}", later, 0), "orders_fire_at_in_range"),
        (
            (mine[0], routing.shuffle_set(mine[0], 16, 4)[0], "{}", datetime(1999, 12, 31, tzinfo=UTC), 0),
            "orders_fire_at_in_range",
        ),
        (("", routing.shuffle_set("", 16, 4)[0], "{}", None, 0), "orders_tenant_not_empty"),
        ((mine[0], routing.shuffle_set(mine[0], 16, 4)[0], "{}", None, 2), "orders_fresh_event"),
    ]
    with psycopg.connect(s0.dsn) as c:
        for bad, rule in cases:
            rows = [(t, p, pl, fa or datetime.now(UTC), a) for t, p, pl, fa, a in [*good[:4], bad, *good[4:]]]
            with pytest.raises(psycopg.errors.CheckViolation) as info:
                with c.transaction():
                    write(c, rows, columns)
            assert info.value.diag.constraint_name == rule, bad
            assert rule in str(info.value)
            if rule == "orders_tenant_on_this_shard":  # the right shard is named, for bulk rows too
                assert 'belongs to shard "s1"' in str(info.value)
                assert isinstance(translate(info.value, queue="orders"), MisroutedTenantError)
                assert translate(info.value, queue="orders").right_shard == "s1"  # type: ignore[union-attr]
            assert count(c) == 0
        with c.transaction():
            write(c, [(t, p, pl, datetime.now(UTC), a) for t, p, pl, _, a in good], columns)
        assert count(c) == len(good)


def test_preset_state_is_checked_even_with_a_valid_partition(shard: Shard, make_queue: Any) -> None:
    make_queue("orders")
    (t,) = tenants_of(shard, 1)
    p = routing.shuffle_set(t, 16, 4)[0]
    with psycopg.connect(shard.dsn, autocommit=True) as c:
        for column, value in [
            ("state", "fired"),
            ("fired_at", "now()"),
            ("acked_at", "now()"),
            ("ack_deadline", "now()"),
        ]:
            literal = f"'{value}'" if column == "state" else value
            with pytest.raises(psycopg.errors.CheckViolation, match="new events must start as to_be_fired"):
                c.execute(f"INSERT INTO orders (tenant, partition, {column}) VALUES (%s, %s, {literal})", (t, p))
        assert count(c) == 0


def test_database_choice_matches_least_loaded_of_the_python_spec(shard: Shard, make_queue: Any) -> None:
    """The routing trigger's pick equals routing.least_loaded over qm.partition_loads, ties included."""
    make_queue("orders", partitions=12, shuffle=3)
    tenants = tenants_of(shard, 30)
    with psycopg.connect(shard.dsn, autocommit=True) as c:
        # uneven done counters, some making a load negative, written the way the manager does
        done = [5, 0, 2, 0, 0, 9, 1, 0, 3, 0, 0, 7]
        parts = [p for p, n in enumerate(done) for _ in range(n)]
        c.execute("SELECT qm.add_done((SELECT id FROM qm.queues WHERE name = 'orders'), %s::smallint[])", (parts,))
        assert c.execute("SELECT qm.partition_loads('orders')").fetchone() == ([-n for n in done],)
        for i in range(120):
            t = tenants[(i * 7) % len(tenants)]
            row = c.execute("SELECT qm.partition_loads('orders')").fetchone()
            assert row is not None
            loads = dict(enumerate(row[0]))
            expected = routing.least_loaded(routing.shuffle_set(t, 12, 3), loads)
            got = c.execute("INSERT INTO orders (tenant) VALUES (%s) RETURNING partition", (t,)).fetchone()
            assert got == (expected,), (t, loads)


@pytest.mark.parametrize(("n", "k"), [(1, 1), (3, 1), (1024, 16), (1000, 7), (64, 2)])
def test_routing_and_checks_for_extreme_shapes(shard: Shard, make_queue: Any, n: int, k: int) -> None:
    make_queue("orders", partitions=n, shuffle=k)
    tenants = tenants_of(shard, 8)
    with psycopg.connect(shard.dsn, autocommit=True) as c:
        for t in tenants:
            allowed = routing.shuffle_set(t, n, k)
            row = c.execute("INSERT INTO orders (tenant) VALUES (%s) RETURNING partition", (t,)).fetchone()
            assert row is not None and row[0] in allowed
            c.execute("INSERT INTO orders (tenant, partition) VALUES (%s, %s)", (t, allowed[-1]))
            outside = next((p for p in range(n) if p not in allowed), n)
            with pytest.raises(psycopg.errors.CheckViolation):
                c.execute("INSERT INTO orders (tenant, partition) VALUES (%s, %s)", (t, outside))
        loads = c.execute("SELECT qm.partition_loads('orders')").fetchone()
        assert loads is not None and sum(loads[0]) == len(tenants)


def test_changed_settings_take_effect_on_both_paths(shard: Shard, make_queue: Any) -> None:
    make_queue("orders", payload_limit_bytes=4096)
    (t,) = tenants_of(shard, 1)
    p = routing.shuffle_set(t, 16, 4)[0]
    big = json.dumps({"x": "y" * 2000})
    with psycopg.connect(shard.dsn, autocommit=True) as c:
        c.execute("INSERT INTO orders (tenant, payload) VALUES (%s, %s)", (t, big))
        c.execute("INSERT INTO orders (tenant, partition, payload) VALUES (%s, %s, %s)", (t, p, big))
        c.execute("SELECT qm.alter_queue('orders', '{\"payload_limit_bytes\": 1024}')")
        with pytest.raises(psycopg.errors.ProgramLimitExceeded):
            c.execute("INSERT INTO orders (tenant, payload) VALUES (%s, %s)", (t, big))
        with pytest.raises(psycopg.errors.CheckViolation, match="orders_payload_within_limit"):
            c.execute("INSERT INTO orders (tenant, partition, payload) VALUES (%s, %s, %s)", (t, p, big))
        c.execute("SELECT qm.alter_queue('orders', '{\"partitions\": 32}')")
        grown = routing.shuffle_set(t, 32, 4)
        c.execute("INSERT INTO orders (tenant, partition) VALUES (%s, %s)", (t, grown[-1]))
        if p not in grown:
            with pytest.raises(psycopg.errors.CheckViolation, match="orders_partition_in_shuffle_set"):
                c.execute("INSERT INTO orders (tenant, partition) VALUES (%s, %s)", (t, p))
        row = c.execute("INSERT INTO orders (tenant) VALUES (%s) RETURNING partition", (t,)).fetchone()
        assert row is not None and row[0] in grown


def test_a_database_without_shard_identity_refuses_both_paths(new_database: Any) -> None:
    dsn = new_database()
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("SELECT qm.create_queue('orders')")
        for stmt in (
            "INSERT INTO orders (tenant) VALUES ('t')",
            "INSERT INTO orders (tenant, partition) VALUES ('t', 0)",
        ):
            with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState, match="no shard identity"):
                c.execute(stmt)


def test_batch_sends_only_the_columns_it_uses(shard: Shard, make_queue: Any) -> None:
    """Without fire_at or dedup keys the COPY leaves fire_at to the column default (the insert's clock_timestamp())."""
    make_queue("orders", partitions=8, shuffle=2)
    tenants = tenants_of(shard, 5)
    later = datetime.now(UTC) + timedelta(minutes=5)
    with psycopg.connect(shard.dsn) as c:
        assert enqueue_batch(c, "orders", [Event(t, {"plain": i}) for i, t in enumerate(tenants * 4)]) == 20
        assert (
            enqueue_batch(c, "orders", [Event(t, {"keyed": i}, dedup_key=f"k{i}") for i, t in enumerate(tenants)]) == 5
        )
        mixed = [Event(t, {"mixed": i}, fire_at=later if i % 2 else None) for i, t in enumerate(tenants)]
        assert enqueue_batch(c, "orders", mixed) == 5
        c.commit()
        # the default: the time of the insert itself (created_at is the transaction's start)
        assert count(c, "fire_at >= created_at AND fire_at < created_at + interval '1 minute'") == 20 + 5 + 3
        assert count(c, "fire_at > created_at + interval '4 minutes'") == 2
        rows = c.execute("SELECT tenant, partition FROM orders").fetchall()
        assert all(p in routing.shuffle_set(t, 8, 2) for t, p in rows)
        loads = c.execute("SELECT qm.partition_loads('orders')").fetchone()
        assert loads is not None and sum(loads[0]) == 30


def test_an_event_made_fresh_again_must_sit_in_a_live_partition(shard: Shard, make_queue: Any) -> None:
    """After a shrink, putting a dead letter of a dropped partition back (attempts 0) is refused."""
    make_queue("orders", partitions=4, shuffle=2)
    tenants = tenants_of(shard, 20)
    with psycopg.connect(shard.dsn, autocommit=True) as c:
        for t in tenants:
            c.execute("INSERT INTO orders (tenant) VALUES (%s)", (t,))
        c.execute("UPDATE orders SET state = 'failed', attempts = 3")
        c.execute("SELECT qm.alter_queue('orders', '{\"partitions\": 2, \"shuffle\": 1}')")
        assert c.execute("SELECT partitions_physical FROM qm.queues WHERE name = 'orders'").fetchone() == (2,)
        retry = "UPDATE orders SET state = 'to_be_fired', attempts = 0 WHERE state = 'failed' AND partition {} 2"
        with pytest.raises(psycopg.errors.CheckViolation) as info:
            c.execute(retry.format(">="))
        assert info.value.diag.constraint_name == "orders_partition_in_shuffle_set"
        assert c.execute(retry.format("<")).rowcount == count(c, "partition < 2")


def test_done_counters_live_in_the_sequences_routing_reads(shard: Shard, make_queue: Any) -> None:
    """add_done moves the done sequences directly (no row, no lock, no dead tuple); like every
    counter here it is not transactional, so a rolled-back one stays until reconcile_load."""
    make_queue("orders", partitions=4, shuffle=4)
    tenants = tenants_of(shard, 12)
    with psycopg.connect(shard.dsn, autocommit=True) as c:
        qid = c.execute("SELECT id FROM qm.queues WHERE name = 'orders'").fetchone()
        for t in tenants:
            c.execute("INSERT INTO orders (tenant) VALUES (%s)", (t,))
        live = c.execute("SELECT qm.reconcile_load('orders')").fetchone()
        assert live is not None and sum(live[0]) == 12
        assert c.execute("SELECT qm.partition_loads('orders')").fetchone() == live
        c.execute("SELECT qm.add_done(%s, '{0,0,1}')", qid)
        assert c.execute("SELECT qm.partition_loads('orders')").fetchone() == (
            [live[0][0] - 2, live[0][1] - 1, live[0][2], live[0][3]],
        )
        with c.transaction(force_rollback=True):
            c.execute("SELECT qm.add_done(%s, '{3,3,3}')", qid)
        loads = c.execute("SELECT qm.partition_loads('orders')").fetchone()
        assert loads is not None and loads[0][3] == live[0][3] - 3  # the rollback does not undo it
        assert c.execute("SELECT to_regclass('qm.queue_load')").fetchone() == (None,)
        assert c.execute("SELECT qm.reconcile_load('orders')").fetchone() == live
        assert c.execute("SELECT qm.partition_loads('orders')").fetchone() == live


def test_the_backdated_threshold_is_the_one_the_dispatcher_assumes(shard: Shard) -> None:
    """The verify trigger announces rows older than qm.backdated_ms() (floors.BACKDATED); the
    dispatcher's floors rely on every other row being at most that old."""
    from queue_manager.manager.floors import BACKDATED

    with psycopg.connect(shard.dsn) as c:
        assert c.execute("SELECT qm.backdated_ms()").fetchone() == (round(BACKDATED * 1000),)


@pytest.mark.parametrize(("n", "k"), [(512, 16), (300, 10), (1024, 8)])
def test_routing_trigger_reaches_every_partition_of_wide_groups(shard: Shard, make_queue: Any, n: int, k: int) -> None:
    """Rows routed by the database land in their Python shuffle sets and use every partition.

    Before revision 0005, (512, 16) and (300, 10) left half the partitions unused (a draw of
    one hex digit for groups of 32 and 30)."""
    make_queue("orders", partitions=n, shuffle=k)
    tenants = tenants_of(shard, 6 * n)
    with psycopg.connect(shard.dsn, autocommit=True) as c:
        c.execute(
            "INSERT INTO orders (tenant, payload) SELECT t, '{}' FROM unnest(%s::text[]) AS t",
            (tenants,),
        )
        rows = c.execute("SELECT tenant, partition FROM orders").fetchall()
        sql_sets = dict(
            c.execute(
                "SELECT t, qm.shuffle_set(t, %s, %s) FROM unnest(%s::text[]) AS t", (n, k, tenants[:50])
            ).fetchall()
        )
    assert len(rows) == len(tenants)
    for tenant, partition in rows:
        assert partition in routing.shuffle_set(tenant, n, k), (tenant, partition)
    for tenant, sql_set in sql_sets.items():
        assert tuple(sql_set) == routing.shuffle_set(tenant, n, k)
    assert {p for _, p in rows} == set(range(n))
