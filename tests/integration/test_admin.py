"""The operator-action API (queue_manager.admin) against two real shards: every action audited in
the transaction of its change (a process killed between the change and the audit leaves both or
neither), the CLI and the dashboard calling the same function, the binding of a confirmation, and
the actions raced against a busy manager."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from queue_manager import admin
from queue_manager.admin import events as admin_events
from queue_manager.domain.eventfilter import EventFilter
from queue_manager.domain.topology import Topology
from queue_manager.errors import InvalidInputError
from tests.conftest import tenants_of
from tests.managerkit import leading_manager, running_receiver, url, wait_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def topology(shards: Topology, make_queue: Callable[..., str]) -> Topology:
    make_queue("orders", partitions=4, shuffle=2, max_attempts=2)
    return shards


def dead_letters(shard_dsn: str, tenant: str, n: int) -> None:
    """``n`` dead letters of ``tenant`` (inserted, then failed as the manager leaves them)."""
    with psycopg.connect(shard_dsn, autocommit=True) as c:
        c.execute(
            "INSERT INTO orders (tenant, payload) SELECT %s, jsonb_build_object('n', i) FROM generate_series(1, %s) i",
            (tenant, n),
        )
        c.execute("UPDATE orders SET state = 'failed', attempts = 2, last_error = 'boom'")


def audit(dsn: str) -> list[dict[str, Any]]:
    with psycopg.connect(dsn) as c:
        c.row_factory = psycopg.rows.dict_row  # type: ignore[assignment]
        return c.execute(
            "SELECT via, actor, action, requested, affected, finished_at IS NOT NULL AS finished, plan, filter "
            "FROM qm.audit ORDER BY id"
        ).fetchall()  # type: ignore[return-value]


def count(dsn: str, state: str) -> int:
    with psycopg.connect(dsn) as c:
        row = c.execute("SELECT count(*) FROM orders WHERE state = %s::qm.event_state", (state,)).fetchone()
    assert row is not None
    return int(row[0])


def qm(topology_file: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "queue_manager.cli.main", *args, "--topology", str(topology_file)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_every_settings_action_is_audited_in_its_transaction_on_each_shard(topology: Topology) -> None:
    t1 = tenants_of(topology.shards[1], 1)[0]
    admin.pause(topology, "orders", actor="ops", via="cli")
    admin.alter_queue(topology, "orders", {"max_qps": 5.0}, actor="ops", via="cli")
    admin.set_tenant(topology, "orders", t1, {"weight": 2.0}, actor="ops", via="cli")
    assert admin.unset_tenant(topology, "orders", t1) is True  # no actor: the operating system's user
    s0, s1 = (audit(s.dsn) for s in topology.shards)
    assert [(r["via"], r["action"], r["requested"], r["affected"], r["finished"]) for r in s0] == [
        ("cli", "pause", 1, 1, True),
        ("cli", "settings", 1, 1, True),
    ]
    assert [(r["via"], r["action"]) for r in s1] == [
        ("cli", "pause"),
        ("cli", "settings"),
        ("cli", "tenant_set"),
        ("api", "tenant_unset"),
    ]
    assert s1[-1]["actor"] not in ("", None) and json.loads(s1[2]["filter"]) == {"tenant": t1, "weight": 2.0}
    actions = admin.recent(topology)
    assert [a.action for a in actions] == ["tenant_unset", "tenant_set", "settings", "pause"]
    assert actions[-1].plan == {"s0": None, "s1": None} and actions[-1].finished
    assert {s: p.affected for s, p in actions[-1].parts.items()} == {"s0": 1, "s1": 1}


def test_a_retry_walks_every_dead_letter_in_slices_and_counts_each_shard(topology: Topology) -> None:
    t0, t1 = tenants_of(topology.shards[0], 1)[0], tenants_of(topology.shards[1], 1)[0]
    dead_letters(topology.shards[0].dsn, t0, 7)
    dead_letters(topology.shards[1].dsn, t1, 3)
    outcome = admin.run(topology, "orders", admin.ACTIONS["retry_dead"], slice_size=2, via="cli")
    assert outcome.changed == {"s0": 7, "s1": 3} and outcome.requested == {"s0": 7, "s1": 3}
    (found,) = admin.recent(topology)
    assert found.action_id == outcome.action_id and found.finished and found.plan == {"s0": None, "s1": None}
    assert (found.requested, found.affected) == (10, 10)
    # a tenant's retry reads its own shard only, and finds nothing more to do there
    assert admin.retry_failed(topology, "orders", tenant=t1, via="cli") == 0
    assert admin.recent(topology)[0].plan == {"s1": None}


def test_a_reschedule_out_of_the_queues_range_and_unknown_actions_are_refused(topology: Topology) -> None:
    from datetime import UTC, datetime

    with pytest.raises(InvalidInputError, match="out of range"):
        admin.run(topology, "orders", admin.ACTIONS["reschedule"], fire_at=datetime(1999, 1, 1, tzinfo=UTC))
    with pytest.raises(InvalidInputError, match="give the new fire_at"):
        admin.bind(topology, "orders", admin.ACTIONS["reschedule"], EventFilter(), cap=5, count_cap=5)
    with pytest.raises(InvalidInputError, match="unknown action"):
        admin.action_named("drop_table")
    assert [audit(s.dsn) for s in topology.shards] == [[], []]


def test_the_cli_and_the_dashboard_retry_through_the_same_function(
    topology: Topology, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``qm events retry`` and the dashboard's bulk retry both run admin.events.run (and neither
    touches a queue table itself): with it replaced by a recorder, neither changes anything."""
    from starlette.testclient import TestClient

    from queue_manager.cli.main import main
    from queue_manager.web.app import WebConfig, create_app
    from tests.web.conftest import ADMIN, login, web_tokens

    t0 = tenants_of(topology.shards[0], 1)[0]
    dead_letters(topology.shards[0].dsn, t0, 2)
    calls: list[tuple[str, str]] = []

    def recorder(db: object, queue: str, action: admin.EventAction, *args: object, **kw: Any) -> admin.Outcome:
        calls.append((action.name, kw["via"]))
        return admin.Outcome("00000000-0000-0000-0000-000000000000", {}, {})

    assert admin.run is admin_events.run  # the package's name for it is the same function
    monkeypatch.setattr(admin_events, "run", recorder)
    monkeypatch.setattr(admin, "run", recorder)
    path = tmp_path / "topology.toml"
    path.write_text(topology.to_toml())
    assert main(["events", "retry", "orders", "--topology", str(path)]) == 0
    with TestClient(create_app(WebConfig(topology=topology, tokens=web_tokens())), follow_redirects=False) as client:
        csrf = login(client, ADMIN)
        r = client.post("/queues/orders/bulk/confirm", data={"csrf": csrf, "do": "retry_dead/all", "bound": "s0:2-1"})
        assert r.status_code == 303
        client.app.state.close()  # type: ignore[attr-defined]
    assert calls == [("retry_dead", "cli"), ("retry_dead", "web")]
    assert count(topology.shards[0].dsn, "failed") == 2


