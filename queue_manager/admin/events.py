"""Operator actions on events: retry dead letters, fire scheduled events now, reschedule events not
yet fired, cancel events not yet settled.

Each changes only events in the states it names, with a state-guarded statement
(db/sql/admin.sql): an event a manager or another action changed meanwhile is simply not changed,
and the manager fires an event only by an UPDATE that finds it ``to_be_fired`` and due, so none
fires twice because of an action. Retry, fire now and reschedule touch only states no manager
holds in hand (``failed``, ``to_be_fired``); cancel also takes ``fired`` events (``qm.cancel``):
the event becomes ``cancelled`` in the table at once, and the shard's manager, told at the
commit, sends the connection holding it a ``cancel`` frame (docs/protocol.md) and refuses its
ack. An action runs in slices of
``slice_size`` events, each slice in one transaction with its audit row (admin/audit.py).

Which events, two ways:

- **bound** (the dashboard): :func:`bind` picks, at the confirmation, the newest ``cap`` events
  matching across the shards and counts every match (up to ``count_cap``); :func:`run` then acts on
  those ids only, the ones still in the action's state and still matching. Newer matches (a dead
  letter that failed after the confirmation) are not taken: the confirmation's count is what it
  changes at most, and its audit asks for exactly those;
- **as found** (the CLI's ``qm events retry``): :func:`run` without ids walks every matching event,
  newest first, slice by slice (at most ``cap`` when given).
"""

from __future__ import annotations

import heapq
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from psycopg import sql

from queue_manager.admin import audit
from queue_manager.admin.audit import ADMIN_SQL, Via
from queue_manager.admin.queues import queue_row
from queue_manager.admin.shards import Conn, Connector, check_ids, check_queue, check_tenant, connector, db_error
from queue_manager.db.sqlfiles import query
from queue_manager.domain.eventfilter import EventFilter
from queue_manager.domain.settings import PRIORITY_LEVELS
from queue_manager.domain.topology import Shard, Topology
from queue_manager.errors import InvalidInputError

#: shard -> event ids
Selection = Mapping[str, Sequence[int]]
#: the earliest fire_at an event may be given (the enqueue's rule, qm.refuse_event)
EARLIEST_FIRE_AT = datetime(2000, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class EventAction:
    """An action on events: the one state it changes (a state no manager holds in hand), and the
    words that name it."""

    #: the action's name in forms, the CLI and the audit
    name: str
    #: the states of the events it changes
    targets: tuple[str, ...]
    #: only events not yet due
    future: bool
    #: its state-guarded statement in admin.sql
    statement: str
    #: "Retry 12 dead letters", "Fire 12 scheduled events now", ...
    verb: str
    noun: str
    #: what it does to them
    effect: str


ACTIONS: dict[str, EventAction] = {
    a.name: a
    for a in (
        EventAction(
            "retry_dead", ("failed",), False, "events_retry", "Retry", "dead letters",
            "back in the queue, due now, with a fresh attempt budget",
        ),
        EventAction(
            "fire_now", ("to_be_fired",), True, "events_fire_now", "Fire now", "scheduled events",
            "due now instead of at their fire_at: the manager fires each once",
        ),
        EventAction(
            "reschedule", ("to_be_fired",), False, "events_reschedule", "Reschedule", "events not yet fired",
            "due at the new time (never fired before it) and/or at the new priority",
        ),
        # cancel: the dashboard's bulk action, and qm events cancel by id or by filter
        EventAction(
            "cancel", ("to_be_fired", "fired"), False, "events_cancel", "Cancel", "events not yet settled",
            "cancelled: never fired (again); a receiver holding one is told to stop, and its ack is refused",
        ),
    )
}  # fmt: skip


def action_named(name: str) -> EventAction:
    """The action called ``name``; InvalidInputError names the others."""
    try:
        return ACTIONS[name]
    except KeyError:
        raise InvalidInputError(f"unknown action {name[:40]!r}; use one of {', '.join(ACTIONS)}") from None


@dataclass(frozen=True)
class Binding:
    """What a confirmation binds an action to."""

    #: events matching on each shard at the confirmation, counted up to ``count_cap`` (more: count_cap + 1)
    matched: dict[str, int]
    #: the events bound, per shard, newest first: the newest ``cap`` matching across the shards
    ids: dict[str, list[int]]
    count_cap: int

    @property
    def total(self) -> int:
        """Events matching at the confirmation (more than ``count_cap`` when :attr:`more`)."""
        return sum(min(n, self.count_cap) for n in self.matched.values())

    @property
    def more(self) -> bool:
        """Some shard had more than ``count_cap`` matching (the count stopped there)."""
        return any(n > self.count_cap for n in self.matched.values())

    @property
    def bound(self) -> int:
        return sum(len(v) for v in self.ids.values())


@dataclass(frozen=True)
class Outcome:
    """What an action did: its audit id, and per shard the events it asked for and changed."""

    action_id: str
    requested: dict[str, int]
    changed: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.changed.values())


