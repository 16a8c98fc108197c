"""Archive settled events to Parquet, then delete them from the shards.

    spark-submit --jars /usr/share/java/postgresql.jar spark_jobs/archive.py --topology T --output DIR --older-than 30d
    python -m spark_jobs.archive --topology T --output DIR --older-than 30d      # same as: qm spark archive ...

From Python: :func:`archive_events`. A run goes through these steps; each is safe to interrupt,
and re-running the same run id finishes the job (docs/spark-archive.md has the full argument):

1. **plan** (first start only): the cut-off and, per shard and queue, the highest id and the
   candidates' id range, in one snapshot per shard; saved as ``run=<run>/_plan.json``. Re-runs
   use the saved plan.
2. **read and write**: every shard not yet committed is read through JDBC in parallel
   (partitioned on ``id``) into a fresh staging directory, as Parquet partitioned by shard,
   queue and day. Rows are counted as they stream into the writer.
3. **verify**: the staged files are read back; per shard and queue the rows written must equal
   the rows read, each id once, none above the plan's bound.
4. **commit**: per shard, the files are synced, the manifest is written inside the staged
   directory, and one rename moves it to ``run=<run>/shard=<shard>``.
5. **delete**: the ids are read back from the committed Parquet, checked against the manifest
   and deleted in slices (one transaction each), each row only while it is still settled before
   the cut-off. ``_deleted.json`` then marks the shard finished.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import reduce
from pathlib import Path
from typing import Any, LiteralString

import psycopg
from psycopg import sql
from pyspark.sql import DataFrame, Observation, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from queue_manager.db.sqlfiles import query
from queue_manager.domain.topology import Shard, Topology
from queue_manager.errors import ArchiveError, ConfigurationError, TopologyError, UnknownQueueError
from spark_jobs.archive_plan import (
    DEFAULT_DELETE_SLICE,
    DEFAULT_ROWS_PER_PARTITION,
    KEPT_IDS_LISTED,
    MANIFEST_NAME,
    PLAN_NAME,
    ArchiveLayout,
    DeletionRecord,
    QueuePlan,
    RunPlan,
    ShardManifest,
    WrittenStats,
    check_older_than,
    check_queues,
    check_run_id,
    check_sizes,
    id_slices,
    manifest_for,
    new_run_id,
    parse_age,
    parse_time,
    read_partitions,
    resolve_cutoff,
    verify_shard,
)
from spark_jobs.jdbc import JdbcTarget, shard_jdbc_target
from spark_jobs.session import job_session

logger = logging.getLogger(__name__)

SQL_FILE = "archive.sql"
#: rows the JDBC driver fetches per round trip (without it, PostgreSQL's driver buffers the whole result)
JDBC_FETCH_SIZE = 10_000

#: session settings while the archive is written: timestamps as the standard INT64 microseconds
#: (Spark's default, INT96, is deprecated in Parquet and misread by some readers), compressed with zstd
PARQUET_WRITE_CONF = {
    "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
    "spark.sql.parquet.compression.codec": "zstd",
}

#: the columns of the archived rows, as stored in the Parquet files
DATA_SCHEMA = StructType(
    [
        StructField("id", LongType(), False),
        StructField("tenant", StringType(), True),
        StructField("partition", ShortType(), True),
        StructField("fire_at", TimestampType(), True),
        StructField("state", StringType(), True),
        StructField("attempts", IntegerType(), True),
        StructField("payload", StringType(), True),
        StructField("dedup_key", StringType(), True),
        StructField("created_at", TimestampType(), True),
        StructField("fired_at", TimestampType(), True),
        StructField("acked_at", TimestampType(), True),
        StructField("ack_deadline", TimestampType(), True),
        StructField("fired_term", LongType(), True),
        StructField("last_error", StringType(), True),
        # the W3C trace context the producer stored (NULL: none; NULL too in files archived before
        # these columns were)
        StructField("traceparent", StringType(), True),
        StructField("tracestate", StringType(), True),
        StructField("baggage", StringType(), True),
        StructField("settled_at", TimestampType(), True),
    ]
)
#: the partition columns, outermost first; all text (the day is ``yyyy-mm-dd``, UTC)
PARTITION_COLUMNS = ("run", "shard", "queue", "day")


def archive_schema(partitions: Sequence[str] = PARTITION_COLUMNS) -> StructType:
    """The archive's schema: the data columns, then the given partition columns as strings.

    Reading with this schema (rather than letting Spark infer it) keeps a shard or run name that
    looks like a number a string.
    """
    return StructType([*DATA_SCHEMA.fields, *(StructField(p, StringType(), True) for p in partitions)])


def read_archive(spark: SparkSession, output: str | Path) -> DataFrame:
    """The whole archive under ``output`` as one DataFrame, with run, shard, queue and day columns.

    Only committed shard directories are visible (staging and manifests start with ``_``).
    """
    root = _local_output(output)
    return spark.read.schema(archive_schema()).parquet(str(root)).withColumn("day", F.to_date("day"))


# --- progress and results -------------------------------------------------------------------------


@dataclass(frozen=True)
class ArchiveProgress:
    """One step of one shard, reported as it happens (the CLI prints one line each).

    Stages, in order: ``planned`` (candidates counted at the start), ``read`` (rows the JDBC read
    returned), ``written`` (rows in the staged Parquet), ``verified``, ``committed``,
    ``delete_slice`` (one transaction; ``queue`` is set), ``deleted`` (the shard is finished), or
    ``finished_before`` (an earlier run of the same id finished this shard: nothing to do).
    """

    run_id: str
    stage: str
    shard: str
    #: rows concerned: counted, read, written, committed, deleted by the slice, deleted in all
    rows: int
    queue: str | None = None
    detail: str = ""

    def line(self) -> str:
        """One human-readable line: ``archive <run>: shard <s>[, queue <q>]: <what> <n> rows (<detail>)``."""
        what = f"shard {self.shard}" + (f", queue {self.queue}" if self.queue else "")
        extra = f" ({self.detail})" if self.detail else ""
        verb = _VERBS.get(self.stage, self.stage)
        return f"archive {self.run_id}: {what}: {verb} {self.rows:,} rows{extra}"


# how ArchiveProgress.line words a stage (the others read as they are)
_VERBS = {"delete_slice": "deleted", "finished_before": "already finished, archived"}


ProgressCallback = Callable[[ArchiveProgress], None]


@dataclass
class ShardResult:
    """What a run did to one shard."""

    shard: str
    #: rows in the shard's committed Parquet
    archived: int = 0
    #: rows this invocation deleted (an interrupted earlier invocation may have deleted others)
    deleted: int = 0
    #: archived rows left in the shard because they changed after they were read (the guard kept them)
    kept: int = 0
    #: an earlier invocation of the same run had already finished this shard
    finished_before: bool = False


@dataclass
class ArchiveResult:
    """The outcome of :func:`archive_events`."""

    run_id: str
    cutoff: datetime
    #: the run's directory (``output/run=<run>``)
    run_dir: Path
    #: the run existed already (this invocation resumed or repeated it)
    resumed: bool
    shards: dict[str, ShardResult] = field(default_factory=dict)

    @property
    def archived(self) -> int:
        return sum(s.archived for s in self.shards.values())

    @property
    def deleted(self) -> int:
        return sum(s.deleted for s in self.shards.values())

    @property
    def kept(self) -> int:
        return sum(s.kept for s in self.shards.values())

    def summary(self) -> dict[str, Any]:
        """The outcome as plain data (``qm spark archive --json``)."""
        return {
            "run_id": self.run_id,
            "cutoff": self.cutoff.isoformat(),
            "run_dir": str(self.run_dir),
            "archived": self.archived,
            "deleted": self.deleted,
            "kept": self.kept,
            "shards": {name: vars(s) for name, s in self.shards.items()},
        }

    def summary_line(self) -> str:
        return (
            f"archive {self.run_id}: done: {self.archived:,} rows archived in {self.run_dir} "
            f"(cut-off {self.cutoff.isoformat()}), {self.deleted:,} deleted now, "
            f"{self.kept:,} kept in the shards (changed after they were read)"
        )


# --- the job --------------------------------------------------------------------------------------


def archive_events(
    spark: SparkSession,
    topology: Topology,
    *,
    older_than: timedelta | datetime,
    output: str | Path,
    queues: Sequence[str] | None = None,
    run_id: str | None = None,
    delete_slice: int = DEFAULT_DELETE_SLICE,
    rows_per_partition: int = DEFAULT_ROWS_PER_PARTITION,
    progress: ProgressCallback | None = None,
) -> ArchiveResult:
    """Archive acked and failed events settled before a cut-off to Parquet, then delete them.

    ``older_than`` is an age (``timedelta``: the cut-off is the database's now minus it) or an
    aware ``datetime`` (the cut-off itself). ``queues`` defaults to every queue. ``run_id``
    names the run; without one a new run starts. Passing the id of an interrupted run finishes
    it (with the cut-off fixed at its first start), and the id of a finished run does nothing.
    ``delete_slice`` ids are deleted per transaction; JDBC reads get one partition per
    ``rows_per_partition`` candidates. ``progress`` is called at every step of every shard.

    Raises ConfigurationError for bad input (a cut-off in the future, a bad run id, an output
    that is not a local directory, a re-run with other queues), UnknownQueueError for a queue
    missing on some shard, and ArchiveError when the output or a check is not as expected (then
    nothing more is deleted).
    """
    root = _local_output(output)
    names = check_queues(queues)
    check_older_than(older_than)
    check_sizes(delete_slice=delete_slice, rows_per_partition=rows_per_partition)
    rid = check_run_id(run_id) if run_id is not None else new_run_id(datetime.now(UTC), secrets.token_hex(2))
    layout = ArchiveLayout(root, rid)
    report = _Reporter(rid, progress, topology)

    root.mkdir(parents=True, exist_ok=True)
    with _output_lock(layout.lock_file):
        plan, resumed = _load_or_make_plan(topology, layout, names, older_than, report)
        pending = _pending_shards(layout, topology)
        if pending:
            _write_verify_commit(spark, layout, plan, pending, rows_per_partition, report)
        result = ArchiveResult(rid, plan.cutoff, layout.run_dir, resumed)
        for shard in topology.shards:
            result.shards[shard.name] = _delete_shard(spark, layout, plan, shard, delete_slice, report)
    return result


class _Reporter:
    """Sends progress to the callback, to the log and to the shard's ledger (``qm.archive_runs``:
    what ``qm web``'s health page shows)."""

    def __init__(self, run_id: str, callback: ProgressCallback | None, topology: Topology | None = None) -> None:
        self.run_id = run_id
        self.callback = callback
        self.topology = topology

    def __call__(self, stage: str, shard: str, rows: int, *, queue: str | None = None, detail: str = "") -> None:
        event = ArchiveProgress(self.run_id, stage, shard, rows, queue, detail)
        logger.info(event.line(), extra={"action": f"archive.{stage}", "shard": shard, "rows": rows})
        self._ledger(event)
        if self.callback is not None:
            self.callback(event)

    def _ledger(self, event: ArchiveProgress) -> None:
        """The step in the shard's ledger row. Only a trace for people: a failed write is logged,
        never a reason to stop the run (its truth is in the output directory)."""
        if self.topology is None:
            return
        try:
            shard = self.topology.by_name(event.shard)
            with psycopg.connect(shard.dsn, autocommit=True, connect_timeout=5) as conn:
                conn.execute(
                    _q("archive_ledger"),
                    {"run_id": event.run_id, "stage": event.stage, "rows": event.rows, "detail": event.detail[:500]},
                )
        except (psycopg.Error, TopologyError) as exc:
            logger.warning(
                "could not record an archive step in the shard's ledger",
                extra={"action": "archive.ledger_failed", "shard": event.shard, "error": str(exc)},
            )


# --- step 1: plan ---------------------------------------------------------------------------------


def _load_or_make_plan(
    topology: Topology,
    layout: ArchiveLayout,
    queues: tuple[str, ...] | None,
    older_than: timedelta | datetime,
    report: _Reporter,
) -> tuple[RunPlan, bool]:
    """The run's saved plan (checked against the arguments), or a new one saved before anything else."""
    shard_names = [s.name for s in topology.shards]
    if layout.plan_file.exists():
        plan = RunPlan.from_json(layout.plan_file.read_text(encoding="utf-8"), source=str(layout.plan_file))
        if plan.run_id != layout.run_id:
            raise ArchiveError(f"{layout.plan_file} belongs to run {plan.run_id!r}, not {layout.run_id!r}")
        plan.check_resume(queues=queues, shards=shard_names, older_than=older_than)
        return plan, True
    _refuse_if_unfinished_runs(layout)
    now, per_shard = _shard_queues(topology)
    chosen = _choose_queues(queues, per_shard)
    cutoff = resolve_cutoff(older_than, now)
    shards: dict[str, dict[str, QueuePlan]] = {}
    for shard in topology.shards:
        shards[shard.name] = _plan_shard(shard, chosen, cutoff)
    plan = RunPlan(layout.run_id, cutoff, now, chosen, shards)
    layout.run_dir.mkdir(parents=True, exist_ok=True)
    _write_atomic(layout.plan_file, plan.to_json())
    for name, qs in shards.items():
        report("planned", name, sum(q.rows for q in qs.values()), detail=f"cut-off {cutoff.isoformat()}")
    return plan, False


def _refuse_if_unfinished_runs(layout: ArchiveLayout) -> None:
    """A new run may not start while another run in the same output has rows not yet deleted.

    Such a run's committed rows are still in the shards: a new run would archive them again.
    """
    for run_dir in sorted(layout.output.glob("run=*")):
        plan_file = run_dir / PLAN_NAME
        if run_dir == layout.run_dir or not plan_file.exists():
            continue  # no plan: that run stopped before it read anything
        other = RunPlan.from_json(plan_file.read_text(encoding="utf-8"), source=str(plan_file))
        unfinished = [
            s for s in sorted(other.shards) if not ArchiveLayout(layout.output, other.run_id).deleted_file(s).exists()
        ]
        if unfinished:
            raise ArchiveError(
                f"run {other.run_id!r} in {layout.output} is unfinished (shards {', '.join(unfinished)} not deleted "
                f"yet): finish it first by re-running with run id {other.run_id!r}; a new run would archive its "
                "rows a second time"
            )


def _shard_queues(topology: Topology) -> tuple[datetime, dict[str, list[str]]]:
    """The database clock (first shard) and every shard's queue names."""
    now: datetime | None = None
    per_shard: dict[str, list[str]] = {}
    for shard in topology.shards:
        with psycopg.connect(shard.dsn, autocommit=True) as conn:
            if now is None:
                row = conn.execute(_q("archive_clock")).fetchone()
                assert row is not None
                now = row[0]
            per_shard[shard.name] = [r[0] for r in conn.execute(_q("archive_queue_names")).fetchall()]
    assert now is not None  # a topology has at least one shard
    return now, per_shard


def _choose_queues(queues: tuple[str, ...] | None, per_shard: Mapping[str, list[str]]) -> tuple[str, ...]:
    """The queues to archive: those named (each must exist on every shard), or all of them."""
    wanted = queues if queues is not None else tuple(sorted({q for qs in per_shard.values() for q in qs}))
    if not wanted:
        raise ConfigurationError("there is no queue to archive: no shard has any queue")
    for queue in wanted:
        missing = [s for s, qs in per_shard.items() if queue not in qs]
        if missing:
            raise UnknownQueueError(
                f"queue {queue!r} does not exist on shard(s) {', '.join(missing)}: check the name "
                "('qm queue list'), or create it on every shard"
            )
    return wanted


def _plan_shard(shard: Shard, queues: Sequence[str], cutoff: datetime) -> dict[str, QueuePlan]:
    """Per queue: the id bound and the candidates, all in one snapshot of the shard."""
    out = {}
    with psycopg.connect(shard.dsn) as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        with conn.transaction():
            for queue in queues:
                row = conn.execute(_q("archive_plan_queue", queue), {"cutoff": cutoff}).fetchone()
                assert row is not None
                max_id, rows, low, high = row
                out[queue] = QueuePlan(max_id=int(max_id), rows=int(rows), low_id=low, high_id=high)
    return out


# --- steps 2-4: read, write, verify, commit -------------------------------------------------------


def _pending_shards(layout: ArchiveLayout, topology: Topology) -> list[Shard]:
    """Shards whose output is not committed yet. A shard directory without its manifest is refused."""
    pending = []
    for shard in topology.shards:
        directory = layout.shard_dir(shard.name)
        if not directory.exists():
            pending.append(shard)
        elif not (directory / MANIFEST_NAME).is_file():
            # only the commit's rename creates this directory, with the manifest inside
            raise ArchiveError(
                f"{directory} exists but has no {MANIFEST_NAME}: it was not made by a completed commit. Nothing was "
                "deleted for it by this job; inspect it and move it away before re-running"
            )
    return pending


def _write_verify_commit(
    spark: SparkSession,
    layout: ArchiveLayout,
    plan: RunPlan,
    pending: Sequence[Shard],
    rows_per_partition: int,
    report: _Reporter,
) -> None:
    """Read the pending shards into a fresh staging directory, check the files, commit shard by shard."""
    shutil.rmtree(layout.staging_dir, ignore_errors=True)  # the partial output of an interrupted attempt
    attempt = layout.staging_dir / uuid.uuid4().hex
    read, written = _read_and_write(spark, plan, pending, rows_per_partition, attempt)
    problems = []
    for shard in pending:
        by_queue = {q: n for (s, q), n in read.items() if s == shard.name}
        stats = {q: w for (s, q), w in written.items() if s == shard.name}
        report("read", shard.name, sum(by_queue.values()), detail=_per_queue(by_queue))
        report("written", shard.name, sum(w.rows for w in stats.values()))
        problems += verify_shard(shard.name, plan.shards[shard.name], by_queue, stats)
    if problems:
        unseen = sum(w.rows for w in written.values()) < sum(read.values())
        raise ArchiveError(
            "the written archive does not match what was read, so nothing was committed or deleted; "
            f"re-run with run id {layout.run_id!r} to write it again: "
            + "; ".join(problems)
            + (
                " (rows the executors wrote are missing where the driver reads them back: on a cluster the "
                "output must be a directory that the driver and every executor share)"
                if unseen
                else ""
            )
        )
    for shard in pending:
        stats = {q: w for (s, q), w in written.items() if s == shard.name}
        manifest = manifest_for(
            layout.run_id, shard.name, plan.cutoff, plan.shards[shard.name], stats, datetime.now(UTC)
        )
        report("verified", shard.name, manifest.rows)
        _commit_shard(layout, attempt / f"shard={shard.name}", manifest)
        report("committed", shard.name, manifest.rows, detail=str(layout.shard_dir(shard.name)))
    shutil.rmtree(layout.staging_dir, ignore_errors=True)
    with contextlib.suppress(OSError):  # another run's staging may still be there
        layout.staging_dir.parent.rmdir()


def _read_and_write(
    spark: SparkSession, plan: RunPlan, pending: Sequence[Shard], rows_per_partition: int, attempt: Path
) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str], WrittenStats]]:
    """One Spark job reads every pending (shard, queue) and writes it under ``attempt``.

    Returns the rows read per (shard, queue), counted by an observation as they stream into the
    writer, and the statistics of the files written, read back.
    """
    frames: list[DataFrame] = []
    observed: dict[tuple[str, str], Observation] = {}
    for shard in pending:
        target = shard_jdbc_target(shard.dsn)
        for queue, qp in plan.shards[shard.name].items():
            if qp.rows == 0 or qp.low_id is None or qp.high_id is None:
                continue  # nothing settled before the cut-off at the start of the run
            df = _read_queue(spark, target, shard.name, queue, qp, plan.cutoff, rows_per_partition)
            obs = Observation(f"qm_archive_read_{len(observed)}")
            frames.append(df.observe(obs, F.count(F.lit(1)).alias("rows")))
            observed[(shard.name, queue)] = obs
    if not frames:
        return {}, {}
    union = reduce(DataFrame.unionByName, frames)
    with _session_conf(spark, PARQUET_WRITE_CONF):
        union.write.mode("errorifexists").partitionBy("shard", "queue", "day").parquet(str(attempt))
    # only after a successful write: Observation.get waits for metrics a failed job never sends
    read = {key: int(obs.get["rows"]) for key, obs in observed.items()}
    return read, _written_stats(spark, attempt)


