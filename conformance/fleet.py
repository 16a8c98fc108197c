"""The system the conformance suite runs a client against: one embedded PostgreSQL shard, migrated,
and its managers as ``qm manager`` processes (one leads, the others stand by), with a token file.

This is the suite's one place that starts servers; it uses what the project has
(:func:`queue_manager.local.shards.start_shards` and the ``qm manager`` command), so that it can
move to a shared fleet launcher without touching the cases.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from queue_manager.domain.topology import Topology
from queue_manager.local.embedded import LocalCluster
from queue_manager.local.shards import start_shards

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


class ManagerProcess:
    """One ``qm manager`` child process; its first line on stdout names its port."""

    def __init__(self, topology_file: Path, tokens_file: Path, config: FleetConfig, log: Path) -> None:
        self._log = log.open("ab")
        argv = [sys.executable, "-m", "queue_manager.cli.main", "manager", "--topology", str(topology_file)]
        argv += ["--shard", SHARD, "--tokens", str(tokens_file), "--port", "0"]
        argv += ["--lease-ttl", str(config.lease_ttl), "--drain-timeout", str(config.drain_timeout)]
        argv += ["--ping-interval", str(config.ping_interval), "--ping-timeout", str(config.ping_timeout)]
        argv += ["--sweep-interval", "0.2"]
        self.log = log
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self._log, text=True)
        self.port = 0
        self.url = ""

    def started(self) -> ManagerProcess:
        """Wait for the line that names its port."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        match = re.search(r"ws://127\.0\.0\.1:(\d+)/", line)
        if match is None:
            self.stop()
            raise RuntimeError(f"qm manager did not start (first line {line!r}); its log: {self.log}")
        self.port = int(match.group(1))
        self.url = f"ws://127.0.0.1:{self.port}/"
        return self

    def health(self) -> dict[str, Any] | None:
        """The manager's ``/health`` body, or None when it does not answer."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1.0) as resp:
                body: dict[str, Any] = json.loads(resp.read())
                return body
        except (OSError, urllib.error.URLError, ValueError):
            return None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


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
        self.managers: list[ManagerProcess] = []

    @property
    def dsn(self) -> str:
        assert self.topology is not None
        return self.topology.shards[0].dsn

    @property
    def urls(self) -> list[str]:
        return [m.url for m in self.managers]

    def start(self) -> Fleet:
        self.topology = start_shards(self.directory, 1)
        self.tokens_file = self.directory / "tokens.toml"
        self.tokens_file.write_text(
            f'[[token]]\nname = "all"\nsecret = "{SECRET_ALL}"\nqueues = ["*"]\n\n'
            f'[[token]]\nname = "other"\nsecret = "{SECRET_OTHER}"\nqueues = ["no_case_uses_this"]\n'
        )
        launched = [self._manager(i) for i in range(self.config.managers)]
        self.managers = [m.started() for m in launched]
        self.wait_leader()
        return self

    def _manager(self, i: int) -> ManagerProcess:
        return ManagerProcess(
            self.directory / "topology.toml", self.tokens_file, self.config, self.directory / f"manager-{i}.log"
        )

    def leader(self) -> int | None:
        """The index of the manager that leads now, if one does."""
        for i, m in enumerate(self.managers):
            health = m.health()
            if m.proc.poll() is None and health is not None and health.get("role") == "leader":
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
        self.managers[i].stop()
        self.managers[i] = self._manager(i).started()

    def connections(self) -> list[dict[str, Any]]:
        """The receiver connections of the leading manager (``/health``), or none."""
        i = self.leader()
        health = self.managers[i].health() if i is not None else None
        return list(health.get("connections", [])) if health else []

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
