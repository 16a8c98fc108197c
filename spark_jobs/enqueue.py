"""Bulk enqueue from Spark: all-or-nothing per shard (or across shards), safe to re-run.

A run moves a DataFrame of events into one queue on every shard:

0. **one live run per run id**: before it changes anything, a run takes a session advisory lock for
   (queue, run id) on the coordinating shard (the topology's first), on a connection of its own held
   to the end (:func:`_run_lock`). A second run of the id started while the first is alive waits for
   it (``wait_for_other_run`` seconds, then RunConflictError with nothing changed), then goes on as
   a re-run: it finishes what the first left undone, or reports the shards already published with
   their ledgers' counts. A killed run's lock goes with its connection;
1. **route and check** (Spark SQL only, no Python UDF): each row gets a row key, its shard (keyspace
   range of the tenant's md5) and a partition of its tenant's shuffle set, spread over the set by a
   hash of the row key; a row that breaks a rule of the queue gets a reason. The row keys must not
   change when Spark recomputes a task: they come from ``monotonically_increasing_id`` over the
   source itself when its plan is a deterministic scan (files, a table, a range, a local
   collection, with projections and filters), else the keyed rows are **materialised** once as
   Parquet under the run's work directory and read back (``materialize``);
2. **stage** each shard's rows, good and rejected, into a stage table of the run's own on that
   shard (``qm.stage_run``: UNLOGGED, no index). By default (``stage_with="copy"``) one Spark pass
   writes every shard's rows as CSV files (Spark's file committer keeps one attempt of each task),
   and the driver COPYs each shard's files in one transaction through the JDBC driver's
   CopyManager in its JVM (no Python on the executors, no row through Python). With
   ``stage_with="jdbc"``, a Spark pass per shard writes through the JDBC writer, a few tasks per
   shard: Spark commits each task on its own and a retried or speculative task writes its rows
   again, so the stage table may hold a row twice; the publish keeps one per row key. The run
   counts and publishes only the stage table it was given (a ledger naming another one fails the
   run, :func:`_fence`);
3. **validate**: the shards count what was staged (``qm.staged_run``: good rows, rejected rows by
   reason, rows written twice); rejected rows are read back and written to a Parquet output with
   their reason. By default the run then stops before anything is published (its staging dropped);
   ``bad_rows="skip"`` publishes the good rows;
4. **publish**, one transaction per shard: ``qm.publish_run`` inserts the run's good rows into the
   queue table with one statement (``INSERT ... SELECT``, with ``ON CONFLICT`` for the rows with a
   dedup key only; the queue's verify trigger checks every row, so a row
   that slipped past the checks fails the whole shard, and wakes the manager once), bumps the load
   counters, marks the run published in the shard's ledger (``qm.spark_runs``) and drops the stage
   table. A shard whose ledger says published is skipped, so a re-run adds nothing; a run staged
   completely and then interrupted is published by the next run of its id without Spark.
   With ``atomic=True`` every shard's publish is prepared (``PREPARE TRANSACTION``), the decision is
   recorded on the coordinating shard (the topology's first), and only then is each part committed;
   :func:`recover` finishes a run left prepared (decision recorded: commit; none: record an abort,
   roll back), and every run starts, once it holds its run id, by recovering its own run id (and
   other runs' parts prepared more than a minute ago).

See docs/spark.md for the options, the guarantees and the measured figures.
"""

from __future__ import annotations

import logging
import math
import re
import sys
import tempfile
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

if __package__ in (None, ""):  # run as a file (spark-submit spark_jobs/enqueue.py): import the project from here
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psycopg
from psycopg import sql
from py4j.protocol import Py4JJavaError
from pyspark.sql import Column, DataFrame, Observation, SparkSession
from pyspark.sql import functions as F

from queue_manager.db.errors import translate
from queue_manager.db.sqlfiles import query
from queue_manager.domain.names import check_queue_name
from queue_manager.domain.topology import Shard, Topology
from queue_manager.errors import ConfigurationError, EnqueueError, InvalidEventError, UnknownQueueError
from spark_jobs import routing as sr
from spark_jobs.jdbc import shard_jdbc_target
from spark_jobs.session import jdbc_connection

logger = logging.getLogger(__name__)

#: a run id names the run in ledgers, paths and prepared transactions
RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
#: the prefix of a two-phase run's prepared transactions: qm-run:<queue>:<run>:<shard>
GID_PREFIX = "qm-run:"
#: the earliest fire_at any queue accepts (the database's rule)
EARLIEST_FIRE_AT = "2000-01-01 00:00:00+00"
#: the queue columns a row carries as they are, text, NULL when the source has none (Columns.carried)
CARRIED = ("dedup_key", "traceparent", "tracestate", "baggage", "concurrency_key", "rate_key")
#: the columns of a stage table, in the order Spark writes them (the order of copy_stage in spark.sql)
STAGE_COLUMNS = (
    "row_key",
    "tenant",
    "partition",
    "payload",
    "fire_at_us",
    "dedup_key",
    "reason",
    "traceparent",
    "tracestate",
    "baggage",
    "priority",
    "concurrency_key",
    "rate_key",
)
#: the forms of the trace context columns, as the queue tables' triggers test them (qm.rule_trace): a
#: row breaking one is rejected with a reason
TRACEPARENT_RE = r"^(?!ff)[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}$"
PRINTABLE_ASCII_RE = r"^[ -~]*$"
#: a recovery without a run id leaves alone the prepared parts younger than this (a job may still
#: be between its prepares and its decision)
RECOVER_MIN_AGE_SECONDS = 60.0
#: staging left unfinished for longer than this is dropped at the start of every run
STAGING_TTL_SECONDS = 24 * 3600.0
#: how long a run waits for another live run of its id (an orchestrator's retry of a task whose first
#: attempt is still going) before it refuses: long enough for a large load to finish, bounded so that
#: a stuck attempt does not hold its retry for ever
OTHER_RUN_WAIT_SECONDS = 3600.0
#: PostgreSQL's largest lock_timeout, in milliseconds (about 24.8 days)
_MAX_LOCK_TIMEOUT_MS = 2_147_483_647
#: plan nodes whose output (rows and their order within each Spark partition) is the same when Spark
#: recomputes them, as long as the input files do not change
_DETERMINISTIC_NODES = frozenset(
    {"Project", "Filter", "LogicalRelation", "HiveTableRelation", "Range", "LocalRelation"}
)

