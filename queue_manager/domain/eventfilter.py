"""Which events an operator means: the event browser's filters and the operator actions' selection
(``qm events retry --tenant``, a bulk action on "all matching"), parsed from fields into values for
one parameterized query (``event_filters`` in db/sql/admin.sql).

Pure: strings in, a frozen :class:`EventFilter` out, or a :class:`FilterError` whose message says
what was wrong and what is expected (the dashboard shows it with HTTP 400). Nothing typed by a user is
ever spliced into SQL: the payload filter becomes a path (``text[]``) and a JSON value (``jsonb``),
both bound as parameters of ``payload #> path``.

The payload filter's grammar::

    payload.order.id = 42            equal to a JSON value (number, "string", true, false, null, [..], {..})
    payload.order.status = shipped   a bare word is a string
    payload.order.id != 42           present and different
    payload.items.0.sku = "A-1"      a number as a segment is an array index (or a key of that name)
    payload."odd key".x = 1          quoted segments hold any characters but "
    payload.order.id                 present (any value, JSON null included)

The leading ``payload.`` may be left out. Every value must be one PostgreSQL can hold: no NUL
character (``\u0000``) or lone surrogate in a field, a path segment, a JSON string or key, and no
number beyond PostgreSQL's numeric (``1e999999``; NaN and Infinity are not JSON). Such a value is
refused here with the rule (queue_manager.domain.inputs), not by the database.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from queue_manager.domain.inputs import dump_json, json_problem, parse_json, text_problem
from queue_manager.errors import InvalidInputError

#: the states of an event (qm.event_state)
STATES = ("to_be_fired", "fired", "acked", "cancelled", "failed")
#: the longest payload filter accepted, characters
MAX_PAYLOAD_FILTER = 500
#: the deepest path accepted
MAX_DEPTH = 16
#: the longest tenant or dedup key filter
MAX_TEXT = 1000

_SEGMENT = re.compile(r'\s*(?:"([^"]*)"|([A-Za-z0-9_\-]+))')
_OPERATOR = re.compile(r"\s*(!=|=)\s*")

Op = Literal["=", "!=", "exists"]


class FilterError(InvalidInputError):
    """A filter of the event browser is malformed."""


@dataclass(frozen=True)
class PayloadFilter:
    """``payload #> path`` compared to ``value`` (``op`` ``=``/``!=``), or only present (``exists``)."""

    path: tuple[str, ...]
    op: Op
    #: the JSON value compared to, as JSON text (None for ``exists``)
    value_json: str | None

    def __str__(self) -> str:
        path = ".".join(s if re.fullmatch(r"[A-Za-z0-9_\-]+", s) else f'"{s}"' for s in self.path)
        if self.op == "exists":
            return f"payload.{path}"
        return f"payload.{path} {self.op} {self.value_json}"


def parse_payload_filter(text: str) -> PayloadFilter:
    """Parse ``payload.a.b = 42`` (grammar in the module docstring); FilterError says what is wrong."""
    src = text.strip()
    if len(src) > MAX_PAYLOAD_FILTER:
        raise FilterError(f"payload filter: longer than {MAX_PAYLOAD_FILTER} characters")
    if not src:
        raise FilterError("payload filter: empty; write e.g. payload.order.id = 42")
    pos = 0
    if src.startswith("payload.") or src == "payload":
        pos = len("payload.")
        if src == "payload":
            raise FilterError("payload filter: name a field after 'payload.', e.g. payload.order.id = 42")
    path: list[str] = []
    while True:
        m = _SEGMENT.match(src, pos)
        if m is None:
            raise FilterError(
                f"payload filter: expected a field name at character {pos + 1} of {src!r} "
                '(letters, digits, _ or -, or a "quoted" name), e.g. payload.order.id = 42'
            )
        segment = m.group(1) if m.group(1) is not None else m.group(2)
        problem = text_problem(segment)
        if problem is not None:
            raise FilterError(f"payload filter: the field name {segment[:40]!r} {problem}")
        path.append(segment)
        pos = m.end()
        if pos < len(src) and src[pos] == ".":
            pos += 1
            continue
        break
    if len(path) > MAX_DEPTH:
        raise FilterError(f"payload filter: a path deeper than {MAX_DEPTH} fields")
    rest = src[pos:]
    if not rest.strip():
        return PayloadFilter(tuple(path), "exists", None)
    m = _OPERATOR.match(rest)
    if m is None:
        raise FilterError(
            f"payload filter: expected = or != after the path {'.'.join(path)!r}, found {rest.strip()[:20]!r}"
        )
    op: Op = "=" if m.group(1) == "=" else "!="
    raw = rest[m.end() :].strip()
    if not raw:
        raise FilterError(f"payload filter: a value is missing after {op!r}, e.g. payload.order.id = 42")
    return PayloadFilter(tuple(path), op, _json_value(raw))


