"""The reshard process killed (SIGKILL) right after each step it records, then run again: the rerun
finishes the step list (or, for a cut-over stopped before its 'serve' step, cancel rolls it back),
and nothing is lost; the targets' server restarted, and a manager SIGKILLed, during the copy and the
switch. In ``make test``; alone: ``make test-reshard-faults``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

from queue_manager.domain.topology import KeyRange, Shard, Topology
from queue_manager.reshard.plan import CUTOVER_STEPS
from queue_manager.reshard.workflow import CRASH_AFTER_ENV, Reshard, load_state
from tests.conftest import DatabaseFactory, tenants_of
from tests.integration.test_reshard import events, expected_on, seed, shard_state, split_targets, write_topology
from tests.processkit import ManagerProcess, write_config


def qm(topo: Path, *args: str, crash_after: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != CRASH_AFTER_ENV}
    if crash_after is not None:
        env[CRASH_AFTER_ENV] = crash_after
    return subprocess.run(
        [sys.executable, "-m", "queue_manager.cli.main", "reshard", *args, "--topology", str(topo)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def target_args(targets: list[Shard]) -> list[str]:
    out: list[str] = []
    for t in targets:
        out += ["--target", t.name, str(t.key_range), t.dsn]
    return out


def killed(result: subprocess.CompletedProcess[str]) -> bool:
    return result.returncode == -signal.SIGKILL


def ok(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_the_reshard_process_killed_after_each_step_resumes_or_rolls_back(
    shards: Topology, new_database: DatabaseFactory, make_queue: Any, tmp_path: Path
) -> None:
    make_queue("orders", partitions=4, shuffle=2)
    s0 = shards.by_name("s0")
    tenants = tenants_of(s0, 6)
    seed(s0.dsn, tenants, 0, 200)
    topo = write_topology(tmp_path / "topology.toml", shards)
    targets = split_targets(new_database)

    # start, killed after each of its recorded steps; the source keeps taking writes throughout
    for i, step in enumerate(("prepared", "capturing", "copied")):
        assert killed(qm(topo, "start", *target_args(targets), "--batch", "50", crash_after=step)), step
        seed(s0.dsn, tenants, 1000 + 100 * i, 20)
    ok(qm(topo, "start", *target_args(targets)))
    assert "copy" in ok(qm(topo, "status")).stdout

    # a switch killed after its freeze leaves writes refused until a rerun; cancel rolls it back
    assert killed(qm(topo, "switch", crash_after="freeze"))
    assert shard_state(s0.dsn)[1] == "frozen"
    ok(qm(topo, "cancel"))
    assert shard_state(s0.dsn) == ("s0", "serving", False)
    assert events(targets[0].dsn) == {}
    seed(s0.dsn, tenants, 2000, 20)  # the source takes writes again
    ok(qm(topo, "start", *target_args(targets)))

    # the switch killed after each step, each rerun resuming after the last step recorded
    for step in CUTOVER_STEPS:
        result = qm(topo, "switch", crash_after=step)
        assert killed(result), (step, result.stdout, result.stderr)
        state = load_state(topo)
        assert state is not None
        recorded = [h["step"] for h in state.history if h.get("to") == "targets"][-1]
        assert recorded == step
    state = load_state(topo)
    assert state is not None and state.phase == "switched"
    final = events(s0.dsn)
    for t in targets:
        assert events(t.dsn) == expected_on(t, final)
        assert shard_state(t.dsn) == (t.name, "serving", True)
    assert [s.name for s in Topology.load(topo).shards] == ["s1", "s2", "s3"]

    # the reverse killed in its catch-up, then rerun: the source serves every event again
    with psycopg.connect(targets[0].dsn, autocommit=True) as c:
        c.execute("UPDATE orders SET state = 'acked', acked_at = now() WHERE state = 'to_be_fired'")
    assert killed(qm(topo, "reverse", crash_after="catch_up"))
    ok(qm(topo, "reverse"))
    back = events(s0.dsn)
    assert back.keys() == final.keys()
    assert {r[3] for n, r in back.items() if final[n][3] == "to_be_fired" and targets[0].key_range.contains(r[0])} == {
        "acked"
    }
    assert shard_state(s0.dsn) == ("s0", "serving", True)
    ok(qm(topo, "switch"))
    ok(qm(topo, "cleanup"))
    assert events(s0.dsn) == {}


def test_a_target_server_restart_during_the_copy_and_during_the_switch(
    shards: Topology, make_queue: Any, tmp_path: Path, server_dir: Path
) -> None:
    """The targets' PostgreSQL server stops and starts (fast shutdown) right after the capture is
    turned on (so the copy's first writes meet a dead connection) and right after the freeze (so
    does the catch-up): the reshard reconnects and finishes, and every event is on its target."""
    from queue_manager.local.embedded import LocalServer

    make_queue("orders", partitions=4, shuffle=2)
    s0 = shards.by_name("s0")
    seed(s0.dsn, tenants_of(s0, 6), 0, 150)
    topo = write_topology(tmp_path / "topology.toml", shards)
    server = LocalServer(server_dir / "targets", settings={"fsync": "off"})
    base = server.start()
    try:
        targets = [
            Shard("s2", base.rsplit("/", 1)[0] + "/qm_s2", KeyRange.parse("-40")),
            Shard("s3", base.rsplit("/", 1)[0] + "/qm_s3", KeyRange.parse("40-80")),
        ]
        restarts: list[str] = []

        def say(line: str) -> None:
            if line.startswith(("capturing changes on", "freeze: done")):
                server.stop("fast")
                assert server.start() == base  # the same port
                restarts.append(line)

        with Reshard(topo, say=say) as r:
            r.start(targets, batch=40)
            seed(s0.dsn, tenants_of(s0, 6), 500, 30)
            r.switch()
        assert len(restarts) == 2
        final = events(s0.dsn)
        for t in targets:
            assert events(t.dsn) == expected_on(t, final)
            assert shard_state(t.dsn) == (t.name, "serving", True)
    finally:
        server.stop("immediate")


LEASE = 2.0


def _role_within(proc: ManagerProcess, role: str, seconds: float) -> float:
    """Wait until the manager's /health says ``role`` (or, for "not leader", any other role); the
    time it took. Fails after ``seconds``."""
    t0 = time.monotonic()
    while True:
        try:
            now = proc.health()[1].get("role")
        except OSError:
            now = None
        if (now == role) if role != "not leader" else (now is not None and now != "leader"):
            return time.monotonic() - t0
        assert time.monotonic() - t0 < seconds, f"{role!r} not reached in {seconds} s (role {now!r})"
        time.sleep(0.1)


def test_a_manager_killed_during_the_copy_and_during_the_switch(
    shards: Topology, new_database: DatabaseFactory, make_queue: Any, tmp_path: Path
) -> None:
    """The source's manager SIGKILLed while the copy runs, and a target's manager SIGKILLed right
    after the freeze: the reshard finishes by itself; the restarted source manager leads again
    while its shard serves, the deposed one stops leading at the switch, the restarted target
    manager leads within its lease and a poll; every event is on its target, the acked still acked."""
    make_queue("orders", partitions=4, shuffle=2)
    s0 = shards.by_name("s0")
    tenants = tenants_of(s0, 6)
    seed(s0.dsn, tenants, 0, 150)
    topo, tokens = write_config(tmp_path, shards)
    targets = split_targets(new_database)
    procs = {"s0": ManagerProcess(topo, tokens, "s0", LEASE)}
    killed: list[str] = []
    try:
        _role_within(procs["s0"], "leader", 15)

        def during_copy(line: str) -> None:
            if line.startswith("capturing changes on"):
                procs["s0"].proc.kill()
                procs["s0"].stop()
                killed.append(line)
                procs["s0"] = ManagerProcess(topo, tokens, "s0", LEASE)

        with Reshard(topo, say=during_copy) as r:
            r.start(targets, batch=40)
        # the source still serves: its restarted manager takes the lease once the killed one's ran out
        _role_within(procs["s0"], "leader", LEASE + 10)
        seed(s0.dsn, tenants, 500, 30)

        for t in targets:
            procs[t.name] = ManagerProcess(topo, tokens, t.name, LEASE)

        def during_switch(line: str) -> None:
            if line.startswith("freeze: done"):
                procs["s2"].proc.kill()
                procs["s2"].stop()
                killed.append(line)

        with Reshard(topo, say=during_switch) as r:
            r.switch()
        assert len(killed) == 2, killed
        _role_within(procs["s0"], "not leader", LEASE + 5)  # deposed at the freeze
        procs["s2"] = ManagerProcess(topo, tokens, "s2", LEASE)
        for t in targets:
            _role_within(procs[t.name], "leader", LEASE + 10)

        final = events(s0.dsn)
        for t in targets:
            on, want = events(t.dsn), expected_on(t, final)
            assert on.keys() == want.keys()
            assert {n for n, r in on.items() if r[3] == "acked"} == {n for n, r in want.items() if r[3] == "acked"}
        assert [s.name for s in Topology.load(topo).shards] == ["s1", "s2", "s3"]
    finally:
        for p in procs.values():
            p.stop()