def _targets(shards: Connector, flt: EventFilter, selection: Selection | None) -> list[Shard]:
    """The shards the events can be on: those of the selection, the filter's shard, and for a
    tenant its own shard only."""
    out = list(shards.shards)
    if selection is not None:
        out = [s for s in out if selection.get(s.name)]
    if flt.shard is not None:
        out = [s for s in out if s.name == flt.shard]
    if flt.tenant is not None:
        home = shards.shard_for(check_tenant(flt.tenant)).name
        out = [s for s in out if s.name == home]
    return out


def _filled(name: str) -> sql.SQL:
    text = query(name, ADMIN_SQL)
    filters = "\n".join(x for x in query("event_filters", ADMIN_SQL).splitlines() if not x.lstrip().startswith("--"))
    return sql.SQL(text.replace("{filters}", filters))  # shipped SQL, never input


def _params(action: EventAction, flt: EventFilter, ids: Sequence[int] | None, **more: Any) -> dict[str, Any]:
    return {**flt.params(), "ids": None if ids is None else list(ids), "targets": list(action.targets),
            "future": action.future, **more}  # fmt: skip


def _check(
    db: Connector, queue: str, action: EventAction, fire_at: datetime | None, priority: int | None = None
) -> None:
    check_queue(queue)
    if action.name != "reschedule":
        return
    if fire_at is None and priority is None:
        raise InvalidInputError(
            "reschedule: give the new fire_at (ISO 8601, e.g. 2026-11-28T09:00:00Z) and/or the new priority"
        )
    if priority is not None and (
        isinstance(priority, bool) or not isinstance(priority, int) or not 1 <= priority <= PRIORITY_LEVELS
    ):
        raise InvalidInputError(
            f"reschedule: the new priority must be 1 (highest) to {PRIORITY_LEVELS}, got {priority!r}"
        )
    if fire_at is None:
        return
    if fire_at.tzinfo is None:
        raise InvalidInputError("reschedule: give the new fire_at with its offset (e.g. +00:00)")
    latest = datetime.now(UTC) + timedelta(seconds=float(queue_row(db, queue)["max_delay_seconds"]))
    if not EARLIEST_FIRE_AT <= fire_at <= latest:
        raise InvalidInputError(
            f"reschedule: fire_at {fire_at.isoformat()} is out of range: after 2000-01-01 and at most the "
            f"queue's max_delay_seconds from now (until {latest.isoformat(timespec='seconds')})"
        )


def bind(
    db: Topology | Connector,
    queue: str,
    action: EventAction,
    flt: EventFilter,
    selection: Selection | None = None,
    *,
    cap: int,
    count_cap: int,
    fire_at: datetime | None = None,
    priority: int | None = None,
) -> Binding:
    """What the action would change now, to be confirmed: on each shard the events matching
    (``flt``, among ``selection`` when given) counted up to ``count_cap``, and the ids of the
    newest ``cap`` across the shards (by creation time), which :func:`run` then acts on."""
    shards = connector(db)
    _check(shards, queue, action, fire_at, priority)
    table = sql.Identifier(queue)
    matched: dict[str, int] = {}
    found: list[list[tuple[datetime, int, str]]] = []
    for shard in _targets(shards, flt, selection):
        ids = None if selection is None else check_ids(selection[shard.name])
        try:
            with shards.connect(shard) as conn:
                params = _params(action, flt, ids, limit=count_cap + 1, below=None)
                row = conn.execute(_filled("events_count").format(queue=table), params).fetchone()
                params["limit"] = cap
                picked = conn.execute(_filled("events_pick").format(queue=table), params).fetchall()
        except psycopg.Error as exc:
            raise db_error(exc, queue, shard) from exc
        assert row is not None
        matched[shard.name] = int(row["n"])
        found.append(sorted(((r["created_at"], r["id"], shard.name) for r in picked), reverse=True))
    bound: dict[str, list[int]] = {name: [] for name in matched}
    newest = heapq.merge(*found, key=lambda x: (x[0], x[1]), reverse=True)
    for _, event_id, name in (x for _, x in zip(range(cap), newest, strict=False)):
        bound[name].append(event_id)
    return Binding(matched, bound, count_cap)


