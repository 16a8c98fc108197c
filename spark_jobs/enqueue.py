"""Bulk enqueue from Spark: all-or-nothing per shard (or across shards), safe to re-run.

A run moves a DataFrame of events into one queue on every shard in five steps:

1. **route and check** (Spark SQL only, no Python UDF): each row gets its shard (keyspace range of
   the tenant's md5) and a partition of its tenant's shuffle set, spread over the set by a hash of
   the row's key; rows that break a rule of the queue get a reason;
2. **materialise** the keyed rows once, as Parquet under the run's work directory. A re-run of the
   run id reads them back instead of the source, so its row keys are the same, whatever the source
   or Spark's recomputation does;
3. **rejects**: rows with a reason go to a Parquet output with it; by default the run then stops
   before anything is written to a shard (``bad_rows="skip"`` publishes the good rows);
4. **stage** each shard's rows through the JDBC driver into ``qm.spark_staging`` (UNLOGGED), with
   a few tasks per shard. Spark commits each task on its own, and a retried or speculative task
   writes its rows again: the staging table keeps duplicates, the publish drops them by row key;
5. **publish**, one transaction per shard: ``qm.publish_run`` inserts the run's distinct rows into
   the queue table with one ``INSERT ... SELECT`` (the queue's verify trigger checks every row and
   wakes the manager once), bumps the load counters, marks the run published in the shard's ledger
   (``qm.spark_runs``) and deletes the staging rows. A shard whose ledger says published is
   skipped, so a re-run adds nothing. With ``atomic=True`` every shard's publish is prepared
   (``PREPARE TRANSACTION``), a decision is recorded on the coordinating shard (the topology's
   first), and only then is each committed: :func:`recover` finishes a run left prepared (decision
   recorded: commit; none: roll back), and every atomic run starts by recovering its own run id.

See docs/spark.md for the options, the guarantees and the measured figures.
"""

from __future__ import annotations

import re
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import psycopg
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from queue_manager.domain.topology import Shard, Topology
from queue_manager.errors import ConfigurationError, InvalidEventError, UnknownQueueError
from spark_jobs import routing as sr
from spark_jobs.jdbc import shard_jdbc_target

#: a run id names the run in ledgers, staging rows, paths and prepared transactions
RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
#: the prefix of a two-phase run's prepared transactions: qm-run:<queue>:<run>:<shard>
GID_PREFIX = "qm-run:"
#: the earliest fire_at any queue accepts (the database's rule)
EARLIEST_FIRE_AT = "2000-01-01 00:00:00+00"
#: the columns the job writes into qm.spark_staging
STAGING_COLUMNS = ("run_id", "queue", "row_key", "tenant", "partition", "payload", "fire_at", "dedup_key")

Stage = Literal["validated", "staged"]
ProgressCallback = Callable[[str, str, int], None]
#: a test's hook, called at (step, shard): "staged", "prepared", "decided"; it may raise
FaultHook = Callable[[str, str], None]


class BadRowsError(InvalidEventError):
    """Rows broke the queue's rules; nothing was published. ``rejects`` names their Parquet output."""

    def __init__(self, count: int, rejects: str, reasons: Mapping[str, int]) -> None:
        listed = ", ".join(f"{reason}: {n}" for reason, n in sorted(reasons.items()))
        super().__init__(f"{count} rows were rejected ({listed}); nothing was published; see {rejects}")
        self.count = count
        self.rejects = rejects
        self.reasons = dict(reasons)


@dataclass(frozen=True)
class Columns:
    """Which source columns hold what. ``payload`` may be a JSON string column or a struct (or map,
    or array) column, which is turned into JSON; ``fire_at`` a timestamp or a string (NULL: now);
    ``dedup_key`` optional."""

    tenant: str = "tenant"
    payload: str = "payload"
    fire_at: str | None = None
    dedup_key: str | None = None


@dataclass(frozen=True)
class QueueShape:
    """What routing and the checks need of a queue on one shard."""

    partitions: int
    shuffle: int
    payload_limit_bytes: int
    max_delay_seconds: float


