"""The cut-over's freeze against busy managers: one lock order everywhere (no deadlock between the
freeze and the managers' fenced fires and acks), a freeze that fails rolls back by itself and says
why, and cut-overs in rounds under managers firing and acking at full speed keep the write block
within 1 s (docs/operations.md, "Resharding")."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from benchmarks.reshard import deadlocks
from queue_manager.domain.topology import KeyRange, Shard, Topology
from queue_manager.errors import ConfigurationError
from queue_manager.producer import Event, Router, enqueue
from queue_manager.reshard.workflow import FREEZE_ATTEMPTS, Reshard, load_state
from receivers.testing import MinimalClient
from tests.conftest import DatabaseFactory, tenants_of
from tests.integration.test_reshard import (
    _stopped,
    events,
    expected_on,
    seed,
    shard_state,
    split_targets,
    write_topology,
)
from tests.integration.test_reshard_faults import killed, ok
from tests.integration.test_reshard_faults import qm as qm_process
from tests.integration.test_reshard_input import qm
from tests.managerkit import SECRET_ALL, Recorder, running_manager, url, wait_for, wait_leader

Conn = psycopg.Connection[Any]


def _waiting_for_a_lock(dsn: str, pid: int, timeout: float = 10.0) -> None:
    """Wait until backend ``pid`` waits for a lock (a heavyweight lock: a table's or a row's)."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(dsn, autocommit=True) as c:
        while True:
            row = c.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
            if row and row[0] == "Lock":
                return
            assert time.monotonic() < deadline, f"backend {pid} did not wait for a lock within {timeout}s"
            time.sleep(0.01)


def test_the_freeze_takes_the_queue_tables_before_the_leader_row_as_the_managers_statements_do(
    shards: Topology, make_queue: Any, tmp_path: Path
) -> None:
    """The interleaving that deadlocked: a manager's fire holds its lock on the queue table (taken
    when the statement starts) when the freeze comes; the freeze waits for it; then the fire's
    fence reads the leader row. The fence must not wait for the freeze (it did: the freeze held the
    leader row), the fire commits, the freeze goes on, and the next fire of the old term is refused."""
    make_queue("orders")
    s0 = shards.by_name("s0")
    with psycopg.connect(s0.dsn, autocommit=True) as c:
        term = c.execute("SELECT qm.acquire_leadership('m', 30)").fetchone()[0]  # type: ignore[index]
        assert term is not None
    with psycopg.connect(s0.dsn, autocommit=True) as manager, psycopg.connect(s0.dsn, autocommit=True) as freezer:
        freezer.execute("SET lock_timeout = '10s'")
        manager.execute("SET lock_timeout = '10s'")
        manager.execute("BEGIN")
        manager.execute("LOCK TABLE orders IN ROW EXCLUSIVE MODE")  # what an UPDATE of the queue takes first
        result: list[Any] = []

        def freeze() -> None:
            try:
                result.append(freezer.execute("SELECT qm.set_serving('frozen')").fetchone())
            except psycopg.Error as exc:
                result.append(exc)

        thread = threading.Thread(target=freeze)
        thread.start()
        _waiting_for_a_lock(s0.dsn, freezer.info.backend_pid)
        t0 = time.monotonic()
        try:
            assert manager.execute("SELECT qm.fence(%s)", (term,)).fetchone() == (term,)
        except psycopg.errors.DeadlockDetected:
            pytest.fail("the fenced statement and the freeze deadlocked")
        fenced_in = time.monotonic() - t0
        manager.execute("COMMIT")
        thread.join(15)
        assert not thread.is_alive()
        assert not isinstance(result[0], BaseException), result[0]
        assert fenced_in < 0.5, f"the fence waited {fenced_in:.2f}s for the freeze"
        with pytest.raises(psycopg.Error) as refused:
            manager.execute("SELECT qm.fence(%s)", (term,))
        assert refused.value.sqlstate == "QMF01"


# --------------------------------------------------------------------------- cut-overs under load

#: cut-overs (a switch, then a reverse, then a switch, ...) of the rounds test; more for a soak:
#: QM_RESHARD_ROUNDS=40 (docs/operations.md, "Resharding"; benchmarks/reshard.py --cutover-rounds)
ROUNDS = int(os.environ.get("QM_RESHARD_ROUNDS", "4"))
#: the write block a cut-over may cause (docs/operations.md): the longest enqueue of the moved range
WRITE_BLOCK_BOUND = 1.0
#: due events of the moved range enqueued at once right before each cut-over
BURST = 500


