"""Database health of one shard, and the thresholds past which it is worth a warning.

The readings come from the database (``queue_manager/db/sql/health.sql`` and the ``xmin_horizon``
query); this module only holds them and judges them, so ``qm status`` and the manager's metrics
warn on the same rules. The thresholds are documented in docs/operations.md, "Database health",
as pg-boss's dashboard documents its warnings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

#: a session or prepared transaction holding back vacuum for longer than this (seconds): the queue
#: tables' dead rows then pile up until it ends
XMIN_WARN_SECONDS = 60.0
#: a replication slot holding back vacuum by more than this many transactions (a slot has no age
#: in seconds); an inactive slot that holds any is a warning at once
SLOT_WARN_XIDS = 1_000_000
#: dead tuples past autovacuum's trigger for the table, and no vacuum finished for this long
#: (seconds): autovacuum is off, starved of workers or cannot finish
VACUUM_STALE_SECONDS = 600.0
#: dead tuples more than this share of a table's tuples (live + dead), and at least
#: DEAD_TUPLES_WARN_MIN of them: vacuum is not keeping up, or cannot remove them
DEAD_TUPLES_WARN_RATIO = 0.5
DEAD_TUPLES_WARN_MIN = 100_000
#: an index whose estimated bloat is more than this share of it, and at least
#: INDEX_BLOAT_WARN_MIN_BYTES: worth a REINDEX CONCURRENTLY
INDEX_BLOAT_WARN_RATIO = 0.5
INDEX_BLOAT_WARN_MIN_BYTES = 64 * 1024 * 1024
#: the leader vacuums a queue table itself (``qm manager --vacuum-after``) only up to this size (heap and
#: indexes): a VACUUM it runs does not give way to a conflicting lock as autovacuum does (a DDL on the
#: table waits for it) and is not throttled, so a larger table is left to autovacuum
VACUUM_MAX_BYTES = 1 << 30
#: the server's NOTIFY queue more than this full (0 to 1): a listener is not consuming; when it is
#: full, every transaction that notifies fails at commit (the producers' wake-ups among them)
NOTIFY_QUEUE_WARN = 0.10

Reading = TypeVar("Reading", bound="DataclassInstance")


def from_row(cls: type[Reading], row: Mapping[str, Any], **given: Any) -> Reading:
    """A reading (a dataclass) from a row of its query: each field the row's column of its name,
    but the fields ``given``."""
    return cls(**{f.name: row[f.name] for f in fields(cls) if f.name not in given}, **given)


@dataclass(frozen=True)
class Thresholds:
    """Where each reading becomes a warning (defaults: the constants above)."""

    xmin_seconds: float = XMIN_WARN_SECONDS
    slot_xids: int = SLOT_WARN_XIDS
    vacuum_stale_seconds: float = VACUUM_STALE_SECONDS
    dead_ratio: float = DEAD_TUPLES_WARN_RATIO
    dead_min: int = DEAD_TUPLES_WARN_MIN
    index_bloat_ratio: float = INDEX_BLOAT_WARN_RATIO
    index_bloat_min_bytes: int = INDEX_BLOAT_WARN_MIN_BYTES
    notify_queue: float = NOTIFY_QUEUE_WARN


@dataclass(frozen=True)
class Horizon:
    """The oldest holder of the database's xmin horizon: what vacuum must keep rows for."""

    #: ``session``, ``prepared`` (a prepared transaction) or ``slot`` (a replication slot)
    kind: str
    #: the session's application name (or backend type), the prepared transaction's gid, the slot's name
    holder: str
    pid: int | None
    application_name: str | None
    #: the session's state (``idle in transaction``, ``active``, ...)
    state: str | None
    #: since the transaction started (seconds); None for a slot
    age_seconds: float | None
    #: transactions begun since (how far back it holds vacuum)
    xid_age: int | None