@dataclass
class ShardResult:
    shard: str
    #: the run's good rows routed to this shard
    rows: int = 0
    #: events inserted by this call's publish; None when the shard had the run already
    published: int | None = None
    state: str = "pending"


@dataclass
class LoadResult:
    run_id: str
    queue: str
    rows: int
    rejected: int
    rejects_path: str | None
    shards: list[ShardResult] = field(default_factory=list)

    @property
    def published(self) -> int:
        return sum(s.published or 0 for s in self.shards)


def check_run_id(run_id: str) -> str:
    if not RUN_ID_RE.match(run_id):
        raise ConfigurationError(
            f"run id {run_id!r} must be 1 to 64 characters of letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return run_id


def read_source(spark: SparkSession, source: str, fmt: str, options: Mapping[str, str] | None = None) -> DataFrame:
    """A DataFrame from a Parquet, CSV or JSON path, or from a table name (``fmt="table"``)."""
    reader = spark.read.options(**dict(options or {}))
    if fmt == "table":
        return spark.table(source)
    if fmt == "csv":
        return reader.option("header", "true").csv(source)
    if fmt in ("parquet", "json", "orc"):
        return reader.format(fmt).load(source)
    raise ConfigurationError(f"unknown input format {fmt!r}: use parquet, csv, json, orc or table")


# ----------------------------------------------------------------------------------- the shards


def queue_shape(dsn: str, shard: str, queue: str) -> QueueShape:
    """The queue's settings on one shard; UnknownQueueError if it has no such queue, and
    ConfigurationError if the database is another shard than the topology says."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        ident = conn.execute("SELECT name FROM qm.shard").fetchone()
        if ident is None or ident[0] != shard:
            raise ConfigurationError(
                f"the database of shard {shard!r} says it is {None if ident is None else ident[0]!r}: wrong topology?"
            )
        row = conn.execute(
            "SELECT partitions, shuffle, payload_limit_bytes, max_delay_seconds FROM qm.queues WHERE name = %s",
            (queue,),
        ).fetchone()
    if row is None:
        raise UnknownQueueError(f"no queue named {queue!r} on shard {shard!r}")
    return QueueShape(int(row[0]), int(row[1]), int(row[2]), float(row[3]))


def _ledger_state(dsn: str, run_id: str, queue: str) -> str | None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT state FROM qm.spark_runs WHERE run_id = %s AND queue = %s", (run_id, queue)
        ).fetchone()
    return None if row is None else str(row[0])


def _require_two_phase(shards: Sequence[Shard]) -> None:
    for s in shards:
        with psycopg.connect(s.dsn, autocommit=True) as conn:
            row = conn.execute("SHOW max_prepared_transactions").fetchone()
        if row is None or int(row[0]) <= 0:
            raise ConfigurationError(
                f"--atomic needs two-phase commit, but shard {s.name!r} has max_prepared_transactions = 0: "
                "set it (for example to 10) in postgresql.conf and restart the server"
            )


# ----------------------------------------------------------------------------------- routing


def _shard_of(tenant: Column, topology: Topology) -> Column:
    expr: Column | None = None
    for s in topology.shards:
        cond = sr.in_key_range(tenant, s.key_range.start, s.key_range.end)
        expr = F.when(cond, F.lit(s.name)) if expr is None else expr.when(cond, F.lit(s.name))
    assert expr is not None  # a topology has at least one shard
    return expr


def _per_shard(shard: Column, shapes: Mapping[str, QueueShape], value: Callable[[QueueShape], Column]) -> Column:
    """``value(shape)`` of the row's shard (one expression when every shard has the same shape)."""
    distinct = set(shapes.values())
    if len(distinct) == 1:
        return value(next(iter(distinct)))
    expr: Column | None = None
    for name, shape in shapes.items():
        expr = F.when(shard == name, value(shape)) if expr is None else expr.when(shard == name, value(shape))
    assert expr is not None
    return expr


def _partition(tenant: Column, row_key: Column, shape: QueueShape) -> Column:
    """A partition of the tenant's shuffle set: its rows are spread over the set by row key."""
    pick = F.pmod(F.xxhash64(row_key), F.lit(shape.shuffle)) + F.lit(1)
    return F.element_at(sr.shuffle_set(tenant, shape.partitions, shape.shuffle), pick.cast("int"))


def _payload_json(df: DataFrame, name: str) -> Column:
    dtype = df.schema[name].dataType.typeName()
    col = F.col(name)
    if dtype == "string":
        return col
    if dtype in ("struct", "map", "array"):
        return F.to_json(col)
    raise ConfigurationError(f"payload column {name!r} is {dtype}: give a JSON string, struct, map or array column")


def route_and_check(df: DataFrame, topology: Topology, shapes: Mapping[str, QueueShape], columns: Columns) -> DataFrame:
    """The source rows with a row key, their shard and partition, and a ``reason`` (NULL: good).

    Columns: row_key, tenant, payload (JSON text), fire_at (timestamp or NULL), dedup_key, shard,
    partition, reason. Raises ConfigurationError for a column the source does not have.
    """
    for what, name in (
        ("tenant", columns.tenant),
        ("payload", columns.payload),
        ("fire_at", columns.fire_at),
        ("dedup key", columns.dedup_key),
    ):
        if name is not None and name not in df.columns:
            raise ConfigurationError(f"the source has no {what} column {name!r} (it has {', '.join(df.columns)})")
    tenant = F.col(columns.tenant).cast("string")
    raw_fire = F.col(columns.fire_at) if columns.fire_at else F.lit(None)
    fire_at = raw_fire.try_cast("timestamp") if columns.fire_at else F.lit(None).cast("timestamp")
    keyed = df.select(
        F.monotonically_increasing_id().alias("row_key"),
        tenant.alias("tenant"),
        _payload_json(df, columns.payload).alias("payload"),
        fire_at.alias("fire_at"),
        raw_fire.isNotNull().alias("_fire_given"),
        (F.col(columns.dedup_key).cast("string") if columns.dedup_key else F.lit(None).cast("string")).alias(
            "dedup_key"
        ),
    )
    t = F.col("tenant")
    shard = _shard_of(t, topology)
    keyed = keyed.withColumn("shard", shard)
    s = F.col("shard")
    limit = _per_shard(s, shapes, lambda q: F.lit(q.payload_limit_bytes))
    max_delay = _per_shard(s, shapes, lambda q: F.lit(int(q.max_delay_seconds)))
    payload = F.col("payload")
    fire = F.col("fire_at")
    reason = (
        F.when(t.isNull() | (t == ""), F.lit("missing tenant"))
        .when(s.isNull(), F.lit("no shard owns the tenant"))
        .when(payload.isNull(), F.lit("missing payload"))
        .when(
            F.get_json_object(payload, "$").isNull() & (F.trim(payload) != "null"), F.lit("payload is not valid JSON")
        )
        .when(F.octet_length(payload) > limit, F.lit("payload too large for the queue"))
        .when(F.col("_fire_given") & fire.isNull(), F.lit("invalid fire_at"))
        .when(
            fire.isNotNull()
            & (
                (fire < F.lit(EARLIEST_FIRE_AT).cast("timestamp"))
                | (fire > F.current_timestamp() + F.make_interval(secs=max_delay))
            ),
            F.lit("fire_at out of range"),
        )
    )
    partition = _per_shard(s, shapes, lambda q: _partition(t, F.col("row_key"), q))
    return (
        keyed.withColumn("reason", reason)
        .withColumn("partition", F.when(F.col("reason").isNull(), partition))
        .drop("_fire_given")
    )


# ----------------------------------------------------------------------------------- the run


class _Crash(BaseException):
    """Raised by a test's fault hook to stop a run where it stands, as a killed process would."""


def load_events(
    df: DataFrame,
    topology: Topology,
    queue: str,
    *,
    run_id: str,
    columns: Columns | None = None,
    bad_rows: Literal["fail", "skip"] = "fail",
    rejects: str | None = None,
    work_dir: str | None = None,
    atomic: bool = False,
    tasks_per_shard: int = 2,
    batch_size: int = 10_000,
    stop_after: Stage | None = None,
    progress: ProgressCallback | None = None,
    fault: FaultHook | None = None,
) -> LoadResult:
    """Enqueue every row of ``df`` into ``queue`` on the shards of ``topology``, once.

    ``run_id`` names the run: a re-run with the same id finishes an interrupted run and adds
    nothing to a finished one. ``bad_rows``: ``"fail"`` (default) raises BadRowsError before any
    shard is written when a row breaks a rule; ``"skip"`` publishes the good rows. ``rejects``:
    where the bad rows go (Parquet, with a ``reason``), default ``<work_dir>/rejects``.
    ``work_dir``: where the run's keyed rows are kept (a path every executor can read; default a
    directory under the system's temporary directory). ``atomic``: the run is visible on every
    shard or on none (two-phase commit; needs ``max_prepared_transactions > 0``). ``stop_after``:
    stop after ``"validated"`` (a dry run: rejects written, nothing staged) or ``"staged"``.
    """
    check_run_id(run_id)
    columns = columns or Columns()
    if tasks_per_shard < 1 or batch_size < 1:
        raise ConfigurationError("tasks_per_shard and batch_size must be at least 1")
    say = progress or (lambda stage, shard, n: None)
    shapes = {s.name: queue_shape(s.dsn, s.name, queue) for s in topology.shards}
    if atomic:
        _require_two_phase(topology.shards)
        recover(topology, run_id=run_id)
    spark = df.sparkSession
    base = Path(work_dir) if work_dir else Path(tempfile.gettempdir()) / "qm-spark-enqueue"
    run_dir = base / queue / run_id
    rows_path = str(run_dir / "rows")
    rejects_path = rejects or str(run_dir / "rejects")

    if not (run_dir / "rows" / "_SUCCESS").exists():
        route_and_check(df, topology, shapes, columns).write.mode("overwrite").parquet(rows_path)
        say("materialised", "*", 0)
    rows = spark.read.parquet(rows_path)
    counts = rows.groupBy("shard", "reason").count().collect()  # one pass for both tallies
    reasons: dict[str, int] = {}
    per_shard: dict[str, int] = {}
    for r in counts:
        if r["reason"] is None:
            per_shard[str(r["shard"])] = int(r["count"])
        else:
            reasons[str(r["reason"])] = reasons.get(str(r["reason"]), 0) + int(r["count"])
    rejected = sum(reasons.values())
    if rejected:
        rows.filter(F.col("reason").isNotNull()).drop("partition").write.mode("overwrite").parquet(rejects_path)
    good = rows.filter(F.col("reason").isNull())
    result = LoadResult(
        run_id,
        queue,
        sum(per_shard.values()),
        rejected,
        rejects_path if rejected else None,
        [ShardResult(s.name, per_shard.get(s.name, 0)) for s in topology.shards],
    )
    say("validated", "*", result.rows)
    if rejected:
        say("rejected", "*", rejected)
        if bad_rows == "fail":
            raise BadRowsError(rejected, rejects_path, reasons)
    if stop_after == "validated":
        return result

    by_name = {s.name: s for s in topology.shards}
    todo = []
    for sr_ in result.shards:
        state = _ledger_state(by_name[sr_.shard].dsn, run_id, queue)
        if state in ("published", "prepared"):
            sr_.state = "published"
            say("already published", sr_.shard, sr_.rows)
            continue
        todo.append(sr_)
    for sr_ in todo:
        _stage(good, by_name[sr_.shard], queue, run_id, sr_.rows, tasks_per_shard, batch_size)
        sr_.state = "staged"
        say("staged", sr_.shard, sr_.rows)
        if fault:
            fault("staged", sr_.shard)
    if stop_after == "staged":
        return result
    if atomic:
        _publish_atomic(topology, queue, run_id, todo, say, fault)
    else:
        for sr_ in todo:
            with psycopg.connect(by_name[sr_.shard].dsn) as conn:
                row = conn.execute("SELECT qm.publish_run(%s, %s)", (run_id, queue)).fetchone()
                conn.commit()
            sr_.published = None if row is None or row[0] is None else int(row[0])
            sr_.state = "published"
            say("published", sr_.shard, sr_.published or 0)
    return result


def _stage(good: DataFrame, shard: Shard, queue: str, run_id: str, expected: int, tasks: int, batch: int) -> None:
    """Write the shard's rows into qm.spark_staging (after removing any left by an earlier try),
    then check that every row key arrived."""
    with psycopg.connect(shard.dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM qm.spark_staging WHERE run_id = %s AND queue = %s", (run_id, queue))
    if expected:
        target = shard_jdbc_target(shard.dsn)
        props = {
            **target.properties,
            "batchsize": str(batch),
            "reWriteBatchedInserts": "true",
            # payload (JSON text) and fire_at (ISO text) are cast by the server: jsonb, timestamptz
            "stringtype": "unspecified",
        }
        rows = (
            good.filter(F.col("shard") == shard.name)
            .select(
                F.lit(run_id).alias("run_id"),
                F.lit(queue).alias("queue"),
                "row_key",
                "tenant",
                F.col("partition").cast("short").alias("partition"),
                "payload",
                F.date_format("fire_at", "yyyy-MM-dd'T'HH:mm:ss.SSSSSSXXX").alias("fire_at"),
                "dedup_key",
            )
            # at most ``tasks`` writers, without a shuffle (the materialised files are already split)
            .coalesce(tasks)
        )
        try:
            rows.write.jdbc(target.url, "qm.spark_staging", mode="append", properties=props)
        except Exception as exc:
            if "org.postgresql.Driver" in str(exc) or "No suitable driver" in str(exc):
                raise ConfigurationError(sr.NO_DRIVER_HINT) from None
            raise
    with psycopg.connect(shard.dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(DISTINCT row_key) FROM qm.spark_staging WHERE run_id = %s AND queue = %s", (run_id, queue)
        ).fetchone()
        staged = 0 if row is None else int(row[0])
        if staged != expected:
            raise RuntimeError(f"shard {shard.name!r}: {staged} rows staged for run {run_id!r}, {expected} expected")
        conn.execute(
            "INSERT INTO qm.spark_runs (run_id, queue, state, staged_rows) VALUES (%s, %s, 'staged', %s) "
            "ON CONFLICT (run_id, queue) DO UPDATE SET state = 'staged', staged_rows = excluded.staged_rows, "
            "updated_at = clock_timestamp()",
            (run_id, queue, staged),
        )


def _gid(queue: str, run_id: str, shard: str) -> str:
    return f"{GID_PREFIX}{queue}:{run_id}:{shard}"


def _publish_atomic(
    topology: Topology,
    queue: str,
    run_id: str,
    todo: list[ShardResult],
    say: ProgressCallback,
    fault: FaultHook | None,
) -> None:
    """Prepare every shard's publish, record the decision on the coordinator, commit each."""
    by_name = {s.name: s for s in topology.shards}
    prepared: list[str] = []
    try:
        for sr_ in todo:
            with psycopg.connect(by_name[sr_.shard].dsn) as conn:
                row = conn.execute("SELECT qm.publish_run(%s, %s, 'prepared')", (run_id, queue)).fetchone()
                sr_.published = None if row is None or row[0] is None else int(row[0])
                conn.execute(f"PREPARE TRANSACTION '{_gid(queue, run_id, sr_.shard)}'")
            prepared.append(sr_.shard)
            sr_.state = "prepared"
            say("prepared", sr_.shard, sr_.published or 0)
            if fault:
                fault("prepared", sr_.shard)
    except Exception:
        for name in prepared:
            _finish(by_name[name].dsn, _gid(queue, run_id, name), commit=False)
        raise
    coordinator = topology.shards[0]
    with psycopg.connect(coordinator.dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO qm.spark_decisions (run_id, queue, shards) VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
            (run_id, queue, prepared),
        )
    say("decided", coordinator.name, len(prepared))
    if fault:
        fault("decided", coordinator.name)
    for sr_ in todo:
        _finish(by_name[sr_.shard].dsn, _gid(queue, run_id, sr_.shard), commit=True)
        sr_.state = "published"
        say("published", sr_.shard, sr_.published or 0)


def _finish(dsn: str, gid: str, *, commit: bool) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        if commit:
            conn.execute(f"COMMIT PREPARED '{gid}'")
            parts = gid[len(GID_PREFIX) :].split(":")
            conn.execute(
                "UPDATE qm.spark_runs SET state = 'published', updated_at = clock_timestamp() "
                "WHERE queue = %s AND run_id = %s AND state = 'prepared'",
                (parts[0], parts[1]),
            )
        else:
            conn.execute(f"ROLLBACK PREPARED '{gid}'")


def recover(topology: Topology, *, run_id: str | None = None) -> dict[str, str]:
    """Finish the two-phase runs left prepared (all of them, or ``run_id``'s): a run whose decision
    is recorded on the coordinating shard (the topology's first) is committed on every shard, any
    other is rolled back. Returns {prepared transaction: "committed" | "rolled back"}.

    Do not run it for a run id whose job is still running (it would roll back a publish in flight).
    """
    coordinator = topology.shards[0]
    done: dict[str, str] = {}
    for shard in topology.shards:
        with psycopg.connect(shard.dsn, autocommit=True) as conn:
            gids = [
                str(r[0])
                for r in conn.execute(
                    "SELECT gid FROM pg_prepared_xacts WHERE database = current_database() AND gid LIKE %s",
                    (GID_PREFIX + "%",),
                ).fetchall()
            ]
        for gid in gids:
            queue, run, _ = gid[len(GID_PREFIX) :].split(":", 2)
            if run_id is not None and run != run_id:
                continue
            with psycopg.connect(coordinator.dsn, autocommit=True) as conn:
                decided = conn.execute(
                    "SELECT 1 FROM qm.spark_decisions WHERE run_id = %s AND queue = %s", (run, queue)
                ).fetchone()
            _finish(shard.dsn, gid, commit=decided is not None)
            done[gid] = "committed" if decided is not None else "rolled back"
    return done


# ----------------------------------------------------------------------------------- entry points


def run_cli(args: Any, topology: Topology, emit: Callable[[str], None]) -> int:
    """``qm spark enqueue`` (see queue_manager.cli): one line per stage and shard."""
    columns = Columns(args.tenant_col, args.payload_col, args.fire_at_col, args.dedup_col)
    with sr.job_session("qm-enqueue", args.jdbc_jar) as spark:
        df = read_source(spark, args.input, args.format)
        result = load_events(
            df,
            topology,
            args.queue,
            run_id=args.run_id,
            columns=columns,
            bad_rows=args.bad_rows,
            rejects=args.rejects,
            work_dir=args.work_dir,
            atomic=args.atomic,
            tasks_per_shard=args.tasks_per_shard,
            batch_size=args.batch_size,
            stop_after=args.stop_after,
            progress=lambda stage, shard, n: emit(f"run {args.run_id}: {stage} {shard} rows={n}"),
        )
    emit(
        f"run {result.run_id}: done: {result.rows} good rows, {result.rejected} rejected, "
        f"{result.published} events published by this call"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The script entry (``python -m spark_jobs.enqueue``, ``spark-submit``): ``qm spark enqueue ARGS``."""
    from queue_manager.cli.main import main as qm_main

    args = list(sys.argv[1:] if argv is None else argv)
    return qm_main(["spark", "enqueue", *args])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
