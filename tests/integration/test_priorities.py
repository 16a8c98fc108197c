"""Priorities with aging, and concurrency and rate limits per key, on a real server: what producers
write, in which order a manager fires, how many events of a key are fired and unsettled at once
(counted by a trigger in the database itself), across a failover, and how often a key is fired."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from queue_manager import admin
from queue_manager.domain.topology import Shard, Topology
from queue_manager.errors import InvalidEventError
from queue_manager.producer import Event, Router, enqueue, enqueue_batch
from tests.conftest import tenants_of
from tests.managerkit import Recorder, leading_manager, running_receiver, url, wait_for
from tests.processkit import ManagerProcess, lease, write_config

#: a test's own audit, in the database: at every fire of an event with a concurrency key, how many
#: events of its (tenant, key) are fired at that moment (the statement's rows included)
AUDIT = """
CREATE TABLE key_audit (tenant text, key text, fired integer, at timestamptz DEFAULT clock_timestamp());
CREATE FUNCTION key_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO key_audit (tenant, key, fired)
    SELECT NEW.tenant, NEW.concurrency_key, count(*) FROM orders
     WHERE state = 'fired' AND tenant = NEW.tenant AND concurrency_key = NEW.concurrency_key;
    RETURN NULL;
END $$;
CREATE TRIGGER key_audit AFTER UPDATE OF state ON orders FOR EACH ROW
    WHEN (NEW.state = 'fired' AND OLD.state = 'to_be_fired' AND NEW.concurrency_key IS NOT NULL)
    EXECUTE FUNCTION key_audit();
"""


def audit(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(AUDIT)


def most_fired(dsn: str) -> dict[str, int]:
    """Per key, the most of its events ever fired at once (by the audit)."""
    with psycopg.connect(dsn) as c:
        return {str(k): int(n) for k, n in c.execute("SELECT key, max(fired) FROM key_audit GROUP BY key")}


def fill(dsn: str, rows: list[dict[str, Any]], queue: str = "orders") -> None:
    """Insert rows (tenant, payload, and any of priority, concurrency_key, rate_key, fire_at) in one transaction."""
    with psycopg.connect(dsn) as c:
        for r in rows:
            cols = ", ".join(r)
            c.execute(
                f"INSERT INTO {queue} ({cols}) VALUES ({', '.join(['%s'] * len(r))})",
                [json.dumps(v) if k == "payload" else v for k, v in r.items()],
            )


# ------------------------------------------------------------------------------------ producers


def test_every_way_in_takes_a_priority_and_keys_and_the_queue_default_fills_the_rest(
    shards: Topology, make_queue: Any
) -> None:
    make_queue("orders", partitions=4, shuffle=2, default_priority=4)
    shard = shards.shards[0]
    tenant = tenants_of(shard, 1)[0]
    with psycopg.connect(shard.dsn) as c:
        plain = enqueue(c, "orders", tenant, {"n": 1})
        given = enqueue(c, "orders", tenant, {"n": 2}, priority=1, concurrency_key="acct-1", rate_key="api")
        batch = enqueue_batch(
            c,
            "orders",
            [Event(tenant, {"n": 3}), Event(tenant, {"n": 4}, priority=2, concurrency_key="acct-2", dedup_key="d4")],
        )
        c.commit()
        assert batch == 2
        c.execute("INSERT INTO orders (tenant, payload) VALUES (%s, '{}')", (tenant,))
        c.commit()
        rows = c.execute("SELECT id, priority, concurrency_key, rate_key FROM orders ORDER BY id").fetchall()
    assert rows[0] == (plain, 4, None, None)
    assert rows[1] == (given, 1, "acct-1", "api")
    assert [r[1:] for r in rows[2:]] == [(4, None, None), (2, "acct-2", None), (4, None, None)]
    with Router(shards) as router:
        router.enqueue("orders", tenant, {"n": 5}, priority=5, rate_key="r")
        assert router.enqueue_batch("orders", [Event(tenant, {"n": 6}, priority=3)]) == 1
    # the queue's default moves the column's default; the events already in stay as they are
    admin.alter_queue(shards, "orders", {"default_priority": 2})
    with psycopg.connect(shard.dsn) as c:
        c.execute("INSERT INTO orders (tenant, payload) VALUES (%s, '{}')", (tenant,))
        c.commit()
        got = [r[0] for r in c.execute("SELECT priority FROM orders ORDER BY id").fetchall()]
    assert got[-3:] == [5, 3, 2] and got[0] == 4


@pytest.mark.parametrize(
    ("column", "value", "rule"),
    [
        ("priority", 0, "orders_priority_in_range"),
        ("priority", 6, "orders_priority_in_range"),
        ("concurrency_key", "", "orders_concurrency_key_valid"),
        ("rate_key", "x" * 257, "orders_rate_key_valid"),
    ],
)
def test_a_bad_priority_or_key_is_refused_by_every_path_and_changes_nothing(
    shards: Topology, make_queue: Any, column: str, value: Any, rule: str
) -> None:
    make_queue("orders", partitions=4, shuffle=2)
    shard = shards.shards[0]
    tenant = tenants_of(shard, 1)[0]
    keys = {column: value}
    with psycopg.connect(shard.dsn) as c:
        with pytest.raises(InvalidEventError, match=rule):
            enqueue(c, "orders", tenant, {}, **keys)
        c.rollback()
        with pytest.raises(InvalidEventError, match=rule):
            enqueue_batch(c, "orders", [Event(tenant, {}), Event(tenant, {}, **keys)])
        c.rollback()
        with pytest.raises(psycopg.errors.CheckViolation, match=rule):
            c.execute(f"INSERT INTO orders (tenant, payload, {column}) VALUES (%s, '{{}}', %s)", (tenant, value))
        c.rollback()
        assert c.execute("SELECT count(*) FROM orders").fetchone() == (0,)


# ------------------------------------------------------------------------------------ the order of fires


async def test_higher_priorities_go_first_across_tenants_and_carry_their_priority(
    shard: Shard, make_queue: Any
) -> None:
    """A backlog of priority 3 from many tenants, then priority-1 events: with one slot at a time,
    every priority-1 event goes before the rest of the backlog (priority before fairness), each
    delivered with its priority; within priority 3 the tenants' partitions take turns."""
    make_queue("orders", partitions=4, shuffle=1, priority_aging_seconds=None)
    tenants = tenants_of(shard, 40)
    fill(shard.dsn, [{"tenant": tenants[i % 20], "payload": {"i": i}} for i in range(200)])
    fill(shard.dsn, [{"tenant": tenants[20 + i % 20], "payload": {"hi": i}, "priority": 1} for i in range(20)])
    async with leading_manager(shard.dsn) as m:
        async with running_receiver(url(m), credit=1) as (_, rec):
            await wait_for(lambda: len(rec.events) >= 60, timeout=30, what="deliveries")
    first = rec.events[:20]
    assert all(e.payload.keys() == {"hi"} and e.priority == 1 for e in first), [e.payload for e in first]
    rest = rec.events[20:60]
    assert all(e.priority == 3 for e in rest)
    # round-robin within the level: each partition of the backlog took its turn
    assert {e.partition for e in rest[:8]} == {0, 1, 2, 3}


