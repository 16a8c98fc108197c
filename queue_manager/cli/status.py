"""``qm status``: the length and state of every queue on every shard."""

from __future__ import annotations

import argparse

from queue_manager.cli.common import Subparsers, command, print_json, topology


def register(sub: Subparsers) -> None:
    p = command(sub, "status", cmd_status, topology=True)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--queue", help="only this queue")


def cmd_status(args: argparse.Namespace) -> int:
    """queue length and state on every shard

    For every shard and queue: the events by state, the depth of each partition, the age of the oldest due event, the
    dead letters; and each database's health (vacuum, the oldest transaction, bloat) with a warning line for each
    threshold crossed. A shard that cannot be reached is reported, and the others still are.

    example:
      qm status
      qm status --queue orders --json
    """
    from queue_manager import admin

    data = admin.status(topology(args), queue=args.queue)
    if args.json:
        print_json(data)
    else:
        print(admin.render_status(data))
    return 0
