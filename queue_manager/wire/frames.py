"""The codec of protocol ``qm.v1`` (docs/protocol.md): parse client frames, build server frames.

Every client frame is one JSON object with a ``type``. Parsing never raises anything but
:class:`FrameError`, whose ``code`` and message go back to the client in an ``error`` frame;
the connection stays open and no other event is affected.

Which check comes first: a message that is not JSON text is ``bad_json``; valid JSON that is not
a valid frame (a bad ``ref``, a missing or mistyped field, a value out of range, an integer too
long to convert, nesting too deep to decode) is ``bad_frame``. Only then do the session's checks
run (``forbidden``, ``unknown_queue``, ...): a malformed queue name is ``bad_frame`` whatever
the token allows.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from queue_manager.domain.names import check_queue_name
from queue_manager.errors import InvalidNameError

PROTOCOL = "qm.v1"

#: limits a client must respect (also sent in the welcome frame)
MAX_FRAME_BYTES = 1 << 20
MAX_ITEMS_PER_FRAME = 10_000
MAX_CREDIT = 100_000
MAX_TENANTS_PER_SUBSCRIPTION = 10_000
MAX_ERROR_TEXT = 4096
MAX_REF_LENGTH = 200
MAX_EXTEND_SECONDS = 86_400.0
MAX_NACK_DELAY_SECONDS = 315_576_000.0
#: per-item errors of one result frame that carry a message; later ones carry id, attempt and code
#: only, so that a result for MAX_ITEMS_PER_FRAME items stays well under MAX_FRAME_BYTES
MAX_ERROR_MESSAGES = 100

# error codes (docs/protocol.md lists them with their meaning)
BAD_JSON = "bad_json"
BAD_FRAME = "bad_frame"
UNKNOWN_TYPE = "unknown_type"
FORBIDDEN = "forbidden"
UNKNOWN_QUEUE = "unknown_queue"
NOT_SUBSCRIBED = "not_subscribed"
ALREADY_SUBSCRIBED = "already_subscribed"
UNKNOWN_ID = "unknown_id"
STALE = "stale"
DUPLICATE = "duplicate"
UNAVAILABLE = "unavailable"
DRAINING = "draining"

# close codes
CLOSE_GOING_AWAY = 1001  # the manager drains or stops
CLOSE_NOT_LEADER = 4001  # the manager lost leadership of its shard; reconnect (to the active one)


class FrameError(Exception):
    """A client frame is malformed or not allowed; sent back as an ``error`` frame."""

    def __init__(self, code: str, message: str, ref: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.ref = ref


@dataclass(frozen=True, slots=True)
class Subscribe:
    queue: str
    tenants: tuple[str, ...] | None
    credit: int | None
    ref: Any


@dataclass(frozen=True, slots=True)
class Credit:
    credit: int
    ref: Any


@dataclass(frozen=True, slots=True)
class Ack:
    items: tuple[tuple[int, int], ...]
    ref: Any


@dataclass(frozen=True, slots=True)
class NackItem:
    id: int
    attempt: int
    delay: float | None
    error: str | None


@dataclass(frozen=True, slots=True)
class Nack:
    items: tuple[NackItem, ...]
    ref: Any


@dataclass(frozen=True, slots=True)
class ExtendItem:
    id: int
    attempt: int
    seconds: float


@dataclass(frozen=True, slots=True)
class Extend:
    items: tuple[ExtendItem, ...]
    ref: Any


@dataclass(frozen=True, slots=True)
class Ping:
    ref: Any


Frame = Subscribe | Credit | Ack | Nack | Extend | Ping

_INT64_MAX = (1 << 63) - 1
_INT32_MAX = (1 << 31) - 1
#: a JSON escape like "\ud800" decodes to a lone surrogate, which UTF-8 cannot encode: such a string
#: would break the frame echoing it (ref, tenants) or the database statement storing it (nack error)
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _unicode(value: str) -> bool:
    return _LONE_SURROGATE.search(value) is None


def _int(value: Any, what: str, lo: int, hi: int, ref: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise FrameError(BAD_FRAME, f"{what} must be an integer from {lo} to {hi}, got {json.dumps(value)[:60]}", ref)
    return value


def _seconds(value: Any, what: str, hi: float, ref: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not 0 <= value <= hi
    ):
        raise FrameError(
            BAD_FRAME, f"{what} must be a number of seconds from 0 to {hi:g}, got {json.dumps(value)[:60]}", ref
        )
    return float(value)


def _items(obj: dict[str, Any], key: str, ref: Any) -> list[Any]:
    items = obj.get(key)
    if not isinstance(items, list) or not items:
        raise FrameError(BAD_FRAME, f"'{key}' must be a non-empty list", ref)
    if len(items) > MAX_ITEMS_PER_FRAME:
        raise FrameError(BAD_FRAME, f"'{key}' holds {len(items)} items; at most {MAX_ITEMS_PER_FRAME} per frame", ref)
    return items


def _id_attempt(item: Any, i: int, ref: Any) -> tuple[int, int]:
    if isinstance(item, list) and len(item) == 2:
        ident, attempt = item
    elif isinstance(item, dict):
        ident, attempt = item.get("id"), item.get("attempt")
    else:
        raise FrameError(BAD_FRAME, f'event #{i}: give [id, attempt] or {{"id": ..., "attempt": ...}}', ref)
    return _int(ident, f"event #{i}: id", 1, _INT64_MAX, ref), _int(attempt, f"event #{i}: attempt", 1, _INT32_MAX, ref)


def _ack_items(items: list[Any], ref: Any) -> tuple[tuple[int, int], ...]:
    """[id, attempt] pairs; the common well-formed case is checked in one pass, anything else by
    :func:`_id_attempt`, which names the first bad item."""
    out = []
    for item in items:
        if type(item) is list and len(item) == 2:
            ident, attempt = item
            if type(ident) is int and type(attempt) is int and 0 < ident <= _INT64_MAX and 0 < attempt <= _INT32_MAX:
                out.append((ident, attempt))
                continue
        return tuple(_id_attempt(it, i, ref) for i, it in enumerate(items))
    return tuple(out)


def parse(text: str | bytes) -> Frame:
    """Parse one client frame; raise FrameError with a precise message when it is not valid."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise FrameError(BAD_JSON, "binary frames must hold UTF-8 JSON text") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FrameError(BAD_JSON, f"frame is not valid JSON: {exc}") from None
    except ValueError:  # valid JSON whose integer has more digits than Python converts
        raise FrameError(BAD_FRAME, "an integer in the frame has too many digits") from None
    except RecursionError:
        raise FrameError(BAD_FRAME, "the frame nests arrays or objects too deeply") from None
    if not isinstance(obj, dict):
        raise FrameError(BAD_FRAME, "a frame must be a JSON object with a 'type'")
    ref = obj.get("ref")
    if ref is not None and not (
        isinstance(ref, str | int) and not isinstance(ref, bool) and len(str(ref)) <= MAX_REF_LENGTH
    ):
        raise FrameError(BAD_FRAME, f"'ref' must be a string or integer of at most {MAX_REF_LENGTH} characters")
    if isinstance(ref, str) and not _unicode(ref):
        raise FrameError(BAD_FRAME, "'ref' holds a lone surrogate escape; it must be valid Unicode text")
    kind = obj.get("type")
    if kind == "ack":
        return Ack(_ack_items(_items(obj, "events", ref), ref), ref)
    if kind == "nack":
        nacks = []
        for i, it in enumerate(_items(obj, "events", ref)):
            if not isinstance(it, dict):
                raise FrameError(BAD_FRAME, f'event #{i}: give {{"id", "attempt"[, "delay", "error"]}}', ref)
            ident, attempt = _id_attempt(it, i, ref)
            delay = it.get("delay")
            if delay is not None:
                delay = _seconds(delay, f"event #{i}: delay", MAX_NACK_DELAY_SECONDS, ref)
            error = it.get("error")
            if error is not None and not isinstance(error, str):
                raise FrameError(BAD_FRAME, f"event #{i}: error must be a string", ref)
            if error is not None:
                if not _unicode(error):
                    raise FrameError(BAD_FRAME, f"event #{i}: error holds a lone surrogate escape", ref)
                # PostgreSQL text cannot hold NUL: keep the rest of the message readable
                error = error[:MAX_ERROR_TEXT].replace("\x00", "\ufffd")
            nacks.append(NackItem(ident, attempt, delay, error))
        return Nack(tuple(nacks), ref)
    if kind == "extend":
        extends = []
        for i, it in enumerate(_items(obj, "events", ref)):
            if not isinstance(it, dict):
                raise FrameError(BAD_FRAME, f'event #{i}: give {{"id", "attempt", "seconds"}}', ref)
            ident, attempt = _id_attempt(it, i, ref)
            secs = _seconds(it.get("seconds"), f"event #{i}: seconds", MAX_EXTEND_SECONDS, ref)
            extends.append(ExtendItem(ident, attempt, secs))
        return Extend(tuple(extends), ref)
    if kind == "credit":
        return Credit(_int(obj.get("credit"), "credit", 0, MAX_CREDIT, ref), ref)
    if kind == "subscribe":
        queue = obj.get("queue")
        if not isinstance(queue, str) or not queue:
            raise FrameError(BAD_FRAME, "'queue' must be a queue name", ref)
        try:
            check_queue_name(queue)
        except InvalidNameError as exc:
            raise FrameError(BAD_FRAME, f"'queue': {exc}", ref) from None
        tenants = obj.get("tenants")
        if tenants is not None:
            if (
                not isinstance(tenants, list)
                or not tenants
                or len(tenants) > MAX_TENANTS_PER_SUBSCRIPTION
                or not all(isinstance(t, str) and t for t in tenants)
            ):
                raise FrameError(
                    BAD_FRAME,
                    f"'tenants' must be a list of 1 to {MAX_TENANTS_PER_SUBSCRIPTION} non-empty strings, or null",
                    ref,
                )
            if not all(_unicode(t) for t in tenants):
                raise FrameError(BAD_FRAME, "'tenants' holds a lone surrogate escape; tenants are valid Unicode", ref)
            tenants = tuple(tenants)
        credit = obj.get("credit")
        if credit is not None:
            credit = _int(credit, "credit", 0, MAX_CREDIT, ref)
        return Subscribe(queue, tenants, credit, ref)
    if kind == "ping":
        return Ping(ref)
    if isinstance(kind, str):
        raise FrameError(UNKNOWN_TYPE, f"unknown frame type {kind[:40]!r}", ref)
    raise FrameError(BAD_FRAME, "a frame must be a JSON object with a 'type'", ref)


