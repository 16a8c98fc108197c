"""The dispatcher on a slow or lossy link to its database: what a round trip costs it (docs/faults.md,
"db-link-slow and db-link-lossy: the round trips of a fire").

The link is the fault suite's proxy delaying every chunk by a fixed time each way (no jitter), so
that a round trip costs at least twice that delay whatever the machine's load: a call that takes
less than two round trips' worth cannot have made two."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg
import pytest

from queue_manager.domain.topology import Shard
from queue_manager.manager import store
from tests.conftest import tenants_of
from tests.faultkit import TcpProxy
from tests.managerkit import insert, leading_manager, running_receiver, url, wait_for

#: each way, per chunk: a round trip costs at least 2 x DELAY
DELAY = 0.3


async def test_a_rescan_carries_the_fire_of_due_events_in_one_round_trip_and_one_transaction(
    shard: Shard, make_queue: Any
) -> None:
    """``store.scan(fire_first=...)``: the fire and the scan in one round trip; the fire is
    committed when it returns, the scan (after it) no longer returns the fired events, and a
    fenced fire changes nothing."""
    make_queue("orders", partitions=2, shuffle=1)
    tenants = tenants_of(shard, 2)
    with psycopg.connect(shard.dsn, autocommit=True) as c:
        cur = c.execute(
            "INSERT INTO orders (tenant, payload, fire_at) SELECT (%s::text[])[1 + g %% 2], '{}', "
            "now() - interval '1 s' + g * interval '1 ms' FROM generate_series(0, 3) g RETURNING id",
            (tenants,),
        )
        due = sorted(r[0] for r in cur.fetchall())
        (later,) = c.execute(
            "INSERT INTO orders (tenant, payload, fire_at) VALUES (%s, '{}', now() + interval '10 s') RETURNING id",
            (tenants[0],),
        ).fetchone() or (None,)
    proxy = TcpProxy.for_dsn(shard.dsn)
    await proxy.start()
    try:
        async with await store.connect(proxy.proxied(shard.dsn), "test") as conn:
            term = await store.acquire(conn, "test-holder", 30.0)
            assert term is not None
            settings = {q.name: q for q in await store.load_queues(conn)}["orders"]
            # a fenced fire (a term that is not current): the pipeline fails, nothing is fired
            with pytest.raises(psycopg.Error) as fenced:
                await store.scan(conn, settings, fire_first=(term + 1, due[:2]))
            assert store.is_fenced(fenced.value)
            proxy.slow(DELAY, 0)
            started = time.monotonic()
            rows, _, clock, fired = await store.scan(conn, settings, fire_first=(term, due[:2]))
            took = time.monotonic() - started
            proxy.slow(0, 0)
    finally:
        await proxy.close()
    assert took < 4 * DELAY, f"{took:.2f} s: more than one round trip ({2 * DELAY} s each)"
    assert sorted(r[0] for r in fired) == due[:2]
    assert {r[0] for r in rows} == {*due[2:], later}
    assert clock is not None
    with psycopg.connect(shard.dsn) as c:
        states = dict(c.execute("SELECT id, state::text FROM orders").fetchall())
    assert [states[i] for i in due] == ["fired", "fired", "to_be_fired", "to_be_fired"]


async def test_on_a_slow_link_the_rescans_after_notices_carry_the_fires_of_a_filtered_queue(
    shard: Shard, make_queue: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A subscriber that filters tenants sends every due event through the window cache: a notice,
    a rescan, a fire. With notices coming faster than a round trip, a rescan carries the fire of
    what the rescan before it found due (``store.scan``'s ``fire_first``): one round trip for both.
    Every event is delivered, none twice."""
    make_queue("orders", partitions=2, shuffle=1)
    tenants = tenants_of(shard, 2)
    carried: list[int] = []
    real = store.scan

    async def scan(conn, q, future_only=False, parts=None, floors=None, **kw):  # type: ignore[no-untyped-def]
        out = await real(conn, q, future_only, parts, floors, **kw)
        carried.extend(r[0] for r in out[3])
        return out

    monkeypatch.setattr(store, "scan", scan)
    proxy = TcpProxy.for_dsn(shard.dsn)
    await proxy.start()
    try:
        async with leading_manager(proxy.proxied(shard.dsn)) as m:
            async with running_receiver(url(m), tenants=[tenants[0]]) as (_, rec):
                proxy.slow(DELAY / 3, 0)
                ids: list[int] = []
                # one transaction each, a notice each, faster than a round trip, until a rescan
                # carried a fire (the moment depends on when the notices reach the manager)
                for i in range(200):
                    ids += await insert(shard.dsn, [(tenants[0], {"i": i})])
                    await asyncio.sleep(DELAY / 6)
                    if set(carried) & set(ids) and i >= 20:
                        break
                await wait_for(lambda: set(ids) <= set(rec.ids()), timeout=30, what="every event")
                proxy.slow(0, 0)
    finally:
        await proxy.close()
    assert set(carried) & set(ids), "no fire went in a rescan's round trip"
    assert sorted(i for i in rec.ids() if i in ids) == sorted(ids)


