"""A queue's wake-up state, pure: whether producers announce their rows, whether the queue is
polled, and where the dispatcher's picks start. No event loop, no database, no clock: each
transition is a method that takes the time, and the dispatcher (dispatch.py) does the I/O.

Two clocks meet here: ``now`` is the event loop's (monotonic seconds); ``at``, ``db_now``,
``since`` and ``pick_time`` are the database's (epoch seconds), as the floors are.

**The wake-up lock** (design.md, "Waking the manager without a NOTIFY per producer"; the waiter
and the listener are in wakeups.py) is in one of three states, :class:`Lock`:

- ``ARMED``: this session holds it, so every producer notifies (notices.py);
- ``WAITING``: a waiter asks for it behind a producer's open transaction, which holds it shared;
  every other producer's try fails, so they notify;
- ``RELEASED``: nobody asks for it (the queue is busy or polled, or a session has just started).
  Producers do not notify: each holds the lock shared until it commits. The dispatcher reads
  those holders (:class:`~.floors.HolderWatch`) every ``HOLDER_CHECK`` or so, lowers the floors
  to the start of each that is gone, and starts no pick above the reading before the latest.

Its transitions:

- RELEASED -> ARMED, :meth:`WakeState.took_lock`: the dispatcher, idle, took the lock. Rows of
  producers that did not notify may lie from the time it returns on: the dispatcher rescans.
- RELEASED -> WAITING, :meth:`WakeState.wait_started`: the try failed and a waiter was started.
- WAITING, :meth:`WakeState.wait_seen`: the waiter's request is seen queued; rescan (a producer
  that committed before it was queued notified nobody).
- WAITING -> RELEASED, :meth:`WakeState.wait_ended`: the request was granted (the open
  transaction ended; the waiter gave the lock back) or failed; rescan, then arm when idle.
- WAITING -> RELEASED, :meth:`WakeState.wait_dropped`: the queue is polled, the waiter dropped.
- ARMED -> RELEASED, :meth:`WakeState.released`: the queue is busy (a backlog, polling, or due
  events and no credit): producers' NOTIFYs would only cost them.
- any -> RELEASED, :meth:`WakeState.reset`: a session ended or starts; the floors go too.

**Poll mode**, beside the lock. A NOTIFY makes the producer's commit take a database-wide lock
held through its WAL flush, so while the manager waits on a queue that gets many single-row
transactions, those producers commit one at a time (measured: 8 connections could not reach
2 000 inserts/s). When POLL_ENTER_WAKES wake-ups of a queue come within POLL_ENTER_SPAN seconds
(500/s or more, :meth:`WakeState.burst`), the queue is polled: the dispatcher gives its lock back
(producers stop notifying) and fires due events every POLL_INTERVAL instead, for as long as its
polls fire at least POLL_STAY_RATE events a second (:meth:`WakeState.polled`); POLL_LINGER after
the last poll that showed that rate, it arms the queue again. A burst is not a rate: a producer
that catches up after a stall (or a manager that reads a stall's notices at once) makes one, and
before the rate was checked a queue of 200 commits a second then stayed polled for good (every
poll fired something within POLL_LINGER), each event waiting for the next poll and every poll
costing the server a statement.

**The floors** (floors.py): where the picks of each partition start, one per priority level of the
partition (a *slot*: :meth:`WakeState.slot`), since a pick reads each level of a partition in
fire_at order from its own floor (docs/design.md, "Priorities"). Picks bracket their
statement with :meth:`WakeState.pick_floors` and :meth:`WakeState.picked`; a notice, a release or
a holder gone lowers them (:meth:`WakeState.lower_floors`); :meth:`WakeState.safety_net` lowers
one partition's in turn and drops them all now and then, for rows an application kept locked
while a pick passed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from enum import Enum

from queue_manager.manager.floors import FULL_RESET, SAFETY_INTERVAL, SAFETY_LOOKBACK, Floors, HolderWatch

#: poll mode's trigger: this many wake-ups of a queue within POLL_ENTER_SPAN seconds
POLL_ENTER_WAKES = 8
POLL_ENTER_SPAN = 0.016
#: while polled, due events are fetched this often, seconds
POLL_INTERVAL = 0.001
#: and the queue stays polled until this long passes without POLL_STAY_RATE, seconds
POLL_LINGER = 0.05
#: polls that fire fewer events a second than this (over POLL_LINGER) let the mode end: half the
#: entry's rate, so that a queue near it does not switch at every burst
POLL_STAY_RATE = POLL_ENTER_WAKES / POLL_ENTER_SPAN / 2


class Lock(Enum):
    """Who asks for a queue's wake-up lock."""

    #: nobody: producers do not notify, their holdings of the lock are read
    RELEASED = "released"
    #: this session holds it: producers notify
    ARMED = "armed"
    #: a waiter asks for it behind a producer's open transaction: producers notify
    WAITING = "waiting"


