"""Cancel against real PostgreSQL and a real manager: each state, the SQL function in a transaction,
a fired event's late ack refused with its own code and never re-fired, the CLI by id and by filter
with its confirmation, and qm events list / show."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from queue_manager import admin
from queue_manager.cli.main import main
from queue_manager.domain.eventfilter import EventFilter
from queue_manager.domain.topology import Topology
from queue_manager.wire import frames as f
from tests.conftest import tenants_of
from tests.managerkit import (
    insert,
    leading_manager,
    raw_client,
    recv_type,
    states,
    url,
    wait_for,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def queue(make_queue) -> str:  # type: ignore[no-untyped-def]
    return str(
        make_queue("orders", partitions=4, shuffle=2, ack_timeout_seconds=1, backoff_min_seconds=0.1, max_attempts=2)
    )


def _loads_match(dsn: str) -> bool:
    with psycopg.connect(dsn) as c:
        row = c.execute(
            "SELECT (SELECT sum(x) FROM unnest(qm.partition_loads('orders')) x),"
            " (SELECT count(*) FROM orders WHERE state IN ('to_be_fired', 'fired'))"
        ).fetchone()
    assert row is not None
    return int(row[0] or 0) == int(row[1])


async def test_cancel_in_each_state_and_a_late_ack_is_refused_with_its_own_code_never_refired(
    shards: Topology, queue: str
) -> None:
    s0 = shards.shards[0]
    t = tenants_of(s0, 1)[0]
    async with leading_manager(s0.dsn) as m:
        later = await insert(s0.dsn, [(t, {"n": "later"})], fire_in=3600)
        failed, acked = await insert(s0.dsn, [(t, {"n": "failed"}), (t, {"n": "acked"})], fire_in=3600)
        with psycopg.connect(s0.dsn, autocommit=True) as c:
            c.execute("UPDATE orders SET state = 'failed' WHERE id = %s", (failed,))
            c.execute("UPDATE orders SET state = 'acked', acked_at = now() WHERE id = %s", (acked,))
        async with raw_client(m) as ws:
            await ws.send(f.Subscribe("orders", credit=1).to_json())
            await recv_type(ws, "subscribed")
            [held] = await insert(s0.dsn, [(t, {"n": "held"})])
            got = (await recv_type(ws, "deliver"))["events"][0]
            assert (got["id"], got["attempt"]) == (held, 1)
            ids = {s.name: [later[0], failed, acked, held] for s in shards.shards}
            out = admin.run(shards, "orders", admin.ACTIONS["cancel"], None, ids, via="cli")
            assert out.changed == {"s0": 2, "s1": 0}  # the scheduled one and the fired one
            st = await states(s0.dsn)
            assert st[later[0]][0] == st[held][0] == "cancelled"
            assert (st[failed][0], st[acked][0]) == ("failed", "acked")
            # the manager heard it: the slot is free, the held event left its ledger
            await wait_for(lambda: held not in m.rt.queues["orders"].ledger, 5, "the cancel heard")
            await ws.send(f.Ack(((held, 1),), ref=1).to_json())
            result = await recv_type(ws, "ack_result")
            assert result["acked"] == [] and [e["code"] for e in result["errors"]] == ["cancelled"]
            await ws.send(f.Extend((f.ExtendItem(held, 1, 9),), ref=2).to_json())
            assert [e["code"] for e in (await recv_type(ws, "extend_result"))["errors"]] == ["cancelled"]
            # past its ack deadline (1 s) and the collector's sweeps: never fired again
            with pytest.raises((AssertionError, TimeoutError)):
                await recv_type(ws, "deliver", timeout=2.5)
        assert (await states(s0.dsn))[held] == ("cancelled", 1)
        with psycopg.connect(s0.dsn) as c:
            row = c.execute("SELECT last_error, acked_at IS NOT NULL FROM orders WHERE id = %s", (held,)).fetchone()
        assert row is not None and row[0].startswith("cancelled by ") and row[1]
        await wait_for(lambda: _loads_match(s0.dsn), 5, "both cancels counted done")
        # a cancelled event is cancelled again by nobody: the action changes nothing
        assert admin.run(shards, "orders", admin.ACTIONS["cancel"], None, ids).total == 0
        # counted by status
        [st0] = [q for q in admin.shard_status(s0) if q.queue == "orders"]
        assert st0.counts["cancelled"] == 2


def test_the_sql_function_cancels_in_the_callers_transaction(shards: Topology, queue: str) -> None:
    s0 = shards.shards[0]
    t = tenants_of(s0, 1)[0]
    with psycopg.connect(s0.dsn, autocommit=True) as c:
        row = c.execute(
            "INSERT INTO orders (tenant, payload, fire_at) VALUES (%s, '{}', now() + interval '1 hour') RETURNING id",
            (t,),
        ).fetchone()
        assert row is not None
        ident = row[0]
        with pytest.raises(psycopg.errors.DivisionByZero), c.transaction():
            assert c.execute("SELECT qm.cancel('orders', ARRAY[%s]::bigint[])", (ident,)).fetchone() == ([ident],)
            c.execute("SELECT 1/0")
        assert c.execute("SELECT state::text FROM orders WHERE id = %s", (ident,)).fetchone() == ("to_be_fired",)
        # its done count is a sequence's (not transactional, by design): re-anchored as the managers' slices do
        c.execute("SELECT qm.reconcile_load('orders')")
        out = c.execute("SELECT qm.cancel('orders', ARRAY[%s, 999]::bigint[], 'duplicate order')", (ident,)).fetchone()
        assert out == ([ident],)
        assert c.execute("SELECT state::text, last_error FROM orders WHERE id = %s", (ident,)).fetchone() == (
            "cancelled",
            "duplicate order",
        )
        with pytest.raises(psycopg.errors.UndefinedTable, match='queue "nope" does not exist'):
            c.execute("SELECT qm.cancel('nope', ARRAY[1]::bigint[])")
    assert _loads_match(s0.dsn)


def test_the_cli_cancels_by_id_and_by_filter_after_a_confirmation_and_lists_and_shows_events(
    shards: Topology, queue: str, topo_file: Path, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    s0, s1 = shards.shards
    t0, t1 = tenants_of(s0, 1)[0], tenants_of(s1, 1)[0]
    base = ["--topology", str(topo_file)]
    ids0 = asyncio.run(insert(s0.dsn, [(t0, {"i": i}) for i in range(3)], fire_in=3600))
    ids1 = asyncio.run(insert(s1.dsn, [(t1, {"i": i}) for i in range(2)], fire_in=3600))
    monkeypatch.setattr("sys.stdin.isatty", lambda: False)
    # by filter: the count, then nothing without --yes
    assert main(["events", "cancel", "orders", "--tenant", t0, *base]) == 1
    out = capsys.readouterr().out
    assert "3 event(s) of orders match" in out and "confirm with --yes" in out
    assert {s for s, _ in (asyncio.run(states(s0.dsn))).values()} == {"to_be_fired"}
    assert main(["events", "cancel", "orders", "--tenant", t0, "--yes", *base]) == 0
    assert "3 event(s) of orders cancelled" in capsys.readouterr().out
    assert {s for s, _ in (asyncio.run(states(s0.dsn))).values()} == {"cancelled"}
    # by id (ids are per shard: the id is looked for on each)
    assert main(["events", "cancel", "orders", "--id", str(ids1[0]), *base]) == 0
    assert asyncio.run(states(s1.dsn))[ids1[0]][0] == "cancelled"
    assert asyncio.run(states(s1.dsn))[ids1[1]][0] == "to_be_fired"
    capsys.readouterr()
    # bad input: refused, nothing changes
    for argv, words in (
        (["--id", "0"], "event id"),
        (["--state", "acked"], "invalid choice"),
        (["--payload", "payload.="], "payload filter"),
        (["--id", "1", "--tenant", t0], "either --id or filters"),
    ):
        try:
            code = main(["events", "cancel", "orders", *argv, "--yes", *base])
        except SystemExit as exc:
            code = int(exc.code or 0)
        assert code == 2 and words in capsys.readouterr().err, argv
    assert asyncio.run(states(s1.dsn))[ids1[1]][0] == "to_be_fired"
    # list and show
    assert main(["events", "list", "orders", "--state", "cancelled", "--json", *base]) == 0
    page = json.loads(capsys.readouterr().out)
    assert sorted((e["shard"], e["id"]) for e in page["events"]) == sorted(
        [("s0", i) for i in ids0] + [("s1", ids1[0])]
    )
    assert main(["events", "list", "orders", "--limit", "2", *base]) == 0
    text = capsys.readouterr().out
    cursor = text.strip().splitlines()[-1].split("--cursor ")[1]
    assert main(["events", "list", "orders", "--limit", "10", "--cursor", cursor, "--json", *base]) == 0
    rest = json.loads(capsys.readouterr().out)["events"]
    assert len(rest) == 3  # 5 events, 2 on the first page
    assert main(["events", "show", "orders", str(ids0[0]), "--shard", "s0", "--json", *base]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["state"] == "cancelled" and shown["last_error"].startswith("cancelled by ")
    assert shown["payload"] == {"i": 0} and shown["attempts"] == 0
    assert admin.browse.list_events(shards, "orders", EventFilter(state="to_be_fired")).events[0]["id"] == ids1[1]


async def _cancelled_at(dsn: str, ident: int) -> float:
    """The moment of the cancel's statement (acked_at: before its commit), epoch seconds."""
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cur = await conn.execute("SELECT extract(epoch FROM acked_at)::float8 FROM orders WHERE id = %s", (ident,))
        row = await cur.fetchone()
    assert row is not None
    return float(row[0])


