"""How notices become nudges, and where picks start (floors), without a database."""

from __future__ import annotations

from typing import Any

from queue_manager.manager.floors import (
    EMPTY_MARGIN,
    EPSILON,
    HOLDER_CHECK,
    HOLDER_CHECK_MAX,
    HOLDER_MARGIN,
    HOLDER_SHARE,
    Floors,
    HolderWatch,
    holder_interval,
)
from queue_manager.manager.wakeups import Listener


def listener(calls: list[tuple[Any, ...]]) -> Listener:
    return Listener(
        conn=None,  # type: ignore[arg-type]  # handle() does no I/O
        on_wake=lambda q, due, since, t: calls.append(("wake", q, due, since, t)),
        on_settled=lambda q, i, a, p, s: calls.append(("settled", q, i, a, p, s)),
        on_unknown=lambda: calls.append(("unknown",)),
        on_settings=lambda: calls.append(("settings",)),
        known={"orders", "audit"}.__contains__,
        loop_time=lambda: 42.0,
    )


def test_notices_from_producers_operators_and_the_settled_trigger() -> None:
    calls: list[tuple[Any, ...]] = []
    lst = listener(calls)
    for payload in (
        "orders due 1750000000123456",
        "orders at 1750000000000000",
        "orders",  # an operator's NOTIFY, or an older producer: no time
        "orders due",
        "audit settled 9223372036854775807 3 15 acked",
        "audit settled 7 1 0 deleted",
        "newqueue due 1",
        "orders settings",  # qm.queues' trigger: paused, resumed, altered
        "newqueue settings",  # created
    ):
        lst.handle(payload)
    assert calls == [
        ("wake", "orders", True, 1750000000.123456, 42.0),
        ("wake", "orders", False, 1750000000.0, 42.0),
        ("wake", "orders", False, None, 42.0),
        ("wake", "orders", True, None, 42.0),
        ("settled", "audit", 9223372036854775807, 3, 15, "acked"),
        ("settled", "audit", 7, 1, 0, "deleted"),
        ("unknown",),
        ("settings",),
        ("settings",),
    ]


def test_a_malformed_notice_is_ignored() -> None:
    calls: list[tuple[Any, ...]] = []
    lst = listener(calls)
    for payload in ("orders settled x 1 0 acked", "orders settled 1 1", "orders due soon"):
        lst.handle(payload)
    assert calls == []


def test_floors_rise_after_picks_and_fall_for_whatever_may_lie_below() -> None:
    f = Floors(4)
    assert f.begin() == [None] * 4
    # a pick fired rows in partitions 0 and 2, examined every partition, found 1 and 3 empty
    f.after_pick({0: 100.0, 2: 103.0}, range(4), pick_time=110.0)
    assert f.bounds() == [100.0 - EPSILON, 110.0 - EMPTY_MARGIN, 103.0 - EPSILON, 110.0 - EMPTY_MARGIN]
    # never falls from a pick
    f.begin()
    f.after_pick({0: 50.0}, (), pick_time=0.0)
    assert f[0] == 100.0 - EPSILON
    # a notice of rows from t on: nothing stays above t
    f.lower_all(101.0)
    assert f.bounds() == [100.0 - EPSILON, 101.0 - EPSILON, 101.0 - EPSILON, 101.0 - EPSILON]
    # the cap of a disarmed queue: no pick starts above the previous holder reading
    assert f.bounds(cap=100.5) == [100.0 - EPSILON, 100.5, 100.5, 100.5]


def test_a_pick_rises_no_higher_than_where_floors_fell_while_it_ran() -> None:
    f = Floors(3)
    f.begin()
    f.after_pick({}, range(3), pick_time=100.0)
    f.begin()
    f.lower_all(50.0)  # a late commit announced while the pick ran: its rows may be unseen
    f.after_pick({0: 120.0, 1: 130.0}, (2,), pick_time=140.0)
    assert f.bounds() == [50.0 - EPSILON] * 3
    f.begin()  # the next pick, with no fall meanwhile, rises freely
    f.after_pick({0: 120.0}, (1,), pick_time=140.0)
    assert f.bounds() == [120.0 - EPSILON, 140.0 - EMPTY_MARGIN, 50.0 - EPSILON]
    f.clear()
    assert f.bounds() == [None, None, None]
    f.begin()
    f.clear()  # cleared while a pick ran: nothing rises
    f.after_pick({0: 1.0}, (1,), pick_time=2.0)
    assert f.bounds() == [None, None, None]
    f.resize(4)
    assert f.bounds() == [None] * 4


def test_the_holder_watch_reports_the_earliest_start_of_those_gone() -> None:
    m = HOLDER_MARGIN  # every bound is lowered by what a row's fire_at may lag its lock
    w = HolderWatch()
    assert w.cap is None
    w.start(10.0)  # the queue lost its wake-up lock at 10.0
    assert w.cap == 10.0 - m
    assert w.read({7: 5.0, 8: 9.0}, at=10.01) is None  # two producers hold it
    assert (w.cap, w.last_reading) == (10.0 - m, 10.01 - m)
    assert w.read({8: 9.0}, at=10.02) == 5.0 - m  # 7 committed: its rows may be as old as its start
    assert w.cap == 10.01 - m
    assert w.read({8: 9.0, 9: 10.015}, at=10.03) is None
    assert w.read({}, at=10.04) == 9.0 - m
    # a pid reused by a new transaction counts as gone
    w.read({11: 10.035}, at=10.05)
    assert w.read({11: 10.045}, at=10.06) == 10.035 - m
    assert w.settle() == 10.045 - m  # the lock is taken: every holder known (11) is gone too
    w.stop()
    assert w.cap is None and w.last_reading is None and w.settle() is None


def test_a_holder_caught_committing_is_bounded_by_what_was_seen_before() -> None:
    """A holder whose transaction start is gone (caught while it commits) bounds its rows by its
    start in the previous reading, or by the previous reading itself: never by anything older
    (the producer session's start stood in before, and sent picks back over every dead entry)."""
    m = HOLDER_MARGIN
    w = HolderWatch()
    w.start(100.0)
    assert w.read({7: 99.5}, at=100.01) is None
    # 7 is caught committing: the same transaction as before, its start stands
    assert w.read({7: None}, at=100.02) is None
    assert w.read({}, at=100.03) == 99.5 - m
    # 8 was not seen before: it took the lock after the previous reading (100.03)
    assert w.read({8: None}, at=100.04) is None
    assert w.read({}, at=100.05) == 100.03 - m
    # still committing over two readings, then a new transaction of the same session
    w.read({9: None}, at=100.06)
    assert w.read({9: None}, at=100.07) is None
    assert w.read({9: 100.065}, at=100.08) == 100.05 - m
    assert w.settle() == min(100.08 - m, 100.065 - m)


def test_slow_holder_readings_are_spaced_out_within_bounds() -> None:
    """A quick reading keeps the usual interval; a slow one stretches it so that readings take at
    most HOLDER_SHARE of the dispatcher's time, up to HOLDER_CHECK_MAX."""
    assert holder_interval(0.0) == HOLDER_CHECK
    assert holder_interval(0.001) == HOLDER_CHECK
    took = 0.0054  # measured on a saturated machine
    interval = holder_interval(took)
    assert HOLDER_CHECK < interval < HOLDER_CHECK_MAX
    assert took / (took + interval) <= HOLDER_SHARE + 1e-9
    assert holder_interval(1.0) == HOLDER_CHECK_MAX
