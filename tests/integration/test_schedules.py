"""Periodic schedules against real PostgreSQL and a real manager: the SQL API refuses bad input and
changes nothing, the leader enqueues each slot once ahead of its time and it fires at its instant,
a deposed leader's pass is fenced, a cursor sent back enqueues nothing twice, pause and remove."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from queue_manager.domain.topology import Topology
from queue_manager.manager import store
from queue_manager.manager.schedules import Scheduler
from tests.conftest import tenants_of
from tests.managerkit import leading_manager, running_receiver, url, wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def queue(make_queue) -> str:  # type: ignore[no-untyped-def]
    return str(make_queue("orders", partitions=4, shuffle=2, window_seconds=3))


def _count(conn: psycopg.Connection[Any], sql: str, *args: Any) -> int:
    row = conn.execute(sql, args).fetchone()
    assert row is not None
    return int(row[0])


BAD = [
    ("qm.schedule_add('a', 'nope', %(t)s, interval_seconds => 5)", "42P01", 'queue "nope" does not exist'),
    ("qm.schedule_add('a', 'orders', %(other)s, interval_seconds => 5)", "23514", "belongs to shard \"s1\""),
    ("qm.schedule_add('a', 'orders', %(t)s, cron => '61 * * *')", "22023", "5 fields"),
    ("qm.schedule_add('a', 'orders', %(t)s, cron => 'every day')", "22023", "5 fields"),
    ("qm.schedule_add('a', 'orders', %(t)s, interval_seconds => 0.5)", "22023", "from 1 second"),
    ("qm.schedule_add('a', 'orders', %(t)s)", "22023", "not neither"),
    ("qm.schedule_add('a', 'orders', %(t)s, cron => '* * * * *', interval_seconds => 5)", "22023", "not both"),
    ("qm.schedule_add('a', 'orders', %(t)s, interval_seconds => 5, timezone => 'Mars/Olympus')", "22023",
     "unknown time zone 'Mars/Olympus'"),
    ("qm.schedule_add('a', 'orders', %(t)s, interval_seconds => 5, misfire => 'often')", "22023", "misfire must be"),
    ("qm.schedule_add('a', 'orders', %(t)s, interval_seconds => 5, catch_up => 0)", "22023", "catch_up must be"),
    ("qm.schedule_add('a', 'orders', %(t)s, interval_seconds => 5, priority => 9::smallint)", "22023", "priority"),
    ("qm.schedule_add('a b', 'orders', %(t)s, interval_seconds => 5)", "22023", "name 'a b' is not valid"),
    ("qm.schedule_add('taken', 'orders', %(t)s, interval_seconds => 5)", "23505", "exists already"),
    ("qm.schedule_pause('ghost')", "42704", "no schedule named 'ghost'"),
]  # fmt: skip


def test_the_sql_api_refuses_bad_input_clearly_and_changes_nothing(shards: Topology, queue: str) -> None:
    s0, s1 = shards.shards
    t = tenants_of(s0, 1)[0]
    other = tenants_of(s1, 1)[0]
    with psycopg.connect(s0.dsn, autocommit=True) as c:
        c.execute("SELECT qm.schedule_add('taken', 'orders', %s, interval_seconds => 60)", (t,))
        before = c.execute("SELECT * FROM qm.schedules").fetchall()
        for call, state, words in BAD:
            with pytest.raises(psycopg.Error) as err:
                c.execute(f"SELECT {call}", {"t": t, "other": other})
            assert err.value.sqlstate == state, (call, err.value)
            assert words in str(err.value), (call, str(err.value))
        assert c.execute("SELECT * FROM qm.schedules").fetchall() == before
        # in a transaction like an enqueue: a rollback leaves nothing
        with pytest.raises(psycopg.errors.DivisionByZero), c.transaction():
            c.execute("SELECT qm.schedule_add('rolled', 'orders', %s, interval_seconds => 5)", (t,))
            c.execute("SELECT 1/0")
        assert _count(c, "SELECT count(*) FROM qm.schedules WHERE name = 'rolled'") == 0


async def test_the_leader_enqueues_each_slot_once_ahead_and_it_fires_at_its_instant(
    shards: Topology, queue: str
) -> None:
    s0 = shards.shards[0]
    t = tenants_of(s0, 1)[0]
    async with leading_manager(s0.dsn) as m, running_receiver(url(m)) as (_, rec):
        with psycopg.connect(s0.dsn, autocommit=True) as c:
            c.execute(
                "SELECT qm.schedule_add('tick', 'orders', %s, '{\"job\": \"tick\"}', interval_seconds => 1,"
                " anchor => date_trunc('second', now()) + interval '3 seconds')",
                (t,),
            )
        await wait_for(lambda: len(rec.events) >= 6, 20, "six slots fired")
        with psycopg.connect(s0.dsn, autocommit=True) as c:
            rows = c.execute(
                "SELECT dedup_key, fire_at, created_at FROM orders"
                " WHERE dedup_key LIKE 'qm:schedule:%%' ORDER BY fire_at"
            ).fetchall()
            sched = c.execute("SELECT next_at, last_slot, last_event_id, missed FROM qm.schedules").fetchone()
    assert sched is not None and sched[3] == 0 and sched[2] is not None
    keys = [r[0] for r in rows]
    assert len(keys) == len(set(keys))
    fire_ats = [r[1] for r in rows]
    assert all(b - a == fire_ats[1] - fire_ats[0] for a, b in itertools.pairwise(fire_ats))
    assert fire_ats[1] - fire_ats[0] == timedelta(seconds=1)
    # enqueued ahead: the window (3 s) at least, less a pass
    assert all((fa - ca).total_seconds() >= 1.5 for _, fa, ca in rows[3:])
    # fired at the slot's instant: never before, and within 100 ms on this shared machine
    for e, at in zip(rec.events, rec.received_at, strict=True):
        assert e.payload == {"job": "tick"}
        assert -0.01 <= at - e.fire_at < 0.1, at - e.fire_at


async def test_a_schedules_slot_events_have_its_priority_or_the_queues_default(
    shards: Topology, make_queue: Any
) -> None:
    make_queue("urgent_jobs", partitions=4, shuffle=2, window_seconds=3, default_priority=4)
    s0 = shards.shards[0]
    t = tenants_of(s0, 1)[0]
    async with leading_manager(s0.dsn) as m, running_receiver(url(m), queue="urgent_jobs") as (_, rec):
        with psycopg.connect(s0.dsn, autocommit=True) as c:
            for name, priority in (("first", 1), ("plain", None)):
                c.execute(
                    "SELECT qm.schedule_add(%s, 'urgent_jobs', %s, interval_seconds => 1, priority => %s::smallint,"
                    " anchor => date_trunc('second', now()) + interval '1 second')",
                    (name, t, priority),
                )
        await wait_for(lambda: len(rec.events) >= 4, 20, "slots of both schedules fired")
        with psycopg.connect(s0.dsn) as c:
            got = c.execute(
                "SELECT s.name, e.priority, count(*) FROM urgent_jobs e"
                " JOIN qm.schedules s ON e.dedup_key LIKE 'qm:schedule:' || s.id || ':%%' GROUP BY 1, 2"
            ).fetchall()
    assert {name: p for name, p, _ in got} == {"first": 1, "plain": 4} and len(got) == 2
    assert {e.priority for e in rec.events} == {1, 4}  # delivered with it


async def test_a_deposed_leaders_pass_is_fenced_and_a_cursor_sent_back_enqueues_nothing_twice(
    shards: Topology, queue: str
) -> None:
    s0 = shards.shards[0]
    t = tenants_of(s0, 1)[0]
    async with leading_manager(s0.dsn) as m:
        with psycopg.connect(s0.dsn, autocommit=True) as c:
            c.execute("SELECT qm.schedule_add('fast', 'orders', %s, interval_seconds => 1)", (t,))
            await wait_for(lambda: _count(c, "SELECT count(*) FROM orders") >= 4, 10, "slots enqueued")
            term = _count(c, "SELECT term FROM qm.leader")
            # the cursor sent back a minute: the leader walks those slots again, and enqueues none twice
            c.execute(
                "UPDATE qm.schedules"
                " SET next_at = next_at - interval '20 seconds', misfire = 'catch_up', catch_up = 100"
            )
            moved = _count(c, "SELECT count(*) FROM orders")
            await wait_for(
                lambda: _count(c, "SELECT count(*) FROM qm.schedules WHERE next_at > now()") == 1, 10, "pass"
            )
            dup = _count(c, "SELECT count(*) - count(DISTINCT dedup_key) FROM orders")
            assert dup == 0 and _count(c, "SELECT count(*) FROM orders") >= moved
    # a pass with a term that is no longer current changes nothing
    with psycopg.connect(s0.dsn, autocommit=True) as c:
        c.execute("UPDATE qm.schedules SET next_at = now() - interval '5 seconds'")
        before = _count(c, "SELECT count(*) FROM orders")
    conn = await store.connect(s0.dsn, "test-deposed")
    try:
        with pytest.raises(psycopg.Error) as err:
            await Scheduler(m.rt, conn, term).run_once()
        assert store.is_fenced(err.value)
    finally:
        await conn.close()
    with psycopg.connect(s0.dsn, autocommit=True) as c:
        assert _count(c, "SELECT count(*) FROM orders") == before


async def test_pause_drops_the_slots_enqueued_ahead_resume_goes_on_remove_ends_it(shards: Topology, queue: str) -> None:
    s0 = shards.shards[0]
    t = tenants_of(s0, 1)[0]
    pending = "SELECT count(*) FROM orders WHERE state = 'to_be_fired' AND fire_at > now()"
    async with leading_manager(s0.dsn):
        with psycopg.connect(s0.dsn, autocommit=True) as c:
            c.execute("SELECT qm.schedule_add('p', 'orders', %s, interval_seconds => 1)", (t,))
            await wait_for(lambda: _count(c, pending) >= 3, 10, "slots ahead")
            c.execute("SELECT qm.schedule_pause('p')")
            assert _count(c, pending) == 0
            paused_at = time.time()
            await asyncio.sleep(2.5)  # a paused schedule: nothing is enqueued (two passes at least)
            assert _count(c, pending) == 0
            c.execute("SELECT qm.schedule_resume('p')")
            await wait_for(lambda: _count(c, pending) >= 3, 10, "slots ahead again")
            gap = c.execute(
                "SELECT count(*) FROM orders WHERE fire_at > to_timestamp(%s) + interval '0.5 s'"
                " AND fire_at < to_timestamp(%s) + interval '2 s'",
                (paused_at, paused_at),
            ).fetchone()
            assert gap is not None and gap[0] == 0  # the slots of the pause never come
            assert c.execute("SELECT qm.schedule_remove('p')").fetchone() == (True,)
            assert _count(c, pending) == 0
            assert c.execute("SELECT qm.schedule_remove('p')").fetchone() == (False,)
            # the load counters: the dropped slots were counted done
            loads = c.execute("SELECT qm.partition_loads('orders')").fetchone()
            live = _count(c, "SELECT count(*) FROM orders WHERE state IN ('to_be_fired', 'fired')")
            assert loads is not None and sum(loads[0]) == live


CLI_BAD = [
    (["--cron", "61 * * * *"], "cron expression '61 * * * *' is not valid"),
    (["--cron", "* * * *"], "give 5 fields"),
    (["--cron", "0 3 * * *", "--tz", "Mars/Olympus"], "unknown time zone 'Mars/Olympus'"),
    (["--every", "0.5"], "from 1 second"),
    (["--every", "soon"], "--every"),
    (["--every", "5", "--queue", "nope"], "queue \"nope\" does not exist on shard 's0'"),
    (["--every", "5", "--payload", "{bad"], "--payload must be JSON"),
    (["--every", "5", "--misfire", "catch_up", "--catch-up", "0"], "catch_up must be"),
    (["--every", "5", "--priority", "7"], "priority must be from 1"),
    (["--every", "5", "--start", "2026-12-01T09:00:00"], "must carry its offset"),
    (["--every", "5", "--name", "taken"], "a schedule named 'taken' exists already"),
    (["--every", "5", "--name", "on-s1", "--tenant", "{t}"], "a schedule named 'on-s1' exists on shard s1"),
]  # fmt: skip


def test_the_cli_adds_lists_shows_pauses_resumes_removes_and_refuses_bad_input(
    shards: Topology, queue: str, topo_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from queue_manager.cli.main import main

    s0, s1 = shards.shards
    t, other = tenants_of(s0, 1)[0], tenants_of(s1, 1)[0]
    base = ["--topology", str(topo_file)]
    add = ["schedule", "add", "--queue", "orders", "--tenant", t, *base]
    assert main([*add[:2], "taken", *add[2:], "--every", "1h"]) == 0
    assert main(["schedule", "add", "on-s1", "--queue", "orders", "--tenant", other, "--every", "1h", *base]) == 0
    capsys.readouterr()

    def rows() -> list[Any]:
        out = []
        for s in shards.shards:
            with psycopg.connect(s.dsn) as c:
                out += c.execute("SELECT * FROM qm.schedules ORDER BY id").fetchall()
        return out

    before = rows()
    for extra, words in CLI_BAD:
        extra = [x.replace("{t}", t) for x in extra]
        name = extra[extra.index("--name") + 1] if "--name" in extra else "fresh"
        extra = [x for i, x in enumerate(extra) if x != "--name" and (i == 0 or extra[i - 1] != "--name")]
        argv = [*add[:2], name, *add[2:], *extra]
        code = -1
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's own refusals
            code = int(exc.code or 0)
        err = capsys.readouterr().err
        assert code == 2, (argv, err)
        assert words in err, (argv, err)
    assert rows() == before

    assert main([*add[:2], "nightly", *add[2:], "--cron", "30 2 * * *", "--tz", "Europe/Berlin"]) == 0
    out = capsys.readouterr().out
    assert "schedule nightly added on shard s0: cron '30 2 * * *' in Europe/Berlin" in out
    assert main(["schedule", "list", "--json", *base]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in listed] == ["nightly", "on-s1", "taken"]
    nightly = listed[0]
    assert nightly["shard"] == "s0" and len(nightly["next_runs"]) == 3
    assert all(r.endswith(":30:00+00:00") for r in nightly["next_runs"])
    assert main(["schedule", "pause", "nightly", *base]) == 0
    assert main(["schedule", "show", "nightly", "--json", *base]) == 0
    shown = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert shown["paused"] is True and shown["next_runs"] == []
    assert main(["schedule", "resume", "nightly", *base]) == 0
    assert main(["schedule", "remove", "nightly", *base]) == 0
    assert main(["schedule", "show", "nightly", *base]) == 2
    assert "no schedule named 'nightly'" in capsys.readouterr().err
    # the changes are in the audit
    with psycopg.connect(s0.dsn) as c:
        acts = [r[0] for r in c.execute("SELECT action FROM qm.audit ORDER BY id").fetchall()]
    assert acts == ["schedule_add", "schedule_add", "schedule_pause", "schedule_resume", "schedule_remove"]


async def test_thousands_of_schedules_are_enqueued_in_bounded_transactions(shards: Topology, queue: str) -> None:
    """1 000 schedules of 1 s with a 25 s window: the first pass has about 27 000 slots to enqueue.
    Each routed insert with a dedup key holds an advisory lock to its commit, so one transaction of
    them all ran the server's lock table out; the pass commits them in transactions of at most 500."""
    s0 = shards.shards[0]
    tenants = tenants_of(s0, 50)
    async with leading_manager(s0.dsn) as m:
        with psycopg.connect(s0.dsn, autocommit=True) as c:
            c.execute("SELECT qm.alter_queue('orders', '{\"window_seconds\": 25}')")
            # the server's lock table: max_locks_per_transaction per connection slot
            locks = c.execute(
                "SELECT current_setting('max_locks_per_transaction')::int"
                " * (current_setting('max_connections')::int + current_setting('max_prepared_transactions')::int)"
            ).fetchone()
            c.execute(
                "SELECT qm.schedule_add('many-' || g, 'orders', (%s::text[])[1 + g %% 50], interval_seconds => 1,"
                " anchor => now() + interval '1 second') FROM generate_series(0, 999) g",
                (tenants,),
            )
            ahead = "SELECT count(*) FROM qm.schedules WHERE next_at > now() + interval '25 seconds'"
            await wait_for(lambda: _count(c, ahead) == 1000, 90, "every schedule enqueued a window ahead")
            assert locks is not None and _count(c, "SELECT count(*) FROM orders") > locks[0]
            assert _count(c, "SELECT count(*) - count(DISTINCT dedup_key) FROM orders") == 0
            assert _count(c, "SELECT count(*) FROM qm.schedules WHERE error IS NOT NULL") == 0
            assert m.rt.session is not None and m.rt.session.failed is None


