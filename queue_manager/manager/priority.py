"""Priorities with aging, as pure arithmetic: in which order a pick serves the priority levels.

An event has a priority from 1 (highest) to ``PRIORITY_LEVELS`` (the queue's ``default_priority``
when it gives none). A pick serves the levels in order, each as a whole: within a level, the events
go as they would without priorities (the round-robin over partitions, or the tenants' fair shares),
so a noisy tenant cannot starve a quiet one of the same level; across levels, a higher one first
(priority before fairness).

**Aging.** With a queue's ``priority_aging_seconds`` A, a level counts one level higher for every A
seconds its oldest due event has waited (since its fire_at), never above 1: at ``now`` it counts at
``max(1, v - floor((now - oldest) / A))`` (:func:`effective`). Levels are served by that count, and
levels that count the same by their oldest event (:func:`level_order`). Aging moves whole levels, not
single events, so that it never reorders the events of one level: an old backlog of a level does not
go before a quiet tenant's fresh event of the same level (event-by-event aging did exactly that).

What aging bounds (:func:`aging_bound`): an event of priority v that has waited ``(v - 1) * A`` keeps
its level at the top count for as long as it waits, and levels at the top count go oldest first. So
it waits at most ``(v - 1) * A`` plus the time to serve the top-count levels whose oldest event is
older than it and its own level's events ahead of it in that level's round-robin; no event of
priority u < v whose fire_at is more than ``(v - u) * A`` later than its own goes before it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from queue_manager.domain.settings import PRIORITY_LEVELS

__all__ = ["PRIORITY_LEVELS", "aging_bound", "effective", "level_order", "next_caps", "pick_order"]


def effective(priority: int, oldest: float, now: float, aging: float | None) -> int:
    """The level ``priority`` counts at when its oldest due event is due since ``oldest`` (epoch
    seconds), at ``now``, with ``aging`` seconds per level (None: no aging)."""
    if aging is None or now <= oldest:
        return priority
    return max(1, priority - math.floor((now - oldest) / aging))


def level_order(oldest: Mapping[int, float], now: float, aging: float | None) -> dict[int, int]:
    """The order a pick serves the levels in (level -> rank, 0 first), from each level's oldest due
    event (``oldest``: level -> fire_at): by the count :func:`effective` gives, then oldest first,
    then the higher level first."""
    ranked = sorted(oldest, key=lambda v: (effective(v, oldest[v], now, aging), oldest[v], v))
    return {v: i for i, v in enumerate(ranked)}


def aging_bound(priority: int, aging: float | None) -> float:
    """Seconds after its fire_at from which an event of ``priority`` keeps its level at the top
    count (inf without aging, 0 at priority 1)."""
    if priority <= 1:
        return 0.0
    return math.inf if aging is None else (priority - 1) * aging


def pick_order(oldest: Mapping[int, float | None], now: float, aging: float | None) -> list[int]:
    """The order of every level for a pick (what ``mgr_fire_due`` takes as ``order``), from the
    levels' oldest due events as the last pick read them (``oldest``: level -> fire_at, None or
    absent: none then), as :func:`level_order` orders them; a level with nothing due then counts as
    fresh (at its own level, after the levels of that count that were there)."""

    def key(v: int) -> tuple[int, float, int]:
        t = oldest.get(v)
        return (v, math.inf, v) if t is None else (effective(v, t, now, aging), t, v)

    return sorted(range(1, PRIORITY_LEVELS + 1), key=key)


def next_caps(
    fired: Mapping[tuple[int, int], int],
    order: Sequence[int],
    caps: Mapping[tuple[int, int], int],
    quota: int,
    limit: int,
) -> dict[tuple[int, int], int]:
    """The read caps of the next pick's streams ((partition, level) -> rows), after a pick that fired
    ``fired`` per stream with ``caps`` (others: ``quota``). When the first level it served could not
    fill the batch and some of its streams gave all they were allowed (its backlog sits in a few
    partitions), those streams may give the batch's room left to that level next time, so that it
    goes to that level before any other; otherwise none (every stream reads ``quota``)."""
    levels = {v for _, v in fired}
    first = next((v for v in order if v in levels), None)
    if first is None:
        return {}
    best = {s: n for s, n in fired.items() if s[1] == first}
    cut = [s for s, n in best.items() if n >= caps.get(s, quota)]
    at_best = sum(best.values())
    if not cut or at_best >= limit:
        return {}
    others = at_best - sum(best[s] for s in cut)
    share = math.ceil(max(0, limit - others) / len(cut))
    return {s: share for s in cut if share > quota}
