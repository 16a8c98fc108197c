"""Periodic schedules across the shards: add (or change), pause, resume, remove, list and show.

A schedule lives on the shard that owns its tenant (``qm.schedules``); that shard's leader
enqueues its slots (``manager/schedules.py``). Its name is unique on the shard, and :func:`add`
refuses a name some other shard has too, so a name finds one schedule everywhere. Each change runs
through the SQL API (``qm.schedule_write``, ``qm.schedule_pause``...), which checks everything
again, in one transaction with its audit row. Everything is checked here first, before any
shard sees it: a cron expression by APScheduler, the time zone, the interval, the queue, the
tenant and the payload (:class:`~queue_manager.errors.InvalidInputError` names what is wrong).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from psycopg import sql

from queue_manager.admin import audit
from queue_manager.admin.audit import ADMIN_SQL, Via
from queue_manager.admin.shards import Connector, check_queue, check_tenant, connector, db_error
from queue_manager.db.sqlfiles import query
from queue_manager.domain import schedules as sch
from queue_manager.domain.inputs import json_problem
from queue_manager.domain.topology import Shard, Topology
from queue_manager.errors import InvalidInputError

#: next runs shown by list and show
NEXT_RUNS = 3


@dataclass(frozen=True)
class Definition:
    """A schedule as an operator gives it."""

    name: str
    queue: str
    tenant: str
    payload: Any = field(default_factory=dict)
    cron: str | None = None
    #: seconds
    every: float | None = None
    timezone: str = "UTC"
    misfire: sch.Misfire = "latest"
    catch_up: int = 1
    #: 1 (highest) to 5; None: the queue's default
    priority: int | None = None
    paused: bool = False
    #: an interval's first slot (None: now)
    start: datetime | None = None

    def check(self) -> sch.Trigger:
        """Every field checked (InvalidInputError says which and why); the schedule's trigger."""
        sch.check_name(self.name)
        check_queue(self.queue)
        check_tenant(self.tenant)
        problem = json_problem(self.payload)
        if problem is not None:
            raise InvalidInputError(f"schedule {self.name!r}: the payload {problem}")
        if self.priority is not None and (isinstance(self.priority, bool) or self.priority not in range(1, 6)):
            raise InvalidInputError(
                f"schedule {self.name!r}: priority must be from 1 (highest) to 5, got {self.priority!r}"
            )
        start = self.start or datetime.now(UTC)
        return sch.check(sch.Spec(self.cron, self.every, self.timezone, start, self.misfire, self.catch_up))


@dataclass(frozen=True)
class Schedule:
    """A schedule as stored, with its shard and what the leader made of it."""

    shard: str
    row: dict[str, Any]
    #: the next slots not enqueued yet (none while paused or in error)
    next_runs: list[datetime]
    #: the latest slot whose time has come, and its event's state (None: none yet, or purged)
    last_slot: datetime | None = None
    last_state: str | None = None

    @property
    def name(self) -> str:
        return str(self.row["name"])

    def describe(self) -> str:
        r = self.row
        if r["cron"] is not None:
            when = f"cron {r['cron']!r} in {r['timezone']}"
        else:
            when = f"every {_seconds(r['interval_seconds'])} from {r['anchor'].isoformat(timespec='seconds')}"
        return when


def _seconds(x: float) -> str:
    return f"{x:g} s"


def _audited(shards: Connector, shard: Shard, name: str, params: dict[str, Any], record: audit.Audit,
             queue: str | None) -> Any:  # fmt: skip
    try:
        with shards.connect(shard) as conn, conn.transaction():
            row = conn.execute(query(name, ADMIN_SQL), params).fetchone()
            assert row is not None
            changed = row["changed"]
            record.record(conn, asked=1, changed=int(changed is not None and changed is not False), last=True)
    except psycopg.Error as exc:
        raise db_error(exc, queue, shard) from exc
    return changed


def add(
    db: Topology | Connector,
    d: Definition,
    *,
    replace: bool = False,
    actor: str | None = None,
    via: Via = "api",
) -> Schedule:
    """Add the schedule ``d`` on its tenant's shard (``replace``: or change the one of that name,
    which drops its slot events not yet due and starts again from now). A name that exists on any
    shard is refused unless ``replace`` finds it on the tenant's shard."""
    d.check()
    shards = connector(db)
    home = shards.shard_for(d.tenant)
    for other, found in _find(shards, d.name):
        if not replace or other.name != home.name:
            where = f"on shard {other.name}" if other.name != home.name else "already"
            raise InvalidInputError(
                f"a schedule named {d.name!r} exists {where} (queue {found['queue']}, tenant {found['tenant']!r}); "
                + (
                    "remove it first, or pick another name"
                    if replace
                    else "change it with --replace, or pick another name"
                )
            )
    params = {
        "replace": replace, "name": d.name, "queue": d.queue, "tenant": d.tenant, "payload": json.dumps(d.payload),
        "cron": d.cron, "interval": d.every, "timezone": d.timezone, "misfire": d.misfire, "catch_up": d.catch_up,
        "priority": d.priority, "paused": d.paused, "anchor": d.start,
    }  # fmt: skip
    record = audit.new("schedule_set" if replace else "schedule_add", d.queue, actor=actor, via=via,
                       detail={k: v for k, v in params.items() if k not in ("replace", "payload")},
                       plan={home.name: None})  # fmt: skip
    _audited(shards, home, "schedule_add", params, record, d.queue)
    out = show(shards, d.name)
    assert out is not None
    return out


