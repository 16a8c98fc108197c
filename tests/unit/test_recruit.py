"""Recruiting maintenance slices (queue_manager.manager.recruit): pure, with explicit draws."""

from __future__ import annotations

import random
from collections import Counter

import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st
from psycopg import errors as pg

from queue_manager.manager.recruit import RATES, Job, Target, pass_walk, recruit, target
from queue_manager.manager.slices import abort_reason


def test_each_job_takes_its_rate_of_enlistments_and_the_rest_are_dismissed() -> None:
    rng = random.Random(7)
    n = 100_000
    got = Counter(recruit(rng.random()) for _ in range(n))
    for job, rate in RATES:
        assert abs(got[job] / n - rate) < 0.01, (job, got[job] / n)
    assert abs(got[None] / n - (1 - sum(r for _, r in RATES))) < 0.01


def test_the_bands_follow_the_declared_order() -> None:
    rates = ((Job.RETENTION, 0.25), (Job.RECONCILIATION, 0.5))
    assert recruit(0.0, rates) is Job.RETENTION
    assert recruit(0.2499, rates) is Job.RETENTION
    assert recruit(0.25, rates) is Job.RECONCILIATION
    assert recruit(0.7499, rates) is Job.RECONCILIATION
    assert recruit(0.75, rates) is None
    assert recruit(0.5, ((Job.RECONCILIATION, 1.0),)) is Job.RECONCILIATION
    with pytest.raises(ValueError, match=r"draw must be in \[0, 1\)"):
        recruit(1.0)


@given(
    st.lists(st.integers(min_value=0, max_value=1024), min_size=1, max_size=20),
    st.floats(min_value=0, max_value=1, exclude_max=True),
    st.floats(min_value=0, max_value=1, exclude_max=True),
)
def test_a_target_is_always_a_partition_of_a_queue(partitions: list[int], a: float, b: float) -> None:
    t = target(partitions, a, b)
    assert t is not None
    assert 0 <= t.queue < len(partitions)
    assert 0 <= t.partition < max(1, partitions[t.queue])


def test_targets_are_spread_over_every_queue_and_partition() -> None:
    rng = random.Random(3)
    seen = Counter(target([2, 3], rng.random(), rng.random()) for _ in range(20_000))
    assert set(seen) == {Target(0, 0), Target(0, 1), Target(1, 0), Target(1, 1), Target(1, 2)}
    assert target([], 0.5, 0.5) is None


def test_the_baseline_pass_stays_on_a_full_partition_and_walks_on_otherwise() -> None:
    assert pass_walk(3, 4, full=True) == (3, False)
    assert pass_walk(3, 4, full=False) == (0, True)
    assert pass_walk(0, 1, full=False) == (0, True)


def test_abort_reasons() -> None:
    assert abort_reason(pg.LockNotAvailable()) == "lock"
    assert abort_reason(pg.SerializationFailure()) == "conflict"
    assert abort_reason(pg.DeadlockDetected()) == "conflict"
    assert abort_reason(pg.QueryCanceled()) == "timeout"
    assert abort_reason(psycopg.OperationalError()) == "connection"
    assert abort_reason(ConnectionResetError()) == "connection"
    assert abort_reason(pg.UndefinedTable()) == "error"
