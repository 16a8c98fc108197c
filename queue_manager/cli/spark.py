"""``qm spark enqueue|recover|cleanup|archive``: the Spark jobs, whose options are the jobs' own
(:mod:`spark_jobs.commands`); their modules, which need pyspark, load only when a job runs."""

from __future__ import annotations

from queue_manager.cli.common import Subparsers, group


def register(sub: Subparsers) -> None:
    from spark_jobs import commands  # no pyspark at import: `qm` starts without it

    spark = group(
        sub,
        "spark",
        help="Spark jobs (need pyspark and Java)",
        description="Bulk enqueue from Spark, all-or-nothing and safe to re-run, and the archive of settled events to "
        "Parquet (docs/spark.md, docs/spark-archive.md). They need pyspark (the spark extra) and Java 17.",
        example=("qm spark enqueue --queue orders --input orders.parquet --run-id r1", "qm spark archive --help"),
    )
    commands.register(spark)
