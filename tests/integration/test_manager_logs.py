"""What a manager writes at its default log level (INFO for ``qm manager``): a handful of lines
while idle, and the lines that tell a failover's story: leadership taken, lost, drained, released.

The idle property is about what recurs: per-run maintenance lines (APScheduler wrote two per run and
a warning per overrun), per-request lines (websockets wrote one per HTTP probe of /health/leader,
which receivers send to find and watch the leader). So the managers run their maintenance ten
times as often as by default, with a receiver that probes the standby every 0.1 s: IDLE seconds of
this are more maintenance runs and probes than a minute at the defaults.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from queue_manager.domain.topology import Shard, Topology
from receivers import Event, Receiver
from tests.managerkit import SECRET_ALL, wait_for
from tests.processkit import ManagerProcess, lease, write_config

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

LEASE_TTL = 1.0
#: ten times the defaults' pace (sweep 1 s, purge 5 s, reconcile 60 s, health 5 s, slices 0.2 s)
FAST = [
    "--sweep-interval",
    "0.1",
    "--purge-interval",
    "0.5",
    "--reconcile-interval",
    "1",
    "--health-interval",
    "0.5",
    "--slice-interval",
    "0.02",
]
IDLE = 6.0
#: what a manager may write in IDLE seconds of idling (at most: a receiver's connection and the odd
#: one-off line; nothing per run, per renewal or per request)
HANDFUL = 3


def lines(path: Path) -> list[str]:
    return [line for line in path.read_text(errors="replace").splitlines() if line.strip()]


@pytest.fixture
def managers(tmp_path: Path, shards: Topology) -> Iterator[tuple[list[ManagerProcess], list[Path]]]:
    topo, tokens = write_config(tmp_path, shards)
    logs = [tmp_path / "manager-a.log", tmp_path / "manager-b.log"]
    procs = []
    try:
        for log in logs:
            procs.append(ManagerProcess(topo, tokens, "s0", LEASE_TTL, *FAST, log=log))
        yield procs, logs
    finally:
        for p in procs:
            p.stop()


async def _leader(procs: list[ManagerProcess], timeout: float = 15.0) -> int:
    """The index of the manager that answers /health/leader with 200."""
    leading: list[int] = []

    def found() -> bool:
        leading[:] = [i for i, p in enumerate(procs) if p.health("/health/leader")[0] == 200]
        return len(leading) == 1

    await wait_for(found, timeout, "a leader")
    return leading[0]


async def _handle(event: Event) -> None:
    return None


async def test_an_idle_manager_writes_a_handful_of_lines_and_a_failover_its_leadership_lines(
    shard: Shard,
    make_queue,  # type: ignore[no-untyped-def]
    managers: tuple[list[ManagerProcess], list[Path]],
) -> None:
    make_queue("orders")
    procs, logs = managers
    first = await _leader(procs)
    other = 1 - first
    await wait_for(lambda: any("leadership acquired" in line for line in lines(logs[first])), 10, "the lead line")
    receiver = Receiver(
        {"s0": [p.url for p in procs]}, "orders", _handle, token=SECRET_ALL, leader_check=0.1, probe_timeout=0.5
    )
    running = asyncio.create_task(receiver.run())
    try:
        await receiver.wait_subscribed(10)
        await wait_for(lambda: any("receiver connected" in line for line in lines(logs[first])), 5, "connected")
        before = [len(lines(log)) for log in logs]
        await asyncio.sleep(IDLE)  # observed, not waited on: what the managers write meanwhile
        idle = [lines(log)[n:] for log, n in zip(logs, before, strict=True)]
        for written in idle:
            assert len(written) <= HANDFUL, "\n".join(written)
        assert not any("maximum number of running instances" in line for log in logs for line in lines(log))
        assert not any("websockets" in line for log in logs for line in lines(log)), "per-request lines"

        # leadership lost and taken: the leader stopped past its lease, then woken
        term, _ = await lease(shard.dsn)
        os.kill(procs[first].pid, signal.SIGSTOP)
        try:
            await wait_for(
                lambda: any(f"leadership acquired action=lead term={term + 1}" in line for line in lines(logs[other])),
                LEASE_TTL + 10,
                "the standby's takeover line",
            )
        finally:
            os.kill(procs[first].pid, signal.SIGCONT)
        await wait_for(
            lambda: any("stepping down" in line for line in lines(logs[first])), 10, "the deposed leader's line"
        )
        stepped = next(line for line in lines(logs[first]) if "stepping down" in line)
        assert "WARNING" in stepped and f"term={term}" in stepped and "reason=" in stepped, stepped
    finally:
        receiver.stop()
        await asyncio.wait_for(running, 10)

    # the drain: the new leader stops on SIGTERM, drains, hands the lease over
    await wait_for(lambda: procs[other].health("/health/leader")[0] == 200, 10, "the new leader dispatching")
    procs[other].proc.send_signal(signal.SIGTERM)
    procs[other].proc.wait(15)
    tail = "\n".join(lines(logs[other]))
    for line in ("stopping: draining", "drained: every event in hand was settled", "leadership released"):
        assert line in tail, tail