Stage = Literal["staged", "validated"]
#: how the rows reach the stage tables: "copy" (CSV files written by Spark, then COPY from the
#: driver) or "jdbc" (Spark's JDBC writer: batched INSERTs from the executors)
StageWith = Literal["copy", "jdbc"]
#: Spark's CSV writer set to PostgreSQL's CSV dialect: quotes doubled, NULL an unquoted empty
#: field, an empty string "", values written as they are (no trimming)
_STAGE_CSV = {
    "header": "false",
    "quote": '"',
    "escape": '"',
    "nullValue": "",
    "emptyValue": '""',
    "ignoreLeadingWhiteSpace": "false",
    "ignoreTrailingWhiteSpace": "false",
    "lineSep": "\n",
    "encoding": "UTF-8",
    "compression": "none",
}
ProgressCallback = Callable[[str, str, int], None]
#: a test's hook, called at (step, shard): "staged", "prepared", "decided", "committed"; it may raise
FaultHook = Callable[[str, str], None]
_SQL = "spark.sql"


class BadRowsError(InvalidEventError):
    """Rows broke the queue's rules; nothing was published. ``rejects`` names their Parquet output."""

    def __init__(self, count: int, rejects: str, reasons: Mapping[str, int]) -> None:
        listed = ", ".join(f"{reason}: {n}" for reason, n in sorted(reasons.items()))
        super().__init__(
            f"{count} rows were rejected ({listed}); nothing was published; see {rejects} "
            "(fix the source and run again, or pass bad_rows='skip' / --bad-rows skip to publish the good rows)"
        )
        self.count = count
        self.rejects = rejects
        self.reasons = dict(reasons)


class RunAbortedError(EnqueueError):
    """A recovery aborted this two-phase run before its decision was recorded; nothing was published."""


class RunConflictError(EnqueueError):
    """Another run of the same run id is alive, or got in while this one ran: this call stopped
    without touching that run's staging."""


@dataclass(frozen=True)
class Columns:
    """Which source columns hold what.

    ``payload`` may be a JSON string column or a struct, map or array column (turned into JSON with
    ``to_json``); ``payload_cols``, when given, instead builds the payload as a JSON object of those
    columns. ``fire_at`` (optional) a timestamp, date or string column (NULL: now); ``dedup_key``
    optional. ``traceparent``, ``tracestate`` and ``baggage`` (optional): string columns holding
    each row's W3C trace context (NULL: none), stored with the event and carried to its receiver
    (docs/observability.md); a malformed value rejects the row. ``priority`` (optional): an integer
    column, 1 (highest) to 5 (NULL: the queue's default_priority); ``concurrency_key`` and
    ``rate_key`` (optional): string columns of the keys the queue's key limits count (NULL: none;
    docs/sql.md); a value out of range rejects the row.
    """

    tenant: str = "tenant"
    payload: str = "payload"
    fire_at: str | None = None
    dedup_key: str | None = None
    payload_cols: tuple[str, ...] = ()
    traceparent: str | None = None
    tracestate: str | None = None
    baggage: str | None = None
    priority: str | None = None
    concurrency_key: str | None = None
    rate_key: str | None = None

    def carried(self) -> tuple[tuple[str, str | None], ...]:
        """The columns carried to the queue table as they are (as text, NULL when not given): each
        queue column of :data:`CARRIED` with the source column that holds it, or None.

        The one place the job's Spark side lists them: a new one (a key column of the queue) is a
        field here and a name in :data:`CARRIED`; the database side is the stage table's column
        (``qm.stage_run``, ``copy_stage`` in spark.sql) and the publish's INSERT (``qm.publish_run``).
        """
        return tuple((name, getattr(self, name)) for name in CARRIED)


@dataclass(frozen=True)
class QueueShape:
    """What routing and the checks need of a queue on one shard."""

    partitions: int
    shuffle: int
    payload_limit_bytes: int
    max_delay_seconds: float


@dataclass
class ShardResult:
    """What a run did on one shard."""

    shard: str
    #: the run's good rows on this shard (distinct row keys)
    rows: int = 0
    #: the run's rejected rows staged on this shard
    rejected: int = 0
    #: rows written twice by retried or speculative tasks (kept once)
    duplicates: int = 0
    #: events inserted by this call's publish; None when the shard had the run already
    published: int | None = None
    #: pending, staged, prepared, published, already published, abandoned
    state: str = "pending"


@dataclass
class LoadResult:
    """What a run did: the counts, where the rejects went and each shard's part."""

    run_id: str
    queue: str
    #: good rows over every shard
    rows: int = 0
    rejected: int = 0
    #: rejected rows by reason
    reasons: dict[str, int] = field(default_factory=dict)
    rejects_path: str | None = None
    #: the keyed rows were materialised (written once as Parquet) before staging
    materialized: bool = False
    shards: list[ShardResult] = field(default_factory=list)

    @property
    def published(self) -> int:
        """Events inserted by this call, over every shard."""
        return sum(s.published or 0 for s in self.shards)