async def test_a_round_enqueues_at_most_its_row_bound_and_the_next_goes_on(shards: Topology, queue: str) -> None:
    """The bound itself: a round stops taking schedules once it holds ROWS_PER_TRANSACTION slots
    (the rest keep their cursors, and the next round of the pass takes them first)."""
    from queue_manager.manager.schedules import ROWS_PER_TRANSACTION, SLOTS_PER_PASS

    s0 = shards.shards[0]
    tenants = tenants_of(s0, 20)
    with psycopg.connect(s0.dsn, autocommit=True) as c:
        row = c.execute("SELECT qm.acquire_leadership('test-holder', 60)").fetchone()
        assert row is not None and row[0] is not None
        term = int(row[0])
        c.execute(
            "SELECT qm.schedule_add('r-' || g, 'orders', (%s::text[])[1 + g %% 20], interval_seconds => 1,"
            " anchor => now() + interval '1 second') FROM generate_series(0, 299) g",
            (tenants,),
        )
    conn = await store.connect(s0.dsn, "test-scheduler")
    try:
        sched = Scheduler(None, conn, term)  # type: ignore[arg-type]  # no runtime: its rounds only
        counts, more = await sched._round(None)
        assert more and ROWS_PER_TRANSACTION <= counts.slots < ROWS_PER_TRANSACTION + SLOTS_PER_PASS
        rest = await sched.run_once()
        assert counts.slots + rest.slots == counts.enqueued + rest.enqueued >= 300 * 4
    finally:
        await conn.close()
    with psycopg.connect(s0.dsn, autocommit=True) as c:
        assert _count(c, "SELECT count(*) FROM qm.schedules WHERE next_at < now() + interval '3 seconds'") == 0
        assert _count(c, "SELECT count(*) - count(DISTINCT dedup_key) FROM orders") == 0


