"""Online resharding on real servers: a split and a merge copy every event in every state, its
dedup key and the tenant overrides, keep them in sync while the sources serve, switch, reverse,
clean up; the sources refuse writes of the moved range with the retryable "moved" error, and a
Router with the old topology file lands its events on the right shard."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import psycopg
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus

from queue_manager import admin
from queue_manager.db.migrate import set_identity
from queue_manager.domain.topology import KeyRange, Shard, Topology
from queue_manager.errors import ConfigurationError, TenantMovedError
from queue_manager.producer import Router, enqueue
from queue_manager.reshard.workflow import Reshard, load_state
from queue_manager.wire import frames as f
from receivers.testing import MinimalClient
from tests.conftest import DatabaseFactory, tenants_of
from tests.managerkit import (
    ACK_BY_SQL,
    SECRET_ALL,
    Recorder,
    insert,
    leading_manager,
    raw_client,
    recv_type,
    running_manager,
    states,
    subscribe,
    url,
    wait_for,
    wait_leader,
)
from tests.processkit import ManagerProcess, write_config

Conn = psycopg.Connection[Any]

#: the columns an event keeps across a move (all but the id, which a merge may renumber)
COLUMNS = (
    "tenant, partition, fire_at, state::text, attempts, payload, dedup_key, created_at, fired_at, acked_at, "
    "ack_deadline, fired_term, last_error"
)


def write_topology(path: Path, topology: Topology) -> Path:
    path.write_text(topology.to_toml())
    return path


def events(dsn: str, queue: str = "orders") -> dict[str, tuple[Any, ...]]:
    """Every event of the queue by its payload's "n", with every column but the id."""
    with psycopg.connect(dsn) as c:
        rows = c.execute(f"SELECT payload->>'n', {COLUMNS} FROM {queue}").fetchall()
    return {str(r[0]): tuple(r[1:]) for r in rows}


def ids(dsn: str, queue: str = "orders") -> dict[str, int]:
    with psycopg.connect(dsn) as c:
        return {str(n): int(i) for n, i in c.execute(f"SELECT payload->>'n', id FROM {queue}").fetchall()}


def seed(dsn: str, tenants: list[str], start: int, count: int) -> None:
    """``count`` events of the given tenants in every state: due, scheduled, fired (in flight, with a
    deadline), acked, failed, some with dedup keys."""
    with psycopg.connect(dsn, autocommit=True) as c:
        for i in range(start, start + count):
            t = tenants[i % len(tenants)]
            c.execute(
                "INSERT INTO orders (tenant, payload, fire_at, dedup_key) "
                "VALUES (%s, %s, now() + %s * interval '1 hour', %s)",
                (t, json.dumps({"n": str(i)}), i % 2, f"k{i}" if i % 3 == 0 else None),
            )
        c.execute("SET qm.role = 'manager'")
        c.execute(
            "UPDATE orders SET state = 'fired', attempts = 1, fired_at = now(), "
            "ack_deadline = now() + interval '30 s', fired_term = 7 "
            "WHERE (payload->>'n')::int %% 5 = 1 AND (payload->>'n')::int >= %s",
            (start,),
        )
        c.execute(
            "UPDATE orders SET state = 'acked', attempts = 1, fired_at = now(), acked_at = now() "
            "WHERE (payload->>'n')::int %% 5 = 2 AND (payload->>'n')::int >= %s",
            (start,),
        )
        c.execute(
            "UPDATE orders SET state = 'failed', attempts = 3, fired_at = now(), last_error = 'boom' "
            "WHERE (payload->>'n')::int %% 5 = 3 AND (payload->>'n')::int >= %s",
            (start,),
        )


def shard_state(dsn: str) -> tuple[str, str, bool]:
    with psycopg.connect(dsn) as c:
        row = c.execute("SELECT name, serving, capturing FROM qm.shard").fetchone()
    assert row is not None
    return str(row[0]), str(row[1]), bool(row[2])


def split_targets(new_database: DatabaseFactory) -> list[Shard]:
    return [
        Shard("s2", new_database(), KeyRange.parse("-40")),
        Shard("s3", new_database(), KeyRange.parse("40-80")),
    ]


