"""The dispatcher's plan, the lease and the database clock, as pure functions of state and a pinned time."""

from __future__ import annotations

from dataclasses import replace

import pytest

from queue_manager.clock import DatabaseClock, FakeClock
from queue_manager.manager import plan
from queue_manager.manager.config import LEASE_MARGIN
from queue_manager.manager.plan import IdleState, QueueState, Scan
from queue_manager.manager.runtime import Lease

NOW = 100.0

QUIET = QueueState(
    direct=True,
    dirty=False,
    due_hint=False,
    backlog=False,
    next_scan=NOW + 1,
    polling=False,
    needs_refill=False,
    scanned_future_only=True,
)


def test_a_quiet_queue_does_nothing_until_its_slice_is_due() -> None:
    r = plan.plan_round(QUIET, NOW)
    assert (r.scan, r.fire_direct, r.polling) == (Scan.NONE, False, False)
    r = plan.plan_round(QUIET, NOW + 1)
    assert (r.scan, r.fire_direct) == (Scan.SLICE, True)  # the safety net fires what it finds due too


def test_a_due_wake_up_fires_without_a_rescan_and_a_new_events_one_rescans() -> None:
    r = plan.plan_round(replace(QUIET, due_hint=True), NOW)
    assert (r.scan, r.fire_direct) == (Scan.NONE, True)
    r = plan.plan_round(replace(QUIET, dirty=True), NOW)
    assert (r.scan, r.future_only, r.fire_direct) == (Scan.FULL, True, True)


def test_tenant_filtered_subscribers_take_due_events_through_the_cache() -> None:
    s = replace(QUIET, direct=False, scanned_future_only=False, due_hint=True)
    r = plan.plan_round(s, NOW)
    assert (r.scan, r.future_only, r.fire_direct) == (Scan.FULL, False, False)
    # switching between direct and filtered subscribers rescans in full
    assert plan.plan_round(replace(QUIET, scanned_future_only=False), NOW).scan is Scan.FULL


def test_a_polled_queue_fires_directly_each_round_unless_its_subscribers_filter_tenants() -> None:
    """(When a burst of wake-ups enters poll mode, and when it ends: test_wakestate.py.)"""
    r = plan.plan_round(replace(QUIET, polling=True), NOW)
    assert (r.scan, r.polling, r.fire_direct) == (Scan.NONE, True, True)
    r = plan.plan_round(replace(QUIET, polling=True, direct=False, scanned_future_only=False), NOW)
    assert (r.scan, r.polling, r.fire_direct) == (Scan.NONE, False, False)


def test_a_refill_or_a_backlog_is_worked_on_at_once() -> None:
    assert plan.plan_round(replace(QUIET, needs_refill=True), NOW).scan is Scan.FULL
    # partitions that run low are rescanned alone, with the safety net's slice when it is due
    r = plan.plan_round(replace(QUIET, refill=(3, 5)), NOW)
    assert (r.scan, r.refill, r.periodic, r.fire_direct) == (Scan.REFILL, (3, 5), False, False)
    r = plan.plan_round(replace(QUIET, refill=(3,)), NOW + 1)
    assert (r.scan, r.refill, r.periodic, r.fire_direct) == (Scan.REFILL, (3,), True, True)
    assert plan.plan_round(replace(QUIET, refill=(3,), dirty=True), NOW).scan is Scan.FULL
    r = plan.plan_round(replace(QUIET, backlog=True), NOW)
    assert (r.scan, r.fire_direct) == (Scan.NONE, True)


IDLE = IdleState(
    id=1,
    backlog=False,
    polling=False,
    has_due=False,
    has_free=True,
    next_fire_at=None,
    next_scan=NOW + 0.5,
    armed=True,
    waiting=False,
)


def test_an_idle_queue_stays_armed_and_sleeps_until_its_next_slice() -> None:
    idle = plan.plan_idle([IDLE], NOW, 1e9, 2.0, NOW + 5)
    assert (idle.disarm, idle.stop_waiting, idle.arm, idle.timeout) == ((), (), (), pytest.approx(0.5))


