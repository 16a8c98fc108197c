"""The server side of one receiver connection, sans I/O: frames in, actions out.

:class:`ReceiverSession` holds the state of one websocket connection of protocol ``qm.v1``:
its subscription, its credit and its claims on the queue's :class:`~queue_manager.wire.ledger.Ledger`.
It never touches a socket, a database or the event loop. The calling contract, as in the
websockets library's protocol core:

- :meth:`ReceiverSession.receive` takes one client message and returns actions;
- for a :class:`Resolve`, the caller looks the queue up and calls :meth:`ReceiverSession.subscribed`
  or :meth:`ReceiverSession.subscribe_failed`;
- for a :class:`Write`, the caller has the database do it and calls :meth:`ReceiverSession.settled`
  with the result, or :meth:`ReceiverSession.write_failed`;
- :meth:`ReceiverSession.timed_out` tells it the collector took back an event it held, past its
  ack deadline: the connection falls silent (it is sent nothing) and a :class:`Probe` asks for a
  websocket ping, whose pong the caller reports with :meth:`ReceiverSession.answered`;
- :meth:`ReceiverSession.closed` tells it the connection is gone: its events in hand come back as
  a :class:`Release`.

Actions are: :class:`Send` (a frame for this connection), :class:`Resolve`, :class:`Write`,
:class:`Release`, :class:`Probe` and :class:`Wake` (the dispatcher should look again: credit
freed, events requeued, a new subscriber, a silent connection back).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from queue_manager.wire import frames as f
from queue_manager.wire.ledger import Claim, Ledger

CANCELLED = f.CANCELLED


class Scope(Protocol):
    """What a token allows (``queue_manager.manager.auth.Grant``)."""

    @property
    def name(self) -> str: ...

    def allows_queue(self, queue: str) -> bool: ...

    def allowed_tenants(self, requested: Iterable[str] | None) -> frozenset[str] | None: ...


class SessionMetrics(Protocol):
    """The counters a session moves (in memory; rendered elsewhere)."""

    def frame_refused(self, code: str) -> None: ...

    def acked(self, queue: str, count: int, latencies: list[float]) -> None: ...

    def nacked(self, queue: str, requeued: int, failed: int) -> None: ...


class WriteKind(Enum):
    """The database writes a receiver's frames cause."""

    ACK = "ack"
    #: a nack: back to to_be_fired after a delay, or dead-lettered at max attempts
    RELEASE = "release"
    EXTEND = "extend"


class Wake(Enum):
    """Why the dispatcher should look again."""

    CREDIT = "credit"
    SETTLED = "settled"
    REQUEUED = "requeued"
    SUBSCRIBED = "subscribed"
    #: a silent connection showed life: its free credit counts again
    ALIVE = "alive"


@dataclass(slots=True)
class Send:
    text: str


@dataclass(slots=True)
class Resolve:
    """Find the queue the connection subscribes to (it may have been created a moment ago)."""

    queue: str
    tenants: frozenset[str] | None
    credit: int | None
    ref: Any
    #: the optional features the subscribe asked for (None: it named none)
    features: tuple[str, ...] | None = None


@dataclass(slots=True)
class Write:
    """A batch of one frame's valid items for the database; ``errors`` holds the items refused
    before it (they are reported with the result)."""

    kind: WriteKind
    items: list[Any]
    ref: Any
    errors: list[f.ItemError] = field(default_factory=list)


#: an event to put back: (id, attempt, delay in seconds or None for the back-off, error text)
ReleaseItem = tuple[int, int, float | None, str | None]


@dataclass(slots=True)
class Release:
    """Put these events back: their holder went away."""

    items: list[ReleaseItem]


@dataclass(slots=True)
class Probe:
    """Ping the connection (a websocket ping) and call :meth:`ReceiverSession.answered` when
    its pong comes: it let an event pass its ack deadline, is it still there?"""


@dataclass(slots=True)
class WakeUp:
    reason: Wake
    #: events due from this database time on may have appeared (a nack's release)
    since: float | None = None


Action = Send | Resolve | Write | Release | Probe | WakeUp

_NOT_HERE = "not in flight on this connection (never delivered here, already settled, or re-fired)"
_CANCELLED = "an operator cancelled this event (it is cancelled, and never fired again): drop it"
#: the cancelled deliveries a connection remembers, to refuse their acks with their own code
MAX_CANCELLED = 10_000


