"""Adopting a legacy queue table: how its columns map onto an event, checked without a database.

``qm queue adopt`` moves the rows of an existing, unsharded queue table into one of our queues
(``queue_manager/adopt.py`` does the moving). This module holds the pure part: the mapping the
operator gives (which column is the id, the payload, the run-at time, the tenant; which rows are
pending; what marks a row as taken), its own consistency, and whether the legacy table's columns,
as the catalog describes them, can carry it. Every problem is reported at once, before anything
moves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from queue_manager.errors import ConfigurationError

#: the most rows one slice moves (one transaction on the legacy database, one per shard)
MAX_SLICE_ROWS = 10_000
#: the outbox's default name, in the legacy table's schema (``qm queue adopt --outbox``)
DEFAULT_OUTBOX = "qm_adopt_outbox"
#: a legacy server older than this has no ``gen_random_uuid()`` (the outbox's keys)
MIN_SERVER_VERSION = 130_000
#: ``pg_input_is_valid`` (the JSON check of a text payload column) appeared in PostgreSQL 16
TEXT_PAYLOAD_SERVER_VERSION = 160_000

_INTEGER_TYPES = frozenset({"int2", "int4", "int8"})

PayloadKind = Literal["json", "text", "columns"]
RunAtKind = Literal["none", "timestamptz", "timestamp"]


@dataclass(frozen=True)
class LegacyColumn:
    """A column of the legacy table, as ``pg_attribute`` and ``pg_type`` describe it."""

    name: str
    #: ``format_type()``, for messages
    type: str
    #: ``pg_type.typname`` (``int4``, ``jsonb``, ``timestamptz``, ...)
    typname: str
    #: ``pg_type.typcategory``: S string, N numeric, E enum, D date/time, U user (json), ...
    category: str
    #: the column alone is the key of a valid, non-partial unique index
    unique: bool = False


def parse_assignments(specs: Sequence[str], option: str) -> tuple[tuple[str, str], ...]:
    """``COLUMN=VALUE`` strings as pairs; ConfigurationError naming the option for a malformed one."""
    out = []
    for spec in specs:
        column, sep, value = spec.partition("=")
        column = column.strip()
        if not sep or not column:
            raise ConfigurationError(f"{option} {spec!r}: write COLUMN=VALUE, e.g. {option} status=pending")
        out.append((column, value))
    return tuple(out)


@dataclass(frozen=True)
class AdoptMapping:
    """Which legacy columns make an event, which rows are pending, and what taking a row does.

    A row is *pending* when every ``filters`` column holds one of its values and every
    ``filter_null`` column is NULL (no filter: every row is pending). A pending row is taken out of
    the legacy table by deleting it, or, with ``marks``, by setting those columns, which must make
    it stop being pending (checked here, and again on every slice by the database).
    """

    #: the legacy table, as SQL would name it (``jobs``, ``app.jobs``); resolved with the search path
    table: str
    #: the legacy id: unique (a primary key or unique index), never reused
    id_col: str = "id"
    #: one column holding the payload (json, jsonb, or text holding JSON)
    payload_col: str | None = "payload"
    #: or several columns, made into one JSON object keyed by column name
    payload_cols: tuple[str, ...] = ()
    #: the tenant's column, or ...
    tenant_col: str | None = None
    #: ... one tenant for every row (a legacy queue that has none)
    tenant: str | None = None
    #: the run-at column (timestamptz, or timestamp with ``run_at_timezone``); none: due at once
    run_at_col: str | None = None
    #: the time zone a ``timestamp without time zone`` run-at column is written in (e.g. UTC)
    run_at_timezone: str | None = None
    #: a column to use as the event's dedup_key (None: no dedup key)
    dedup_col: str | None = None
    #: pending rows: (column, accepted values); values of one column are alternatives
    filters: tuple[tuple[str, tuple[str, ...]], ...] = ()
    #: pending rows: columns that must be NULL
    filter_null: tuple[str, ...] = ()
    #: take a row by setting these columns (column, value) instead of deleting it
    marks: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ConfigurationError("qm queue adopt: " + "; ".join(problems))

    @classmethod
    def build(
        cls,
        table: str,
        *,
        id_col: str = "id",
        payload_col: str | None = None,
        payload_cols: Sequence[str] = (),
        tenant_col: str | None = None,
        tenant: str | None = None,
        run_at_col: str | None = None,
        run_at_timezone: str | None = None,
        dedup_col: str | None = None,
        filters: Sequence[tuple[str, str]] = (),
        filter_null: Sequence[str] = (),
        marks: Sequence[tuple[str, str]] = (),
    ) -> AdoptMapping:
        """A mapping from option-like arguments: ``filters`` as repeated (column, value) pairs."""
        grouped: dict[str, list[str]] = {}
        for column, value in filters:
            grouped.setdefault(column, []).append(value)
        return cls(
            table=table,
            id_col=id_col,
            payload_col=None if payload_cols else (payload_col or "payload"),
            payload_cols=tuple(payload_cols),
            tenant_col=tenant_col,
            tenant=tenant,
            run_at_col=run_at_col,
            run_at_timezone=run_at_timezone,
            dedup_col=dedup_col,
            filters=tuple((c, tuple(v)) for c, v in grouped.items()),
            filter_null=tuple(filter_null),
            marks=tuple(marks),
        )

    @property
    def mode(self) -> Literal["delete", "mark"]:
        """How a taken row leaves the legacy queue."""
        return "mark" if self.marks else "delete"

    def problems(self) -> list[str]:
        """What is inconsistent in the mapping itself (empty when nothing is)."""
        out: list[str] = []
        if not self.table.strip():
            out.append("--table is empty")
        if (self.tenant_col is None) == (self.tenant is None):
            out.append("give exactly one of --tenant-col COLUMN and --tenant VALUE (one tenant for every row)")
        if self.tenant is not None and not self.tenant:
            out.append("--tenant must not be empty")
        if self.payload_cols and self.payload_col is not None:
            out.append("give --payload-col or --payload-cols, not both")
        if not self.payload_cols and self.payload_col is None:
            out.append("no payload: give --payload-col or --payload-cols")
        if len(set(self.payload_cols)) != len(self.payload_cols):
            out.append("--payload-cols names a column twice")
        if self.run_at_timezone is not None and self.run_at_col is None:
            out.append("--run-at-timezone needs --run-at-col")
        filter_cols = [c for c, _ in self.filters]
        if set(filter_cols) & set(self.filter_null):
            out.append("a column is both --filter COLUMN=VALUE and --filter-null COLUMN")
        mark_cols = [c for c, _ in self.marks]
        if len(set(mark_cols)) != len(mark_cols):
            out.append("--mark sets a column twice")
        if self.marks:
            accepted = dict(self.filters)
            leaves = [
                c
                for c, v in self.marks
                if (c in accepted and v not in accepted[c]) or (c in self.filter_null)  # a value is never NULL
            ]
            if not self.filters and not self.filter_null:
                out.append("--mark needs a --filter (or --filter-null): with no filter every row stays pending")
            elif not leaves:
                out.append(
                    "--mark must change a --filter column to a value it does not accept (or set a --filter-null "
                    "column): a marked row would still be pending and be adopted again"
                )
        return out

    def columns(self) -> list[tuple[str, str]]:
        """(option, column) for every column the mapping names."""
        out = [("--id-col", self.id_col)]
        if self.payload_col is not None:
            out.append(("--payload-col", self.payload_col))
        out += [("--payload-cols", c) for c in self.payload_cols]
        if self.tenant_col is not None:
            out.append(("--tenant-col", self.tenant_col))
        if self.run_at_col is not None:
            out.append(("--run-at-col", self.run_at_col))
        if self.dedup_col is not None:
            out.append(("--dedup-col", self.dedup_col))
        out += [("--filter", c) for c, _ in self.filters]
        out += [("--filter-null", c) for c in self.filter_null]
        out += [("--mark", c) for c, _ in self.marks]
        return out


@dataclass(frozen=True)
class ColumnPlan:
    """How each mapped column is read, once the legacy table's columns are known to fit."""

    payload: PayloadKind
    run_at: RunAtKind
    #: columns of the legacy table not named by the mapping (for messages)
    unused: tuple[str, ...] = field(default=())


