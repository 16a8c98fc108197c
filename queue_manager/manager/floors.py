"""Where the dispatcher's picks start: a floor on fire_at per partition, and how it may move.

Why. Every fire leaves a dead entry in the queue's due index (``(partition, fire_at) WHERE state =
'to_be_fired'``): the row's old version stays until vacuum removes it. While one transaction
anywhere holds back the xmin horizon, vacuum removes nothing, and a pick that starts at the low end
of a partition walks every event fired since (measured: 27 buffer hits per pick clean, 3 715 after
30 s of a held snapshot at 500 events/s). So a pick starts at the partition's *floor*: no visible,
unlocked, due row of that partition lies below it.

How a floor rises. After a pick of partition ``p`` from its floor, everything visible below the
last row it fired is gone: the floor rises to that row's fire_at. A partition the pick examined and
found empty rises to the database's time of the pick (rows with a later fire_at were not due).

How a floor falls, for the rows a pick could not see. A row below a floor can still appear when a
transaction commits late (its rows were invisible when the pick passed), when the manager itself
puts an event back, or when an application lock made the pick skip a row. So floors fall:

- to the time a producer's notice carries: a producer notifies while the manager waits for it
  (it holds the queue's wake-up lock), and always for a row whose fire_at is older than its insert
  by more than ``qm.backdated_ms()``; the notice carries the earliest fire_at of its rows (or its
  transaction's start if earlier), and arrives at commit;
- while the manager does *not* hold the wake-up lock (busy, polling, waiting for it), producers do
  not notify and hold the lock in shared mode until they commit. The dispatcher reads those
  holders every HOLDER_CHECK seconds, less often when a reading is slow (:func:`holder_interval`);
  when one is gone (committed, :class:`HolderWatch`), floors fall to its transaction's start. A
  transaction that took and released the lock between two readings inserted after the first
  reading, and its rows' fire_at (default: the insert's time) are no earlier than that reading:
  at every reading the floors fall to the reading before it, and picks never start above it
  (a reading's time is the database's before its snapshot, and a release's the database's before
  the lock is given back);
- to the time of a release the manager made (nack, disconnect, collector), to the time an
  application's update made an event due (the queue table's ``qm_rescheduled`` trigger announces
  it, like a producer's notice), and to the time of the last holder reading when the queue is
  armed again;
- for a row an application kept locked while a pick passed (``SKIP LOCKED``): one partition at a
  time, in turn, its floor falls by SAFETY_LOOKBACK every SAFETY_INTERVAL / partitions, and every
  floor is dropped every FULL_RESET and when a session starts. (A full reset under a held
  snapshot walks every dead entry once; a partition's lookback only a minute of one partition's.)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

#: how often the holders of a disarmed queue's wake-up lock are read, seconds
HOLDER_CHECK = 0.01
#: the most of the dispatcher's time holder readings may take (holder_interval): at a fixed
#: HOLDER_CHECK on a saturated server they took more of it than the fires (docs/benchmarks-history.md,
#: "Held snapshot", runs of 2026-11-25 on `540711d`)
HOLDER_SHARE = 0.1
#: and readings are never further apart than this, seconds (a late commit's rows are found by then)
HOLDER_CHECK_MAX = 0.1
#: every partition's floor falls by SAFETY_LOOKBACK once in this many seconds (one partition at a
#: time), for a row an application kept locked while a pick passed
SAFETY_INTERVAL = 30.0
SAFETY_LOOKBACK = 60.0
#: and every floor is dropped this often
FULL_RESET = 600.0
#: kept below every time a floor is set from: float rounding of epoch seconds
EPSILON = 0.001
#: qm.backdated_ms() / 1000: a row whose fire_at is older than the moment its statement took the
#: wake-up lock by more than this is always announced; any other row's fire_at is at most this
#: much older than that moment (a row's default fire_at is taken when the row is formed, a moment
#: before its statement's trigger tries the lock)
BACKDATED = 0.010
#: how far the manager's estimate of the database clock may run ahead of it (it is measured from
#: round trips; on one machine the two clocks are one)
CLOCK_SLACK = 0.005
#: an empty partition's floor rises to the estimated database time of the pick minus this much
EMPTY_MARGIN = 0.020
#: what a holder reading (or the moment the lock was given back) bounds: rows of producers that
#: took the lock after it have a fire_at no earlier than it minus this
HOLDER_MARGIN = BACKDATED + CLOCK_SLACK


class Floors:
    """Per-partition floors (epoch seconds, database clock); None = no floor.

    A pick brackets its statement with :meth:`begin` and :meth:`after_pick`; picks of one queue
    never overlap (the dispatcher awaits each), but notices and holder readings may lower the
    floors while one runs. Those rows may have committed after the pick's snapshot, so the pick
    raises no floor above the lowest point any floor fell to meanwhile.
    """

    __slots__ = ("_f", "_fell_to")

    def __init__(self, partitions: int) -> None:
        self._f: list[float | None] = [None] * partitions
        #: the lowest point floors fell to since the last begin(); None: they did not fall
        self._fell_to: float | None = None

    def __len__(self) -> int:
        return len(self._f)

    def __getitem__(self, p: int) -> float | None:
        return self._f[p]

    def _fell(self, t: float) -> None:
        self._fell_to = t if self._fell_to is None else min(self._fell_to, t)

    def resize(self, partitions: int) -> None:
        """A partition count change: new partitions start without a floor."""
        if partitions != len(self._f):
            self._f = (self._f + [None] * partitions)[:partitions]
            self._fell(float("-inf"))

    def clear(self) -> None:
        self._f = [None] * len(self._f)
        self._fell(float("-inf"))

    def lower_one(self, p: int, by: float) -> None:
        """Partition ``p``'s floor falls by ``by`` seconds (the rotating safety net)."""
        if p < len(self._f):
            f = self._f[p]
            if f is not None:
                self._f[p] = f - by
                self._fell(f - by)

    def lower_all(self, t: float) -> None:
        """Rows with fire_at >= t may have appeared anywhere: no floor stays above t - EPSILON."""
        t -= EPSILON
        self._f = [f if f is None or f <= t else t for f in self._f]
        self._fell(t)

    def bounds(self, cap: float | None = None) -> list[float | None]:
        """The floors a pick uses, none above ``cap`` (the previous holder reading, when disarmed)."""
        if cap is None:
            return list(self._f)
        return [f if f is None or f <= cap else cap for f in self._f]

    def begin(self, cap: float | None = None) -> list[float | None]:
        """A pick starts: the floors it uses (see :meth:`bounds`)."""
        self._fell_to = None
        return self.bounds(cap)

    def after_pick(self, tops: Mapping[int, float], empty: Iterable[int], pick_time: float) -> None:
        """The pick that last called :meth:`begin` found nothing visible below ``tops`` (partition ->
        fire_at: the latest row a pick fired, the earliest row a scan saw), and nothing due at all
        in the ``empty`` partitions, as of ``pick_time`` (the estimated database time when it
        started). Floors rise accordingly, never fall, and never above where they fell to while
        the pick ran."""
        ceiling = float("inf") if self._fell_to is None else self._fell_to
        self._fell_to = None
        if ceiling == float("-inf"):  # cleared while the pick ran
            return
        f = self._f
        for p, t in tops.items():
            if p < len(f):
                target = min(t - EPSILON, ceiling)
                current = f[p]
                if current is None or target > current:
                    f[p] = target
        target = min(pick_time - EMPTY_MARGIN, ceiling)
        for p in empty:
            if p < len(f) and p not in tops:
                current = f[p]
                if current is None or target > current:
                    f[p] = target