def test_sleep_until_the_next_cached_fire_at_only_with_credit_to_fire_it() -> None:
    s = replace(IDLE, next_fire_at=1e9 + 0.2)
    assert plan.plan_idle([s], NOW, 1e9, 2.0, NOW + 5).timeout == pytest.approx(0.2)
    assert plan.plan_idle([replace(s, has_free=False)], NOW, 1e9, 2.0, NOW + 5).timeout == pytest.approx(0.5)


def test_a_busy_queue_gives_its_lock_back_and_an_idle_one_takes_it() -> None:
    busy = replace(IDLE, has_due=True, has_free=False)
    assert plan.plan_idle([busy], NOW, 1e9, 2.0, NOW + 5).disarm == (1,)
    assert plan.plan_idle([replace(IDLE, backlog=True)], NOW, 1e9, 2.0, NOW + 5).disarm == (1,)
    assert plan.plan_idle([replace(IDLE, armed=False)], NOW, 1e9, 2.0, NOW + 5).arm == (1,)


def test_a_moment_is_spare_for_maintenance_unless_due_events_wait_for_credit() -> None:
    assert not plan.credit_bound([IDLE])
    assert not plan.credit_bound([replace(IDLE, next_fire_at=1e9 + 5, has_free=False)])  # nothing due yet
    # due events held back by the limits, with credit: the wait is spare
    assert not plan.credit_bound([replace(IDLE, backlog=True, limit_wait=0.3)])
    assert plan.credit_bound([replace(IDLE, has_due=True, has_free=False)])
    assert plan.credit_bound([IDLE, replace(IDLE, id=2, backlog=True, has_free=False)])
    # the idle plan carries it to the dispatcher
    assert plan.plan_idle([IDLE], NOW, 1e9, 2.0, NOW + 5).spare
    assert not plan.plan_idle([replace(IDLE, has_due=True, has_free=False)], NOW, 1e9, 2.0, NOW + 5).spare


def test_a_waiter_is_kept_through_a_backlog_and_dropped_when_polling() -> None:
    waiting = replace(IDLE, armed=False, waiting=True)
    idle = plan.plan_idle([replace(waiting, backlog=True)], NOW, 1e9, 2.0, NOW + 5)
    assert (idle.disarm, idle.stop_waiting, idle.arm) == ((), (), ())
    idle = plan.plan_idle([replace(waiting, polling=True)], NOW, 1e9, 2.0, NOW + 5)
    assert idle.stop_waiting == (1,) and idle.timeout == plan.POLL_INTERVAL
    assert plan.plan_idle([waiting], NOW, 1e9, 2.0, NOW + 5).arm == ()  # it is not armed twice


def test_capacity_is_credit_within_the_batch_and_the_concurrency_cap() -> None:
    assert plan.capacity([3, 4], 1000, None, 0) == 7
    assert plan.capacity([3, 4], 5, None, 0) == 5
    assert plan.capacity([3, 4], 1000, 10, 8) == 2
    assert plan.capacity([3, 4], 1000, 1, 1) == 0


def test_the_chooser_prefers_the_least_busy_subscriber_that_takes_the_tenant() -> None:
    subs = [("a", 2, None), ("b", 3, frozenset({"acme"})), ("c", 1, frozenset({"globex"}))]
    choose = plan.chooser(subs, lambda s: s[1], lambda s: s[2])
    picks = [choose("acme") for _ in range(5)]
    assert [p[0] if p else None for p in picks] == ["b", "a", "b", "a", "b"]
    assert choose("acme") is None  # every slot that takes acme is reserved
    assert choose("globex") == subs[2]
    assert choose("globex") is None