def _read_queue(
    spark: SparkSession,
    target: JdbcTarget,
    shard: str,
    queue: str,
    qp: QueuePlan,
    cutoff: datetime,
    rows_per_partition: int,
) -> DataFrame:
    """The candidates of one queue of one shard, read in partitions of the id range."""
    assert qp.low_id is not None and qp.high_id is not None
    source = sql.SQL(_strip_comments(query("archive_source", SQL_FILE))).format(
        queue=sql.Identifier(queue), max_id=sql.Literal(qp.max_id), cutoff=sql.Literal(cutoff)
    )
    reader = (
        spark.read.format("jdbc")
        .option("url", target.url)
        .option("dbtable", source.as_string())
        .option("fetchsize", JDBC_FETCH_SIZE)
        .option("partitionColumn", "id")
        .option("lowerBound", qp.low_id)
        .option("upperBound", qp.high_id + 1)
        .option("numPartitions", read_partitions(qp.rows, rows_per_partition))
    )
    for key, value in target.properties.items():
        reader = reader.option(key, value)
    df = reader.load()
    # the files get the declared types whatever the driver maps (smallint, jsonb text, ...)
    columns = [F.col(f.name).cast(f.dataType).alias(f.name) for f in DATA_SCHEMA.fields]
    return df.select(*columns, F.lit(shard).alias("shard"), F.lit(queue).alias("queue"), F.col("day"))