async def test_a_running_handler_cancelled_from_the_cli_sees_it_within_100_ms_and_is_never_refired(
    shards: Topology, queue: str, topo_file: Path
) -> None:
    """The receiver library asks for cancel frames: a slow coroutine handler's task is cancelled
    within 100 ms of the CLI's cancel; the event ends cancelled at attempt 1, never fired again past
    its ack deadline and back-off, and nothing is acked for it; the receiver goes on."""
    from tests.integration.test_receiver_library import receiving

    s0 = shards.shards[0]
    t = tenants_of(s0, 1)[0]
    started: list[int] = []
    stopped: list[float] = []
    done: list[int] = []

    async def handle(event: Any) -> None:
        started.append(event.id)
        if event.payload.get("slow"):
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                stopped.append(time.time())
                raise
        done.append(event.id)

    async with leading_manager(s0.dsn) as m:
        async with receiving({"s0": [url(m)]}, handle, concurrency=2) as receiver:
            [slow] = await insert(s0.dsn, [(t, {"slow": True})])
            await wait_for(lambda: slow in started, 10, "the slow handler started")
            code = await asyncio.to_thread(
                main, ["events", "cancel", "orders", "--id", str(slow), "--topology", str(topo_file)]
            )
            assert code == 0
            await wait_for(lambda: bool(stopped), 2, "the handler's task cancelled")
            seen = stopped[0] - await _cancelled_at(s0.dsn, slow)
            assert seen < 0.1, f"the handler saw the cancel {seen * 1000:.0f} ms after it"
            await asyncio.sleep(2.5)  # past the ack deadline (1 s) and the back-off
            assert started.count(slow) == 1 and slow not in done
            assert (await states(s0.dsn))[slow] == ("cancelled", 1)
            [more] = await insert(s0.dsn, [(t, {"n": 1})])
            await wait_for(lambda: receiver.stats.acked == 1, 10, "the next event handled and acked")
            assert more in done and receiver.stats.cancelled == 1
    assert m.metrics.refired.get(queue="orders", reason="ack_timeout") == 0