def check_run_id(run_id: str) -> str:
    """``run_id`` if it is a valid run id, else ConfigurationError."""
    if not isinstance(run_id, str) or not RUN_ID_RE.match(run_id):
        raise ConfigurationError(
            f"run id {run_id!r} must be 1 to 64 characters of letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return run_id


def work_base(master: str, work_dir: str | None) -> str:
    """The runs' base directory: ``work_dir``, else (with a local master only) the driver's temporary
    directory. On a cluster the executors write the run's files there and the driver reads them, so
    a directory of the driver's own will not do: ConfigurationError when ``work_dir`` is missing."""
    if work_dir:
        return work_dir.rstrip("/") or "/"
    if master.startswith("local"):
        return str(Path(tempfile.gettempdir()) / "qm-spark-enqueue")
    raise ConfigurationError(
        f"on a cluster (master {master!r}) the job needs --work-dir (work_dir): a directory that the driver and "
        "every executor read and write (an HDFS or S3 path, or a mount shared by every machine); the default, "
        "the driver's temporary directory, is not seen by the executors. Nothing was changed"
    )


def read_source(spark: SparkSession, source: str, fmt: str, options: Mapping[str, str] | None = None) -> DataFrame:
    """A DataFrame from a Parquet, CSV (with a header), JSON or ORC path, or a table (``fmt="table"``)."""
    reader = spark.read.options(**dict(options or {}))
    if fmt == "table":
        return spark.table(source)
    if fmt == "csv":
        return reader.option("header", "true").csv(source)
    if fmt in ("parquet", "json", "orc"):
        return reader.format(fmt).load(source)
    raise ConfigurationError(f"unknown input format {fmt!r}: use parquet, csv, json, orc or table")


# ----------------------------------------------------------------------------------- the shards


def _connect(shard: Shard, *, autocommit: bool = True) -> psycopg.Connection[Any]:
    return psycopg.connect(shard.dsn, autocommit=autocommit, application_name="qm-spark-enqueue")


def queue_shape(shard: Shard, queue: str) -> QueueShape:
    """The queue's settings on one shard; UnknownQueueError if it has no such queue, and
    ConfigurationError if the database is another shard than the topology says."""
    with _connect(shard) as conn:
        ident = conn.execute(query("shard_name", _SQL)).fetchone()
        if ident is None or ident[0] != shard.name:
            raise ConfigurationError(
                f"the database of shard {shard.name!r} says it is {None if ident is None else ident[0]!r}: "
                "wrong topology file, or run 'qm migrate --topology <file>'"
            )
        row = conn.execute(query("queue_shape", _SQL), {"queue": queue}).fetchone()
    if row is None:
        raise UnknownQueueError(f"no queue named {queue!r} on shard {shard.name!r}: create it with 'qm queue create'")
    return QueueShape(int(row[0]), int(row[1]), int(row[2]), float(row[3]))


def _require_two_phase(shards: Sequence[Shard]) -> None:
    for s in shards:
        with _connect(s) as conn:
            row = conn.execute(query("max_prepared_transactions", _SQL)).fetchone()
        if row is None or int(row[0]) <= 0:
            raise ConfigurationError(
                f"--atomic needs two-phase commit, but shard {s.name!r} has max_prepared_transactions = 0: "
                "set it (for example to 10) in postgresql.conf and restart the server, or run without --atomic"
            )


def cleanup(topology: Topology, *, older_than: float = STAGING_TTL_SECONDS) -> dict[str, int]:
    """Drop the staging of runs left unfinished for more than ``older_than`` seconds, on every shard.
    Returns {shard: runs abandoned}."""
    out = {}
    for shard in topology.shards:
        with _connect(shard) as conn:
            row = conn.execute(query("cleanup_runs", _SQL), {"older_than": older_than}).fetchone()
        out[shard.name] = int(row[0]) if row else 0
    return out


# ----------------------------------------------------------------------------------- routing


def _shard_of(kid: Column, topology: Topology) -> Column:
    """The shard that owns a keyspace id (:func:`spark_jobs.routing.keyspace_hex`), NULL for none."""
    expr: Column | None = None
    for s in topology.shards:
        cond = sr.keyspace_hex_in_range(kid, s.key_range.start, s.key_range.end)
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
    """A partition of the tenant's shuffle set: a tenant's rows are spread evenly over its set by a
    hash of their row keys."""
    pick = F.pmod(F.xxhash64(row_key), F.lit(shape.shuffle)) + F.lit(1)
    return F.element_at(sr.shuffle_set(tenant, shape.partitions, shape.shuffle), pick.cast("int"))


def _payload_json(df: DataFrame, columns: Columns) -> Column:
    if columns.payload_cols:
        return F.to_json(F.struct(*[F.col(c) for c in columns.payload_cols]))
    dtype = df.schema[columns.payload].dataType.typeName()
    col = F.col(columns.payload)
    if dtype == "string":
        return col
    if dtype in ("struct", "map", "array"):
        return F.to_json(col)
    raise ConfigurationError(
        f"payload column {columns.payload!r} is {dtype}: give a JSON string, struct, map or array column "
        "(or several columns with payload_cols / --payload-cols)"
    )


def _payload_is_text(df: DataFrame, columns: Columns) -> bool:
    """Whether the payload is the source's own JSON text (to be checked), not built by ``to_json``."""
    return not columns.payload_cols and df.schema[columns.payload].dataType.typeName() == "string"


def _fire_at(df: DataFrame, name: str) -> Column:
    col = F.col(name)
    dtype = df.schema[name].dataType.typeName()
    if dtype in ("timestamp", "timestamp_ntz", "date"):
        return col.cast("timestamp")
    if dtype == "string":
        return F.try_to_timestamp(col)
    raise ConfigurationError(f"fire_at column {name!r} is {dtype}: give a timestamp, date or ISO-8601 string column")


def _check_columns(df: DataFrame, columns: Columns) -> None:
    named = [("tenant", columns.tenant), ("fire_at", columns.fire_at)]
    named += [(key.replace("_", " "), name) for key, name in columns.carried()]
    named += [("priority", columns.priority)]
    named += [("payload", c) for c in columns.payload_cols] if columns.payload_cols else [("payload", columns.payload)]
    for what, name in named:
        if name is not None and name not in df.columns:
            raise ConfigurationError(f"the source has no {what} column {name!r} (it has {', '.join(df.columns)})")


def route_and_check(
    df: DataFrame,
    topology: Topology,
    shapes: Mapping[str, QueueShape],
    columns: Columns,
    *,
    only_shards: Collection[str] | None = None,
) -> DataFrame:
    """The source rows with their row key, shard and partition, and a ``reason`` (NULL: good).

    Columns: row_key, tenant, payload (JSON text), fire_at (timestamp or NULL), shard, partition,
    reason, then the carried columns (:data:`CARRIED`: dedup_key, the trace context and the keys)
    and the priority. A row with
    no shard (no tenant) is given the topology's first shard, where it is staged as a reject. The
    row key is ``monotonically_increasing_id()`` over ``df`` (or ``df``'s
    own ``row_key`` column when it has one). ``only_shards``: keep those shards' rows only, before
    the checks and the shuffle set are computed (Spark cannot move a filter below the row key's
    non-deterministic projection by itself). Raises ConfigurationError for a column the source does
    not have or cannot be used.
    """
    _check_columns(df, columns)
    row_key = F.col("row_key") if "row_key" in df.columns else F.monotonically_increasing_id()
    fire_at = _fire_at(df, columns.fire_at) if columns.fire_at else F.lit(None).cast("timestamp")
    keyed = df.select(
        row_key.alias("row_key"),
        F.col(columns.tenant).cast("string").alias("tenant"),
        _payload_json(df, columns).alias("payload"),
        fire_at.alias("fire_at"),
        (F.col(columns.fire_at).isNotNull() if columns.fire_at else F.lit(False)).alias("_fire_given"),
        *(
            (F.col(name).cast("string") if name else F.lit(None).cast("string")).alias(key)
            for key, name in columns.carried()
        ),
        (F.col(columns.priority).cast("int") if columns.priority else F.lit(None).cast("int")).alias("priority"),
    )
    t = F.col("tenant")
    # the keyspace id once per row, whatever the number of shards
    routed = keyed.withColumn("_kid", sr.keyspace_hex(t)).withColumn("_shard", _shard_of(F.col("_kid"), topology))
    routed = routed.withColumn("shard", F.coalesce(F.col("_shard"), F.lit(topology.shards[0].name)))
    if only_shards is not None:
        routed = routed.filter(F.col("shard").isin(sorted(only_shards)))
    s = F.col("_shard")
    limit = _per_shard(s, shapes, lambda q: F.lit(q.payload_limit_bytes))
    max_delay = _per_shard(s, shapes, lambda q: F.lit(int(q.max_delay_seconds)))
    payload = F.col("payload")
    fire = F.col("fire_at")
    reason = (
        F.when(t.isNull() | (t == ""), F.lit("missing tenant"))
        .when(s.isNull(), F.lit("no shard owns the tenant"))
        .when(payload.isNull(), F.lit("missing payload"))
        .when(F.octet_length(payload) > limit, F.lit("payload too large for the queue"))
        .when(
            # JSON text from the source is parsed; to_json's output is JSON by construction
            F.lit(_payload_is_text(df, columns))
            & F.get_json_object(payload, "$").isNull()
            & (F.trim(payload) != "null"),
            F.lit("payload is not valid JSON"),
        )
        .when(F.col("_fire_given") & fire.isNull(), F.lit("invalid fire_at"))
        .when(
            fire.isNotNull()
            & (
                (fire < F.lit(EARLIEST_FIRE_AT).cast("timestamp"))
                | (fire > F.current_timestamp() + F.make_interval(secs=max_delay))
            ),
            F.lit("fire_at out of range"),
        )
        .when(~F.col("traceparent").rlike(TRACEPARENT_RE), F.lit("invalid traceparent"))
        .when(
            (F.length("tracestate") > 512) | ~F.col("tracestate").rlike(PRINTABLE_ASCII_RE), F.lit("invalid tracestate")
        )
        .when((F.length("baggage") > 8192) | ~F.col("baggage").rlike(PRINTABLE_ASCII_RE), F.lit("invalid baggage"))
        .when(~F.col("priority").between(1, 5), F.lit("invalid priority"))
        .when(~F.length("concurrency_key").between(1, 256), F.lit("invalid concurrency_key"))
        .when(~F.length("rate_key").between(1, 256), F.lit("invalid rate_key"))
    )
    partition = _per_shard(s, shapes, lambda q: _partition(t, F.col("row_key"), q))
    return routed.select(
        "row_key",
        "tenant",
        "payload",
        "fire_at",
        "shard",
        partition.cast("short").alias("partition"),
        reason.alias("reason"),
        *CARRIED,
        F.col("priority").cast("short").alias("priority"),
    )


def is_deterministic_scan(df: DataFrame) -> bool:
    """Whether Spark recomputes ``df`` with the same rows in the same order in each partition: its
    optimised plan has only scans, projections and filters, and no non-deterministic expression.
    Row keys from ``monotonically_increasing_id`` over such a plan survive task retries."""
    plan: Any = df._jdf.queryExecution().optimizedPlan()
    if not plan.deterministic():
        return False
    stack = [plan]
    while stack:
        node = stack.pop()
        if node.nodeName() not in _DETERMINISTIC_NODES:
            return False
        children = node.children()
        stack.extend(children.apply(i) for i in range(children.size()))
    return True


# ----------------------------------------------------------------------------------- file system


def _hadoop_path(spark: SparkSession, path: str) -> tuple[Any, Any]:
    jvm: Any = spark.sparkContext._jvm
    hpath = jvm.org.apache.hadoop.fs.Path(path)
    return hpath.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration()), hpath