def _written_stats(spark: SparkSession, directory: Path) -> dict[tuple[str, str], WrittenStats]:
    """Rows, distinct ids and id range per (shard, queue) of the Parquet files under ``directory``."""
    df = spark.read.schema(archive_schema(("shard", "queue", "day"))).parquet(str(directory))
    rows = (
        df.groupBy("shard", "queue")
        .agg(
            F.count(F.lit(1)).alias("n"),
            F.countDistinct("id").alias("d"),
            F.min("id").alias("lo"),
            F.max("id").alias("hi"),
        )
        .collect()
    )
    return {(r["shard"], r["queue"]): WrittenStats(r["n"], r["d"], r["lo"], r["hi"]) for r in rows}


def _commit_shard(layout: ArchiveLayout, staged: Path, manifest: ShardManifest) -> None:
    """Make a staged shard directory durable, put its manifest in it, and rename it into the run.

    The rename is the commit: before it the shard has no directory in the run (a re-run writes it
    again), after it the directory is complete with its manifest.
    """
    staged.mkdir(parents=True, exist_ok=True)  # a shard with nothing to archive still gets its manifest
    _fsync_tree(staged)
    _write_atomic(staged / MANIFEST_NAME, manifest.to_json())
    layout.run_dir.mkdir(parents=True, exist_ok=True)
    os.rename(staged, layout.shard_dir(manifest.shard))
    _fsync_dir(layout.run_dir)


