"""A queue's wake-up state without a database: the wake-up lock's transitions, poll mode, the
holder readings and the floors, on a fake clock."""

from __future__ import annotations

import pytest

from queue_manager.clock import FakeClock
from queue_manager.manager.floors import (
    EMPTY_MARGIN,
    EPSILON,
    FULL_RESET,
    HOLDER_MARGIN,
    SAFETY_INTERVAL,
    SAFETY_LOOKBACK,
)
from queue_manager.manager.wakestate import (
    POLL_ENTER_SPAN,
    POLL_ENTER_WAKES,
    POLL_INTERVAL,
    POLL_LINGER,
    POLL_STAY_RATE,
    Lock,
    WakeState,
)

M = HOLDER_MARGIN  # every holder bound keeps this far below its reading
DB = 1_750_000_000.0  # the database's clock (epoch seconds)


def test_a_new_queue_is_released_and_its_holders_are_read_at_once() -> None:
    clock = FakeClock()
    w = WakeState(4)
    now = clock.monotonic()
    assert (w.lock, w.armed, w.waiting, w.polling(now)) == (Lock.RELEASED, False, False, False)
    assert w.reading_due(now) and w.until_reading(now) == 0.0
    assert w.read_holders({}, at=DB, next_reading=now + 0.01) is None
    assert not w.reading_due(now) and w.until_reading(now) == pytest.approx(0.01)
    clock.advance(0.01)
    assert w.reading_due(clock.monotonic())


def test_arming_rescans_from_the_last_reading_and_stops_the_readings() -> None:
    clock = FakeClock()
    w = WakeState(2)
    w.read_holders({7: DB - 5.0}, at=DB, next_reading=clock.monotonic() + 0.01)  # a producer holds it
    since = w.took_lock()  # it committed, the dispatcher took the lock
    assert since == DB - 5.0 - M  # its rows may be as old as its transaction's start
    assert (w.lock, w.armed) == (Lock.ARMED, True)
    clock.advance(1.0)
    assert not w.reading_due(clock.monotonic()) and w.until_reading(clock.monotonic()) == float("inf")
    # given back (the queue is busy): producers stop notifying, their holdings are read again
    w.released(DB + 1.0)
    assert w.lock is Lock.RELEASED and w.reading_due(clock.monotonic())
    assert w.took_lock() == DB + 1.0 - M  # nobody seen holding it: the moment it was given back
    w.reset()
    assert w.took_lock() is None  # a session's start: nothing watched, the rescan covers all


def test_a_producer_holding_the_lock_is_waited_for_while_the_others_notify() -> None:
    clock = FakeClock()
    w = WakeState(2)
    w.released(DB)
    w.wait_started()  # the try failed: an open producer transaction holds the lock
    assert (w.lock, w.armed, w.waiting) == (Lock.WAITING, False, True)
    # holders are still read while waiting (the waiter may not be queued yet)
    assert w.reading_due(clock.monotonic())
    assert w.read_holders({9: DB - 2.0}, at=DB + 0.01, next_reading=clock.monotonic() + 0.01) is None
    assert w.wait_seen() == DB - 2.0 - M  # seen waiting: rescan, still waiting
    assert w.waiting
    assert w.wait_ended() == DB - 2.0 - M  # granted: the open transaction ended
    assert w.lock is Lock.RELEASED  # the next idle round arms it
    w.wait_started()
    w.wait_dropped()  # the queue is polled instead
    assert w.lock is Lock.RELEASED
    w.took_lock()
    w.wait_dropped()  # only a waiting lock is dropped
    assert w.wait_ended() is None and w.armed


def test_a_burst_of_wake_ups_enters_poll_mode_until_a_quiet_linger() -> None:
    clock = FakeClock()
    w = WakeState(1)
    # a slow trickle: no poll mode
    for _ in range(POLL_ENTER_WAKES):
        w.woken(clock.monotonic())
        clock.advance(0.1)
    assert not w.burst(clock.monotonic())
    # a burst: POLL_ENTER_WAKES wake-ups within POLL_ENTER_SPAN
    for _ in range(POLL_ENTER_WAKES):
        w.woken(clock.monotonic())
        clock.advance(POLL_ENTER_SPAN / POLL_ENTER_WAKES / 2)
    start = clock.monotonic()
    assert w.burst(start) and w.polling(start)
    assert not w.burst(start)  # the wake-ups that made the burst are used up
    # a poll that fires POLL_STAY_RATE's share of POLL_LINGER keeps the mode on for another POLL_LINGER
    clock.advance(POLL_LINGER - POLL_INTERVAL)
    assert w.polling(clock.monotonic())
    w.polled(clock.monotonic(), round(POLL_STAY_RATE * POLL_LINGER + 0.5))
    clock.advance(POLL_LINGER - POLL_INTERVAL)
    assert w.polling(clock.monotonic())
    # POLL_LINGER with nothing fired: the mode ends (the dispatcher arms the queue again)
    clock.advance(POLL_INTERVAL)
    assert not w.polling(clock.monotonic())