async def test_the_periodic_reload_reads_on_a_connection_of_its_own(
    shard: Shard, make_queue: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The settings reload every ``rescan_interval`` runs on the session's settings connection,
    never on the dispatcher's (where, on a slow link, each reload held up the fires behind it), and
    what it reads is applied: a change made without a notice is seen at the next reload."""
    make_queue("orders", partitions=2, shuffle=1)
    names: list[str] = []
    real = store.load_settings

    async def recording(conn: store.AsyncConn) -> Any:
        names.append(conn.info.get_parameters().get("application_name", "").split(" ")[0])
        return await real(conn)

    monkeypatch.setattr(store, "load_settings", recording)
    async with leading_manager(shard.dsn, rescan_interval=0.2) as m:
        q = m.queues["orders"]
        with psycopg.connect(shard.dsn, autocommit=True) as c:
            # no notice: the queue's settings trigger is bypassed for this one update
            c.execute("SET session_replication_role = replica")
            c.execute("UPDATE qm.queues SET ack_timeout_seconds = 7 WHERE name = 'orders'")
        await wait_for(
            lambda: q.settings.ack_timeout_seconds == 7 and len(names) >= 3, what="a reload that reads the change"
        )
    assert set(names) == {"qm-manager-settings"}


async def test_a_session_started_again_under_its_term_releases_the_fires_whose_answer_was_lost(
    shard: Shard, make_queue: Any
) -> None:
    """A link reset that fails the session after a fire committed and before its answer came back
    leaves the event fired and held by nobody. The session that starts again under the same term
    releases it at once (it used to wait for its ack deadline: 30 s here, 2 s in the fault suite's
    ``db-link-lossy``, its worst stalls); events its receivers hold stay where they are."""
    make_queue("orders", partitions=2, shuffle=1, ack_timeout_seconds=30)
    tenant = tenants_of(shard, 1)[0]
    async with leading_manager(shard.dsn) as m:
        async with running_receiver(url(m), mode="hold") as (_, rec):
            (held,) = await insert(shard.dsn, [(tenant, {"held": True})])
            await wait_for(lambda: held in rec.ids(), what="the event the receiver holds")
            (lost,) = await insert(shard.dsn, [(tenant, {"lost": True})], fire_in=3600)
            # as the dispatcher's fire would have it (a manager's session), its answer never read
            with psycopg.connect(shard.dsn, autocommit=True, options="-c qm.role=manager") as c:
                (term,) = c.execute("SELECT term FROM qm.leader").fetchone() or (None,)
                c.execute(
                    "UPDATE orders SET state = 'fired', attempts = attempts + 1, fire_at = now(), fired_at = now(), "
                    "ack_deadline = now() + interval '30 s', fired_term = %s WHERE id = %s",
                    (term, lost),
                )
                # the link resets under the dispatcher: its session fails, the next one starts
                c.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND application_name LIKE 'qm-manager-work%%'"
                )
            await wait_for(lambda: lost in rec.ids(), timeout=10, what="the fire whose answer was lost, again")
            with psycopg.connect(shard.dsn) as c:
                assert c.execute("SELECT term FROM qm.leader").fetchone() == (term,)
                rows = dict(c.execute("SELECT id, attempts FROM orders").fetchall())
    assert rows == {held: 1, lost: 2}
    assert rec.ids().count(held) == 1


#: the round trips one after the other from a failed session to the fire of an event due at once
#: (13 before): the lease's renewal, a new connection's two (SSL request, start-up), the LISTEN, the
#: settings with the events in flight (every queue's, beside them on the dispatcher's connection),
#: the dispatcher's wake-up lock reading, rescan and fire
RESTART_ROUND_TRIPS = 8


def waves(sends: list[tuple[float, int, bytes]], gap: float) -> list[list[tuple[float, int, bytes]]]:
    """The chunks the clients sent, in groups sent together: a chunk more than ``gap`` after the
    one before it starts a group (on a link delaying every chunk by ``gap`` each way, a chunk that
    waited for an answer comes at least 2 x ``gap`` after the request it answered)."""
    out: list[list[tuple[float, int, bytes]]] = []
    for send in sends:
        if not out or send[0] - out[-1][-1][0] > gap:
            out.append([])
        out[-1].append(send)
    return out


async def test_a_session_restart_costs_a_counted_number_of_round_trips_in_sequence(
    shard: Shard, make_queue: Any
) -> None:
    """From a session's failure (its dispatcher's connection terminated) to the fire of an event
    due at once, on a link that delays every chunk: the round trips one after the other are counted
    from what the manager sends, in groups (``waves``), not timed. A restart used to take 13 (two
    renewals, the reads of a session's start one after the other, and each of the dispatcher's
    first statements prepared in a round trip of its own); every one of them is a wait of a restart
    on a lossy link (docs/faults.md, "A cheaper restart")."""
    make_queue("orders", partitions=2, shuffle=1)
    tenant = tenants_of(shard, 1)[0]
    delay = 0.1
    proxy = TcpProxy.for_dsn(shard.dsn)
    await proxy.start()
    # nothing periodic on the link while it is counted (renewals, rescans, maintenance)
    quiet = {
        "lease_ttl": 30.0,
        "rescan_interval": 30.0,
        "sweep_interval": 30.0,
        "purge_interval": 30.0,
        "reconcile_interval": 30.0,
    }
    try:
        async with leading_manager(proxy.proxied(shard.dsn), **quiet) as m:
            async with running_receiver(url(m)) as (_, rec):
                (first,) = await insert(shard.dsn, [(tenant, {})])
                await wait_for(lambda: first in rec.ids(), what="the first event")
                proxy.slow(delay, 0)
                proxy.sends = []
                with psycopg.connect(shard.dsn, autocommit=True) as c:
                    c.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND application_name LIKE 'qm-manager-work%%'"
                    )
                (due,) = await insert(shard.dsn, [(tenant, {})])
                await wait_for(lambda: due in rec.ids(), timeout=30, what="the event due, after the restart")
                sends = list(proxy.sends)
                proxy.slow(0, 0)
    finally:
        await proxy.close()
    # from the restart's first statement (the lease's renewal) to the fire: what comes after the
    # fire is not waited for
    start = next(i for i, s in enumerate(sends) if b"renew_leadership" in s[2])
    fire = next(i for i, s in enumerate(sends) if i > start and (b"-- Fire" in s[2] or b"-- Mark due" in s[2]))
    groups = waves(sends[start : fire + 1], delay)
    shown = "\n".join(f"{g[0][0] - sends[start][0]:.2f} s: {[s[2][:40] for s in g]}" for g in groups)
    assert len(groups) <= RESTART_ROUND_TRIPS, f"{len(groups)} round trips in sequence:\n{shown}"
    # and the count is of what it claims: a session's start is among them
    assert any(b"LISTEN" in s[2] for s in sends[start:fire])
