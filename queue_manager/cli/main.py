"""The ``qm`` command line: the parser, built from one module per command group, and the dispatch.

    qm local start --shards N --dir DIR     start N embedded PostgreSQL shards, migrate, write DIR/topology.toml
    qm local stop --dir DIR                 stop them (a later start reuses the data)
    qm migrate --topology T                 apply the schema history to every shard
    qm queue create|alter|list|pause|resume manage queues on every shard
    qm queue tenant set|unset|list Q [T]    a tenant's weight and in-flight cap
    qm queue adopt QUEUE --from DSN --table T   move a legacy queue table's events into QUEUE, while it is written
    qm enqueue QUEUE TENANT [PAYLOAD]       enqueue one event (routed to the tenant's shard)
    qm shard-for TENANT [--dsn]             the shard that holds a tenant's events (and its DSN, for psql)
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
Building the parser imports no database driver, migration tool or manager: a command imports what
it uses when it runs (``tests/unit/test_cli.py`` checks it).

Every command takes ``--log-level`` (and ``qm -v`` is ``--log-level INFO``). The commands that run
until stopped (``qm manager``, ``qm receive``, ``qm web``) log at INFO by default: what they did that
an operator wants to know (leadership, drains, failovers, connections); the others at WARNING.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from queue_manager import logs
from queue_manager.cli import (
    demo,
    events,
    local,
    manager,
    queues,
    receive,
    reshard,
    schedules,
    shard_for,
    spark,
    status,
    web,
)
from queue_manager.cli.common import HelpFormatter, examples, run
from queue_manager.cli.receive import managers_by_shard as _managers  # noqa: F401  (the name tests know)

#: the command groups, in the order ``qm --help`` lists them
GROUPS = (
    local.register,
    local.register_migrate,
    queues.register,
    events.register_enqueue,
    shard_for.register,
    status.register,
    manager.register,
    receive.register,
    events.register,
    schedules.register,
    web.register,
    spark.register,
    demo.register,
    reshard.register,
)

#: the commands that run until stopped, and log at INFO unless told otherwise
LONG_RUNNING = frozenset({"manager", "receive", "web"})
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class _Version(argparse.Action):
    """``qm --version``: the installed package's version, read only when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        from importlib import metadata

        try:
            version = metadata.version("queue-manager")
        except metadata.PackageNotFoundError:
            version = "(not installed: run from a checkout)"
        print(f"qm {version} (queue-manager, Python {sys.version.split()[0]})")
        parser.exit()


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """The parser and every command's below it."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                yield from _parsers(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qm",
        description="A sharded, table-backed queue manager on PostgreSQL: enqueue in your own transaction, "
        "receive over websockets. `qm COMMAND --help` explains each command, with an example.",
        epilog=examples(
            "qm local start --shards 2 --dir ./local && export QM_TOPOLOGY=./local/topology.toml",
            "qm queue create orders",
            "qm enqueue orders acme '{\"order\": 42}'",
            "qm status",
        ),
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action=_Version, help="print the version and exit")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level (as --log-level INFO)")
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LEVELS,
        metavar="LEVEL",
        help="DEBUG, INFO, WARNING or ERROR (default: INFO for manager, receive and web, WARNING otherwise)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    for register in GROUPS:
        register(sub)
    for p in _parsers(parser):
        p.formatter_class = HelpFormatter
        if p is not parser and p.get_default("func") is not None and "--log-level" not in p._option_string_actions:
            p.add_argument(
                "--log-level",
                type=str.upper,
                choices=LEVELS,
                default=argparse.SUPPRESS,
                metavar="LEVEL",
                help="DEBUG, INFO, WARNING or ERROR (as qm --log-level)",
            )
    return parser


def log_level(args: argparse.Namespace) -> int:
    """The level a parsed command logs at: ``--log-level``, else ``-v``, else the command's default."""
    if args.log_level:
        name = str(args.log_level)
    elif args.verbose or args.command in LONG_RUNNING:
        name = "INFO"
    else:
        name = "WARNING"
    return int(getattr(logging, name))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``qm`` console command."""
    args = build_parser().parse_args(argv)
    logs.configure(log_level(args))
    return run(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
