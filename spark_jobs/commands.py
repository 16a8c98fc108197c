"""The Spark jobs' command lines: ``qm spark enqueue|recover|cleanup|archive`` and the scripts
``python -m spark_jobs.enqueue ARGS`` / ``python -m spark_jobs.archive ARGS`` (also through spark-submit).

No pyspark here, and no job: ``qm`` builds these parsers without them. Each command's function is
given the job's function by its caller: ``qm``'s spark group (:mod:`queue_manager.cli.spark`)
imports the job's module when the command runs, and a script passes its own (the module run as
``__main__``, which would otherwise be imported a second time).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from queue_manager import logs
from queue_manager.cli.common import duration, examples, run, topology, with_topology
from queue_manager.domain.durations import format_duration
from queue_manager.domain.topology import Topology


def register(spark: Any) -> None:
    """Add the jobs to a ``spark`` group's subparsers (``qm spark``)."""
    p = with_topology(
        spark.add_parser(
            "enqueue",
            help="bulk enqueue a Parquet/CSV/JSON source or a table into a queue on every shard, once",
            description="Route and check every row in Spark, stage each shard's rows through JDBC, then publish "
            "them in one transaction per shard (--atomic: across all shards). Safe to re-run with the same "
            "--run-id. See docs/spark.md.",
            epilog=examples("qm spark enqueue --queue orders --input s3a://bucket/orders/ --run-id orders-2026-01-01"),
        )
    )
    p.add_argument("--queue", required=True, help="target queue (must exist on every shard)")
    p.add_argument("--input", required=True, help="source path (or table name with --format table)")
    p.add_argument(
        "--format",
        default="parquet",
        choices=["parquet", "csv", "json", "orc", "table"],
        help="the source's format (default parquet; table: --input names a table of the Spark catalog)",
    )
    p.add_argument("--run-id", required=True, help="names the run: a re-run with the same id adds nothing twice")
    p.add_argument("--tenant-col", default="tenant", help="tenant column (default tenant)")
    p.add_argument("--payload-col", default="payload", help="payload column: JSON text or a struct (default payload)")
    p.add_argument("--fire-at-col", help="fire_at column (timestamp or ISO text; default: now)")
    p.add_argument("--payload-cols", help="comma-separated columns that make the payload, as one JSON object")
    p.add_argument("--dedup-col", help="dedup key column (default: none)")
    p.add_argument("--traceparent-col", help="W3C traceparent column: each event's trace context (default: none)")
    p.add_argument("--tracestate-col", help="W3C tracestate column (default: none)")
    p.add_argument("--baggage-col", help="W3C baggage column (default: none)")
    p.add_argument("--priority-col", help="priority column, 1 (highest) to 5 (default: the queue's default_priority)")
    p.add_argument("--concurrency-key-col", help="concurrency key column: key_max_in_flight counts it (default: none)")
    p.add_argument("--rate-key-col", help="rate key column: key_max_qps counts it (default: none)")
    p.add_argument("--bad-rows", choices=["fail", "skip"], default="fail", help="fail the run (default) or skip them")
    p.add_argument("--rejects", help="where rejected rows go, Parquet (default: under the work directory)")
    p.add_argument("--work-dir", help="where the run keeps its keyed rows (shared by every executor)")
    p.add_argument(
        "--materialize",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="write the keyed rows once as Parquet before staging (default: only when the source's plan is not a "
        "deterministic scan)",
    )
    p.add_argument("--atomic", action="store_true", help="visible on every shard or none (needs prepared transactions)")
    p.add_argument(
        "--staging-ttl",
        type=duration,
        default=86_400.0,
        metavar="DURATION",
        help="drop staging of runs unfinished this long (default 1 day)",
    )
    p.add_argument(
        "--stage-with",
        choices=["copy", "jdbc"],
        default="copy",
        help="stage by COPY of CSV files Spark writes (default) or through Spark's JDBC writer",
    )
    p.add_argument("--tasks-per-shard", type=int, default=2, help="JDBC write tasks per shard (default 2)")
    p.add_argument("--batch-size", type=int, default=10_000, help="rows per JDBC batch (default 10000)")
    p.add_argument("--stop-after", choices=["validated", "staged"], help="stop early (a dry run: validated)")
    p.add_argument(
        "--wait-for-other-run",
        type=duration,
        default=3600.0,
        metavar="DURATION",
        help="wait this long for another live run of the same --run-id to end, then refuse; 0: refuse at once "
        "(default 1 h)",
    )
    p.add_argument("--jdbc-jar", help="PostgreSQL JDBC driver jar (default: $QM_JDBC_JAR, else Debian's, else Maven)")

    p = with_topology(
        spark.add_parser(
            "recover",
            help="finish or roll back two-phase enqueue runs left prepared",
            description="Finish (or roll back) the prepared transactions that --atomic enqueue runs left on the "
            "shards when they stopped between their prepare and their commit.",
            epilog=examples("qm spark recover", "qm spark recover --run-id orders-2026-01-01"),
        )
    )
    p.add_argument("--run-id", help="only this run (default: every run left prepared --min-age ago)")
    p.add_argument(
        "--min-age",
        type=duration,
        default=60.0,
        metavar="DURATION",
        help="leave younger prepared parts alone (default 1 min)",
    )

    p = with_topology(
        spark.add_parser(
            "cleanup",
            help="drop the staging of enqueue runs left unfinished",
            description="Drop the staging tables of enqueue runs left unfinished for longer than --older-than (a "
            "run that completes drops its own).",
            epilog=examples("qm spark cleanup --older-than 2d"),
        )
    )
    p.add_argument(
        "--older-than",
        type=duration,
        default=86_400.0,
        metavar="DURATION",
        help="unfinished for this long (default 1 day)",
    )

    p = with_topology(
        spark.add_parser(
            "archive",
            help="move acked and failed events settled before a cut-off to Parquet, then delete them",
            description="Archive acked and failed events settled before a cut-off to Parquet under OUTPUT "
            "(partitioned by run, shard, queue and day), verify the files, then delete exactly those rows. "
            "Safe to interrupt: re-run with the same --run-id to finish. See docs/spark-archive.md.",
            epilog=examples("qm spark archive --output /data/qm-archive --older-than 30d"),
        )
    )
    p.add_argument("--output", required=True, help="archive root directory (a local path)")
    cut = p.add_mutually_exclusive_group(required=True)
    cut.add_argument("--older-than", help="settled longer ago than this: 30d, 12h, 90m, 3600 (seconds)")
    cut.add_argument("--before", help="settled before this time: ISO-8601 with offset, e.g. 2026-01-01T00:00:00Z")
    p.add_argument("--queue", action="append", help="only this queue (repeat; default: every queue)")
    p.add_argument("--run-id", help="finish or repeat this run (default: a new run)")
    p.add_argument("--delete-slice", type=int, default=10_000, help="ids deleted per transaction (default 10000)")
    p.add_argument(
        "--rows-per-partition", type=int, default=50_000, help="candidate rows per JDBC read partition (default 50000)"
    )
    p.add_argument("--jdbc-jar", help="PostgreSQL JDBC driver jar (default: $QM_JDBC_JAR, else Debian's)")
    p.add_argument("--json", action="store_true", help="print the outcome as JSON")