async def test_a_waiting_level_ages_past_a_stream_of_higher_priority_events(shard: Shard, make_queue: Any) -> None:
    """One priority-5 event, then a backlog of priority 1 that takes 3 s to drain (one slot, 10 ms a
    handler): with aging of 0.3 s per level, the priority-5 event counts at the top after 1.2 s and
    goes then (its level's oldest event is older than any of level 1's); without aging, last."""
    delays = {}
    tenants = tenants_of(shard, 20)
    for queue, aging in (("aged", 0.3), ("strict", None)):
        make_queue(queue, partitions=4, shuffle=1, priority_aging_seconds=aging)
        fill(shard.dsn, [{"tenant": tenants[0], "payload": {"low": 1}, "priority": 5}], queue)
        rows = [{"tenant": tenants[1 + i % 19], "payload": {"i": i}, "priority": 1} for i in range(300)]
        fill(shard.dsn, rows, queue)
        rec = Recorder()

        async def slow(event: Any, rec: Recorder = rec) -> None:
            await rec(event)
            await asyncio.sleep(0.01)

        def low(rec: Recorder = rec) -> list[Any]:
            return [e for e in rec.events if e.payload == {"low": 1}]

        async with leading_manager(shard.dsn) as m:
            async with running_receiver(url(m), queue=queue, credit=1, recorder=slow):
                await wait_for(lambda: bool(low()), timeout=30, what="the priority-5 event")
                i = rec.events.index(low()[0])
                delays[aging] = (rec.received_at[i] - low()[0].fire_at, i)
    aged, position = delays[0.3]
    assert 1.1 <= aged <= 1.2 + 1.0, delays  # the bound (5 - 1) x 0.3 s, and not much later
    assert position < 290, delays  # well before the end of the backlog
    assert delays[None][1] == 300, delays  # without aging: after all of level 1


