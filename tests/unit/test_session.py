"""The receiver session and the in-flight ledger, driven with frames and a fake clock: no socket, no database."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from queue_manager.clock import FakeClock
from queue_manager.domain.settings import QueueSettings
from queue_manager.manager import plan
from queue_manager.manager.auth import Grant, TokenStore
from queue_manager.manager.config import ManagerConfig
from queue_manager.manager.metrics import ManagerMetrics
from queue_manager.manager.queues import QueueRuntime
from queue_manager.manager.runtime import Runtime
from queue_manager.manager.signals import ManagerSignals
from queue_manager.wire import frames
from queue_manager.wire.ledger import Claim, Ledger
from queue_manager.wire.session import (
    Action,
    Probe,
    ReceiverSession,
    Release,
    Resolve,
    Send,
    Wake,
    WakeUp,
    Write,
    WriteKind,
)


class Counted:
    """A SessionMetrics that records what it was told."""

    def __init__(self) -> None:
        self.refused: list[str] = []
        self.acks: list[tuple[str, int, list[float]]] = []
        self.nacks: list[tuple[str, int, int]] = []

    def frame_refused(self, code: str) -> None:
        self.refused.append(code)

    def acked(self, queue: str, count: int, latencies: list[float]) -> None:
        self.acks.append((queue, count, latencies))

    def nacked(self, queue: str, requeued: int, failed: int) -> None:
        self.nacks.append((queue, requeued, failed))


ALL = Grant("all", None, None)


def msg(**body: Any) -> str:
    return json.dumps(body)


def sent(actions: Iterable[Action]) -> list[dict[str, Any]]:
    return [json.loads(a.text) for a in actions if isinstance(a, Send)]


def only(actions: list[Action], kind: type) -> Any:
    found = [a for a in actions if isinstance(a, kind)]
    assert len(found) == 1, actions
    return found[0]


class Harness:
    """A session subscribed to 'orders' with a shared ledger and a fake clock."""

    def __init__(self, conn_id: int = 1, ledger: Ledger | None = None, credit: int = 10, scope: Grant = ALL) -> None:
        self.clock = FakeClock()
        self.metrics = Counted()
        self.ledger = ledger if ledger is not None else Ledger()
        self.s = ReceiverSession(conn_id, scope, db_time=lambda: 1234.5, metrics=self.metrics)
        resolve = only(self.receive(frames.Subscribe("orders", credit=credit, ref="sub")), Resolve)
        out = self.s.subscribed(resolve, self.ledger)
        assert sent(out)[0]["type"] == "subscribed"
        assert WakeUp(Wake.SUBSCRIBED) in out

    def receive(self, frame: frames.ClientFrame) -> list[Action]:
        return self.s.receive(frame.to_json(), self.clock.monotonic())

    def deliver(self, *pairs: tuple[int, int]) -> None:
        """The dispatcher pushed these (id, attempt) to this connection."""
        for ident, attempt in pairs:
            self.ledger.hold(self.s.id, ident, attempt, self.clock.monotonic())


def test_credit_is_free_until_deliveries_use_it_and_a_credit_frame_replaces_it() -> None:
    h = Harness(credit=3)
    assert h.s.free == 3
    h.deliver((1, 1), (2, 1))
    assert h.s.free == 1
    out = h.receive(frames.Credit(1, ref=7))
    assert sent(out) == [{"type": "credit_set", "ref": 7, "credit": 1}]
    assert WakeUp(Wake.CREDIT) in out
    assert h.s.free == -1  # lowered below what is in hand: nothing is recalled, nothing more is sent


def test_a_slot_is_free_again_once_its_ack_or_nack_comes_not_once_it_commits() -> None:
    """The receiver's handler is done with an event it acks or nacks, so the slot is filled again
    while the write commits (the fire of the next events overlaps the ack's commit); a write that
    fails takes the slot back, since the event is in hand again."""
    h = Harness(credit=3)
    h.deliver((1, 1), (2, 1), (3, 1))
    assert h.s.free == 0
    out = h.receive(frames.Ack(((1, 1),), ref="a"))
    ack = only(out, Write)
    assert WakeUp(Wake.CREDIT) in out
    assert (h.s.free, h.ledger.held_by(h.s.id), len(h.ledger)) == (1, 3, 3)  # in hand and in flight until it commits
    nack = only(h.receive(frames.Nack((frames.NackItem(2, 1),), ref="n")), Write)
    assert h.s.free == 2
    h.receive(frames.Ack(((1, 1),), ref="b"))  # a duplicate claims nothing more
    assert h.s.free == 2
    h.s.write_failed(nack, "database unreachable")
    assert h.s.free == 1
    h.ledger.check()
    h.s.settled(ack, {1}, h.clock.monotonic())
    assert (h.s.free, h.ledger.held_by(h.s.id)) == (1, 2)
    h.ledger.check()


def test_acks_on_their_way_free_at_most_the_credit() -> None:
    """A connection holds at most twice its credit unsettled (its handlers' events and as many
    acks on their way), however long the writes take: that bounds what a crash sends again."""
    h = Harness(credit=2)
    h.deliver((1, 1), (2, 1))
    h.receive(frames.Ack(((1, 1), (2, 1)), ref="a"))
    assert h.s.free == 2
    h.deliver((3, 1), (4, 1))
    h.receive(frames.Ack(((3, 1), (4, 1)), ref="b"))
    assert (h.s.free, h.ledger.held_by(h.s.id)) == (0, 4)  # the first acks have not committed yet


def test_an_ack_is_written_then_answered_with_the_latency_on_the_fake_clock() -> None:
    h = Harness()
    h.deliver((1, 1), (2, 1))
    h.clock.advance(0.25)
    write = only(h.receive(frames.Ack(((1, 1), (2, 1)), ref="a")), Write)
    assert (write.kind, write.items, write.errors) == (WriteKind.ACK, [(1, 1), (2, 1)], [])
    assert h.ledger.get(1).settling  # type: ignore[union-attr]
    out = h.s.settled(write, {1}, h.clock.monotonic())  # the database acked 1; 2 had been re-fired
    (result,) = sent(out)
    assert result["acked"] == [1] and [(e["id"], e["code"]) for e in result["errors"]] == [(2, "stale")]
    assert WakeUp(Wake.SETTLED) in out
    assert h.metrics.acks == [("orders", 1, [0.25])]
    assert len(h.ledger) == 0 and h.s.free == 10


def test_unknown_foreign_stale_and_duplicate_acks_never_reach_the_database() -> None:
    ledger = Ledger()
    a, b = Harness(1, ledger), Harness(2, ledger)
    a.deliver((10, 1))
    b.deliver((20, 3))
    # b acks a's event (foreign), one never delivered (unknown), its own at a wrong attempt (stale)
    out = b.receive(frames.Ack(((10, 1), (99, 1), (20, 2)), ref=1))
    assert not any(isinstance(x, Write) for x in out)
    (result,) = sent(out)
    assert result["acked"] == []
    assert [(e["id"], e["code"]) for e in result["errors"]] == [(10, "unknown_id"), (99, "unknown_id"), (20, "stale")]
    assert "attempt 3" in result["errors"][2]["message"]
    # a's ack twice in one frame, then again while the first is on its way: duplicates
    write = only(a.receive(frames.Ack(((10, 1), (10, 1)), ref=2)), Write)
    assert write.items == [(10, 1)] and [e["code"] for e in write.errors] == ["duplicate"]
    (again,) = sent(a.receive(frames.Ack(((10, 1),), ref=3)))
    assert [e["code"] for e in again["errors"]] == ["duplicate"]
    assert ledger.get(10).holder == 1 and ledger.get(20).holder == 2  # type: ignore[union-attr]


def test_an_unrecorded_write_leaves_the_event_in_hand_to_retry() -> None:
    h = Harness()
    h.deliver((5, 1))
    write = only(h.receive(frames.Ack(((5, 1),), ref="x")), Write)
    (result,) = sent(h.s.write_failed(write, "database unreachable"))
    assert result["errors"][0]["code"] == "unavailable" and "retry" in result["errors"][0]["message"]
    assert not h.ledger.get(5).settling  # type: ignore[union-attr]
    assert isinstance(only(h.receive(frames.Ack(((5, 1),))), Write), Write)  # the retry is accepted


def test_nack_with_delay_requeues_and_the_last_attempt_dead_letters() -> None:
    h = Harness()
    h.deliver((1, 1), (2, 3))
    write = only(
        h.receive(frames.Nack((frames.NackItem(1, 1, delay=30, error="later"), frames.NackItem(2, 3)), ref="n")),
        Write,
    )
    assert write.kind is WriteKind.RELEASE
    assert write.items == [(1, 1, 30.0, "later"), (2, 3, None, "nacked by the receiver")]
    out = h.s.settled(write, ({1, 2}, {2}, 1_750_000_000.5), h.clock.monotonic())
    (result,) = sent(out)
    assert (result["requeued"], result["failed"], result["errors"]) == ([1], [2], [])
    assert WakeUp(Wake.REQUEUED, 1_750_000_000.5) in out  # due events may appear from the release on
    assert h.metrics.nacks == [("orders", 1, 1)] and len(h.ledger) == 0


def test_a_re_fire_pushed_before_its_nack_is_answered_stays_in_hand() -> None:
    """A nack with delay 0 commits, and the dispatcher's next pick (on a connection of its own) may
    fire the event again and push attempt 2 before the nack's answer reaches the session. That
    answer settles attempt 1 only: attempt 2 stays in hand and its ack is written. (Settled by id,
    attempt 2 left the ledger, its ack was refused as unknown_id, and the event waited for its ack
    deadline.)"""
    h = Harness()
    h.deliver((1, 1))
    nack = only(h.receive(frames.Nack((frames.NackItem(1, 1, delay=0),), ref="n")), Write)
    h.deliver((1, 2))  # the re-fire, pushed while the nack's answer is on its way
    (result,) = sent(h.s.settled(nack, ({1}, set(), 1_750_000_000.5), h.clock.monotonic()))
    assert (result["requeued"], result["errors"]) == ([1], [])
    assert h.ledger.get(1).attempt == 2 and h.s.free == 9  # type: ignore[union-attr]
    h.ledger.check()
    ack = only(h.receive(frames.Ack(((1, 2),), ref="a")), Write)
    (acked,) = sent(h.s.settled(ack, {1}, h.clock.monotonic()))
    assert acked["acked"] == [1] and len(h.ledger) == 0 and h.s.free == 10


def test_an_answer_for_an_older_attempt_leaves_the_re_fire_on_another_connection_alone() -> None:
    """The collector re-fired events to another connection while the first one's acks were on their
    way: the first acks' answers (a failed write, a stale ack) leave the new deliveries, and the
    claims of their own acks, as they are."""
    ledger = Ledger()
    a, b = Harness(1, ledger), Harness(2, ledger)
    a.deliver((7, 1), (8, 1))
    failing = only(a.receive(frames.Ack(((7, 1),), ref="a7")), Write)
    stale = only(a.receive(frames.Ack(((8, 1),), ref="a8")), Write)
    b.deliver((7, 2), (8, 2))  # re-fired past their ack deadline, to b
    b_ack = only(b.receive(frames.Ack(((7, 2), (8, 2)), ref="b")), Write)
    a.s.write_failed(failing, "database unreachable")
    (result,) = sent(a.s.settled(stale, set(), a.clock.monotonic()))
    assert [e["code"] for e in result["errors"]] == ["stale"]
    assert [(d.id, d.attempt, d.settling) for d in ledger.deliveries_of(2)] == [(7, 2, True), (8, 2, True)]
    ledger.check()
    (dup,) = sent(b.receive(frames.Ack(((7, 2),), ref="b2")))  # b's first ack is still on its way
    assert [e["code"] for e in dup["errors"]] == ["duplicate"]
    (acked,) = sent(b.s.settled(b_ack, {7, 8}, b.clock.monotonic()))
    assert acked["acked"] == [7, 8] and len(ledger) == 0 and b.s.free == 10


def test_extend_keeps_the_event_in_hand_and_reports_stale_ones() -> None:
    h = Harness()
    h.deliver((1, 1), (2, 1))
    write = only(
        h.receive(
            frames.Extend(
                (
                    frames.ExtendItem(1, 1, seconds=60),
                    frames.ExtendItem(2, 2, seconds=60),
                    frames.ExtendItem(3, 1, seconds=5),
                ),
                ref="e",
            )
        ),
        Write,
    )
    assert write.kind is WriteKind.EXTEND and write.items == [(1, 1, 60.0)]
    assert [e["code"] for e in write.errors] == ["stale", "unknown_id"]
    (result,) = sent(h.s.settled(write, {1: 1_750_000_060.0}, h.clock.monotonic()))
    assert result["extended"] == [{"id": 1, "ack_deadline": 1_750_000_060.0}]
    assert len(h.ledger) == 2  # an extend settles nothing


def test_a_disconnect_gives_back_what_is_in_hand_but_not_what_is_being_settled() -> None:
    h = Harness()
    h.deliver((1, 1), (2, 1), (3, 2))
    write = only(h.receive(frames.Ack(((2, 1),))), Write)
    (release,) = [a for a in h.s.closed() if isinstance(a, Release)]
    assert sorted(release.items) == [
        (1, 1, 0.0, "receiver disconnected before acking"),
        (3, 2, 0.0, "receiver disconnected before acking"),
    ]
    assert list(h.ledger.unsettled()) == [] and 2 in h.ledger  # the ack on its way decides event 2
    h.s.settled(write, {2}, h.clock.monotonic())
    assert len(h.ledger) == 0


def test_frames_before_subscribe_and_a_second_subscribe_are_refused() -> None:
    metrics = Counted()
    s = ReceiverSession(1, ALL, db_time=lambda: 1.0, metrics=metrics)
    for text, code in (
        (frames.Credit(1).to_json(), "not_subscribed"),
        (frames.Ack(((1, 1),)).to_json(), "not_subscribed"),
        (msg(type="subscribe", queue="bad name"), "bad_frame"),  # malformed, written raw on purpose
    ):
        (err,) = sent(s.receive(text, 0.0))
        assert err["code"] == code, text
    assert isinstance(only(s.receive(frames.Subscribe("orders").to_json(), 0.0), Resolve), Resolve)
    (err,) = sent(s.receive(frames.Subscribe("other", ref="b").to_json(), 0.0))
    assert (err["code"], err["ref"]) == ("already_subscribed", "b")
    assert metrics.refused == ["not_subscribed", "not_subscribed", "bad_frame", "already_subscribed"]


def test_scopes_are_checked_before_the_queue_is_looked_up_and_draining_refuses() -> None:
    scoped = Grant("one", frozenset({"orders"}), frozenset({"acme"}))
    s = ReceiverSession(1, scoped, db_time=lambda: 1.0, metrics=Counted())
    (err,) = sent(s.receive(frames.Subscribe("audit", ref=1).to_json(), 0.0))
    assert err["code"] == "forbidden" and "audit" in err["message"]
    (err,) = sent(s.receive(frames.Subscribe("orders", ("globex",), ref=2).to_json(), 0.0))
    assert err["code"] == "forbidden" and "globex" in err["message"]
    resolve = only(s.receive(frames.Subscribe("orders", ref=3).to_json(), 0.0), Resolve)
    assert resolve.tenants == frozenset({"acme"})  # no tenants asked: the token's
    (err,) = sent(s.subscribe_failed(resolve, frames.UNKNOWN_QUEUE, "no queue named 'orders'"))
    assert (err["code"], err["ref"]) == ("unknown_queue", 3)
    s.draining = True
    (err,) = sent(s.receive(frames.Subscribe("orders").to_json(), 0.0))
    assert err["code"] == "draining"


def test_ping_answers_with_the_database_clock() -> None:
    h = Harness()
    assert sent(h.receive(frames.Ping(ref="p"))) == [{"type": "pong", "ref": "p", "time": 1234.5}]


# ------------------------------------------------------------------ a connection gone silent


def test_a_connection_that_let_an_event_time_out_is_sent_nothing_until_a_frame_shows_life() -> None:
    h = Harness(credit=3)
    h.deliver((1, 1), (2, 1))
    h.clock.advance(30.0)  # past the ack deadline: the collector takes event 1 back
    h.ledger.drop(1)
    assert h.s.timed_out() == [Probe()]  # ping it
    assert (h.s.silent, h.s.free) == (True, 0)  # 2 of its 3 slots are free, yet it is sent nothing
    h.ledger.drop(2)
    assert h.s.timed_out() == []  # one ping per silence
    assert h.s.free == 0
    # a late ack of what was taken back is refused, but the client is there
    out = h.receive(frames.Ack(((1, 1),), ref="late"))
    assert [e["code"] for e in sent(out)[0]["errors"]] == ["unknown_id"]
    assert WakeUp(Wake.ALIVE) in out
    assert (h.s.silent, h.s.free) == (False, 3)
    assert WakeUp(Wake.ALIVE) not in h.receive(frames.Ping())  # not silent: no wake-up


@pytest.mark.parametrize(
    "text",
    [
        frames.Credit(2).to_json(),
        frames.Nack((frames.NackItem(9, 1),)).to_json(),
        frames.Extend((frames.ExtendItem(9, 1, 5),)).to_json(),
        frames.Ping().to_json(),
        msg(type="no_such_frame"),  # refused (unknown_type), written raw on purpose
    ],
)
def test_any_frame_even_a_refused_one_shows_life(text: str) -> None:
    h = Harness(credit=2)
    h.s.timed_out()
    assert WakeUp(Wake.ALIVE) in h.s.receive(text, h.clock.monotonic())
    assert not h.s.silent and h.s.free == 2


def test_the_pong_to_the_probe_shows_life_once() -> None:
    h = Harness(credit=2)
    assert h.s.answered() == []  # a pong while not silent changes nothing
    assert h.s.timed_out() == [Probe()]
    assert h.s.answered() == [WakeUp(Wake.ALIVE)]
    assert h.s.answered() == []
    assert h.s.free == 2
    assert h.s.timed_out() == [Probe()]  # silent again: pinged again


TOKENS = TokenStore.from_entries([{"name": "all", "secret": "secret-all-queues-0001", "queues": ["*"]}])


class Conn:
    """A subscriber as the dispatcher sees it, over a session (what ReceiverConnection adapts)."""

    def __init__(self, h: Harness) -> None:
        self.h = h
        self.id = h.s.id
        self.tenants = None
        self.closed = False
        self.actions: list[Action] = []

    @property
    def free(self) -> int:
        return self.h.s.free

    @property
    def silent(self) -> bool:
        return self.h.s.silent

    @property
    def lapsed(self) -> bool:
        return self.h.s.lapsed

    def timed_out(self) -> None:
        self.actions += self.h.s.timed_out()

    def send(self, text: str) -> None:
        pass

    def close_soon(self, code: int, reason: str) -> None:
        pass


def test_events_that_timed_out_on_a_connection_are_fired_to_the_others_until_it_shows_life() -> None:
    """The collector's move silences the connections that held the moved events, and only them;
    the chooser then gives the re-fires to the others, and to the silent one again once it answers."""
    clock = FakeClock()
    rt = Runtime(ManagerConfig(dsn="x", tokens=TOKENS), clock, ManagerMetrics(), ManagerSignals())
    q = QueueRuntime(QueueSettings(id=1, name="orders", partitions=4, partitions_physical=4))
    frozen, healthy = Conn(Harness(1, q.ledger, credit=8)), Conn(Harness(2, q.ledger, credit=4))
    q.subscribers = [frozen, healthy]  # type: ignore[list-item]
    frozen.h.deliver(*((i, 1) for i in range(1, 9)))
    healthy.h.deliver((20, 1))
    q.pick.take_nudges()
    rt.refired(q, {1, 2, 3}, set(), 1_750_000_000.0)  # the first of the frozen one's deadlines passed
    assert frozen.actions == [Probe()] and healthy.actions == []
    assert (frozen.free, healthy.free) == (0, 3) and q.in_flight == 6
    assert q.pick.take_nudges() == (True, False)  # rescan: the moved events are back in the table
    choose = plan.chooser(q.subscribers, lambda c: c.free, lambda c: c.tenants)
    assert [choose("t") for _ in range(4)] == [healthy, healthy, healthy, None]
    rt.refired(q, {4, 5, 6, 7, 8}, set(), 1_750_000_001.0)
    assert frozen.actions == [Probe()]  # still silent: no second ping
    assert frozen.h.s.answered() == [WakeUp(Wake.ALIVE)]  # the pong came
    # alive, but it has settled nothing since its events timed out: the others come first
    choose = plan.chooser(q.subscribers, lambda c: c.free, lambda c: c.tenants, lambda c: c.lapsed)
    assert [choose("t") for _ in range(4)] == [healthy, healthy, healthy, frozen]
    frozen.h.receive(frames.Nack((frames.NackItem(99, 1),)))  # it works through its events again
    choose = plan.chooser(q.subscribers, lambda c: c.free, lambda c: c.tenants, lambda c: c.lapsed)
    assert choose("t") is frozen  # the one with the most room again


@pytest.mark.parametrize(
    ("frame", "settles"),
    [
        (frames.Ack(((9, 1),)), True),
        (frames.Nack((frames.NackItem(9, 1),)), True),
        (frames.Extend((frames.ExtendItem(9, 1, 5),)), True),
        (frames.Credit(2), False),
        (frames.Ping(), False),
    ],
)
def test_a_connection_that_let_an_event_time_out_stays_lapsed_until_it_settles_something(
    frame: frames.ClientFrame, settles: bool
) -> None:
    """A pong or a credit frame shows the client is there; an ack, a nack or an extend (even one
    refused, for an event taken back) shows it works through what it is sent."""
    h = Harness(credit=2)
    assert not h.s.lapsed
    h.s.timed_out()
    h.s.answered()
    assert h.s.lapsed and not h.s.silent
    h.receive(frame)
    assert h.s.lapsed is not settles


def test_a_result_for_ten_thousand_errors_stays_under_the_frame_limit() -> None:
    h = Harness()
    big = 9_223_372_036_854_775_000
    (result,) = h.receive(frames.Ack(tuple((big + i % 700, 2147483647) for i in range(10000)), ref="r"))
    assert isinstance(result, Send)
    assert len(result.text.encode()) < 0.75 * frames.MAX_FRAME_BYTES
    errors = json.loads(result.text)["errors"]
    assert len(errors) == 10_000 and sum("message" in e for e in errors) == frames.MAX_ERROR_MESSAGES


# ------------------------------------------------------------------ the ledger's invariants

ops = st.lists(
    st.one_of(
        st.tuples(st.just("hold"), st.integers(1, 3), st.integers(1, 8), st.integers(1, 3)),
        st.tuples(st.just("claim"), st.integers(1, 3), st.integers(1, 8), st.integers(1, 3)),
        st.tuples(st.just("unclaim"), st.integers(1, 8), st.integers(1, 3)),
        st.tuples(st.just("settle"), st.integers(1, 8), st.integers(1, 3)),
        st.tuples(st.just("drop"), st.integers(1, 8), st.one_of(st.none(), st.integers(1, 3))),
        st.tuples(st.just("release"), st.integers(1, 3)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_the_ledger_keeps_one_holder_per_event_and_counts_that_agree(steps: list[tuple[Any, ...]]) -> None:
    """Against a model: each event is held by at most one connection at one attempt; per-holder
    counts sum to the queue's in-flight count; a claim succeeds once per delivery; a settle or an
    unclaim touches only the delivery at its attempt; a release keeps exactly the deliveries being
    settled."""
    ledger = Ledger()
    model: dict[int, list[Any]] = {}  # id -> [holder, attempt, settling]
    for step in steps:
        kind = step[0]
        if kind == "hold":
            _, holder, ident, attempt = step
            ledger.hold(holder, ident, attempt, 0.0)
            model[ident] = [holder, attempt, False]
        elif kind == "claim":
            _, holder, ident, attempt = step
            found, _ = ledger.claim(holder, ident, attempt)
            m = model.get(ident)
            if m is None or m[0] != holder:
                assert found is Claim.UNKNOWN
            elif m[1] != attempt:
                assert found is Claim.STALE
            elif m[2]:
                assert found is Claim.DUPLICATE
            else:
                assert found is Claim.OK
                m[2] = True
        elif kind == "unclaim":
            _, ident, attempt = step
            ledger.unclaim(ident, attempt)
            if ident in model and model[ident][1] == attempt:
                model[ident][2] = False
        elif kind == "settle":
            _, ident, attempt = step
            hit = ident in model and model[ident][1] == attempt
            assert (ledger.settle(ident, attempt) is not None) == hit
            if hit:
                del model[ident]
        elif kind == "drop":
            _, ident, attempt = step
            m = model.get(ident)
            hit = m is not None and (attempt is None or m[1] == attempt)
            assert (ledger.drop(ident, attempt) is not None) == hit
            if hit:
                del model[ident]
        else:
            holder = step[1]
            released = {d.id for d in ledger.release_holder(holder)}
            expected = {i for i, m in model.items() if m[0] == holder and not m[2]}
            assert released == expected
            for i in expected:
                del model[i]
        ledger.check()
        assert len(ledger) == len(model)
        for holder in (1, 2, 3):
            assert ledger.held_by(holder) == sum(1 for m in model.values() if m[0] == holder)
        assert {d.id for d in ledger.unsettled()} == {i for i, m in model.items() if not m[2]}


pairs = st.lists(st.tuples(st.integers(1, 8), st.integers(1, 3)), max_size=6)
batches = st.lists(
    st.one_of(
        st.tuples(st.just("hold"), st.integers(1, 3), pairs, st.one_of(st.none(), st.sampled_from(["k1", "k2"]))),
        st.tuples(st.just("claim"), st.integers(1, 3), pairs),
        st.tuples(st.just("settle"), pairs),
        st.tuples(st.just("stray"), st.integers(1, 8), st.integers(1, 3)),
    ),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(batches)
def test_the_ledgers_batch_calls_do_what_their_calls_one_by_one_do(steps: list[tuple[Any, ...]]) -> None:
    """hold_many, claim_many and settle_many (one call per frame or fired batch) leave the ledger as
    hold, claim and settle item by item do, and report the same: re-fires of an event its holder
    still has, duplicates within one batch, keys and strays included."""
    one, many = Ledger(), Ledger()
    for step in steps:
        if step[0] == "hold":
            _, holder, items, key = step
            for ident, attempt in items:
                one.hold(holder, ident, attempt, 1.0, f"t{ident % 2}", key)
            many.hold_many(holder, 1.0, [(ident, attempt, f"t{ident % 2}", key) for ident, attempt in items])
        elif step[0] == "claim":
            _, holder, items = step
            singly = [(i, *one.claim(holder, ident, attempt)) for i, (ident, attempt) in enumerate(items)]
            assert many.claim_many(holder, items) == [r for r in singly if r[1] is not Claim.OK]
        elif step[0] == "settle":
            _, items = step
            singly = [one.settle(ident, attempt) for ident, attempt in items]
            assert many.settle_many(items) == [d for d in singly if d is not None]
        else:
            _, ident, attempt = step
            one.stray(ident, attempt, "k1")
            many.stray(ident, attempt, "k1")
        one.check()
        many.check()
        assert one.in_hand() == many.in_hand()
        assert one.by_tenant() == many.by_tenant() and one.by_key() == many.by_key()
        assert [(d.holder, d.settling) for d in one.unsettled()] == [(d.holder, d.settling) for d in many.unsettled()]
        assert one.strays == many.strays
        for holder in (1, 2, 3):
            assert one.held_by(holder) == many.held_by(holder)
            assert one.settling_by(holder) == many.settling_by(holder)


def test_an_ack_written_beside_other_frames_reports_only_its_own_items_as_acked() -> None:
    """The writer answers a batch of several frames' acks with one set of ids: ids of the other
    frames in it do not make up for an item of this frame the database did not ack."""
    h = Harness(credit=5)
    h.deliver((1, 1), (2, 1), (3, 1))
    write = only(h.receive(frames.Ack(((1, 1), (2, 1), (3, 1)), ref="a")), Write)
    result = sent(h.s.settled(write, {1, 3, 98, 99}, h.clock.monotonic()))[0]
    assert result["acked"] == [1, 3]
    assert [(e["id"], e["code"]) for e in result["errors"]] == [(2, frames.STALE)]
    assert len(h.ledger) == 0 and h.metrics.acks == [("orders", 2, [0.0, 0.0])]
    h.deliver((5, 2))
    write = only(h.receive(frames.Ack(((5, 2),), ref="c")), Write)
    assert sent(h.s.settled(write, {5, 6}, h.clock.monotonic()))[0]["acked"] == [5]
