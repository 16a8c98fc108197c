"""Managers as real processes (``qm manager``, started by :mod:`queue_manager.local.fleet`), for fault
tests that signal or kill them."""

from __future__ import annotations

from pathlib import Path

import psycopg

from queue_manager.domain.topology import Topology
from queue_manager.local import fleet
from tests.managerkit import SECRET_ALL


def write_config(tmp_path: Path, topology: Topology) -> tuple[Path, Path]:
    """The topology file and a token file (one token for every queue, ``SECRET_ALL``)."""
    topo = tmp_path / "topology.toml"
    topo.write_text(topology.to_toml())
    tokens = fleet.write_tokens(tmp_path / "tokens.toml", [fleet.Token("all", SECRET_ALL)])
    return topo, tokens


class ManagerProcess(fleet.ManagerProcess):
    """``qm manager`` of ``shard`` on a free port with a ``lease_ttl`` lease and a 2 s drain; ``extra``: more flags."""

    def __init__(
        self, topo: Path, tokens: Path, shard: str, lease_ttl: float, *extra: str, log: Path | None = None
    ) -> None:
        super().__init__(topo, tokens, shard, *extra, log=log, lease_ttl=lease_ttl, drain_timeout=2)


async def lease(dsn: str) -> tuple[int, int | None]:
    """The shard's current term, and the pid of its holder while the lease is unexpired."""
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cur = await conn.execute("SELECT term, holder, expires_at > clock_timestamp() FROM qm.leader")
        row = await cur.fetchone()
    assert row is not None
    term, holder, live = row
    return int(term), (int(str(holder).split(":")[1]) if live and holder else None)