# ------------------------------------------------------------------------------------ concurrency per key


async def test_a_keys_events_in_hand_never_exceed_its_limit_and_other_keys_are_not_held_behind_it(
    shards: Topology, make_queue: Any
) -> None:
    """key_max_in_flight 2 (and 4 for one key of its own): 40 events of a hot key and 2 each of ten
    cold keys, all in the same partitions, a receiver of 20 slots whose handler holds each event
    50 ms. The database's own count never sees more than the limit of a key fired at once; the
    cold keys' events all go out while the hot key is still working through its backlog."""
    shard = shards.shards[0]
    make_queue("orders", partitions=2, shuffle=1, key_max_in_flight=2)
    tenant = tenants_of(shard, 1)[0]
    admin.set_key(shards, "orders", tenant, "wide", {"max_in_flight": 4})
    audit(shard.dsn)
    rows = [{"tenant": tenant, "payload": {"k": "hot", "i": i}, "concurrency_key": "hot"} for i in range(40)]
    rows += [{"tenant": tenant, "payload": {"k": f"c{i}"}, "concurrency_key": f"c{i % 10}"} for i in range(20)]
    rows += [{"tenant": tenant, "payload": {"k": "wide", "i": i}, "concurrency_key": "wide"} for i in range(16)]
    fill(shard.dsn, rows)
    rec = Recorder()

    async def slow(event: Any) -> None:
        await rec(event)
        await asyncio.sleep(0.05)

    async with leading_manager(shard.dsn) as m:
        async with running_receiver(url(m), credit=20, recorder=slow) as (_, _r):
            await wait_for(lambda: len({e.id for e in rec.events}) >= len(rows), timeout=60, what="every event")
    most = most_fired(shard.dsn)
    assert most["hot"] == 2 and most["wide"] == 4, most
    assert max(n for k, n in most.items() if k.startswith("c")) <= 2
    keys = [e.payload["k"] for e in rec.events]
    last_cold = max(i for i, k in enumerate(keys) if k.startswith("c"))
    assert keys[last_cold + 1 :].count("hot") >= 20, "the cold keys waited behind the hot one"


async def test_a_cancelled_event_in_hand_frees_its_keys_slot_as_an_ack_does(shards: Topology, make_queue: Any) -> None:
    """key_max_in_flight 1: a receiver holds the key's first event (its handler never ends), so the
    second waits; an operator cancels the first, and the second goes out at once, long before the
    first's ack deadline (60 s) would have freed the slot. The database never sees two fired."""
    shard = shards.shards[0]
    make_queue("orders", partitions=2, shuffle=1, key_max_in_flight=1, ack_timeout_seconds=60)
    tenant = tenants_of(shard, 1)[0]
    audit(shard.dsn)
    fill(shard.dsn, [{"tenant": tenant, "payload": {"i": i}, "concurrency_key": "acct"} for i in range(2)])
    rec = Recorder()

    async def hold(event: Any) -> None:
        await rec(event)
        await asyncio.sleep(120)  # in hand until cancelled

    async with leading_manager(shard.dsn) as m:
        ledger = m.rt.queues["orders"].ledger
        async with running_receiver(url(m), credit=5, recorder=hold) as (_, _r):
            await wait_for(lambda: len(rec.events) == 1, 10, "the key's first event")
            with pytest.raises(AssertionError):  # the second waits for the key's slot
                await wait_for(lambda: len(rec.events) > 1, 0.5, "a second event of the key")
            assert list(ledger.by_key().values()) == [1]
            first = rec.events[0].id
            cancel = admin.ACTIONS["cancel"]
            out = await asyncio.to_thread(admin.run, shards, "orders", cancel, None, {"s0": [first], "s1": []})
            assert out.total == 1
            await wait_for(lambda: len(rec.events) == 2, 5, "the second event, once the first was cancelled")
            assert rec.events[1].id != first and list(ledger.by_key().values()) == [1]
    assert most_fired(shard.dsn) == {"acct": 1}


