"""The ``qm`` command line: the parser, built from one module per command group, and the dispatch.

    qm local start --shards N --dir DIR     start N embedded PostgreSQL shards, migrate, write DIR/topology.toml
    qm local stop --dir DIR                 stop them (a later start reuses the data)
    qm migrate --topology T                 apply the schema history to every shard
    qm queue create|alter|list|pause|resume manage queues on every shard
    qm queue tenant set|unset|list Q [T]    a tenant's weight and in-flight cap
    qm queue adopt QUEUE --from DSN --table T   move a legacy queue table's events into QUEUE, while it is written
    qm enqueue QUEUE TENANT [PAYLOAD]       enqueue one event (routed to the tenant's shard)
    qm status [--json]                      length and state of every queue on every shard
    qm manager --shard S --tokens F         run the manager of one shard (websocket, metrics, health)
    qm events retry QUEUE [--id ..]         put dead-lettered (failed) events back
    qm receive --queue Q module:function    run a receiver (docs/receivers.md) on every shard's managers
    qm demo --dir DIR                       the end-to-end demo on local shards
    qm web --tokens F [--port 8080]         the web dashboard over every shard (docs/dashboard.md)
    qm spark enqueue --queue Q --input SRC --run-id R   bulk enqueue from Spark, once (docs/spark.md)
    qm spark recover|cleanup                finish two-phase enqueue runs; drop the staging of dead runs
    qm spark archive --output DIR --older-than 30d
                                            move settled events to Parquet, then delete them (needs pyspark)
    qm reshard plan|start|status|sync|switch|reverse|cleanup|cancel
                                            split or merge shards online (docs/operations.md, "Resharding")

``--topology`` defaults to ``$QM_TOPOLOGY``. A command group is a module here with a
``register(subparsers)`` function that adds its commands, each with a ``func`` default that runs it.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from queue_manager import logs
from queue_manager.cli import demo, events, local, manager, queues, receive, reshard, spark, status, web
from queue_manager.cli.common import run
from queue_manager.cli.receive import managers_by_shard as _managers  # noqa: F401  (the name tests know)

#: the command groups, in the order ``qm --help`` lists them
GROUPS = (
    local.register,
    local.register_migrate,
    queues.register,
    events.register_enqueue,
    status.register,
    manager.register,
    receive.register,
    events.register,
    web.register,
    spark.register,
    demo.register,
    reshard.register,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qm", description="Sharded, table-backed queue manager on PostgreSQL")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    for register in GROUPS:
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``qm`` console command."""
    args = build_parser().parse_args(argv)
    logs.configure(logging.INFO if args.verbose else logging.WARNING)
    return run(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
