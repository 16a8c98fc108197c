"""The receiver side of one shard's connections, sans I/O: frames in, frames and effects out.

:class:`ClientSession` mirrors the manager's :class:`~queue_manager.wire.session.ReceiverSession`:
it holds what protocol ``qm.v1`` (docs/protocol.md) asks a receiver to remember, and never touches
a socket, a clock or the event loop. One session lives as long as the receiver's link to a shard,
across its connections, because the handler slots do (:class:`~queue_manager.wire.credit.CreditBook`).
The calling contract:

- :meth:`ClientSession.connected` when a connection opens; the first frame the manager sends is
  ``welcome``, which :meth:`ClientSession.receive` answers with the ``subscribe``;
- :meth:`ClientSession.receive` takes each server message and returns effects;
- :meth:`ClientSession.completed` reports what a handler's run asks for (ack, nack, or nothing
  when the application settled the event by SQL) and :meth:`ClientSession.slot_freed` that its
  slot is free (the two differ for a thread that keeps running after its timeout);
- :meth:`ClientSession.extend` asks for a longer ack deadline, :meth:`ClientSession.drain` for
  credit 0 (the stop);
- :meth:`ClientSession.frames` returns the frames to send now, batched: a changed credit first,
  then acks, nacks and extends, each frame with a ``ref`` the reply is matched by;
- :meth:`ClientSession.connection_lost` forgets what the connection held (the manager re-fires it).

Effects are: :class:`Send` (a frame), :class:`Start` (run the handler on an event now: a slot is
free), :class:`Subscribed`, :class:`RetryLater` (call :meth:`~ClientSession.frames` again after a
pause: the manager could not write some items for a moment), :class:`Refused` (the subscribe
was refused; ``fatal`` when retrying cannot help) and :class:`Cancelled` (an operator cancelled a
delivery in hand: stop its handler; nothing is sent for it). A session made ``cancellable`` asks
for the feature ``cancel`` in its subscribe; a manager that grants it sends ``cancel`` frames. A
server frame this client cannot read raises :class:`ServerFrameError`: the connection should be
dropped and opened again.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from queue_manager.wire import frames as f
from queue_manager.wire.credit import CreditBook
from queue_manager.wire.frames import ServerFrameError

__all__ = ["ACK", "SETTLED", "Cancelled", "ClientSession", "Effect", "Outcome", "ServerFrameError"]

logger = logging.getLogger("receivers")

#: the ``ref`` of the subscribe frame (the other refs are integers)
SUBSCRIBE_REF = "subscribe"
#: seconds before items the manager answered ``unavailable`` are sent again
RETRY_AFTER = 0.1


class Delivered(Protocol):
    """What the session needs of an event it was delivered (the library's ``Event``)."""

    @property
    def id(self) -> int: ...

    @property
    def attempt(self) -> int: ...


E = TypeVar("E", bound=Delivered)


class ClientStats(Protocol):
    """The counters a session moves (``receivers.ReceiverStats``, shared by every shard)."""

    delivered: int
    acked: int
    nacked: int
    dead_lettered: int
    settled_by_sql: int
    extended: int
    dropped: int
    connects: int
    #: the last error frames and per-item errors
    errors: deque[dict[str, Any]]


@dataclass(slots=True)
class Send:
    text: str


@dataclass(slots=True)
class Start(Generic[E]):
    """Run the handler on ``event``: its slot is taken (report with :meth:`ClientSession.completed`
    and :meth:`ClientSession.slot_freed`, giving ``gen``)."""

    event: E
    #: the connection it came on (:attr:`ClientSession.gen`)
    gen: int


@dataclass(slots=True)
class Subscribed:
    queue: str
    term: int | None


@dataclass(slots=True)
class RetryLater:
    seconds: float


@dataclass(slots=True)
class Refused:
    """The manager refused the subscription: ``forbidden`` is fatal (the token does not allow it);
    ``unknown_queue`` or ``draining`` may pass: reconnect after a back-off."""

    code: str
    message: str
    fatal: bool


@dataclass(slots=True)
class Cancelled:
    """An operator cancelled this delivery of the connection ``gen``: stop its handler (an asyncio
    task is cancelled; a thread sees the event's flag); it is no longer in hand, and nothing is sent
    for it (its result, if the handler still returns one, is dropped)."""

    id: int
    attempt: int
    gen: int


Effect = Send | Start[E] | Subscribed | RetryLater | Refused | Cancelled
#: a frame sent whose reply has not come yet
Outstanding = f.Ack | f.Nack | f.Extend | f.Credit


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a handler's run asks for."""

    kind: str  # "ack", "nack" or "settled" (the application acked it by SQL: nothing is sent)
    delay: float | None = None
    error: str | None = None


ACK = Outcome("ack")
SETTLED = Outcome("settled")


class ClientSession(Generic[E]):
    """The state of one shard's link: the connection's subscription, its events in hand, the
    handler slots, the acks, nacks and extends on their way and the replies still awaited."""

    def __init__(
        self,
        shard: str,
        queue: str,
        *,
        slots: int,
        make_event: Callable[[str, Mapping[str, Any]], E],
        stats: ClientStats,
        tenants: Sequence[str] | None = None,
        cancellable: bool = False,
    ) -> None:
        #: the shard's name (the receiver's, the key of its managers' URLs)
        self.shard = shard
        self.queue = queue
        self.tenants = list(tenants) if tenants is not None else None
        self.book = CreditBook(slots)
        self._make_event = make_event
        self.stats = stats
        #: the connection's number: 1 for the first, +1 at each (results of older ones are dropped)
        self.gen = 0
        self.open = False
        self.welcomed = False
        self.subscribed = False
        #: the leadership term the current connection's welcome named
        self.term: int | None = None
        #: the credit last sent on this connection (None before the subscribe)
        self.last_credit: int | None = None
        #: events in hand that wait for a handler slot
        self.waiting: deque[E] = deque()
        self.acks: list[tuple[int, int]] = []
        self.nacks: list[f.NackItem] = []
        #: id -> (attempt, seconds) of the extensions to ask for
        self.extends: dict[int, tuple[int, float]] = {}
        #: ref -> the frame (ack, nack, extend or credit) whose reply has not come yet
        self.outstanding: dict[int, Outstanding] = {}
        self._next_ref = 0
        self._retry = False
        #: the adapter can stop a running handler: ask for the feature "cancel" in the subscribe
        self.cancellable = cancellable
        #: the manager of the current connection granted it (echoed in ``subscribed``)
        self.cancel_granted = False
        #: deliveries cancelled by an operator, since the session started
        self.cancelled = 0

    # ------------------------------------------------------------------ state

    @property
    def in_hand(self) -> int:
        """Events held on the current connection (delivered, not yet settled)."""
        return len(self.book.in_hand)

    @property
    def busy(self) -> bool:
        """Something is still to finish before a drain may close: events in hand or waiting, results unsent."""
        return bool(self.book.in_hand or self.waiting or self.acks or self.nacks)

    def holds(self, event: E, gen: int) -> bool:
        """Whether this delivery is still in hand on the current connection."""
        return gen == self.gen and self.open and self.book.holds(event.id, event.attempt)

    # ------------------------------------------------------------------ connection

    def connected(self, *, draining: bool = False) -> None:
        """A new connection is open: a new generation; nothing is in hand on it yet."""
        self.gen += 1
        self.open = True
        self.welcomed = self.subscribed = False
        self.book.draining = draining
        self.term = None

    def connection_lost(self) -> int:
        """The connection is gone: forget what it held (the manager re-fires it); returns how many
        events were in hand. Handlers still running keep their slots until they return."""
        held = len(self.book.in_hand)
        self.book.connection_lost(len(self.waiting))
        self.waiting.clear()
        self.acks.clear()
        self.nacks.clear()
        self.extends.clear()
        self.outstanding.clear()
        self.last_credit = None
        self.open = self.welcomed = self.subscribed = False
        return held

    def drain(self) -> None:
        """Stop: credit 0 from the next :meth:`frames` on; what is in hand still finishes."""
        self.book.draining = True

    # ------------------------------------------------------------------ frames in

    def receive(self, message: str | bytes) -> list[Effect[E]]:
        """One server message; the effects it has."""
        frame = f.parse_server(message)
        self._retry = False
        try:
            out = self._on_frame(frame)
        except ServerFrameError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ServerFrameError(f"unreadable {type(frame).__name__} frame: {exc!r}") from None
        if self._retry:
            out.append(RetryLater(RETRY_AFTER))
        return out

    def _on_frame(self, frame: f.ServerFrame | None) -> list[Effect[E]]:
        if not self.welcomed and not isinstance(frame, f.Welcome):
            raise ServerFrameError(f"expected a welcome frame, got {frame!r:.200}")
        if isinstance(frame, f.Deliver):
            return self._deliver(frame)
        if isinstance(frame, f.AckResult):
            self._ack_result(frame)
        elif isinstance(frame, f.NackResult):
            self._nack_result(frame)
        elif isinstance(frame, f.ExtendResult):
            self._extend_result(frame)
        elif isinstance(frame, f.Error):
            return self._error(frame)
        elif isinstance(frame, f.Cancel):
            return self._cancel(frame)
        elif isinstance(frame, f.Subscribed):
            self.subscribed = True
            self.cancel_granted = frame.features is not None and f.Cancel.TYPE in frame.features
            self.stats.connects += 1
            return [Subscribed(self.queue, self.term)]
        elif isinstance(frame, f.Welcome):
            return self._welcome(frame)
        # credit_set, pong and frames of later versions (None) need nothing
        return []

    def _welcome(self, frame: f.Welcome) -> list[Effect[E]]:
        if self.welcomed:
            raise ServerFrameError("a second welcome frame on one connection")
        self.welcomed = True
        self.term = frame.term
        self.last_credit = self.book.credit
        tenants = tuple(self.tenants) if self.tenants is not None else None
        features = (f.Cancel.TYPE,) if self.cancellable else None
        return [Send(f.Subscribe(self.queue, tenants, self.last_credit, SUBSCRIBE_REF, features).to_json())]

    def _deliver(self, frame: f.Deliver) -> list[Effect[E]]:
        queue = frame.queue
        out: list[Effect[E]] = []
        for raw in frame.events:
            event = self._make_event(queue, raw)
            self.stats.delivered += 1
            if self.book.delivered(event.id, event.attempt):
                self.book.started(event.id, event.attempt, False)
                out.append(Start(event, self.gen))
            else:
                self.waiting.append(event)
        return out

    def _cancel(self, frame: f.Cancel) -> list[Effect[E]]:
        """Deliveries an operator cancelled: out of hand (an event still waiting for a slot never
        starts), their results not sent; each running handler is to be stopped."""
        out: list[Effect[E]] = []
        for item in frame.events:
            ident, attempt = item["id"], item["attempt"]
            if not self.book.holds(ident, attempt):
                continue
            self.cancelled += 1
            for waiting in [e for e in self.waiting if e.id == ident and e.attempt == attempt]:
                self.waiting.remove(waiting)
                self.book.waiting -= 1
            self.book.settled(ident, attempt)
            self.acks = [a for a in self.acks if a != (ident, attempt)]
            self.nacks = [n for n in self.nacks if (n.id, n.attempt) != (ident, attempt)]
            self.extends.pop(ident, None)
            out.append(Cancelled(ident, attempt, self.gen))
        return out

    def _ack_result(self, frame: f.AckResult) -> None:
        sent = self._reply_to(frame.ref)
        attempts = dict(sent.items) if isinstance(sent, f.Ack) else {}
        for ident in frame.acked:
            self.stats.acked += 1
            self.book.settled(ident, attempts.get(ident, self.book.in_hand.get(ident, 0)))
        self._item_errors("ack", frame.errors, sent)

    def _nack_result(self, frame: f.NackResult) -> None:
        sent = self._reply_to(frame.ref)
        attempts = {it.id: it.attempt for it in sent.items} if isinstance(sent, f.Nack) else {}
        for ident in frame.requeued:
            self.stats.nacked += 1
            self.book.settled(ident, attempts.get(ident, 0))
        for ident in frame.failed:
            self.stats.dead_lettered += 1
            self.book.settled(ident, attempts.get(ident, 0))
        self._item_errors("nack", frame.errors, sent)

    def _extend_result(self, frame: f.ExtendResult) -> None:
        self._reply_to(frame.ref)
        self.stats.extended += len(frame.extended)
        for err in frame.errors:
            self._record(err)
            if err.get("code") != f.UNAVAILABLE:  # the event is gone from this connection
                self._drop(err["id"], err["attempt"])

    def _reply_to(self, ref: Any) -> Outstanding | None:
        """The frame a reply answers (forgotten: it has its reply)."""
        return self.outstanding.pop(ref, None) if isinstance(ref, int) else None

    def _item_errors(self, kind: str, errors: list[f.ItemError], sent: Outstanding | None) -> None:
        nacks = {it.id: it for it in sent.items} if isinstance(sent, f.Nack) else {}
        for err in errors:
            self._record(err)
            ident, attempt = err["id"], err["attempt"]
            code = err.get("code")
            if code == f.UNAVAILABLE:  # not written this time: send it again on this connection, a little later
                if kind == "ack":
                    self.acks.append((ident, attempt))
                elif ident in nacks:
                    self.nacks.append(nacks[ident])
                self._retry = True
            elif code != f.DUPLICATE:  # stale, unknown_id: no longer ours
                self._drop(ident, attempt)

    def _error(self, frame: f.Error) -> list[Effect[E]]:
        record: dict[str, Any] = {"type": "error", "code": frame.code, "message": frame.message}
        if frame.ref is not None:
            record["ref"] = frame.ref
        self._record(record)
        if frame.ref == SUBSCRIBE_REF:
            return [Refused(frame.code, frame.message, fatal=frame.code == f.FORBIDDEN)]
        sent = self._reply_to(frame.ref)
        if sent is None:
            logger.warning("shard %s: error frame: %s", self.shard, frame, extra={"shard": self.shard})
            return []
        if frame.code == f.UNAVAILABLE:
            if isinstance(sent, f.Ack):
                self.acks.extend(sent.items)
            elif isinstance(sent, f.Nack):
                self.nacks.extend(sent.items)
            self._retry = True
            return []
        logger.error("shard %s: %s frame refused: %s", self.shard, sent.TYPE, frame, extra={"shard": self.shard})
        if isinstance(sent, f.Ack):
            for ident, attempt in sent.items:
                self._drop(ident, attempt)
        elif isinstance(sent, f.Nack):
            for it in sent.items:
                self._drop(it.id, it.attempt)
        return []

    def _record(self, error: Mapping[str, Any]) -> None:
        self.stats.errors.append({"shard": self.shard, **error})

    def _drop(self, ident: int, attempt: int) -> None:
        if self.book.holds(ident, attempt):
            self.stats.dropped += 1
        self.book.settled(ident, attempt)

    # ------------------------------------------------------------------ the handlers

    def completed(self, event: E, gen: int, outcome: Outcome) -> None:
        """A handler's run ended with ``outcome``: queue its ack or nack (sent by :meth:`frames`)."""
        if outcome.kind == "settled":
            self.stats.settled_by_sql += 1
            if gen == self.gen:
                self.book.settled(event.id, event.attempt)
            return
        if not self.holds(event, gen):
            # delivered on a connection that has ended, or taken back meanwhile: the manager re-fires it
            self.stats.dropped += 1
            return
        if outcome.kind == "ack":
            self.acks.append((event.id, event.attempt))
        else:
            self.nacks.append(f.NackItem(event.id, event.attempt, outcome.delay, outcome.error))
        self.extends.pop(event.id, None)

    def slot_freed(self, event: E) -> list[Start[E]]:
        """A handler returned: its slot is free; the events that waited for one start."""
        self.book.handler_returned(event.id, event.attempt)
        out: list[Start[E]] = []
        while self.book.can_start_waiting() and self.waiting:
            waiting = self.waiting.popleft()
            self.book.started(waiting.id, waiting.attempt, True)
            out.append(Start(waiting, self.gen))
        return out

    def extend(self, event: E, gen: int, seconds: float) -> bool:
        """Ask for the event's ack deadline to be now + ``seconds``; False if it is no longer in hand."""
        if not self.holds(event, gen):
            return False
        self.extends[event.id] = (event.attempt, seconds)
        return True

    # ------------------------------------------------------------------ frames out

    def frames(self) -> list[str]:
        """The frames to send now: a changed credit, then the acks, nacks and extensions, in batches."""
        if not self.open:
            return []
        out = []
        credit = self.book.credit
        if credit != self.last_credit and self.subscribed:
            self.last_credit = credit
            out.append(self._sent(f.Credit(credit, self._next())))
        n = f.MAX_ITEMS_PER_FRAME
        while self.acks:
            batch, self.acks[:] = self.acks[:n], self.acks[n:]
            out.append(self._sent(f.Ack(tuple(batch), self._next())))
        while self.nacks:
            nbatch, self.nacks[:] = self.nacks[:n], self.nacks[n:]
            out.append(self._sent(f.Nack(tuple(nbatch), self._next())))
        if self.extends:
            ext = [f.ExtendItem(i, a, s) for i, (a, s) in self.extends.items()]
            self.extends.clear()
            for k in range(0, len(ext), n):
                out.append(self._sent(f.Extend(tuple(ext[k : k + n]), self._next())))
        return out

    def _next(self) -> int:
        self._next_ref += 1
        return self._next_ref

    def _sent(self, frame: Outstanding) -> str:
        """``frame``'s text; its reply is matched by its ref."""
        assert isinstance(frame.ref, int)
        self.outstanding[frame.ref] = frame
        return frame.to_json()