def holder_interval(took: float) -> float:
    """Seconds from the end of a holder reading that took ``took`` seconds to the next one:
    HOLDER_CHECK, stretched so that readings take at most HOLDER_SHARE of the dispatcher's time,
    and at most HOLDER_CHECK_MAX. Any interval is safe: a pick never starts above the reading
    before the latest (:attr:`HolderWatch.cap`), however old it is."""
    return min(HOLDER_CHECK_MAX, max(HOLDER_CHECK, took * (1.0 - HOLDER_SHARE) / HOLDER_SHARE))


class HolderWatch:
    """Producer transactions that hold a queue's wake-up lock (and so did not notify).

    Times kept here are already lowered by HOLDER_MARGIN: they bound rows' fire_at directly.
    """

    __slots__ = ("_holders", "_last", "_previous")

    def __init__(self) -> None:
        self._holders: dict[int, float] = {}
        self._last: float | None = None
        self._previous: float | None = None

    @property
    def cap(self) -> float | None:
        """No pick may start above this (from the reading before the latest), None when not watching."""
        return self._previous

    @property
    def last_reading(self) -> float | None:
        return self._last

    def start(self, now: float) -> None:
        """The queue lost its wake-up lock at ``now``: producers may stop notifying from here on."""
        if self._last is None:
            self._holders = {}
            self._previous = self._last = now - HOLDER_MARGIN

    def settle(self) -> float | None:
        """Every holder known is gone (the wake-up lock was taken, or granted to the waiter): the
        earliest time from which their rows, and the rows of producers that came and went since
        the last reading, may lie. None when not watching."""
        if self._last is None:
            return None
        return min([self._last, *(start - HOLDER_MARGIN for start in self._holders.values())])

    def stop(self) -> None:
        """The queue is armed again: producers notify."""
        self._holders = {}
        self._last = self._previous = None

    def read(self, holders: Mapping[int, float | None], at: float) -> float | None:
        """A reading at database time ``at``: pid -> transaction start. Returns the earliest time
        rows of the holders gone since the last reading (they committed or rolled back) may have.

        A holder caught while it commits shows no transaction start (None). Its rows are then no
        older than its start in the previous reading, when it was seen there, or else than the
        previous reading itself (it took the lock after that reading, and rows it did not announce
        have a fire_at no earlier than the moment it took the lock, minus the margin). Its
        session's start, which stood in before, was as old as the producer's connection: under a
        held snapshot every such holder sent the picks back over every dead entry since then."""
        if any(start is None for start in holders.values()):
            since = self._last + HOLDER_MARGIN if self._last is not None else at
            known = self._holders
            holders = {pid: (start if start is not None else known.get(pid, since)) for pid, start in holders.items()}
        gone = [start for pid, start in self._holders.items() if holders.get(pid) != start]
        self._holders = {pid: start for pid, start in holders.items() if start is not None}
        low = at - HOLDER_MARGIN
        self._previous, self._last = (self._last if self._last is not None else low), low
        return min(gone) - HOLDER_MARGIN if gone else None
