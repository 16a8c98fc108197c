"""Reading events from the shell: a page of a queue's events across the shards (``qm events list``)
and one event whole (``qm events show``), so that a dead letter can be read without SQL on each
shard.

Paging is a keyset per shard: a :class:`Page` names, for each shard, the lowest id it showed there,
and the next page asks each shard for the events below it. Every page merges the shards' newest
first by creation time.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from queue_manager.admin.audit import ADMIN_SQL
from queue_manager.admin.events import _filled, _targets
from queue_manager.admin.shards import Connector, check_ids, check_queue, connector, db_error
from queue_manager.db.sqlfiles import query
from queue_manager.domain.eventfilter import EventFilter
from queue_manager.domain.topology import Topology
from queue_manager.errors import InvalidInputError

#: events per page at most
MAX_PAGE = 1000


@dataclass(frozen=True)
class Page:
    """A page of events (each with its ``shard``), and where the next one starts on each shard."""

    events: list[dict[str, Any]]
    #: shard -> the lowest id shown there (shards with none shown keep the cursor they had)
    cursor: dict[str, int | None]
    #: some shard may have more
    more: bool

    def cursor_text(self) -> str:
        """The cursor as ``s0:123,s1:456`` (``--cursor`` of ``qm events list``)."""
        return ",".join(f"{k}:{v}" for k, v in self.cursor.items() if v is not None)


def parse_cursor(text: str, shards: tuple[str, ...]) -> dict[str, int | None]:
    """``s0:123,s1:456`` as a cursor; InvalidInputError names what is wrong."""
    out: dict[str, int | None] = dict.fromkeys(shards)
    for part in (p for p in text.split(",") if p.strip()):
        name, _, raw = part.strip().partition(":")
        if name not in out or not raw.isdigit():
            raise InvalidInputError(
                f"cursor: {part.strip()[:40]!r} is not SHARD:ID with a shard of {', '.join(shards)}"
            )
        out[name] = check_ids([int(raw)])[0]
    return out


def list_events(
    db: Topology | Connector,
    queue: str,
    flt: EventFilter | None = None,
    *,
    limit: int = 50,
    cursor: Mapping[str, int | None] | None = None,
) -> Page:
    """The newest ``limit`` events matching ``flt`` across the shards (below ``cursor``)."""
    check_queue(queue)
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE:
        raise InvalidInputError(f"limit must be from 1 to {MAX_PAGE}, got {limit!r}")
    shards = connector(db)
    flt = flt or EventFilter()
    stmt = _filled("events_list").format(queue=sql.Identifier(queue))
    found: list[list[tuple[Any, int, str, dict[str, Any]]]] = []
    more = False
    start = dict(cursor or {})
    for shard in _targets(shards, flt, None):
        try:
            with shards.connect(shard) as conn:
                params = {**flt.params(), "below": start.get(shard.name), "limit": limit + 1}
                rows = conn.execute(stmt, params).fetchall()
        except psycopg.Error as exc:
            raise db_error(exc, queue, shard) from exc
        more = more or len(rows) > limit
        found.append([(r["created_at"], r["id"], shard.name, {"shard": shard.name, **r}) for r in rows[:limit]])
    merged = heapq.merge(*found, key=lambda x: (x[0], x[1]), reverse=True)
    events = [x[3] for _, x in zip(range(limit), merged, strict=False)]
    taken = sum(len(f) for f in found)
    more = more or taken > len(events)
    new: dict[str, int | None] = {s.name: start.get(s.name) for s in shards.shards}
    for e in events:
        cur = new.get(e["shard"])
        new[e["shard"]] = e["id"] if cur is None or e["id"] < cur else cur
    return Page(events, new, more)


def show_event(db: Topology | Connector, queue: str, event_id: int, shard: str | None = None) -> list[dict[str, Any]]:
    """The event ``event_id`` of ``queue``, every column, on each shard that has one (ids are per
    shard: give ``shard`` to look at one)."""
    check_queue(queue)
    check_ids([event_id])
    shards = connector(db)
    names = [s.name for s in shards.shards]
    if shard is not None and shard not in names:
        raise InvalidInputError(f"no shard named {shard!r} (shards: {', '.join(names)})")
    out = []
    for s in shards.shards:
        if shard is not None and s.name != shard:
            continue
        try:
            with shards.connect(s) as conn:
                stmt = sql.SQL(query("event_show", ADMIN_SQL)).format(queue=sql.Identifier(queue))
                row = conn.execute(stmt, {"id": event_id}).fetchone()
        except psycopg.Error as exc:
            raise db_error(exc, queue, s) from exc
        if row is not None:
            out.append({"shard": s.name, **row})
    return out
