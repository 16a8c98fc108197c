"""Managers as real processes (``qm manager``), for fault tests that signal or kill them."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psycopg

from queue_manager.domain.topology import Topology
from tests.managerkit import SECRET_ALL

_ROOT = Path(__file__).resolve().parents[1]


def write_config(tmp_path: Path, topology: Topology) -> tuple[Path, Path]:
    """The topology file and a token file (one token for every queue, ``SECRET_ALL``)."""
    topo = tmp_path / "topology.toml"
    topo.write_text(topology.to_toml())
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[[token]]\nname = "all"\nsecret = "{SECRET_ALL}"\nqueues = ["*"]\n')
    return topo, tokens


class ManagerProcess:
    """``qm manager`` in a child process; its first stdout line names its port."""

    def __init__(
        self, topo: Path, tokens: Path, shard: str, lease_ttl: float, *extra: str, log: Path | None = None
    ) -> None:
        """``log``: append the manager's stderr (its log lines) to this file instead of dropping it."""
        self._log = log.open("ab") if log is not None else None
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "queue_manager.cli.main",
                "manager",
                "--topology",
                str(topo),
                "--shard",
                shard,
                "--tokens",
                str(tokens),
                "--port",
                "0",
                "--lease-ttl",
                str(lease_ttl),
                "--drain-timeout",
                "2",
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=self._log if self._log is not None else subprocess.DEVNULL,
            text=True,
            cwd=_ROOT,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        match = re.search(r"ws://127\.0\.0\.1:(\d+)/", line)
        assert match, f"unexpected first line from qm manager: {line!r}"
        self.port = int(match.group(1))
        self.url = f"ws://127.0.0.1:{self.port}/"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def health(self, path: str = "/health", timeout: float = 1.0) -> tuple[int, dict[str, Any]]:
        """(HTTP status, JSON body) of a health endpoint."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=timeout) as resp:
                return int(resp.status), json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return int(err.code), json.loads(err.read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if self._log is not None:
            self._log.close()


async def lease(dsn: str) -> tuple[int, int | None]:
    """The shard's current term, and the pid of its holder while the lease is unexpired."""
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cur = await conn.execute("SELECT term, holder, expires_at > clock_timestamp() FROM qm.leader")
        row = await cur.fetchone()
    assert row is not None
    term, holder, live = row
    return int(term), (int(str(holder).split(":")[1]) if live and holder else None)
