"""The receiver library (receivers.Receiver, receivers.sql, qm receive) against real managers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import psycopg
import pytest

from queue_manager.domain.topology import KeyRange, Shard, Topology
from queue_manager.local import fleet
from receivers import (
    Backoff,
    Event,
    EventNotFiredError,
    Receiver,
    ReceiverError,
    Retry,
    ack_in_transaction,
    ack_in_transaction_async,
)
from tests.conftest import tenants_of
from tests.managerkit import (
    SECRET_ALL,
    SECRET_OTHER,
    Recorder,
    insert,
    leading_manager,
    rescanned,
    url,
    wait_for,
)
from tests.processkit import ManagerProcess, lease, write_config

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


def fast_backoff() -> Backoff:
    return Backoff(initial=0.05, maximum=0.5)


@contextlib.asynccontextmanager
async def receiving(urls: Any, handler: Any, queue: str = "orders", **kwargs: Any) -> AsyncIterator[Receiver]:
    """A Receiver running in this loop; stopped (drained) on exit."""
    kwargs.setdefault("token", SECRET_ALL)
    kwargs.setdefault("backoff", fast_backoff)
    kwargs.setdefault("drain_timeout", 5.0)
    receiver = Receiver(urls, queue, handler, **kwargs)
    task = asyncio.create_task(receiver.run())
    try:
        await receiver.wait_subscribed(10)
        yield receiver
    finally:
        receiver.stop()
        async with asyncio.timeout(15):
            await task


async def rows(dsn: str, queue: str = "orders") -> dict[int, tuple[str, int, str | None]]:
    """id -> (state, attempts, last_error)."""
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cur = await conn.execute(f"SELECT id, state::text, attempts, last_error FROM {queue}")
        return {int(r[0]): (str(r[1]), int(r[2]), r[3]) for r in await cur.fetchall()}


async def test_a_receiver_acks_what_its_handler_returns(shard: Shard, make_queue) -> None:  # type: ignore[no-untyped-def]
    make_queue("orders", partitions=4, shuffle=2)
    tenants = tenants_of(shard, 4)
    seen: list[Event] = []

    async def handle(event: Event) -> None:
        seen.append(event)

    async with leading_manager(shard.dsn) as m:
        async with receiving({"s0": [url(m)]}, handle, concurrency=3) as r:
            ids = await insert(shard.dsn, [(tenants[i % 4], {"i": i}) for i in range(20)])
            await wait_for(lambda: r.stats.acked == 20, what="20 acks")
            assert sorted(e.id for e in seen) == sorted(ids)
            assert all(e.shard == "s0" and e.attempt == 1 for e in seen)
        assert {v[:2] for v in (await rows(shard.dsn)).values()} == {("acked", 1)}


async def test_credit_follows_free_handler_slots(shard: Shard, make_queue) -> None:  # type: ignore[no-untyped-def]
    """With 3 slots and 10 due events, 3 handlers run and the manager holds back the rest: no
    event is delivered for a busy slot; when one handler returns, exactly one more arrives."""
    make_queue("orders", partitions=4, shuffle=2)
    tenants = tenants_of(shard, 4)
    release: dict[int, asyncio.Event] = {}
    started: list[int] = []
    free_run = False

    async def handle(event: Event) -> None:
        started.append(event.id)
        release[event.id] = asyncio.Event()
        if not free_run:
            await release[event.id].wait()

    async def fired() -> int:
        async with await psycopg.AsyncConnection.connect(shard.dsn) as conn:
            cur = await conn.execute("SELECT count(*) FROM orders WHERE state = 'fired'")
            return int((await cur.fetchone())[0])  # type: ignore[index]

    async with leading_manager(shard.dsn) as m:
        async with receiving(url(m), handle, concurrency=3) as r:
            await insert(shard.dsn, [(tenants[i % 4], {"i": i}) for i in range(10)])
            await wait_for(lambda: len(started) == 3, what="3 handlers running")
            await rescanned(m)  # whatever was due, the dispatcher has seen it
            assert await fired() == 3 and r.stats.delivered == 3 and r.credit("default") == 3
            release[started[0]].set()
            await wait_for(lambda: r.stats.acked == 1, what="the first ack")
            await wait_for(lambda: len(started) == 4, what="a fourth delivery")
            await wait_for(lambda: r.credit("default") == 3, what="the credit back to 3")
            await rescanned(m)
            assert await fired() == 3 and r.stats.delivered == 4 and r.in_hand("default") == 3
            free_run = True
            for ev in release.values():
                ev.set()
            await wait_for(lambda: r.stats.acked == 10, what="10 acks")
            assert r.stats.delivered == 10


async def test_a_failing_handler_is_nacked_retried_then_dead_lettered(shard: Shard, make_queue) -> None:  # type: ignore[no-untyped-def]
    make_queue("orders", partitions=2, shuffle=1, max_attempts=3, backoff_min_seconds=0.05, backoff_max_seconds=0.1)
    [tenant] = tenants_of(shard, 1)
    attempts: list[int] = []

    def handle(event: Event) -> None:  # a plain function: run in the thread pool
        attempts.append(event.attempt)
        raise ValueError(f"cannot handle {event.payload['n']}")

    async with leading_manager(shard.dsn) as m:
        async with receiving(url(m), handle, concurrency=2) as r:
            [ident] = await insert(shard.dsn, [(tenant, {"n": 7})])
            await wait_for(lambda: r.stats.dead_lettered == 1, what="the dead letter")
            assert attempts == [1, 2, 3] and r.stats.nacked == 2
        state, tries, error = (await rows(shard.dsn))[ident]
        assert (state, tries, error) == ("failed", 3, "ValueError: cannot handle 7")


async def test_retry_asks_for_a_delay(shard: Shard, make_queue) -> None:  # type: ignore[no-untyped-def]
    """Retry(delay=...) sets when the event is due again, whatever the queue's back-off (60 s here)."""
    make_queue("orders", partitions=2, shuffle=1, backoff_min_seconds=60, backoff_max_seconds=60)
    [tenant] = tenants_of(shard, 1)
    seen: list[tuple[int, float]] = []

    async def handle(event: Event) -> None:
        seen.append((event.attempt, event.fire_at))
        if event.attempt == 1:
            raise Retry("not yet", delay=0.3)

    async with leading_manager(shard.dsn) as m:
        async with receiving(url(m), handle) as r:
            [ident] = await insert(shard.dsn, [(tenant, {})])
            await wait_for(lambda: r.stats.acked == 1, what="the second attempt acked")
        assert [a for a, _ in seen] == [1, 2]
        assert 0.25 <= seen[1][1] - seen[0][1] < 5  # due again 0.3 s after the nack, not 60 s
        assert (await rows(shard.dsn))[ident] == ("acked", 2, "not yet")