class WakeState:
    """One queue's wake-up lock, poll mode, holder readings and floors (see the module's docstring)."""

    __slots__ = (
        "_floors",
        "_holders",
        "_levels",
        "_lock",
        "_lookback_at",
        "_lookback_partition",
        "_next_reading",
        "_partitions",
        "_poll_until",
        "_polls",
        "_reset_at",
        "_wakes",
    )

    def __init__(self, partitions: int, levels: int = 1) -> None:
        #: a floor per partition and priority level: slot ``p * levels + level - 1``
        self._partitions = partitions
        self._levels = levels
        self._lock = Lock.RELEASED
        #: loop times of the latest wake-ups, and the end of poll mode
        self._wakes: deque[float] = deque(maxlen=POLL_ENTER_WAKES)
        self._poll_until = 0.0
        #: loop times and events fired of the polls within the last POLL_LINGER
        self._polls: deque[tuple[float, int]] = deque()
        self._floors = Floors(partitions * levels)
        #: producers holding the lock while it is not armed, and the loop time of the next reading
        self._holders = HolderWatch()
        self._next_reading = 0.0
        #: the safety net's loop times: every floor dropped, and the next partition's lookback
        self._reset_at = 0.0
        self._lookback_at = 0.0
        self._lookback_partition = 0

    # ------------------------------------------------------------------ the wake-up lock

    @property
    def lock(self) -> Lock:
        return self._lock

    @property
    def armed(self) -> bool:
        return self._lock is Lock.ARMED

    @property
    def waiting(self) -> bool:
        return self._lock is Lock.WAITING

    def took_lock(self) -> float | None:
        """Armed: producers notify from now on. Returns the earliest time from which the rows of
        producers that did not notify (seen holding the lock or not) may lie; None when the
        holders were not watched."""
        since = self._holders.settle()
        self._holders.stop()
        self._lock = Lock.ARMED
        return since

    def wait_started(self) -> None:
        """The try failed (a producer's open transaction holds the lock): a waiter asks for it."""
        self._lock = Lock.WAITING

    def wait_seen(self) -> float | None:
        """The waiter's request is seen queued: from when rows of producers that committed before
        it was, without notifying, may lie."""
        return self._holders.settle()

    def wait_ended(self) -> float | None:
        """The waiter's request was granted (and the lock given back at once), or failed: from
        when the rows of the transaction it waited for may lie."""
        if self._lock is Lock.WAITING:
            self._lock = Lock.RELEASED
        return self._holders.settle()

    def wait_dropped(self) -> None:
        """The waiter was cancelled: the queue is polled, producers need not notify."""
        if self._lock is Lock.WAITING:
            self._lock = Lock.RELEASED

    def released(self, db_now: float) -> None:
        """The lock was given back at ``db_now``: producers stop notifying from then on."""
        self._lock = Lock.RELEASED
        self._holders.start(db_now)

    def reset(self) -> None:
        """A session ended or starts: no lock, no holder known, no floor."""
        self._lock = Lock.RELEASED
        self._holders.stop()
        self._floors.clear()

    # ------------------------------------------------------------------ holder readings

    def reading_due(self, now: float) -> bool:
        """The holders of the lock are to be read now (producers do not all notify)."""
        return self._lock is not Lock.ARMED and now >= self._next_reading

    def until_reading(self, now: float) -> float:
        """Seconds until the next holder reading (inf while armed)."""
        return float("inf") if self._lock is Lock.ARMED else max(0.0, self._next_reading - now)

    def read_holders(self, holders: Mapping[int, float | None], at: float, next_reading: float) -> float | None:
        """A reading at database time ``at`` (pid -> transaction start, see
        :meth:`HolderWatch.read`); the next one at loop time ``next_reading``. Returns the earliest
        time the rows of the holders gone since the last reading may have (None: none is gone)."""
        self._holders.start(at)
        self._next_reading = next_reading
        gone = self._holders.read(holders, at)
        # A producer that took the lock after the reading before this one and committed before
        # this one was never seen: its rows are no older than that reading (HolderWatch.cap), and
        # only a pick that starts after this reading sees them. So the floors themselves fall to
        # it, and stay there until such a pick raises them. Capping only where picks start lost the
        # bound when readings went on without a pick (no receiver credit, a receivers' link
        # partition): the cap moved on, a floor an earlier pick had raised stayed above the rows,
        # and they waited for the safety lookback (18 to 30 s in the fault suite).
        cap = self._holders.cap
        if cap is not None:
            self._floors.lower_all(cap)
        return gone

    # ------------------------------------------------------------------ poll mode

    def woken(self, now: float) -> None:
        """A producer's notice arrived."""
        self._wakes.append(now)

    def burst(self, now: float) -> bool:
        """Enter poll mode when the last POLL_ENTER_WAKES wake-ups came within POLL_ENTER_SPAN;
        True when it did (also when it was polled already: the mode lasts longer)."""
        w = self._wakes
        if len(w) == POLL_ENTER_WAKES and w[-1] - w[0] < POLL_ENTER_SPAN:
            self._poll_until = now + POLL_LINGER
            self._polls.clear()
            w.clear()
            return True
        return False

    def polling(self, now: float) -> bool:
        """In poll mode: the lock given back, due events fetched every POLL_INTERVAL."""
        return now < self._poll_until

    def polled(self, now: float, fired: int) -> None:
        """A poll fired ``fired`` events: while the polls of the last POLL_LINGER fired at least
        POLL_STAY_RATE a second, the mode lasts until POLL_LINGER from now; below that rate it ends
        when its linger runs out (producers notify again)."""
        polls = self._polls
        polls.append((now, fired))
        while polls[0][0] <= now - POLL_LINGER:
            polls.popleft()
        if sum(n for _, n in polls) >= POLL_STAY_RATE * POLL_LINGER:
            self._poll_until = now + POLL_LINGER

    # ------------------------------------------------------------------ floors

    def safety_net(self, now: float) -> None:
        """For a row an application kept locked while a pick passed (``SKIP LOCKED``): every floor
        is dropped every FULL_RESET, and between those one partition's floor in turn falls by
        SAFETY_LOOKBACK every SAFETY_INTERVAL / partitions."""
        if now >= self._reset_at:
            self._floors.clear()  # one pick from the start of each partition
            self._reset_at = now + FULL_RESET
        elif now >= self._lookback_at:
            partitions = max(1, self._partitions)
            for slot in self.slots_of(self._lookback_partition % partitions):
                self._floors.lower_one(slot, SAFETY_LOOKBACK)
            self._lookback_partition = (self._lookback_partition + 1) % partitions
            self._lookback_at = now + SAFETY_INTERVAL / partitions

    @property
    def levels(self) -> int:
        return self._levels

    def slot(self, partition: int, level: int) -> int:
        """The floor of ``partition``'s priority ``level`` (1..levels)."""
        return partition * self._levels + level - 1

    def slots_of(self, partition: int) -> range:
        """The floors of every level of ``partition``."""
        return range(partition * self._levels, (partition + 1) * self._levels)

    @property
    def floors(self) -> list[float | None]:
        """Each slot's floor as it stands (None: none)."""
        return self._floors.bounds()

    def pick_floors(self) -> list[float | None]:
        """A pick starts: where it starts in each slot (None: from the start), never above the
        holder reading before the latest while the lock is not armed."""
        return self._floors.begin(self._holders.cap)

    def picked(self, tops: Mapping[int, float], empty: Iterable[int], pick_time: float) -> None:
        """The pick that last called :meth:`pick_floors` ended (see :meth:`Floors.after_pick`);
        ``tops`` and ``empty`` by slot."""
        self._floors.after_pick(tops, empty, pick_time)

    def lower_floors(self, since: float) -> None:
        """Rows with a fire_at from ``since`` on may have appeared in any partition."""
        self._floors.lower_all(since)

    def resize(self, partitions: int) -> None:
        """The queue's partition count changed: new partitions start without a floor."""
        self._partitions = partitions
        self._floors.resize(partitions * self._levels)
