"""An operator's cancel of events a connection holds, in the manager's receiver session: no socket,
no database. A client that asked for the feature ``cancel`` is sent a ``cancel`` frame; an old one
is not, and its late ack, nack or extend is refused with the code ``cancelled``."""

from __future__ import annotations

from typing import Any

from queue_manager.wire import frames
from queue_manager.wire.session import CANCELLED, Resolve, Wake, WakeUp, Write
from tests.unit.test_session import ALL, Counted, Harness, only, sent


def _codes(frame: dict[str, Any]) -> list[tuple[int, str]]:
    return [(e["id"], e["code"]) for e in frame["errors"]]


def test_an_old_clients_cancelled_delivery_frees_its_slot_and_its_late_ack_nack_extend_are_refused() -> None:
    h = Harness(credit=2)
    h.deliver((1, 1), (2, 1))
    assert h.s.free == 0
    assert h.s.cancelled(1, 1) == [WakeUp(Wake.CREDIT)]  # no cancel frame: it did not ask for one
    assert h.s.free == 1 and 1 not in h.ledger
    h.ledger.check()
    assert sent(h.receive(frames.Ack(((1, 1), (2, 1)), ref="a"))) == []  # 2 goes to the database
    late = (
        frames.Ack(((1, 1),), ref="ack"),
        frames.Nack((frames.NackItem(1, 1),), ref="nack"),
        frames.Extend((frames.ExtendItem(1, 1, 5.0),), ref="extend"),
    )
    for frame in late:
        out = sent(h.receive(frame))
        assert _codes(out[0]) == [(1, CANCELLED)], out
        assert "cancelled" in out[0]["errors"][0]["message"]
    # another attempt of the same id is not this delivery: unknown here
    assert _codes(sent(h.receive(frames.Ack(((1, 2),), ref="x")))[0]) == [(1, "unknown_id")]
    # a cancel of an event this connection does not hold changes nothing
    assert h.s.cancelled(9, 1) == [] and h.s.free == 2  # (event 2: its ack is on its way)


def test_an_ack_on_its_way_when_the_cancel_commits_is_refused_with_the_cancel_code() -> None:
    h = Harness(credit=2)
    h.deliver((1, 1))
    write = only(h.receive(frames.Ack(((1, 1),), ref="a")), Write)
    h.s.cancelled(1, 1)  # the cancel's notice comes while the ack is on its way: its UPDATE finds it cancelled
    h.ledger.check()
    result = sent(h.s.settled(write, set(), h.clock.monotonic()))
    assert result[0]["acked"] == [] and _codes(result[0]) == [(1, CANCELLED)]
    assert h.s.free == 2
    h.ledger.check()


def test_a_client_that_asks_for_the_feature_is_granted_it_and_sent_a_cancel_frame() -> None:
    h = Harness(credit=2)
    s = type(h.s)(2, ALL, db_time=lambda: 1.0, metrics=Counted())
    resolve = only(
        s.receive(frames.Subscribe("orders", credit=2, ref="sub", features=("cancel", "x")).to_json(), 0.0), Resolve
    )
    assert resolve.features == ("cancel", "x")
    reply = sent(s.subscribed(resolve, h.ledger))[0]
    assert reply["features"] == ["cancel"]  # what both sides know
    h.ledger.hold(s.id, 7, 3, 0.0)
    out = s.cancelled(7, 3)
    assert sent(out) == [{"type": "cancel", "queue": "orders", "events": [{"id": 7, "attempt": 3}]}]
    assert WakeUp(Wake.CREDIT) in out
    # a subscribe without features is answered without them (an old client sees what it always saw)
    old = type(h.s)(3, ALL, db_time=lambda: 1.0, metrics=Counted())
    r2 = only(old.receive(frames.Subscribe("orders", credit=1).to_json(), 0.0), Resolve)
    assert "features" not in sent(old.subscribed(r2, h.ledger))[0]
    # a malformed features member refuses the subscribe
    bad = sent(old.receive('{"type":"subscribe","queue":"orders","features":"cancel"}', 0.0))
    assert bad[0]["code"] == "bad_frame" and "'features'" in bad[0]["message"]