def expected_on(target: Shard, rows: dict[str, tuple[Any, ...]]) -> dict[str, tuple[Any, ...]]:
    return {n: r for n, r in rows.items() if target.key_range.contains(r[0])}


def test_a_split_copies_every_state_keeps_in_sync_switches_and_reverses(
    shards: Topology, new_database: DatabaseFactory, make_queue: Any, tmp_path: Path
) -> None:
    make_queue("orders", partitions=4, shuffle=2)
    s0 = shards.by_name("s0")
    tenants = tenants_of(s0, 12)
    seed(s0.dsn, tenants, 0, 300)
    admin.set_tenant(shards, "orders", tenants[0], {"weight": 5})
    admin.set_tenant(shards, "orders", tenants[1], {"max_in_flight": 3})
    topo = write_topology(tmp_path / "topology.toml", shards)
    targets = split_targets(new_database)
    s2, s3 = targets

    with Reshard(topo) as r:
        plan = r.plan(targets)
        assert plan.kind == "split" and [s.name for s in plan.sources] == ["s0"]
        r.start(targets, batch=64)
        # the targets are migrated, pending (no leadership, no writes) and hold the copy
        assert shard_state(s2.dsn) == ("s2", "pending", False)
        assert shard_state(s0.dsn) == ("s0", "serving", True)
        before = events(s0.dsn)
        assert events(s2.dsn) == expected_on(s2, before)
        assert events(s3.dsn) == expected_on(s3, before)
        assert ids(s2.dsn).items() <= ids(s0.dsn).items()  # a split keeps the ids
        with psycopg.connect(s2.dsn) as c, pytest.raises(psycopg.Error, match=r"QMM01|does not serve"):
            c.execute("INSERT INTO orders (tenant, payload) VALUES (%s, '{}')", (tenants_of(s2, 1)[0],))

        # the sources keep serving: inserts, acks, deletes and override changes are captured
        seed(s0.dsn, tenants, 300, 60)
        with psycopg.connect(s0.dsn, autocommit=True) as c:
            c.execute("UPDATE orders SET state = 'acked', acked_at = now() WHERE (payload->>'n')::int % 5 = 1")
            c.execute("DELETE FROM orders WHERE (payload->>'n')::int % 7 = 0")
        admin.set_tenant(shards, "orders", tenants[0], {"weight": 9})
        admin.unset_tenant(shards, "orders", tenants[1])
        assert sum(r.lag(plan.sources).values()) > 0
        assert r.status()["lag"]["s0"] > 0

        r.switch()

    # every event, in its state, with its dedup key, is on the target that owns its tenant
    final = events(s0.dsn)
    final_ids = ids(s0.dsn)
    assert len(final) > 300
    assert events(s2.dsn) == expected_on(s2, final)
    assert events(s3.dsn) == expected_on(s3, final)
    for t in targets:  # each target has the overrides of its own tenants, none of the other's
        with psycopg.connect(t.dsn) as c:
            overrides = c.execute("SELECT tenant, weight, max_in_flight FROM qm.tenant_settings").fetchall()
        owned = {x for x in tenants[:2] if t.key_range.contains(x)}
        assert {o[0] for o in overrides} == ({tenants[0]} & owned), t.name
    # the topology file and every shard's map name the targets; the source is moved, the targets serve
    assert [s.name for s in Topology.load(topo).shards] == ["s1", "s2", "s3"]
    assert shard_state(s0.dsn) == ("s0", "moved", False)
    assert shard_state(s2.dsn) == ("s2", "serving", True)
    state = load_state(topo)
    assert state is not None and state.phase == "switched"
    assert [h["step"] for h in state.history[-4:]] == ["freeze", "catch_up", "serve", "topology"]

    # a producer writing to the source gets the retryable "moved" error naming the target
    t2 = tenants_of(s2, 1)[0]
    with psycopg.connect(s0.dsn) as c, pytest.raises(TenantMovedError) as moved:
        enqueue(c, "orders", t2, {"n": "late"})
    assert moved.value.right_shard == "s2"
    # an ack by SQL on the source of an event now served by the target is refused, not lost
    with psycopg.connect(s0.dsn) as c, pytest.raises(psycopg.Error, match="does not serve"):
        c.execute("UPDATE orders SET state = 'acked' WHERE state = 'to_be_fired'")
    # dedup keys keep deduplicating on the target
    key_row = next(r for r in final.values() if r[6] is not None and s2.key_range.contains(r[0]))
    with psycopg.connect(s2.dsn) as c:
        assert enqueue(c, "orders", key_row[0], {"n": "dup"}, dedup_key=key_row[6]) is None
        new_id = enqueue(c, "orders", t2, {"n": "after-switch"})
        c.commit()
    assert new_id is not None and new_id > max(ids(s0.dsn).values())

    # reverse: the sources serve again, with what the targets took in the meantime
    with psycopg.connect(s2.dsn, autocommit=True) as c:
        c.execute("UPDATE orders SET state = 'acked', acked_at = now() WHERE payload->>'n' = 'after-switch'")
    with Reshard(topo) as r:
        r.reverse()
    assert [s.name for s in Topology.load(topo).shards] == ["s0", "s1"]
    assert shard_state(s0.dsn) == ("s0", "serving", True)
    back = events(s0.dsn)
    assert back["after-switch"][3] == "acked"
    assert {n: v for n, v in back.items() if n != "after-switch"} == final
    # the events came home under their original ids
    assert {n: i for n, i in ids(s0.dsn).items() if n != "after-switch"} == final_ids

    # switch again, then clean up: the source's events go, the reshard is done
    with Reshard(topo) as r:
        r.switch()
        r.cleanup()
        with pytest.raises(Exception, match="done"):
            r.switch()
    assert events(s0.dsn) == {}
    assert events(s2.dsn) == expected_on(s2, back)
    assert shard_state(s2.dsn) == ("s2", "serving", False)