def dumps(obj: dict[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def item_error(ident: int, attempt: int, code: str, message: str) -> dict[str, Any]:
    """A per-item error of an ack, nack or extend result."""
    return {"id": ident, "attempt": attempt, "code": code, "message": message}


def result_frame(kind: str, ref: Any, errors: Iterable[dict[str, Any]], **body: Any) -> str:
    """An ``ack_result``, ``nack_result`` or ``extend_result``, its size bounded.

    Only the first MAX_ERROR_MESSAGES errors keep their message: 10 000 errors with messages
    made a 1.4 MB frame, over the 1 MiB most clients accept, and the client was closed.
    """
    msg: dict[str, Any] = {"type": kind}
    if ref is not None:
        msg["ref"] = ref
    msg.update(body)
    trimmed = []
    for i, err in enumerate(errors):
        if i >= MAX_ERROR_MESSAGES:
            err = {"id": err["id"], "attempt": err["attempt"], "code": err["code"]}
        trimmed.append(err)
    msg["errors"] = trimmed
    return dumps(msg)


def reply_frame(kind: str, ref: Any, **body: Any) -> str:
    """A server frame that answers a client frame (echoing its ``ref`` when it had one)."""
    msg: dict[str, Any] = {"type": kind}
    if ref is not None:
        msg["ref"] = ref
    msg.update(body)
    return dumps(msg)


def error_frame(code: str, message: str, ref: Any = None, **extra: Any) -> str:
    body: dict[str, Any] = {"type": "error", "code": code, "message": message}
    if ref is not None:
        body["ref"] = ref
    body.update(extra)
    return dumps(body)


#: tenant -> its JSON string literal; tenants repeat across deliveries (bounded: cleared when full)
_TENANT_JSON: dict[str, str] = {}
_TENANT_JSON_MAX = 65_536


def _tenant_json(tenant: str) -> str:
    text = _TENANT_JSON.get(tenant)
    if text is None:
        if len(_TENANT_JSON) >= _TENANT_JSON_MAX:
            _TENANT_JSON.clear()
        text = _TENANT_JSON[tenant] = json.dumps(tenant, ensure_ascii=False)
    return text


def event_json(
    ident: int,
    attempt: int,
    tenant: str,
    partition: int,
    fire_at: float,
    payload_json: str,
    trace: str = "",
    priority: int = 3,
) -> str:
    """One delivered event; the payload is spliced in as the JSON text the database stored, then
    its trace context's members when it has one (``trace``, from :func:`trace_json`). ``priority``:
    the event's (1 highest, docs/protocol.md, "deliver")."""
    return (
        f'{{"id":{ident},"attempt":{attempt},"tenant":{_tenant_json(tenant)},'
        f'"partition":{partition},"fire_at":{fire_at!r},"priority":{priority},"payload":{payload_json}{trace}}}'
    )


def trace_json(traceparent: str | None, tracestate: str | None, baggage: str | None) -> str:
    """The optional members of a delivered event that carry its W3C trace context, each only when
    set (``,"traceparent":"...",...``; empty when it has none). Receivers that do not know them
    ignore them (docs/protocol.md, "deliver")."""
    out = ""
    if traceparent is not None:
        out += f',"traceparent":{json.dumps(traceparent)}'
    if tracestate is not None:
        out += f',"tracestate":{json.dumps(tracestate)}'
    if baggage is not None:
        out += f',"baggage":{json.dumps(baggage)}'
    return out


def deliver_frame(queue: str, events: list[str]) -> str:
    return f'{{"type":"deliver","queue":"{queue}","events":[{",".join(events)}]}}'
