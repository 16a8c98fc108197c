"""Recruiting maintenance slices (work stealing, seed 002): pure decisions, no I/O, no clock.

A manager process with spare cycles is *enlisted*: the leader when its dispatcher finds nothing
to do, a standby on every tick of its maintenance loop, at most once per ``slice_interval`` each.
An enlisted process draws a number in [0, 1). Each job declares a rate, the share of enlistments
it takes; the draw recruits the process for the job whose band it falls in, or dismisses it (no
work this time). A recruit then picks a random queue and a random partition of it: random sampling
needs no shared cursor and no coordination between the managers of a shard, and a slice that
gives up leaves its partition to whichever recruit draws it next.

The baseline pass (the leader's periodic run over every partition, which guarantees progress when
nobody is idle) walks the partitions in order instead: :func:`pass_walk`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum


class Job(Enum):
    """The sliced maintenance jobs. (The old-event collector is not sliced: see maintenance.py.)"""

    #: acked events past the queue's retention, failed events past the failed retention: deleted
    RETENTION = "retention"
    #: one partition's load counter re-anchored on its live events
    RECONCILIATION = "reconciliation"


#: each job's share of enlistments. Retention does the bulk of the work; a reconciliation slice
#: counts one partition's live events, and the counters drift slowly, so it is recruited less often.
#: The remaining 0.3 dismisses the worker.
RATES: tuple[tuple[Job, float], ...] = ((Job.RETENTION, 0.5), (Job.RECONCILIATION, 0.2))


def recruit(draw: float, rates: Sequence[tuple[Job, float]] = RATES) -> Job | None:
    """The job an enlisted worker is recruited for, by a uniform ``draw`` in [0, 1); None: dismissed."""
    if not 0.0 <= draw < 1.0:
        raise ValueError(f"draw must be in [0, 1), got {draw!r}")
    band = 0.0
    for job, rate in rates:
        band += rate
        if draw < band:
            return job
    return None


@dataclass(frozen=True, slots=True)
class Target:
    """Where a recruited slice works: the index of a queue in the list given, and a partition of it."""

    queue: int
    partition: int


def target(partitions: Sequence[int], queue_draw: float, partition_draw: float) -> Target | None:
    """A random partition of a random queue, from two uniform draws in [0, 1); ``partitions`` holds
    each queue's physical partition count (a shrinking queue's dropped partitions still hold events
    to purge). None when there is no queue."""
    if not partitions:
        return None
    qi = min(int(queue_draw * len(partitions)), len(partitions) - 1)
    n = max(1, partitions[qi])
    return Target(qi, min(int(partition_draw * n), n - 1))


def pass_walk(cursor: int, partitions: int, full: bool) -> tuple[int, bool]:
    """The baseline pass's next partition after a retention slice of ``cursor``: the same one again while
    its slices come back full (more may wait there), else the next. Returns (partition, advanced)."""
    n = max(1, partitions)
    if full:
        return cursor % n, False
    return (cursor + 1) % n, True
