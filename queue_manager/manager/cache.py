"""The window cache of one queue: upcoming to_be_fired events held in memory, per partition.

The database stays the truth: the cache is rebuilt from every scan, and a fire that the
database refuses just drops (or puts back) the entry. The cache holds only what firing needs
(id, tenant, partition, fire_at); payloads come back from the fire UPDATE itself, so memory
is bounded by the queue's cache size whatever the payload sizes or the backlog.

Reads are fair: :meth:`WindowCache.take` visits partitions round-robin, one event per
partition per turn, starting from a position kept across calls, so a full partition cannot
starve the others.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

R = TypeVar("R")

#: how far into a partition take() looks for an event a receiver will accept
LOOKAHEAD = 16
#: a partition cut short by its quota is rescanned (alone) once its last cached event is due
#: within this many seconds and half of what its scan found is gone: the refill then comes
#: before the events beyond the cached ones fall due, not after the partition ran dry
REFILL_LEAD = 1.0


@dataclass(slots=True)
class Entry:
    id: int
    tenant: str
    partition: int
    fire_at: float  # database epoch seconds
    refusals: int = 0  # fires the database refused (a hair early by its clock)


class WindowCache:
    """Due-soon events of one queue, ordered by fire_at within each partition."""

    def __init__(self) -> None:
        self._parts: dict[int, deque[Entry]] = {}
        self._cursor = 0
        #: partitions whose last scan hit its quota: more events may wait beyond the cached ones
        self.truncated: set[int] = set()
        #: partition -> the fire_at (database clock) up to which its last scan saw every event
        self._covered: dict[int, float] = {}
        #: partition -> how many events its last scan installed
        self._scanned: dict[int, int] = {}
        #: a scan is on its way (begin_scan): it may miss rows committed after its snapshot
        self._scanning = False
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def replace(
        self, entries: Iterable[Entry], truncated: Iterable[int], partitions: Iterable[int] | None = None
    ) -> None:
        """Install a scan's result. With ``partitions``, only those partitions are replaced."""
        self._scanning = False
        fresh: dict[int, deque[Entry]] = {}
        for e in entries:
            d = fresh.get(e.partition)
            if d is None:
                d = fresh[e.partition] = deque()
            d.append(e)
        for d in fresh.values():
            if any(d[i].fire_at > d[i + 1].fire_at for i in range(len(d) - 1)):
                fresh_sorted = sorted(d, key=lambda x: x.fire_at)
                d.clear()
                d.extend(fresh_sorted)
        if partitions is None:
            self._parts = fresh
            self.truncated = set(truncated)
            self._covered.clear()
            self._scanned.clear()
        else:
            for p in partitions:
                self._parts.pop(p, None)
                self.truncated.discard(p)
                self._covered.pop(p, None)
                self._scanned.pop(p, None)
            self._parts.update(fresh)
            self.truncated.update(truncated)
        for p, d in fresh.items():
            self._scanned[p] = len(d)
        self._size = sum(len(d) for d in self._parts.values())

    def begin_scan(self) -> None:
        """A scan was sent: until its result is installed, :meth:`horizon` vouches for nothing (a
        row committed after the scan's snapshot and announced meanwhile would be in neither)."""
        self._scanning = True

    def cover(self, partitions: Iterable[int], until: float) -> None:
        """The scan just installed saw every event of ``partitions`` due up to ``until`` (its
        database time, taken before it was sent, plus the window)."""
        for p in partitions:
            self._covered[p] = until

    def horizon(self, partitions: int) -> float:
        """The fire_at (database clock) up to which the cache holds every to_be_fired event of the
        queue's ``partitions``, as of their last scans: the coverage of a scan, or the last cached
        event of a partition cut short by its quota; -inf when some partition has no scan yet or
        ran dry. An event committed later and due after this is found in time by the rescans that
        follow (the periodic slices, a refill), without a rescan for its notice."""
        if self._scanning:
            return -math.inf
        h = math.inf
        for p in range(partitions):
            until = self._covered.get(p)
            if until is None:
                return -math.inf
            if p in self.truncated:
                d = self._parts.get(p)
                until = d[-1].fire_at if d else -math.inf
            h = min(h, until)
        return h

    def next_fire_at(self) -> float | None:
        """The earliest fire_at in the cache, or None when it is empty."""
        heads = [d[0].fire_at for d in self._parts.values() if d]
        return min(heads) if heads else None

    def has_due(self, now: float) -> bool:
        """True when some cached event is due (cheap: looks at partition heads only)."""
        return any(d and d[0].fire_at <= now for d in self._parts.values())

    def due_count(self, now: float) -> int:
        return sum(1 for d in self._parts.values() for e in d if e.fire_at <= now)

    def needs_refill(self) -> bool:
        """True when a partition cut short by its quota has run dry: rescan to see what follows."""
        return any(not self._parts.get(p) for p in self.truncated)

    def refills(self, now: float) -> tuple[int, ...]:
        """The partitions cut short by their quota to rescan now: those that ran dry, and those
        whose last cached event is due within REFILL_LEAD seconds (database clock) with at most
        half of what their scan installed left (so that a partition fired faster than its quota
        lasts is not rescanned on every round)."""
        out = []
        for p in sorted(self.truncated):
            d = self._parts.get(p)
            if not d or (d[-1].fire_at <= now + REFILL_LEAD and 2 * len(d) <= self._scanned.get(p, 0)):
                out.append(p)
        return tuple(out)

    def take(self, now: float, limit: int, choose: Callable[[Entry], R | None]) -> list[tuple[Entry, R]]:
        """Remove and return up to ``limit`` due events (fire_at <= now), round-robin by partition.

        ``choose(entry)`` returns where the event goes (a receiver) or None when nobody can take
        it now; such an event stays, and the next LOOKAHEAD events of its partition are tried.
        """
        out: list[tuple[Entry, R]] = []
        if limit <= 0 or not self._parts:
            return out
        order = sorted(p for p, d in self._parts.items() if d and d[0].fire_at <= now)
        if not order:
            return out
        # start at the first partition at or after the cursor, wrapping around
        start = next((i for i, p in enumerate(order) if p >= self._cursor), 0)
        order = order[start:] + order[:start]
        while order and len(out) < limit:
            still: list[int] = []
            for p in order:
                if len(out) >= limit:
                    still.append(p)
                    continue
                d = self._parts[p]
                picked = -1
                target: R | None = None
                for i in range(min(LOOKAHEAD, len(d))):
                    e = d[i]
                    if e.fire_at > now:
                        break
                    target = choose(e)
                    if target is not None:
                        picked = i
                        break
                if picked < 0:
                    continue
                e = d[picked]
                del d[picked]
                self._size -= 1
                out.append((e, target))  # type: ignore[arg-type]
                self._cursor = p + 1
                if d and d[0].fire_at <= now:
                    still.append(p)
                elif not d:
                    del self._parts[p]
            order = still
        return out

    def take_ordered(
        self,
        now: float,
        limit: int,
        choose: Callable[[Entry], R | None],
        order: Callable[[list[Entry], int], list[Entry]],
    ) -> list[tuple[Entry, R]]:
        """As :meth:`take`, but the due events (up to LOOKAHEAD per partition, listed round-robin
        from the cursor) are offered in the order ``order(candidates, n)`` gives (which may leave
        some out): the per-tenant fair share of a queue with tenant settings (fairness.py)."""
        out: list[tuple[Entry, R]] = []
        if limit <= 0 or not self._parts:
            return out
        parts = sorted(p for p, d in self._parts.items() if d and d[0].fire_at <= now)
        if not parts:
            return out
        start = next((i for i, p in enumerate(parts) if p >= self._cursor), 0)
        parts = parts[start:] + parts[:start]
        cands: list[Entry] = []
        for i in range(LOOKAHEAD):
            for p in parts:
                d = self._parts[p]
                if i < len(d) and d[i].fire_at <= now:
                    cands.append(d[i])
        turn = {p: i for i, p in enumerate(parts)}
        last = -1
        for e in order(cands, len(cands)):
            if len(out) >= limit:
                break
            target = choose(e)
            if target is None:
                continue
            d = self._parts[e.partition]
            d.remove(e)
            self._size -= 1
            if not d:
                del self._parts[e.partition]
            out.append((e, target))
            last = max(last, turn[e.partition])
        if last >= 0:
            self._cursor = parts[last] + 1
        return out

    def discard_ids(self, ids: set[int]) -> int:
        """Drop cached events fired by another path, wherever they sit (a fair pick may fire past
        a partition's head)."""
        dropped = 0
        for p in list(self._parts):
            d = self._parts[p]
            keep = [e for e in d if e.id not in ids]
            if len(keep) != len(d):
                dropped += len(d) - len(keep)
                if keep:
                    self._parts[p] = deque(keep)
                else:
                    del self._parts[p]
        self._size -= dropped
        return dropped

    def discard_heads(self, ids: set[int]) -> int:
        """Drop cached events fired by another path; they sit at the heads of their partitions."""
        dropped = 0
        for p in list(self._parts):
            d = self._parts[p]
            while d and d[0].id in ids:
                d.popleft()
                dropped += 1
            if not d:
                del self._parts[p]
        self._size -= dropped
        return dropped

    def put_back(self, entries: Iterable[Entry]) -> None:
        """Return entries the database did not fire yet (for example one clock tick early)."""
        for e in entries:
            d = self._parts.get(e.partition)
            if d is None:
                d = self._parts[e.partition] = deque()
            # keep fire_at order; put-backs are rare and near the head
            i = 0
            while i < len(d) and d[i].fire_at <= e.fire_at:
                i += 1
            d.insert(i, e)
            self._size += 1

    def clear(self) -> None:
        self._parts.clear()
        self.truncated.clear()
        self._covered.clear()
        self._scanned.clear()
        self._scanning = False
        self._size = 0