@dataclass(frozen=True)
class Slot:
    """A replication slot that holds back vacuum."""

    name: str
    #: ``physical`` or ``logical``
    kind: str
    active: bool
    pid: int | None
    database: str | None
    #: transactions behind, of its xmin (physical, hot_standby_feedback) and catalog_xmin (logical)
    xmin_age: int | None
    catalog_xmin_age: int | None

    @property
    def xid_age(self) -> int:
        return max(self.xmin_age or 0, self.catalog_xmin_age or 0)


@dataclass(frozen=True)
class IndexHealth:
    name: str
    size_bytes: int
    #: statistics-based estimate of the wasted bytes (health.sql, ``health_indexes``); None
    #: before the table's first analyze and the index's first vacuum
    bloat_bytes: int | None
    bloat_ratio: float | None


@dataclass(frozen=True)
class TableHealth:
    """One queue table: tuples, vacuum, sizes."""

    queue: str
    live_tuples: int
    dead_tuples: int
    #: dead tuples at which autovacuum vacuums the table (its storage parameters or the server's)
    autovacuum_trigger: int | None
    autovacuum_enabled: bool
    #: seconds since the last vacuum of any kind, the last autovacuum, the last autoanalyze (None: never)
    vacuum_age_seconds: float | None
    autovacuum_age_seconds: float | None
    autoanalyze_age_seconds: float | None
    autovacuum_count: int
    #: since the queue was created (a table never vacuumed has waited this long)
    queue_age_seconds: float
    #: heap (with TOAST and the free-space and visibility maps) and all indexes
    table_bytes: int
    index_bytes: int
    #: the table's storage parameters, ``name=value,...``
    reloptions: str
    indexes: tuple[IndexHealth, ...] = ()

    @property
    def dead_ratio(self) -> float:
        total = self.live_tuples + self.dead_tuples
        return self.dead_tuples / total if total else 0.0

    @property
    def index_bloat_bytes(self) -> int | None:
        known = [i.bloat_bytes for i in self.indexes if i.bloat_bytes is not None]
        return sum(known) if known else None

    @classmethod
    def from_rows(cls, row: Mapping[str, Any], index_rows: list[Mapping[str, Any]]) -> TableHealth:
        indexes = tuple(
            IndexHealth(r["index_name"], r["size_bytes"], r["bloat_bytes"], r["bloat_ratio"]) for r in index_rows
        )
        return from_row(cls, row, indexes=indexes)