class ReceiverSession:
    """The state machine of one receiver connection."""

    def __init__(self, conn_id: int, scope: Scope, *, db_time: Callable[[], float], metrics: SessionMetrics) -> None:
        self.id = conn_id
        self.scope = scope
        self._db_time = db_time
        self._metrics = metrics
        self.queue: str | None = None
        self.ledger: Ledger | None = None
        self.tenants: frozenset[str] | None = None
        self.credit = 0
        self.subscribing = False
        #: set by the manager when it drains: new subscriptions are refused
        self.draining = False
        #: an event it held passed its ack deadline, and it has shown no life since (no frame, no
        #: pong): it is sent nothing, and the events taken back from it go to others
        self.silent = False
        #: an event it held passed its ack deadline, and it has settled nothing since (no ack, nack
        #: or extend): alive, perhaps, but not working through what it is sent, so the dispatcher
        #: gives it events only when no other subscriber with credit takes them
        self.lapsed = False
        #: deliveries of this connection an operator cancelled: (id -> attempt), the oldest first out
        self._cancelled: dict[int, int] = {}
        #: its subscribe asked for the feature "cancel": it is sent cancel frames
        self.cancel_frames = False

    @property
    def free(self) -> int:
        """Events this connection may be sent now (none while it is silent): its credit less its
        events in hand, of which those with an ack or nack on its way count as free, up to the
        credit. Their handlers are done, so the next events go out while the writes commit (the
        fire beside the ack's commit, not after it); the cap keeps what the connection holds
        unsettled, and so what a manager crash sends again, within twice its credit."""
        if self.ledger is None or self.silent:
            return 0
        return self.credit - self.ledger.held_by(self.id) + min(self.ledger.settling_by(self.id), self.credit)

    # ------------------------------------------------------------------ frames in

    def receive(self, message: str | bytes, now: float) -> list[Action]:
        """One client message; ``now`` is monotonic seconds. Any message, even one refused, shows
        that the client is there."""
        alive = self._heard()
        try:
            frame = f.parse(message)
            return self._handle(frame, now) + alive
        except f.FrameError as err:
            self._metrics.frame_refused(err.code)
            return [Send(f.Error(err.code, err.message, err.ref).to_json()), *alive]

    def _handle(self, frame: f.Frame, now: float) -> list[Action]:
        if isinstance(frame, f.Ping):
            return [Send(f.Pong(self._db_time(), frame.ref).to_json())]
        if isinstance(frame, f.Subscribe):
            return self._subscribe(frame)
        if isinstance(frame, f.Credit):
            if self.queue is None and not self.subscribing:
                raise f.FrameError(f.NOT_SUBSCRIBED, "subscribe to a queue before granting credit", frame.ref)
            self.credit = frame.credit
            return [Send(f.CreditSet(self.credit, frame.ref).to_json()), WakeUp(Wake.CREDIT)]
        if self.ledger is None:
            raise f.FrameError(f.NOT_SUBSCRIBED, "subscribe to a queue first", frame.ref)
        self.lapsed = False  # an ack, nack or extend, even a refused one: it works through its events
        if isinstance(frame, f.Ack):
            return self._ack(self.ledger, frame)
        if isinstance(frame, f.Nack):
            return self._nack(self.ledger, frame)
        if isinstance(frame, f.Extend):
            return self._extend(self.ledger, frame)
        raise AssertionError(frame)  # pragma: no cover

    def _subscribe(self, frame: f.Subscribe) -> list[Action]:
        if self.queue is not None or self.subscribing:
            name = repr(self.queue) if self.queue is not None else "a queue"
            raise f.FrameError(
                f.ALREADY_SUBSCRIBED,
                f"this connection is subscribed to {name}; open another connection for another queue",
                frame.ref,
            )
        if self.draining:
            raise f.FrameError(f.DRAINING, "this manager is draining; connect to another one", frame.ref)
        if not self.scope.allows_queue(frame.queue):
            raise f.FrameError(f.FORBIDDEN, f"token {self.scope.name!r} may not read queue {frame.queue!r}", frame.ref)
        try:
            tenants = self.scope.allowed_tenants(frame.tenants)
        except PermissionError as exc:
            raise f.FrameError(f.FORBIDDEN, str(exc), frame.ref) from None
        self.subscribing = True
        return [Resolve(frame.queue, tenants, frame.credit, frame.ref, frame.features)]

    def subscribed(self, resolve: Resolve, ledger: Ledger) -> list[Action]:
        """The queue of ``resolve`` exists: the connection now receives its events."""
        self.subscribing = False
        self.queue = resolve.queue
        self.ledger = ledger
        self.tenants = resolve.tenants
        if resolve.credit is not None:
            self.credit = resolve.credit
        tenants = None if resolve.tenants is None else tuple(sorted(resolve.tenants))
        granted = None
        if resolve.features is not None:  # version negotiation: the features both sides know
            granted = tuple(x for x in f.FEATURES if x in resolve.features)
            self.cancel_frames = f.Cancel.TYPE in granted
        frame = f.Subscribed(resolve.queue, tenants, self.credit, resolve.ref, granted)
        return [Send(frame.to_json()), WakeUp(Wake.SUBSCRIBED)]

    def subscribe_failed(self, resolve: Resolve, code: str, message: str) -> list[Action]:
        self.subscribing = False
        self._metrics.frame_refused(code)
        return [Send(f.Error(code, message, resolve.ref).to_json())]

    def _claims(self, ledger: Ledger, items: list[tuple[int, int]], errors: list[f.ItemError]) -> list[int]:
        """Claim each item on the ledger; returns the indexes of those refused (their errors in
        ``errors``)."""
        refused = ledger.claim_many(self.id, items)
        for i, found, d in refused:
            ident, attempt = items[i]
            if found is Claim.UNKNOWN and self._cancelled.get(ident) == attempt:
                errors.append(f.item_error(ident, attempt, CANCELLED, _CANCELLED))
            elif found is Claim.UNKNOWN:
                errors.append(f.item_error(ident, attempt, f.UNKNOWN_ID, _NOT_HERE))
            elif found is Claim.STALE:
                assert d is not None
                errors.append(
                    f.item_error(
                        ident, attempt, f.STALE, f"attempt {attempt} is not the current delivery (attempt {d.attempt})"
                    )
                )
            else:
                errors.append(
                    f.item_error(ident, attempt, f.DUPLICATE, "an ack or nack for this event is already in progress")
                )
        return [i for i, _, _ in refused]

    def _ack(self, ledger: Ledger, frame: f.Ack) -> list[Action]:
        errors: list[f.ItemError] = []
        items = list(frame.items)
        refused = self._claims(ledger, items, errors)
        if refused:
            bad = set(refused)
            valid = [it for i, it in enumerate(items) if i not in bad]
        else:
            valid = items
        if not valid:
            return [Send(f.AckResult([], errors, frame.ref).to_json())]
        # the claimed events' slots are free again (see free): fill them while the ack commits
        return [Write(WriteKind.ACK, valid, frame.ref, errors), WakeUp(Wake.CREDIT)]

    def _nack(self, ledger: Ledger, frame: f.Nack) -> list[Action]:
        errors: list[f.ItemError] = []
        bad = set(self._claims(ledger, [(it.id, it.attempt) for it in frame.items], errors))
        valid = [
            (it.id, it.attempt, it.delay, it.error or "nacked by the receiver")
            for i, it in enumerate(frame.items)
            if i not in bad
        ]
        if not valid:
            return [Send(f.NackResult([], [], errors, frame.ref).to_json())]
        return [Write(WriteKind.RELEASE, valid, frame.ref, errors), WakeUp(Wake.CREDIT)]

    def _extend(self, ledger: Ledger, frame: f.Extend) -> list[Action]:
        errors: list[f.ItemError] = []
        valid = []
        for it in frame.items:
            found, _ = ledger.lookup(self.id, it.id, it.attempt)
            if found is Claim.OK:
                valid.append((it.id, it.attempt, it.seconds))
            elif found is Claim.UNKNOWN and self._cancelled.get(it.id) == it.attempt:
                errors.append(f.item_error(it.id, it.attempt, CANCELLED, _CANCELLED))
            elif found is Claim.UNKNOWN:
                errors.append(f.item_error(it.id, it.attempt, f.UNKNOWN_ID, "not in flight on this connection"))
            else:
                errors.append(
                    f.item_error(it.id, it.attempt, f.STALE, f"attempt {it.attempt} is not the current delivery")
                )
        if not valid:
            return [Send(f.ExtendResult([], errors, frame.ref).to_json())]
        return [Write(WriteKind.EXTEND, valid, frame.ref, errors)]

    # ------------------------------------------------------------------ the database answered

    def settled(self, op: Write, result: Any, now: float) -> list[Action]:
        """The database committed ``op``; ``result`` is what the writer returned for its kind."""
        ledger = self.ledger
        assert ledger is not None and self.queue is not None
        errors = op.errors
        if op.kind is WriteKind.ACK:
            done: set[int] = result
            acked = [ident for ident, _ in op.items]
            if done.issuperset(acked):  # every item acked (the common case: one pass in C)
                latencies = [now - d.pushed_at for d in ledger.settle_many(op.items)]
                self._metrics.acked(self.queue, len(acked), latencies)
                return [Send(f.AckResult(acked, errors, op.ref).to_json()), WakeUp(Wake.SETTLED)]
            acked = []
            latencies = []
            for ident, attempt in op.items:
                d = ledger.settle(ident, attempt)
                if ident in done:
                    acked.append(ident)
                    if d is not None:
                        latencies.append(now - d.pushed_at)
                elif self._cancelled.get(ident) == attempt:
                    errors.append(f.item_error(ident, attempt, CANCELLED, _CANCELLED))
                else:
                    errors.append(
                        f.item_error(
                            ident,
                            attempt,
                            f.STALE,
                            "the event is no longer fired at this attempt (re-fired after its deadline?)",
                        )
                    )
            if acked:
                self._metrics.acked(self.queue, len(acked), latencies)
            return [Send(f.AckResult(acked, errors, op.ref).to_json()), WakeUp(Wake.SETTLED)]
        if op.kind is WriteKind.RELEASE:
            moved, dead, released_at = result
            requeued: list[int] = []
            failed: list[int] = []
            for ident, attempt, _, _ in op.items:
                ledger.settle(ident, attempt)
                if ident in dead:
                    failed.append(ident)
                elif ident in moved:
                    requeued.append(ident)
                else:
                    errors.append(f.item_error(ident, attempt, f.STALE, "the event is no longer fired at this attempt"))
            self._metrics.nacked(self.queue, len(requeued), len(failed))
            frame = f.NackResult(requeued, failed, errors, op.ref)
            return [Send(frame.to_json()), WakeUp(Wake.REQUEUED, released_at)]
        deadlines: dict[int, float] = result
        extended: list[f.Extended] = []
        for ident, attempt, _ in op.items:
            if ident in deadlines:
                extended.append({"id": ident, "ack_deadline": deadlines[ident]})
            else:
                errors.append(f.item_error(ident, attempt, f.STALE, "the event is no longer fired at this attempt"))
        return [Send(f.ExtendResult(extended, errors, op.ref).to_json())]

    def write_failed(self, op: Write, reason: str) -> list[Action]:
        """``op`` was not recorded (database unreachable, term lost): the items may be retried."""
        ledger = self.ledger
        errors = op.errors
        for item in op.items:
            ident, attempt = item[0], item[1]
            if op.kind is not WriteKind.EXTEND and ledger is not None:
                ledger.unclaim(ident, attempt)
            errors.append(f.item_error(ident, attempt, f.UNAVAILABLE, f"not recorded, retry: {reason}"))
        if op.kind is WriteKind.ACK:
            return [Send(f.AckResult([], errors, op.ref).to_json())]
        if op.kind is WriteKind.RELEASE:
            return [Send(f.NackResult([], [], errors, op.ref).to_json())]
        return [Send(f.ExtendResult([], errors, op.ref).to_json())]

    # ------------------------------------------------------------------ an operator cancelled an event

    def cancelled(self, ident: int, attempt: int) -> list[Action]:
        """An operator cancelled (ident, attempt) while this connection held it (its state is
        ``cancelled`` in the table): it leaves the ledger (its slot is free), a client that asked
        for the feature is sent a ``cancel`` frame (its handler stops), and an ack, nack or extend
        of it from now on is refused with the code ``cancelled`` (an old client learns it so)."""
        ledger = self.ledger
        if ledger is None or self.queue is None or ledger.drop(ident, attempt) is None:
            return []
        self._cancelled[ident] = attempt
        if len(self._cancelled) > MAX_CANCELLED:
            del self._cancelled[next(iter(self._cancelled))]
        out: list[Action] = [WakeUp(Wake.CREDIT)]
        if self.cancel_frames:
            out.insert(0, Send(f.Cancel(self.queue, [{"id": ident, "attempt": attempt}]).to_json()))
        return out

    # ------------------------------------------------------------------ a silent connection

    def timed_out(self) -> list[Action]:
        """The collector took back an event this connection held, past its ack deadline. A client
        that is alive acks, nacks or extends in time; one that does not may be frozen (a stopped
        process, a blocked event loop) with its socket still open, and its credit would draw every
        event, the re-fired ones first, into it. So it is sent nothing until it shows life: a frame,
        or the pong to the ping asked for here (once per silence)."""
        self.lapsed = True
        if self.silent:
            return []
        self.silent = True
        return [Probe()]

    def answered(self) -> list[Action]:
        """The pong to a :class:`Probe`'s ping came: the client reads its socket again."""
        return self._heard()

    def _heard(self) -> list[Action]:
        if not self.silent:
            return []
        self.silent = False
        return [WakeUp(Wake.ALIVE)]

    # ------------------------------------------------------------------ the connection ends

    def closed(self) -> list[Action]:
        """The connection is gone: its events in hand, other than those being settled, go back."""
        if self.ledger is None:
            return []
        released = self.ledger.release_holder(self.id)
        if not released:
            return []
        return [Release([(d.id, d.attempt, 0.0, "receiver disconnected before acking") for d in released])]