async def test_a_new_leader_counts_the_events_its_predecessor_left_in_hand(
    tmp_path: Path, shards: Topology, make_queue: Any
) -> None:
    """The active manager is killed (SIGKILL) while a receiver holds two events of a key whose limit
    is 2. The standby takes over and the receiver, reconnected, has room; but the two events are
    still fired in the table until their ack deadline, so the new leader fires no more of that key
    until the collector has taken them back: the database never sees three fired at once. (Without
    the recount, the new leader fired two more at once.)"""
    shard = shards.shards[0]
    make_queue(
        "orders",
        partitions=2,
        shuffle=1,
        key_max_in_flight=2,
        ack_timeout_seconds=3,
        backoff_min_seconds=0.1,
        backoff_max_seconds=0.2,
    )
    tenant = tenants_of(shard, 1)[0]
    audit(shard.dsn)
    fill(shard.dsn, [{"tenant": tenant, "payload": {"i": i}, "concurrency_key": "acct"} for i in range(8)])
    topo, tokens = write_config(tmp_path, shards)
    procs = [ManagerProcess(topo, tokens, "s0", 2.0), ManagerProcess(topo, tokens, "s0", 2.0)]
    try:
        leader = None
        deadline = time.monotonic() + 15
        while leader is None and time.monotonic() < deadline:
            _, leader = await lease(shard.dsn)
            await asyncio.sleep(0.05)
        active = next(p for p in procs if p.pid == leader)
        rec = Recorder()
        held = asyncio.Event()

        async def hold_first_two(event: Any) -> None:
            await rec(event)
            if len(rec.events) <= 2:
                if len(rec.events) == 2:
                    held.set()
                await asyncio.sleep(60)  # in hand past the kill, never acked (the deadline takes them back)

        async with running_receiver([p.url for p in procs], credit=10, recorder=hold_first_two) as (_, _r):
            await asyncio.wait_for(held.wait(), 30)
            os.kill(active.pid, signal.SIGKILL)
            active.proc.wait()
            await wait_for(lambda: len({e.payload["i"] for e in rec.events}) >= 8, timeout=60, what="every event")
        assert most_fired(shard.dsn) == {"acct": 2}
        with psycopg.connect(shard.dsn) as c:
            row = c.execute("SELECT count(*) FROM key_audit WHERE fired = 2").fetchone()
        assert row is not None and row[0] >= 2
    finally:
        for p in procs:
            p.stop()


# ------------------------------------------------------------------------------------ rate per key


async def test_a_rate_key_is_fired_at_most_its_rate_plus_one_in_any_second(shard: Shard, make_queue: Any) -> None:
    """key_max_qps 8: 30 events of one rate key and 30 of others without a limit of their own but the
    queue's. The key is fired at most 8 + 1 times in any second (the burst is one), at its rate (not
    much less), and the other keys are not held behind it."""
    make_queue("orders", partitions=2, shuffle=1, key_max_qps=8)
    tenant = tenants_of(shard, 1)[0]
    rows = [{"tenant": tenant, "payload": {"k": "r"}, "rate_key": "r"} for _ in range(30)]
    rows += [{"tenant": tenant, "payload": {"k": f"o{i}"}, "rate_key": f"o{i}"} for i in range(30)]
    fill(shard.dsn, rows)
    async with leading_manager(shard.dsn) as m:
        async with running_receiver(url(m), credit=50) as (_, rec):
            await wait_for(lambda: len(rec.events) >= 60, timeout=30, what="every event")
    with psycopg.connect(shard.dsn) as c:
        times = [
            float(t)
            for (t,) in c.execute(
                "SELECT extract(epoch FROM fired_at) FROM orders WHERE rate_key = 'r' ORDER BY fired_at"
            )
        ]
        others = [
            float(t) for (t,) in c.execute("SELECT extract(epoch FROM fired_at) FROM orders WHERE rate_key <> 'r'")
        ]
    most = max(sum(1 for u in times if t <= u < t + 1.0) for t in times)
    assert most <= 8 + 1, most
    rate = (len(times) - 1) / (times[-1] - times[0])
    assert 8 * 0.6 <= rate <= 8 * 1.1, rate  # (the lower bound with room for a loaded machine)
    assert max(others) < times[5], "the other keys waited behind the limited one"


# ------------------------------------------------------------------------------------ where a user looks


