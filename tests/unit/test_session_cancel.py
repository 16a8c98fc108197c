"""An operator's cancel of events a connection holds, in the receiver session: no socket, no database."""

from __future__ import annotations

from queue_manager.wire.session import CANCELLED, Wake, WakeUp, Write
from tests.unit.test_session import Harness, only, sent


def _codes(frame: dict[str, object]) -> list[tuple[int, str]]:
    return [(e["id"], e["code"]) for e in frame["errors"]]  # type: ignore[attr-defined, index]


def test_a_cancelled_delivery_frees_its_slot_and_its_late_ack_nack_extend_are_refused_with_their_own_code() -> None:
    h = Harness(credit=2)
    h.deliver((1, 1), (2, 1))
    assert h.s.free == 0
    assert h.s.cancelled(1, 1) == [WakeUp(Wake.CREDIT)]
    assert h.s.free == 1 and 1 not in h.ledger
    h.ledger.check()
    ack = sent(h.receive(type="ack", ref="a", events=[[1, 1], [2, 1]]))
    assert ack == []  # event 2 goes to the database; the answer comes with its result
    for kind, item in (
        ("ack", [1, 1]),
        ("nack", {"id": 1, "attempt": 1}),
        ("extend", {"id": 1, "attempt": 1, "seconds": 5}),
    ):
        out = sent(h.receive(type=kind, ref=kind, events=[item]))
        assert _codes(out[0]) == [(1, CANCELLED)], out
        assert "cancelled" in out[0]["errors"][0]["message"]
    # another attempt of the same id is not this delivery: unknown here
    out = sent(h.receive(type="ack", ref="x", events=[[1, 2]]))
    assert _codes(out[0]) == [(1, "unknown_id")]
    # a cancel of an event this connection does not hold changes nothing
    assert h.s.cancelled(9, 1) == [] and h.s.free == 2  # (event 2: its ack is on its way)


def test_an_ack_on_its_way_when_the_cancel_commits_is_refused_with_the_cancel_code() -> None:
    h = Harness(credit=2)
    h.deliver((1, 1))
    out = h.receive(type="ack", ref="a", events=[[1, 1]])
    write = only(out, Write)
    h.s.cancelled(1, 1)  # the cancel's notice comes while the ack is on its way: its UPDATE finds it cancelled
    h.ledger.check()
    result = sent(h.s.settled(write, set(), h.clock.monotonic()))
    assert result[0]["acked"] == [] and _codes(result[0]) == [(1, CANCELLED)]
    assert h.s.free == 2
    h.ledger.check()
