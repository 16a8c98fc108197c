"""Throughput of ``qm queue adopt`` (queue_manager.adopt) from a legacy table into two shards.

Prints one JSON object on stdout (logs go to stderr): for each slice size, the rows per second of
runs that move ``--rows`` legacy rows (1 000 tenants, a payload of about 100 bytes, a run-at in the
past) from a legacy database into a queue of two shards (16 partitions, 4 per tenant), repeated
``--repeats`` times (median, min, max). The legacy database and both shards are databases of one
PostgreSQL server: unless ``--dsn`` names the administrative database of an existing server, an
embedded server with the default durability (fsync and synchronous_commit on) is started in a
temporary directory and stopped at the end.

    .venv/bin/python -m benchmarks.adopt [--rows 100000] [--slices 100,500,2000] [--repeats 3] [--dsn URI]
                                         [--mark [--index]]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from benchmarks.lib.machine import machine_info
from benchmarks.lib.server import bench_server, server_info
from queue_manager import admin
from queue_manager.adopt import AdoptOptions, adopt
from queue_manager.db.migrate import set_identity, upgrade
from queue_manager.domain.adopt import AdoptMapping
from queue_manager.domain.topology import KeyRange, Shard, Topology

logger = logging.getLogger("bench")
QUEUE = "bench_adopt"
LEGACY = """
CREATE TABLE jobs (
    id       bigserial PRIMARY KEY,
    customer text NOT NULL,
    args     jsonb NOT NULL,
    run_at   timestamptz NOT NULL,
    status   text NOT NULL DEFAULT 'pending'
)"""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=100_000, help="legacy rows per run")
    p.add_argument("--slices", default="100,500,2000", help="slice sizes to measure, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="runs per slice size")
    p.add_argument(
        "--mark",
        action="store_true",
        help="take rows by marking them (--filter status=pending --mark status=adopted) instead of deleting them",
    )
    p.add_argument("--index", action="store_true", help="with --mark: a partial index on the pending rows' ids")
    p.add_argument("--dsn", help="administrative database of an existing server (default: an embedded server)")
    return p.parse_args(argv)


def create_databases(admin_dsn: str, base: str, names: Sequence[str]) -> list[str]:
    out = []
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        for name in names:
            full = f"{base}_{name}"
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(full)))
            out.append(full)
    return out


def fill_legacy(dsn: str, rows: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE jobs")
        conn.execute(
            "INSERT INTO jobs (customer, args, run_at) "
            "SELECT 'tenant-' || (n %% 1000), jsonb_build_object('n', n, 'pad', repeat('x', 80)), "
            "now() - interval '1 hour' FROM generate_series(1, %s) n",
            (rows,),
        )
        conn.execute("VACUUM ANALYZE jobs")


def empty_queue(topology: Topology) -> None:
    for shard in topology.shards:
        with psycopg.connect(shard.dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("TRUNCATE {}").format(sql.Identifier(QUEUE)))
            conn.execute("SELECT qm.reconcile_load(%s)", (QUEUE,))
            conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(QUEUE)))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")
    slices = [int(s) for s in args.slices.split(",")]
    with bench_server(args.dsn, "adopt") as (admin_dsn, dsn):
        base = str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"])
        extra = create_databases(admin_dsn, base, ["s1", "legacy"])
        try:
            s1 = make_conninfo(admin_dsn, dbname=extra[0])
            legacy = make_conninfo(admin_dsn, dbname=extra[1])
            topology = Topology((Shard("s0", dsn, KeyRange.parse("-80")), Shard("s1", s1, KeyRange.parse("80-"))))
            for shard in topology.shards:
                upgrade(shard.dsn)
                set_identity(shard.dsn, shard, topology)
            admin.create_queue(topology, QUEUE, {"partitions": 16, "shuffle": 4})
            with psycopg.connect(legacy, autocommit=True) as conn:
                conn.execute(LEGACY)
                if args.index:
                    conn.execute("CREATE INDEX jobs_pending ON jobs (id) WHERE status = 'pending'")
            take: dict[str, Any] = {"filters": [("status", "pending")], "marks": [("status", "adopted")]}
            mapping = AdoptMapping.build(
                "jobs", payload_col="args", tenant_col="customer", run_at_col="run_at", **(take if args.mark else {})
            )
            results: dict[str, Any] = {}
            for size in slices:
                runs = []
                for i in range(args.repeats):
                    fill_legacy(legacy, args.rows)
                    empty_queue(topology)
                    started = time.perf_counter()
                    report = adopt(topology, QUEUE, legacy, mapping, AdoptOptions(slice_rows=size))
                    elapsed = time.perf_counter() - started
                    assert report.adopted == args.rows, report
                    runs.append(round(args.rows / elapsed))
                    logger.info("slice %d run %d: %d rows in %.2f s (%d rows/s)", size, i, args.rows, elapsed, runs[-1])
                results[str(size)] = {
                    "rows_per_second": runs,
                    "median": statistics.median(runs),
                    "min": min(runs),
                    "max": max(runs),
                }
            info = server_info(dsn)
        finally:
            with psycopg.connect(admin_dsn, autocommit=True) as conn:
                for name in extra:
                    conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
    report_json = {
        "benchmark": "adopt",
        "rows": args.rows,
        "take": ("mark" if args.mark else "delete") + (" with a partial index" if args.index else ""),
        "tenants": 1000,
        "shards": 2,
        "partitions": 16,
        "shuffle": 4,
        "by_slice_rows": results,
        "server": info,
        "machine": machine_info(),
    }
    print(json.dumps(report_json, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
