"""``qm spark enqueue|recover|cleanup|archive``: the Spark jobs, whose options are the jobs' own
(:mod:`spark_jobs.commands`); their modules, which need pyspark, load only when a job runs."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from queue_manager.cli.common import Subparsers, group, topology
from queue_manager.errors import ConfigurationError

SPARK_HELP = """Spark jobs (need pyspark and Java)

Bulk enqueue from Spark, all-or-nothing and safe to re-run, and the archive of settled events to Parquet (docs/spark.md,
docs/spark-archive.md). They need pyspark (the spark extra) and Java 17.

example:
  qm spark enqueue --queue orders --input orders.parquet --run-id r1
  qm spark archive --help
"""


def register(sub: Subparsers) -> None:
    from spark_jobs import commands  # no pyspark at import: `qm` starts without it

    spark = group(sub, "spark", SPARK_HELP)
    commands.register(spark)
    for name, job in (("enqueue", _enqueue), ("recover", _recover), ("cleanup", _cleanup), ("archive", _archive)):
        spark.choices[name].set_defaults(func=_command(name, job))


def _command(name: str, job: Callable[[], Callable[..., Any]]) -> Callable[[argparse.Namespace], int]:
    """``qm spark NAME``: the job's function imported now, then the command's (:data:`spark_jobs.commands.COMMANDS`)."""

    def run(args: argparse.Namespace) -> int:
        from spark_jobs.commands import COMMANDS

        try:
            function = job()
        except ImportError as exc:
            raise ConfigurationError(f"qm spark {name} needs pyspark ({exc}): pip install -e '.[spark]'") from None
        return COMMANDS[name](args, topology(args), function)

    return run


def _enqueue() -> Callable[..., Any]:
    from spark_jobs.enqueue import run_cli

    return run_cli


def _recover() -> Callable[..., Any]:
    from spark_jobs.enqueue import recover

    return recover


def _cleanup() -> Callable[..., Any]:
    from spark_jobs.enqueue import cleanup

    return cleanup


def _archive() -> Callable[..., Any]:
    from spark_jobs.archive import run_archive

    return run_archive
