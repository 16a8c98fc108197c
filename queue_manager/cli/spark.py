"""``qm spark enqueue|recover|cleanup|archive``: the Spark jobs, whose options are the jobs' own
(:mod:`spark_jobs.commands`); their modules, which need pyspark, load only when a job runs."""

from __future__ import annotations

from queue_manager.cli.common import Subparsers


def register(sub: Subparsers) -> None:
    from spark_jobs import commands  # no pyspark at import: `qm` starts without it

    spark = sub.add_parser("spark", help="Spark jobs (need pyspark and Java)").add_subparsers(
        dest="spark_command", required=True
    )
    commands.register(spark)