class Producers:
    """Enqueues through a Router that follows the topology file, paced at ``rate`` per second on a
    few threads, for tenants of every shard; each call's (start, seconds, tenant) is kept, and each
    error (a failure of the test)."""

    def __init__(self, topo: Path, tenants: list[str], rate: float, threads: int = 3) -> None:
        self.router = Router.from_file(topo, moved_wait=10.0)
        self.tenants = tenants
        self.rate = rate
        self.stop_ev = threading.Event()
        self.lock = threading.Lock()
        self.calls: list[tuple[float, float, str]] = []
        self.sent: dict[str, str] = {}
        self.errors: list[str] = []
        self._threads = [threading.Thread(target=self._run, args=(j, threads), daemon=True) for j in range(threads)]

    def __enter__(self) -> Producers:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_ev.set()
        for t in self._threads:
            t.join(30)
        self.router.close()

    def _run(self, j: int, threads: int) -> None:
        t0 = time.monotonic()
        k = j
        while not self.stop_ev.is_set():
            delay = t0 + k / self.rate - time.monotonic()
            if delay > 0:
                self.stop_ev.wait(delay)
            tenant = self.tenants[k % len(self.tenants)]
            n = f"live-{k}"
            start = time.monotonic()
            try:
                self.router.enqueue("orders", tenant, {"n": n})
            except Exception as exc:  # recorded, asserted on by the test
                with self.lock:
                    self.errors.append(f"{n}: {exc!r}"[:300])
            else:
                with self.lock:
                    self.calls.append((start, time.monotonic() - start, tenant))
                    self.sent[n] = tenant
            k += threads

    def longest(self, moved: KeyRange, since: float, until: float) -> float:
        """The longest enqueue of a tenant of ``moved`` that was under way in [since, until]."""
        with self.lock:
            return max(
                (d for s, d, t in self.calls if s <= until and s + d >= since and moved.contains(t)), default=0.0
            )


#: the live events acked on a shard, by their number
ACKED_LIVE = "SELECT payload->>'n' FROM orders WHERE state = 'acked' AND payload->>'n' LIKE 'live-%'"


def _burst(topo: Path, tenants: list[str], i: int) -> None:
    with Router.from_file(topo) as router:
        router.enqueue_batch(
            "orders", [Event(tenants[j % len(tenants)], {"n": f"burst-{i}-{j}"}) for j in range(BURST)]
        )


