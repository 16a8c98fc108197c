"""Two real PostgreSQL servers from `qm local start`, resizing N, status, the CLI, the wake-up hint."""

from __future__ import annotations

import json
import re
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import psycopg
import pytest
from alembic.script import ScriptDirectory

from queue_manager import admin
from queue_manager.cli.main import main
from queue_manager.db.migrate import alembic_config
from queue_manager.domain import routing
from queue_manager.domain.health import Thresholds
from queue_manager.domain.topology import Shard, Topology
from queue_manager.local import fleet
from queue_manager.producer import Router
from tests.conftest import tenants_of


@pytest.mark.cluster
def test_two_server_cluster_1000_tenants_x_100_events(server_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's acceptance check on `qm local start --shards 2`: plain INSERTs, DB-side routing."""
    directory = server_dir / "cluster"
    assert main(["local", "start", "--shards", "2", "--dir", str(directory), "--fsync-off"]) == 0
    try:
        topo_file = directory / "topology.toml"
        topology = Topology.load(topo_file)
        ports = {psycopg.conninfo.conninfo_to_dict(s.dsn)["port"] for s in topology.shards}
        assert len(ports) == 2  # two servers, not two databases
        assert (
            main(["queue", "create", "events", "--partitions", "16", "--shuffle", "4", "--topology", str(topo_file)])
            == 0
        )

        tenants = [f"tenant-{i}" for i in range(1000)]
        with Router(topology) as router:
            # a rolled-back insert leaves nothing
            with router.transaction(tenants[0]) as c, c.transaction(force_rollback=True):
                c.execute("INSERT INTO events (tenant, payload) VALUES (%s, '{}')", (tenants[0],))
            for t in tenants:
                with router.transaction(t) as c, c.cursor() as cur:
                    cur.executemany(
                        "INSERT INTO events (tenant, payload) VALUES (%s, %s)",
                        [(t, json.dumps({"n": n})) for n in range(100)],
                    )

        totals: dict[str, Counter[int]] = {}
        for shard in topology.shards:
            with psycopg.connect(shard.dsn) as c:
                rows = c.execute("SELECT tenant, partition, count(*) FROM events GROUP BY 1, 2").fetchall()
            per_partition: Counter[int] = Counter()
            seen: dict[str, int] = defaultdict(int)
            for tenant, partition, n in rows:
                assert shard.key_range.contains(tenant), f"{tenant} landed on {shard.name}"
                assert partition in routing.shuffle_set(tenant, 16, 4), (tenant, partition)
                per_partition[partition] += n
                seen[tenant] += n
            assert all(n == 100 for n in seen.values())
            totals[shard.name] = per_partition
        assert sum(sum(c.values()) for c in totals.values()) == 100_000
        for name, per_partition in totals.items():
            assert len(per_partition) == 16
            fullest, emptiest = max(per_partition.values()), min(per_partition.values())
            assert fullest <= 1.5 * emptiest, (name, sorted(per_partition.values()))

        capsys.readouterr()
        assert main(["status", "--json", "--topology", str(topo_file)]) == 0
        status = json.loads(capsys.readouterr().out)
        lengths = {s["shard"]: s["queues"][0]["length"] for s in status["shards"]}
        assert sum(lengths.values()) == 100_000
        assert all(v > 0 for v in lengths.values())
    finally:
        assert main(["local", "stop", "--dir", str(directory)]) == 0


def test_grow_takes_effect_at_once_and_shrink_waits_for_drain(shards: Topology, make_queue: Any) -> None:
    make_queue("orders", partitions=4, shuffle=2)
    s0 = shards.shards[0]
    tenants = tenants_of(s0, 200)
    with psycopg.connect(s0.dsn, autocommit=True) as c:
        for t in tenants:
            c.execute("INSERT INTO orders (tenant) VALUES (%s)", (t,))

        admin.alter_queue(shards, "orders", {"partitions": 8})
        for t in tenants:
            c.execute("INSERT INTO orders (tenant) VALUES (%s)", (t,))
        used = {r[0] for r in c.execute("SELECT DISTINCT partition FROM orders WHERE id > 200")}
        assert used & {4, 5, 6, 7}, "grown partitions are written to at once"

        admin.alter_queue(shards, "orders", {"partitions": 2, "shuffle": 1})
        (q,) = [q for q in admin.shard_status(s0) if q.queue == "orders"]
        assert (q.partitions, q.partitions_physical) == (2, 8)
        assert q.draining > 0
        before = c.execute("SELECT max(id) FROM orders").fetchone()
        for t in tenants:
            c.execute("INSERT INTO orders (tenant) VALUES (%s)", (t,))
        new_parts = {r[0] for r in c.execute("SELECT DISTINCT partition FROM orders WHERE id > %s", before)}
        assert new_parts <= {0, 1}, "no new writes to partitions being dropped"
        # a preset partition in the dropped range is refused too
        with pytest.raises(psycopg.errors.CheckViolation):
            c.execute("INSERT INTO orders (tenant, partition) VALUES (%s, 5)", (tenants[0],))

        # the shrink completes only when the dropped partitions hold no live event
        c.execute("UPDATE orders SET state = 'acked', attempts = 1 WHERE partition >= 2 AND id % 2 = 0")
        assert c.execute("SELECT qm.finish_resize('orders')").fetchone()[0] > 0  # type: ignore[index]
        c.execute("UPDATE orders SET state = 'acked', attempts = 1 WHERE partition >= 2")
        (q,) = [q for q in admin.shard_status(s0) if q.queue == "orders"]
        assert (q.partitions, q.partitions_physical, q.draining) == (2, 2, 0)
        assert c.execute("SELECT cardinality(enq_seqs) FROM qm.queues WHERE name = 'orders'").fetchone() == (2,)


def test_status_counts_depth_and_oldest_due(shards: Topology, make_queue: Any) -> None:
    make_queue("orders", partitions=4, shuffle=2)
    s0 = shards.shards[0]
    (t,) = tenants_of(s0, 1)
    with psycopg.connect(s0.dsn, autocommit=True) as c:
        c.execute("INSERT INTO orders (tenant, fire_at) VALUES (%s, now() - interval '90 seconds')", (t,))
        c.execute("INSERT INTO orders (tenant, fire_at) VALUES (%s, now() + interval '1 hour')", (t,))
        c.execute("INSERT INTO orders (tenant) VALUES (%s)", (t,))
        c.execute("UPDATE orders SET state = 'acked', attempts = 1 WHERE id = 3")
    data = admin.status(shards)
    (q,) = data["shards"][0]["queues"]
    assert q["counts"] == {"to_be_fired": 2, "fired": 0, "acked": 1, "failed": 0, "cancelled": 0}
    assert q["length"] == 2 and sum(q["depth"]) == 2 and len(q["depth"]) == 4
    assert q["due_now"] == 1
    assert 89 <= q["oldest_due_age_seconds"] < 150
    assert data["shards"][1]["queues"][0]["length"] == 0


def test_status_names_what_holds_back_vacuum_and_warns_past_the_threshold(shards: Topology, make_queue: Any) -> None:
    make_queue("orders", partitions=4, shuffle=2)
    s0 = shards.shards[0]
    with psycopg.connect(s0.dsn, application_name="report-job") as holder:
        holder.execute("SELECT txid_current()")  # then idle in transaction
        data = admin.status(shards)
        horizon = data["shards"][0]["xmin_horizon"]
        assert (horizon["kind"], horizon["holder"], horizon["state"]) == (
            "session",
            "report-job",
            "idle in transaction",
        )
        assert horizon["pid"] == holder.info.backend_pid and 0 <= horizon["age_seconds"] < 60
        assert data["shards"][0]["warnings"] == []
        assert data["shards"][1]["xmin_horizon"] is None  # the other shard's database is not held
        data = admin.status(shards, Thresholds(xmin_seconds=0.0))
        (warning,) = data["shards"][0]["warnings"]
        assert "'report-job'" in warning and "held back vacuum" in warning
        text = admin.render_status(data)
        assert "oldest xmin: session 'report-job'" in text and "WARNING:" in text
        holder.rollback()
    assert admin.status(shards)["shards"][0]["xmin_horizon"] is None


def test_status_reports_an_unreachable_shard(shards: Topology, make_queue: Any) -> None:
    make_queue("orders")
    broken = Topology(
        (shards.shards[0], Shard("s1", "postgresql://postgres@127.0.0.1:1/none", shards.shards[1].key_range))
    )
    data = admin.status(broken)
    assert "unreachable" in data["shards"][1]["error"]
    assert data["shards"][0]["queues"][0]["queue"] == "orders"


def test_cli_queue_lifecycle(
    shards: Topology, tmp_path: Path, topo_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(
            [
                "queue",
                "create",
                "jobs",
                "--partitions",
                "8",
                "--shuffle",
                "2",
                "--ack-timeout",
                "5",
                "--topology",
                str(topo_file),
            ]
        )
        == 0
    )
    assert main(["queue", "create", "jobs", "--topology", str(topo_file)]) == 2  # exists
    assert "already exists" in capsys.readouterr().err
    assert main(["queue", "create", "jobs", "--if-not-exists", "--topology", str(topo_file)]) == 0
    assert main(["queue", "create", "Bad", "--topology", str(topo_file)]) == 2
    assert "invalid queue name" in capsys.readouterr().err
    assert (
        main(["queue", "create", "bad_shuffle", "--partitions", "2", "--shuffle", "4", "--topology", str(topo_file)])
        == 2
    )
    assert "invalid settings" in capsys.readouterr().err
    assert main(["queue", "alter", "jobs", "--max-attempts", "3", "--topology", str(topo_file)]) == 0
    assert main(["queue", "pause", "jobs", "--topology", str(topo_file)]) == 0
    capsys.readouterr()
    assert main(["queue", "list", "--json", "--topology", str(topo_file)]) == 0
    listing = json.loads(capsys.readouterr().out)
    for shard in ("s0", "s1"):
        (jobs,) = [q for q in listing[shard] if q["name"] == "jobs"]
        assert (jobs["partitions"], jobs["shuffle"], jobs["max_attempts"], jobs["paused"]) == (8, 2, 3, True)
        assert jobs["ack_timeout_seconds"] == 5
    tenant = tenants_of(shards.shards[1], 1)[0]
    assert main(["enqueue", "jobs", tenant, '{"hello": 1}', "--topology", str(topo_file)]) == 0
    assert "on shard s1" in capsys.readouterr().out
    assert main(["enqueue", "jobs", tenant, "not json", "--topology", str(topo_file)]) == 2
    assert main(["status", "--topology", str(topo_file)]) == 0
    out = capsys.readouterr().out
    assert "jobs: length 1" in out and "PAUSED" in out
    assert main(["status", "--topology", str(tmp_path / "missing.toml")]) == 2


def test_migrate_is_idempotent_and_sets_identity(new_database: Any, tmp_path: Path) -> None:
    from queue_manager.domain.topology import KeyRange

    dsn = new_database()
    topo = tmp_path / "t.toml"
    topo.write_text(Topology((Shard("only", dsn, KeyRange.parse("-")),)).to_toml())
    assert main(["migrate", "--topology", str(topo)]) == 0
    assert main(["migrate", "--topology", str(topo)]) == 0
    with psycopg.connect(dsn) as c:
        assert c.execute("SELECT name, range_start, range_end FROM qm.shard").fetchone() == ("only", "", "")
        head = ScriptDirectory.from_config(alembic_config()).get_current_head()
        assert c.execute("SELECT version_num FROM qm.alembic_version").fetchone() == (head,)


def test_producers_notify_only_a_waiting_manager(shard: Shard, make_queue: Any) -> None:
    """The wake-up hint: no NOTIFY while no manager waits; one per statement while one does."""
    make_queue("orders")
    (t,) = tenants_of(shard, 1)
    with psycopg.connect(shard.dsn, autocommit=True) as manager, psycopg.connect(shard.dsn, autocommit=True) as prod:
        qid = manager.execute("SELECT id FROM qm.queues WHERE name = 'orders'").fetchone()[0]  # type: ignore[index]
        manager.execute("LISTEN qm_wake")
        # a row due later: one due now is announced when over 10 ms pass between its forming and its
        # statement's trigger (qm.backdated_ms, for long bulk statements), which a loaded machine does
        prod.execute("INSERT INTO orders (tenant, fire_at) VALUES (%s, now() + interval '1 hour')", (t,))
        assert list(manager.notifies(timeout=0.3, stop_after=1)) == []

        manager.execute("SELECT pg_advisory_lock(qm.lock_class('wake'), %s)", (qid,))  # the manager arms itself
        with prod.transaction():
            prod.execute("INSERT INTO orders (tenant) SELECT %s FROM generate_series(1, 1000)", (t,))
            prod.execute("INSERT INTO orders (tenant) VALUES (%s)", (t,))
        # generous for a loaded machine: the wait ends at the first notice; then none more may follow
        got = [n.payload for n in manager.notifies(timeout=10, stop_after=1)]
        got += [n.payload for n in manager.notifies(timeout=0.5, stop_after=4)]
        # folded: one per transaction, not per row; "due": every row is due now, no rescan needed;
        # then the transaction's start in epoch microseconds (no row of it has an earlier fire_at)
        assert len(got) == 1 and re.fullmatch(r"orders due \d{16}", got[0]), got
        assert abs(int(got[0].split()[2]) / 1e6 - time.time()) < 60
        prod.execute(
            "INSERT INTO orders (tenant, fire_at) VALUES (%s, now()), (%s, now() + interval '1 minute')", (t, t)
        )
        got = [n.payload for n in manager.notifies(timeout=10, stop_after=1)]
        assert len(got) == 1 and re.fullmatch(r"orders at \d{16}", got[0]), got  # one for later: rescan
        manager.execute("SELECT pg_advisory_unlock(qm.lock_class('wake'), %s)", (qid,))

        # no manager waits, but a row older than its insert is announced with its fire_at: the
        # manager's picks start at what it already fired and would not look that far back
        prod.execute("INSERT INTO orders (tenant, fire_at) VALUES (%s, '2020-01-01T00:00:00Z')", (t,))
        got = [n.payload for n in manager.notifies(timeout=10, stop_after=1)]
        assert got == [f"orders due {1577836800 * 1_000_000}"], got

        # a producer mid-transaction holds the shared lock: the manager cannot arm until it ends
        with prod.transaction():
            prod.execute("INSERT INTO orders (tenant) VALUES (%s)", (t,))
            armed = manager.execute("SELECT pg_try_advisory_lock(qm.lock_class('wake'), %s)", (qid,)).fetchone()
            assert armed == (False,)
        assert manager.execute("SELECT pg_try_advisory_lock(qm.lock_class('wake'), %s)", (qid,)).fetchone() == (True,)


def test_cli_manager_refuses_bad_maintenance_intervals(
    shards: Topology, tmp_path: Path, topo_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokens = fleet.write_tokens(tmp_path / "tokens.toml", [fleet.Token("all", "secret-all-queues-0001")])
    shard = shards.shards[0].name
    for option in ("sweep_interval", "purge_interval", "reconcile_interval", "slice_interval"):
        assert main(fleet.manager_argv(topo_file, shard, tokens, **{option: 0})) == 2
        err = capsys.readouterr().err
        assert option + " must be a positive number of seconds" in err


def test_cli_sets_lists_and_unsets_tenant_overrides_on_the_tenant_shard(
    shards: Topology, topo_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    t = ["--topology", str(topo_file)]
    assert main(["queue", "create", "jobs", "--tenant-max-in-flight", "20", *t]) == 0
    tenant = tenants_of(shards.shards[1], 1)[0]
    assert main(["queue", "tenant", "set", "jobs", tenant, "--weight", "3", "--max-in-flight", "5", *t]) == 0
    assert f"s1: queue jobs tenant {tenant}: weight=3 max_in_flight=5" in capsys.readouterr().out
    assert main(["queue", "tenant", "set", "jobs", tenant, "--default-max-in-flight", *t]) == 0
    assert "weight=3 max_in_flight=queue default" in capsys.readouterr().out
    assert main(["queue", "tenant", "list", "jobs", "--json", *t]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["shard"], row["tenant"], row["weight"], row["max_in_flight"], row["queue_default_max_in_flight"]) == (
        "s1",
        tenant,
        3.0,
        None,
        20,
    )
    # only on the tenant's shard
    with psycopg.connect(shards.shards[0].dsn) as c:
        assert c.execute("SELECT count(*) FROM qm.tenant_settings").fetchone() == (0,)
    assert main(["queue", "tenant", "set", "jobs", tenant, "--weight", "0", *t]) == 2
    assert "tenant setting 'weight' must be > 0" in capsys.readouterr().err
    assert main(["queue", "tenant", "set", "nope", tenant, "--weight", "2", *t]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["queue", "tenant", "set", "jobs", tenant, *t]) == 2
    assert "nothing to change" in capsys.readouterr().err
    assert main(["queue", "tenant", "unset", "jobs", tenant, *t]) == 0
    assert "overrides removed" in capsys.readouterr().out
    assert main(["queue", "tenant", "list", *t]) == 0
    assert "no tenant overrides" in capsys.readouterr().out
