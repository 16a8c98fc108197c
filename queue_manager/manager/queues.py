"""What the active manager knows of each queue: settings, window cache, ledger, subscribers, and
why the dispatcher should look at it again.

Anything that may change what a queue can fire calls :meth:`QueueRuntime.nudge` with a
:class:`Reason` (through ``Runtime.nudge``, which also wakes the dispatcher). The reason decides
what the dispatcher does next: rescan the window, fire what is due, or only look at credit again.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum
from typing import Protocol

from queue_manager.domain.settings import QueueSettings
from queue_manager.manager.cache import WindowCache
from queue_manager.manager.fairness import FairShare, TenantPolicy
from queue_manager.manager.limits import QueueLimits
from queue_manager.manager.wakestate import WakeState
from queue_manager.wire.ledger import Ledger

#: the periodic rescan covers 1/RESCAN_SLICES of a queue's partitions per tick
RESCAN_SLICES = 4


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


class Subscriber(Protocol):
    """A receiver connection, as the dispatcher sees it."""

    @property
    def id(self) -> int: ...

    @property
    def free(self) -> int: ...

    @property
    def tenants(self) -> frozenset[str] | None: ...

    @property
    def closed(self) -> bool: ...

    @property
    def silent(self) -> bool:
        """An event it held passed its ack deadline and it has shown no life since (it has no
        free credit meanwhile)."""
        ...

    @property
    def lapsed(self) -> bool:
        """An event it held passed its ack deadline and it has settled nothing since (it gets
        events only when no other subscriber with credit takes them)."""
        ...

    def timed_out(self) -> None:
        """The collector took back an event it held, past its ack deadline."""
        ...

    def send(self, text: str) -> None: ...

    def cancelled(self, ident: int, attempt: int) -> None:
        """An operator cancelled (ident, attempt), which it holds."""
        ...

    def close_soon(self, code: int, reason: str) -> None: ...


class QueueRuntime:
    """A queue's settings, window cache, in-flight ledger and subscribers, as the active manager sees them."""

    def __init__(self, settings: QueueSettings) -> None:
        self.settings = settings
        self.cache = WindowCache()
        self.ledger = Ledger()
        self.subscribers: list[Subscriber] = []
        #: the window may hold something the cache does not know: rescan (set by nudge only)
        self.dirty = True
        #: producers committed events that were all due at once: a direct fire finds them
        self.due_hint = False
        #: the wake-up lock, poll mode, the holder readings and the floors (wakestate.py)
        self.wake_state = WakeState(settings.partitions_physical)
        self.next_scan = 0.0
        #: the last direct fire was full: more events are due now
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
        #: this manager's slices of max_qps and max_concurrency, and its token bucket (budget.py)
        self.limits = QueueLimits()
        #: per-tenant weights and caps (fairness.py); inactive: dispatch by partition alone
        self.policy = TenantPolicy(default_cap=settings.tenant_max_in_flight)
        #: start-time fair queueing state across batches (used while the policy is active)
        self.fair = FairShare()
        #: tenants a pick passed over or stopped at their cap: when one has room again, fire
        self.cap_blocked: set[str] = set()
        #: the cache's due events were all held back by their tenants' caps in the last round
        self.cache_held = False

    @property
    def name(self) -> str:
        return self.settings.name

    @property
    def id(self) -> int:
        return self.settings.id

    @property
    def in_flight(self) -> int:
        return len(self.ledger)

    def nudge(self, reason: Reason, since: float | None = None) -> None:
        """``since``: rows with a fire_at from then on (database clock) may have appeared."""
        if since is not None:
            self.wake_state.lower_floors(since)
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

    def room_again(self) -> bool:
        """A tenant held back by its cap has room again (an ack freed a slot): its due events may
        be fired at once. Clears the record when so."""
        if not self.cap_blocked:
            return False
        counts = self.ledger.by_tenant()
        policy = self.policy
        for t in self.cap_blocked:
            room = policy.room(t, counts.get(t, 0))
            if room is None or room > 0:
                self.cap_blocked.clear()
                return True
        return False

    def direct(self) -> bool:
        """Due events go by mgr_fire_due when every subscriber takes every tenant."""
        return all(c.tenants is None for c in self.subscribers)

    def next_slice(self) -> list[int]:
        """The partitions of the next periodic rescan; the slices take turns."""
        i = self.rescan_slice
        self.rescan_slice = (i + 1) % RESCAN_SLICES
        return [p for p in range(self.settings.partitions_physical) if p % RESCAN_SLICES == i]

    def reset(self) -> None:
        """A session ended: the cache, the floors and the wake-up state are gone; rescan from scratch."""
        self.cache.clear()
        self.wake_state.reset()
        self.limits = QueueLimits()  # the session's slices were given back: the next one starts from none
        self.nudge(Reason.SESSION)


def active(queues: Iterable[QueueRuntime]) -> list[QueueRuntime]:
    """Queues to dispatch: subscribed and not paused."""
    return [q for q in queues if q.subscribers and not q.settings.paused]