def test_a_lapsed_subscriber_gets_events_only_when_no_other_takes_them() -> None:
    subs = [("lapsed", 5, None, True), ("steady", 2, None, False), ("acme-only", 3, frozenset({"acme"}), False)]
    choose = plan.chooser(subs, lambda s: s[1], lambda s: s[2], lambda s: s[3])
    assert [choose("globex")[0] for _ in range(3)] == ["steady", "steady", "lapsed"]  # type: ignore[index]
    assert [choose("acme")[0] for _ in range(4)] == ["acme-only"] * 3 + ["lapsed"]  # type: ignore[index]


def test_ties_go_to_the_first_subscriber_from_the_start_given() -> None:
    subs = [("a", 1, None), ("b", 1, None), ("c", 1, None)]
    firsts = [plan.chooser(subs, lambda s: s[1], lambda s: s[2], start=k)("t") for k in range(4)]
    assert [p[0] for p in firsts if p] == ["a", "b", "c", "a"]


def test_next_scan_covers_every_partition_within_the_interval_or_half_the_window() -> None:
    assert plan.next_scan_at(NOW, 2.0, 30.0) == pytest.approx(NOW + 0.5)
    assert plan.next_scan_at(NOW, 2.0, 1.0) == pytest.approx(NOW + 0.125)


def test_the_lease_is_trusted_from_the_renewals_start_only() -> None:
    clock = FakeClock()
    lease = Lease(ttl=2.0)
    assert not lease.trusted(clock.monotonic())
    started = clock.monotonic()
    clock.advance(1.0)  # the renewal took a second (or the process was paused in it)
    lease.granted(7, started)
    assert lease.trusted(clock.monotonic())
    clock.advance(2.0 - 1.0 - LEASE_MARGIN)
    assert not lease.trusted(clock.monotonic())  # start + TTL - margin, not answer + TTL
    lease.dropped()
    assert lease.term is None and not lease.trusted(clock.monotonic())


def test_the_database_clock_keeps_the_tightest_measurement() -> None:
    clock = FakeClock(wall=1000.0)
    db = DatabaseClock(clock)
    db.observe(1010.0, 1000.0, 1000.010)  # rtt 10 ms: skew ~ +9.995
    assert db.now() == pytest.approx(1009.995)
    db.observe(1010.2, 1000.0, 1000.5)  # a slow round trip (consistent with the kept skew) does not win
    assert db.now() == pytest.approx(1009.995)
    db.observe(1010.5, 1000.0, 1000.001)  # a tighter one does
    assert db.now() == pytest.approx(1010.4995)
    db.lean_later(0.5)
    assert db.now() == pytest.approx(1009.9995)


@pytest.mark.parametrize("step", [-30.0, 30.0])
@pytest.mark.parametrize("during_a_reading", [False, True])
def test_the_database_clock_follows_a_step_of_the_local_wall_clock(step: float, during_a_reading: bool) -> None:
    """A wall clock stepped by 30 s (the fault suite's clock jump, docs/faults.md): the estimate of
    the database's clock is right again at the next reading that is not across the step, however
    slow. Before, a reading across a step back set the skew halfway (15 s off) and refused every
    later reading of 2 ms or more, and a step between readings was followed only once a reading as
    tight as the kept one came (dozens of readings): a manager whose clock went back thought due
    events were 15 to 30 s in the future."""
    clock = FakeClock(wall=1000.0)
    db = DatabaseClock(clock)
    db.observe(1000.0005, 1000.0, 1000.001)  # a tight reading: skew 0
    real = 1001.0  # the database's (and the real) time from here on; the local wall clock is off by `step`
    if during_a_reading:
        db.observe(real, real - 0.002, real + step + 0.002)
    for i in range(3):  # readings of 5 ms: slower than 2 ms and than 1.5 x the kept 1 ms
        t = real + i
        db.observe(t, t + step - 0.0025, t + step + 0.0025)
        assert db.now() - clock.wall() == pytest.approx(-step, abs=0.003), f"reading {i}"
    # readings consistent with the new skew but slower do not move it
    db.observe(real + 5 + 0.01, real + 5 + step - 0.05, real + 5 + step + 0.05)
    assert db.skew == pytest.approx(-step, abs=0.003)
