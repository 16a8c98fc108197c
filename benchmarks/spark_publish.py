"""The Spark publish alone: ``qm.publish_run`` of ``--rows`` staged rows into one shard's queue, with
this checkout's SQL and with another git revision's (``--other REF``, default ``main``), alternated.

What it isolates: the publish's INSERT ... SELECT into the queue table (its indexes, the jsonb parse,
the checks of the queue's rules). The other revision's functions (every file of ``schema/spark/``
and the verify trigger's generator, ``git show REF:<file>``) are applied into the same database,
and the queue's trigger regenerated, before each of its runs; this checkout's before each of ours.
Each run stages the same rows (5 000 tenants, the job's routing) into a fresh stage table with COPY
(not timed), then times ``SELECT qm.publish_run(...)`` and its commit, and the server's CPU seconds
over it. Prints JSON on stdout: per side the seconds, their median and spread, and the ratio of the
medians. ``python -m benchmarks.spark_publish [--rows N] [--reps N] [--other REF]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psycopg
from psycopg.conninfo import make_conninfo

from benchmarks.lib.server import ServerCpu, bench_server, server_info
from queue_manager import admin
from queue_manager.db.migrate import set_identity, upgrade
from queue_manager.domain.routing import shuffle_set
from queue_manager.domain.topology import KeyRange, Shard, Topology

logger = logging.getLogger("bench")
QUEUE = "bulk"
#: the Spark publish's functions (every file of schema/spark/) and the verify trigger's generator
SPARK_DIR = "queue_manager/db/sql/schema/spark"
VERIFY = "queue_manager/db/sql/schema/queue_triggers/verify_source.sql"
ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def sources(ref: str | None) -> list[str]:
    """The functions' SQL at ``ref`` (None: this checkout's files)."""
    if ref is None:
        names = sorted(str(p.relative_to(ROOT)) for p in (ROOT / SPARK_DIR).glob("*.sql"))
        return [(ROOT / f).read_text(encoding="utf-8") for f in [*names, VERIFY]]
    names = sorted(_git("ls-tree", "--name-only", f"{ref}:{SPARK_DIR}").split())
    return [_git("show", f"{ref}:{f}") for f in [*(f"{SPARK_DIR}/{n}" for n in names), VERIFY]]


def use(dsn: str, code: list[str]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for text in code:
            conn.execute(text)  # type: ignore[arg-type]
        conn.execute("SELECT qm.apply_queue(id) FROM qm.queues")


def stage(dsn: str, run: str, rows: int) -> None:
    """A run staged with ``rows`` good rows, as the job's COPY staging leaves it."""
    sets = {f"tenant-{i}": shuffle_set(f"tenant-{i}", 16, 4) for i in range(5000)}
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"TRUNCATE {QUEUE}")
        row = conn.execute("SELECT stage_table FROM qm.stage_run(%s, %s)", (run, QUEUE)).fetchone()
        assert row is not None
        with conn.cursor().copy(
            f"COPY qm.{row[0]} (row_key, tenant, partition, payload) FROM STDIN"  # type: ignore[arg-type]
        ) as copy:
            for i in range(rows):
                tenant = f"tenant-{i % 5000}"
                copy.write_row((i, tenant, sets[tenant][i % 4], f'{{"n": {i}, "kind": "bulk"}}'))
        conn.execute("SELECT * FROM qm.staged_run(%s, %s)", (run, QUEUE))
        conn.execute("CHECKPOINT")


def publish(dsn: str, run: str, meter: ServerCpu) -> tuple[float, float]:
    before = meter.read()
    t = time.perf_counter()
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT qm.publish_run(%s, %s)", (run, QUEUE)).fetchone()
        conn.commit()
    elapsed = time.perf_counter() - t
    assert row is not None and row[0] is not None
    return elapsed, meter.read() - before


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=500_000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--other", default="main", help="git revision to compare with (default main)")
    parser.add_argument("--dsn", help="administrative database of an existing server (default: an embedded one)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")
    sides = {"this": sources(None), args.other: sources(args.other)}
    with bench_server(args.dsn, "spark-publish") as (admin_dsn, base_dsn):
        dbname = f"{psycopg.conninfo.conninfo_to_dict(base_dsn)['dbname']}_pub"
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{dbname}"')  # type: ignore[arg-type]
        dsn = make_conninfo(admin_dsn, dbname=dbname)
        topology = Topology((Shard("s0", dsn, KeyRange.parse("-")),))
        upgrade(dsn)
        set_identity(dsn, topology.shards[0], topology)
        admin.create_queue(topology, QUEUE, {"partitions": 16, "shuffle": 4})
        meter = ServerCpu(dsn)
        seconds: dict[str, list[float]] = {side: [] for side in sides}
        cpu: dict[str, list[float]] = {side: [] for side in sides}
        for rep in range(args.reps):
            for side, code in sides.items():
                use(dsn, code)
                run = f"pub-{rep}-{len(seconds[side])}-{side.replace('/', '-')}"[:64]
                stage(dsn, run, args.rows)
                logger.info("rep %d: %s", rep, side)
                elapsed, used = publish(dsn, run, meter)
                seconds[side].append(elapsed)
                cpu[side].append(used)
        out = {
            "benchmark": "spark_publish",
            "rows": args.rows,
            "reps": args.reps,
            "server": server_info(dsn),
            **{
                side: {
                    "seconds": [round(s, 2) for s in seconds[side]],
                    "median_s": round(statistics.median(seconds[side]), 2),
                    "postgres_cpu_s": [round(c, 2) for c in cpu[side]],
                    "postgres_cpu_median_s": round(statistics.median(cpu[side]), 2),
                }
                for side in sides
            },
            "this_vs_other_time": round(statistics.median(seconds[args.other]) / statistics.median(seconds["this"]), 2),
            "this_vs_other_cpu": round(statistics.median(cpu[args.other]) / statistics.median(cpu["this"]), 2),
        }
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')  # type: ignore[arg-type]
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
