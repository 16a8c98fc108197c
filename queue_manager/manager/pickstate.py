"""A queue's pick state, pure: why the dispatcher looks at the queue again, whether it has a
backlog, where its round-robin picks start, and who waits for room. No event loop, no database, no
clock: each transition is a method that takes what happened, and the dispatcher (dispatch.py)
does the I/O. It sits beside :class:`~.wakestate.WakeState` (the wake-up lock, poll mode and the
floors) in each :class:`~.queues.QueueRuntime`.

**Nudges.** Anything that may change what a queue can fire calls :meth:`PickState.nudge` with a
:class:`Reason` (through ``Runtime.nudge``, which also wakes the dispatcher). A reason in
RESCAN_REASONS makes the next round rescan the window; :attr:`Reason.DUE` makes it fire what is
due without a rescan; :attr:`Reason.CREDIT` only wakes it. :meth:`PickState.take_nudges` takes
them at the start of a round, before any await, so that one arriving meanwhile counts for the next.

**The window's rescans.** :meth:`PickState.scanned` records a scan and when the next safety-net
slice is due; :meth:`PickState.next_slice` names the partitions of that slice (the slices take
turns: every partition once per RESCAN_SLICES ticks).

**A pick's outcome.** :meth:`PickState.direct_start` tells a ``mgr_fire_due`` pick where to start
and from when partitions count as sparse; :meth:`PickState.direct_fired` records what it fired:
the backlog (the batch was full, or a partition gave its whole quota: more is due now), the
round-robin cursor (``plan.cursor_after``) and the pick's time. :meth:`PickState.fair_fired` does
the same for a fair pick (tenant settings), with the tenants it stopped at their cap.

**Room again.** Tenants a pick passed over at their cap (:attr:`PickState.cap_blocked`) make the
next round fire as soon as one of them has room (:meth:`PickState.room_again`), without waiting
for a nudge; :attr:`PickState.cache_held` says the cache's due events were all held back by caps.
So do the concurrency keys a pick passed over at their limit (:attr:`PickState.key_blocked`,
:meth:`PickState.key_room_again`), and a pick that passed over rate keys without a token fires
again when the first of them has one (:meth:`PickState.rate_wait`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from enum import Enum

from queue_manager.manager import plan
from queue_manager.manager.fairness import TenantPolicy
from queue_manager.manager.keys import KeyPolicy
from queue_manager.manager.priority import level_counts, level_ties

#: the periodic rescan covers 1/RESCAN_SLICES of a queue's partitions per tick
RESCAN_SLICES = plan.RESCAN_SLICES


class Reason(Enum):
    """Why the dispatcher should look at a queue again."""

    #: a producer committed events, some scheduled for later (NOTIFY '<queue>'): rescan
    NOTIFIED = "notified"
    #: a producer committed events that are all due now (NOTIFY '<queue> due'), or a silent
    #: receiver showed life (events may be due that no one could take): fire, no rescan
    DUE = "due"
    #: events went back to to_be_fired (nack, release, collector): rescan
    REQUEUED = "requeued"
    #: a receiver has room again (credit frame, acks, an ack by SQL)
    CREDIT = "credit"
    #: a new subscriber
    SUBSCRIBED = "subscribed"
    #: the queue's wake-up lock was taken, or waited for: rescan what committed before
    ARMED = "armed"
    #: its settings changed (window, partitions, resumed)
    SETTINGS = "settings"
    #: a new leadership session: nothing in memory is trusted
    SESSION = "session"


#: reasons after which the window is rescanned, not only fired from
RESCAN_REASONS = frozenset(
    {Reason.NOTIFIED, Reason.REQUEUED, Reason.SUBSCRIBED, Reason.ARMED, Reason.SETTINGS, Reason.SESSION}
)


class PickState:
    """One queue's dispatch state between rounds (see the module's docstring)."""

    __slots__ = (
        "backlog",
        "cache_held",
        "cap_blocked",
        "caps",
        "cursor",
        "dirty",
        "due_hint",
        "key_blocked",
        "last_pick",
        "level_oldest",
        "next_scan",
        "rate_until",
        "rescan_slice",
        "scanned_future_only",
        "turn",
    )

    def __init__(self) -> None:
        #: the window may hold something the cache does not know: rescan (set by nudge only)
        self.dirty = True
        #: producers committed events that were all due at once: a direct fire finds them
        self.due_hint = False
        #: loop time of the next safety-net slice of the window
        self.next_scan = 0.0
        #: the last pick was full: more events are due now
        self.backlog = False
        #: the last full scan left due events to mgr_fire_due (future_only)
        self.scanned_future_only = False
        #: round-robin position of mgr_fire_due, kept across batches
        self.cursor = 0
        #: the database time of the last mgr_fire_due: partitions with nothing due before it go
        #: first in the next one (plan.sparse_partitions)
        self.last_pick: float | None = None
        #: the subscriber that ties of free credit start from, moved on at each batch
        self.turn = 0
        #: the slice of partitions the next periodic rescan covers (see RESCAN_SLICES)
        self.rescan_slice = 0
        #: tenants a pick passed over or stopped at their cap: when one has room again, fire
        self.cap_blocked: set[str] = set()
        #: the cache's due events were all held back by their tenants' caps in the last round
        self.cache_held = False
        #: concurrency keys a pick passed over or stopped at their limit: when one has room, fire
        self.key_blocked: set[str] = set()
        #: a pick passed over rate keys without a token: fire again at this loop time (None: none)
        self.rate_until: float | None = None
        #: each priority level's oldest due event as the last pick read it (level -> epoch seconds,
        #: database clock), from which the next pick's counts of the levels come (priority.level_counts)
        self.level_oldest: dict[int, float | None] = {}
        #: the read caps of the next mgr_fire_due's streams ((partition, level) -> rows; others: the
        #: quota), when the first level's backlog sits in a few partitions (priority.next_caps)
        self.caps: dict[tuple[int, int], int] = {}

    # ------------------------------------------------------------------ nudges

    def nudge(self, reason: Reason) -> None:
        if reason in RESCAN_REASONS:
            self.dirty = True
        elif reason is Reason.DUE:
            self.due_hint = True

    def take_nudges(self) -> tuple[bool, bool]:
        """(rescan, due) since the last call; taken before any await, so a nudge that arrives
        meanwhile counts for the next round."""
        dirty, hint = self.dirty, self.due_hint
        self.dirty = self.due_hint = False
        return dirty, hint

    # ------------------------------------------------------------------ the window's rescans

    def scanned(self, full: bool, future_only: bool, next_scan: float) -> None:
        """A scan of the window ended (``full``: every partition); the next slice is due at ``next_scan``."""
        if full:
            self.scanned_future_only = future_only
        self.next_scan = next_scan

    def next_slice(self, partitions: int) -> list[int]:
        """The partitions of the next periodic rescan; the slices take turns."""
        i = self.rescan_slice
        self.rescan_slice = (i + 1) % RESCAN_SLICES
        return [p for p in range(partitions) if p % RESCAN_SLICES == i]

    # ------------------------------------------------------------------ picks

    def next_turn(self) -> int:
        """Where ties of free credit start in this batch: one subscriber further on than the last."""
        self.turn += 1
        return self.turn

    def level_counts(self, now: float, aging: float | None) -> list[int]:
        """Each level's count for a pick at database time ``now`` (priority.level_counts), from the
        oldest due events the last pick read."""
        return level_counts(self.level_oldest, now, aging)

    def level_ties(self) -> list[int]:
        """Which of the levels that count the same goes first in this pick (priority.level_ties):
        they take turns, one further on per batch."""
        return level_ties(self.turn)

    def levels_read(self, oldest: Sequence[float | None]) -> None:
        """A pick read these oldest due events of levels 1, 2, ... (None: none of that level)."""
        self.level_oldest = {v: t for v, t in enumerate(oldest, start=1)}

    def direct_start(self) -> tuple[int, float | None]:
        """(cursor, since) of a ``mgr_fire_due`` pick: sparse partitions first only behind a
        backlog; after a pick that took everything due, every partition's due events are new, and
        the walk's probes would buy nothing."""
        return self.cursor, self.last_pick if self.backlog else None

    def direct_fired(
        self,
        fired: Mapping[int, int],
        heads: Mapping[int, float],
        since: float | None,
        pick_time: float,
        full: bool,
        partitions: int,
    ) -> None:
        """A ``mgr_fire_due`` pick at database time ``pick_time`` fired ``fired`` (partition ->
        events, whose earliest fire_at is ``heads``); ``full``: the batch reached its limit or a
        partition gave its whole quota, so more are due now."""
        self.last_pick = pick_time
        self.backlog = full
        if fired:
            self.cursor = plan.cursor_after(self.cursor, fired, heads, since, partitions)

    def fair_fired(self, fired: Mapping[int, int], full: bool, capped: Iterable[str], partitions: int) -> None:
        """A fair pick fired ``fired`` (partition -> events); ``full``: more are due now; ``capped``:
        tenants it stopped at, or passed over at, their cap (they may have more due)."""
        self.backlog = full
        self.cap_blocked.update(capped)
        if fired:
            self.cursor = plan.next_cursor(self.cursor, fired, partitions)

    # ------------------------------------------------------------------ room again

    def room_again(self, in_flight: Mapping[str, int], policy: TenantPolicy) -> bool:
        """A tenant held back by its cap has room again (an ack freed a slot): its due events may
        be fired at once. Clears the record when so."""
        if not self.cap_blocked:
            return False
        for t in self.cap_blocked:
            room = policy.room(t, in_flight.get(t, 0))
            if room is None or room > 0:
                self.cap_blocked.clear()
                return True
        return False

    def key_room_again(self, held: Mapping[str, int], keys: KeyPolicy, now: float) -> bool:
        """A concurrency key held back at its limit has room again, or the rate keys passed over
        have a token by ``now`` (loop time): fire at once. Clears the record when so."""
        if self.rate_until is not None and now >= self.rate_until:
            self.rate_until = None
            return True
        for k in self.key_blocked:
            cap = keys.max_in_flight(k)
            if cap is None or held.get(k, 0) < cap:
                self.key_blocked.clear()
                return True
        return False

    def keys_passed(self, blocked: Iterable[str], rate_until: float | None) -> None:
        """A pick passed over (or stopped at their limit) these concurrency keys, and rate keys
        without a token, the first of which has one at ``rate_until`` (loop time; None: none)."""
        self.key_blocked.update(blocked)
        if rate_until is not None:
            self.rate_until = rate_until if self.rate_until is None else min(self.rate_until, rate_until)

    def rate_wait(self, now: float) -> float:
        """Seconds until the rate keys passed over have a token (inf: none was)."""
        return float("inf") if self.rate_until is None else max(0.0, self.rate_until - now)

    def policy_changed(self) -> None:
        """The tenants' caps or the keys' limits changed: who was held back is to be seen again."""
        self.cap_blocked.clear()
        self.key_blocked.clear()
        self.rate_until = None

    def reset(self) -> None:
        """A session ended: nothing in memory is trusted, rescan from scratch."""
        self.nudge(Reason.SESSION)