def _is_text(col: LegacyColumn) -> bool:
    return col.category == "S"


def _is_key_like(col: LegacyColumn) -> bool:
    """Text, an enum, an integer or a uuid: what can be a tenant or a dedup key, as its text."""
    return col.category in ("S", "E") or col.typname in _INTEGER_TYPES or col.typname == "uuid"


def plan_columns(mapping: AdoptMapping, columns: Mapping[str, LegacyColumn], *, server_version: int) -> ColumnPlan:
    """Check the legacy table's columns against the mapping; ConfigurationError lists every problem."""
    problems: list[str] = []
    if server_version < MIN_SERVER_VERSION:
        problems.append(
            f"the legacy database runs PostgreSQL {server_version // 10_000}: adopt needs 13 or later "
            "(gen_random_uuid, MATERIALIZED)"
        )
    missing = [(opt, c) for opt, c in mapping.columns() if c not in columns]
    for opt, c in missing:
        problems.append(f"{opt} {c!r}: no such column in {mapping.table} (columns: {', '.join(columns)})")

    def col(name: str | None) -> LegacyColumn | None:
        return None if name is None else columns.get(name)

    ident = col(mapping.id_col)
    if ident is not None and not ident.unique:
        problems.append(
            f"--id-col {ident.name!r} is not unique: adopt takes rows by id, so it needs a primary key or a "
            "unique index on that column alone"
        )
    tenant = col(mapping.tenant_col)
    if tenant is not None and not _is_key_like(tenant):
        problems.append(f"--tenant-col {tenant.name!r} is {tenant.type}: expected text, an enum, an integer or uuid")
    dedup = col(mapping.dedup_col)
    if dedup is not None and not _is_key_like(dedup):
        problems.append(f"--dedup-col {dedup.name!r} is {dedup.type}: expected text, an enum, an integer or uuid")

    payload: PayloadKind = "columns"
    single = col(mapping.payload_col)
    if single is not None:
        if single.typname in ("json", "jsonb"):
            payload = "json"
        elif _is_text(single):
            payload = "text"
            if server_version < TEXT_PAYLOAD_SERVER_VERSION:
                problems.append(
                    f"--payload-col {single.name!r} is {single.type}: checking that text holds JSON row by row "
                    "needs PostgreSQL 16 on the legacy side (or a json/jsonb column)"
                )
        else:
            problems.append(
                f"--payload-col {single.name!r} is {single.type}: expected json, jsonb or text holding JSON "
                "(or --payload-cols to make an object of several columns)"
            )

    run_at: RunAtKind = "none"
    when = col(mapping.run_at_col)
    if when is not None:
        if when.typname == "timestamptz":
            run_at = "timestamptz"
        elif when.typname == "timestamp":
            run_at = "timestamp"
            if mapping.run_at_timezone is None:
                problems.append(
                    f"--run-at-col {when.name!r} is timestamp without time zone: say which zone its times are in "
                    "with --run-at-timezone (e.g. UTC)"
                )
        else:
            problems.append(
                f"--run-at-col {when.name!r} is {when.type}: expected timestamptz (or timestamp with --run-at-timezone)"
            )
    if problems:
        raise ConfigurationError("qm queue adopt: " + "; ".join(problems))
    named = {c for _, c in mapping.columns()}
    return ColumnPlan(payload, run_at, tuple(c for c in columns if c not in named))


def check_slice_rows(rows: int) -> int:
    """``rows`` if it is a valid slice size."""
    if not 1 <= rows <= MAX_SLICE_ROWS:
        raise ConfigurationError(f"--slice {rows}: give 1 to {MAX_SLICE_ROWS} rows per slice")
    return rows
