"""The pure half of the archive job: inputs, the run's plan, the output layout and the checks.

No Spark and no database here: :mod:`spark_jobs.archive` does the I/O and asks these functions
what to do. The layout under ``output/`` (see docs/spark-archive.md)::

    _archive.lock                         held (flock) while a run works in this output
    _staging/run=<run>/<attempt>/...      a write in progress; discarded by the next attempt
    run=<run>/_plan.json                  cut-off and per-(shard, queue) id bound, fixed at the start
    run=<run>/shard=<shard>/              committed by one rename, manifest inside
        _manifest.json                    rows per queue, written before the rename
        _deleted.json                     written once the shard's rows are deleted
        queue=<queue>/day=<yyyy-mm-dd>/part-*.parquet

Names starting with ``_`` are skipped by Spark's and most Parquet readers' directory listing,
so ``output/`` reads as one dataset partitioned by run, shard, queue and day.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from queue_manager.domain.names import check_queue_name
from queue_manager.errors import ArchiveError, ConfigurationError

#: the states an archive run takes (settled events: acked, cancelled, and failed = dead-lettered)
ARCHIVE_STATES = ("acked", "cancelled", "failed")
#: ids deleted per transaction
DEFAULT_DELETE_SLICE = 10_000
#: candidate rows per JDBC read partition
DEFAULT_ROWS_PER_PARTITION = 50_000
#: most JDBC read partitions (connections) per (shard, queue)
MAX_READ_PARTITIONS = 64
#: how many kept ids a shard's deletion record lists (the count is always complete)
KEPT_IDS_LISTED = 1000

MANIFEST_NAME = "_manifest.json"
DELETED_NAME = "_deleted.json"
PLAN_NAME = "_plan.json"
LOCK_NAME = "_archive.lock"
STAGING_NAME = "_staging"

# a leading letter: Spark's partition discovery would read a numeric or date-like run id as a number or a date
_RUN_ID_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$")
_AGE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_AGE_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


# --- inputs ---------------------------------------------------------------------------------------


def check_run_id(run_id: str) -> str:
    """Return ``run_id`` if it can name a run directory, else raise ConfigurationError."""
    if not isinstance(run_id, str) or not _RUN_ID_RE.match(run_id):
        raise ConfigurationError(
            f"invalid run id {run_id!r}: use 1-64 letters, digits, '_', '.' or '-', starting with a letter"
        )
    return run_id


def new_run_id(now: datetime, token: str) -> str:
    """A fresh run id from the start time (UTC) and a short random ``token``: ``archive-<time>-<token>``."""
    return check_run_id(f"archive-{now.astimezone(UTC):%Y%m%dT%H%M%SZ}-{token}")


def check_queues(queues: Iterable[str] | None) -> tuple[str, ...] | None:
    """Validated, sorted, distinct queue names; None (all queues) stays None; an empty list is an error."""
    if queues is None:
        return None
    if isinstance(queues, str):
        queues = [queues]
    names = sorted({check_queue_name(q) for q in queues})
    if not names:
        raise ConfigurationError("no queue to archive: name at least one queue, or none for all queues")
    return tuple(names)


def parse_age(text: str) -> timedelta:
    """A positive duration: ``90`` (seconds), ``90s``, ``15m``, ``12h``, ``30d`` or ``2w``."""
    m = _AGE_RE.match(text)
    if not m:
        raise ConfigurationError(
            f"invalid age {text!r}: expected a number with an optional unit s, m, h, d or w (e.g. 30d, 12h, 3600)"
        )
    age = timedelta(seconds=float(m.group(1)) * _AGE_UNITS[m.group(2)])
    if age <= timedelta(0):
        raise ConfigurationError(f"invalid age {text!r}: it must be more than 0")
    return age


def parse_time(text: str) -> datetime:
    """An ISO-8601 time with a UTC offset (``2026-01-01T00:00:00+00:00`` or ``...Z``)."""
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise ConfigurationError(f"invalid time {text!r}: expected ISO-8601, e.g. 2026-01-01T00:00:00+00:00") from None
    if when.tzinfo is None:
        raise ConfigurationError(f"invalid time {text!r}: give a UTC offset, e.g. 2026-01-01T00:00:00+00:00")
    return when


def check_older_than(older_than: timedelta | datetime) -> timedelta | datetime:
    """Return ``older_than`` if it is a positive age or an aware time, else raise ConfigurationError."""
    if isinstance(older_than, timedelta):
        if older_than <= timedelta(0):
            raise ConfigurationError(f"older_than must be a positive age, got {older_than}")
        return older_than
    if isinstance(older_than, datetime):
        if older_than.tzinfo is None:
            raise ConfigurationError(f"cut-off {older_than.isoformat()} has no time zone: pass an aware datetime")
        return older_than
    raise ConfigurationError(
        f"older_than must be a timedelta (an age) or an aware datetime (a cut-off), got {type(older_than).__name__}"
    )


def resolve_cutoff(older_than: timedelta | datetime, now: datetime) -> datetime:
    """The absolute cut-off: ``now - older_than`` for an age, the time itself for a time.

    ``now`` is the database clock. Raises ConfigurationError as :func:`check_older_than` does, and
    for a time after ``now``: only events settled before the start of the run can be archived
    (else rows settling during the run would join it).
    """
    check_older_than(older_than)
    if isinstance(older_than, timedelta):
        return now - older_than
    if older_than > now:
        raise ConfigurationError(
            f"cut-off {older_than.isoformat()} is in the future (database clock {now.isoformat()}): "
            "only events settled before now can be archived"
        )
    return older_than


def check_sizes(*, delete_slice: int, rows_per_partition: int) -> None:
    """Raise ConfigurationError unless both sizes are at least 1."""
    for name, value in (("delete_slice", delete_slice), ("rows_per_partition", rows_per_partition)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigurationError(f"{name} must be a whole number of at least 1, got {value!r}")


# --- sizing ---------------------------------------------------------------------------------------


def read_partitions(rows: int, rows_per_partition: int, max_partitions: int = MAX_READ_PARTITIONS) -> int:
    """JDBC read partitions for ``rows`` candidates: one per ``rows_per_partition``, 1 to ``max_partitions``."""
    if rows_per_partition < 1:
        raise ConfigurationError(f"rows per read partition must be at least 1, got {rows_per_partition}")
    return max(1, min(max_partitions, math.ceil(rows / rows_per_partition)))


def id_slices(ids: Iterable[int], size: int) -> Iterator[list[int]]:
    """``ids`` in consecutive lists of at most ``size``."""
    if size < 1:
        raise ConfigurationError(f"delete slice must be at least 1 id, got {size}")
    chunk: list[int] = []
    for i in ids:
        chunk.append(i)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


# --- layout ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArchiveLayout:
    """Where one run's files live under the output directory."""

    #: the archive's root directory (a local path)
    output: Path
    #: the run's id (checked with :func:`check_run_id`)
    run_id: str

    @property
    def run_dir(self) -> Path:
        return self.output / f"run={self.run_id}"

    @property
    def plan_file(self) -> Path:
        return self.run_dir / PLAN_NAME

    @property
    def staging_dir(self) -> Path:
        """This run's write attempts; everything under it is disposable."""
        return self.output / STAGING_NAME / f"run={self.run_id}"

    @property
    def lock_file(self) -> Path:
        return self.output / LOCK_NAME

    def shard_dir(self, shard: str) -> Path:
        return self.run_dir / f"shard={shard}"

    def manifest_file(self, shard: str) -> Path:
        return self.shard_dir(shard) / MANIFEST_NAME

    def deleted_file(self, shard: str) -> Path:
        return self.shard_dir(shard) / DELETED_NAME

    def queue_dir(self, shard: str, queue: str) -> Path:
        return self.shard_dir(shard) / f"queue={queue}"