def test_a_process_killed_between_a_change_and_its_audit_leaves_neither(topology: Topology, tmp_path: Path) -> None:
    """``qm events retry`` is killed while its first slice, its events already changed in the
    transaction, waits to write its audit row (the audit table held locked by the test): the
    transaction never commits, so neither the change nor the audit is there."""
    s0 = topology.shards[0]
    dead_letters(s0.dsn, tenants_of(s0, 1)[0], 1200)
    path = tmp_path / "topology.toml"
    path.write_text(topology.to_toml())
    with psycopg.connect(s0.dsn) as holder:
        holder.execute("LOCK TABLE qm.audit IN SHARE ROW EXCLUSIVE MODE")  # an INSERT waits for it
        proc = qm(path, "events", "retry", "orders")
        try:
            with psycopg.connect(s0.dsn, autocommit=True) as watch:
                deadline = time.monotonic() + 20
                while True:
                    row = watch.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                        "AND query LIKE '%%INSERT INTO qm.audit%%' AND datname = current_database()"
                    ).fetchone()
                    if row and row[0]:
                        break
                    assert proc.poll() is None, proc.communicate()
                    assert time.monotonic() < deadline, "the retry never reached its audit row"
                    time.sleep(0.02)
                # the slice's change is made, in its transaction: the rows are locked, not yet changed for others
                assert count(s0.dsn, "failed") == 1200
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            proc.communicate()
        holder.rollback()
    with psycopg.connect(s0.dsn, autocommit=True) as watch:  # the orphaned backend finishes and rolls back
        deadline = time.monotonic() + 20
        while watch.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE query LIKE '%%INSERT INTO qm.audit%%' AND pid <> pg_backend_pid()"
        ).fetchone() != (0,):
            assert time.monotonic() < deadline
            time.sleep(0.02)
    assert count(s0.dsn, "failed") == 1200 and audit(s0.dsn) == []


