"""Local shards ready to use: started, described in a topology file, migrated (``qm local start``, the demo)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from queue_manager.db.migrate import migrate_topology
from queue_manager.domain.topology import Shard, Topology, even_ranges, shard_names
from queue_manager.local.embedded import LocalCluster

#: the topology file a local cluster's directory holds
TOPOLOGY_FILE = "topology.toml"


def start_shards(directory: Path, shards: int, *, settings: Mapping[str, str] | None = None) -> Topology:
    """Start ``shards`` embedded PostgreSQL servers in ``directory`` (reusing its data), split the keyspace
    evenly between them, write ``directory/topology.toml`` and migrate every shard."""
    dsns = LocalCluster(directory, shards, settings=settings).start()
    topology = Topology(
        tuple(Shard(n, d, r) for n, d, r in zip(shard_names(len(dsns)), dsns, even_ranges(len(dsns)), strict=True))
    )
    (directory / TOPOLOGY_FILE).write_text(topology.to_toml())
    migrate_topology(topology)
    return topology
