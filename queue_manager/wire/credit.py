"""Credit accounting of one receiver connection, sans I/O.

The manager sends an event only while the connection holds fewer events than its *credit*; it
counts as held every event delivered and neither acked nor nacked yet: events being handled, and
events that wait for a slot. An event whose ack or nack is on its way no longer holds a slot (its
handler returned before the ack was sent), so the manager fills that slot while the ack commits.
The receiver wants the manager never to send an event for which no handler slot is free, so it
grants

    credit = handler slots - slots held by handlers whose event is no longer in hand here

The manager may then send ``credit - held`` events, which is the number of free handler slots.
An ack whose write fails puts its event back in hand on the manager; the receiver keeps it in hand
too (it may ack it again), and an event sent meanwhile for that slot waits for a free one.

A handler slot stays busy while its handler runs, also when its event is no longer in hand on
this connection: the handler ran over a reconnect, a synchronous handler kept running in its
thread after its timeout, or the event was taken back meanwhile. Such a slot lowers the credit
until the handler returns.

An event can still arrive for a busy slot when its slot turns into such a slot while the manager
already counts it free: a thread that timed out, whose nack is on its way before the lowered
credit arrives, or an ack whose write failed. It then waits (``waiting``) for the next free slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CreditBook:
    """What one connection holds and how many handler slots are busy; :attr:`credit` follows."""

    slots: int
    #: events in hand on the current connection (the manager's count of held events): id -> attempt
    in_hand: dict[int, int] = field(default_factory=dict)
    #: deliveries in hand whose handler is running
    running: set[tuple[int, int]] = field(default_factory=set)
    #: handler slots taken (by handlers of this connection's events or not)
    busy: int = 0
    #: events in hand that wait for a slot
    waiting: int = 0
    #: once draining, the credit is 0: nothing new is sent
    draining: bool = False

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.slots}")

    @property
    def orphans(self) -> int:
        """Busy slots whose event is no longer in hand on this connection."""
        return self.busy - len(self.running)

    @property
    def free(self) -> int:
        """Handler slots that no running or waiting event has taken."""
        return max(0, self.slots - self.busy - self.waiting)

    @property
    def credit(self) -> int:
        """The credit to grant: the slots not held by orphaned handlers (0 while draining)."""
        if self.draining:
            return 0
        return max(0, self.slots - self.orphans)

    @property
    def idle(self) -> bool:
        """Nothing in hand and no handler running."""
        return not self.in_hand and self.busy == 0 and self.waiting == 0

    def holds(self, ident: int, attempt: int) -> bool:
        """Whether this delivery (id at this attempt) is in hand on the current connection."""
        return self.in_hand.get(ident) == attempt

    def delivered(self, ident: int, attempt: int) -> bool:
        """An event arrived; True if a slot is free to start it now (else it waits)."""
        self.in_hand[ident] = attempt
        if self.busy < self.slots and self.waiting == 0:
            return True
        self.waiting += 1
        return False

    def can_start_waiting(self) -> bool:
        return self.waiting > 0 and self.busy < self.slots

    def started(self, ident: int, attempt: int, from_waiting: bool) -> None:
        """A handler took a slot (an event that waited gives up its place in the queue)."""
        if from_waiting:
            self.waiting -= 1
        self.busy += 1
        if self.holds(ident, attempt):
            self.running.add((ident, attempt))

    def handler_returned(self, ident: int, attempt: int) -> None:
        """A handler ended (its result, if any, is on its way): its slot is free again."""
        self.busy -= 1
        assert self.busy >= 0
        self.running.discard((ident, attempt))

    def settled(self, ident: int, attempt: int) -> None:
        """The delivery left this connection's hands: its ack or nack committed, the manager refused
        it as no longer ours (``stale``, ``unknown_id``), or the application settled it by SQL.
        A later attempt of the same id delivered meanwhile stays in hand. A handler still running
        for it keeps its slot, now an orphan's."""
        if self.in_hand.get(ident) == attempt:
            del self.in_hand[ident]
        self.running.discard((ident, attempt))

    def connection_lost(self, waiting_dropped: int) -> None:
        """The connection ended: nothing is in hand any more (the manager re-fires it all);
        ``waiting_dropped`` events that waited for a slot are forgotten. Running handlers keep
        their slots until they return."""
        self.in_hand.clear()
        self.running.clear()
        self.waiting -= waiting_dropped
        assert self.waiting >= 0
