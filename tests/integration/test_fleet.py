"""A fleet of real processes (queue_manager.local.fleet): ``qm manager`` records itself in the topology
file, and ``qm receive --topology`` finds every shard's managers there, with no ``--manager``."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
import pytest

from queue_manager.domain.topology import Topology
from queue_manager.local import fleet
from tests.conftest import tenants_of
from tests.managerkit import SECRET_ALL
from tests.processkit import write_config

pytestmark = pytest.mark.timeout(120)

#: every event is acked this long after its commit at most (receivers subscribed; a loaded machine)
ACKED_WITHIN = 20.0


def recorded(topo: Path) -> dict[str, set[str]]:
    return {s.name: set(s.managers) for s in Topology.load(topo).shards}


def insert(dsn: str, tenants: list[str]) -> list[int]:
    ids = []
    with psycopg.connect(dsn) as conn:
        for t in tenants:
            row = conn.execute("INSERT INTO orders (tenant, payload) VALUES (%s, '{}') RETURNING id", (t,)).fetchone()
            assert row is not None
            ids.append(int(row[0]))
    return ids


def wait_acked(shards: Topology, ids: dict[str, list[int]], what: str) -> None:
    deadline = time.monotonic() + ACKED_WITHIN
    while True:
        left = 0
        for s in shards.shards:
            with psycopg.connect(s.dsn) as conn:
                row = conn.execute(
                    "SELECT count(*) FROM orders WHERE id = ANY(%s) AND state <> 'acked'", (ids[s.name],)
                ).fetchone()
                left += int(row[0]) if row else 0
        if left == 0:
            return
        assert time.monotonic() < deadline, f"{left} events {what} not acked within {ACKED_WITHIN} s"
        time.sleep(0.1)


def test_qm_receive_finds_the_managers_that_recorded_themselves_in_the_topology_file(
    shards: Topology, make_queue: Any, tmp_path: Path
) -> None:
    """Four ``qm manager`` processes (two per shard) start at once on one topology file that names no
    managers; each adds its URL to its shard's ``managers``, none is lost. ``qm receive --topology``
    without ``--manager`` receives both shards' events. A manager stopped (drained) takes its URL
    off; the receiver goes on with the file's other manager of that shard."""
    make_queue("orders")
    topo, tokens = write_config(tmp_path, shards)
    assert recorded(topo) == {"s0": set(), "s1": set()}

    def start(shard: str) -> fleet.ManagerProcess:
        return fleet.ManagerProcess(topo, tokens, shard, lease_ttl=2.0, drain_timeout=2)

    with ThreadPoolExecutor(4) as pool:
        managers = list(pool.map(start, ["s0", "s1", "s0", "s1"]))
    receiver = None
    try:
        assert recorded(topo) == {s: {m.url for m in managers if m.shard == s} for s in ("s0", "s1")}
        receiver = fleet.ReceiverProcess(
            "orders", "receivers.demo:handle", topology=topo, token=SECRET_ALL, log=tmp_path / "receiver.log"
        )
        ids = {s.name: insert(s.dsn, tenants_of(s, 5)) for s in shards.shards}
        wait_acked(shards, ids, "of both shards")

        gone = next(m for m in managers if m.shard == "s0")
        gone.stop()
        assert recorded(topo)["s0"] == {m.url for m in managers if m.shard == "s0" and m is not gone}
        ids = {s.name: insert(s.dsn, tenants_of(s, 5, "later")) for s in shards.shards}
        wait_acked(shards, ids, "after one of s0's managers stopped")
        assert receiver.alive(), (tmp_path / "receiver.log").read_text()[-2000:]
    finally:
        if receiver is not None:
            receiver.stop()
        for m in managers:  # drained side by side
            m.signal(signal.SIGTERM)
        for m in managers:
            m.stop()
    assert recorded(topo) == {"s0": set(), "s1": set()}  # each took its URL off as it stopped


def test_qm_manager_no_record_leaves_the_topology_file_alone(shards: Topology, tmp_path: Path) -> None:
    topo, tokens = write_config(tmp_path, shards)
    before = topo.read_text()
    manager = fleet.ManagerProcess(topo, tokens, "s0", no_record=True)
    try:
        assert manager.role() in ("leader", "standby", "starting")
        assert topo.read_text() == before
    finally:
        manager.stop()
    assert topo.read_text() == before


def test_a_manager_that_cannot_start_is_reported_with_its_log(tmp_path: Path) -> None:
    tokens = fleet.write_tokens(tmp_path / "tokens.toml", [fleet.Token("all", SECRET_ALL)])
    log = tmp_path / "manager.log"
    with pytest.raises(RuntimeError, match=r"qm manager for shard s0 did not start: ''; see .*manager\.log"):
        fleet.ManagerProcess(tmp_path / "missing.toml", tokens, "s0", log=log)
    assert "missing.toml does not exist" in log.read_text()