async def test_a_long_handler_gets_its_lease_extended_and_is_not_fired_again(shard: Shard, make_queue) -> None:  # type: ignore[no-untyped-def]
    """ack_timeout 1 s; the handler runs until the original deadline has passed and the collector
    has swept after it; it is extended, acked at attempt 1, never re-fired."""
    make_queue("orders", partitions=2, shuffle=1, ack_timeout_seconds=1, backoff_min_seconds=0.05)
    [tenant] = tenants_of(shard, 1)
    done = asyncio.Event()
    calls: list[int] = []

    async def handle(event: Event) -> None:
        calls.append(event.attempt)
        await done.wait()

    async with leading_manager(shard.dsn) as m:
        async with receiving(url(m), handle, extend_after=0.2, extend_by=2.0) as r:
            [ident] = await insert(shard.dsn, [(tenant, {})])
            await wait_for(lambda: r.stats.extended >= 1, what="a lease extension")
            async with await psycopg.AsyncConnection.connect(shard.dsn, autocommit=True) as conn:
                cur = await conn.execute(
                    "SELECT extract(epoch FROM fired_at + interval '1 second' - now()) FROM orders WHERE id = %s",
                    (ident,),
                )
                left = float((await cur.fetchone())[0])  # type: ignore[index]
                # past the original deadline, then a whole collector run
                await asyncio.sleep(max(0.0, left) + 0.1)
                m.signals.swept.clear()
                await m.signals.swept.wait()
                await m.signals.swept.wait()
                cur = await conn.execute("SELECT state::text, attempts FROM orders WHERE id = %s", (ident,))
                assert await cur.fetchone() == ("fired", 1)
            assert r.stats.extended >= 2  # renewed every extend_by / 2
            done.set()
            await wait_for(lambda: r.stats.acked == 1, what="the ack")
        assert calls == [1]
        assert (await rows(shard.dsn))[ident][:2] == ("acked", 1)