def test_a_merge_renumbers_colliding_ids_and_dedups_across_the_move(
    shards: Topology, new_database: DatabaseFactory, make_queue: Any, tmp_path: Path
) -> None:
    make_queue("orders", partitions=4, shuffle=2)
    s0, s1 = shards.shards
    seed(s0.dsn, tenants_of(s0, 5), 0, 40)
    seed(s1.dsn, tenants_of(s1, 5), 1000, 40)
    assert set(ids(s0.dsn).values()) & set(ids(s1.dsn).values())  # the two id spaces collide
    topo = write_topology(tmp_path / "topology.toml", shards)
    merged = Shard("m0", new_database(), KeyRange.parse("-"))
    with Reshard(topo) as r:
        assert r.plan([merged]).kind == "merge"
        r.start([merged])
        seed(s1.dsn, tenants_of(s1, 5), 2000, 10)
        r.switch()
    everything = {**events(s0.dsn), **events(s1.dsn)}
    assert events(merged.dsn) == everything
    assert len(set(ids(merged.dsn).values())) == len(everything)
    # a dedup key of either source still dedups on the merged shard
    with psycopg.connect(merged.dsn) as c:
        for n in ("0", "1002"):
            row = everything[n]
            assert row[6] is not None
            assert enqueue(c, "orders", row[0], {"n": "again"}, dedup_key=row[6]) is None
        fresh = enqueue(c, "orders", row[0], {"n": "fresh"})
        c.commit()
    assert fresh is not None and fresh > max(ids(merged.dsn).values()) - 1
    # reverse splits them back, each event to its own source under its own id again
    before_ids = {**ids(s0.dsn), **ids(s1.dsn)}
    with Reshard(topo) as r:
        r.reverse()
    assert {**events(s0.dsn), **events(s1.dsn)}.keys() == everything.keys() | {"fresh"}
    after_ids = {**ids(s0.dsn), **ids(s1.dsn)}
    assert {n: after_ids[n] for n in before_ids} == before_ids


def test_bad_plans_are_refused_clearly(shards: Topology, new_database: DatabaseFactory, tmp_path: Path) -> None:
    topo = write_topology(tmp_path / "topology.toml", shards)
    with Reshard(topo) as r:
        with pytest.raises(Exception, match="exactly the ranges"):
            r.plan([Shard("s2", new_database(), KeyRange.parse("-40"))])
        with pytest.raises(Exception, match="must be new"):
            r.plan([Shard("s1", new_database(), KeyRange.parse("-80"))])
        with pytest.raises(Exception, match="no reshard"):
            r.switch()
    assert load_state(topo) is None


