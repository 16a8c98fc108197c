"""Credit accounting of one receiver connection, sans I/O.

The manager sends an event only while the connection holds fewer events than its *credit*,
where it counts as held every event delivered and not yet settled (acked, nacked or taken back):
events being handled and events whose ack or nack is on its way. The receiver wants the manager
to be able to send exactly as many events as it has free handler slots, so it keeps

    credit = events in hand (on this connection) + free handler slots

A handler slot is busy while a handler runs, including a handler whose event is no longer in
hand on this connection (it ran over a reconnect, or a synchronous handler kept running in its
thread after its timeout); such a slot counts as busy but not in hand, so the credit drops by one
until that handler returns. Events delivered but not yet started (see below) take a slot in
advance.

The manager frees a slot when an ack commits, a moment before the lowered credit that follows
the ``ack_result`` reaches it; it may then send one event more than there are free slots. Such an
event waits (``waiting``) for the next slot to free up, and takes that slot in advance.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CreditBook:
    """What one connection holds and how many handler slots are busy; :attr:`credit` follows."""

    slots: int
    #: events in hand on the current connection: (id -> attempt)
    in_hand: dict[int, int] = field(default_factory=dict)
    #: handler slots taken (by handlers of this connection or of an earlier one)
    busy: int = 0
    #: events in hand that wait for a slot
    waiting: int = 0
    #: once draining, the credit is 0: nothing new is sent
    draining: bool = False

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.slots}")

    @property
    def free(self) -> int:
        """Handler slots that no running or waiting event has taken."""
        return max(0, self.slots - self.busy - self.waiting)

    @property
    def credit(self) -> int:
        """The credit to grant: events in hand + free slots (0 while draining)."""
        if self.draining:
            return 0
        return len(self.in_hand) + self.free

    @property
    def idle(self) -> bool:
        """Nothing in hand and no handler running."""
        return not self.in_hand and self.busy == 0 and self.waiting == 0

    def delivered(self, ident: int, attempt: int) -> bool:
        """An event arrived; True if a slot is free to start it now (else it waits)."""
        self.in_hand[ident] = attempt
        if self.busy < self.slots and self.waiting == 0:
            return True
        self.waiting += 1
        return False

    def started(self, from_waiting: bool) -> None:
        """A handler took a slot (an event that waited gives up its place in the queue)."""
        if from_waiting:
            self.waiting -= 1
        self.busy += 1

    def can_start_waiting(self) -> bool:
        return self.waiting > 0 and self.busy < self.slots

    def handler_returned(self) -> None:
        """A handler ended: its slot is free again."""
        self.busy -= 1
        assert self.busy >= 0

    def holds(self, ident: int, attempt: int) -> bool:
        """Whether this delivery (id at this attempt) is in hand on the current connection."""
        return self.in_hand.get(ident) == attempt

    def settled(self, ident: int, attempt: int) -> None:
        """The delivery left this connection's hands: its ack or nack committed, the manager refused
        it as no longer ours (``stale``, ``unknown_id``), or the application settled it by SQL.
        A later attempt of the same id delivered meanwhile stays in hand."""
        if self.in_hand.get(ident) == attempt:
            del self.in_hand[ident]

    def connection_lost(self, waiting_dropped: int) -> None:
        """The connection ended: nothing is in hand any more (the manager re-fires it all);
        ``waiting_dropped`` events that waited for a slot are forgotten. Running handlers keep
        their slots until they return."""
        self.in_hand.clear()
        self.waiting -= waiting_dropped
        assert self.waiting >= 0
