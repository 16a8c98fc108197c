"""``qm demo``: the whole system live on local embedded shards (:mod:`queue_manager.demo`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from queue_manager.cli.common import Subparsers, command, duration


def register(sub: Subparsers) -> None:
    p = command(sub, "demo", cmd_demo)
    p.add_argument("--dir", default=".qm-local", help="directory for the local shards (default .qm-local)")
    p.add_argument("--shards", type=int, default=2, help="number of shards (default 2)")
    p.add_argument(
        "--duration",
        type=duration,
        metavar="DURATION",
        help="stop after this long, e.g. 60 or 2min (default: at Ctrl-C)",
    )
    p.add_argument("--rate", type=float, default=150.0, help="events per second the producer commits (default 150)")
    p.add_argument("--receivers", type=int, default=3, help="receiver processes (default 3)")
    p.add_argument("--keep", action="store_true", help="leave the shards running at the end")
    p.add_argument("--plain", action="store_true", help="plain progress lines, even on a terminal")


def cmd_demo(args: argparse.Namespace) -> int:
    """run the whole system live on local embedded shards until Ctrl-C

    Local shards, two managers per shard, receiver processes, a producer, a live view, a manager failover at a third of
    the run, and a summary checked against the database at the end. The managers', receivers' and dashboard's logs are
    in DIR/demo-logs.

    example:
      qm demo --dir .qm-local
      qm demo --dir .qm-local --duration 60 --rate 300
    """
    from queue_manager.demo import run_demo

    return run_demo(
        Path(args.dir).resolve(),
        shards=args.shards,
        duration=args.duration,
        rate=args.rate,
        receivers=args.receivers,
        keep=args.keep,
        live=False if args.plain else None,
    )
