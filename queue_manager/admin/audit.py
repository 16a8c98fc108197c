"""The audit of the operator actions (``qm.audit``): who did what, where, to how many events.

An action that touches several shards writes a row on each (its *part* there), in the same
transaction as its change on that shard (no transaction spans two shards, so this is the only way
the audit and the change are both there or neither, whatever stops the process). The parts share
the action's id, and :func:`recent` and :func:`find` read them back as one :class:`Action` with
its counts per shard. ``requested`` is what the action asked for on a shard (the events it bound
there, or looked at), ``affected`` what it changed there, counted in each change's transaction.
"""

from __future__ import annotations

import getpass
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

import psycopg

from queue_manager.admin.shards import Conn, Connector, connector
from queue_manager.db.sqlfiles import query
from queue_manager.domain.topology import Topology

ADMIN_SQL = "admin.sql"
Via = Literal["web", "cli", "api"]


def default_actor() -> str:
    """Who acts when no one is named: the operating system's user."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no user name for this uid (a container)
        return "unknown"


@dataclass(frozen=True)
class Audit:
    """One action being taken: what each of its parts records."""

    #: the action's name (retry_dead, fire_now, reschedule, cancel, pause, resume, settings, tenant_set...)
    action: str
    queue: str
    #: who: a dashboard token's name, or the operating system's user
    actor: str
    via: Via
    #: the filter, selection or settings, as an operator reads them
    detail: str
    #: per shard it means to touch, how many events it bound there (None: as found, or a settings change)
    plan: Mapping[str, int | None]
    action_id: uuid.UUID = field(default_factory=uuid.uuid4)

    def record(self, conn: Conn, *, asked: int, changed: int, last: bool) -> None:
        """Add a slice to this action's part on ``conn``'s shard, in the caller's transaction."""
        conn.execute(
            query("audit_record", ADMIN_SQL),
            {
                "action_id": self.action_id,
                "via": self.via,
                "actor": self.actor,
                "action": self.action,
                "queue": self.queue,
                "detail": self.detail,
                "plan": json.dumps(dict(self.plan)),
                "asked": asked,
                "changed": changed,
                "last": last,
            },
        )


def new(
    action: str,
    queue: str,
    *,
    actor: str | None = None,
    via: Via = "api",
    detail: Any,
    plan: Mapping[str, int | None],
    action_id: uuid.UUID | None = None,
) -> Audit:
    """An :class:`Audit` for an action about to be taken (``detail``: text, or data shown as JSON;
    ``action_id``: the caller's, to find the action again, else a new one)."""
    text = detail if isinstance(detail, str) else json.dumps(detail, sort_keys=True, default=str)
    return Audit(action, queue, actor or default_actor(), via, text[:2000], plan, action_id or uuid.uuid4())


@dataclass
class Part:
    """An action's row on one shard."""

    requested: int
    affected: int
    finished: bool


@dataclass
class Action:
    """An action as the audit tells it, its parts on every shard together."""

    action_id: str
    #: when its first part was written
    at: datetime
    actor: str
    via: str
    action: str
    queue: str | None
    detail: str
    #: shard -> its part there
    parts: dict[str, Part]
    #: shard -> what it bound there (None: as found), for every shard it meant to touch
    plan: dict[str, int | None]

    @property
    def requested(self) -> int:
        return sum(p.requested for p in self.parts.values())

    @property
    def affected(self) -> int:
        return sum(p.affected for p in self.parts.values())

    @property
    def missing(self) -> list[str]:
        """The shards it meant to touch and has no part on (the process stopped before them)."""
        return [s for s in self.plan if s not in self.parts]

    @property
    def finished(self) -> bool:
        return not self.missing and all(p.finished for p in self.parts.values())


def _group(rows: list[tuple[str, dict[str, Any]]]) -> list[Action]:
    out: dict[str, Action] = {}
    for shard, r in rows:
        key = str(r["action_id"]) if r["action_id"] is not None else f"{shard}:{r['id']}"
        part = Part(int(r["requested"]), int(r["affected"]), r["finished_at"] is not None)
        found = out.get(key)
        if found is None:
            plan = dict(r["plan"]) if r["plan"] is not None else {shard: int(r["requested"])}
            found = out[key] = Action(
                key, r["at"], r["actor"], r["via"], r["action"], r["queue"], r["filter"], {}, plan
            )
        found.parts[shard] = part
        found.at = min(found.at, r["at"])
    return sorted(out.values(), key=lambda a: a.at, reverse=True)


def recent(db: Topology | Connector, limit: int = 50, queue: str | None = None) -> list[Action]:
    """The newest actions (of one queue, or of all), newest first; a shard that cannot be read is
    left out."""
    shards = connector(db)
    rows: list[tuple[str, dict[str, Any]]] = []
    for shard in shards.shards:
        try:
            with shards.connect(shard) as conn:
                found = conn.execute(query("audit_recent", ADMIN_SQL), {"limit": limit, "queue": queue}).fetchall()
        except psycopg.OperationalError:
            continue
        rows += [(shard.name, r) for r in found]
    return _group(rows)[:limit]


def find(db: Topology | Connector, action_id: str) -> Action | None:
    """One action by its id, or None (an id that is not a UUID: None)."""
    try:
        key = uuid.UUID(action_id)
    except ValueError:
        return None
    shards = connector(db)
    rows: list[tuple[str, dict[str, Any]]] = []
    for shard in shards.shards:
        with shards.connect(shard) as conn:
            rows += [(shard.name, r) for r in conn.execute(query("audit_action", ADMIN_SQL), {"action_id": key})]
    grouped = _group(rows)
    return grouped[0] if grouped else None