def _exists(spark: SparkSession, path: str) -> bool:
    fs, hpath = _hadoop_path(spark, path)
    return bool(fs.exists(hpath))


def _delete(spark: SparkSession, path: str) -> None:
    fs, hpath = _hadoop_path(spark, path)
    fs.delete(hpath, True)


# ----------------------------------------------------------------------------------- the run


class _Crash(BaseException):
    """Raised by a test's fault hook to stop a run where it stands, as a killed process would."""


@dataclass
class _Plan:
    """One run's fixed parts: where things go and how the shards are reached."""

    spark: SparkSession
    topology: Topology
    queue: str
    run_id: str
    run_dir: str
    rejects_path: str
    say: ProgressCallback
    fault: FaultHook | None
    tasks: int
    batch: int
    stage_with: StageWith
    #: rejected rows by reason, per shard (as counted by the shard)
    reasons: dict[str, dict[str, int]] = field(default_factory=dict)
    #: the run's stage table on each shard not yet published, as qm.stage_run gave it: the only one
    #: this run counts and publishes there
    tables: dict[str, str] = field(default_factory=dict)
    #: rows of each shard that this call's Spark pass wrote to stage files (COPY staging)
    written: dict[str, int] = field(default_factory=dict)

    @property
    def rows_path(self) -> str:
        return f"{self.run_dir}/rows"

    @property
    def stage_path(self) -> str:
        return f"{self.run_dir}/stage"

    def hook(self, step: str, shard: str) -> None:
        if self.fault is not None:
            self.fault(step, shard)


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
    materialize: bool | None = None,
    atomic: bool = False,
    tasks_per_shard: int = 2,
    batch_size: int = 10_000,
    stage_with: StageWith = "copy",
    staging_ttl: float = STAGING_TTL_SECONDS,
    stop_after: Stage | None = None,
    wait_for_other_run: float = OTHER_RUN_WAIT_SECONDS,
    progress: ProgressCallback | None = None,
    fault: FaultHook | None = None,
) -> LoadResult:
    """Enqueue every row of ``df`` into ``queue`` on the shards of ``topology``, once.

    ``run_id`` names the run: a re-run with the same id finishes an interrupted run and adds
    nothing to a finished one. ``bad_rows``: ``"fail"`` (default) raises BadRowsError before
    anything is published when a row breaks a rule; ``"skip"`` publishes the good rows. ``rejects``:
    where the rejected rows go (Parquet, with a ``reason``), default ``<work_dir>/<queue>/<run>/rejects``.
    ``work_dir``: the run's directory (rejects, materialised rows): a path the driver and every
    executor can read (default: under the system's temporary directory). ``materialize``: write the
    keyed rows once as Parquet before staging (None: only when ``df`` is not a deterministic scan,
    see :func:`is_deterministic_scan`). ``atomic``: the run is visible on every shard or on none
    (two-phase commit; needs ``max_prepared_transactions > 0``). ``stage_with``: ``"copy"``
    (default: one Spark pass writes every shard's rows as CSV files under the work directory, then
    the driver COPYs each shard's files into its stage table) or ``"jdbc"`` (a Spark pass per shard
    through the JDBC writer). ``tasks_per_shard``: JDBC write tasks (connections) per shard and
    ``batch_size``: rows per JDBC batch, with ``"jdbc"``. ``staging_ttl``: seconds
    after which staging left by dead runs is dropped (at the start of the run). ``stop_after``: stop
    after ``"staged"`` (as a job killed before publishing) or ``"validated"`` (a dry run: counts and
    rejects, nothing published; a later run of the id publishes without staging again).
    ``wait_for_other_run``: seconds to wait for another live run of the same id (it holds the run's
    lock, see :func:`_run_lock`) before raising RunConflictError with nothing changed; 0 refuses at
    once. ``progress(stage, shard, rows)`` is called at each step (``"waiting"``, on the coordinating
    shard, with the wait in whole seconds, when another live run of the id holds it).
    """
    check_run_id(run_id)
    check_queue_name(queue)
    columns = columns or Columns()
    if tasks_per_shard < 1 or batch_size < 1:
        raise ConfigurationError("tasks_per_shard and batch_size must be at least 1")
    if stage_with not in ("copy", "jdbc"):
        raise ConfigurationError(f"stage_with must be 'copy' or 'jdbc', got {stage_with!r}")
    if bad_rows not in ("fail", "skip"):
        raise ConfigurationError(f"bad_rows must be 'fail' or 'skip', got {bad_rows!r}")
    if not (math.isfinite(wait_for_other_run) and wait_for_other_run >= 0):
        raise ConfigurationError(f"wait_for_other_run must be 0 or more seconds, got {wait_for_other_run!r}")
    _check_columns(df, columns)
    base = work_base(df.sparkSession.sparkContext.master or "", work_dir)
    shapes = {s.name: queue_shape(s, queue) for s in topology.shards}
    if atomic:
        _require_two_phase(topology.shards)
    say = progress or (lambda stage, shard, n: None)
    # Nothing above changes anything; everything below may take it that no other job works on the run
    # id, its own prepared parts and stage tables included.
    with _run_lock(topology, queue, run_id, wait_for_other_run, say):
        # Two-phase runs left prepared: other runs' once their job has had time to decide, and this
        # run's own at once (an earlier attempt of it is dead, and its prepared parts hold the ledger
        # rows this attempt needs). Its earlier decision must not decide this attempt.
        recover(topology, min_age=RECOVER_MIN_AGE_SECONDS)
        recover(topology, run_id=run_id, min_age=0.0)
        with _connect(topology.shards[0]) as conn:
            conn.execute(query("forget_decision", _SQL), {"run": run_id, "queue": queue})
        cleanup(topology, older_than=staging_ttl)
        run_dir = f"{base}/{queue}/{run_id}"
        plan = _Plan(
            df.sparkSession,
            topology,
            queue,
            run_id,
            run_dir,
            rejects or f"{run_dir}/rejects",
            say,
            fault,
            tasks_per_shard,
            batch_size,
            stage_with,
        )
        plan.reasons = {s.name: {} for s in topology.shards}
        result = LoadResult(run_id, queue, shards=[ShardResult(s.name) for s in topology.shards])

        to_stage = _begin(plan, result)
        if to_stage:
            routed, result.materialized = _routed(plan, df, shapes, columns, materialize)
            if stage_with == "copy":
                _write_stage_files(plan, routed(to_stage))
                plan.say("written", "*", sum(plan.written.values()))
        for shard, part in zip(topology.shards, result.shards, strict=True):
            if shard.name in to_stage:
                if stage_with == "copy":
                    _copy_stage(plan, shard, plan.tables[shard.name])
                else:
                    _stage(plan, routed({shard.name}), shard, plan.tables[shard.name])
                _count(plan, shard, part)
                plan.say("staged", shard.name, part.rows + part.rejected)
                plan.hook("staged", shard.name)
            elif part.state == "pending":  # staged completely by an earlier attempt: count its table
                _count(plan, shard, part)
        if _exists(plan.spark, plan.stage_path):
            _delete(plan.spark, plan.stage_path)  # every shard is staged: its files are not needed again
        if stop_after == "staged":
            return result

        _validate(plan, result)
        if result.rejected and bad_rows == "fail":
            _abandon(plan)
            raise BadRowsError(result.rejected, plan.rejects_path, result.reasons)
        if stop_after == "validated":
            return result

        if atomic:
            _publish_atomic(plan, result)
        else:
            _publish(plan, result)
        if _exists(plan.spark, plan.rows_path):
            _delete(plan.spark, plan.rows_path)  # every shard has the run: the keyed rows are not needed again
        return result


