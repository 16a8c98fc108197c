"""The receiver's side of protocol qm.v1, sans I/O (queue_manager.wire.client): server frames in,
client frames and effects out. Every frame the session sends is read back with the manager's own
codec (frames.parse), so the two sides cannot drift apart."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from queue_manager.wire import frames as f
from queue_manager.wire.client import (
    ACK,
    SETTLED,
    ClientSession,
    Outcome,
    Refused,
    RetryLater,
    Send,
    ServerFrameError,
    Start,
    Subscribed,
)
from receivers import ReceiverStats as Stats


@dataclass(frozen=True)
class Ev:
    queue: str
    id: int
    attempt: int
    tenant: str


def make_event(queue: str, raw: Mapping[str, Any]) -> Ev:
    return Ev(queue, raw["id"], raw["attempt"], raw["tenant"])


WELCOME = f.Welcome(f.PROTOCOL, "s0", 7, "m", f.limits(500)).to_json()


def deliver(*events: tuple[int, int]) -> str:
    evs: list[f.DeliveredEvent] = [
        {"id": i, "attempt": a, "tenant": "acme", "partition": 0, "fire_at": 1.5, "payload": {"n": i}}
        for i, a in events
    ]
    return f.Deliver("orders", evs).to_json()


def session(slots: int = 3, tenants: list[str] | None = None) -> tuple[ClientSession[Ev], Stats]:
    stats = Stats()
    s = ClientSession("s0", "orders", slots=slots, make_event=make_event, stats=stats, tenants=tenants)
    return s, stats


def subscribed(slots: int = 3) -> tuple[ClientSession[Ev], Stats]:
    s, stats = session(slots)
    s.connected()
    s.receive(WELCOME)
    s.receive(f.Subscribed("orders", None, slots, "subscribe").to_json())
    return s, stats


def started(effects: list[Any]) -> list[tuple[int, int]]:
    return [(e.event.id, e.event.attempt) for e in effects if isinstance(e, Start)]


def sent(s: ClientSession[Ev]) -> list[f.Frame]:
    """The frames the session sends now, parsed as the manager parses them."""
    return [f.parse(text) for text in s.frames()]


def test_welcome_is_answered_with_the_subscribe_carrying_the_credit_and_tenants() -> None:
    s, stats = session(slots=4, tenants=["acme", "globex"])
    s.connected()
    effects = s.receive(WELCOME)
    assert len(effects) == 1 and isinstance(effects[0], Send)
    sub = f.parse(effects[0].text)
    assert sub == f.Subscribe("orders", ("acme", "globex"), 4, "subscribe")
    assert s.term == 7 and s.last_credit == 4
    out = s.receive(f.Subscribed("orders", None, 4, "subscribe").to_json())
    assert out == [Subscribed("orders", 7)] and s.subscribed and stats.connects == 1
    assert s.frames() == []  # the credit was given in the subscribe: nothing more to say


def test_a_connection_must_open_with_a_welcome() -> None:
    s, _ = session()
    s.connected()
    with pytest.raises(ServerFrameError, match="expected a welcome"):
        s.receive(deliver((1, 1)))
    s.connected()
    s.receive(WELCOME)
    with pytest.raises(ServerFrameError, match="second welcome"):
        s.receive(WELCOME)


@pytest.mark.parametrize(
    "message",
    [
        "not json",
        "[1, 2]",
        # malformed server frames, written raw on purpose
        '{"type": "deliver", "queue": "orders"}',
        '{"type": "ack_result", "ref": 1, "acked": [], "errors": [{"code": "stale"}]}',
        '{"type": "ack_result", "ref": 1, "acked": 5, "errors": []}',
        '{"type": "welcome", "protocol": "qm.v1", "shard": "s0", "term": "seven", "manager": "m", "limits": {}}',
    ],
)
def test_an_unreadable_server_frame_is_a_protocol_error(message: str) -> None:
    s, _ = subscribed()
    s.acks.append((1, 1))
    s.frames()
    with pytest.raises(ServerFrameError):
        s.receive(message)


def test_deliveries_start_while_slots_are_free_then_wait_for_one() -> None:
    s, stats = subscribed(slots=2)
    effects = s.receive(deliver((10, 1), (11, 1), (12, 3)))
    assert started(effects) == [(10, 1), (11, 1)]
    assert stats.delivered == 3 and s.in_hand == 3 and len(s.waiting) == 1
    first = next(e for e in effects if isinstance(e, Start))
    assert first.gen == s.gen and first.event.queue == "orders" and first.event.tenant == "acme"
    # the first handler returns: its slot goes to the event that waited
    assert started(s.slot_freed(Ev("orders", 10, 1, "acme"))) == [(12, 3)]  # type: ignore[arg-type]
    assert not s.waiting


def test_an_ack_is_sent_once_and_settles_on_its_result() -> None:
    s, stats = subscribed()
    ev = started_event(s, 5, 2)
    s.slot_freed(ev)
    s.completed(ev, s.gen, ACK)
    frames = sent(s)
    assert len(frames) == 1 and isinstance(frames[0], f.Ack) and frames[0].items == ((5, 2),)
    assert s.frames() == []  # nothing twice
    assert s.in_hand == 1 and s.busy  # in hand until the commit
    s.receive(f.AckResult([5], [], frames[0].ref).to_json())
    assert s.in_hand == 0 and stats.acked == 1 and not s.busy and not s.outstanding


def test_a_nack_carries_its_delay_and_error_and_counts_requeued_and_dead_lettered() -> None:
    s, stats = subscribed()
    a, b = started_event(s, 1, 1), started_event(s, 2, 5)
    s.completed(a, s.gen, Outcome("nack", 30.0, "upstream 503"))
    s.completed(b, s.gen, Outcome("nack", None, "boom"))
    (frame,) = sent(s)
    assert isinstance(frame, f.Nack)
    assert frame.items == (f.NackItem(1, 1, 30.0, "upstream 503"), f.NackItem(2, 5, None, "boom"))
    s.receive(f.NackResult([1], [2], [], frame.ref).to_json())
    assert stats.nacked == 1 and stats.dead_lettered == 1 and s.in_hand == 0


def test_per_item_errors_unavailable_is_retried_stale_is_dropped_duplicate_is_kept() -> None:
    s, stats = subscribed()
    for i in (1, 2, 3):
        finish(s, started_event(s, i, 1), ACK)
    (frame,) = sent(s)
    errors: list[f.ItemError] = [
        {"id": 1, "attempt": 1, "code": "unavailable", "message": "database unreachable"},
        {"id": 2, "attempt": 1, "code": "stale", "message": "re-fired"},
        {"id": 3, "attempt": 1, "code": "duplicate", "message": "twice in one frame"},
    ]
    effects = s.receive(f.AckResult([], errors, frame.ref).to_json())
    assert effects == [RetryLater(0.1)]
    assert stats.dropped == 1 and not s.book.holds(2, 1)  # stale: no longer ours
    assert s.book.holds(1, 1) and s.book.holds(3, 1)
    assert [dict(e) for e in stats.errors] == [{"shard": "s0", **e} for e in errors]
    (again,) = sent(s)
    assert isinstance(again, f.Ack) and again.items == ((1, 1),)  # only the unavailable one, once more


def test_a_refused_frame_drops_its_items_unless_the_manager_was_unavailable() -> None:
    s, stats = subscribed()
    a, b = started_event(s, 1, 1), started_event(s, 2, 1)
    s.completed(a, s.gen, ACK)
    (first,) = sent(s)
    effects = s.receive(f.Error("unavailable", "x", first.ref).to_json())
    assert effects == [RetryLater(0.1)]
    (retried,) = sent(s)
    assert isinstance(retried, f.Ack) and retried.items == ((1, 1),)
    s.completed(b, s.gen, Outcome("nack", None, "e"))
    (nack,) = sent(s)
    assert s.receive(f.Error("bad_frame", "x", nack.ref).to_json()) == []
    assert not s.book.holds(2, 1) and stats.dropped == 1
    # an error about nothing we sent is recorded and changes nothing
    assert s.receive(f.Error("bad_json", "?").to_json()) == []
    assert s.book.holds(1, 1) and len(stats.errors) == 3


def test_extend_asks_for_events_in_hand_only_and_an_extend_error_drops_the_event() -> None:
    s, stats = subscribed()
    ev = started_event(s, 9, 1)
    assert s.extend(ev, s.gen, 60.0)
    assert not s.extend(Ev("orders", 9, 2, "acme"), s.gen, 60.0)  # another attempt: not ours
    (frame,) = sent(s)
    assert isinstance(frame, f.Extend) and frame.items == (f.ExtendItem(9, 1, 60.0),)
    s.receive(f.ExtendResult([{"id": 9, "ack_deadline": 99.0}], [], frame.ref).to_json())
    assert stats.extended == 1 and s.book.holds(9, 1)
    s.extend(ev, s.gen, 60.0)
    (frame,) = sent(s)
    err = f.item_error(9, 1, "stale", "taken back")
    s.receive(f.ExtendResult([], [err], frame.ref).to_json())
    assert not s.book.holds(9, 1) and stats.dropped == 1


def test_an_ack_drops_a_pending_extension_of_the_same_event() -> None:
    s, _ = subscribed()
    ev = started_event(s, 4, 1)
    s.extend(ev, s.gen, 60.0)
    s.completed(ev, s.gen, ACK)
    assert [type(fr) for fr in sent(s)] == [f.Ack]


def test_settled_by_sql_sends_nothing_and_frees_the_event() -> None:
    s, stats = subscribed()
    finish(s, started_event(s, 3, 1), SETTLED)
    assert s.frames() == [] and s.in_hand == 0 and stats.settled_by_sql == 1


def test_drain_sends_credit_zero_and_waits_for_what_is_in_hand() -> None:
    s, _ = subscribed(slots=3)
    ev = started_event(s, 1, 1)
    s.drain()
    (credit,) = sent(s)
    assert isinstance(credit, f.Credit) and credit.credit == 0
    assert s.busy
    s.slot_freed(ev)
    s.completed(ev, s.gen, ACK)
    (ack,) = sent(s)
    s.receive(f.AckResult([1], [], ack.ref).to_json())
    assert not s.busy


def test_a_lost_connection_forgets_its_events_and_late_results_are_dropped() -> None:
    s, stats = subscribed(slots=2)
    s.receive(deliver((1, 1), (2, 1), (3, 1)))  # 3 waits for a slot
    ev = Ev("orders", 1, 1, "acme")
    old_gen = s.gen
    s.completed(ev, old_gen, ACK)
    (ack,) = sent(s)
    assert s.connection_lost() == 3
    assert s.in_hand == 0 and not s.waiting and not s.outstanding and s.frames() == []
    # the handlers of 1 and 2 still run: their slots lower the credit on the next connection
    s.connected()
    (sub,) = s.receive(WELCOME)
    assert isinstance(sub, Send) and f.parse(sub.text) == f.Subscribe("orders", None, 0, "subscribe")
    s.receive(f.Subscribed("orders", None, 0, "subscribe").to_json())
    # a late ack_result of the old connection's ref is not this connection's
    s.receive(f.AckResult([], [], ack.ref).to_json())
    s.completed(Ev("orders", 2, 1, "acme"), old_gen, ACK)
    assert stats.dropped == 1 and s.frames() == []  # nothing sent for an old delivery
    s.slot_freed(Ev("orders", 1, 1, "acme"))
    s.slot_freed(Ev("orders", 2, 1, "acme"))
    (credit,) = sent(s)
    assert isinstance(credit, f.Credit) and credit.credit == 2  # the slots are back


def test_an_ack_of_an_earlier_attempt_of_a_refired_event_is_not_sent() -> None:
    s, stats = subscribed()
    first = started_event(s, 8, 1)
    s.receive(deliver((8, 2)))  # re-fired to us (the first attempt was taken back)
    s.completed(first, s.gen, ACK)
    assert stats.dropped == 1 and s.acks == []


def test_subscribe_refusals_forbidden_is_fatal_others_are_retried() -> None:
    s, stats = session()
    s.connected()
    s.receive(WELCOME)
    refused = s.receive(f.Error("forbidden", "no", "subscribe").to_json())
    assert refused == [Refused("forbidden", "no", fatal=True)]
    s.connected()
    s.receive(WELCOME)
    refused = s.receive(f.Error("unknown_queue", "?", "subscribe").to_json())
    assert refused == [Refused("unknown_queue", "?", fatal=False)]
    assert len(stats.errors) == 2


def test_acks_are_batched_at_the_protocols_item_limit() -> None:
    s, _ = subscribed(slots=f.MAX_ITEMS_PER_FRAME + 5)
    n = f.MAX_ITEMS_PER_FRAME + 5
    s.receive(deliver(*[(i, 1) for i in range(1, n + 1)]))
    for i in range(1, n + 1):
        s.completed(Ev("orders", i, 1, "acme"), s.gen, ACK)
    frames = sent(s)
    assert [len(fr.items) for fr in frames if isinstance(fr, f.Ack)] == [f.MAX_ITEMS_PER_FRAME, 5]
    assert len({fr.ref for fr in frames}) == 2


def test_credit_frames_follow_the_free_slots_only_once_subscribed() -> None:
    s, _ = session(slots=2)
    s.connected()
    s.receive(WELCOME)
    s.drain()
    assert s.frames() == []  # not subscribed yet: the credit goes out once it is
    s.receive(f.Subscribed("orders", None, 2, "subscribe").to_json())
    (credit,) = sent(s)
    assert isinstance(credit, f.Credit) and credit.credit == 0
    assert s.receive(f.CreditSet(0, credit.ref).to_json()) == []


def finish(s: ClientSession[Ev], ev: Ev, outcome: Outcome) -> None:
    """A handler returns (its slot frees first, as the library does), with this outcome."""
    s.slot_freed(ev)
    s.completed(ev, s.gen, outcome)


def started_event(s: ClientSession[Ev], ident: int, attempt: int) -> Ev:
    (start,) = [e for e in s.receive(deliver((ident, attempt))) if isinstance(e, Start)]
    return start.event


def test_a_cancellable_session_asks_for_cancel_frames_and_a_cancel_stops_its_delivery_and_sends_nothing() -> None:
    from queue_manager.wire.client import Cancelled

    stats = Stats()
    s = ClientSession("s0", "orders", slots=1, make_event=make_event, stats=stats, cancellable=True)
    s.connected()
    sub = f.parse(next(e for e in s.receive(WELCOME) if isinstance(e, Send)).text)
    assert isinstance(sub, f.Subscribe) and sub.features == ("cancel",)
    s.receive(f.Subscribed("orders", None, 1, "subscribe", ("cancel",)).to_json())
    assert s.cancel_granted
    running, waiting = s.receive(deliver((1, 1), (2, 1)))[0], None
    assert isinstance(running, Start) and s.waiting and s.waiting[0].id == 2
    out = s.receive(
        f.Cancel("orders", [{"id": 1, "attempt": 1}, {"id": 2, "attempt": 1}, {"id": 9, "attempt": 1}]).to_json()
    )
    assert out == [Cancelled(1, 1, s.gen), Cancelled(2, 1, s.gen)]  # 9: not in hand here, nothing to stop
    assert s.cancelled == 2 and not s.waiting and s.in_hand == 0 and waiting is None
    # the handler of 1 ends anyway (a thread that did not poll its flag): nothing is sent for it
    s.completed(running.event, running.gen, ACK)
    assert s.slot_freed(running.event) == [] and s.frames() == []
    assert stats.acked == 0


def test_a_session_that_cannot_stop_handlers_asks_for_no_feature_and_a_manager_that_grants_none_sends_none() -> None:
    s, _ = session()
    s.connected()
    sub = f.parse(next(e for e in s.receive(WELCOME) if isinstance(e, Send)).text)
    assert isinstance(sub, f.Subscribe) and sub.features is None
    assert '"features"' not in sub.to_json()
    # a cancellable session against a manager of before the feature: subscribed without features
    c = ClientSession("s0", "orders", slots=1, make_event=make_event, stats=Stats(), cancellable=True)
    c.connected()
    c.receive(WELCOME)
    c.receive('{"type":"subscribed","ref":"subscribe","queue":"orders","tenants":null,"credit":1}')
    assert not c.cancel_granted
