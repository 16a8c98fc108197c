"""What the dispatcher does next, as pure functions of a queue's state and the time.

The dispatch loop (``dispatch.py``) runs rounds. In each round it asks :func:`plan_round` for
every active queue's steps (rescan the window: all of it, a slice, or nothing; fire what is due
straight from the table or not), runs them, and when nothing was fired asks :func:`plan_idle`
which wake-up locks to take or give back and how long to sleep. :func:`capacity` and
:func:`chooser` decide how many events may go and to whom. Whether a queue is polled, and its
wake-up lock's state, are the queue's :class:`~.wakestate.WakeState`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TypeVar

from queue_manager.manager.wakestate import POLL_INTERVAL

#: the periodic rescan covers 1/RESCAN_SLICES of a queue's partitions per tick
RESCAN_SLICES = 4

#: how soon a wake-up lock is tried again when a producer's transaction held it and no waiter
#: could be started for it
ARM_RETRY = 0.002


class Scan(Enum):
    NONE = "none"
    #: every partition of the window
    FULL = "full"
    #: the next slice of the periodic safety-net rescan
    SLICE = "slice"
    #: the partitions cut short by their quota that run low (``Round.refill``), with the next
    #: slice when it is due
    REFILL = "refill"


@dataclass(frozen=True, slots=True)
class QueueState:
    """The inputs of one queue's round."""

    #: every subscriber takes every tenant: due events go by mgr_fire_due
    direct: bool
    #: nudged for a rescan since the last round
    dirty: bool
    #: nudged for due events since the last round
    due_hint: bool
    backlog: bool
    next_scan: float
    #: in poll mode (wakestate.py)
    polling: bool
    #: a partition cut short by its quota has run dry
    needs_refill: bool
    #: the last full scan was future_only
    scanned_future_only: bool
    #: partitions cut short by their quota that run low (WindowCache.refills): rescanned alone
    refill: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Round:
    """One queue's steps in one round."""

    scan: Scan
    #: only events not yet due go to the cache (the due ones go by mgr_fire_due)
    future_only: bool
    fire_direct: bool
    #: a poll: due events are fetched directly, every POLL_INTERVAL while nothing else is to do
    polling: bool
    #: with Scan.REFILL: the partitions to rescan
    refill: tuple[int, ...] = ()
    #: with Scan.REFILL: the next slice of the safety net is due too
    periodic: bool = False


def rescan_wanted(dirty: bool, due_hint: bool, direct: bool) -> bool:
    """Do these nudges ask for a rescan of the window? A due hint does when a subscriber filters
    tenants (its due events go through the cache)."""
    return dirty or (due_hint and not direct)


def plan_round(s: QueueState, now: float) -> Round:
    dirty = rescan_wanted(s.dirty, s.due_hint, s.direct)
    polling = s.direct and s.polling
    periodic = now >= s.next_scan
    full = dirty or s.needs_refill or s.direct != s.scanned_future_only
    if full:
        scan = Scan.FULL
    elif s.refill:
        scan = Scan.REFILL
    else:
        scan = Scan.SLICE if periodic else Scan.NONE
    # Scan first, then fire directly: an event that falls due between the two is in the scan
    # (still future) and then fired (and dropped from the cache), in two round trips.
    fire_direct = s.direct and (dirty or s.due_hint or s.backlog or periodic or polling)
    return Round(scan, s.direct, fire_direct, polling, s.refill if scan is Scan.REFILL else (), periodic)


def next_scan_at(now: float, rescan_interval: float, window_seconds: float) -> float:
    """When the next safety-net slice is due: every partition is rescanned every
    min(rescan_interval, window / 2), one slice per tick."""
    return now + min(rescan_interval, window_seconds / 2) / RESCAN_SLICES


@dataclass(frozen=True, slots=True)
class IdleState:
    """One active queue when a round fired nothing."""

    id: int
    backlog: bool
    polling: bool
    #: a cached event is due now
    has_due: bool
    #: some subscriber has free credit
    has_free: bool
    #: the earliest cached fire_at (database clock), None when the cache is empty
    next_fire_at: float | None
    next_scan: float
    #: the session holds the queue's wake-up lock: producers NOTIFY
    armed: bool
    #: a waiter waits for the lock behind an open producer transaction: producers NOTIFY too
    waiting: bool
    #: seconds until the queue's rate or concurrency slice admits a due event (0: they do not hold
    #: one back; inf: only an ack or a larger slice can)
    limit_wait: float = 0.0


@dataclass(frozen=True, slots=True)
class Idle:
    #: give these wake-up locks back: the queue is busy, producers' NOTIFYs would only cost them
    disarm: tuple[int, ...]
    #: stop waiting for these locks: the queue is polled, NOTIFYs would only cost the producers
    stop_waiting: tuple[int, ...]
    #: take these (try, never wait), then rescan the queues taken
    arm: tuple[int, ...]
    #: how long to sleep if nothing was armed
    timeout: float
    #: the moment is spare for maintenance slices (not :func:`credit_bound`)
    spare: bool = True