@contextmanager
def _run_lock(topology: Topology, queue: str, run_id: str, wait: float, say: ProgressCallback) -> Iterator[None]:
    """Hold the run id for the block: one live run per (queue, run id).

    A session advisory lock on the coordinating shard, on a connection of its own, released when the
    block ends or the process dies (its connection goes with it, so a killed job's retry goes on at
    once). While another live run of the id holds it, wait for up to ``wait`` seconds (one
    ``waiting`` progress line), then raise RunConflictError: nothing was changed yet.
    """
    coordinator = topology.shards[0]
    key = {"queue": queue, "run": run_id}
    conn = _connect(coordinator)
    try:
        row = conn.execute(query("run_lock", _SQL), key).fetchone()
        held = row is not None and bool(row[0])
        if not held and wait > 0:
            say("waiting", coordinator.name, math.ceil(wait))
            timeout_ms = min(math.ceil(wait * 1000), _MAX_LOCK_TIMEOUT_MS)
            conn.execute(query("run_lock_timeout", _SQL), {"ms": str(timeout_ms)})
            try:
                conn.execute(query("run_lock_wait", _SQL), key)
                held = True
            except psycopg.errors.LockNotAvailable:
                pass
        if not held:
            waited = f" and did not end within {wait:g} s" if wait > 0 else ""
            raise RunConflictError(
                f"another run of {run_id!r} into queue {queue!r} is alive (it holds the run's lock on shard "
                f"{coordinator.name!r}){waited}; nothing was changed: let it finish and run the id again (it "
                "then reports what was published), wait longer (--wait-for-other-run / wait_for_other_run), "
                "or stop the other job"
            )
        yield
    finally:
        conn.close()


def _begin(plan: _Plan, result: LoadResult) -> set[str]:
    """Begin or resume the run on every shard: marks the shards that have the run published and
    records the others' stage tables (``plan.tables``); returns the shards to stage (the rest were
    staged completely by an earlier attempt)."""
    to_stage = set()
    for shard, part in zip(plan.topology.shards, result.shards, strict=True):
        with _connect(shard) as conn:
            row = conn.execute(query("stage_run", _SQL), {"run": plan.run_id, "queue": plan.queue}).fetchone()
        assert row is not None
        state, table = str(row[0]), row[1]
        if state == "published":
            part.state = state
            continue
        plan.tables[shard.name] = str(table)
        if state == "staging":
            to_stage.add(shard.name)
    return to_stage