def enqueue(args: argparse.Namespace, topology: Topology, run_cli: Callable[..., int]) -> int:
    """``qm spark enqueue``: ``run_cli`` is :func:`spark_jobs.enqueue.run_cli`."""
    return run_cli(args, topology, lambda line: print(line, flush=True))


def recover(args: argparse.Namespace, topology: Topology, recover_runs: Callable[..., dict[str, str]]) -> int:
    """``qm spark recover``: ``recover_runs`` is :func:`spark_jobs.enqueue.recover`."""
    outcome = recover_runs(topology, run_id=args.run_id, min_age=args.min_age)
    for gid, what in sorted(outcome.items()):
        print(f"{gid}: {what}")
    if not outcome:
        print("no two-phase run was left prepared")
    return 0


def cleanup(args: argparse.Namespace, topology: Topology, cleanup_runs: Callable[..., dict[str, int]]) -> int:
    """``qm spark cleanup``: ``cleanup_runs`` is :func:`spark_jobs.enqueue.cleanup`."""
    for shard, n in cleanup_runs(topology, older_than=args.older_than).items():
        age = format_duration(args.older_than)
        print(f"{shard}: {n} run(s) unfinished for more than {age} abandoned (staging dropped)")
    return 0


def archive(args: argparse.Namespace, topology: Topology, run_archive: Callable[..., Any]) -> int:
    """``qm spark archive``: ``run_archive`` is :func:`spark_jobs.archive.run_archive`."""
    out = sys.stderr if args.json else sys.stdout  # with --json, stdout carries the JSON only

    def starting(run_id: str) -> None:
        print(f"archive {run_id}: starting (if it stops early, re-run with --run-id {run_id} to finish it)", file=out)
        out.flush()

    result = run_archive(
        topology,
        older_than=args.older_than,
        before=args.before,
        output=args.output,
        queues=args.queue,
        run_id=args.run_id,
        delete_slice=args.delete_slice,
        rows_per_partition=args.rows_per_partition,
        jdbc_jar=args.jdbc_jar,
        starting=starting,
        progress=lambda p: print(p.line(), file=out, flush=True),
    )
    if args.json:
        print(json.dumps(result.summary(), indent=2))
    else:
        print(result.summary_line())
    return 0


#: each command's function, called with the parsed options, the topology and the job's function
COMMANDS: dict[str, Callable[[argparse.Namespace, Topology, Callable[..., Any]], int]] = {
    "enqueue": enqueue,
    "recover": recover,
    "cleanup": cleanup,
    "archive": archive,
}


def script_main(command: str, job: Callable[..., Any], argv: Sequence[str] | None = None) -> int:
    """``python -m spark_jobs.<command> ARGS``: the same as ``qm spark <command> ARGS``, with ``job``
    the script's own function (see :data:`COMMANDS`)."""
    parser = argparse.ArgumentParser(prog="qm spark")
    register(parser.add_subparsers(dest="spark_command", required=True))
    args = parser.parse_args([command, *(sys.argv[1:] if argv is None else argv)])
    args.func = lambda a: COMMANDS[command](a, topology(a), job)
    logs.configure(logging.WARNING)
    return run(args)