def test_a_process_killed_anywhere_in_an_action_leaves_the_audit_telling_the_truth(
    topology: Topology, tmp_path: Path
) -> None:
    """``qm events retry`` SIGKILLed at a different moment in each round, most often between two
    slices or inside one: whatever it did, the audit's count on the shard is exactly the events
    changed (each slice and its count commit together), and a slice that did not commit left
    nothing."""
    s0 = topology.shards[0]
    path = tmp_path / "topology.toml"
    path.write_text(topology.to_toml())
    tenant = tenants_of(s0, 1)[0]
    for delay in (0.0, 0.05, 0.2):
        with psycopg.connect(s0.dsn, autocommit=True) as c:
            c.execute("DELETE FROM orders")
            c.execute("DELETE FROM qm.audit")
        dead_letters(s0.dsn, tenant, 2000)
        proc = qm(path, "events", "retry", "orders")
        with psycopg.connect(s0.dsn, autocommit=True) as watch:
            deadline = time.monotonic() + 30
            while watch.execute("SELECT coalesce(sum(affected), 0) FROM qm.audit").fetchone() == (0,):
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline
                time.sleep(0.005)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc.communicate()
        time.sleep(0.2)  # let an orphaned backend see its client gone and roll back
        moved = count(s0.dsn, "to_be_fired")
        (part,) = audit(s0.dsn)
        assert (part["affected"], part["requested"]) == (moved, moved), delay
        assert 500 <= moved <= 2000 and moved % 500 == 0 and part["finished"] == (moved == 2000), (delay, moved)


def test_actions_raced_against_a_busy_manager_fire_each_event_once(topology: Topology) -> None:
    """While a manager fires and a receiver acks at full speed, the dashboard's actions (by the
    API) make 600 scheduled events due now and retry 300 dead letters, in slices of 50: every event
    is delivered exactly once, and the audit counts every change."""
    s0 = topology.shards[0]
    tenant = tenants_of(s0, 1)[0]

    async def scenario() -> None:
        async with leading_manager(s0.dsn) as manager:
            async with running_receiver(url(manager)) as (_, recorder):
                with psycopg.connect(s0.dsn, autocommit=True) as c:
                    c.execute(
                        "INSERT INTO orders (tenant, payload, fire_at) SELECT %s, jsonb_build_object('later', i), "
                        "now() + interval '1 hour' FROM generate_series(1, 600) i",
                        (tenant,),
                    )
                    c.execute(
                        "INSERT INTO orders (tenant, payload) SELECT %s, jsonb_build_object('dead', i) "
                        "FROM generate_series(1, 300) i",
                        (tenant,),
                    )
                await wait_for(lambda: sum("dead" in e.payload for e in recorder.events) >= 300, 30, "first fires")
                with psycopg.connect(s0.dsn, autocommit=True) as c:
                    c.execute("UPDATE orders SET state = 'failed', last_error = 'boom' WHERE payload ? 'dead'")
                # meanwhile, the manager keeps firing: now the due events and the retried ones at once
                binding = await asyncio.to_thread(
                    admin.bind, topology, "orders", admin.ACTIONS["fire_now"], EventFilter(), cap=1000, count_cap=1000
                )
                assert binding.bound == 600
                fire = asyncio.to_thread(
                    admin.run, topology, "orders", admin.ACTIONS["fire_now"], None, binding.ids, slice_size=50
                )
                retry = asyncio.to_thread(
                    admin.run, topology, "orders", admin.ACTIONS["retry_dead"], None, None, slice_size=50
                )
                fired, retried = await asyncio.gather(fire, retry)
                assert fired.total == 600 and retried.total == 300
                await wait_for(lambda: len(recorder.events) >= 1200, 60, "every event delivered")
                await asyncio.sleep(0.5)  # a negative: nothing more may come
                later = [e.payload["later"] for e in recorder.events if "later" in e.payload]
                dead = [e.payload["dead"] for e in recorder.events if "dead" in e.payload]
                assert sorted(later) == list(range(1, 601)), "each scheduled event fired once"
                assert sorted(dead) == sorted(list(range(1, 301)) * 2), "each dead letter once before, once after"

    asyncio.run(scenario())
    actions = admin.recent(topology)
    assert sorted((a.action, a.affected, a.finished) for a in actions) == [
        ("fire_now", 600, True),
        ("retry_dead", 300, True),
    ]
    assert count(s0.dsn, "acked") == 900 or count(s0.dsn, "to_be_fired") + count(s0.dsn, "acked") == 900


def test_the_clis_bad_inputs_get_the_rule_and_change_nothing(
    topology: Topology, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from queue_manager.cli.main import main

    s0 = topology.shards[0]
    dead_letters(s0.dsn, tenants_of(s0, 1)[0], 2)
    path = tmp_path / "topology.toml"
    path.write_text(topology.to_toml())
    for args, rule in (
        (["events", "retry", "orders", "--id", str(2**63)], "not an event id"),
        (["events", "retry", "orders", "--id", "0"], "not an event id"),
        (["queue", "tenant", "set", "orders", "acme", "--weight", "1e999999"], "must be finite"),
        (["queue", "alter", "orders", "--max-qps", "nan"], "must be finite"),
    ):
        assert main([*args, "--topology", str(path)]) == 2, args
        assert rule in capsys.readouterr().err, args
    assert count(s0.dsn, "failed") == 2 and [audit(s.dsn) for s in topology.shards] == [[], []]
