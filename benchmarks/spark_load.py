"""Spark bulk enqueue: rows/s of the whole job next to Spark's plain JDBC writer and psycopg COPY.

One embedded PostgreSQL server (default durability) holds two shard databases (``s0``: ``-80``,
``s1``: ``80-``) with one queue (16 partitions, shuffle 4) and a plain table of the same columns.
The source is ``--rows`` events (tenant, a small struct payload) written once to Parquet. Measured,
alternating, ``--reps`` times each:

* ``job``: :func:`spark_jobs.enqueue.load_events` with a fresh run id: route and check, stage
  (``--stage-with``: COPY of the CSV files one Spark pass writes, the default, or Spark's JDBC
  writer), validate, publish per shard (the whole job, wall clock; ``job_steps_seconds_from_start``
  says when each of its progress lines came);
* ``plain_jdbc``: the same Parquet rows, each with its shard's routing columns computed the same
  way, written by ``DataFrame.write.jdbc`` into a plain table (no index, no trigger) on each shard
  with the writer's defaults (1 000-row batches, statements not rewritten): what a pipeline that
  writes straight to a table does;
* ``tuned_jdbc``: the same, with the job's own JDBC batching (``reWriteBatchedInserts``, the same
  batch size and tasks per shard): what Spark's JDBC path alone costs at its best;
* ``copy``: the same number of rows streamed from Python with psycopg ``COPY`` into the plain
  tables (one connection per shard, one after the other);
* ``queue_jdbc`` (and ``queue_jdbc_tuned``, the job's batching): Spark's JDBC writer straight into
  the queue table, the partition picked by its routing trigger (:func:`run_queue_jdbc`): what a
  data team writes without the job. Target: the job at least 1.5x it (``job_vs_queue_jdbc``);
* ``queue_copy``: psycopg ``COPY`` into the queue table, partitions computed beforehand
  (:func:`run_queue_copy`): the limit for a table with the queue's indexes and checks. Target: the
  job at least 0.6x it (``job_vs_queue_copy``).

A manager runs for each shard during the job (``qm manager``): its CPU seconds during the runs
are reported (it should hear one wake-up per shard and publish, and scan only its window). Every
path also reports the CPU seconds it cost Spark's JVM, this Python process and the PostgreSQL
server (``cpu_seconds``; the server's include the managers' sessions during the job): on a
2-core machine shared with others, what a path costs is clearer in CPU than in wall time.
Prints JSON on stdout. ``make bench-spark``.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo
from pyspark.sql import functions as F

from benchmarks.lib.server import ServerCpu, bench_server, proc_cpu_seconds, server_info
from queue_manager import admin
from queue_manager.db.migrate import set_identity, upgrade
from queue_manager.domain.topology import KeyRange, Shard, Topology
from queue_manager.local import fleet
from spark_jobs import enqueue as ej
from spark_jobs import routing as sr
from spark_jobs.jdbc import shard_jdbc_target
from spark_jobs.session import spark_session

logger = logging.getLogger("bench")
QUEUE = "bulk"
PLAIN = "plain_events"


class CpuMeter:
    """CPU seconds used by the load's three parts: Spark (its JVM: the driver and, in local mode, the
    executors), this Python process, and the PostgreSQL server (the postmaster, its live processes
    and the backends it has reaped). On a shared machine CPU seconds move much less than wall time
    when others run, so they say what each path costs, next to its time."""

    def __init__(self, spark: Any, dsn: str) -> None:
        self.jvm_pid = int(spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid())
        self.pg = ServerCpu(dsn)

    def read(self) -> dict[str, float]:
        return {"spark": proc_cpu_seconds(self.jvm_pid), "python": time.process_time(), "postgres": self.pg.read()}


@contextmanager
def managers(topology: Topology, topo_file: Path) -> Iterator[list[fleet.ManagerProcess]]:
    tokens = fleet.write_tokens(
        topo_file.with_name("tokens.toml"), [fleet.Token("bench", "bench-secret-0123456789abcdef")]
    )
    procs: list[fleet.ManagerProcess] = []
    try:
        for s in topology.shards:
            procs.append(
                fleet.ManagerProcess(topo_file, tokens, s.name, log=topo_file.with_name(f"manager-{s.name}.log"))
            )
        time.sleep(3.0)  # elected and idle
        for p in procs:
            if not p.alive():
                raise RuntimeError(f"the manager of {p.shard} exited: {p.log.read_text()[-2000:] if p.log else ''}")
        yield procs
    finally:
        for p in procs:
            p.signal(signal.SIGTERM)
        for p in procs:
            p.stop(30)


def setup(admin_dsn: str, base_dsn: str) -> Topology:
    shards = []
    for name, spec in (("s0", "-80"), ("s1", "80-")):
        dbname = f"{psycopg.conninfo.conninfo_to_dict(base_dsn)['dbname']}_{name}"
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{dbname}"')
        shards.append(Shard(name, make_conninfo(admin_dsn, dbname=dbname), KeyRange.parse(spec)))
    topology = Topology(tuple(shards))
    for s in topology.shards:
        upgrade(s.dsn)
        set_identity(s.dsn, s, topology)
        with psycopg.connect(s.dsn, autocommit=True) as conn:
            conn.execute(
                f"CREATE TABLE {PLAIN} (tenant text, partition smallint, payload jsonb, fire_at timestamptz, "
                "dedup_key text)"
            )
    admin.create_queue(topology, QUEUE, {"partitions": 16, "shuffle": 4})
    return topology


def reset(topology: Topology) -> None:
    for s in topology.shards:
        with psycopg.connect(s.dsn, autocommit=True) as conn:
            conn.execute(f"TRUNCATE {QUEUE}, {PLAIN}")
            conn.execute("SELECT qm.cleanup_spark_runs('0 s')")  # any stage table left by a failed run
            conn.execute("TRUNCATE qm.spark_runs")
            conn.execute(f"SELECT qm.reconcile_load('{QUEUE}')")
            conn.execute("CHECKPOINT")


def run_job(
    spark: Any,
    source: str,
    topology: Topology,
    work: str,
    rep: int,
    args: argparse.Namespace,
    steps: list[dict[str, Any]],
    meter: CpuMeter,
) -> float:
    """The whole job, wall clock; ``steps`` gets, at each of its progress lines (``<stage> <shard>``),
    the seconds from the start and the CPU seconds Spark and PostgreSQL have used since: where the
    time goes."""
    df = spark.read.parquet(source)
    t = time.perf_counter()
    start = meter.read()
    seen: dict[str, Any] = {}

    def progress(stage: str, shard: str, n: int) -> None:
        now = meter.read()
        seen[f"{stage} {shard}"] = {
            "s": round(time.perf_counter() - t, 2),
            "spark_cpu": round(now["spark"] - start["spark"], 2),
            "postgres_cpu": round(now["postgres"] - start["postgres"], 2),
        }

    result = ej.load_events(
        df,
        topology,
        QUEUE,
        run_id=f"bench-{rep}",
        work_dir=work,
        stage_with=args.stage_with,
        tasks_per_shard=args.tasks_per_shard,
        batch_size=args.batch_size,
        progress=progress,
    )
    elapsed = time.perf_counter() - t
    steps.append({**seen, "done": {"s": round(elapsed, 2)}})
    if result.published != result.rows:
        raise RuntimeError(f"published {result.published} of {result.rows}")
    return elapsed


def _jdbc_write(
    spark: Any, source: str, topology: Topology, tasks: int, batch: int | None, table: str, plain: bool
) -> float:
    """Spark's JDBC writer into ``table`` on each shard, each shard's rows filtered by its key range:
    with ``plain``, the routing columns computed (a partition of the tenant's set); without, the
    tenant and the payload only. ``batch`` None: the writer's defaults (1 000-row batches, no
    rewritten inserts)."""
    df = spark.read.parquet(source)
    t = time.perf_counter()
    tenant = F.col("tenant")
    columns = (
        [
            tenant,
            F.element_at(sr.shuffle_set(tenant, 16, 4), 1).cast("short").alias("partition"),
            F.to_json("payload").alias("payload"),
            F.lit(None).cast("string").alias("fire_at"),
            F.lit(None).cast("string").alias("dedup_key"),
        ]
        if plain
        else [tenant, F.to_json("payload").alias("payload")]
    )
    for s in topology.shards:
        target = shard_jdbc_target(s.dsn)
        props = {**target.properties, "stringtype": "unspecified"}
        if batch is not None:
            props.update({"batchsize": str(batch), "reWriteBatchedInserts": "true"})
        (
            df.filter(sr.in_key_range(tenant, s.key_range.start, s.key_range.end))
            .select(*columns)
            .repartition(tasks)
            .write.jdbc(target.url, table, mode="append", properties=props)
        )
    return time.perf_counter() - t


def run_plain_jdbc(spark: Any, source: str, topology: Topology, tasks: int, batch: int | None) -> float:
    """Into a plain table (no index, no trigger): what Spark's JDBC path alone costs."""
    return _jdbc_write(spark, source, topology, tasks, batch, PLAIN, plain=True)