def _routed(
    plan: _Plan, df: DataFrame, shapes: Mapping[str, QueueShape], columns: Columns, materialize: bool | None
) -> tuple[Callable[[Collection[str]], DataFrame], bool]:
    """A function giving some shards' routed and checked rows to stage, and whether the keyed rows
    were materialised first (they are when the keys could change on a recomputation)."""
    if materialize is None:
        materialize = not is_deterministic_scan(df)
    if not materialize and not _exists(plan.spark, f"{plan.rows_path}/_SUCCESS"):
        return (lambda names: route_and_check(df, plan.topology, shapes, columns, only_shards=names)), False
    # an earlier attempt of this run may have materialised its rows already: they are the run's rows
    if not _exists(plan.spark, f"{plan.rows_path}/_SUCCESS"):
        written = Observation("qm_materialized")
        keyed = route_and_check(df, plan.topology, shapes, columns).observe(written, F.count(F.lit(1)).alias("rows"))
        keyed.write.mode("overwrite").partitionBy("shard").parquet(plan.rows_path)
        expected, found = int(written.get["rows"]), plan.spark.read.parquet(plan.rows_path).count()
        if found != expected:
            _delete(plan.spark, plan.rows_path)
            raise ConfigurationError(
                f"the executors wrote {expected} keyed rows under {plan.rows_path}, but the driver reads {found} "
                "there: the work directory must be one that the driver and every executor share (an HDFS or S3 "
                "path, or a mount shared by every machine; --work-dir). Nothing was published"
            )
        plan.say("materialized", "*", expected)
    rows = plan.spark.read.parquet(plan.rows_path)
    return (lambda names: rows.filter(F.col("shard").isin(sorted(names)))), True


def _stage_columns(rows: DataFrame) -> list[Column]:
    """The columns of a stage table (:data:`STAGE_COLUMNS`), in its order, from routed rows."""
    return [F.unix_micros("fire_at").alias(c) if c == "fire_at_us" else F.col(c) for c in STAGE_COLUMNS]


def _stage(plan: _Plan, rows: DataFrame, shard: Shard, table: str) -> None:
    """Write the shard's rows into its stage table through the JDBC driver (``stage_with="jdbc"``)."""
    target = shard_jdbc_target(shard.dsn)
    props = {
        **target.properties,
        "batchsize": str(plan.batch),
        "reWriteBatchedInserts": "true",
        "ApplicationName": "qm-spark-enqueue",
    }
    rows = rows.select(*_stage_columns(rows))
    # fewer tasks without a shuffle when the source has more partitions; more with one otherwise
    parts = rows.rdd.getNumPartitions()
    rows = rows.coalesce(plan.tasks) if parts >= plan.tasks else rows.repartition(plan.tasks)
    rows.write.jdbc(target.url, f"qm.{table}", mode="append", properties=props)


def _write_stage_files(plan: _Plan, rows: DataFrame) -> None:
    """One Spark pass over the rows of every shard to stage (``stage_with="copy"``): CSV files in
    PostgreSQL's CSV dialect under ``<run dir>/stage/shard=<i>`` (i: the shard's place in the
    topology), written by Spark's file committer, so that a retried or speculative task leaves its
    rows there once."""
    place = F.lit(None).cast("int")
    for i, s in enumerate(plan.topology.shards):
        place = F.when(F.col("shard") == s.name, F.lit(i)).otherwise(place)
    out = rows.select(*_stage_columns(rows), place.alias("shard"))
    # what the tasks wrote, per shard, counted as the rows stream into the writer (an observation
    # counts a task's rows once, when it succeeds): the driver checks its COPY against it
    written = Observation("qm_stage_files")
    counts = [F.count_if(F.col("shard") == i).alias(str(i)) for i in range(len(plan.topology.shards))]
    out = out.observe(written, *counts)
    if _exists(plan.spark, plan.stage_path):  # an earlier attempt's, whatever partitionOverwriteMode says
        _delete(plan.spark, plan.stage_path)
    out.write.mode("overwrite").partitionBy("shard").options(**_STAGE_CSV).csv(plan.stage_path)
    # only after a successful write: Observation.get waits for metrics a failed job never sends
    got = written.get
    plan.written = {s.name: int(got[str(i)]) for i, s in enumerate(plan.topology.shards)}


def _copy_stage(plan: _Plan, shard: Shard, table: str) -> None:
    """COPY the shard's stage files (:func:`_write_stage_files`) into its stage table in one
    transaction, through the JDBC driver's CopyManager in Spark's driver JVM: the files are read
    where Spark wrote them (any file system Spark reads) and no row passes through Python."""
    place = [s.name for s in plan.topology.shards].index(shard.name)
    fs, path = _hadoop_path(plan.spark, f"{plan.stage_path}/shard={place}")
    files = [st.getPath() for st in (fs.listStatus(path) if fs.exists(path) else [])]
    copy = query("copy_stage", _SQL).replace("{stage}", sql.Identifier("qm", table).as_string(None))
    try:
        conn = jdbc_connection(plan.spark, shard_jdbc_target(shard.dsn))
        try:
            conn.setAutoCommit(False)
            api = conn.getCopyAPI()
            copied = 0
            for file in sorted(files, key=lambda f: str(f.getName())):
                if not str(file.getName()).startswith("part-"):
                    continue
                stream = fs.open(file)
                try:
                    copied += int(api.copyIn(copy, stream))
                finally:
                    stream.close()
            expected = plan.written.get(shard.name)
            if expected is not None and copied != expected:
                conn.rollback()
                raise ConfigurationError(
                    f"shard {shard.name}: the executors wrote {expected} rows to stage under {plan.stage_path}, but "
                    f"the driver found {copied} there: the work directory must be one that the driver and every "
                    "executor share (an HDFS or S3 path, or a mount shared by every machine; --work-dir). Nothing "
                    "was published; run again with a shared work directory"
                )
            conn.commit()
        finally:
            conn.close()
    except Py4JJavaError:
        # the table is gone when another run of the id replaced it: say so rather than the JVM's error
        with _connect(shard, autocommit=False) as check:
            _fence(plan, shard, _ledger(plan, check), ("staging",))
        raise


def _ledger(plan: _Plan, conn: psycopg.Connection[Any]) -> tuple[Any, ...]:
    """The run's ledger row on the connection's shard, locked until its transaction ends."""
    row = conn.execute(query("ledger", _SQL), {"run": plan.run_id, "queue": plan.queue}).fetchone()
    assert row is not None  # qm.stage_run wrote it
    return tuple(row)