def plan_idle(
    queues: Sequence[IdleState], now: float, db_now: float, rescan_interval: float, next_reload: float
) -> Idle:
    """A queue with due events it cannot fire for want of credit is busy: producers' NOTIFYs
    would only cost them, and its next scan comes with the next refill or rescan. Any other queue
    is idle, or waits for a cached fire_at: its wake-up lock stays taken, or is taken now (and the
    queue rescanned, so that nothing committed before the lock was taken is missed). (A queue
    that kept firing cached events would otherwise disarm and re-arm, and so rescan its whole
    window, between every two scheduled events.)"""
    disarm = []
    stop_waiting = []
    arm = []
    timeout = rescan_interval
    for q in queues:
        busy = q.backlog or q.polling or (q.has_due and not q.has_free)
        if busy and q.armed:
            disarm.append(q.id)
        # a waiter is kept through a backlog: a new one could miss a commit until it is seen waiting
        if q.polling and q.waiting:
            stop_waiting.append(q.id)
        elif not busy and not q.armed and not q.waiting:
            arm.append(q.id)
        timeout = min(timeout, max(0.0, q.next_scan - now))
        if q.polling:
            timeout = min(timeout, POLL_INTERVAL)
        if q.next_fire_at is not None and q.has_free:
            timeout = min(timeout, max(0.0, q.next_fire_at - db_now, q.limit_wait))
        if q.limit_wait > 0:  # due events held back by the limits: look again when they admit one
            timeout = min(timeout, q.limit_wait)
    timeout = min(timeout, max(0.0, next_reload - now))
    return Idle(tuple(disarm), tuple(stop_waiting), tuple(arm), timeout, spare=not credit_bound(queues))


def credit_bound(queues: Sequence[IdleState]) -> bool:
    """Some queue has events due that it cannot fire for want of credit: the dispatcher is idle
    only until the next ack. Such a moment is not spare for maintenance slices: on a saturated
    machine (2 000 events/s on two slow cores, one receiver of 32 credits) the leader went idle
    between every fire and the next ack and enlisted about 8 slices a second, 5 of every 60 s of
    database time (docs/benchmarks-history.md, "Held snapshot", runs of 2026-11-26 on `d00f5c5` and `7b4316e`).
    The floor still serves every partition (slices.py)."""
    return any((q.backlog or q.has_due) and not q.has_free for q in queues)


def capacity(free: Sequence[int], fire_batch: int, max_concurrency: int | None, in_flight: int) -> int:
    """How many events may be fired now: the subscribers' free credit, at most a batch, within
    the queue's concurrency cap."""
    limit = min(sum(free), fire_batch)
    if max_concurrency is not None:
        limit = min(limit, max_concurrency - in_flight)
    return limit


def next_cursor(start: int, fired: Mapping[int, int], partitions: int) -> int:
    """Where the next round-robin pick starts: after the last partition, in this pick's walk order
    from ``start``, that gave an event (``fired``: partition -> events). Every partition then gets
    its turn before any gets a second one. (The row order a statement returns is no walk order:
    the UPDATE returns its rows in primary-key order, so "after the last row's partition" moved the
    cursor to wherever the newest event happened to be.)"""
    n = max(1, partitions)
    if not fired:
        return start % n
    last = max(fired, key=lambda p: (p - start) % n)
    return (last + 1) % n


def sparse_partitions(heads: Mapping[int, float], since: float | None) -> frozenset[int]:
    """The partitions a pick walked first (``mgr_fire_due``): those whose earliest due event
    (``heads``: partition -> the earliest fire_at it gave, epoch seconds) is not older than
    ``since``, the previous pick's time; they had nothing due then. The cursor moves past the other
    partitions only (:func:`next_cursor`): a sparse partition served out of turn does not make the
    backlogged partitions before it in the walk lose theirs."""
    if since is None:
        return frozenset()
    return frozenset(p for p, head in heads.items() if head >= since)


def cursor_after(
    start: int, fired: Mapping[int, int], heads: Mapping[int, float], since: float | None, partitions: int
) -> int:
    """The round-robin cursor after a ``mgr_fire_due`` pick from ``start`` that fired ``fired``
    (partition -> events) with ``heads`` (partition -> earliest fire_at): past the last backlogged
    partition of the walk; a pick of sparse partitions only moves it past them, as before, so that
    the walk turns even should the clock's estimate behind ``since`` lag."""
    sparse = sparse_partitions(heads, since)
    backlogged = {p: n for p, n in fired.items() if p not in sparse}
    return next_cursor(start, backlogged or fired, partitions)


S = TypeVar("S")


def chooser(
    subs: Sequence[S],
    free: Callable[[S], int],
    tenants: Callable[[S], frozenset[str] | None],
    lapsed: Callable[[S], bool] = lambda s: False,
    start: int = 0,
) -> Callable[[str], S | None]:
    """Pick the least busy subscriber (most free credit) that takes a tenant, and reserve a slot.

    A ``lapsed`` subscriber (it let an event pass its ack deadline and has settled nothing since)
    is picked only when no other with credit takes the tenant: an event that timed out on one
    connection goes elsewhere when it can. Ties go to the first from ``start`` on: a caller that
    moves ``start`` on from batch to batch spreads them instead of always feeding the first."""
    n = len(subs)
    order = [(start + k) % n for k in range(n)] if n else []
    reserved = [free(c) for c in subs]
    accepts = [tenants(c) for c in subs]
    steady = [not lapsed(c) for c in subs]

    def choose(tenant: str) -> S | None:
        best = -1
        best_key = (False, 0)
        for i in order:
            f = reserved[i]
            if f <= 0:
                continue
            key = (steady[i], f)
            if best < 0 or key > best_key:
                t = accepts[i]
                if t is None or tenant in t:
                    best, best_key = i, key
        if best < 0:
            return None
        reserved[best] -= 1
        return subs[best]

    return choose