@pytest.mark.parametrize(("rate", "polled"), [(200.0, False), (0.8 * POLL_STAY_RATE, False), (1000.0, True)])
def test_poll_mode_lasts_only_while_its_polls_fire_at_its_rate(rate: float, polled: bool) -> None:
    """A burst (a producer catching up after a stall) enters poll mode; polls that then fire events
    one by one at a steady rate keep it only at POLL_STAY_RATE a second or more. At 200/s it once
    lasted for good (each poll fired something within POLL_LINGER), and producers stopped
    notifying."""
    clock = FakeClock()
    w = WakeState(1)
    for _ in range(POLL_ENTER_WAKES):
        w.woken(clock.monotonic())
    assert w.burst(clock.monotonic())
    next_event = clock.monotonic()
    for _ in range(round(10 * POLL_LINGER / POLL_INTERVAL)):  # ten lingers of polls
        clock.advance(POLL_INTERVAL)
        now = clock.monotonic()
        fired = 0
        while next_event <= now:
            fired += 1
            next_event += 1 / rate
        if w.polling(now) and fired:
            w.polled(now, fired)
    assert w.polling(clock.monotonic()) is polled


def test_floors_rise_after_picks_fall_for_notices_and_stay_below_the_holder_readings() -> None:
    w = WakeState(4)
    assert w.pick_floors() == [None] * 4
    # a pick fired rows in partitions 0 and 2, examined every partition, found 1 and 3 empty
    w.picked({0: DB, 2: DB + 3.0}, range(4), pick_time=DB + 10.0)
    empty = DB + 10.0 - EMPTY_MARGIN
    assert w.floors == [DB - EPSILON, empty, DB + 3.0 - EPSILON, empty]
    w.lower_floors(DB + 5.0)  # a notice: rows from DB + 5 on may have committed
    assert w.floors == [DB - EPSILON, DB + 5.0 - EPSILON, DB + 3.0 - EPSILON, DB + 5.0 - EPSILON]
    # the lock given back at DB + 4: no pick starts above that reading, the floors themselves stay
    w.released(DB + 4.0)
    cap = DB + 4.0 - M
    assert w.pick_floors() == [DB - EPSILON, cap, DB + 3.0 - EPSILON, cap]
    assert w.floors[1] == DB + 5.0 - EPSILON
    w.picked({}, (), pick_time=DB + 4.0)
    # a producer seen holding the lock, then gone: the floors fall to its transaction's start
    w.read_holders({7: DB + 1.0}, at=DB + 4.01, next_reading=0.0)
    gone = w.read_holders({}, at=DB + 4.02, next_reading=0.0)
    assert gone == DB + 1.0 - M
    w.lower_floors(gone)  # the dispatcher nudges the queue with it
    assert w.floors == [DB - EPSILON] + [DB + 1.0 - M - EPSILON] * 3
    # a notice while a pick runs: the pick raises no floor above it
    w.pick_floors()
    w.lower_floors(DB - 1.0)
    w.picked({0: DB + 2.0}, range(4), pick_time=DB + 4.0)
    assert w.floors == [DB - 1.0 - EPSILON] * 4
    # a session's end drops every floor
    w.reset()
    assert w.floors == [None] * 4
    w.resize(6)
    assert w.pick_floors() == [None] * 6


def test_the_safety_net_looks_back_one_partition_in_turn_and_drops_all_floors_now_and_then() -> None:
    clock = FakeClock()
    w = WakeState(2)
    w.safety_net(clock.monotonic())  # the first round: every floor dropped
    w.pick_floors()
    w.picked({0: DB, 1: DB}, (), pick_time=DB)
    assert w.floors == [DB - EPSILON] * 2
    w.safety_net(clock.monotonic())  # partition 0 looks back
    assert w.floors == [DB - EPSILON - SAFETY_LOOKBACK, DB - EPSILON]
    w.safety_net(clock.monotonic())  # not yet partition 1's turn
    assert w.floors[1] == DB - EPSILON
    clock.advance(SAFETY_INTERVAL / 2)
    w.safety_net(clock.monotonic())
    assert w.floors == [DB - EPSILON - SAFETY_LOOKBACK] * 2
    clock.advance(FULL_RESET)
    w.safety_net(clock.monotonic())
    assert w.floors == [None, None]


def test_a_producer_never_seen_holding_the_lock_is_found_after_readings_without_a_pick() -> None:
    """The receivers' link partitioned, the dispatcher has no credit: holder readings go on, picks
    do not. A producer took the lock after one reading and committed before the next, unseen; a
    pick before its commit had raised a floor above its rows. The first pick after the readings
    must start at or below the reading before the producer took the lock, however many readings
    came in between (the picks' cap alone moved on with them: the rows waited for the safety
    lookback, 18 to 30 s in the fault suite)."""
    w = WakeState(2)
    w.released(DB)
    w.read_holders({}, at=DB + 0.1, next_reading=0.0)  # R1; the producer takes the lock after it
    # a pick before the producer commits fires a row of partition 0 inserted later by another
    w.pick_floors()
    w.picked({0: DB + 0.15}, (1,), pick_time=DB + 0.16)
    w.read_holders({}, at=DB + 0.2, next_reading=0.0)  # R2: the producer committed, never seen
    for i in range(3, 30):  # no credit: readings, no pick
        w.read_holders({}, at=DB + 0.1 * i, next_reading=0.0)
    rows_no_older_than = DB + 0.1 - M
    assert all(f is not None and f <= rows_no_older_than for f in w.pick_floors())
