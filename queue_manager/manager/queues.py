"""What the active manager knows of each queue: settings, window cache, ledger, subscribers, and
why the dispatcher should look at it again.

Anything that may change what a queue can fire calls :meth:`QueueRuntime.nudge` with a
:class:`Reason` (through ``Runtime.nudge``, which also wakes the dispatcher). The reason decides
what the dispatcher does next: rescan the window, fire what is due, or only look at credit again.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from queue_manager.domain.settings import QueueSettings
from queue_manager.manager.cache import WindowCache
from queue_manager.manager.fairness import FairShare, TenantPolicy
from queue_manager.manager.keys import KeyPolicy, RateBuckets
from queue_manager.manager.limits import QueueLimits
from queue_manager.manager.pickstate import RESCAN_REASONS, RESCAN_SLICES, PickState, Reason
from queue_manager.manager.priority import PRIORITY_LEVELS
from queue_manager.manager.wakestate import WakeState
from queue_manager.wire.ledger import Ledger

__all__ = ["RESCAN_REASONS", "RESCAN_SLICES", "QueueRuntime", "Reason", "Subscriber", "active"]


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
    """A queue's settings, window cache, in-flight ledger and subscribers, as the active manager sees
    them, with its pick state and wake-up state."""

    def __init__(self, settings: QueueSettings) -> None:
        self.settings = settings
        self.cache = WindowCache()
        self.ledger = Ledger()
        self.subscribers: list[Subscriber] = []
        #: nudges, backlog, round-robin cursor, rescan slices, tenants waiting for room (pickstate.py)
        self.pick = PickState()
        #: the wake-up lock, poll mode, the holder readings and the floors (wakestate.py)
        self.wake_state = WakeState(settings.partitions_physical, PRIORITY_LEVELS)
        #: this manager's slices of max_qps and max_concurrency, and its token bucket (budget.py)
        self.limits = QueueLimits()
        #: per-tenant weights and caps (fairness.py); inactive: dispatch by partition alone
        self.policy = TenantPolicy(default_cap=settings.tenant_max_in_flight)
        #: start-time fair queueing state across batches (used while the policy is active)
        self.fair = FairShare()
        #: the concurrency and rate limits per key (keys.py), and the rate keys' token buckets
        self.keys = KeyPolicy(settings.key_max_in_flight, settings.key_max_qps)
        self.rates = RateBuckets()

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
        self.pick.nudge(reason)

    def room_again(self, now: float) -> bool:
        """A tenant or a concurrency key held back by its cap has room again (an ack freed a slot),
        or a rate key held back has a token: its due events may be fired at once."""
        tenants = self.pick.room_again(self.ledger.by_tenant(), self.policy)
        keys = self.pick.key_room_again(self.ledger.by_key(), self.keys, now)
        return tenants or keys

    @property
    def limited(self) -> bool:
        """Picks go by the limited pick (mgr_fire_due_fair): tenant settings or key limits apply."""
        return self.policy.active or self.keys.active

    def direct(self) -> bool:
        """Due events go by mgr_fire_due when every subscriber takes every tenant."""
        return all(c.tenants is None for c in self.subscribers)

    def next_slice(self) -> list[int]:
        """The partitions of the next periodic rescan; the slices take turns."""
        return self.pick.next_slice(self.settings.partitions_physical)

    def reset(self) -> None:
        """A session ended: the cache, the floors and the wake-up state are gone; rescan from scratch."""
        self.cache.clear()
        self.wake_state.reset()
        self.limits = QueueLimits()  # the session's slices were given back: the next one starts from none
        self.pick.reset()


def active(queues: Iterable[QueueRuntime]) -> list[QueueRuntime]:
    """Queues to dispatch: subscribed and not paused."""
    return [q for q in queues if q.subscribers and not q.settings.paused]