async def test_a_function_handler_sees_the_cancel_flag_and_its_result_is_not_sent(shards: Topology, queue: str) -> None:
    from tests.integration.test_receiver_library import receiving

    s0 = shards.shards[0]
    t = tenants_of(s0, 1)[0]
    saw: list[float] = []

    def handle(event: Any) -> None:  # a thread: it polls the flag
        deadline = time.time() + 20
        while time.time() < deadline:
            if event.cancelled:
                saw.append(time.time())
                return
            time.sleep(0.005)

    async with leading_manager(s0.dsn) as m:
        async with receiving({"s0": [url(m)]}, handle, concurrency=1) as receiver:
            [ident] = await insert(s0.dsn, [(t, {"n": 1})])
            await wait_for(lambda: ident in m.rt.queues["orders"].ledger, 10, "the event in hand")
            await asyncio.to_thread(admin.run, shards, "orders", admin.ACTIONS["cancel"], None, {"s0": [ident]})
            await wait_for(lambda: bool(saw), 2, "the handler saw the flag")
            assert saw[0] - await _cancelled_at(s0.dsn, ident) < 0.1
            await asyncio.sleep(0.3)
            assert receiver.stats.acked == 0 and receiver.stats.cancelled == 1
            assert (await states(s0.dsn))[ident] == ("cancelled", 1)
