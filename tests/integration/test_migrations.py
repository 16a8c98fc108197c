"""The migration history and the schema source: a database migrated from the old history's last
revision keeps its events and ends with the schema of one built fresh; a second migration changes
nothing; an operator's table parameters survive."""

from __future__ import annotations

import difflib
import re
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from queue_manager import admin
from queue_manager.db import schema
from queue_manager.db.migrate import downgrade, set_identity, upgrade
from queue_manager.domain.topology import KeyRange, Shard, Topology
from queue_manager.errors import MigrationError
from queue_manager.local.embedded import pg_bin_dir
from tests import pgtest

#: the head revision of the alembic history
HEAD = "0009_priorities_keys"
#: tables the revisions after the baseline add
ADDED_TABLES = (
    "qm.audit",
    "qm.archive_runs",
    "qm.reshard_capture",
    "qm.reshard_rows",
    "qm.schedules",
    "qm.key_settings",
)
ADDED_SEQUENCES = ("audit_id_seq", "reshard_capture_seq_seq", "schedules_id_seq")
#: columns the revisions after the baseline add to a table, and the value every old row gets
ADDED_COLUMNS = {
    "qm.shard": ("serving", False),
    # 0009_priorities_keys: the queues' default priority (3), aging (30 s) and no key limits
    "qm.queues": (3, 30.0, None, None),
    # 0006_trace_context: the trace context of every event, NULL for those enqueued before; then
    # 0009_priorities_keys: priority 3 and no keys
    **{f"public.{q}": (None, None, None, 3, None, None) for q in ("orders", "emails", "wide")},
}
#: a shard at revision 0013_enqueue_lock of the squashed history, with queues and events in every
#: state (made by tests/fixtures/make_old_head_dump.py)
OLD_HEAD_DUMP = Path(__file__).parents[1] / "fixtures" / "old_head_0013.sql"
#: a generated function of a queue: not in the schema source, made by qm.apply_queue
GENERATED = re.compile(r"^q\d+_(route|verify)$")
#: the header pg_dump writes before each object
_DUMP_HEADER = re.compile(r"^-- Name: (.*); Type: (.*); Schema: (.*); Owner: .*$", re.MULTILINE)

Conn = psycopg.Connection[Any]


@pytest.fixture
def database(pg_admin_dsn: str) -> Iterator[Any]:
    """A factory of empty databases, dropped at teardown."""
    names: list[str] = []

    def make() -> str:
        name = f"qm_m_{uuid.uuid4().hex[:12]}"
        names.append(name)
        return pgtest.fresh_database(pg_admin_dsn, None, name)

    yield make
    for name in names:
        pgtest.drop_database(pg_admin_dsn, name)


