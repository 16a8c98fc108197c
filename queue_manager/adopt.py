"""``qm queue adopt``: move a legacy queue table's events into a queue, in slices, while it is written.

The legacy table is an existing, unsharded queue on any PostgreSQL database (one of the shards or
another server). Producers may keep writing to it and its old consumers may keep taking rows from
it while adopt runs. Each slice is three transactions:

1. **move** (legacy database, one statement): lock up to ``slice_rows`` pending rows with
   ``FOR UPDATE SKIP LOCKED`` (rows an old consumer holds are skipped), take the good ones out of
   the legacy queue (delete them, or set the ``--mark`` columns) and write them, mapped to
   (tenant, payload, fire_at, dedup_key), into the *outbox*, a table beside the legacy table. Taking
   a row and keeping it commit together, so an old consumer never sees a row that adopt holds.
2. **publish** (each target shard, one transaction each): record the outbox keys in the shard's
   ledger ``qm.adopted`` and insert the rows whose key was new with a plain ``INSERT INTO
   <queue>``, the producers' path (routing trigger, every check, the wake-up).
3. **forget** (legacy database): delete the published rows from the outbox.

A run stopped anywhere (a crash, a kill, a lost connection) leaves every row in exactly one of: the
legacy table, the outbox, or the queue with its key in the ledger. The next run first publishes
what the outbox holds; keys already in a shard's ledger are not inserted again. So nothing is lost
and nothing is enqueued twice (docs/design.md, "Adopting a legacy queue table").

SQL lives in ``db/sql/adopt.sql``; the expressions that read the mapped columns are composed here
with ``psycopg.sql`` from catalog column names and named parameters only.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal
from uuid import UUID

import psycopg
from psycopg import sql

from queue_manager.clock import Clock, SystemClock
from queue_manager.db.errors import translate
from queue_manager.db.sqlfiles import query
from queue_manager.domain.adopt import (
    DEFAULT_OUTBOX,
    AdoptMapping,
    ColumnPlan,
    LegacyColumn,
    check_slice_rows,
    plan_columns,
)
from queue_manager.domain.names import check_queue_name
from queue_manager.domain.topology import Topology
from queue_manager.errors import AdoptError, ConfigurationError, EnqueueError, QueueManagerError, UnknownQueueError

logger = logging.getLogger(__name__)

_SQL = "adopt.sql"
#: how long a run retries an adoption lock it finds held, before it refuses (the holder may be a run
#: whose session is ending)
LOCK_GRACE_SECONDS = 2.0
#: a test may pass a hook called with these names at the points between commits
Phase = Literal["moved", "published", "forgotten"]


def _q(name: str) -> sql.SQL:
    return sql.SQL(query(name, _SQL))


@dataclass(frozen=True)
class AdoptOptions:
    """How a run goes: slice size, following the table, what to do with rows the queue refuses."""

    #: rows per slice (one transaction on the legacy database, one per shard the slice touches)
    slice_rows: int = 500
    #: keep adopting rows as producers write them, until stopped (or idle for ``until_idle``)
    follow: bool = False
    #: in follow mode, the pause after a slice that found nothing pending, seconds
    poll_seconds: float = 1.0
    #: in follow mode, stop once nothing was pending for this long (the cut-over condition), seconds
    until_idle: float | None = None
    #: "fail": stop before anything moves when a pending row would be refused (default); "leave":
    #: leave such rows in the legacy table, report them, and adopt the rest
    bad_rows: Literal["fail", "leave"] = "fail"
    #: the adoption's name (ledger rows, lock); default ``<database>.<schema>.<table>:<queue>``
    name: str | None = None
    #: the outbox table's name, in the legacy table's schema
    outbox: str = DEFAULT_OUTBOX

    def __post_init__(self) -> None:
        check_slice_rows(self.slice_rows)
        if self.poll_seconds <= 0:
            raise ConfigurationError("--poll must be above 0 seconds")
        if self.until_idle is not None and (self.until_idle < 0 or not self.follow):
            raise ConfigurationError("--until-idle needs --follow and a value of 0 seconds or more")
        if self.bad_rows not in ("fail", "leave"):
            raise ConfigurationError(f"--bad-rows {self.bad_rows!r}: give fail or leave")
        if not self.outbox or len(self.outbox) > 50:
            raise ConfigurationError("--outbox: give a table name of 1 to 50 characters")


@dataclass(frozen=True)
class Rejected:
    """A legacy row the queue refuses: still in the legacy table, or (refused at publish) in the outbox."""

    legacy_id: str
    reason: str
    where: Literal["legacy table", "outbox"]


@dataclass
class Preflight:
    """The legacy table before anything moves."""

    #: rows matching the filter
    pending: int
    #: all rows of the table (pending or not: in progress, done, ...)
    total: int
    #: pending rows the queue would refuse
    bad: int
    bad_by_reason: dict[str, int]
    #: up to 10 of them, as ``<legacy id>: <reason>``
    examples: list[str]


@dataclass
class AdoptReport:
    """What a run did. Every row it took is counted once in adopted, already or deduplicated, or is
    still in the outbox (outbox_left)."""

    adoption: str
    queue: str
    table: str
    outbox: str
    preflight: Preflight | None = None
    #: rows taken out of the legacy table (deleted or marked) into the outbox
    moved: int = 0
    #: events inserted into the queue
    adopted: int = 0
    #: outbox rows an earlier, interrupted run had published already (found in the ledger)
    already: int = 0
    #: rows whose dedup key the queue held already (--dedup-col), so no event was inserted
    deduplicated: int = 0
    #: slices that found pending rows
    slices: int = 0
    rejected: list[Rejected] = field(default_factory=list)
    #: rows still pending in the legacy table at the end (locked by an old consumer, written meanwhile,
    #: or left there as bad)
    left_pending: int | None = None
    #: rows left in the outbox (refused by the queue when published)
    outbox_left: int = 0
    #: why the run ended: drained (nothing pending), idle (--until-idle), stopped (asked to)
    ended: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def complete(self) -> bool:
        """Every row taken was adopted: none rejected, none left in the outbox."""
        return not self.rejected and not self.outbox_left

    def progress_line(self) -> str:
        return (
            f"adopt {self.adoption}: {self.moved} moved, {self.adopted} adopted, "
            f"{len(self.rejected)} rejected, {self.slices} slices"
        )

    def summary_line(self) -> str:
        return (
            f"adopt {self.adoption}: {self.ended}: {self.adopted} event(s) adopted into {self.queue} "
            f"({self.moved} taken from {self.table}, {self.already} published by an earlier run, "
            f"{self.deduplicated} dedup hits), {len(self.rejected)} rejected; "
            f"{self.left_pending} still pending in {self.table}, {self.outbox_left} in {self.outbox}"
        )

    def append_rejects(self, path: str | Path) -> None:
        """Append the rejected rows to ``path``, one JSON object a line (with the adoption's name)."""
        with open(path, "a", encoding="utf-8") as f:
            for r in self.rejected:
                f.write(json.dumps({"adoption": self.adoption, **asdict(r)}) + "\n")


@dataclass(frozen=True)
class _Row:
    key: UUID
    legacy_id: str
    tenant: str
    payload: str
    fire_at: datetime | None
    dedup_key: str | None


@dataclass(frozen=True)
class _Legacy:
    """The resolved legacy table and the statements compiled for it."""

    table: str
    database: str
    source: str
    outbox_name: str
    plan: ColumnPlan
    params: dict[str, Any]
    preflight: sql.Composed
    check_take: sql.Composed
    pending_count: sql.Composed
    move: sql.Composed
    outbox_create: sql.Composed
    outbox_index: sql.Composed
    outbox_read: sql.Composed
    outbox_delete: sql.Composed
    outbox_count: sql.Composed


def _col(alias: str, name: str) -> sql.Composed:
    return sql.SQL("{}.{}").format(sql.Identifier(alias), sql.Identifier(name))


def _pending(mapping: AdoptMapping, alias: str) -> sql.Composable:
    """The filter over the row ``alias``: parameters f0, f1, ... in the order of ``mapping.filters``."""
    parts: list[sql.Composable] = []
    i = 0
    for column, values in mapping.filters:
        alternatives = []
        for _ in values:
            alternatives.append(sql.SQL("{} = {}").format(_col(alias, column), sql.Placeholder(f"f{i}")))
            i += 1
        parts.append(sql.SQL("({})").format(sql.SQL(" OR ").join(alternatives)))
    parts += [sql.SQL("{} IS NULL").format(_col(alias, column)) for column in mapping.filter_null]
    return sql.SQL(" AND ").join(parts) if parts else sql.SQL("true")


def _params(mapping: AdoptMapping, payload_limit: int, max_delay: float) -> dict[str, Any]:
    params: dict[str, Any] = {"payload_limit": payload_limit, "max_delay": max_delay}
    values = [v for _, vs in mapping.filters for v in vs]
    params.update({f"f{i}": v for i, v in enumerate(values)})
    params.update({f"m{i}": v for i, (_, v) in enumerate(mapping.marks)})
    if mapping.tenant is not None:
        params["tenant"] = mapping.tenant
    if mapping.run_at_timezone is not None:
        params["run_at_timezone"] = mapping.run_at_timezone
    return params


def _expressions(mapping: AdoptMapping, plan: ColumnPlan) -> dict[str, sql.Composable]:
    """The mapped values of the legacy row ``c``, and why the queue would refuse it."""
    if mapping.tenant_col is not None:
        tenant: sql.Composable = sql.SQL("{}::text").format(_col("c", mapping.tenant_col))
    else:
        tenant = sql.SQL("{}::text").format(sql.Placeholder("tenant"))
    not_json: sql.Composable = sql.SQL("false")
    if plan.payload == "columns":
        pairs = sql.SQL(", ").join(sql.SQL("{}, {}").format(sql.Literal(c), _col("c", c)) for c in mapping.payload_cols)
        payload: sql.Composable = _q("expr_payload_object").format(pairs=pairs)
        payload_source: sql.Composable = payload
    else:
        assert mapping.payload_col is not None
        payload_source = _col("c", mapping.payload_col)
        payload = sql.SQL("{}::jsonb").format(payload_source)
        if plan.payload == "text":
            not_json = _q("expr_not_json").format(column=payload_source)
    if mapping.run_at_col is None:
        fire_at: sql.Composable = sql.SQL("NULL::timestamptz")
    elif plan.run_at == "timestamp":
        fire_at = _q("expr_run_at_local").format(column=_col("c", mapping.run_at_col))
    else:
        fire_at = _col("c", mapping.run_at_col)
    dedup: sql.Composable = (
        sql.SQL("NULL::text") if mapping.dedup_col is None else sql.SQL("{}::text").format(_col("c", mapping.dedup_col))
    )
    problem = _q("expr_problem").format(
        tenant=tenant, payload_source=payload_source, not_json=not_json, payload=payload, fire_at=fire_at
    )
    return {"tenant": tenant, "payload": payload, "fire_at": fire_at, "dedup_key": dedup, "problem": problem}


def _compile(
    conn: psycopg.Connection[Any], mapping: AdoptMapping, options: AdoptOptions, limits: tuple[int, float]
) -> _Legacy:
    """Resolve the legacy table, check its columns against the mapping, and compile the statements."""
    row = conn.execute(query("legacy_resolve", _SQL), {"table": mapping.table}).fetchone()
    if row is None:
        raise ConfigurationError(
            f"qm queue adopt: no table {mapping.table!r} in the legacy database (give SCHEMA.TABLE if it is "
            "not on the search path)"
        )
    schema, relname, relkind, server_version, database, system_id = row
    if relkind not in ("r", "p"):
        raise ConfigurationError(f"qm queue adopt: {schema}.{relname} is not a table (relkind {relkind!r})")
    columns = {
        r[0]: LegacyColumn(name=r[0], type=r[1], typname=r[2], category=r[3], unique=r[4])
        for r in conn.execute(query("legacy_columns", _SQL), {"table": mapping.table}).fetchall()
    }
    plan = plan_columns(mapping, columns, server_version=server_version)
    table = sql.Identifier(schema, relname)
    outbox = sql.Identifier(schema, options.outbox)
    outbox_name = f"{schema}.{options.outbox}"
    ident = sql.Identifier(mapping.id_col)
    exprs = _expressions(mapping, plan)
    pending = _pending(mapping, "c")
    marks = sql.SQL(", ").join(
        sql.SQL("{} = {}").format(sql.Identifier(c), sql.Placeholder(f"m{i}")) for i, (c, _) in enumerate(mapping.marks)
    )
    if mapping.mode == "mark":
        take = _q("legacy_take_mark").format(table=table, marks=marks, id=ident, pending_t=_pending(mapping, "t"))
        check_take = _q("legacy_check_take_mark").format(table=table, marks=marks)
    else:
        take = _q("legacy_take_delete").format(table=table, id=ident)
        check_take = _q("legacy_check_take_delete").format(table=table)
    common = {"table": table, "id": ident, "pending": pending, "outbox": outbox}
    return _Legacy(
        table=f"{schema}.{relname}",
        database=database,
        source=f"{system_id}/{database}/{outbox_name}",
        outbox_name=outbox_name,
        plan=plan,
        params=_params(mapping, *limits),
        preflight=_q("legacy_preflight").format(table=table, id=ident, pending=pending, problem=exprs["problem"]),
        check_take=check_take,
        pending_count=_q("legacy_pending_count").format(table=table, pending=pending),
        move=_q("legacy_move").format(take=take, **common, **exprs),
        outbox_create=_q("legacy_outbox_create").format(outbox=outbox),
        outbox_index=_q("legacy_outbox_index").format(
            outbox=outbox, index=sql.Identifier(f"{options.outbox}_adoption")
        ),
        outbox_read=_q("legacy_outbox_read").format(outbox=outbox),
        outbox_delete=_q("legacy_outbox_delete").format(outbox=outbox),
        outbox_count=_q("legacy_outbox_count").format(outbox=outbox),
    )


def _queue_limits(conns: dict[str, psycopg.Connection[Any]], queue: str) -> tuple[int, float]:
    """The queue's payload limit and maximum delay (the strictest over the shards); it must exist on each."""
    limit, delay = None, None
    for name, conn in conns.items():
        row = conn.execute(query("adopt_queue_limits", _SQL), {"queue": queue}).fetchone()
        if row is None:
            raise UnknownQueueError(
                f"queue {queue!r} does not exist on shard {name!r}: create it with 'qm queue create'"
            )
        limit = row[0] if limit is None else min(limit, row[0])
        delay = row[1] if delay is None else min(delay, row[1])
    assert limit is not None and delay is not None
    return int(limit), float(delay)


def _config_error(what: str, exc: psycopg.Error) -> ConfigurationError:
    return ConfigurationError(f"qm queue adopt: {what}: {exc.diag.message_primary or str(exc).strip()}")


@contextmanager
def _connections(
    topology: Topology, source_dsn: str
) -> Iterator[tuple[psycopg.Connection[Any], dict[str, psycopg.Connection[Any]]]]:
    with ExitStack() as stack:
        shards = {s.name: stack.enter_context(psycopg.connect(s.dsn, autocommit=True)) for s in topology.shards}
        legacy = stack.enter_context(psycopg.connect(source_dsn, autocommit=True))
        yield legacy, shards


def _check(
    legacy_conn: psycopg.Connection[Any],
    shard_conns: dict[str, psycopg.Connection[Any]],
    queue: str,
    mapping: AdoptMapping,
    options: AdoptOptions,
) -> tuple[_Legacy, Preflight]:
    """Everything that can be checked before anything moves; nothing is written."""
    legacy = _compile(legacy_conn, mapping, options, _queue_limits(shard_conns, queue))
    try:
        with legacy_conn.transaction(force_rollback=True):
            legacy_conn.execute(legacy.check_take, legacy.params)
    except psycopg.Error as exc:
        raise _config_error(
            f"taking rows from {legacy.table} ({'--mark' if mapping.marks else 'DELETE'})", exc
        ) from None
    try:
        with legacy_conn.transaction(force_rollback=True):
            row = legacy_conn.execute(legacy.preflight, legacy.params).fetchone()
    except psycopg.Error as exc:
        raise _config_error(f"reading {legacy.table} (--filter, --run-at-timezone)", exc) from None
    assert row is not None
    pending, total, bad, by_reason, examples = row
    return legacy, Preflight(pending, total, bad, dict(by_reason), list(examples))


def default_name(legacy_table: str, database: str, queue: str) -> str:
    """The adoption's default name: which table of which database goes to which queue."""
    return f"{database}.{legacy_table}:{queue}"


def check_adoption(topology: Topology, queue: str, source_dsn: str, mapping: AdoptMapping) -> Preflight:
    """The checks ``adopt`` runs first, alone (a dry run): the mapping, the types, the rows the queue
    would refuse. Writes nothing (the outbox is not created)."""
    check_queue_name(queue)
    with _connections(topology, source_dsn) as (legacy_conn, shard_conns):
        return _check(legacy_conn, shard_conns, queue, mapping, AdoptOptions())[1]


@dataclass
class _Run:
    """One run of an adoption: the connections, the report, and the three phases of a slice."""

    topology: Topology
    queue: str
    legacy_conn: psycopg.Connection[Any]
    shard_conns: dict[str, psycopg.Connection[Any]]
    legacy: _Legacy
    options: AdoptOptions
    report: AdoptReport
    hook: Callable[[Phase], None]
    insert: sql.Composed = field(init=False)
    #: legacy ids of bad rows left in the legacy table (not taken again this run)
    skip_ids: list[str] = field(init=False, default_factory=list)
    #: outbox keys the queue refused (not published again this run)
    skip_keys: list[UUID] = field(init=False, default_factory=list)
    #: per shard, ledger keys whose outbox rows are gone: deleted with the shard's next publish
    forget: dict[str, list[UUID]] = field(init=False, default_factory=lambda: defaultdict(list))

    def __post_init__(self) -> None:
        self.insert = _q("adopt_insert").format(queue=sql.Identifier(self.queue))

    # phase 1 ------------------------------------------------------------------------------------
    def move(self) -> int:
        """Take one slice of pending rows into the outbox; returns how many rows it locked."""
        params = {
            **self.legacy.params,
            "adoption": self.report.adoption,
            "limit": self.options.slice_rows,
            "skip": self.skip_ids,
        }
        with self.legacy_conn.transaction():
            row = self.legacy_conn.execute(self.legacy.move, params).fetchone()
            assert row is not None
            locked, boxed, still_pending, bad_ids, bad_reasons = row
            if still_pending:
                raise ConfigurationError(
                    f"qm queue adopt: --mark left {still_pending} row(s) of {self.legacy.table} still matching the "
                    "filter: they would be adopted again (nothing was taken; change --mark or --filter)"
                )
            if bad_ids and self.options.bad_rows == "fail":
                raise AdoptError(
                    f"{len(bad_ids)} pending row(s) of {self.legacy.table} written since the start would be refused by "
                    f"queue {self.queue!r} ({_examples(bad_ids, bad_reasons)}): stopped before taking this slice; "
                    "they are still in the legacy table. Fix them, or re-run with --bad-rows leave"
                )
        self.report.moved += boxed
        for legacy_id, reason in zip(bad_ids, bad_reasons, strict=True):
            self.skip_ids.append(legacy_id)
            self.report.rejected.append(Rejected(legacy_id, reason, "legacy table"))
        if boxed:
            self.hook("moved")
        return int(locked)

    # phases 2 and 3 -----------------------------------------------------------------------------
    def publish(self) -> None:
        """Publish everything this adoption holds in the outbox (this slice's rows, or a crashed run's)."""
        while True:
            params = {
                "adoption": self.report.adoption,
                "skip": self.skip_keys,
                "limit": self.options.slice_rows,
            }
            rows = [_Row(*r) for r in self.legacy_conn.execute(self.legacy.outbox_read, params).fetchall()]
            if not rows:
                return
            by_shard: dict[str, list[_Row]] = defaultdict(list)
            for r in rows:
                by_shard[self.topology.shard_for(r.tenant).name].append(r)
            done: dict[str, list[UUID]] = {}
            refused: list[tuple[_Row, str]] = []
            for name, part in by_shard.items():
                done[name], bad = self._publish_on_shard(name, part)
                refused += bad
                self.hook("published")
            with self.legacy_conn.transaction():
                keys = [k for ks in done.values() for k in ks]
                self.legacy_conn.execute(self.legacy.outbox_delete, {"keys": keys})
            self.hook("forgotten")
            for name, ks in done.items():
                self.forget[name] += ks
            for r, reason in refused:
                self.skip_keys.append(r.key)
                self.report.rejected.append(Rejected(r.legacy_id, reason, "outbox"))
            if refused and self.options.bad_rows == "fail":
                raise AdoptError(
                    f"queue {self.queue!r} refused {len(refused)} row(s) "
                    f"({_examples([r.legacy_id for r, _ in refused], [m for _, m in refused])}); they are kept in the "
                    f"outbox {self.legacy.outbox_name} (not lost): fix the cause and re-run, which publishes them first"
                )

    def _publish_on_shard(self, name: str, rows: list[_Row]) -> tuple[list[UUID], list[tuple[_Row, str]]]:
        """Ledger and events of ``rows`` in one transaction on shard ``name``; returns (keys now done
        with: published, already published or deduplicated; the rows the queue refused, with why)."""
        conn = self.shard_conns[name]
        try:
            with conn.transaction():
                self._forget_keys(conn, name)
                fresh = self._claim(conn, rows)
                new = [r for r in rows if r.key in fresh]
                inserted = self._insert(conn, new)
        except psycopg.Error as exc:
            err = translate(exc, queue=self.queue)
            if isinstance(err, EnqueueError):
                return self._publish_row_by_row(conn, name, rows)
            if isinstance(err, QueueManagerError):
                raise err from exc
            raise
        self.forget[name].clear()
        self.report.already += len(rows) - len(new)
        self.report.adopted += inserted
        self.report.deduplicated += len(new) - inserted
        return [r.key for r in rows], []

    def _publish_row_by_row(
        self, conn: psycopg.Connection[Any], name: str, rows: list[_Row]
    ) -> tuple[list[UUID], list[tuple[_Row, str]]]:
        """The slow path, after the queue refused some row of a batch: one savepoint per row."""
        done: list[UUID] = []
        refused: list[tuple[_Row, str]] = []
        adopted = already = deduplicated = 0
        with conn.transaction():
            self._forget_keys(conn, name)
            for r in rows:
                try:
                    with conn.transaction():
                        if not self._claim(conn, [r]):
                            already += 1
                        elif self._insert(conn, [r]):
                            adopted += 1
                        else:
                            deduplicated += 1
                except psycopg.Error as exc:
                    err = translate(exc, queue=self.queue)
                    if not isinstance(err, EnqueueError):
                        raise
                    refused.append((r, str(err)))
                    continue
                done.append(r.key)
        self.forget[name].clear()
        self.report.adopted += adopted
        self.report.already += already
        self.report.deduplicated += deduplicated
        return done, refused

    def _forget_keys(self, conn: psycopg.Connection[Any], name: str) -> None:
        if self.forget[name]:
            conn.execute(query("adopt_ledger_forget", _SQL), {"keys": self.forget[name]})

    def _claim(self, conn: psycopg.Connection[Any], rows: list[_Row]) -> set[UUID]:
        """Record the rows' keys in the shard's ledger; returns the keys that were not there yet."""
        cur = conn.execute(
            query("adopt_ledger_add", _SQL),
            {
                "adoption": self.report.adoption,
                "source": self.legacy.source,
                "queue": self.queue,
                "keys": [r.key for r in rows],
                "legacy_ids": [r.legacy_id for r in rows],
            },
        )
        return {k for (k,) in cur.fetchall()}

    def _insert(self, conn: psycopg.Connection[Any], rows: list[_Row]) -> int:
        if not rows:
            return 0
        cur = conn.execute(
            self.insert,
            {
                "tenants": [r.tenant for r in rows],
                "payloads": [r.payload for r in rows],
                "fire_ats": [r.fire_at for r in rows],
                "dedup_keys": [r.dedup_key for r in rows],
            },
        )
        return len(cur.fetchall())

    def flush_forget(self) -> None:
        """Delete the ledger keys whose outbox rows are gone (at the end of a run)."""
        for name, keys in self.forget.items():
            if keys:
                conn = self.shard_conns[name]
                with conn.transaction():
                    self._forget_keys(conn, name)
                keys.clear()

    def sweep(self) -> None:
        """After a recovery drained the outbox: ledger keys a crashed run left behind are not needed."""
        for conn in self.shard_conns.values():
            conn.execute(
                query("adopt_ledger_sweep", _SQL),
                {"adoption": self.report.adoption, "source": self.legacy.source, "keep": self.skip_keys},
            )
        self.forget.clear()


def _examples(ids: list[str], reasons: list[str], limit: int = 5) -> str:
    shown = ", ".join(f"{i}: {r}" for i, r in list(zip(ids, reasons, strict=True))[:limit])
    return shown + (f", and {len(ids) - limit} more" if len(ids) > limit else "")


def _scalar(conn: psycopg.Connection[Any], statement: sql.Composed, params: dict[str, Any]) -> int:
    row = conn.execute(statement, params).fetchone()
    assert row is not None
    return int(row[0])


def _lock(shard_conns: dict[str, psycopg.Connection[Any]], adoption: str) -> None:
    """Take the adoption's lock on every shard, or AdoptError. A run that has just ended, or was
    killed, holds it until its server session ends, a moment after its connection closed: an
    attempt that finds it held tries again for up to LOCK_GRACE_SECONDS before it refuses."""
    for name, conn in shard_conns.items():
        deadline = time.monotonic() + LOCK_GRACE_SECONDS  # wall waiting on a server, not the run's clock
        while True:
            row = conn.execute(query("adopt_lock", _SQL), {"adoption": adoption}).fetchone()
            if row is not None and row[0]:
                break
            if time.monotonic() >= deadline:
                raise AdoptError(
                    f"adoption {adoption!r} is already running (its lock is held on shard {name!r}): one run at a time"
                )
            time.sleep(0.05)


def adopt(
    topology: Topology,
    queue: str,
    source_dsn: str,
    mapping: AdoptMapping,
    options: AdoptOptions | None = None,
    *,
    stop: threading.Event | None = None,
    progress: Callable[[AdoptReport], None] | None = None,
    clock: Clock | None = None,
    hook: Callable[[Phase], None] | None = None,
) -> AdoptReport:
    """Move the legacy table's pending rows into ``queue``, slice by slice; returns what it did.

    Checks first, before anything moves: the queue on every shard, the table and its columns against
    the mapping, the privilege to take rows, and (with ``bad_rows="fail"``) that no pending row would
    be refused (else ConfigurationError or AdoptError, nothing moved). Then publishes what an earlier,
    interrupted run left in the outbox, and takes slices until nothing is pending (or, with
    ``follow``, until ``stop`` is set or nothing was pending for ``until_idle`` seconds). Setting
    ``stop`` ends the run after the current slice. ``hook`` is for tests: called with the phase just
    committed.
    """
    check_queue_name(queue)
    options = options or AdoptOptions()
    stop = stop or threading.Event()
    clock = clock or SystemClock()
    with _connections(topology, source_dsn) as (legacy_conn, shard_conns):
        legacy, preflight = _check(legacy_conn, shard_conns, queue, mapping, options)
        adoption = options.name or default_name(legacy.table, legacy.database, queue)
        report = AdoptReport(adoption, queue, legacy.table, legacy.outbox_name, preflight=preflight)
        if preflight.bad and options.bad_rows == "fail":
            reasons = ", ".join(f"{n} {why}" for why, n in sorted(preflight.bad_by_reason.items()))
            raise AdoptError(
                f"{preflight.bad} of the {preflight.pending} pending row(s) of {legacy.table} would be refused by "
                f"queue {queue!r} ({reasons}; e.g. {'; '.join(preflight.examples[:5])}). Nothing was moved. Fix "
                "those rows, or re-run with --bad-rows leave to adopt the others and leave these in the legacy table"
            )
        _lock(shard_conns, adoption)
        try:
            with legacy_conn.transaction():
                legacy_conn.execute(legacy.outbox_create)
                legacy_conn.execute(legacy.outbox_index)
        except psycopg.Error as exc:
            raise _config_error(f"creating the outbox {legacy.outbox_name} in the legacy database", exc) from None
        run = _Run(topology, queue, legacy_conn, shard_conns, legacy, options, report, hook or (lambda phase: None))
        logger.info(
            "adopt starting", extra={"action": "adopt_start", "adoption": adoption, "pending": preflight.pending}
        )
        run.publish()  # what an interrupted run left in the outbox
        run.sweep()
        idle_since: float | None = None
        report.ended = "stopped"
        while not stop.is_set():
            locked = run.move()
            run.publish()
            if locked:
                report.slices += 1
                idle_since = None
                if progress is not None:
                    progress(report)
                continue
            if not options.follow:
                report.ended = "drained"
                break
            now = clock.monotonic()
            idle_since = now if idle_since is None else idle_since
            if options.until_idle is not None and now - idle_since >= options.until_idle:
                report.ended = "idle"
                break
            if progress is not None:
                progress(report)
            stop.wait(options.poll_seconds)
        run.flush_forget()
        report.left_pending = _scalar(legacy_conn, legacy.pending_count, legacy.params)
        report.outbox_left = _scalar(legacy_conn, legacy.outbox_count, {"adoption": adoption})
        logger.info(
            "adopt finished",
            extra={
                "action": "adopt_end",
                "adoption": adoption,
                "adopted": report.adopted,
                "moved": report.moved,
                "rejected": len(report.rejected),
                "ended": report.ended,
            },
        )
        return report