@pytest.mark.parametrize("kind", ["async", "thread"])
async def test_a_handler_timeout_nacks(shard: Shard, make_queue, kind: str) -> None:  # type: ignore[no-untyped-def]
    make_queue("orders", partitions=2, shuffle=1, backoff_min_seconds=0.05, backoff_max_seconds=0.1)
    [tenant] = tenants_of(shard, 1)
    calls: list[int] = []
    unblock = asyncio.Event()
    import threading

    thread_unblock = threading.Event()

    async def handle_async(event: Event) -> None:
        calls.append(event.attempt)
        if event.attempt == 1:
            await unblock.wait()

    def handle_thread(event: Event) -> None:
        calls.append(event.attempt)
        if event.attempt == 1:
            thread_unblock.wait(10)

    handler = handle_async if kind == "async" else handle_thread
    async with leading_manager(shard.dsn) as m:
        async with receiving(url(m), handler, handler_timeout=0.3, concurrency=2) as r:
            [ident] = await insert(shard.dsn, [(tenant, {})])
            await wait_for(lambda: r.stats.acked == 1, what="the second attempt acked")
            assert r.stats.timeouts == 1 and r.stats.nacked == 1 and calls == [1, 2]
            thread_unblock.set()
        assert (await rows(shard.dsn))[ident] == ("acked", 2, "handler timed out after 0.3 s")


async def _loads_and_live(dsn: str, queue: str = "orders") -> tuple[list[int], list[int]]:
    """(the producers' load per partition, the live events per partition)."""
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cur = await conn.execute("SELECT qm.partition_loads(%s)", (queue,))
        loads = list((await cur.fetchone())[0])  # type: ignore[index]
        cur = await conn.execute(
            f"SELECT p, count(o.id) FROM generate_series(0, %s - 1) AS p "
            f"LEFT JOIN {queue} o ON o.partition = p AND o.state IN ('to_be_fired', 'fired') GROUP BY p ORDER BY p",
            (len(loads),),
        )
        return loads, [int(n) for _, n in await cur.fetchall()]


async def test_ack_in_transaction_commits_the_effects_and_the_ack_together(shard: Shard, make_queue) -> None:  # type: ignore[no-untyped-def]
    """A threaded handler writes its effect and acks in one transaction: no ack frame is sent, the
    manager frees the slots (nothing in flight), the load counters equal the live events with no
    reconciliation, and no event fires again after its ack deadline."""
    make_queue("orders", partitions=4, shuffle=2, ack_timeout_seconds=1, backoff_min_seconds=0.05)
    tenants = tenants_of(shard, 8)
    with psycopg.connect(shard.dsn, autocommit=True) as c:
        c.execute("CREATE TABLE effects (event_id bigint PRIMARY KEY, attempt int NOT NULL)")

    def handle(event: Event) -> None:
        with psycopg.connect(shard.dsn) as conn:  # one transaction, committed at the end of the block
            conn.execute("INSERT INTO effects VALUES (%s, %s)", (event.id, event.attempt))
            ack_in_transaction(conn, "orders", event)

    async with leading_manager(shard.dsn, reconcile_interval=3600.0, idle_slices=False) as m:
        async with receiving(url(m), handle, concurrency=3) as r:
            later = await insert(shard.dsn, [(t, {"later": True}) for t in tenants[:5]], fire_in=3600)
            ids = await insert(shard.dsn, [(tenants[i % 8], {"i": i}) for i in range(30)])
            await wait_for(lambda: r.stats.settled_by_sql == 30, what="30 acks by SQL")
            await wait_for(lambda: m.metrics.settled_by_sql.total() >= 30, what="the manager told of them")
            await wait_for(lambda: m.health()["queues"]["orders"]["in_flight"] == 0, what="every slot freed")
            assert r.stats.acked == 0 and r.stats.nacked == 0  # no ack frame was sent
            loads, live = await _loads_and_live(shard.dsn)
            assert loads == live and sum(live) == len(later)
            # past every ack deadline, and two whole collector runs: nothing fires again
            m.signals.swept.clear()
            await asyncio.sleep(1.2)
            await m.signals.swept.wait()
            await m.signals.swept.wait()
            assert r.stats.delivered == 30
        with psycopg.connect(shard.dsn) as c:
            assert c.execute("SELECT count(*), max(attempt) FROM effects").fetchone() == (30, 1)
        states = await rows(shard.dsn)
        assert {states[i][:2] for i in ids} == {("acked", 1)}
        assert await _loads_and_live(shard.dsn) == (loads, live)