def _change(
    conn: Conn,
    queue: str,
    action: EventAction,
    ids: list[int],
    fire_at: datetime | None,
    reason: str | None = None,
    priority: int | None = None,
) -> int:
    """One slice's change, in the caller's transaction; how many events changed."""
    statement = sql.SQL(query(action.statement, ADMIN_SQL)).format(queue=sql.Identifier(queue))
    params = {"ids": ids, "queue": queue, "fire_at": fire_at, "reason": reason, "priority": priority}
    rows = conn.execute(statement, params).fetchall()
    if action.name == "cancel":
        return len(rows[0]["ids"])
    if action.name == "retry_dead" and rows:  # delivered at commit: the manager fires them without a rescan
        conn.execute(query("events_wake", ADMIN_SQL), {"queue": queue})
    return len(rows)


def run(
    db: Topology | Connector,
    queue: str,
    action: EventAction,
    flt: EventFilter | None = None,
    ids: Selection | None = None,
    *,
    actor: str | None = None,
    via: Via = "api",
    description: str | None = None,
    fire_at: datetime | None = None,
    priority: int | None = None,
    cap: int | None = None,
    slice_size: int = 500,
    action_id: uuid.UUID | None = None,
) -> Outcome:
    """Take ``action`` on the events of ``ids`` (shard -> ids: bound, e.g. by :func:`bind`) still in
    its state and matching ``flt``; or, without ``ids``, on every event matching ``flt`` as found,
    newest first, at most ``cap``. In slices of ``slice_size``, each in one transaction with the
    action's audit row on its shard."""
    shards = connector(db)
    flt = flt or EventFilter()
    _check(shards, queue, action, fire_at, priority)
    targets = _targets(shards, flt, ids)
    bound = {s.name: sorted(set(check_ids(ids[s.name])), reverse=True) for s in targets} if ids is not None else None
    plan: dict[str, int | None] = {s.name: (len(bound[s.name]) if bound else None) for s in targets}
    what = description or (flt.describe() if bound is None else f"{sum(map(len, bound.values()))} events by id")
    if fire_at is not None:
        what = f"{what}; fire_at {fire_at.isoformat()}"
    if priority is not None:
        what = f"{what}; priority {priority}"
    record = audit.new(action.name, queue, actor=actor, via=via, detail=what, plan=plan, action_id=action_id)
    why = f"cancelled by {record.actor} ({via})"
    pick = _filled("events_pick").format(queue=sql.Identifier(queue))
    remaining = cap
    asked: dict[str, int] = {}
    changed: dict[str, int] = {}
    for shard in targets:
        asked[shard.name] = changed[shard.name] = 0
        mine = None if bound is None else bound[shard.name]
        below: int | None = None
        try:
            with shards.connect(shard) as conn:
                while True:
                    limit = slice_size if remaining is None else min(slice_size, remaining)
                    chunk = None if mine is None else mine[:limit]
                    with conn.transaction():
                        params = _params(action, flt, chunk, below=below, limit=limit)
                        found = [r["id"] for r in conn.execute(pick, params)] if limit > 0 else []
                        n = _change(conn, queue, action, found, fire_at, why, priority) if found else 0
                        if mine is None:
                            last = len(found) < limit or limit == 0
                            looked = len(found)
                        else:
                            mine = mine[limit:]
                            last = not mine or limit == 0
                            looked = len(chunk or [])
                        record.record(conn, asked=looked, changed=n, last=last)
                    asked[shard.name] += looked
                    changed[shard.name] += n
                    if remaining is not None:
                        remaining -= n if mine is None else looked
                    if last:
                        break
                    below = min(found) if mine is None and found else below
        except psycopg.Error as exc:
            raise db_error(exc, queue, shard) from exc
    return Outcome(str(record.action_id), asked, changed)


def retry_failed(
    db: Topology | Connector,
    queue: str,
    ids: list[int] | None = None,
    tenant: str | None = None,
    *,
    actor: str | None = None,
    via: Via = "api",
) -> int:
    """Put dead-lettered (``failed``) events back to ``to_be_fired``, due now, with a fresh attempt
    budget: every one of the queue, or of one tenant (on its shard), or those ids (on every shard;
    ids are per shard). In slices, each audited in its transaction; the shard's manager is woken at
    each commit. Returns how many moved (``qm events retry``)."""
    shards = connector(db)
    flt = EventFilter(tenant=None if tenant is None else check_tenant(tenant))
    selection = None if ids is None else {s.name: check_ids(ids) for s in shards.shards}
    return run(shards, queue, ACTIONS["retry_dead"], flt, selection, actor=actor, via=via).total