# --- step 5: delete -------------------------------------------------------------------------------


def _delete_shard(
    spark: SparkSession, layout: ArchiveLayout, plan: RunPlan, shard: Shard, delete_slice: int, report: _Reporter
) -> ShardResult:
    """Delete a committed shard's archived rows from the shard, unless an earlier invocation did."""
    manifest = _load_manifest(layout, plan, shard.name)
    result = ShardResult(shard.name, archived=manifest.rows)
    deleted_file = layout.deleted_file(shard.name)
    if deleted_file.exists():
        record = DeletionRecord.from_json(deleted_file.read_text(encoding="utf-8"), source=str(deleted_file))
        result.finished_before = True
        result.kept = record.kept
        report(
            "finished_before",
            shard.name,
            manifest.rows,
            detail=f"{record.kept} of them kept in the shard, finished {record.finished_at.isoformat()}",
        )
        return result
    _check_committed_ids(spark, layout, manifest)
    kept_ids: list[tuple[str, int]] = []
    with psycopg.connect(shard.dsn, autocommit=True) as conn:
        for queue, qm in sorted(manifest.queues.items()):
            if qm.rows == 0:
                continue
            delete, kept = _q("archive_delete", queue), _q("archive_kept", queue)
            ids = _archived_ids(spark, layout.queue_dir(shard.name, queue))
            for number, chunk in enumerate(id_slices(ids, delete_slice), 1):
                with conn.transaction():
                    params = {"ids": chunk, "max_id": qm.max_id, "cutoff": manifest.cutoff}
                    gone = conn.execute(delete, params).rowcount
                    still = [r[0] for r in conn.execute(kept, {"ids": chunk}).fetchall()]
                result.deleted += gone
                result.kept += len(still)
                kept_ids += [(queue, i) for i in still]
                report(
                    "delete_slice",
                    shard.name,
                    gone,
                    queue=queue,
                    detail=f"slice {number}, {len(chunk)} ids" + (f", {len(still)} kept" if still else ""),
                )
    record = DeletionRecord(result.deleted, result.kept, kept_ids[:KEPT_IDS_LISTED], datetime.now(UTC))
    _write_atomic(deleted_file, record.to_json())
    report("deleted", shard.name, result.deleted, detail=f"{result.kept} kept" if result.kept else "")
    return result