async def test_a_rolled_back_ack_in_transaction_gets_the_event_back(shard: Shard, make_queue) -> None:  # type: ignore[no-untyped-def]
    """Event A: the handler acks in its transaction, then raises: the transaction rolls back, the
    receiver nacks, A is delivered again and committed at attempt 2. Event B: the transaction
    rolls back but the handler returns: B fires again after its ack deadline. Each effect is
    committed once."""
    make_queue(
        "orders", partitions=2, shuffle=1, ack_timeout_seconds=1, backoff_min_seconds=0.05, backoff_max_seconds=0.1
    )
    [tenant] = tenants_of(shard, 1)
    async with await psycopg.AsyncConnection.connect(shard.dsn, autocommit=True) as c:
        await c.execute("CREATE TABLE effects (event_id bigint PRIMARY KEY, attempt int NOT NULL)")

    async def handle(event: Event) -> None:
        async with await psycopg.AsyncConnection.connect(shard.dsn, autocommit=True) as conn:
            try:
                async with conn.transaction():
                    await conn.execute("INSERT INTO effects VALUES (%s, %s)", (event.id, event.attempt))
                    await ack_in_transaction_async(conn, "orders", event)
                    if event.attempt == 1:
                        raise RuntimeError(f"boom {event.payload['name']}")
            except RuntimeError:
                if event.payload["name"] == "A":
                    raise

    async with leading_manager(shard.dsn, reconcile_interval=3600.0, idle_slices=False) as m:
        async with receiving(url(m), handle) as r:
            a, b = await insert(shard.dsn, [(tenant, {"name": "A"}), (tenant, {"name": "B"})])
            # A: attempt 1 nacked, attempt 2 settled; B: both attempts "settled" (the first rolled back)
            await wait_for(lambda: r.stats.settled_by_sql == 3, what="two attempts of each handled")
            assert r.stats.nacked == 1 and r.stats.acked == 0
            await wait_for(lambda: m.health()["queues"]["orders"]["in_flight"] == 0, what="every slot freed")
            assert await _loads_and_live(shard.dsn) == ([0, 0], [0, 0])
        states = await rows(shard.dsn)
        assert states[a] == ("acked", 2, "RuntimeError: boom A")
        assert states[b] == ("acked", 2, "no ack before the deadline (attempt 1)")
        async with await psycopg.AsyncConnection.connect(shard.dsn) as c:
            cur = await c.execute("SELECT event_id, attempt FROM effects ORDER BY event_id")
            assert await cur.fetchall() == [(a, 2), (b, 2)]


async def test_ack_in_transaction_refuses_a_delivery_that_is_not_fired(shard: Shard, make_queue) -> None:  # type: ignore[no-untyped-def]
    make_queue("orders", partitions=2, shuffle=1)
    [tenant] = tenants_of(shard, 1)
    [ident] = await insert(shard.dsn, [(tenant, {})])
    event = Event("orders", "s0", ident, 1, tenant, 0, 0.0, {})
    with psycopg.connect(shard.dsn) as conn:
        with pytest.raises(EventNotFiredError, match=r"it is to_be_fired at attempt 0") as exc:
            ack_in_transaction(conn, "orders", event)
        assert exc.value.state == "to_be_fired" and not event.settled_by_sql
        conn.rollback()
        with pytest.raises(EventNotFiredError, match="no such event"):
            ack_in_transaction(conn, "orders", Event("orders", "s0", ident + 1000, 1, tenant, 0, 0.0, {}))
    with psycopg.connect(shard.dsn, autocommit=True) as conn, pytest.raises(ValueError, match="autocommit"):
        ack_in_transaction(conn, "orders", event)


# ---------------------------------------------------------------- qm receive, as a process


def _qm_receive(*args: str, env: dict[str, str] | None = None, **popen: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        fleet.qm("receive", *args),
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        text=True,
        **popen,
    )