def run_queue_jdbc(spark: Any, source: str, topology: Topology, tasks: int, batch: int | None) -> float:
    """Spark's JDBC writer straight into the queue table, without a partition: the queue's routing
    trigger picks one per row (the least loaded of the tenant's set) and its verify trigger checks
    each statement's rows. What a data team writes without the job: not idempotent (a retried task
    inserts its rows again), a failed job leaves the tasks that committed."""
    return _jdbc_write(spark, source, topology, tasks, batch, QUEUE, plain=False)


def run_queue_copy(topology: Topology, rows: int) -> float:
    """psycopg ``COPY`` of the same rows into the queue table, with each row's shard and partition
    computed in Python beforehand (outside the clock, as the job's routing is part of its Spark
    pass): the queue table's own cost (its indexes, the verify trigger, the jsonb parse) at the
    speed of COPY, one connection per shard, one after the other. The limit for a table with the
    queue's indexes and checks."""
    from queue_manager.domain.routing import shuffle_set

    sets = {f"tenant-{i}": shuffle_set(f"tenant-{i}", 16, 4) for i in range(5000)}
    per_shard: dict[str, list[tuple[str, int, str]]] = {s.name: [] for s in topology.shards}
    for i in range(rows):
        tenant = f"tenant-{i % 5000}"
        shard = topology.shard_for(tenant).name
        per_shard[shard].append((tenant, sets[tenant][i % 4], f'{{"n": {i}, "kind": "bulk"}}'))
    t = time.perf_counter()
    for s in topology.shards:
        with psycopg.connect(s.dsn) as conn, conn.cursor() as cur:
            with cur.copy(f"COPY {QUEUE} (tenant, partition, payload) FROM STDIN") as copy:
                for row in per_shard[s.name]:
                    copy.write_row(row)
            conn.commit()
    return time.perf_counter() - t