def _fence(plan: _Plan, shard: Shard, ledger: tuple[Any, ...], states: tuple[str, ...]) -> None:
    """A run counts and publishes only the stage table it was given (``plan.tables``): a ledger that
    names another, or another state, means that another run of the id got in (the run lock keeps
    that from happening); RunConflictError rather than counting or publishing that run's rows."""
    state, table = ledger[2], ledger[3]
    mine = plan.tables.get(shard.name)
    if state not in states or table is None or table != mine:
        raise RunConflictError(
            f"run {plan.run_id!r} of queue {plan.queue!r} on shard {shard.name!r}: the ledger says {state} with "
            f"stage table {table!r}, not this run's {mine!r}: another run of the id got in; this call published "
            "nothing on that shard: let the other run end, then run the id again"
        )


def _count(plan: _Plan, shard: Shard, part: ShardResult) -> None:
    """The shard's counts of the run: from its ledger once published, else from the run's own stage
    table (``qm.staged_run`` marks the run staged)."""
    with _connect(shard, autocommit=False) as conn:
        ledger = _ledger(plan, conn)
        if part.state == "published":
            part.rows, part.rejected, part.duplicates = (int(ledger[i] or 0) for i in (5, 6, 7))
            part.state = "already published"
            return
        _fence(plan, shard, ledger, ("staging", "staged"))
        counts = conn.execute(query("staged_run", _SQL), {"run": plan.run_id, "queue": plan.queue}).fetchall()
    part.rows = part.rejected = part.duplicates = 0
    for reason, distinct, written in counts:
        if reason is None:
            part.rows = int(distinct)
        else:
            part.rejected += int(distinct)
            plan.reasons[shard.name][str(reason)] = int(distinct)
        part.duplicates += int(written) - int(distinct)
    part.state = "staged"


def _validate(plan: _Plan, result: LoadResult) -> None:
    """Count the shards published before (from their ledgers; the others were counted when staged or
    resumed), add up every shard's counts, and write the rejects."""
    for shard, part in zip(plan.topology.shards, result.shards, strict=True):
        if part.state == "published":
            _count(plan, shard, part)
    result.rows = sum(p.rows for p in result.shards)
    result.rejected = sum(p.rejected for p in result.shards)
    for by_reason in plan.reasons.values():
        for reason, n in by_reason.items():
            result.reasons[reason] = result.reasons.get(reason, 0) + n
    plan.say("validated", "*", result.rows)
    if result.rejected:
        plan.say("rejected", "*", result.rejected)
    pairs = zip(plan.topology.shards, result.shards, strict=True)
    with_rejects = [shard for shard, part in pairs if part.rejected and part.state == "staged"]
    if with_rejects:
        _write_rejects(plan, with_rejects)
    if result.rejected:
        result.rejects_path = plan.rejects_path


def _write_rejects(plan: _Plan, shards: Sequence[Shard]) -> None:
    """Read the rejected rows back from the stage tables and write them, with their reason, as Parquet."""
    parts = []
    for shard in shards:
        stage = sql.Identifier("qm", plan.tables[shard.name]).as_string(None)
        target = shard_jdbc_target(shard.dsn)
        select = query("rejected_rows", _SQL).replace("{stage}", stage)
        parts.append(
            plan.spark.read.jdbc(target.url, f"({select}) rejected", properties=target.properties).withColumn(
                "shard", F.lit(shard.name)
            )
        )
    rejected = parts[0]
    for other in parts[1:]:
        rejected = rejected.unionByName(other)
    rejected.coalesce(1).write.mode("overwrite").parquet(plan.rejects_path)


def _abandon(plan: _Plan) -> None:
    """Drop the run's staging on every shard, and its materialised rows, so that a run of the same id
    after the source is fixed starts again."""
    for shard in plan.topology.shards:
        with _connect(shard) as conn:
            conn.execute(query("abandon_run", _SQL), {"run": plan.run_id, "queue": plan.queue})
    if _exists(plan.spark, plan.rows_path):
        _delete(plan.spark, plan.rows_path)


def _publish_one(plan: _Plan, shard: Shard, conn: psycopg.Connection[Any], *, two_phase: bool) -> int:
    """``qm.publish_run`` of the run's own stage table (:func:`_fence`) in the connection's
    transaction; a row the database refuses (the queue's verify trigger) becomes the error tree's
    InvalidEventError or MisroutedTenantError."""
    _fence(plan, shard, _ledger(plan, conn), ("staged",))
    try:
        row = conn.execute(
            query("publish_run", _SQL), {"run": plan.run_id, "queue": plan.queue, "two_phase": two_phase}
        ).fetchone()
    except psycopg.Error as exc:
        raise translate(exc, queue=plan.queue) from exc
    assert row is not None and row[0] is not None  # staged, and its ledger row locked since the fence
    return int(row[0])


def _on_every_shard(parts: Sequence[ShardResult], work: Callable[[ShardResult], None]) -> list[BaseException]:
    """``work(part)`` for every part at once, one thread each (each shard's publish is one PostgreSQL
    backend's work: in parallel they use the machine's cores); returns what they raised."""
    if len(parts) <= 1:
        try:
            for part in parts:
                work(part)
        except BaseException as exc:
            return [exc]
        return []
    with ThreadPoolExecutor(max_workers=len(parts), thread_name_prefix="qm-publish") as pool:
        futures = [pool.submit(work, part) for part in parts]
    return [err for f in futures if (err := f.exception()) is not None]


def _publish(plan: _Plan, result: LoadResult) -> None:
    """One transaction per shard, all shards at once: each shard gets all of the run's good rows or none."""
    by_name = {s.name: s for s in plan.topology.shards}

    def publish(part: ShardResult) -> None:
        shard = by_name[part.shard]
        with _connect(shard, autocommit=False) as conn:
            part.published = _publish_one(plan, shard, conn, two_phase=False)
            conn.commit()
        part.state = "published"
        plan.say("published", part.shard, part.published)

    for part in result.shards:
        if part.state == "already published":
            plan.say("already published", part.shard, part.rows)
    failed = _on_every_shard([p for p in result.shards if p.state != "already published"], publish)
    if failed:
        raise failed[0]


def _gid(queue: str, run_id: str, shard: str) -> str:
    return f"{GID_PREFIX}{queue}:{run_id}:{shard}"