def test_the_cli_sets_priorities_and_key_limits_and_a_keys_own_limits(
    shards: Topology, topo_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from queue_manager.cli.main import main

    t = ["--topology", str(topo_file)]
    create = [
        "queue",
        "create",
        "jobs",
        "--default-priority",
        "2",
        "--priority-aging",
        "10",
        "--key-max-in-flight",
        "3",
    ]
    assert main([*create, *t]) == 0
    assert main(["queue", "alter", "jobs", "--key-max-qps", "5", *t]) == 0
    capsys.readouterr()
    assert main(["queue", "list", *t]) == 0
    assert "priority=2 aging=10 s key_max_in_flight=3 key_max_qps=5" in capsys.readouterr().out
    assert main(["queue", "alter", "jobs", "--no-priority-aging", *t]) == 0
    capsys.readouterr()
    assert main(["queue", "list", "--json", *t]) == 0
    (row,) = json.loads(capsys.readouterr().out)["s0"]
    assert (row["default_priority"], row["priority_aging_seconds"], row["key_max_qps"]) == (2, None, 5.0)
    assert main(["queue", "alter", "jobs", "--default-priority", "6", *t]) == 2
    assert "'default_priority' must be >= 1 and <= 5" in capsys.readouterr().err
    tenant = tenants_of(shards.shards[1], 1)[0]
    assert main(["queue", "key", "set", "jobs", tenant, "acct-1", "--max-in-flight", "1", *t]) == 0
    assert (
        f"s1: queue jobs tenant {tenant} key acct-1: max_in_flight=1 max_qps=queue default" in capsys.readouterr().out
    )
    assert (
        main(["queue", "key", "set", "jobs", tenant, "acct-1", "--max-qps", "0.5", "--default-max-in-flight", *t]) == 0
    )
    assert "max_in_flight=queue default max_qps=0.5" in capsys.readouterr().out
    assert main(["queue", "key", "list", "jobs", "--json", *t]) == 0
    (key,) = json.loads(capsys.readouterr().out)
    assert (key["shard"], key["key"], key["max_qps"], key["queue_default_max_in_flight"]) == ("s1", "acct-1", 0.5, 3)
    with psycopg.connect(shards.shards[0].dsn) as c:  # only on the tenant's shard
        assert c.execute("SELECT count(*) FROM qm.key_settings").fetchone() == (0,)
    assert main(["queue", "key", "set", "jobs", tenant, "acct-1", "--max-qps", "0", *t]) == 2
    assert "key setting 'max_qps' must be > 0" in capsys.readouterr().err
    assert main(["queue", "key", "set", "jobs", tenant, "acct-1", *t]) == 2
    assert "nothing to change" in capsys.readouterr().err
    assert main(["queue", "key", "unset", "jobs", tenant, "acct-1", *t]) == 0
    assert "limits removed" in capsys.readouterr().out
    assert main(["queue", "key", "list", *t]) == 0
    assert "no key limits of their own" in capsys.readouterr().out
    # qm enqueue takes them too; the queue's default fills the priority in, a bad one is refused
    enq = ["enqueue", "jobs", tenant, "{}", *t]
    assert main([*enq, "--priority", "1", "--concurrency-key", "acct-1", "--rate-key", "api"]) == 0
    assert main(enq) == 0
    assert main([*enq, "--priority", "9"]) == 2
    assert "priority must be 1 (highest) to 5, got 9" in capsys.readouterr().err
    with psycopg.connect(shards.shards[1].dsn) as c:
        rows = c.execute("SELECT priority, concurrency_key, rate_key FROM jobs ORDER BY id").fetchall()
    assert rows == [(1, "acct-1", "api"), (2, None, None)]


async def test_status_metrics_and_health_show_the_keys_in_hand_and_those_at_their_limit(
    shards: Topology, make_queue: Any
) -> None:
    shard = shards.shards[0]
    make_queue("orders", partitions=2, shuffle=1, key_max_in_flight=2)
    tenant = tenants_of(shard, 1)[0]
    rows = [{"tenant": tenant, "payload": {"i": i}, "concurrency_key": f"k{i % 3}"} for i in range(9)]
    fill(shard.dsn, rows)
    async with leading_manager(shard.dsn) as m:
        async with running_receiver(url(m), credit=10, mode="hold") as (_, rec):
            await wait_for(lambda: len(rec.events) >= 6, timeout=20, what="two events of each key in hand")
            health = m.health()["queues"]["orders"]
            metrics = m.metrics.render()
            data = admin.status(shards, queue="orders")
    assert health["keys_at_limit"] == 3
    assert sorted((k["key"], k["in_hand"], k["max_in_flight"]) for k in health["top_keys"]) == [
        ("k0", 2, 2),
        ("k1", 2, 2),
        ("k2", 2, 2),
    ]
    assert f'qm_key_in_flight{{key="k0",queue="orders",tenant="{tenant}"}} 2' in metrics
    assert 'qm_keys_at_limit{queue="orders"} 3' in metrics
    (q,) = data["shards"][0]["queues"]
    assert q["keys_at_limit"] == 3 and {k["key"] for k in q["top_keys"]} == {"k0", "k1", "k2"}
    assert f"{tenant}/k0 2/2" in admin.render_status(data) and "3 at their limit" in admin.render_status(data)
