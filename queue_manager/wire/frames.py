"""The vocabulary of protocol ``qm.v1`` (docs/protocol.md), spelled once: every client and server
frame as a typed value, its constructor (``to_json``) and its parser.

- client frames (:data:`ClientFrame`: :class:`Subscribe`, :class:`Credit`, :class:`Ack`,
  :class:`Nack`, :class:`Extend`, :class:`Ping`) are built by receivers with ``to_json()`` and read
  by the manager with :func:`parse`, which checks every rule of the protocol;
- server frames (:data:`ServerFrame`: :class:`Welcome`, :class:`Subscribed`, :class:`CreditSet`,
  :class:`Deliver`, :class:`AckResult`, :class:`NackResult`, :class:`ExtendResult`, :class:`Pong`,
  :class:`Error`, and :class:`Cancel` for a connection whose subscribe asked for the feature
  ``cancel``: :data:`FEATURES`) are built by the manager with ``to_json()`` and read by receivers with
  :func:`parse_server`. A ``deliver`` is built on the manager's hot path by :func:`deliver_frames`
  from :func:`event` values (each payload spliced in as the JSON text the database stored).

The members' types carry their rules (:class:`Range`, :class:`Length`, :class:`Pattern`,
:class:`Member`), from which :mod:`queue_manager.wire.schema` generates the JSON Schema of every
frame (``docs/protocol.schema.json``), the file a client in another language is built from.

Parsing a client frame never raises anything but :class:`FrameError`, whose ``code`` and message go
back to the client in an ``error`` frame; the connection stays open and no other event is affected.
Which check comes first: a message that is not JSON text is ``bad_json``; valid JSON that is not
a valid frame (a bad ``ref``, a missing or mistyped field, a value out of range, an integer too
long to convert, nesting too deep to decode) is ``bad_frame``. Only then do the session's checks
run (``forbidden``, ``unknown_queue``, ...): a malformed queue name is ``bad_frame`` whatever
the token allows. Parsing a server frame raises :class:`ServerFrameError` (the client drops the
connection); a server frame of a type this version does not know parses to ``None`` (ignored).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Final, Literal, NotRequired, TypedDict

import orjson

from queue_manager.domain.names import check_queue_name
from queue_manager.errors import InvalidNameError

PROTOCOL: Final = "qm.v1"

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
#: per item: an operator cancelled the delivery (the event is cancelled, never fired again)
CANCELLED = "cancelled"

#: the optional features of this version a subscribe may ask for, and the manager grants (echoed in
#: ``subscribed``): ``cancel``, the ``cancel`` frame. A manager that does not know a feature does
#: not echo it, so a client knows what it gets; an old client asks for none and gets none.
FEATURES: Final = ("cancel",)
MAX_FEATURES = 16

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


_INT64_MAX = (1 << 63) - 1
_INT32_MAX = (1 << 31) - 1


# ---------------------------------------------------------------------- the members' rules
# (read by queue_manager.wire.schema; parse() checks the same rules, with the messages of docs/protocol.md)


@dataclass(frozen=True, slots=True)
class Range:
    """A number from ``lo`` to ``hi``, both included."""

    lo: float
    hi: float | None = None


@dataclass(frozen=True, slots=True)
class Length:
    """A string's length, or a list's number of items, from ``lo`` to ``hi``."""

    lo: int = 0
    hi: int | None = None


@dataclass(frozen=True, slots=True)
class Pattern:
    """A string matching this regular expression (JSON Schema's ECMA-262 dialect)."""

    regex: str


@dataclass(frozen=True, slots=True)
class Doc:
    """What a member means, for the schema's ``description``."""

    text: str


@dataclass(frozen=True, slots=True)
class Either:
    """The member may also take this other form (the ``{"id", "attempt"}`` form of an ack item)."""

    alternative: Any


@dataclass(frozen=True, slots=True)
class Member:
    """How a field appears in a frame: under the name ``name`` when it differs from the field's,
    and, with ``omit_none``, left out (never ``null``) when it is None."""

    name: str | None = None
    omit_none: bool = False


EventId = Annotated[int, Range(1, _INT64_MAX), Doc("an event's id on its shard, a 64-bit integer")]
Attempt = Annotated[int, Range(1, _INT32_MAX), Doc("which delivery of the event this is")]
CreditValue = Annotated[int, Range(0, MAX_CREDIT), Doc("the most events in hand on the connection")]
QueueName = Annotated[str, Pattern("^[a-z][a-z0-9_]{0,39}$")]
Tenant = Annotated[str, Length(1)]
Tenants = Annotated[tuple[Tenant, ...], Length(1, MAX_TENANTS_PER_SUBSCRIPTION)]
#: echoed unchanged in the reply (a string, or an integer of at most 200 digits)
Ref = Annotated[str, Length(0, MAX_REF_LENGTH)] | int
Epoch = Annotated[float, Doc("epoch seconds by the database clock")]
ClientRef = Annotated[Ref | None, Doc("echoed in the reply to this frame")]
ServerRef = Annotated[Ref | None, Member(omit_none=True), Doc("the ref of the frame this answers")]
ErrorCode = Annotated[
    str,
    Doc(
        "bad_json, bad_frame, unknown_type, forbidden, unknown_queue, not_subscribed, "
        "already_subscribed, unavailable, draining (later versions may add codes)"
    ),
]
ItemCode = Annotated[str, Doc("unknown_id, stale, duplicate, cancelled or unavailable (later versions may add codes)")]
Features = Annotated[
    tuple[Annotated[str, Length(1, 40)], ...],
    Length(0, MAX_FEATURES),
    Doc("optional features of the protocol: cancel (the cancel frame)"),
]


class IdAttemptObject(TypedDict):
    id: EventId
    attempt: Attempt


IdAttempt = Annotated[tuple[EventId, Attempt], Either(IdAttemptObject)]
AckItems = Annotated[tuple[IdAttempt, ...], Length(1, MAX_ITEMS_PER_FRAME), Member("events")]


# ---------------------------------------------------------------------- client frames


@dataclass(frozen=True, slots=True)
class Subscribe:
    """Subscribe the connection to a queue (once), with an initial credit."""

    TYPE: ClassVar[str] = "subscribe"
    queue: QueueName
    #: None: every tenant the token allows
    tenants: Tenants | None = None
    #: None: unchanged (0 on a new connection)
    credit: CreditValue | None = None
    ref: ClientRef = None
    #: the optional features the client handles (FEATURES); unknown ones are ignored
    features: Annotated[Features | None, Member(omit_none=True)] = None

    def to_json(self) -> str:
        body: dict[str, Any] = {"type": "subscribe", "queue": self.queue}
        if self.tenants is not None:
            body["tenants"] = list(self.tenants)
        if self.credit is not None:
            body["credit"] = self.credit
        if self.features is not None:
            body["features"] = list(self.features)
        return _with_ref(body, self.ref)


@dataclass(frozen=True, slots=True)
class Credit:
    """Set the connection's credit (it replaces the old value)."""

    TYPE: ClassVar[str] = "credit"
    credit: CreditValue
    ref: ClientRef = None

    def to_json(self) -> str:
        return _with_ref({"type": "credit", "credit": self.credit}, self.ref)


@dataclass(frozen=True, slots=True)
class Ack:
    """Events done: each item is ``[id, attempt]`` (or ``{"id", "attempt"}``)."""

    TYPE: ClassVar[str] = "ack"
    items: AckItems
    ref: ClientRef = None

    def to_json(self) -> str:
        return _with_ref({"type": "ack", "events": self.items}, self.ref)


@dataclass(frozen=True, slots=True)
class NackItem:
    id: EventId
    attempt: Attempt
    #: seconds before the event is due again; None: the queue's back-off
    delay: Annotated[float, Range(0, MAX_NACK_DELAY_SECONDS)] | None = None
    #: kept as the event's last_error (cut to MAX_ERROR_TEXT characters); None: "nacked by the receiver"
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        item: dict[str, Any] = {"id": self.id, "attempt": self.attempt}
        if self.delay is not None:
            item["delay"] = self.delay
        if self.error is not None:
            item["error"] = self.error
        return item


NackItems = Annotated[tuple[NackItem, ...], Length(1, MAX_ITEMS_PER_FRAME), Member("events")]


@dataclass(frozen=True, slots=True)
class Nack:
    """Give events back: due again after their delay (or the back-off), or dead-lettered at the last attempt."""

    TYPE: ClassVar[str] = "nack"
    items: NackItems
    ref: ClientRef = None

    def to_json(self) -> str:
        return _with_ref({"type": "nack", "events": [it.to_dict() for it in self.items]}, self.ref)


@dataclass(frozen=True, slots=True)
class ExtendItem:
    id: EventId
    attempt: Attempt
    #: the new ack deadline is now + seconds (by the database clock)
    seconds: Annotated[float, Range(0, MAX_EXTEND_SECONDS)]


ExtendItems = Annotated[tuple[ExtendItem, ...], Length(1, MAX_ITEMS_PER_FRAME), Member("events")]


@dataclass(frozen=True, slots=True)
class Extend:
    """Move events' ack deadlines."""

    TYPE: ClassVar[str] = "extend"
    items: ExtendItems
    ref: ClientRef = None

    def to_json(self) -> str:
        events = [{"id": it.id, "attempt": it.attempt, "seconds": it.seconds} for it in self.items]
        return _with_ref({"type": "extend", "events": events}, self.ref)


@dataclass(frozen=True, slots=True)
class Ping:
    """An application-level round trip; the ``pong`` carries the database clock."""

    TYPE: ClassVar[str] = "ping"
    ref: ClientRef = None

    def to_json(self) -> str:
        return _with_ref({"type": "ping"}, self.ref)


ClientFrame = Subscribe | Credit | Ack | Nack | Extend | Ping
Frame = ClientFrame
CLIENT_FRAMES: tuple[type[ClientFrame], ...] = (Subscribe, Credit, Ack, Nack, Extend, Ping)


def _with_ref(body: dict[str, Any], ref: Any) -> str:
    if ref is not None:
        body["ref"] = ref
    return dumps(body)


# ---------------------------------------------------------------------- server frames


class Limits(TypedDict):
    """The limits a client can run into (docs/protocol.md, "Limits")."""

    max_frame_bytes: int
    max_items_per_frame: int
    max_credit: int
    max_events_per_deliver: int
    max_tenants_per_subscription: int
    max_error_text: int
    max_ref_length: int
    max_extend_seconds: float
    max_error_messages: int


def limits(max_events_per_deliver: int) -> Limits:
    """This version's limits, with the manager's configured events per deliver."""
    return {
        "max_frame_bytes": MAX_FRAME_BYTES,
        "max_items_per_frame": MAX_ITEMS_PER_FRAME,
        "max_credit": MAX_CREDIT,
        "max_events_per_deliver": max_events_per_deliver,
        "max_tenants_per_subscription": MAX_TENANTS_PER_SUBSCRIPTION,
        "max_error_text": MAX_ERROR_TEXT,
        "max_ref_length": MAX_REF_LENGTH,
        "max_extend_seconds": MAX_EXTEND_SECONDS,
        "max_error_messages": MAX_ERROR_MESSAGES,
    }


class DeliveredEvent(TypedDict):
    """One event of a ``deliver`` (kept as the decoded JSON object: the receiver makes its own event of it)."""

    id: EventId
    attempt: Attempt
    tenant: Tenant
    partition: Annotated[int, Range(0)]
    fire_at: Epoch
    payload: Annotated[Any, Doc("any JSON value, as the database's jsonb stores it")]
    priority: NotRequired[Annotated[int, Range(1, 5), Doc("1 the highest; a manager of before priorities sends none")]]
    traceparent: NotRequired[Annotated[str, Pattern("^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")]]
    tracestate: NotRequired[Annotated[str, Length(0, 512)]]
    baggage: NotRequired[Annotated[str, Length(0, 8192)]]


class ItemError(TypedDict):
    """An item of an ack, nack or extend that was not applied; past MAX_ERROR_MESSAGES errors of one
    result frame, without its message."""

    id: EventId
    attempt: Attempt
    code: ItemCode
    message: NotRequired[str]


class Extended(TypedDict):
    id: EventId
    ack_deadline: Epoch


@dataclass(frozen=True, slots=True)
class Welcome:
    """The first frame on every connection."""

    TYPE: ClassVar[str] = "welcome"
    protocol: Literal["qm.v1"]
    #: the shard's name (null only from a manager that does not know it yet)
    shard: str | None
    #: the leadership term: it grows at every change of active manager (null only when the manager
    #: lost its term in the instant the connection opened: the connection is closed at once)
    term: int | None
    #: identifies the manager process
    manager: str
    limits: Limits

    def to_json(self) -> str:
        body = {
            "type": "welcome",
            "protocol": self.protocol,
            "shard": self.shard,
            "term": self.term,
            "manager": self.manager,
            "limits": self.limits,
        }
        return dumps(body)


@dataclass(frozen=True, slots=True)
class Subscribed:
    TYPE: ClassVar[str] = "subscribed"
    queue: QueueName
    #: the effective tenant filter, sorted; None: every tenant
    tenants: Tenants | None
    credit: CreditValue
    ref: ServerRef = None
    #: the features asked for that this manager grants (absent when none was asked for)
    features: Annotated[Features | None, Member(omit_none=True)] = None

    def to_json(self) -> str:
        tenants = None if self.tenants is None else list(self.tenants)
        body: dict[str, Any] = {"type": "subscribed", "queue": self.queue, "tenants": tenants, "credit": self.credit}
        if self.features is not None:
            body["features"] = list(self.features)
        return _with_ref(body, self.ref)


@dataclass(frozen=True, slots=True)
class CreditSet:
    TYPE: ClassVar[str] = "credit_set"
    credit: CreditValue
    ref: ServerRef = None

    def to_json(self) -> str:
        return _with_ref({"type": "credit_set", "credit": self.credit}, self.ref)


@dataclass(frozen=True, slots=True)
class Deliver:
    """Events for the connection; the manager builds this frame with :func:`deliver_frame`."""

    TYPE: ClassVar[str] = "deliver"
    queue: QueueName
    events: Annotated[list[DeliveredEvent], Length(1)]

    def to_json(self) -> str:
        return dumps({"type": "deliver", "queue": self.queue, "events": self.events})


def _errors(errors: Sequence[ItemError]) -> list[ItemError]:
    """Only the first MAX_ERROR_MESSAGES errors keep their message: 10 000 errors with messages
    made a 1.4 MB frame, over the 1 MiB most clients accept, and the client was closed."""
    if len(errors) <= MAX_ERROR_MESSAGES:
        return list(errors)
    later: list[ItemError] = [
        {"id": e["id"], "attempt": e["attempt"], "code": e["code"]} for e in errors[MAX_ERROR_MESSAGES:]
    ]
    return [*errors[:MAX_ERROR_MESSAGES], *later]


@dataclass(frozen=True, slots=True)
class AckResult:
    """Every item of the ack is in ``acked`` (committed) or in ``errors``."""

    TYPE: ClassVar[str] = "ack_result"
    acked: list[EventId]
    errors: list[ItemError] = field(default_factory=list)
    ref: ServerRef = None

    def to_json(self) -> str:
        return _with_ref({"type": "ack_result", "acked": self.acked, "errors": _errors(self.errors)}, self.ref)


@dataclass(frozen=True, slots=True)
class NackResult:
    """``requeued``: due again; ``failed``: dead-lettered (the last attempt); ``errors``: not applied."""

    TYPE: ClassVar[str] = "nack_result"
    requeued: list[EventId]
    failed: list[EventId]
    errors: list[ItemError] = field(default_factory=list)
    ref: ServerRef = None

    def to_json(self) -> str:
        body = {"type": "nack_result", "requeued": self.requeued, "failed": self.failed, "errors": _errors(self.errors)}
        return _with_ref(body, self.ref)


@dataclass(frozen=True, slots=True)
class ExtendResult:
    TYPE: ClassVar[str] = "extend_result"
    extended: list[Extended]
    errors: list[ItemError] = field(default_factory=list)
    ref: ServerRef = None

    def to_json(self) -> str:
        return _with_ref({"type": "extend_result", "extended": self.extended, "errors": _errors(self.errors)}, self.ref)


@dataclass(frozen=True, slots=True)
class Pong:
    TYPE: ClassVar[str] = "pong"
    #: the manager's estimate of the database clock
    time: Epoch
    ref: ServerRef = None

    def to_json(self) -> str:
        return _with_ref({"type": "pong", "time": self.time}, self.ref)


@dataclass(frozen=True, slots=True)
class Error:
    """A client frame was refused as a whole, or an unsolicited notice (``unknown_queue``)."""

    TYPE: ClassVar[str] = "error"
    code: ErrorCode
    message: str
    ref: ServerRef = None

    def to_json(self) -> str:
        return _with_ref({"type": "error", "code": self.code, "message": self.message}, self.ref)


@dataclass(frozen=True, slots=True)
class Cancel:
    """Deliveries of this connection an operator cancelled: stop their handlers and send nothing
    for them (an ack, nack or extend of one is refused with ``cancelled``). Sent only on a
    connection whose subscribe asked for the feature ``cancel``."""

    TYPE: ClassVar[str] = "cancel"
    queue: QueueName
    events: Annotated[list[IdAttemptObject], Length(1)]

    def to_json(self) -> str:
        return dumps({"type": "cancel", "queue": self.queue, "events": self.events})


ServerFrame = Welcome | Subscribed | CreditSet | Deliver | AckResult | NackResult | ExtendResult | Pong | Error | Cancel
SERVER_FRAMES: tuple[type[ServerFrame], ...] = (
    Welcome,
    Subscribed,
    CreditSet,
    Deliver,
    AckResult,
    NackResult,
    ExtendResult,
    Pong,
    Error,
    Cancel,
)


class ServerFrameError(ValueError):
    """A server frame this client cannot read (not JSON, not an object, a member missing or mistyped)."""


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"expected a list, got {type(value).__name__}")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def _integer(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def _tenants_of(value: Any) -> tuple[str, ...] | None:
    return None if value is None else tuple(_list(value))


_SERVER_PARSERS: dict[Any, Any] = {
    "deliver": lambda o: Deliver(_str(o["queue"]), _list(o["events"])),
    "ack_result": lambda o: AckResult(_list(o["acked"]), _list(o.get("errors", [])), o.get("ref")),
    "nack_result": lambda o: NackResult(
        _list(o["requeued"]), _list(o["failed"]), _list(o.get("errors", [])), o.get("ref")
    ),
    "extend_result": lambda o: ExtendResult(_list(o["extended"]), _list(o.get("errors", [])), o.get("ref")),
    "credit_set": lambda o: CreditSet(_integer(o["credit"]), o.get("ref")),
    "pong": lambda o: Pong(o["time"], o.get("ref")),
    "error": lambda o: Error(_str(o["code"]), str(o.get("message", "")), o.get("ref")),
    "subscribed": lambda o: Subscribed(
        _str(o["queue"]),
        _tenants_of(o.get("tenants")),
        _integer(o["credit"]),
        o.get("ref"),
        _tenants_of(o.get("features")),
    ),
    "cancel": lambda o: Cancel(_str(o["queue"]), _list(o["events"])),
    "welcome": lambda o: Welcome(
        o["protocol"], o["shard"], None if o["term"] is None else _integer(o["term"]), _str(o["manager"]), o["limits"]
    ),
}


def parse_server(message: str | bytes) -> ServerFrame | None:
    """Parse one server frame; None for a frame type this version does not know (to be ignored).

    Members the frame does not define are ignored; a deliver's events and a result's items stay the
    decoded JSON objects (typed by :class:`DeliveredEvent`, :class:`ItemError`, :class:`Extended`)."""
    try:
        obj = loads(message)
    except ValueError as exc:
        raise ServerFrameError(f"a server frame is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ServerFrameError(f"a server frame is not a JSON object: {str(obj)[:200]}")
    build = _SERVER_PARSERS.get(obj.get("type"))
    if build is None:
        return None
    try:
        frame: ServerFrame = build(obj)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ServerFrameError(f"unreadable {obj.get('type')!r} frame: {exc!r}") from None
    return frame


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
        obj = loads(text)
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
        features = obj.get("features")
        if features is not None:
            if (
                not isinstance(features, list)
                or len(features) > MAX_FEATURES
                or not all(isinstance(x, str) and 0 < len(x) <= 40 for x in features)
            ):
                raise FrameError(BAD_FRAME, f"'features' must be a list of at most {MAX_FEATURES} names, or null", ref)
            features = tuple(features)
        return Subscribe(queue, tenants, credit, ref, features)
    if kind == "ping":
        return Ping(ref)
    if isinstance(kind, str):
        raise FrameError(UNKNOWN_TYPE, f"unknown frame type {kind[:40]!r}", ref)
    raise FrameError(BAD_FRAME, "a frame must be a JSON object with a 'type'", ref)


def loads(text: str | bytes) -> Any:
    """A frame's JSON: orjson's parse (four times the standard library's speed on a deliver frame),
    and where orjson refuses the text (integers past 64 bits, NaN, lone surrogates, nesting past
    1 024 levels, text that is not JSON), the standard library's, so that what a frame may hold and
    the error it gets stay the same."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text)


def dumps(obj: dict[str, Any]) -> str:
    """A frame's JSON text, compact, UTF-8 characters as they are (orjson: the same values as the
    standard library's ``separators=(",", ":"), ensure_ascii=False``, a float's exponent perhaps
    written shorter, ``1e-7`` for ``1e-07``)."""
    try:
        return orjson.dumps(obj).decode()
    except TypeError:  # what orjson does not write (an integer past 64 bits): as before
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def item_error(ident: int, attempt: int, code: str, message: str) -> ItemError:
    """A per-item error of an ack, nack or extend result."""
    return {"id": ident, "attempt": attempt, "code": code, "message": message}


def event(
    ident: int,
    attempt: int,
    tenant: str,
    partition: int,
    fire_at: float,
    payload_json: str,
    priority: int = 3,
    traceparent: str | None = None,
    tracestate: str | None = None,
    baggage: str | None = None,
) -> dict[str, Any]:
    """One delivered event, for :func:`deliver_frames`: the payload is spliced in as the JSON text
    the database stored (not parsed), then its trace context's members, each only when set.
    ``priority``: the event's (1 highest, docs/protocol.md, "deliver")."""
    ev = {
        "id": ident,
        "attempt": attempt,
        "tenant": tenant,
        "partition": partition,
        "fire_at": fire_at,
        "priority": priority,
        "payload": orjson.Fragment(payload_json),
    }
    if traceparent is not None:
        ev["traceparent"] = traceparent
    if tracestate is not None:
        ev["tracestate"] = tracestate
    if baggage is not None:
        ev["baggage"] = baggage
    return ev


def deliver_frames(queue: str, events: list[dict[str, Any]], per_frame: int) -> list[str]:
    """The deliver frames of ``events`` (from :func:`event`), in order: at most ``per_frame`` events
    and :data:`MAX_FRAME_BYTES` bytes each (an event larger than that alone in its frame). One
    orjson call writes a frame of events: the manager's hot path."""
    out: list[str] = []
    for i in range(0, len(events), per_frame):
        _deliver_chunk(queue, events[i : i + per_frame], out)
    return out


def _deliver_chunk(queue: str, events: list[dict[str, Any]], out: list[str]) -> None:
    text = orjson.dumps({"type": "deliver", "queue": queue, "events": events})
    if len(text) > MAX_FRAME_BYTES and len(events) > 1:
        half = len(events) // 2
        _deliver_chunk(queue, events[:half], out)
        _deliver_chunk(queue, events[half:], out)
        return
    out.append(text.decode())
