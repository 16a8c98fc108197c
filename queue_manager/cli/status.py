"""``qm status``: the length and state of every queue on every shard."""

from __future__ import annotations

import argparse

from queue_manager import admin
from queue_manager.cli.common import Subparsers, print_json, topology, with_topology


def register(sub: Subparsers) -> None:
    p = with_topology(sub.add_parser("status", help="queue length and state on every shard"))
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--queue", help="only this queue")
    p.set_defaults(func=cmd_status)


def cmd_status(args: argparse.Namespace) -> int:
    data = admin.status(topology(args), queue=args.queue)
    if args.json:
        print_json(data)
    else:
        print(admin.render_status(data))
    return 0