def _json_value(raw: str) -> str:
    """The value as canonical JSON text: a JSON literal, else a bare word taken as a string."""
    try:
        value: Any = parse_json(raw)
    except ValueError:
        if raw[0] in '"[{' or not re.fullmatch(r"[A-Za-z0-9_\-.:@/+ ]+", raw):
            raise FilterError(
                f"payload filter: the value {raw[:40]!r} is neither JSON nor a plain word; quote strings "
                'that hold other characters, e.g. payload.note = "a, b"'
            ) from None
        value = raw
    problem = json_problem(value)
    if problem is not None:
        raise FilterError(f"payload filter: the value {raw[:40]!r} cannot be compared: {problem}")
    return dump_json(value)


def parse_time(name: str, raw: str) -> datetime:
    """An ISO-8601 time (``2026-11-27``, ``2026-11-27T10:00``, with or without an offset; UTC when none)."""
    try:
        value = datetime.fromisoformat(raw.strip())
    except ValueError:
        raise FilterError(f"{name}: {raw[:40]!r} is not a time; use ISO 8601, e.g. 2026-11-27T10:00:00Z") from None
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


@dataclass(frozen=True)
class EventFilter:
    """What the event browser (and a bulk action on "all matching") selects."""

    state: str | None = None
    tenant: str | None = None
    event_id: int | None = None
    dedup_key: str | None = None
    fire_from: datetime | None = None
    fire_to: datetime | None = None
    created_from: datetime | None = None
    created_to: datetime | None = None
    payload: PayloadFilter | None = None
    #: only this shard's events (None: every shard)
    shard: str | None = None

    def params(self) -> dict[str, Any]:
        """The bound parameters of the ``web_events_*`` queries (web.sql)."""
        p = self.payload
        return {
            "state": self.state,
            "tenant": self.tenant,
            "id": self.event_id,
            "dedup_key": self.dedup_key,
            "fire_from": self.fire_from,
            "fire_to": self.fire_to,
            "created_from": self.created_from,
            "created_to": self.created_to,
            "jpath": None if p is None else list(p.path),
            "jop": None if p is None else p.op,
            "jvalue": None if p is None else p.value_json,
        }

    def query(self) -> dict[str, str]:
        """The filter as query-string fields (what :func:`parse_filter` reads back)."""
        out: dict[str, str] = {}
        for key, value in (
            ("state", self.state),
            ("tenant", self.tenant),
            ("id", None if self.event_id is None else str(self.event_id)),
            ("dedup_key", self.dedup_key),
            ("fire_from", _iso(self.fire_from)),
            ("fire_to", _iso(self.fire_to)),
            ("created_from", _iso(self.created_from)),
            ("created_to", _iso(self.created_to)),
            ("payload", None if self.payload is None else str(self.payload)),
            ("shard", self.shard),
        ):
            if value is not None:
                out[key] = value
        return out

    def describe(self) -> str:
        """One line for the audit table and the confirmation page."""
        q = self.query()
        return ", ".join(f"{k} {v}" for k, v in q.items()) or "no filter"


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def parse_filter(fields: Mapping[str, str], shards: tuple[str, ...]) -> EventFilter:
    """The filter of a query string or form; empty fields are no filter. FilterError on bad input."""

    def get(name: str) -> str | None:
        raw = fields.get(name)
        if raw is None:
            return None
        raw = raw.strip()
        if len(raw) > MAX_TEXT:
            raise FilterError(f"{name}: longer than {MAX_TEXT} characters")
        problem = text_problem(raw)
        if problem is not None:
            raise FilterError(f"{name}: {raw[:40]!r} {problem}")
        return raw or None

    state = get("state")
    if state is not None and state not in STATES:
        raise FilterError(f"state: {state!r} is not a state; use one of {', '.join(STATES)}")
    raw_id = get("id")
    event_id = None
    if raw_id is not None:
        if not re.fullmatch(r"[0-9]{1,18}", raw_id):
            raise FilterError(f"id: {raw_id[:40]!r} is not an event id (a positive whole number)")
        event_id = int(raw_id)
    shard = get("shard")
    if shard is not None and shard not in shards:
        raise FilterError(f"shard: no shard named {shard!r} (shards: {', '.join(shards)})")
    times = {}
    for name in ("fire_from", "fire_to", "created_from", "created_to"):
        raw = get(name)
        times[name] = None if raw is None else parse_time(name, raw)
    payload_raw = get("payload")
    return EventFilter(
        state=state,
        tenant=get("tenant"),
        event_id=event_id,
        dedup_key=get("dedup_key"),
        payload=None if payload_raw is None else parse_payload_filter(payload_raw),
        shard=shard,
        **times,
    )