def run_copy(topology: Topology, rows: int) -> float:
    t = time.perf_counter()
    for s in topology.shards:
        with psycopg.connect(s.dsn) as conn, conn.cursor() as cur:
            with cur.copy(f"COPY {PLAIN} (tenant, partition, payload) FROM STDIN") as copy:
                for i in range(rows // len(topology.shards)):
                    copy.write_row((f"tenant-{i % 5000}", i % 16, f'{{"n": {i}, "kind": "bulk"}}'))
            conn.commit()
    return time.perf_counter() - t


def summary(samples: list[float], rows: int) -> dict[str, Any]:
    rates = [rows / s for s in samples]
    return {
        "seconds": [round(s, 2) for s in samples],
        "rows_per_s_median": round(statistics.median(rates)),
        "rows_per_s_min": round(min(rates)),
        "rows_per_s_max": round(max(rates)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tasks-per-shard", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=10_000)
    parser.add_argument("--stage-with", choices=["copy", "jdbc"], default="copy", help="the job's staging")
    parser.add_argument("--no-managers", action="store_true", help="do not run a manager per shard")
    parser.add_argument("--dsn", help="administrative database of an existing server (default: an embedded one)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")

    tmp = Path(tempfile.mkdtemp(prefix="qm-bench-spark-"))
    spark = spark_session("qm-bench-spark")
    spark.sparkContext.setLogLevel("ERROR")
    try:
        with bench_server(args.dsn, "spark") as (admin_dsn, base_dsn):
            topology = setup(admin_dsn, base_dsn)
            topo_file = tmp / "topology.toml"
            topo_file.write_text(topology.to_toml())
            source = str(tmp / "source")
            spark.range(args.rows).select(
                F.concat(F.lit("tenant-"), (F.col("id") % 5000).cast("string")).alias("tenant"),
                F.struct(F.col("id").alias("n"), F.lit("bulk").alias("kind")).alias("payload"),
            ).write.parquet(source)
            samples: dict[str, list[float]] = {
                kind: []
                for kind in ("job", "queue_jdbc", "queue_jdbc_tuned", "queue_copy", "plain_jdbc", "tuned_jdbc", "copy")
            }
            cpu: dict[str, list[dict[str, float]]] = {kind: [] for kind in samples}
            meter = CpuMeter(spark, topology.shards[0].dsn)
            manager_cpu: list[float] = []
            steps: list[dict[str, Any]] = []
            for rep in range(args.reps):
                for kind in samples:
                    reset(topology)
                    logger.info("rep %d: %s", rep, kind)
                    before = meter.read()
                    if kind == "job":
                        work = str(tmp / f"work-{rep}")
                        if args.no_managers:
                            samples[kind].append(run_job(spark, source, topology, work, rep, args, steps, meter))
                        else:
                            with managers(topology, topo_file) as procs:
                                managers_before = sum(proc_cpu_seconds(p.pid) for p in procs)
                                samples[kind].append(run_job(spark, source, topology, work, rep, args, steps, meter))
                                manager_cpu.append(sum(proc_cpu_seconds(p.pid) for p in procs) - managers_before)
                        shutil.rmtree(work, ignore_errors=True)
                    elif kind == "queue_jdbc":
                        samples[kind].append(run_queue_jdbc(spark, source, topology, args.tasks_per_shard, None))
                    elif kind == "queue_jdbc_tuned":
                        samples[kind].append(
                            run_queue_jdbc(spark, source, topology, args.tasks_per_shard, args.batch_size)
                        )
                    elif kind == "queue_copy":
                        samples[kind].append(run_queue_copy(topology, args.rows))
                    elif kind == "plain_jdbc":
                        samples[kind].append(run_plain_jdbc(spark, source, topology, args.tasks_per_shard, None))
                    elif kind == "tuned_jdbc":
                        samples[kind].append(
                            run_plain_jdbc(spark, source, topology, args.tasks_per_shard, args.batch_size)
                        )
                    else:
                        samples[kind].append(run_copy(topology, args.rows))
                    after = meter.read()
                    cpu[kind].append({part: round(after[part] - before[part], 2) for part in after})
            out = {
                "benchmark": "spark_load",
                "rows": args.rows,
                "shards": 2,
                "reps": args.reps,
                "tasks_per_shard": args.tasks_per_shard,
                "batch_size": args.batch_size,
                "stage_with": args.stage_with,
                "server": server_info(topology.shards[0].dsn),
                **{k: {**summary(v, args.rows), "cpu_seconds": cpu[k]} for k, v in samples.items()},
                # the targets (docs/spark.md): at least 1.5x the JDBC writer into the queue table, at
                # least 0.6x COPY into it; a ratio per alternated rep too (the machine's noise moves both)
                "job_vs_queue_jdbc": round(
                    statistics.median(samples["queue_jdbc"]) / statistics.median(samples["job"]), 2
                ),
                "job_vs_queue_jdbc_tuned": round(
                    statistics.median(samples["queue_jdbc_tuned"]) / statistics.median(samples["job"]), 2
                ),
                "job_vs_queue_copy": round(
                    statistics.median(samples["queue_copy"]) / statistics.median(samples["job"]), 2
                ),
                "job_vs_queue_jdbc_per_rep": [
                    round(b / j, 2) for b, j in zip(samples["queue_jdbc"], samples["job"], strict=True)
                ],
                "job_vs_queue_copy_per_rep": [
                    round(b / j, 2) for b, j in zip(samples["queue_copy"], samples["job"], strict=True)
                ],
                "job_vs_plain_jdbc": round(
                    statistics.median(samples["plain_jdbc"]) / statistics.median(samples["job"]), 2
                ),
                "job_vs_tuned_jdbc": round(
                    statistics.median(samples["tuned_jdbc"]) / statistics.median(samples["job"]), 2
                ),
                "job_vs_copy": round(statistics.median(samples["copy"]) / statistics.median(samples["job"]), 2),
                "manager_cpu_seconds_during_job": [round(c, 2) for c in manager_cpu],
                "job_steps_seconds_from_start": steps,
            }
            for s in topology.shards:
                with psycopg.connect(admin_dsn, autocommit=True) as conn:
                    conn.execute(
                        f'DROP DATABASE IF EXISTS "{psycopg.conninfo.conninfo_to_dict(s.dsn)["dbname"]}" WITH (FORCE)'
                    )
    finally:
        spark.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