@contextlib.contextmanager
def _qm_receive_logged(log: Path, handlers: Path, *args: str) -> Iterator[subprocess.Popen[str]]:
    """``qm receive`` with its stderr in ``log`` and ``tests.receiver_handlers``' directory
    ``handlers``; killed at the exit if it still runs."""
    with log.open("w") as log_file:
        proc = _qm_receive(
            *args, env={"QM_TEST_HANDLER_DIR": str(handlers)}, stdout=subprocess.DEVNULL, stderr=log_file
        )
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module_xyz:handle", "handler 'no_such_module_xyz:handle': no module named 'no_such_module_xyz'"),
        ("tests.receiver_handlers:nothing", "module 'tests.receiver_handlers' has no attribute 'nothing'"),
        ("tests.receiver_handlers:NOT_A_FUNCTION", "'NOT_A_FUNCTION' is a int, not a function"),
        (
            "tests.receiver_handlers_broken:handle",
            "importing module 'tests.receiver_handlers_broken' failed: RuntimeError: this module cannot be imported",
        ),
        ("tests.receiver_handlers", "name it as module:function"),
    ],
)
def test_qm_receive_says_why_a_handler_cannot_be_imported(spec: str, message: str) -> None:
    proc = _qm_receive("--queue", "orders", "--manager", "s0=ws://127.0.0.1:9/", spec, stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert err.startswith("qm: error: ") and message in err, err
    assert "Traceback" not in err


async def test_sigterm_drains_qm_receive_without_losing_or_duplicating_acks(  # type: ignore[no-untyped-def]
    shard: Shard, make_queue, tmp_path: Path
) -> None:
    """``qm receive --concurrency 3`` holds 3 of 5 events in blocked handlers; SIGTERM: it grants
    no more credit, the 3 handlers finish, are acked (attempt 1, once each), the process exits 0,
    and the 2 others were never delivered."""
    make_queue("orders", partitions=2, shuffle=1)
    tenants = tenants_of(shard, 5)
    log = tmp_path / "receiver.log"
    async with leading_manager(shard.dsn) as m:
        ids = await insert(shard.dsn, [(t, {}) for t in tenants])
        with _qm_receive_logged(
            log, tmp_path,
            "--queue", "orders", "--manager", f"s0={url(m)}", "--token", SECRET_ALL, "--concurrency", "3",
            "--log-level", "INFO", "tests.receiver_handlers:blocking",
        ) as proc:  # fmt: skip
            started = tmp_path / "started"
            await wait_for(lambda: started.exists() and len(list(started.iterdir())) == 3, 20, "3 handlers")
            proc.send_signal(signal.SIGTERM)
            await wait_for(lambda: "draining shard s0" in log.read_text(), 10, "the drain to start")
            assert proc.poll() is None
            (tmp_path / "release").touch()
            rc = await asyncio.to_thread(proc.wait, 20)
        assert rc == 0, log.read_text()
        handled = sorted(p.name for p in started.iterdir())
        assert sorted(p.name for p in (tmp_path / "done").iterdir()) == handled
        assert all(name.endswith("-1") for name in handled)
        handled_ids = {int(name.split("-")[0]) for name in handled}
        states = await rows(shard.dsn)
        assert {states[i][:2] for i in handled_ids} == {("acked", 1)}
        assert {states[i][:2] for i in set(ids) - handled_ids} == {("to_be_fired", 0)}
        assert m.metrics.refired.total() == 0  # nothing released, nacked or re-fired
        assert m.health()["queues"]["orders"]["in_flight"] == 0
        assert "receiver stopped: 3 delivered, 3 acked" in log.read_text()


async def test_qm_receive_finds_the_managers_in_the_topology_file(  # type: ignore[no-untyped-def]
    tmp_path: Path, shard: Shard, make_queue
) -> None:
    """``qm receive --topology FILE`` without ``--manager``: the file's ``managers`` are used."""
    make_queue("orders", partitions=2, shuffle=1)
    (tmp_path / "release").touch()
    path = tmp_path / "topology.toml"
    log = tmp_path / "receiver.log"
    async with leading_manager(shard.dsn) as m:
        write_topology(path, replace(shard, key_range=KeyRange.parse("-"), managers=(url(m),)))
        ids = await insert(shard.dsn, [(t, {}) for t in tenants_of(shard, 2)])
        with _qm_receive_logged(
            log, tmp_path, "--queue", "orders", "--topology", str(path), "--token", SECRET_ALL,
            "tests.receiver_handlers:blocking",
        ) as proc:  # fmt: skip
            done = tmp_path / "done"
            await wait_for(lambda: done.exists() and len(list(done.iterdir())) == 2, 20, "2 handled")
            proc.send_signal(signal.SIGTERM)
            rc = await asyncio.to_thread(proc.wait, 20)
        assert rc == 0, log.read_text()
        assert {v[:2] for i, v in (await rows(shard.dsn)).items() if i in ids} == {("acked", 1)}


# ---------------------------------------------------------------- failover


@pytest.fixture
def two_managers(tmp_path: Path, shards: Topology, make_queue: Callable[..., str]) -> Iterator[list[ManagerProcess]]:
    """Two ``qm manager`` processes for shard s0 (lease TTL 2 s): one leads, one stands by. They
    serve the queue ``orders`` (ack timeout 2 s, so that a lost receiver's events come back soon)."""
    make_queue("orders", partitions=2, shuffle=1, ack_timeout_seconds=2, backoff_min_seconds=0.05)
    topo, tokens = write_config(tmp_path, shards)
    procs = [ManagerProcess(topo, tokens, "s0", 2.0) for _ in range(2)]
    yield procs
    for p in procs:
        p.stop()


async def leader_and_standby(
    dsn: str, managers: list[ManagerProcess], timeout: float = 15.0
) -> tuple[ManagerProcess, ManagerProcess]:
    """The manager that holds the lease and says so on /health/leader, and the other one."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        assert asyncio.get_running_loop().time() < deadline, "no manager took the lease"
        _, pid = await lease(dsn)
        leader = next((p for p in managers if p.pid == pid and p.health("/health/leader")[0] == 200), None)
        if leader is not None:
            [standby] = [p for p in managers if p is not leader]
            return leader, standby
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
async def test_a_receiver_follows_a_failover_by_itself(
    shard: Shard, two_managers: list[ManagerProcess], how: str
) -> None:
    """The receiver knows both managers of s0 and finds the leader by /health/leader. The leader is
    stopped (drained by SIGTERM, or killed): the receiver moves to the new leader with no help,
    and events committed before, during and after the failover are all handled and acked."""
    tenants = tenants_of(shard, 4)
    handled = Recorder()
    leader, standby = await leader_and_standby(shard.dsn, two_managers)
    async with receiving({"s0": [p.url for p in two_managers]}, handled, concurrency=4) as r:
        assert r.leader("s0") == leader.url
        before = await insert(shard.dsn, [(tenants[i % 4], {"i": i}) for i in range(10)])
        await wait_for(lambda: r.stats.acked == 10, what="the first 10 acked")
        if how == "sigterm":
            await asyncio.to_thread(leader.stop)
        else:
            os.kill(leader.pid, signal.SIGKILL)
            await asyncio.to_thread(leader.proc.wait, 10)
        during = await insert(shard.dsn, [(tenants[i % 4], {"i": i}) for i in range(10, 20)])
        await wait_for(lambda: r.leader("s0") == standby.url, 20, "the receiver on the new leader")
        after = await insert(shard.dsn, [(tenants[i % 4], {"i": i}) for i in range(20, 30)])
        await wait_for(lambda: r.stats.acked == 30, 20, "all 30 acked")
        assert r.stats.connects == 2
    assert sorted((e.id, e.attempt) for e in handled.events) == sorted((i, 1) for i in before + during + after)
    assert {v[:2] for v in (await rows(shard.dsn)).values()} == {("acked", 1)}


async def test_a_receiver_leaves_a_frozen_leader_once_a_standby_leads(
    shard: Shard, two_managers: list[ManagerProcess]
) -> None:
    """The leader is frozen (SIGSTOP) with its sockets open: it cannot close its receivers, and
    the websocket pings would take tens of seconds. The standby takes the lease once it expires;
    the receiver, whose probe the standby holds until it leads, moves to it at once (it probed
    every second before), and events committed meanwhile are handled (found by the fault suite's
    manager-pause-active scenario, docs/faults.md)."""
    tenants = tenants_of(shard, 4)
    handled = Recorder()
    leader, standby = await leader_and_standby(shard.dsn, two_managers)
    async with receiving({"s0": [p.url for p in two_managers]}, handled, concurrency=4) as r:
        assert r.leader("s0") == leader.url
        os.kill(leader.pid, signal.SIGSTOP)
        try:
            frozen_at = asyncio.get_running_loop().time()
            during = await insert(shard.dsn, [(tenants[i % 4], {"i": i}) for i in range(10)])
            await wait_for(lambda: r.leader("s0") == standby.url, 20, "the receiver on the new leader")
            moved = asyncio.get_running_loop().time() - frozen_at
            moved_at = time.time()
            await wait_for(lambda: set(handled.ids()) >= set(during), 20, "the events committed meanwhile")
            # the lease TTL (2 s) and the standby's poll; then within 0.5 s of the takeover (a margin for load)
            assert moved <= 2.0 + 2.0, f"the receiver left the frozen leader after {moved:.1f} s"
            async with await psycopg.AsyncConnection.connect(shard.dsn) as conn:
                cur = await conn.execute("SELECT extract(epoch FROM acquired_at)::float8 FROM qm.leader")
                acquired_at = (await cur.fetchone())[0]  # type: ignore[index]
            assert moved_at - acquired_at <= 1.5, f"on the new leader {moved_at - acquired_at:.2f} s after it took over"
        finally:
            os.kill(leader.pid, signal.SIGCONT)


@contextlib.asynccontextmanager
async def holding_probes(hold: float) -> AsyncIterator[tuple[str, asyncio.Event]]:
    """A stand-in for a standby manager: it holds every ``/health/leader`` probe for ``hold``
    seconds, then answers 503 (it never leads). Yields its URL and an event set at its first probe."""
    probed = asyncio.Event()
    holding: set[asyncio.Task[None]] = set()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        holding.add(task)  # type: ignore[arg-type]
        try:
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
                await reader.readuntil(b"\r\n\r\n")
                probed.set()
                await asyncio.sleep(hold)
                writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                await writer.drain()
        finally:
            holding.discard(task)  # type: ignore[arg-type]
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        yield f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}/", probed
    finally:
        server.close()
        for task in list(holding):  # probes still held: closed with the stand-in
            task.cancel()
        await asyncio.gather(*holding, return_exceptions=True)
        await server.wait_closed()


async def test_a_restarted_manager_that_leads_is_found_while_another_holds_the_probe(  # type: ignore[no-untyped-def]
    shard: Shard, make_queue
) -> None:
    """The leader of a shard was killed and its process restarts on the same address (a service
    manager's restart) while the other manager of the shard, a standby, holds the receiver's
    probe for 5 s. The restarted manager takes the lease first: the receiver finds it within a
    second, not when the standby's hold ends (found by the fault suite's promotion-and-kill-active
    scenario: 5 to 24 s)."""
    make_queue("orders", partitions=2, shuffle=1)
    port = fleet.free_port()
    handled = Recorder()
    async with holding_probes(5.0) as (standby_url, probed):
        receiver = Receiver(
            {"s0": [f"ws://127.0.0.1:{port}/", standby_url]}, "orders", handled, token=SECRET_ALL, backoff=fast_backoff
        )
        task = asyncio.create_task(receiver.run())
        try:
            await asyncio.wait_for(probed.wait(), 10)
            async with leading_manager(shard.dsn, port=port):
                leading = time.monotonic()
                await receiver.wait_subscribed(10)
                found = time.monotonic() - leading
                assert found < 2.0, f"the receiver found the restarted leader {found:.2f} s after it took over"
                [ident] = await insert(shard.dsn, [(tenants_of(shard, 1)[0], {"n": 1})])
                await wait_for(lambda: ident in handled.ids(), 10, "the event handled")
        finally:
            receiver.stop()
            await asyncio.wait_for(task, 15)


async def test_a_refused_token_or_queue_stops_the_receiver_with_a_clear_error(shard: Shard, make_queue) -> None:  # type: ignore[no-untyped-def]
    make_queue("orders", partitions=2, shuffle=1)

    async def handle(event: Event) -> None: ...

    async with leading_manager(shard.dsn) as m:
        for token, message in [
            ("not-a-known-token-0000", r"refused the token \(HTTP 401\)"),
            (SECRET_OTHER, r"subscribe to 'orders' refused: token 'other' may not read queue 'orders'"),
        ]:
            receiver = Receiver({"s0": [url(m)]}, "orders", handle, token=token, backoff=fast_backoff)
            with pytest.raises(ReceiverError, match=message):
                async with asyncio.timeout(10):
                    await receiver.run()


async def test_one_receiver_takes_every_shard_and_honours_a_tenant_filter(shards: Topology, make_queue) -> None:  # type: ignore[no-untyped-def]
    make_queue("orders", partitions=2, shuffle=1)
    s0, s1 = shards.shards
    seen: list[Event] = []

    async def handle(event: Event) -> None:
        seen.append(event)

    async with leading_manager(s0.dsn) as m0, leading_manager(s1.dsn) as m1:
        urls = {"s0": [url(m0)], "s1": [url(m1)]}
        async with receiving(urls, handle, concurrency=2) as r:
            ids = {s.name: await insert(s.dsn, [(t, {}) for t in tenants_of(s, 3)]) for s in (s0, s1)}
            await wait_for(lambda: r.stats.acked == 6, what="6 acks over two shards")
        assert sorted((e.shard, e.id) for e in seen) == sorted((k, i) for k, v in ids.items() for i in v)
        wanted = [tenants_of(s0, 1)[0], tenants_of(s1, 1)[0]]
        seen.clear()
        async with receiving(urls, handle, tenants=wanted) as r:
            for s in (s0, s1):
                await insert(s.dsn, [(t, {"again": True}) for t in tenants_of(s, 3)])
            await wait_for(lambda: r.stats.acked == 2, what="the two wanted tenants' events")
            await rescanned(m0)
            await rescanned(m1)
        assert sorted(e.tenant for e in seen) == sorted(wanted)


def write_topology(path: Path, *shards: Shard) -> None:
    """Replace the topology file as ``qm reshard`` does: a temporary file renamed over it."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(Topology(shards).to_toml())
    os.replace(tmp, path)


async def test_a_receiver_following_the_topology_file_opens_and_drains_links_as_it_changes(  # type: ignore[no-untyped-def]
    tmp_path: Path, shards: Topology, make_queue
) -> None:
    """A shard added to the file is received from without a restart; a shard removed from it has
    its link drained (the event in hand is acked first) and closed; a file it cannot use changes nothing."""
    make_queue("orders", partitions=2, shuffle=1)
    s0, s1 = shards.shards
    seen: list[Event] = []
    hold = asyncio.Event()

    async def handle(event: Event) -> None:
        seen.append(event)
        if event.payload.get("hold"):
            await hold.wait()

    path = tmp_path / "topology.toml"
    async with leading_manager(s0.dsn) as m0, leading_manager(s1.dsn) as m1:
        whole = KeyRange.parse("-")
        write_topology(path, replace(s0, key_range=whole, managers=(url(m0),)))
        async with receiving({}, handle, topology_file=path, topology_check=0.1) as r:
            assert list(r.shards) == ["s0"]
            write_topology(path, replace(s0, managers=(url(m0),)), replace(s1, managers=(url(m1),)))
            await r.wait_subscribed(10, ["s1"])
            [id1] = await insert(s1.dsn, [(tenants_of(s1, 1)[0], {})])
            await wait_for(lambda: ("s1", id1) in {(e.shard, e.id) for e in seen}, what="the new shard's event")

            # a shard without managers (and no override): the file is not used, the links stay
            write_topology(path, replace(s0, key_range=whole))
            await asyncio.sleep(0.5)
            assert sorted(r.shards) == ["s0", "s1"] and r.leader("s0") == url(m0) and r.leader("s1") == url(m1)

            [held] = await insert(s0.dsn, [(tenants_of(s0, 1)[0], {"hold": True})])
            await wait_for(lambda: r.in_hand("s0") == 1, what="the held event in hand")
            write_topology(path, replace(s1, key_range=whole, managers=(url(m1),)))
            await wait_for(lambda: list(r.shards) == ["s1"], what="s0 leaving the receiver")
            await asyncio.sleep(0.3)
            assert r.leader("s0") == url(m0), "the link drains before it closes"
            hold.set()
            await wait_for(lambda: r.leader("s0") is None, what="the link of s0 closed")
            assert (await rows(s0.dsn))[held][:2] == ("acked", 1)

            # no subscriber left on s0: its new events wait there
            [after] = await insert(s0.dsn, [(tenants_of(s0, 1)[0], {})])
            await asyncio.sleep(0.5)
            assert after not in {e.id for e in seen if e.shard == "s0"}
            assert (await rows(s0.dsn))[after][0] == "to_be_fired"
            assert r.leader("s1") == url(m1)