def _find(shards: Connector, name: str) -> list[tuple[Shard, dict[str, Any]]]:
    out = []
    for shard in shards.shards:
        try:
            with shards.connect(shard) as conn:
                rows = conn.execute(query("schedules_list", ADMIN_SQL), {"queue": None, "name": name, "limit": 1})
                row = rows.fetchone()
        except psycopg.Error as exc:
            raise db_error(exc, None, shard) from exc
        if row is not None:
            out.append((shard, dict(row)))
    return out


def _one(shards: Connector, name: str) -> tuple[Shard, dict[str, Any]]:
    sch.check_name(name)
    found = _find(shards, name)
    if not found:
        raise InvalidInputError(f"no schedule named {name!r} on any shard (qm schedule list shows them)")
    return found[0]


def _change(db: Topology | Connector, name: str, what: str, actor: str | None, via: Via) -> Schedule | None:
    shards = connector(db)
    shard, row = _one(shards, name)
    record = audit.new(f"schedule_{what}", row["queue"], actor=actor, via=via, detail={"name": name},
                       plan={shard.name: None})  # fmt: skip
    _audited(shards, shard, f"schedule_{what}", {"name": name}, record, row["queue"])
    return show(shards, name)


def pause(db: Topology | Connector, name: str, *, actor: str | None = None, via: Via = "api") -> Schedule:
    """Pause: no slot is enqueued, and its slot events enqueued ahead and not yet due are dropped."""
    out = _change(db, name, "pause", actor, via)
    assert out is not None
    return out


def resume(db: Topology | Connector, name: str, *, actor: str | None = None, via: Via = "api") -> Schedule:
    """Resume: slots are enqueued from now on (those of the pause never are)."""
    out = _change(db, name, "resume", actor, via)
    assert out is not None
    return out


def remove(db: Topology | Connector, name: str, *, actor: str | None = None, via: Via = "api") -> None:
    """Remove the schedule and its slot events not yet due (its fired events stay)."""
    _change(db, name, "remove", actor, via)


def _schedule(shards: Connector, shard: Shard, row: dict[str, Any], conn: Any) -> Schedule:
    now: datetime = row["now"]
    runs: list[datetime] = []
    last: datetime | None = None
    state: str | None = None
    if row["error"] is None:
        try:
            trig = sch.check(sch.Spec(row["cron"], row["interval_seconds"], row["timezone"], row["anchor"],
                                      row["misfire"], row["catch_up"]))  # fmt: skip
        except InvalidInputError:
            trig = None
        if trig is not None:
            if not row["paused"]:
                runs = trig.next_runs(now, NEXT_RUNS)
            if row["last_slot"] is not None:
                last = row["last_slot"] if row["last_slot"] <= now else _last_before(trig, row, now)
            if last is not None:
                ev = conn.execute(
                    sql.SQL(query("schedule_slot_event", ADMIN_SQL)).format(queue=sql.Identifier(row["queue"])),
                    {"tenant": row["tenant"], "key": sch.dedup_key(row["id"], last)},
                ).fetchone()
                state = None if ev is None else str(ev["state"])
    return Schedule(shard.name, row, runs, last, state)


def _last_before(trig: sch.Trigger, row: dict[str, Any], now: datetime) -> datetime | None:
    """The latest slot at or before ``now`` (an interval's by arithmetic; a cron's from a day back at most)."""
    if trig.interval is not None:
        start = now - timedelta(seconds=trig.interval)
    else:
        start = max(row["created_at"], now - timedelta(days=1))
    slots = trig.slots(start, now, 2000)
    return slots[-1] if slots else None


def show(db: Topology | Connector, name: str) -> Schedule | None:
    """The schedule called ``name``, wherever it is (None: none)."""
    shards = connector(db)
    sch.check_name(name)
    for shard, _ in _find(shards, name):
        with shards.connect(shard) as conn:
            row = conn.execute(query("schedules_list", ADMIN_SQL), {"queue": None, "name": name, "limit": 1}).fetchone()
            if row is not None:
                return _schedule(shards, shard, dict(row), conn)
    return None


def list_schedules(db: Topology | Connector, queue: str | None = None, limit: int = 1000) -> list[Schedule]:
    """Every shard's schedules (of ``queue``, or all), by name."""
    if queue is not None:
        check_queue(queue)
    shards = connector(db)
    out: list[Schedule] = []
    for shard in shards.shards:
        try:
            with shards.connect(shard) as conn:
                rows = conn.execute(query("schedules_list", ADMIN_SQL), {"queue": queue, "name": None, "limit": limit})
                out += [_schedule(shards, shard, dict(r), conn) for r in rows.fetchall()]
        except psycopg.Error as exc:
            raise db_error(exc, queue, shard) from exc
    return sorted(out, key=lambda s: s.name)