def test_a_target_that_is_already_a_shard_is_refused(
    shards: Topology, make_queue: Any, tmp_path: Path, new_database: DatabaseFactory
) -> None:
    make_queue("orders")
    topo = write_topology(tmp_path / "topology.toml", shards)
    busy = Shard("s9", new_database(), KeyRange.parse("-40"))
    other = Topology((Shard("x", busy.dsn, KeyRange.parse("-")),))
    set_identity(busy.dsn, other.shards[0], other)
    with Reshard(topo) as r, pytest.raises(Exception, match="already shard"):
        r.start([busy, Shard("s3", new_database(), KeyRange.parse("40-80"))])


def test_router_with_the_old_topology_follows_the_switch(
    shards: Topology, new_database: DatabaseFactory, make_queue: Any, tmp_path: Path
) -> None:
    make_queue("orders")
    s0 = shards.by_name("s0")
    topo = write_topology(tmp_path / "topology.toml", shards)
    targets = split_targets(new_database)
    router = Router.from_file(topo, moved_wait=5.0)
    tenant = tenants_of(targets[1], 1)[0]
    try:
        assert router.enqueue("orders", tenant, {"n": "before"}) is not None
        with Reshard(topo) as r:
            r.start(targets)
            r.switch()
        # the router still holds the old topology: s0 refuses as moved, it reloads and retries on s3
        assert router.shard_for(tenant).name == "s0"
        assert router.enqueue("orders", tenant, {"n": "after"}) is not None
        assert router.shard_for(tenant).name == "s3"
    finally:
        router.close()
    assert set(events(targets[1].dsn)) == {"before", "after"}
    assert "after" not in events(s0.dsn)
    # a router without the file cannot follow: it raises the moved error
    with Router(shards) as stale, pytest.raises(TenantMovedError):
        stale.enqueue("orders", tenant, {"n": "lost?"})


def test_cancel_before_the_switch_drops_the_copy(
    shards: Topology, new_database: DatabaseFactory, make_queue: Any, tmp_path: Path
) -> None:
    make_queue("orders")
    s0 = shards.by_name("s0")
    seed(s0.dsn, tenants_of(s0, 4), 0, 20)
    topo = write_topology(tmp_path / "topology.toml", shards)
    targets = split_targets(new_database)
    with Reshard(topo) as r:
        r.start(targets)
        with pytest.raises(Exception, match="only once the targets serve"):
            r.cleanup()
        r.cancel()
        with pytest.raises(ConfigurationError, match="cancelled"):
            r.switch()
    assert events(targets[0].dsn) == {} and events(targets[1].dsn) == {}
    assert shard_state(s0.dsn) == ("s0", "serving", False)
    assert len(events(s0.dsn)) == 20
    with psycopg.connect(s0.dsn) as c:
        enqueue(c, "orders", tenants_of(s0, 1)[0], {"n": "still served"})


async def _stopped(receiver: MinimalClient, task: asyncio.Task[None]) -> None:
    receiver.stop()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(task, 10)


async def _produce(
    router: Router,
    tenants: list[str],
    stop: asyncio.Event,
    sent: dict[str, str],
    errors: list[str],
    committed_at: dict[str, float] | None = None,
) -> None:
    """Enqueue through the router (on a thread: the router is synchronous) until stopped; records
    each committed event's number -> tenant, and any error a producer saw."""
    i = 0
    while not stop.is_set():
        tenant = tenants[i % len(tenants)]
        n = f"live-{i}"
        try:
            await asyncio.to_thread(router.enqueue, "orders", tenant, {"n": n}, None, f"d{i}" if i % 4 == 0 else None)
            sent[n] = tenant
            if committed_at is not None:
                committed_at[n] = time.time()
        except Exception as exc:  # a producer error is a failure of the test, recorded to be asserted on
            errors.append(f"{n}: {exc!r}")
        i += 1
        await asyncio.sleep(0.01)