def _load_manifest(layout: ArchiveLayout, plan: RunPlan, shard: str) -> ShardManifest:
    path = layout.manifest_file(shard)
    manifest = ShardManifest.from_json(path.read_text(encoding="utf-8"), source=str(path))
    if (manifest.run_id, manifest.shard, manifest.cutoff) != (plan.run_id, shard, plan.cutoff):
        raise ArchiveError(
            f"{path} describes run {manifest.run_id!r}, shard {manifest.shard!r}, cut-off "
            f"{manifest.cutoff.isoformat()}: not this run's shard {shard!r}; nothing deleted"
        )
    if set(manifest.queues) != set(plan.queues):
        raise ArchiveError(f"{path} lists queues {sorted(manifest.queues)}, the plan {list(plan.queues)}")
    return manifest


def _check_committed_ids(spark: SparkSession, layout: ArchiveLayout, manifest: ShardManifest) -> None:
    """The committed files must hold exactly the manifest's rows, each id once, before any delete."""
    if manifest.rows == 0:
        return
    df = spark.read.schema(archive_schema(("queue", "day"))).parquet(str(layout.shard_dir(manifest.shard)))
    found = {
        r["queue"]: (r["n"], r["d"], r["hi"])
        for r in df.groupBy("queue")
        .agg(F.count(F.lit(1)).alias("n"), F.countDistinct("id").alias("d"), F.max("id").alias("hi"))
        .collect()
    }
    problems = []
    for queue, qm in sorted(manifest.queues.items()):
        n, distinct, high = found.get(queue, (0, 0, None))
        if n != qm.rows or distinct != qm.rows or (high is not None and high > qm.max_id):
            problems.append(f"queue {queue}: manifest {qm.rows} rows, files {n} rows ({distinct} distinct ids)")
    if problems:
        raise ArchiveError(
            f"the committed archive of shard {manifest.shard} ({layout.shard_dir(manifest.shard)}) no longer matches "
            f"its manifest, so nothing was deleted: {'; '.join(problems)}"
        )


