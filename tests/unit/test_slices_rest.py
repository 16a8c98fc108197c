"""Reconciliation slices rest after one gave up on its time bound (pure: a fake clock, no database)."""

from __future__ import annotations

import asyncio

import psycopg.errors as pg

from queue_manager.clock import FakeClock
from queue_manager.manager.auth import TokenStore
from queue_manager.manager.config import ManagerConfig
from queue_manager.manager.metrics import ManagerMetrics
from queue_manager.manager.recruit import Job
from queue_manager.manager.runtime import Runtime
from queue_manager.manager.signals import ManagerSignals
from queue_manager.manager.slices import RECONCILE_REST_MAX, RECONCILE_REST_MIN, RECONCILE_SLOW, Slicer


def slicer(clock: FakeClock) -> Slicer:
    tokens = TokenStore.from_entries([{"name": "t", "secret": "s" * 32, "queues": ["*"]}])
    config = ManagerConfig(dsn="postgresql://x/y", tokens=tokens)
    return Slicer(Runtime(config, clock, ManagerMetrics(), ManagerSignals()))


def test_reconciliation_rests_after_a_timeout_and_doubles_up_to_the_most() -> None:
    clock = FakeClock()
    s = slicer(clock)
    assert s._resting(Job.RECONCILIATION) is Job.RECONCILIATION

    def time_out() -> None:
        asyncio.run(s._aborted(Job.RECONCILIATION, "orders", 0, "idle", pg.QueryCanceled("timeout"), counted=False))

    time_out()
    assert s._resting(Job.RECONCILIATION) is None
    assert s._resting(Job.RETENTION) is Job.RETENTION  # retention never rests
    clock.advance(RECONCILE_REST_MIN + 0.01)
    assert s._resting(Job.RECONCILIATION) is Job.RECONCILIATION
    time_out()  # the second rest is twice as long
    clock.advance(RECONCILE_REST_MIN + 0.01)
    assert s._resting(Job.RECONCILIATION) is None
    for _ in range(20):
        time_out()
    assert s._reconcile_rest == RECONCILE_REST_MAX
    # a lock conflict (a table lock its count would queue for) is no reason to rest
    clock.advance(RECONCILE_REST_MAX + 1)
    asyncio.run(s._aborted(Job.RECONCILIATION, "orders", 0, "idle", pg.LockNotAvailable("busy"), counted=False))
    assert s._resting(Job.RECONCILIATION) is Job.RECONCILIATION


def test_a_finished_reconciliation_slice_ends_the_doubling_of_the_rests() -> None:
    clock = FakeClock()
    s = slicer(clock)
    for _ in range(3):
        asyncio.run(s._aborted(Job.RECONCILIATION, "orders", 0, "idle", pg.QueryCanceled("timeout"), counted=False))
    assert s._reconcile_rest == RECONCILE_REST_MIN * 8
    clock.advance(RECONCILE_REST_MAX + 1)
    s._reconciled(RECONCILE_SLOW / 2)  # a quick count: the next rest is the shortest again
    assert s._reconcile_rest == RECONCILE_REST_MIN
    assert s._resting(Job.RECONCILIATION) is Job.RECONCILIATION


def test_a_slow_reconciliation_slice_rests_like_a_timeout_and_a_quick_one_ends_the_rests() -> None:
    clock = FakeClock()
    s = slicer(clock)
    s._reconciled(RECONCILE_SLOW / 2)
    assert s._resting(Job.RECONCILIATION) is Job.RECONCILIATION
    s._reconciled(RECONCILE_SLOW * 4)  # finished, but its count was slow (a held snapshot)
    assert s._resting(Job.RECONCILIATION) is None
    clock.advance(RECONCILE_REST_MIN + 0.01)
    assert s._resting(Job.RECONCILIATION) is Job.RECONCILIATION
    s._reconciled(RECONCILE_SLOW * 2)  # slow again: the rest doubles
    clock.advance(RECONCILE_REST_MIN + 0.01)
    assert s._resting(Job.RECONCILIATION) is None
    clock.advance(RECONCILE_REST_MIN)
    s._reconciled(RECONCILE_SLOW / 2)  # a quick one: the next rest is the shortest again
    assert s._reconcile_rest == RECONCILE_REST_MIN