@pytest.mark.slow
async def test_a_split_while_producers_and_receivers_run_loses_nothing_and_fires_nothing_early(
    shards: Topology, new_database: DatabaseFactory, make_queue: Any, tmp_path: Path
) -> None:
    """Managers of every shard and a receiver on all of them; a router producing all along. The
    split's events all end acked on the target that owns them, none fired before its fire_at; an
    event in flight on the source at the switch is re-fired by the target after its deadline, and
    its old attempt's ack to the source is refused."""
    make_queue("orders", partitions=4, shuffle=2, ack_timeout_seconds=4, backoff_min_seconds=0.1)
    s0 = shards.by_name("s0")
    topo = write_topology(tmp_path / "topology.toml", shards)
    targets = split_targets(new_database)
    tenants = tenants_of(s0, 8) + tenants_of(shards.by_name("s1"), 2)
    await insert(s0.dsn, [(t, {"n": f"sched-{t}"}) for t in tenants[:8]], fire_in=3.0)
    with psycopg.connect(s0.dsn) as c:
        scheduled_at = {
            str(t): float(f)
            for t, f in c.execute(
                "SELECT tenant, extract(epoch FROM fire_at) FROM orders WHERE payload->>'n' LIKE 'sched-%'"
            )
        }
    async with contextlib.AsyncExitStack() as stack:
        m0 = await stack.enter_async_context(leading_manager(s0.dsn))
        m1 = await stack.enter_async_context(leading_manager(shards.by_name("s1").dsn))
        with Reshard(topo) as r:
            await asyncio.to_thread(r.start, targets)
        m2 = await stack.enter_async_context(running_manager(targets[0].dsn))
        m3 = await stack.enter_async_context(running_manager(targets[1].dsn))
        # one event held in flight on s0 by a client that never acks it (its deadline: 4 s)
        held_tenant = tenants_of(targets[1], 1, prefix="held")[0]
        holder = await stack.enter_async_context(raw_client(m0))
        await subscribe(holder, "orders", tenants=(held_tenant,), credit=1)
        [held] = await insert(s0.dsn, [(held_tenant, {"n": "held"})])
        delivered = (await recv_type(holder, "deliver"))["events"][0]
        assert (delivered["id"], delivered["attempt"]) == (held, 1)
        assert m2.role != "leader" and m3.role != "leader"  # pending: standbys until the switch
        # one receiver per shard (all recording into one recorder); the targets' keep retrying (HTTP
        # 503 from a standby) until their managers take over at the switch
        recorder = Recorder()
        for m in (m0, m1, m2, m3):
            receiver = MinimalClient(url(m), SECRET_ALL, "orders", recorder, reconnect_delay=0.05)
            task = asyncio.create_task(receiver.run())
            stack.push_async_callback(_stopped, receiver, task)
        router = Router.from_file(topo)
        stack.callback(router.close)
        stop, sent, errors, committed_at = asyncio.Event(), {}, [], {}
        producer = asyncio.create_task(_produce(router, tenants, stop, sent, errors, committed_at))
        await asyncio.sleep(1.0)
        switch_started = time.time()
        with Reshard(topo) as r:
            await asyncio.to_thread(r.switch)
        switched = time.time()
        assert (await states(s0.dsn))[held] == ("fired", 1)  # in flight at the switch
        await asyncio.sleep(1.0)
        stop.set()
        await producer
        await wait_leader(m2)
        await wait_leader(m3)
        assert m0.role != "leader"
        # the old attempt's ack, sent to the source's manager, is refused: the deposed manager closed
        # the socket that delivered it (4001), and one opened to it now gets "stale"
        with contextlib.suppress(ConnectionClosed):
            await holder.send(f.Ack(((held, 1),), ref=1).to_json())
            await recv_type(holder, "ack_result")
        assert holder.close_code == 4001
        with pytest.raises(InvalidStatus, match="503"):  # a standby takes no connection
            async with raw_client(m0):
                pass
        # and by SQL the source refuses it as moved: the event stays fired there, never acked twice
        assert (await states(s0.dsn))[held] == ("fired", 1)
        with psycopg.connect(s0.dsn) as c, pytest.raises(psycopg.Error, match="does not serve"):
            c.execute(ACK_BY_SQL, (held, 1))

        def settled() -> bool:
            states_ = {**events(targets[0].dsn), **events(targets[1].dsn), **events(shards.by_name("s1").dsn)}
            return all(states_.get(n, (None,) * 4)[3] == "acked" for n in [*sent, "held"])

        try:
            await wait_for(settled, 30, "every event acked on the shard that owns it")
        except AssertionError:
            states_ = {**events(targets[0].dsn), **events(targets[1].dsn), **events(shards.by_name("s1").dsn)}
            missing = {
                n: states_.get(n, (None,) * 6)[:6] for n in [*sent, "held"] if states_.get(n, (None,) * 4)[3] != "acked"
            }
            raise AssertionError(f"not acked: {missing}; errors {errors}") from None
    assert errors == []
    # the producer wrote the moved range before, during and after the switch
    moved = [n for n, t in sent.items() if s0.key_range.contains(t)]
    assert any(committed_at[n] < switch_started for n in moved)
    assert any(committed_at[n] > switched for n in moved)
    everything = {**events(targets[0].dsn), **events(targets[1].dsn), **events(shards.by_name("s1").dsn)}
    # nothing lost: every committed event is on the shard that owns it now
    after = Topology.load(topo)
    for n, tenant in sent.items():
        assert n in events(after.shard_for(tenant).dsn), n
    # nothing early: the scheduled events were first delivered at or after their fire_at
    firsts: dict[str, float] = {}
    for ev, at in zip(recorder.events, recorder.received_at, strict=True):
        firsts.setdefault(str(ev.payload["n"]), at)
    for t, fire_at in scheduled_at.items():
        assert firsts[f"sched-{t}"] >= fire_at - 0.01, (t, firsts[f"sched-{t}"], fire_at)
    # acked stays acked: each event's last delivery is the attempt it was acked at, delivered once
    attempts: dict[str, list[int]] = defaultdict(list)
    for ev in recorder.events:
        attempts[str(ev.payload["n"])].append(ev.attempt)
    for n, delivered in attempts.items():
        final = everything[n][4]
        assert max(delivered) == final and delivered.count(final) == 1, (n, delivered, everything[n])
    # the held event was re-fired by the target (attempt 2 there) and acked
    assert everything["held"][3:5] == ("acked", 2)