def _archived_ids(spark: SparkSession, directory: Path) -> Iterator[int]:
    """The ids of one committed (shard, queue), ascending, streamed partition by partition."""
    df = spark.read.schema(StructType([DATA_SCHEMA["id"], StructField("day", StringType())])).parquet(str(directory))
    for row in df.select("id").orderBy("id").toLocalIterator():
        yield int(row[0])


# --- small helpers --------------------------------------------------------------------------------


def _q(name: str, queue: str | None = None) -> sql.Composed:
    """A block of archive.sql, with ``{queue}`` filled in when given."""
    text: LiteralString = query(name, SQL_FILE)
    if queue is None:
        return sql.Composed([sql.SQL(text)])
    return sql.SQL(text).format(queue=sql.Identifier(queue))


def _strip_comments(text: str) -> str:
    """A block without its leading comment lines (Spark pastes ``dbtable`` into a larger statement)."""
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--"))


def _per_queue(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{q} {n:,}" for q, n in sorted(counts.items()))


def _local_output(output: str | Path) -> Path:
    """The output as an absolute local path; ConfigurationError for a remote URL."""
    text = str(output)
    if not text:
        raise ConfigurationError("the archive output directory must not be empty")
    if text.startswith("file://"):
        text = text.removeprefix("file://")
    elif "://" in text:
        raise ConfigurationError(
            f"archive output {text!r} is not a local directory: a shard's output is committed by an atomic "
            "directory rename, which object stores lack; write to a local or mounted POSIX path"
        )
    return Path(text).expanduser().resolve()


@contextlib.contextmanager
def _session_conf(spark: SparkSession, settings: Mapping[str, str]) -> Iterator[None]:
    """Set Spark SQL settings for the duration of the block, then put the caller's values back."""
    saved: dict[str, str | None] = {key: spark.conf.get(key, None) for key in settings}
    for key, value in settings.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, old)