@dataclass(frozen=True)
class ShardHealth:
    """Everything one reading found on one shard's database."""

    horizon: Horizon | None
    #: fraction of the server's NOTIFY queue in use, 0 to 1
    notify_queue_usage: float
    slots: tuple[Slot, ...] = ()
    tables: tuple[TableHealth, ...] = field(default_factory=tuple)


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps it at least 1 (``1.5 MiB``)."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("kiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def warnings(h: ShardHealth, t: Thresholds | None = None) -> list[str]:
    """One line per reading past its threshold, each saying what it means and what to do."""
    t = t or Thresholds()
    out: list[str] = []
    hz = h.horizon
    if hz is not None and hz.kind != "slot" and hz.age_seconds is not None and hz.age_seconds > t.xmin_seconds:
        out.append(
            f"{hz.kind} {hz.holder!r} (pid {hz.pid}, {hz.state}) has held back vacuum for {hz.age_seconds:.0f} s: "
            "dead rows pile up until it ends"
        )
    for s in h.slots:
        if not s.active or s.xid_age > t.slot_xids:
            out.append(
                f"replication slot {s.name!r} ({'active' if s.active else 'inactive'}) holds back vacuum by "
                f"{s.xid_age} transactions: drop it if nothing consumes it"
            )
    if h.notify_queue_usage > t.notify_queue:
        out.append(
            f"the NOTIFY queue is {h.notify_queue_usage:.0%} full: a listening session does not consume its "
            "notifications (one idle in a transaction?); when it is full, producers' commits fail"
        )
    for tb in h.tables:
        if not tb.autovacuum_enabled:
            out.append(f"{tb.queue}: autovacuum is off for this table: nothing removes its dead rows")
        elif (
            tb.autovacuum_trigger is not None
            and tb.dead_tuples > tb.autovacuum_trigger
            and (tb.vacuum_age_seconds if tb.vacuum_age_seconds is not None else tb.queue_age_seconds)
            > t.vacuum_stale_seconds
        ):
            age = "never" if tb.vacuum_age_seconds is None else f"{tb.vacuum_age_seconds:.0f} s ago"
            out.append(
                f"{tb.queue}: {tb.dead_tuples} dead tuples, past autovacuum's trigger ({tb.autovacuum_trigger}), "
                f"and last vacuumed {age}: autovacuum is not getting to it (workers busy elsewhere?)"
            )
        if tb.dead_tuples >= t.dead_min and tb.dead_ratio > t.dead_ratio:
            out.append(
                f"{tb.queue}: {tb.dead_tuples} dead tuples, {tb.dead_ratio:.0%} of the table: vacuum is not keeping "
                "up or cannot remove them (see what holds back vacuum)"
            )
        for ix in tb.indexes:
            if (
                ix.bloat_bytes is not None
                and ix.bloat_ratio is not None
                and ix.bloat_ratio > t.index_bloat_ratio
                and ix.bloat_bytes >= t.index_bloat_min_bytes
            ):
                wasted, size = format_bytes(ix.bloat_bytes), format_bytes(ix.size_bytes)
                out.append(
                    f"{tb.queue}: index {ix.name} is about {ix.bloat_ratio:.0%} bloat ({wasted} of {size}, "
                    f"estimated): REINDEX INDEX CONCURRENTLY {ix.name}"
                )
    return out


def tables_to_vacuum(h: ShardHealth, after: float, max_bytes: int = VACUUM_MAX_BYTES) -> list[str]:
    """The queue tables worth a VACUUM now, when autovacuum is late: past autovacuum's trigger and
    not vacuumed for ``after`` seconds (0: never any).

    Autovacuum visits a database once per ``autovacuum_naptime`` (60 s by default), and a queue
    table under churn passes its trigger within a second or two: at 500 events/s the dead tuples
    reached 90 000 between two visits, and the table grew by what they took (docs/benchmarks-history.md,
    "Churn"). Left out: tables with autovacuum turned off (an operator's choice), tables over
    ``max_bytes``, and tables whose last vacuum ran under the horizon still held (a session or
    prepared transaction older than that vacuum: another one would remove nothing more).
    """
    if after <= 0:
        return []
    hz = h.horizon
    held = None if hz is None or hz.kind == "slot" else hz.age_seconds
    out = []
    for t in h.tables:
        waited = t.vacuum_age_seconds if t.vacuum_age_seconds is not None else t.queue_age_seconds
        if (
            t.autovacuum_enabled
            and t.autovacuum_trigger is not None
            and t.dead_tuples > t.autovacuum_trigger
            and waited >= after
            and t.table_bytes + t.index_bytes <= max_bytes
            and not (held is not None and t.vacuum_age_seconds is not None and held >= t.vacuum_age_seconds)
        ):
            out.append(t.queue)
    return out


def as_data(h: ShardHealth) -> dict[str, Any]:
    """Plain data (JSON-ready) of a reading, the ``health`` entry of ``qm status --json``."""
    return {
        "notify_queue_usage": h.notify_queue_usage,
        "slots": [{**s.__dict__, "xid_age": s.xid_age} for s in h.slots],
        "tables": [
            {
                **{k: v for k, v in tb.__dict__.items() if k != "indexes"},
                "dead_ratio": round(tb.dead_ratio, 4),
                "index_bloat_bytes": tb.index_bloat_bytes,
                "indexes": [i.__dict__ for i in tb.indexes],
            }
            for tb in h.tables
        ],
    }