# --- plan, manifest, deletion record ---------------------------------------------------------------


@dataclass(frozen=True)
class QueuePlan:
    """One queue of one shard, as planned at the start of a run."""

    #: the table's highest id at the start: rows above it are never this run's
    max_id: int
    #: candidates counted at the start (for information: the rows read are what is archived)
    rows: int
    #: lowest and highest candidate id (the JDBC read's partition bounds); None when there is none
    low_id: int | None
    high_id: int | None


@dataclass(frozen=True)
class RunPlan:
    """What a run archives, fixed at its first start and reused by every re-run of the same id."""

    run_id: str
    #: events settled strictly before this time are archived
    cutoff: datetime
    #: the database time the plan was made
    planned_at: datetime
    queues: tuple[str, ...]
    #: shard name -> queue -> plan
    shards: dict[str, dict[str, QueuePlan]] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(
            {
                "run_id": self.run_id,
                "cutoff": self.cutoff.isoformat(),
                "planned_at": self.planned_at.isoformat(),
                "queues": list(self.queues),
                "shards": {s: {q: asdict(p) for q, p in qs.items()} for s, qs in self.shards.items()},
            },
            indent=2,
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str, *, source: str) -> RunPlan:
        try:
            raw = json.loads(text)
            return cls(
                run_id=str(raw["run_id"]),
                cutoff=datetime.fromisoformat(raw["cutoff"]),
                planned_at=datetime.fromisoformat(raw["planned_at"]),
                queues=tuple(str(q) for q in raw["queues"]),
                shards={s: {q: QueuePlan(**p) for q, p in qs.items()} for s, qs in raw["shards"].items()},
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ArchiveError(
                f"{source} is not a valid archive plan ({exc!r}): restore it or use a new run id"
            ) from None

    def check_resume(
        self, *, queues: tuple[str, ...] | None, shards: Sequence[str], older_than: timedelta | datetime
    ) -> None:
        """Refuse to resume this run with other queues, other shards or another absolute cut-off.

        An age (timedelta) is accepted as is: the plan's absolute cut-off, fixed at the first
        start, stands (the age would now give a later one).
        """
        where = f"run {self.run_id!r} was started"
        if queues is not None and queues != self.queues:
            raise ConfigurationError(
                f"{where} for queues {', '.join(self.queues)}, not {', '.join(queues)}: "
                "re-run it with the same queues (or none), or use a new run id"
            )
        if sorted(shards) != sorted(self.shards):
            raise ConfigurationError(
                f"{where} on shards {', '.join(sorted(self.shards))}, but the topology has {', '.join(sorted(shards))}"
            )
        if isinstance(older_than, datetime) and older_than != self.cutoff:
            raise ConfigurationError(
                f"{where} with cut-off {self.cutoff.isoformat()}, not {older_than.isoformat()}: "
                "re-run it with the same cut-off, or use a new run id"
            )


@dataclass(frozen=True)
class QueueManifest:
    """One queue's rows in a committed shard directory."""

    rows: int
    low_id: int | None
    high_id: int | None
    #: the plan's id bound, repeated so that the shard directory is self-describing
    max_id: int


@dataclass(frozen=True)
class ShardManifest:
    """What one shard's committed directory holds; written inside it before the rename that commits it."""

    run_id: str
    shard: str
    cutoff: datetime
    queues: dict[str, QueueManifest]
    written_at: datetime

    @property
    def rows(self) -> int:
        return sum(q.rows for q in self.queues.values())

    def to_json(self) -> str:
        return json.dumps(
            {
                "run_id": self.run_id,
                "shard": self.shard,
                "cutoff": self.cutoff.isoformat(),
                "rows": self.rows,
                "queues": {q: asdict(m) for q, m in self.queues.items()},
                "written_at": self.written_at.isoformat(),
            },
            indent=2,
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str, *, source: str) -> ShardManifest:
        try:
            raw = json.loads(text)
            return cls(
                run_id=str(raw["run_id"]),
                shard=str(raw["shard"]),
                cutoff=datetime.fromisoformat(raw["cutoff"]),
                queues={q: QueueManifest(**m) for q, m in raw["queues"].items()},
                written_at=datetime.fromisoformat(raw["written_at"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ArchiveError(f"{source} is not a valid shard manifest ({exc!r}); nothing was deleted") from None


@dataclass(frozen=True)
class DeletionRecord:
    """The end of one shard's deletion: written once, so that a re-run of a finished run does nothing."""

    #: rows the last deletion pass removed (an earlier, interrupted pass may have removed others)
    deleted: int
    #: archived rows still in the shard: changed since they were read, so the guard kept them
    kept: int
    #: the first KEPT_IDS_LISTED of them, as (queue, id)
    kept_ids: list[tuple[str, int]]
    finished_at: datetime

    def to_json(self) -> str:
        data: dict[str, Any] = asdict(self)
        data["finished_at"] = self.finished_at.isoformat()
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, *, source: str) -> DeletionRecord:
        try:
            raw = json.loads(text)
            return cls(
                deleted=int(raw["deleted"]),
                kept=int(raw["kept"]),
                kept_ids=[(str(q), int(i)) for q, i in raw["kept_ids"]],
                finished_at=datetime.fromisoformat(raw["finished_at"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ArchiveError(f"{source} is not a valid deletion record ({exc!r})") from None


# --- verification ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class WrittenStats:
    """What the Parquet files of one (shard, queue) hold, read back after the write."""

    rows: int
    distinct_ids: int
    low_id: int | None
    high_id: int | None


def verify_shard(
    shard: str,
    plan: Mapping[str, QueuePlan],
    read: Mapping[str, int],
    written: Mapping[str, WrittenStats],
) -> list[str]:
    """The problems that forbid committing a shard's staged output (none: commit).

    ``read`` is the rows the JDBC read returned per queue (counted as they streamed into the
    writer), ``written`` what the Parquet files hold. Every queue must have as many rows written
    as read, each id once, and no id above the plan's bound.
    """
    problems = []
    for queue in sorted((set(read) | set(written)) - set(plan)):
        problems.append(f"shard {shard}: queue {queue} was read or written but is not in the plan")
    for queue, qp in sorted(plan.items()):
        n_read = read.get(queue, 0)
        w = written.get(queue, WrittenStats(0, 0, None, None))
        if w.rows != n_read:
            problems.append(f"shard {shard}, queue {queue}: {n_read} rows read but {w.rows} written")
        if w.distinct_ids != w.rows:
            problems.append(f"shard {shard}, queue {queue}: {w.rows - w.distinct_ids} duplicate ids written")
        if w.high_id is not None and w.high_id > qp.max_id:
            problems.append(f"shard {shard}, queue {queue}: id {w.high_id} is above the run's bound {qp.max_id}")
    return problems


def manifest_for(
    run_id: str,
    shard: str,
    cutoff: datetime,
    plan: Mapping[str, QueuePlan],
    written: Mapping[str, WrittenStats],
    now: datetime,
) -> ShardManifest:
    """The manifest of a verified shard."""
    queues = {}
    for queue, qp in sorted(plan.items()):
        w = written.get(queue, WrittenStats(0, 0, None, None))
        queues[queue] = QueueManifest(rows=w.rows, low_id=w.low_id, high_id=w.high_id, max_id=qp.max_id)
    return ShardManifest(run_id=run_id, shard=shard, cutoff=cutoff, queues=queues, written_at=now)
