"""``qm shard-for TENANT``: the shard that holds a tenant's events, from the topology file alone
(no database is asked): ``psql "$(qm shard-for acme --dsn)"`` opens a session where the tenant's
INSERTs belong."""

from __future__ import annotations

import argparse

from queue_manager.cli.common import Subparsers, command, topology
from queue_manager.domain.routing import keyspace_hex


def register(sub: Subparsers) -> None:
    p = command(sub, "shard-for", cmd_shard_for, topology=True)
    p.add_argument("tenant", help="the tenant, as in the events' tenant column")
    p.add_argument("--dsn", action="store_true", help="print the shard's DSN only (for psql or a script)")


def cmd_shard_for(args: argparse.Namespace) -> int:
    """the shard that holds a tenant's events, and its DSN

    Print the shard a tenant's events live on: its name, its key range, the tenant's keyspace id (the hash of the tenant
    that picks the shard) and the shard's DSN. Only that shard accepts the tenant's INSERTs (another one refuses them,
    naming the right one). Reads the topology file only.

    example:
      qm shard-for acme
      psql "$(qm shard-for acme --dsn)"      # a psql session on acme's shard
    """
    shard = topology(args).shard_for(args.tenant)
    if args.dsn:
        print(shard.dsn)
    else:
        print(
            f"tenant {args.tenant}: shard {shard.name} (key range {shard.key_range}, keyspace id "
            f"{keyspace_hex(args.tenant)}): {shard.dsn}"
        )
    return 0