async def test_a_manager_writes_its_limit_slices_to_the_shards_of_the_rewritten_topology(
    shards: Topology, new_database: DatabaseFactory, make_queue: Any, tmp_path: Path
) -> None:
    """The limits across shards follow the topology file: after a switch rewrites it, an unchanged
    shard's manager writes its slices into the new shards' databases, without a restart."""
    make_queue("orders", max_qps=100)
    s0, s1 = shards.shards
    topo = write_topology(tmp_path / "topology.toml", shards)
    s9 = Shard("s9", new_database(), KeyRange.parse("80-"))
    replaced = Topology((s0, s9))
    set_identity(s9.dsn, s9, replaced)

    def slices_in(dsn: str) -> set[str]:
        with psycopg.connect(dsn) as c:
            return {str(r[0]) for r in c.execute("SELECT shard FROM qm.rate_leases WHERE NOT resigned")}

    async with leading_manager(s0.dsn, topology=shards, topology_file=topo, shard="s0"):
        await wait_for(lambda: "s0" in slices_in(s1.dsn), 10, "s0's slices in s1's database")
        assert "s0" not in slices_in(s9.dsn)
        write_topology(topo, replaced)
        await wait_for(lambda: "s0" in slices_in(s9.dsn), 10, "s0's slices in s9's database")


def test_qm_manager_of_a_target_waits_as_a_standby_then_leads_after_the_switch(
    shards: Topology, new_database: DatabaseFactory, make_queue: Any, tmp_path: Path
) -> None:
    """``qm manager --shard s2`` with the live topology file, which does not name s2 before the
    switch: it starts from the reshard recorded next to the file, stays a standby while s2 is
    pending, and leads once the switch made s2 serve (no restart)."""
    make_queue("orders")
    topo, tokens = write_config(tmp_path, shards)
    targets = split_targets(new_database)
    with Reshard(topo) as r:
        r.start(targets)
    proc = ManagerProcess(topo, tokens, "s2", 2.0)
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            assert proc.health()[1].get("role") != "leader"
            time.sleep(0.2)
        with Reshard(topo) as r:
            r.switch()
        deadline = time.monotonic() + 15
        while proc.health()[1].get("role") != "leader":
            assert time.monotonic() < deadline, proc.health()
            time.sleep(0.1)
    finally:
        proc.stop()