def _publish_atomic(plan: _Plan, result: LoadResult) -> None:
    """Prepare every shard's publish (all at once), record the decision on the coordinator, then
    commit every part."""
    by_name = {s.name: s for s in plan.topology.shards}
    todo = [p for p in result.shards if p.state != "already published"]
    for part in result.shards:
        if part.state == "already published":
            plan.say("already published", part.shard, part.rows)
    if not todo:
        return  # every shard has the run: nothing to prepare or decide
    prepared: list[str] = []

    def prepare(part: ShardResult) -> None:
        gid = _gid(plan.queue, plan.run_id, part.shard)
        shard = by_name[part.shard]
        with _connect(shard, autocommit=False) as conn:
            part.published = _publish_one(plan, shard, conn, two_phase=True)
            conn.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
        prepared.append(part.shard)
        part.state = "prepared"
        plan.say("prepared", part.shard, part.published)
        plan.hook("prepared", part.shard)

    def roll_back() -> None:
        for name in prepared:
            _finish(by_name[name], _gid(plan.queue, plan.run_id, name), commit=False)

    failed = _on_every_shard(todo, prepare)
    killed = [exc for exc in failed if not isinstance(exc, Exception)]
    if killed:
        raise killed[0]  # the process is going away (a test's crash): recovery finishes the run
    if failed:
        roll_back()
        raise failed[0]
    try:
        outcome = _decide(plan.topology, plan.queue, plan.run_id, "commit", sorted(prepared))
    except Exception:
        roll_back()
        raise
    if outcome != "commit":
        roll_back()
        raise RunAbortedError(
            f"run {plan.run_id!r}: a recovery aborted it before its decision was recorded; nothing was published "
            "(run it again)"
        )
    plan.say("decided", plan.topology.shards[0].name, len(prepared))
    plan.hook("decided", plan.topology.shards[0].name)
    for part in todo:
        if not _finish(by_name[part.shard], _gid(plan.queue, plan.run_id, part.shard), commit=True):
            raise RunAbortedError(
                f"run {plan.run_id!r}: the prepared part on shard {part.shard!r} is gone (another job of the same "
                "run id recovered it?): check the shards' ledgers (qm.spark_runs) and run it again"
            )
        part.state = "published"
        plan.say("published", part.shard, part.published or 0)
        plan.hook("committed", part.shard)


def _decide(topology: Topology, queue: str, run_id: str, outcome: str, shards: Sequence[str]) -> str:
    """Record the outcome of a two-phase run on the coordinating shard unless one is there; return
    the one that stands (the first recorded)."""
    with _connect(topology.shards[0]) as conn:
        row = conn.execute(
            query("decide", _SQL), {"run": run_id, "queue": queue, "shards": list(shards), "outcome": outcome}
        ).fetchone()
    assert row is not None
    return str(row[0])


def _finish(shard: Shard, gid: str, *, commit: bool) -> bool:
    """COMMIT (then wake the manager) or ROLLBACK a prepared part; False if it was no longer there."""
    with _connect(shard) as conn:
        try:
            conn.execute(sql.SQL("COMMIT PREPARED {}" if commit else "ROLLBACK PREPARED {}").format(sql.Literal(gid)))
        except psycopg.errors.UndefinedObject:
            return False
        if commit:
            queue, run, _ = gid[len(GID_PREFIX) :].split(":", 2)
            conn.execute(query("wake_after_publish", _SQL), {"run": run, "queue": queue})
    return True


def recover(
    topology: Topology, *, run_id: str | None = None, min_age: float = RECOVER_MIN_AGE_SECONDS
) -> dict[str, str]:
    """Finish the two-phase runs left prepared (all of them, or ``run_id``'s): a run whose decision is
    commit is committed on every shard; for any other an abort is recorded on the coordinating shard
    (the topology's first) and its parts are rolled back. Returns {prepared transaction: "committed" |
    "rolled back"}.

    Without ``run_id``, parts prepared less than ``min_age`` seconds ago are left alone (their job
    may still be about to decide). An abort recorded for a job that is still running makes that job
    roll back and fail with RunAbortedError: never a partial run.
    """
    done: dict[str, str] = {}
    for shard in topology.shards:
        with _connect(shard) as conn:
            found = conn.execute(query("prepared_runs", _SQL), {"prefix": GID_PREFIX}).fetchall()
        for gid, age in found:
            queue, run, _ = str(gid)[len(GID_PREFIX) :].split(":", 2)
            if (run_id is not None and run != run_id) or (run_id is None and float(age) < min_age):
                continue
            outcome = _decide(topology, queue, run, "abort", [])
            if _finish(shard, str(gid), commit=outcome == "commit"):
                done[str(gid)] = "committed" if outcome == "commit" else "rolled back"
    if done:
        logger.info("recovered prepared runs", extra={"action": "spark.recover", "parts": len(done)})
    return done


# ----------------------------------------------------------------------------------- entry points


def run_cli(args: Any, topology: Topology, emit: Callable[[str], None]) -> int:
    """``qm spark enqueue`` (options: :mod:`spark_jobs.commands`): one line per stage and shard."""
    from spark_jobs.session import job_session, require_jdbc_driver

    check_run_id(args.run_id)
    for shard in topology.shards:  # a clear error before Spark starts
        queue_shape(shard, check_queue_name(args.queue))
    columns = Columns(
        tenant=args.tenant_col,
        payload=args.payload_col,
        fire_at=args.fire_at_col,
        payload_cols=tuple(c.strip() for c in (args.payload_cols or "").split(",") if c.strip()),
        dedup_key=args.dedup_col,
        traceparent=args.traceparent_col,
        tracestate=args.tracestate_col,
        baggage=args.baggage_col,
        priority=args.priority_col,
        concurrency_key=args.concurrency_key_col,
        rate_key=args.rate_key_col,
    )
    with job_session("qm-spark-enqueue", args.jdbc_jar) as spark:
        require_jdbc_driver(spark)
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
            materialize=args.materialize,
            atomic=args.atomic,
            tasks_per_shard=args.tasks_per_shard,
            batch_size=args.batch_size,
            staging_ttl=args.staging_ttl,
            stage_with=args.stage_with,
            stop_after=args.stop_after,
            wait_for_other_run=args.wait_for_other_run,
            progress=lambda stage, shard, n: emit(_progress_line(args.run_id, stage, shard, n)),
        )
    emit(
        f"run {result.run_id}: done: {result.rows} good rows, {result.rejected} rejected"
        f"{f' (see {result.rejects_path})' if result.rejected else ''}, "
        f"{result.published} events published by this call"
    )
    return 0


def _progress_line(run_id: str, stage: str, shard: str, n: int) -> str:
    if stage == "waiting":
        return (
            f"run {run_id}: waiting for another live run of this run id to end (its lock on shard {shard}), "
            f"for up to {n} s"
        )
    return f"run {run_id}: {stage} {shard} rows={n}"


if __name__ == "__main__":  # pragma: no cover
    from spark_jobs.commands import script_main

    sys.exit(script_main("enqueue", run_cli))