@pytest.mark.slow
async def test_cutovers_in_rounds_while_managers_fire_and_ack_at_full_speed(
    shards: Topology,
    new_database: DatabaseFactory,
    make_queue: Any,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Producers at 300 events/s through a Router (a third of them in the moved range), every
    shard's manager firing as they arrive and a receiver acking at once; the range is switched to
    the targets and reversed, ROUNDS cut-overs: none deadlocks (no cut-over rolls back, PostgreSQL
    counts no deadlock, no manager meets one), each blocks the moved range's writes at most 1 s,
    and every event ends acked on the shard that serves it."""
    make_queue("orders", partitions=4, shuffle=2, ack_timeout_seconds=2)
    s0, s1 = shards.shards
    topo = write_topology(tmp_path / "topology.toml", shards)
    targets = split_targets(new_database)
    dsns = [s0.dsn, s1.dsn, *(t.dsn for t in targets)]
    deadlocks_before = deadlocks(dsns)
    moved = tenants_of(s0, 12)
    tenants = moved + tenants_of(s1, 6)
    blocks: list[float] = []
    said: list[str] = []
    recorder = Recorder()
    async with contextlib.AsyncExitStack() as stack:
        managers = [await stack.enter_async_context(running_manager(s.dsn)) for s in shards.shards]
        for m in managers:
            await wait_leader(m)
        with Reshard(topo) as r:
            await asyncio.to_thread(r.start, targets)
        managers += [await stack.enter_async_context(running_manager(t.dsn)) for t in targets]
        for m in managers:
            receiver = MinimalClient(url(m), SECRET_ALL, "orders", recorder, credit=500, reconnect_delay=0.05)
            stack.push_async_callback(_stopped, receiver, asyncio.create_task(receiver.run()))
        producers = stack.enter_context(Producers(topo, tenants, rate=300))
        await wait_for(lambda: len(recorder.events) > 300, 20, "events flowing")
        for i in range(ROUNDS):
            to_targets = i % 2 == 0
            # a burst of due events of the moved range, so that the managers fire and ack in full
            # batches while the cut-over freezes
            await asyncio.to_thread(_burst, topo, moved, i)
            started = time.monotonic()
            with Reshard(topo, say=said.append) as r:
                await asyncio.to_thread(r.switch if to_targets else r.reverse)
            ended = time.monotonic()
            serving = targets if to_targets else [s0]
            leaders = [m for m in managers if m.config.dsn in {s.dsn for s in serving}]
            await wait_for(lambda leaders=leaders: all(m.role == "leader" for m in leaders), 10, "the new leaders")  # type: ignore[misc]
            blocks.append(producers.longest(s0.key_range, started, ended + 0.5))
            assert producers.errors == [], producers.errors
            seen = len(recorder.events)
            await wait_for(lambda seen=seen: len(recorder.events) > seen + 100, 20, "events flowing again")  # type: ignore[misc]
        producers.stop_ev.set()
        after = Topology.load(topo)

        def not_acked() -> dict[str, str]:
            """The events sent that are not acked on the shard that serves their tenant now."""
            acked: set[str] = set()
            for s in after.shards:
                with psycopg.connect(s.dsn) as c:
                    acked |= {str(r[0]) for r in c.execute(ACKED_LIVE)}
            return {n: after.shard_for(t).name for n, t in producers.sent.items() if n not in acked}

        # polled on a thread: the managers share this event loop
        deadline = time.monotonic() + 30
        while (late := await asyncio.to_thread(not_acked)) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert not late, f"{len(late)} events not acked where they are served, e.g. {list(late.items())[:5]}"
    assert producers.errors == []
    assert "deadlock" not in caplog.text.lower(), "a manager met a deadlock"
    assert deadlocks(dsns) == deadlocks_before
    steps = [line for line in said if " done in " in line or line.startswith("caught up")]
    print(json.dumps({"cutovers": ROUNDS, "write_block_s": [round(b, 3) for b in blocks], "steps": steps}))
    assert max(blocks) <= WRITE_BLOCK_BOUND, blocks


# --------------------------------------------------------------------------- a failed freeze


def _merge(shards: Topology, new_database: DatabaseFactory, tmp_path: Path) -> tuple[Path, Shard]:
    """Both shards seeded and copied to one new shard (the start done): two sources to freeze."""
    s0, s1 = shards.shards
    seed(s0.dsn, tenants_of(s0, 4), 0, 30)
    seed(s1.dsn, tenants_of(s1, 4), 100, 30)
    topo = write_topology(tmp_path / "topology.toml", shards)
    merged = Shard("m0", new_database(), KeyRange.parse("-"))
    with Reshard(topo) as r:
        r.start([merged])
    return topo, merged


def test_a_freeze_that_fails_rolls_back_by_itself_and_the_sources_serve(
    shards: Topology, new_database: DatabaseFactory, make_queue: Any, tmp_path: Path
) -> None:
    """A merge whose second source has an application's write open through the whole freeze: the
    first source froze, the second's lock is not granted in time. The command exits 4 with "lock
    timeout", both sources serve again (writes and leadership), the state says rolled back; the rerun
    catches up while the sources serve, then cuts over with every event."""
    make_queue("orders")
    s0, s1 = shards.shards
    topo, merged = _merge(shards, new_database, tmp_path)
    with psycopg.connect(s1.dsn) as app:
        app.execute('INSERT INTO orders (tenant, payload) VALUES (%s, \'{"n": "held"}\')', (tenants_of(s1, 1)[0],))
        t0 = time.monotonic()
        result = qm(topo, "switch", "--lock-timeout", "0.2")
        assert result.returncode == 4, result.stdout + result.stderr
        assert time.monotonic() - t0 < 20
        assert "lock timeout" in result.stderr and "rolled back" in result.stderr, result.stderr
        assert "unreachable" not in result.stderr
        assert result.stdout.count("freezing s1: shard 's1': lock timeout while freezing") == FREEZE_ATTEMPTS
        # the sources serve again, both of them, by themselves
        assert shard_state(s0.dsn)[1] == shard_state(s1.dsn)[1] == "serving"
        with psycopg.connect(s0.dsn) as c:
            assert enqueue(c, "orders", tenants_of(s0, 1)[0], {"n": "served"}) is not None
            c.commit()
            assert c.execute("SELECT qm.acquire_leadership('m', 5)").fetchone() != (None,)  # a manager may lead
        state = load_state(topo)
        assert state is not None and (state.phase, state.cutover_to, state.step) == ("copying", None, None)
        assert state.history[-1]["step"] == "rolled_back" and "lock timeout" in state.history[-1]["why"]
        app.commit()
    result = ok(qm(topo, "switch"))
    assert "caught up while the sources serve" in result.stdout
    everything = {**events(s0.dsn), **events(s1.dsn)}
    assert {"held", "served"} <= everything.keys()
    assert events(merged.dsn) == everything
    assert shard_state(s0.dsn)[1] == shard_state(s1.dsn)[1] == "moved"


def test_a_switch_killed_in_its_freeze_starts_over_with_its_catch_up(
    shards: Topology, new_database: DatabaseFactory, make_queue: Any, tmp_path: Path
) -> None:
    """Killed once a source froze, before the step was recorded: the rerun makes the sources serve
    again, catches up while they serve (it does not skip to a frozen catch-up), and finishes the
    cut-over."""
    make_queue("orders")
    s0, s1 = shards.shards
    topo, merged = _merge(shards, new_database, tmp_path)
    assert killed(qm_process(topo, "switch", crash_after="freeze:s0"))
    assert shard_state(s0.dsn)[1] == "frozen"  # s1's freeze, run at the same time, may have committed too
    state = load_state(topo)
    assert state is not None and (state.phase, state.step) == ("cutover", None)
    result = ok(qm(topo, "switch"))
    assert "stopped before its freeze was recorded: starting it over" in result.stdout
    assert "caught up while the sources serve" in result.stdout
    assert events(merged.dsn) == {**events(s0.dsn), **events(s1.dsn)}


def test_a_deadlock_in_the_freeze_is_named_and_the_freeze_tried_again(
    shards: Topology, new_database: DatabaseFactory, make_queue: Any, tmp_path: Path
) -> None:
    """An application's transaction writes the second queue and then the first, while the freeze
    locks them in the other order: PostgreSQL ends the freeze's statement (a deadlock), which is
    said as such and tried again once the application's transaction is through."""
    make_queue("orders")
    make_queue("other")
    s0 = shards.by_name("s0")
    tenant = tenants_of(s0, 1)[0]
    topo = write_topology(tmp_path / "topology.toml", shards)
    targets = split_targets(new_database)
    said: list[str] = []
    with Reshard(topo, say=said.append) as r:
        r.start(targets)
        pid = r.conn(s0).info.backend_pid
        with psycopg.connect(s0.dsn) as app:
            app.execute("INSERT INTO other (tenant, payload) VALUES (%s, '{}')", (tenant,))

            def write_the_first_queue_once_the_freeze_waits() -> None:
                _waiting_for_a_lock(s0.dsn, pid)
                app.execute('INSERT INTO orders (tenant, payload) VALUES (%s, \'{"n": "app"}\')', (tenant,))
                app.commit()

            thread = threading.Thread(target=write_the_first_queue_once_the_freeze_waits)
            thread.start()
            r.switch(lock_timeout=10)
            thread.join(10)
    assert any("freezing s0: shard 's0': deadlock while freezing" in line for line in said), said
    assert shard_state(s0.dsn)[1] == "moved"
    assert "app" in events(targets[0].dsn) or "app" in events(targets[1].dsn)


def test_cancel_refuses_a_cut_over_whose_serve_step_ran_but_was_not_recorded(
    shards: Topology, new_database: DatabaseFactory, make_queue: Any, tmp_path: Path
) -> None:
    """A switch stopped right after its serve step ran, before it recorded it: the state says
    'catch_up', but a target serves. Cancel would make the sources serve too and drop the
    targets' events: it refuses, and the switch finishes the cut-over."""
    make_queue("orders")
    s0 = shards.by_name("s0")
    seed(s0.dsn, tenants_of(s0, 4), 0, 30)
    topo = write_topology(tmp_path / "topology.toml", shards)
    targets = split_targets(new_database)

    class Stopped(Exception):
        pass

    def stop_after_catch_up(line: str) -> None:
        if line.startswith("catch_up: done"):
            raise Stopped

    with Reshard(topo, say=stop_after_catch_up) as r:
        r.start(targets)
        with pytest.raises(Stopped):
            r.switch()
    with psycopg.connect(targets[0].dsn, autocommit=True) as c:
        c.execute("SELECT qm.set_serving('serving')")  # what the serve step did before the stop
    with Reshard(topo) as r:
        with pytest.raises(ConfigurationError, match=r"serve step ran \(s2 serve already\)"):
            r.cancel()
        r.switch()
    final = events(s0.dsn)
    for t in targets:
        assert events(t.dsn) == expected_on(t, final)
        assert shard_state(t.dsn)[1] == "serving"