def _restore(dsn: str, dump: Path) -> None:
    subprocess.run(
        [str(pg_bin_dir() / "psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1", "--dbname", dsn, "-f", str(dump)],
        check=True,
        capture_output=True,
        text=True,
    )


def _copy_by_dump(source: str, target: str, tmp_path: Path) -> None:
    """Dump ``source`` and restore it into ``target``, as the fixture was: a restore reads back the
    dump's text of each CHECK constraint, and keeps it in that form (``a BETWEEN b AND c AND d``
    comes back with one AND, not two)."""
    dump = tmp_path / "copy.sql"
    subprocess.run(
        [str(pg_bin_dir() / "pg_dump"), "--no-owner", "--no-privileges", "--dbname", source, "-f", str(dump)],
        check=True,
        capture_output=True,
    )
    _restore(target, dump)


def schema_dump(dsn: str) -> dict[str, str]:
    """``pg_dump --schema-only`` by object (``name; type; schema``), without the dump's comments,
    settings and ownership, so that two databases with the same objects compare equal whatever
    order their objects were made in."""
    out = subprocess.run(
        [str(pg_bin_dir() / "pg_dump"), "--schema-only", "--no-owner", "--no-privileges", "--dbname", dsn],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    objects: dict[str, str] = {}
    headers = list(_DUMP_HEADER.finditer(out))
    for m, nxt in zip(headers, [*headers[1:], None], strict=True):
        body = out[m.end() : nxt.start() if nxt else len(out)]
        lines = [ln for ln in body.splitlines() if ln.strip() and not ln.startswith(("--", "\\"))]
        key = "; ".join(m.groups())
        assert key not in objects, key
        objects[key] = "\n".join(lines)
    return objects


def _diff(a: dict[str, str], b: dict[str, str]) -> str:
    out = [f"only in the first: {k}" for k in sorted(a.keys() - b.keys())]
    out += [f"only in the second: {k}" for k in sorted(b.keys() - a.keys())]
    for k in sorted(a.keys() & b.keys()):
        if a[k] != b[k]:
            out.append(f"differs: {k}")
            out += difflib.unified_diff(a[k].splitlines(), b[k].splitlines(), lineterm="", n=1)
    return "\n".join(out)


def _contents(conn: Conn) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table of schema qm (but alembic's) and of every queue table, and the value
    of every sequence of schema qm (the load and maintenance counters)."""
    tables = conn.execute(
        "SELECT c.relnamespace::regnamespace::text, c.relname FROM pg_class c "
        "WHERE c.relkind = 'r' AND c.relnamespace IN ('qm'::regnamespace, 'public'::regnamespace) "
        "AND c.relname <> 'alembic_version' ORDER BY 1, 2"
    ).fetchall()
    found: dict[str, list[tuple[Any, ...]]] = {}
    for schema_name, name in tables:
        query = sql.SQL("SELECT * FROM {} ORDER BY 1, 2").format(sql.Identifier(schema_name, name))
        found[f"{schema_name}.{name}"] = conn.execute(query).fetchall()
    # a done counter never written reads NULL before the migration and 0 after it (apply_queue_counters
    # marks it called, so that qm.add_done's first nextval counts one): the same value to every reader
    found["sequences"] = conn.execute(
        "SELECT c.relname, CASE WHEN right(c.relname, 5) = '_done' THEN coalesce(pg_sequence_last_value(c.oid), 0) "
        "ELSE pg_sequence_last_value(c.oid) END FROM pg_class c "
        "WHERE c.relkind = 'S' AND c.relnamespace = 'qm'::regnamespace ORDER BY 1"
    ).fetchall()
    return found


def _functions(conn: Conn) -> set[str]:
    return {str(n) for (n,) in conn.execute("SELECT proname FROM pg_proc WHERE pronamespace = 'qm'::regnamespace")}


def _build_like(conn: Conn, dsn: str) -> None:
    """Build the database at ``dsn`` fresh from empty with the topology and queues of ``conn``'s."""
    upgrade(dsn)
    (shard,) = conn.execute("SELECT name FROM qm.shard").fetchone() or ("",)
    (shards,) = conn.execute("SELECT jsonb_agg(to_jsonb(m) ORDER BY m.name) FROM qm.shard_map m").fetchone() or ("",)
    queues = conn.execute(
        "SELECT q.name, (SELECT jsonb_object_agg(k, to_jsonb(q) -> k) FROM unnest(qm.settable_columns()) k) "
        "FROM qm.queues q ORDER BY q.id"
    ).fetchall()
    with psycopg.connect(dsn, autocommit=True) as fresh:
        fresh.execute("SELECT qm.set_topology(%s, %s)", (shard, psycopg.types.json.Jsonb(shards)))
        for name, settings in queues:
            fresh.execute("SELECT qm.create_queue(%s, %s)", (name, psycopg.types.json.Jsonb(settings)))


def test_head_is_the_latest_revision(shard: Shard) -> None:
    with psycopg.connect(shard.dsn) as c:
        row: Any = c.execute("SELECT version_num FROM qm.alembic_version").fetchone()
    assert row == (HEAD,)


def test_a_database_at_the_old_head_keeps_its_events_and_ends_as_one_built_fresh(database: Any, tmp_path: Path) -> None:
    """Revision 0013_enqueue_lock of the squashed history is carried over: nothing stored changes
    (every row of every table, every counter), and its schema is then the schema of a database
    migrated from empty with the same topology and queues: the same tables, indexes, triggers and
    functions, the generated ones of each queue included."""
    old = database()
    _restore(old, OLD_HEAD_DUMP)
    with psycopg.connect(old, autocommit=True) as c:
        assert c.execute("SELECT version_num FROM qm.alembic_version").fetchone() == (schema.LEGACY_HEAD,)
        before = _contents(c)
        old_functions = _functions(c)
    assert sum(len(before[t]) for t in ("public.orders", "public.emails", "public.wide")) == 54
    assert {"wake_lock_key", "enq_lock_key"} <= old_functions

    upgrade(old)

    with psycopg.connect(old, autocommit=True) as c:
        assert c.execute("SELECT version_num FROM qm.alembic_version").fetchone() == (HEAD,)
        after = _contents(c)
        functions = _functions(c)
        fresh = database()
        _build_like(c, fresh)
    # tables added by the revisions after the baseline start empty; every other row is as it was
    assert [after.pop(t) for t in ADDED_TABLES] == [[] for _ in ADDED_TABLES]
    after["sequences"] = [s for s in after["sequences"] if s[0] not in ADDED_SEQUENCES]
    for table, added in ADDED_COLUMNS.items():
        assert [row[-len(added) :] for row in after[table]] == [added] * len(after[table])
        after[table] = [row[: -len(added)] for row in after[table]]
    assert after == before
    # the functions are the source's, and the generated ones of each queue
    source = {Path(f).stem for f in schema.SOURCE}
    assert {f for f in functions if not GENERATED.match(f)} == source
    # compared as the fixture came: through a dump and a restore
    restored = database()
    _copy_by_dump(fresh, restored, tmp_path)
    migrated, built = schema_dump(old), schema_dump(restored)
    assert len(built) > 200
    assert migrated == built, _diff(migrated, built)


def test_the_carried_over_database_routes_checks_and_dispatches_as_before(database: Any) -> None:
    """After the carry-over the events inserted before and after stand side by side: a routed insert
    lands in its tenant's shuffle set, a dedup key of an old event still deduplicates, a tenant of
    the other shard is refused, and the counters count the new rows on top of the old."""
    old = database()
    _restore(old, OLD_HEAD_DUMP)
    upgrade(old)
    with psycopg.connect(old, autocommit=True) as c:
        row: Any = c.execute("SELECT tenant, dedup_key FROM orders WHERE dedup_key LIKE 'key-%' LIMIT 1").fetchone()
        tenant, key = row
        loads: Any = c.execute("SELECT qm.partition_loads('orders')").fetchone()
        twin = c.execute(
            "INSERT INTO orders (tenant, payload, dedup_key) VALUES (%s, '{}', %s) RETURNING id", (tenant, key)
        ).fetchone()
        assert twin is None  # an event with that dedup key exists: the insert does nothing
        row = c.execute(
            "INSERT INTO orders (tenant, payload) VALUES (%s, '{}') RETURNING partition", (tenant,)
        ).fetchone()
        part = row[0]
        row = c.execute("SELECT qm.shuffle_set(%s, 8, 2)", (tenant,)).fetchone()
        assert part in row[0]
        after: Any = c.execute("SELECT qm.partition_loads('orders')").fetchone()
        assert [a - b for a, b in zip(after[0], loads[0], strict=True)] == [int(p == part) for p in range(8)]
        other = next(f"t-{i}" for i in range(100) if not KeyRange.parse("-80").contains(f"t-{i}"))
        with pytest.raises(psycopg.errors.CheckViolation, match='belongs to shard "s1"'):
            c.execute("INSERT INTO orders (tenant, payload) VALUES (%s, '{}')", (other,))


def test_a_database_at_an_earlier_revision_of_the_squashed_history_is_refused(database: Any) -> None:
    dsn = database()
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("CREATE SCHEMA qm")
        c.execute("CREATE TABLE qm.alembic_version (version_num varchar(32) PRIMARY KEY)")
        c.execute("INSERT INTO qm.alembic_version VALUES ('0009_maintenance_slices')")
    with pytest.raises(MigrationError, match="only its last revision, 0013_enqueue_lock"):
        upgrade(dsn)
    with psycopg.connect(dsn) as c:
        assert c.execute("SELECT version_num FROM qm.alembic_version").fetchone() == ("0009_maintenance_slices",)


def test_migrating_again_changes_nothing(shards: Topology) -> None:
    """Each migration applies the source and regenerates every queue: the same schema again."""
    admin.create_queue(shards, "orders", {"partitions": 4, "shuffle": 2})
    dsn = shards.shards[0].dsn
    before = schema_dump(dsn)
    upgrade(dsn)
    assert schema_dump(dsn) == before, _diff(before, schema_dump(dsn))


#: the storage parameters qm.create_queue gives every queue table (qm.tune_queue_tables)
TUNED = {
    "autovacuum_vacuum_scale_factor=0.02",
    "autovacuum_analyze_scale_factor=0.02",
    "autovacuum_vacuum_cost_limit=2000",
}


def _reloptions(dsn: str, table: str) -> set[str]:
    with psycopg.connect(dsn) as c:
        row: Any = c.execute("SELECT reloptions FROM pg_class WHERE oid = %s::regclass", (table,)).fetchone()
    return set(row[0] or [])


def test_queue_tables_are_tuned_and_migrations_leave_an_operators_parameters(database: Any) -> None:
    dsn = database()
    upgrade(dsn)
    shard = Shard("s0", dsn, KeyRange.parse("-"))
    topology = Topology((shard,))
    set_identity(dsn, shard, topology)
    admin.create_queue(topology, "emails", {})
    assert _reloptions(dsn, "emails") == TUNED
    # qm queue alter, qm migrate and the migrations' regeneration of every queue leave an operator's change
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("ALTER TABLE emails SET (autovacuum_vacuum_cost_limit = 500)")
    admin.alter_queue(topology, "emails", {"partitions": 8})
    set_identity(dsn, shard, topology)
    upgrade(dsn)
    assert "autovacuum_vacuum_cost_limit=500" in _reloptions(dsn, "emails")
    with psycopg.connect(dsn, autocommit=True) as c, pytest.raises(psycopg.errors.UndefinedTable):
        c.execute("SELECT qm.tune_queue_tables(-1)")


def _columns(conn: Conn, table: str) -> list[str]:
    return [
        str(n)
        for (n,) in conn.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped "
            "ORDER BY attnum",
            (table,),
        )
    ]


def test_priorities_and_keys_downgrade_to_the_schedules_revision_and_back(shards: Topology) -> None:
    """0009_priorities_keys undone: the queue tables lose priority and the keys, the due index is
    (partition, fire_at) again, the registry loses its settings and qm.key_settings goes; the events
    stay. Migrated to head again, the events are back at the queue's default priority."""
    admin.create_queue(shards, "orders", {"partitions": 4, "shuffle": 2, "default_priority": 2})
    dsn = shards.shards[0].dsn
    with psycopg.connect(dsn, autocommit=True) as c:
        tenant = next(f"t-{i}" for i in range(100) if KeyRange.parse("-80").contains(f"t-{i}"))
        c.execute(
            "INSERT INTO orders (tenant, payload, priority, concurrency_key) "
            "VALUES (%s, '{}', 1, 'k'), (%s, '{}', 5, NULL)",
            (tenant, tenant),
        )
        c.execute("INSERT INTO orders (tenant, payload) VALUES (%s, '{}')", (tenant,))
        assert [p for (p,) in c.execute("SELECT priority FROM orders ORDER BY id")] == [1, 5, 2]
        c.execute("SELECT qm.set_key('orders', %s, 'k', '{\"max_in_flight\": 2}')", (tenant,))
    downgrade(dsn, "0008_schedules_cancel")
    with psycopg.connect(dsn, autocommit=True) as c:
        assert c.execute("SELECT version_num FROM qm.alembic_version").fetchone() == ("0008_schedules_cancel",)
        assert _columns(c, "orders")[-3:] == ["traceparent", "tracestate", "baggage"]
        (index,) = c.execute("SELECT indexdef FROM pg_indexes WHERE indexname = 'orders_due'").fetchone() or ("",)
        assert "(partition, fire_at) WHERE (state = 'to_be_fired'" in index
        assert c.execute("SELECT to_regclass('qm.key_settings')").fetchone() == (None,)
        assert "default_priority" not in _columns(c, "qm.queues")
        assert c.execute("SELECT count(*) FROM orders").fetchone() == (3,)
    upgrade(dsn)
    with psycopg.connect(dsn, autocommit=True) as c:
        assert _columns(c, "orders")[-3:] == ["priority", "concurrency_key", "rate_key"]
        assert [p for (p,) in c.execute("SELECT priority FROM orders ORDER BY id")] == [3, 3, 3]
        (index,) = c.execute("SELECT indexdef FROM pg_indexes WHERE indexname = 'orders_due'").fetchone() or ("",)
        assert "(partition, priority, fire_at) WHERE (state = 'to_be_fired'" in index