@contextlib.contextmanager
def _output_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (flock), or fail at once if another process holds it."""
    with open(path, "a+b") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ArchiveError(
                f"another archive run is working in {path.parent} (it holds {path}): wait for it to finish"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _write_atomic(path: Path, text: str) -> None:
    """Write a file whole or not at all: a synced temporary file renamed over it, then the directory synced."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Sync every file and directory under ``root`` (Spark's local writer does not)."""
    for directory, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(directory))


# --- command line ---------------------------------------------------------------------------------


def run_archive(
    topology: Topology,
    *,
    older_than: str | None,
    before: str | None,
    output: str | Path,
    queues: Sequence[str] | None = None,
    run_id: str | None = None,
    delete_slice: int = DEFAULT_DELETE_SLICE,
    rows_per_partition: int = DEFAULT_ROWS_PER_PARTITION,
    jdbc_jar: str | None = None,
    starting: Callable[[str], None] | None = None,
    progress: ProgressCallback | None = None,
) -> ArchiveResult:
    """A command-line run (``qm spark archive``): the cut-off as text (an age, ``older_than``, or a time,
    ``before``), checked before Spark starts; a new run id unless given; ``starting(run_id)`` before the
    work; then :func:`archive_events` in the job's session (:func:`spark_jobs.session.job_session`)."""
    if (older_than is None) == (before is None):
        raise ConfigurationError("give the cut-off as an age (older_than) or a time (before), not both")
    cut = parse_age(older_than) if older_than is not None else parse_time(str(before))
    resolve_cutoff(cut, datetime.now(UTC))  # a time in the future fails before Spark starts (the job asks the database)
    run = check_run_id(run_id) if run_id else new_run_id(datetime.now(UTC), os.urandom(2).hex())
    if starting is not None:
        starting(run)
    with job_session("qm-archive", jdbc_jar) as spark:
        return archive_events(
            spark,
            topology,
            older_than=cut,
            output=output,
            queues=queues,
            run_id=run,
            delete_slice=delete_slice,
            rows_per_partition=rows_per_partition,
            progress=progress,
        )


if __name__ == "__main__":  # pragma: no cover
    from spark_jobs.commands import script_main

    sys.exit(script_main("archive", run_archive))