async def test_a_schedule_whose_event_the_queue_refuses_gets_its_error_and_the_others_go_on(
    shards: Topology, queue: str
) -> None:
    s0 = shards.shards[0]
    t1, t2 = tenants_of(s0, 2)
    with psycopg.connect(s0.dsn, autocommit=True) as c:
        c.execute(
            "SELECT qm.schedule_add('big', 'orders', %s, %s::jsonb, interval_seconds => 1)",
            (t1, '{"x": "' + "y" * 400 + '"}'),
        )
        c.execute("SELECT qm.schedule_add('small', 'orders', %s, interval_seconds => 1)", (t2,))
        c.execute("SELECT qm.alter_queue('orders', '{\"payload_limit_bytes\": 100}')")
    async with leading_manager(s0.dsn) as m:
        with psycopg.connect(s0.dsn, autocommit=True) as c:
            err = "SELECT count(*) FROM qm.schedules WHERE name = 'big' AND error LIKE 'its event was refused:%%'"
            await wait_for(lambda: _count(c, err) == 1, 15, "the big schedule's error recorded")
            small = "SELECT count(*) FROM orders WHERE tenant = %s"
            await wait_for(lambda: _count(c, small, t2) >= 3, 15, "the small schedule's slots enqueued")
            assert _count(c, "SELECT count(*) FROM orders WHERE tenant = %s", t1) == 0
            # a change clears the error (a smaller payload): its slots come
            c.execute("SELECT qm.schedule_upsert('big', 'orders', %s, interval_seconds => 1)", (t1,))
            await wait_for(lambda: _count(c, small, t1) >= 2, 15, "the changed schedule's slots enqueued")
        assert m.rt.session is not None and m.rt.session.failed is None
