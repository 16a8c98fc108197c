"""The system the conformance suite runs a client against: one embedded PostgreSQL shard, migrated,
and its managers as ``qm manager`` processes (one leads, the others stand by), with a token file,
all started through :mod:`queue_manager.local.fleet`.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from queue_manager.domain.topology import Topology
from queue_manager.local import fleet as local
from queue_manager.local.embedded import LocalCluster

#: the secrets of the suite's token file: every queue; a queue no case uses; unknown to the managers
SECRET_ALL = "conformance-all-queues-0001"
SECRET_OTHER = "conformance-other-queue-001"
SECRET_UNKNOWN = "conformance-no-such-token-1"
SHARD = "s0"


@dataclass(frozen=True, slots=True)
class FleetConfig:
    managers: int = 2
    lease_ttl: float = 2.0
    #: the managers ping every receiver connection this often and close it (1011) past the timeout
    ping_interval: float = 0.5
    ping_timeout: float = 1.0
    drain_timeout: float = 5.0


class Fleet:
    """A shard and its managers, running until :meth:`stop`."""

    def __init__(self, config: FleetConfig | None = None, directory: Path | None = None) -> None:
        self.config = config or FleetConfig()
        shm = Path("/dev/shm")
        self._owned = directory is None
        self.directory = directory or Path(
            tempfile.mkdtemp(prefix="qm-conformance-", dir=shm if shm.is_dir() else None)
        )
        self.topology: Topology | None = None
        self.managers: list[local.ManagerProcess] = []

    @property
    def dsn(self) -> str:
        assert self.topology is not None
        return self.topology.shards[0].dsn

    @property
    def urls(self) -> list[str]:
        return [m.url for m in self.managers]

    def start(self) -> Fleet:
        self.topology = local.start_shards(self.directory, 1)
        self.tokens_file = local.write_tokens(
            self.directory / "tokens.toml",
            [local.Token("all", SECRET_ALL), local.Token("other", SECRET_OTHER, ("no_case_uses_this",))],
        )
        self.managers = [self._manager(i) for i in range(self.config.managers)]
        self.wait_leader()
        return self

    def _manager(self, i: int) -> local.ManagerProcess:
        c = self.config
        return local.ManagerProcess(
            self.directory / local.TOPOLOGY_FILE,
            self.tokens_file,
            SHARD,
            log=self.directory / f"manager-{i}.log",
            lease_ttl=c.lease_ttl,
            drain_timeout=c.drain_timeout,
            ping_interval=c.ping_interval,
            ping_timeout=c.ping_timeout,
            sweep_interval=0.2,
        )

    def leader(self) -> int | None:
        """The index of the manager that leads now, if one does."""
        for i, m in enumerate(self.managers):
            if m.role() == "leader":
                return i
        return None

    def wait_leader(self, timeout: float = 20.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.leader()
            if found is not None:
                return found
            time.sleep(0.05)
        raise RuntimeError(f"no manager leads shard {SHARD} after {timeout:g} s (logs in {self.directory})")

    def kill(self, i: int) -> None:
        """SIGKILL manager ``i`` (its standby takes over once the lease runs out)."""
        self.managers[i].kill()

    def restart(self, i: int) -> None:
        """Start manager ``i`` again (on a new port), after a kill."""
        self.managers[i].start()

    def connections(self) -> list[dict[str, Any]]:
        """The receiver connections of the leading manager (``/health``), or none."""
        i = self.leader()
        if i is None:
            return []
        _, health = self.managers[i].health()
        return list(health.get("connections", []))

    def stop(self) -> None:
        for m in self.managers:
            m.stop()
        self.managers.clear()
        if self.topology is not None:
            with contextlib.suppress(Exception):
                LocalCluster.from_directory(self.directory).stop()
        if self._owned:
            shutil.rmtree(self.directory, ignore_errors=True)


@contextlib.contextmanager
def running(config: FleetConfig | None = None) -> Iterator[Fleet]:
    fleet = Fleet(config)
    try:
        yield fleet.start()
    finally:
        fleet.stop()
