"""Throughput of the archive job (spark_jobs.archive) on two shards.

Prints one JSON object on stdout (logs go to stderr): the time of each step of one archive run of
``--rows`` settled events (half per shard; four in five acked, one in five failed, settled 8 to
12 days ago, with a 100-byte payload) next to a quarter as many live events that must stay, and
rows per second for the whole run, the read-and-write step and the delete step.

Both shards are databases of one PostgreSQL server: unless ``--dsn`` names the administrative
database of an existing server, an embedded server with the default durability (fsync and
synchronous_commit on) is started in a temporary directory and stopped at the end. Spark runs in
this process (``local[2]``, as ``qm spark archive`` does); its start-up is reported apart.

    .venv/bin/python -m benchmarks.archive [--rows 200000] [--dsn URI] [--delete-slice 10000]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from benchmarks.lib import server
from benchmarks.lib.machine import machine_info
from benchmarks.lib.server import bench_server, server_info, tenants_for
from queue_manager import admin
from queue_manager.domain.topology import Topology
from queue_manager.producer import Event, enqueue_batch

logger = logging.getLogger("bench")
QUEUE = "bench_archive"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=200_000, help="settled events to archive, both shards together")
    p.add_argument("--dsn", help="administrative database of an existing server (default: an embedded server)")
    p.add_argument("--delete-slice", type=int, default=10_000)
    p.add_argument("--rows-per-partition", type=int, default=50_000)
    return p.parse_args(argv)


def two_shards(admin_dsn: str, first_dsn: str) -> tuple[Topology, str]:
    """A two-shard topology with the queue: the given database and a second one on the same server
    (returned to drop)."""
    topology, second = server.two_shards(admin_dsn, first_dsn)
    admin.create_queue(topology, QUEUE, {"partitions": 16, "shuffle": 4})
    return topology, second


def populate(topology: Topology, rows: int) -> dict[str, Any]:
    """Settled events to archive and live ones to keep, on each shard; returns sizes."""
    per_shard = rows // len(topology.shards)
    live = per_shard // 4
    table_bytes = 0
    for shard in topology.shards:
        tenants = tenants_for(shard.key_range, 200)
        # a note of 64 hex digits: about 100 bytes of payload that compresses like real data, not like "xxx"
        events = [
            Event(tenants[i % len(tenants)], {"order": i, "note": hashlib.sha256(b"%d" % i).hexdigest()})
            for i in range(per_shard + live)
        ]
        with psycopg.connect(shard.dsn) as conn:
            enqueue_batch(conn, QUEUE, events)
            conn.commit()
            # the first per_shard rows (by id) settle 8-12 days ago: four in five acked, one failed
            conn.execute(
                sql.SQL(
                    """UPDATE {q} SET attempts = 1,
                           state = CASE WHEN id %% 5 = 0 THEN 'failed' ELSE 'acked' END::qm.event_state,
                           fired_at = now() - make_interval(days => 8 + id::int %% 5, secs => 1),
                           acked_at = CASE WHEN id %% 5 = 0 THEN NULL
                                           ELSE now() - make_interval(days => 8 + id::int %% 5) END
                     WHERE id <= (SELECT min(id) FROM {q}) + %s - 1"""
                ).format(q=sql.Identifier(QUEUE)),
                [per_shard],
            )
            conn.commit()
            conn.autocommit = True
            conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(QUEUE)))
            row = conn.execute("SELECT pg_total_relation_size(%s)", [QUEUE]).fetchone()
            table_bytes += int(row[0]) if row else 0
    return {"per_shard": per_shard, "live_per_shard": live, "table_bytes": table_bytes}


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    # pyspark only here: the other benchmarks run without it
    from spark_jobs.archive import archive_events
    from spark_jobs.session import spark_session

    out_dir = Path(tempfile.mkdtemp(prefix="qm-bench-archive-out-"))
    try:
        return run(args, out_dir, archive_events, spark_session)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def run(args: argparse.Namespace, out_dir: Path, archive_events: Any, spark_session: Any) -> int:
    """One archive run into ``out_dir``; prints the report."""
    with bench_server(args.dsn, "archive") as (admin_dsn, dsn):
        topology, second = two_shards(admin_dsn, dsn)
        try:
            t0 = time.monotonic()
            sizes = populate(topology, args.rows)
            logger.info("loaded %s rows in %.1fs", args.rows, time.monotonic() - t0)
            info = server_info(dsn)
            t0 = time.monotonic()
            spark = spark_session("qm-bench-archive")
            spark.sparkContext.setLogLevel("ERROR")
            spark_start = time.monotonic() - t0
            marks: list[tuple[float, Any]] = []  # (time, ArchiveProgress)
            try:
                start = time.monotonic()
                result = archive_events(
                    spark,
                    topology,
                    older_than=timedelta(days=7),
                    output=out_dir,
                    run_id="bench",
                    delete_slice=args.delete_slice,
                    rows_per_partition=args.rows_per_partition,
                    progress=lambda p: marks.append((time.monotonic(), p)),
                )
                total = time.monotonic() - start
            finally:
                spark.stop()
            left = 0
            for shard in topology.shards:
                with psycopg.connect(shard.dsn) as conn:
                    row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(QUEUE))).fetchone()
                    left += int(row[0]) if row else 0
        finally:
            with psycopg.connect(admin_dsn, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(second)))
    archive_bytes = sum(f.stat().st_size for f in out_dir.rglob("*.parquet"))
    files = sum(1 for _ in out_dir.rglob("*.parquet"))

    def last(stage: str) -> float:
        return max(t for t, p in marks if p.stage == stage)

    steps = {
        "plan": last("planned") - start,
        "read_write_readback": last("written") - last("planned"),
        "verify_commit": last("committed") - last("written"),
        "delete": start + total - last("committed"),
    }
    report = {
        "benchmark": "archive",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        **info,
        "params": {
            "rows": args.rows,
            "shards": len(topology.shards),
            "delete_slice": args.delete_slice,
            "rows_per_partition": args.rows_per_partition,
            "spark_master": "local[2]",
        },
        "sizes": {**sizes, "archive_bytes": archive_bytes, "parquet_files": files},
        "archived": result.archived,
        "deleted": result.deleted,
        "rows_left_in_shards": left,
        "seconds": {"spark_start": round(spark_start, 2), "total": round(total, 2)}
        | {k: round(v, 2) for k, v in steps.items()},
        "rows_per_second": {
            "total": round(result.archived / total),
            "read_write_readback": round(result.archived / steps["read_write_readback"]),
            "delete": round(result.deleted / steps["delete"]),
        },
    }
    print(json.dumps(report, indent=2))
    if result.archived != args.rows // 2 * 2 or result.deleted != result.archived:
        print("unexpected counts: the run did not archive and delete every settled row", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
