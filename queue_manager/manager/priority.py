"""Priorities with aging, as pure arithmetic: in which order a pick serves the priority levels.

An event has a priority from 1 (highest) to ``PRIORITY_LEVELS`` (the queue's ``default_priority``
when it gives none). A pick serves the levels by their *count*, the lowest count first; within a
level, the events go as they would without priorities (the round-robin over partitions, or the
tenants' fair shares), so a noisy tenant cannot starve a quiet one of the same level; across
levels of different counts, the lower count first (priority before fairness).

**Aging.** With a queue's ``priority_aging_seconds`` A, a level counts one level higher for every A
seconds its oldest due event has waited (since its fire_at), never above 1: at ``now`` it counts at
``max(1, v - floor((now - oldest) / A))`` (:func:`effective`); without aging, or with nothing due,
at its own level (:func:`level_counts`). Aging moves whole levels, not single events, so that it
never reorders the events of one level: an old backlog of a level does not go before a quiet
tenant's fresh event of the same level (event-by-event aging did exactly that).

**Levels that count the same take turns.** Which of them goes first rotates from pick to pick
(:func:`level_ties`): a direct pick walks their streams with the fresh ones first (a stream whose
head was not due at the previous pick), then the level whose turn it is, then the others; the
window cache takes their events turn by turn (each level's first, then each one's second...).
Taking turns, rather than oldest level first, keeps an aged backlog from shutting out the fresh
events of a higher level: a priority-3 backlog that has waited 2A counts 1, and a stream of
priority-1 events then still goes first in its turns and whenever its streams are fresh (oldest
first would have held the stream until the backlog was gone).

What aging bounds (:func:`aging_bound`): an event of priority v that has waited ``(v - 1) * A``
keeps its level at count 1 for as long as it waits, and a level at count 1 goes first in at least
one pick of every ``PRIORITY_LEVELS`` (with as much of the batch as its streams give). So it waits at
most ``(v - 1) * A`` plus the turns its own level's events ahead of it in the level's round robin
take.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from queue_manager.domain.settings import PRIORITY_LEVELS

__all__ = ["PRIORITY_LEVELS", "aging_bound", "effective", "level_counts", "level_ties", "next_caps"]


def effective(priority: int, oldest: float, now: float, aging: float | None) -> int:
    """The level ``priority`` counts at when its oldest due event is due since ``oldest`` (epoch
    seconds), at ``now``, with ``aging`` seconds per level (None: no aging)."""
    if aging is None or now <= oldest:
        return priority
    return max(1, priority - math.floor((now - oldest) / aging))


def level_counts(oldest: Mapping[int, float | None], now: float, aging: float | None) -> list[int]:
    """The count of every level (index ``v - 1``) for a pick at ``now``, from each level's oldest due
    event (``oldest``: level -> fire_at; None or absent: none known, the level counts at its own).
    What ``mgr_fire_due`` takes as ``counts``."""
    out = []
    for v in range(1, PRIORITY_LEVELS + 1):
        t = oldest.get(v)
        out.append(v if t is None else effective(v, t, now, aging))
    return out


def level_ties(turn: int) -> list[int]:
    """Which of the levels that count the same goes first in a pick (index ``v - 1``, the lowest
    first): the order 1, 2, ..., rotated by ``turn`` (the dispatcher's batch counter), so that each
    level goes first in turn."""
    return [(v - 1 - turn) % PRIORITY_LEVELS for v in range(1, PRIORITY_LEVELS + 1)]


def aging_bound(priority: int, aging: float | None) -> float:
    """Seconds after its fire_at from which an event of ``priority`` keeps its level at count 1 (inf
    without aging, 0 at priority 1)."""
    if priority <= 1:
        return 0.0
    return math.inf if aging is None else (priority - 1) * aging


def next_caps(
    fired: Mapping[tuple[int, int], int],
    counts: Sequence[int],
    caps: Mapping[tuple[int, int], int],
    quota: int,
    limit: int,
) -> dict[tuple[int, int], int]:
    """The read caps of the next pick's streams ((partition, level) -> rows), after a pick that fired
    ``fired`` per stream with ``caps`` (others: ``quota``) and the levels' ``counts``. When the
    levels of the lowest count it served could not fill the batch and some of their streams gave all
    they were allowed (their backlog sits in a few partitions), those streams may give the batch's
    room left next time, so that it goes to those levels before any other; otherwise none (every
    stream reads ``quota``)."""
    if not fired:
        return {}
    first = min(counts[v - 1] for _, v in fired)
    best = {s: n for s, n in fired.items() if counts[s[1] - 1] == first}
    cut = [s for s, n in best.items() if n >= caps.get(s, quota)]
    at_best = sum(best.values())
    if not cut or at_best >= limit:
        return {}
    others = at_best - sum(best[s] for s in cut)
    share = math.ceil(max(0, limit - others) / len(cut))
    return {s: share for s in cut if share > quota}
