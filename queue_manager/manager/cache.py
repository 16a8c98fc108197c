"""The window cache of one queue: upcoming to_be_fired events held in memory, per partition and
priority level (a *stream*, as the due index orders them).

The database stays the truth: the cache is rebuilt from every scan, and a fire that the
database refuses just drops (or puts back) the entry. The cache holds only what firing needs
(id, tenant, partition, fire_at, priority and keys); payloads come back from the fire UPDATE itself,
so memory is bounded by the queue's cache size whatever the payload sizes or the backlog.

Reads are fair: :meth:`WindowCache.take` takes level by level (priority.py), then round-robin over
partitions, one event per partition per turn, starting from a position kept across
calls, so a full partition cannot starve the others of its level.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from queue_manager.manager.priority import PRIORITY_LEVELS, level_counts, level_ties

R = TypeVar("R")

#: how far into a stream take() looks for an event a receiver will accept
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
    priority: int = 3
    #: its concurrency and rate keys, scoped by its tenant (keys.py); None: none
    ckey: str | None = None
    rkey: str | None = None


Stream = tuple[int, int]  # (partition, priority)


def _stream(e: Entry) -> Stream:
    return (e.partition, e.priority)


class WindowCache:
    """Due-soon events of one queue, ordered by fire_at within each stream."""

    def __init__(self) -> None:
        self._streams: dict[Stream, deque[Entry]] = {}
        self._cursor = 0
        #: partitions whose last scan hit its quota: more events may wait beyond the cached ones
        self.truncated: set[int] = set()
        #: partition -> the fire_at (database clock) up to which its last scan saw every event
        self._covered: dict[int, float] = {}
        #: partition -> how many events its last scan installed
        self._scanned: dict[int, int] = {}
        #: the coverage of a scan on its way (begin_scan), None when none is: it may miss rows
        #: committed after its snapshot
        self._scanning: float | None = None
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def replace(
        self, entries: Iterable[Entry], truncated: Iterable[int], partitions: Iterable[int] | None = None
    ) -> None:
        """Install a scan's result. With ``partitions``, only those partitions are replaced."""
        self._scanning = None
        fresh: dict[Stream, deque[Entry]] = {}
        for e in entries:
            d = fresh.get(_stream(e))
            if d is None:
                d = fresh[_stream(e)] = deque()
            d.append(e)
        for d in fresh.values():
            if any(d[i].fire_at > d[i + 1].fire_at for i in range(len(d) - 1)):
                fresh_sorted = sorted(d, key=lambda x: x.fire_at)
                d.clear()
                d.extend(fresh_sorted)
        if partitions is None:
            self._streams = fresh
            self.truncated = set(truncated)
            self._covered.clear()
            self._scanned.clear()
        else:
            dropped = set(partitions)
            for s in [s for s in self._streams if s[0] in dropped]:
                del self._streams[s]
            self.truncated -= dropped
            for p in dropped:
                self._covered.pop(p, None)
                self._scanned.pop(p, None)
            self._streams.update(fresh)
            self.truncated.update(truncated)
        for (p, _), d in fresh.items():
            self._scanned[p] = self._scanned.get(p, 0) + len(d)
        self._size = sum(len(d) for d in self._streams.values())

    def begin_scan(self, until: float) -> None:
        """A scan was sent that will cover events due up to ``until`` (database clock): until its
        result is installed, :meth:`horizon` vouches for nothing up to there (a row committed after
        the scan's snapshot and announced meanwhile would be in neither)."""
        self._scanning = until

    def cover(self, partitions: Iterable[int], until: float) -> None:
        """The scan just installed saw every event of ``partitions`` due up to ``until`` (its
        database time, taken before it was sent, plus the window)."""
        for p in partitions:
            self._covered[p] = until

    def horizon(self, partitions: int) -> float:
        """The fire_at (database clock) past which a new event's notice needs no rescan: the latest
        of what the last scans of the queue's ``partitions`` vouch for, each the coverage of its
        scan or, for a partition cut short by its quota, its last cached event (one that ran dry
        vouches for nothing: its refill comes at once), and the coverage of a scan on its way. An
        event committed later and due past this is found in time by the rescans that follow (the
        periodic slices, a refill), without a rescan for its notice. One due at or before it may
        lie in a partition whose cache claims everything up to its fire_at (the notice does not say
        which partition: the latest claim counts, not the earliest), or be missed by the scan on
        its way (committed after its snapshot): its notice rescans. inf (every notice rescans) when
        some partition has no scan yet."""
        h = -math.inf if self._scanning is None else self._scanning
        for p in range(partitions):
            until = self._covered.get(p)
            if until is None:
                return math.inf
            if p in self.truncated:
                n, last = self._held(p)
                until = last if n else -math.inf
            h = max(h, until)
        return h

    def _held(self, p: int) -> tuple[int, float]:
        """How many events of partition ``p`` the cache holds, and the latest fire_at among them
        (its scan kept the partition's earliest events across its levels: everything of ``p`` due
        up to that time was cached, unless fired since)."""
        n, last = 0, -math.inf
        for level in range(1, PRIORITY_LEVELS + 1):
            d = self._streams.get((p, level))
            if d:
                n += len(d)
                last = max(last, d[-1].fire_at)
        return n, last

    def next_fire_at(self) -> float | None:
        """The earliest fire_at in the cache, or None when it is empty."""
        heads = [d[0].fire_at for d in self._streams.values() if d]
        return min(heads) if heads else None

    def has_due(self, now: float) -> bool:
        """True when some cached event is due (cheap: looks at stream heads only)."""
        return any(d and d[0].fire_at <= now for d in self._streams.values())

    def due_count(self, now: float) -> int:
        return sum(1 for d in self._streams.values() for e in d if e.fire_at <= now)

    def needs_refill(self) -> bool:
        """True when a partition cut short by its quota has run dry: rescan to see what follows."""
        return any(not self._held(p)[0] for p in self.truncated)

    def refills(self, now: float) -> tuple[int, ...]:
        """The partitions cut short by their quota to rescan now: those that ran dry, and those
        whose last cached event is due within REFILL_LEAD seconds (database clock) with at most
        half of what their scan installed left (so that a partition fired faster than its quota
        lasts is not rescanned on every round)."""
        out = []
        for p in sorted(self.truncated):
            n, last = self._held(p)
            if not n or (last <= now + REFILL_LEAD and 2 * n <= self._scanned.get(p, 0)):
                out.append(p)
        return tuple(out)

    def _candidates(self, now: float, limit: int) -> dict[int, list[Entry]]:
        """Per partition, the due entries at the head of each of its streams: LOOKAHEAD of each, or
        its share of ``limit`` when more (so that one stream's backlog fills a batch)."""
        due = [d for d in self._streams.values() if d and d[0].fire_at <= now]
        if not due:
            return {}
        depth = max(LOOKAHEAD, math.ceil(limit / len(due)))
        out: dict[int, list[Entry]] = {}
        for d in due:
            got = out.setdefault(d[0].partition, [])
            for i in range(min(depth, len(d))):
                e = d[i]
                if e.fire_at > now:
                    break
                got.append(e)
        return out

    def _walk(self, partitions: Iterable[int]) -> dict[int, int]:
        """Each partition's place in the round-robin walk from the cursor."""
        parts = sorted(partitions)
        start = next((i for i, p in enumerate(parts) if p >= self._cursor), 0)
        return {p: k for k, p in enumerate(parts[start:] + parts[:start])}

    def _remove(self, e: Entry) -> None:
        s = _stream(e)
        d = self._streams[s]
        if d and d[0] is e:
            d.popleft()
        else:
            d.remove(e)
        self._size -= 1
        if not d:
            del self._streams[s]

    def take(
        self, now: float, limit: int, choose: Callable[[Entry], R | None], aging: float | None = None, turn: int = 0
    ) -> list[tuple[Entry, R]]:
        """Remove and return up to ``limit`` due events (fire_at <= now): the levels of the lowest
        count first (priority.level_counts; ``aging``: the queue's priority_aging_seconds), then
        round-robin by partition, one per partition per turn; levels of one count take the same
        turns (``turn`` says which goes first: priority.level_ties).

        ``choose(entry)`` returns where the event goes (a receiver) or None when nobody can take
        it now; such an event stays, and the partition's next candidates are tried in its next turns.
        """
        cands, pos = self._due(now, limit)
        if not cands:
            return []
        oldest: dict[int, float | None] = {}
        for es in cands.values():
            for e in es:
                t = oldest.get(e.priority)
                oldest[e.priority] = e.fire_at if t is None else min(e.fire_at, t)
        counts = level_counts(oldest, now, aging)
        ties = level_ties(turn)
        ranked: list[tuple[int, int, int, int, float, Entry]] = []
        for p, es in cands.items():
            turns: dict[int, int] = {}
            for e in sorted(es, key=lambda e: e.fire_at):
                j = turns.get(e.priority, 0)
                turns[e.priority] = j + 1
                ranked.append((counts[e.priority - 1], j, pos[p], ties[e.priority - 1], e.fire_at, e))
        ranked.sort(key=lambda x: x[:5])
        out = self._offer((e for *_, e in ranked), limit, choose)
        if out:
            self._cursor = out[-1][0].partition + 1
        return out

    def take_ordered(
        self,
        now: float,
        limit: int,
        choose: Callable[[Entry], R | None],
        order: Callable[[list[Entry], int], list[Entry]],
    ) -> list[tuple[Entry, R]]:
        """As :meth:`take`, but the due candidates (listed round-robin from the cursor, each
        partition's by fire_at) are offered in the order ``order(candidates, n)`` gives (which may
        leave some out): the per-tenant fair share of a queue with tenant settings (fairness.py),
        by effective priority first."""
        cands, pos = self._due(now, limit)
        if not cands:
            return []
        listed: list[Entry] = []
        for p in sorted(cands, key=pos.__getitem__):
            listed.extend(sorted(cands[p], key=lambda e: e.fire_at))
        out = self._offer(order(listed, len(listed)), limit, choose)
        if out:
            walk = sorted(pos, key=pos.__getitem__)
            self._cursor = walk[max(pos[e.partition] for e, _ in out)] + 1
        return out

    def _due(self, now: float, limit: int) -> tuple[dict[int, list[Entry]], dict[int, int]]:
        """The due candidates of :meth:`_candidates` (none when ``limit`` <= 0) and each one's
        partition's place in the walk from the cursor."""
        cands = self._candidates(now, limit) if limit > 0 and self._streams else {}
        return cands, self._walk(cands) if cands else {}

    def _offer(
        self, entries: Iterable[Entry], limit: int, choose: Callable[[Entry], R | None]
    ) -> list[tuple[Entry, R]]:
        """Remove and return, with where each goes, the first ``limit`` of ``entries`` that
        ``choose`` places."""
        out: list[tuple[Entry, R]] = []
        for e in entries:
            if len(out) >= limit:
                break
            target = choose(e)
            if target is not None:
                self._remove(e)
                out.append((e, target))
        return out

    def discard_ids(self, ids: set[int]) -> int:
        """Drop cached events fired by another path, wherever they sit (a fair pick may fire past
        a stream's head)."""
        dropped = 0
        for s in list(self._streams):
            d = self._streams[s]
            keep = [e for e in d if e.id not in ids]
            if len(keep) != len(d):
                dropped += len(d) - len(keep)
                if keep:
                    self._streams[s] = deque(keep)
                else:
                    del self._streams[s]
        self._size -= dropped
        return dropped

    def discard_heads(self, ids: set[int]) -> int:
        """Drop cached events fired by another path; they sit at the heads of their streams."""
        dropped = 0
        for s in list(self._streams):
            d = self._streams[s]
            while d and d[0].id in ids:
                d.popleft()
                dropped += 1
            if not d:
                del self._streams[s]
        self._size -= dropped
        return dropped

    def put_back(self, entries: Iterable[Entry]) -> None:
        """Return entries the database did not fire yet (for example one clock tick early)."""
        for e in entries:
            d = self._streams.get(_stream(e))
            if d is None:
                d = self._streams[_stream(e)] = deque()
            # keep fire_at order; put-backs are rare and near the head
            i = 0
            while i < len(d) and d[i].fire_at <= e.fire_at:
                i += 1
            d.insert(i, e)
            self._size += 1

    def clear(self) -> None:
        self._streams.clear()
        self.truncated.clear()
        self._covered.clear()
        self._scanned.clear()
        self._scanning = None
        self._size = 0
