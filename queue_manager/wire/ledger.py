"""The in-flight ledger of one queue: which connection holds which event, at which attempt, since when.

It is the single truth on deliveries in hand. A push records a delivery; an ack or nack claims it
(so a second one is a ``duplicate``) and settles it once the database has answered; the collector,
an ack by SQL and a disconnect drop it. Everything else is derived from it: a connection's used
credit (its events in hand less those whose ack or nack is on its way, up to its credit: the
receiver's handler is done with them, so their slots are free on its side while the write
commits), the queue's events in flight (``max_concurrency``), a tenant's events in flight
(per-tenant caps), a key's events fired and unsettled (``key_max_in_flight``), who gets the slot
back.

A key's count also holds the events fired that no connection holds: *strays*, left fired by
another leadership term (recounted from the table when a session starts: :meth:`Ledger.strays_found`),
or on their way back to the table (a connection that went away, a push with no receiver left: they
count until the release has committed). Each leaves by :meth:`Ledger.drop`, as a delivery does,
when the database says it left ``fired``. Plain data, no I/O: ``tests/unit/test_session.py`` checks its invariants.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum


@dataclass(slots=True)
class Delivery:
    """One event in hand: pushed to ``holder`` (a connection id) at ``attempt``."""

    id: int
    attempt: int
    holder: int
    #: monotonic seconds of the push (ack latency)
    pushed_at: float
    #: an ack or nack of it is on its way to the database
    settling: bool = False
    #: the event's tenant (per-tenant caps count events in flight by tenant)
    tenant: str = ""
    #: its concurrency key, scoped by its tenant (manager/keys.py); None: none
    key: str | None = None


class Claim(Enum):
    """What a connection's ack, nack or extend of (id, attempt) finds in the ledger."""

    OK = "ok"
    #: not in hand on this connection
    UNKNOWN = "unknown"
    #: in hand on this connection, at another attempt
    STALE = "stale"
    #: an ack or nack of it is already on its way
    DUPLICATE = "duplicate"


class Ledger:
    """Deliveries in hand for one queue, by event id and by holder."""

    __slots__ = ("_by_holder", "_by_key", "_by_tenant", "_events", "_settling", "_strays")

    def __init__(self) -> None:
        self._events: dict[int, Delivery] = {}
        self._by_holder: dict[int, dict[int, Delivery]] = {}
        self._by_tenant: dict[str, int] = {}
        #: events fired and unsettled per concurrency key: deliveries and strays
        self._by_key: dict[str, int] = {}
        #: events fired that no connection holds: id -> (attempt, key)
        self._strays: dict[int, tuple[int, str]] = {}
        #: per holder, its deliveries in hand whose ack or nack is on its way (holders with none are absent)
        self._settling: dict[int, int] = {}

    def __len__(self) -> int:
        """Events in flight in the queue (fired, pushed, not settled)."""
        return len(self._events)

    def __contains__(self, ident: object) -> bool:
        return ident in self._events

    def get(self, ident: int) -> Delivery | None:
        return self._events.get(ident)

    def held_by(self, holder: int) -> int:
        """How many events ``holder`` has in hand."""
        held = self._by_holder.get(holder)
        return 0 if held is None else len(held)

    def settling_by(self, holder: int) -> int:
        """How many of ``holder``'s events in hand have an ack or nack on its way. Such an event no
        longer holds a handler slot of the receiver, so its slot may be filled again while the
        write commits, not one commit later (``ReceiverSession.free``)."""
        return self._settling.get(holder, 0)

    def by_tenant(self) -> dict[str, int]:
        """Events in flight per tenant (tenants with none are absent). The ledger's own dict: read only."""
        return self._by_tenant

    def by_key(self) -> dict[str, int]:
        """Events fired and unsettled per concurrency key, strays included (keys with none are
        absent). The ledger's own dict: read only."""
        return self._by_key

    @property
    def strays(self) -> int:
        return len(self._strays)

    def _count_key(self, key: str | None, n: int) -> None:
        if key is None:
            return
        v = self._by_key.get(key, 0) + n
        if v:
            self._by_key[key] = v
        else:
            del self._by_key[key]

    def stray(self, ident: int, attempt: int, key: str | None) -> None:
        """An event fired at ``attempt`` that no connection holds (a push with no receiver left): it
        counts for its key until :meth:`drop` (the release committed)."""
        if key is not None and ident not in self._events and ident not in self._strays:
            self._strays[ident] = (attempt, key)
            self._count_key(key, 1)

    def strays_found(self, fired: list[tuple[int, int, str]]) -> int:
        """A session starts: ``fired`` are the (id, attempt, key) of the events with a concurrency
        key that the table has fired. Those no connection of ours holds are the strays from now on
        (the ones known before and no longer fired are forgotten). Returns how many there are."""
        for _, (_, key) in self._strays.items():
            self._count_key(key, -1)
        self._strays = {}
        for ident, attempt, key in fired:
            if ident not in self._events:  # a delivery of it counts it already (at whatever attempt)
                self._strays[ident] = (attempt, key)
                self._count_key(key, 1)
        return len(self._strays)

    def deliveries_of(self, holder: int) -> list[Delivery]:
        return list(self._by_holder.get(holder, {}).values())

    def in_hand(self) -> list[tuple[int, int]]:
        """Every delivery in hand, as (id, attempt)."""
        return [(d.id, d.attempt) for d in self._events.values()]

    def unsettled(self) -> list[Delivery]:
        """Deliveries in hand with no ack or nack on its way."""
        return [d for d in self._events.values() if not d.settling]

    def hold(
        self, holder: int, ident: int, attempt: int, now: float, tenant: str = "", key: str | None = None
    ) -> None:
        """Record a push. A record of an older fire of the same event (a re-fire that raced the
        collector's notice) is replaced: the database fired it again, so only this one counts."""
        self.hold_many(holder, now, ((ident, attempt, tenant, key),))

    def hold_many(self, holder: int, now: float, pushes: Iterable[tuple[int, int, str, str | None]]) -> None:
        """Record the pushes of one batch to ``holder``, each (id, attempt, tenant, key), as
        :meth:`hold` does one (the dispatcher's path: one call per batch, not per event)."""
        events = self._events
        by_tenant = self._by_tenant
        by_holder = self._by_holder
        held = None
        for ident, attempt, tenant, key in pushes:
            old = events.get(ident)
            if old is not None:
                self._forget(old)
                held = None  # forgetting a holder's last delivery drops its dict
            if self._strays:
                self._drop_stray(ident, None)
            if held is None:
                held = by_holder.get(holder)
                if held is None:
                    held = by_holder[holder] = {}
            events[ident] = held[ident] = Delivery(ident, attempt, holder, now, False, tenant, key)
            by_tenant[tenant] = by_tenant.get(tenant, 0) + 1
            if key is not None:
                self._count_key(key, 1)

    def lookup(self, holder: int, ident: int, attempt: int) -> tuple[Claim, Delivery | None]:
        """Is (ident, attempt) in hand on ``holder``? (An extend's check: it claims nothing.)"""
        d = self._events.get(ident)
        if d is None or d.holder != holder:
            return Claim.UNKNOWN, None
        if d.attempt != attempt:
            return Claim.STALE, d
        return Claim.OK, d

    def claim(self, holder: int, ident: int, attempt: int) -> tuple[Claim, Delivery | None]:
        """Mark (ident, attempt) as being settled by ``holder``'s ack or nack, if it may be."""
        found, d = self.lookup(holder, ident, attempt)
        if found is not Claim.OK or d is None:
            return found, d
        if d.settling:
            return Claim.DUPLICATE, d
        d.settling = True
        self._settling[holder] = self._settling.get(holder, 0) + 1
        return Claim.OK, d

    def claim_many(
        self, holder: int, items: Sequence[tuple[int, int]]
    ) -> list[tuple[int, Claim, Delivery | None]]:
        """:meth:`claim` each (id, attempt) of one frame, in order; returns those not claimed, as
        (their index in ``items``, what was found, the delivery found): empty when all were."""
        events = self._events
        refused: list[tuple[int, Claim, Delivery | None]] = []
        claimed = 0
        for i, (ident, attempt) in enumerate(items):
            d = events.get(ident)
            if d is None or d.holder != holder:
                refused.append((i, Claim.UNKNOWN, None))
            elif d.attempt != attempt:
                refused.append((i, Claim.STALE, d))
            elif d.settling:
                refused.append((i, Claim.DUPLICATE, d))
            else:
                d.settling = True
                claimed += 1
        if claimed:
            self._settling[holder] = self._settling.get(holder, 0) + claimed
        return refused

    def unclaim(self, ident: int, attempt: int) -> None:
        """The write of a claimed ack or nack of (ident, attempt) was not recorded: it may be tried
        again. A later delivery of the event (re-fired meanwhile) keeps its own claim."""
        d = self._events.get(ident)
        if d is not None and d.attempt == attempt and d.settling:
            d.settling = False
            self._unsettle(d.holder)

    def _unsettle(self, holder: int) -> None:
        n = self._settling[holder] - 1
        if n:
            self._settling[holder] = n
        else:
            del self._settling[holder]

    def settle(self, ident: int, attempt: int) -> Delivery | None:
        """The database answered a claimed ack or nack of (ident, attempt): that delivery leaves the
        ledger. A later one stays: a nack's release commits before its answer reaches the session,
        and the dispatcher may fire and push the event again in between."""
        d = self._events.get(ident)
        if d is None or d.attempt != attempt:
            return None
        self._forget(d)
        return d

    def settle_many(self, items: Iterable[tuple[int, int]]) -> list[Delivery]:
        """:meth:`settle` each (id, attempt) of one answered write; returns the deliveries that left."""
        events = self._events
        by_holder = self._by_holder
        by_tenant = self._by_tenant
        out = []
        for ident, attempt in items:
            d = events.get(ident)
            if d is None or d.attempt != attempt:
                continue
            out.append(d)
            if d.key is not None:
                self._forget(d)
                continue
            # _forget, inline for the common case (no key)
            del events[ident]
            if d.settling:
                self._unsettle(d.holder)
            held = by_holder[d.holder]
            del held[ident]
            if not held:
                del by_holder[d.holder]
            n = by_tenant[d.tenant] - 1
            if n:
                by_tenant[d.tenant] = n
            else:
                del by_tenant[d.tenant]
        return out

    def drop(self, ident: int, attempt: int | None = None) -> Delivery | None:
        """The event left its holder another way (the collector re-fired it, an application acked
        it by SQL, its release committed): forget it, if it is still held (or a stray) at
        ``attempt`` (any attempt when None)."""
        self._drop_stray(ident, attempt)
        d = self._events.get(ident)
        if d is None or (attempt is not None and d.attempt != attempt):
            return None
        self._forget(d)
        return d

    def _drop_stray(self, ident: int, attempt: int | None) -> None:
        s = self._strays.get(ident)
        if s is not None and (attempt is None or s[0] == attempt):
            del self._strays[ident]
            self._count_key(s[1], -1)

    def release_holder(self, holder: int) -> list[Delivery]:
        """The holder went away: forget and return its deliveries that are not being settled; those
        with a key stay counted for it, as strays, until their release is dropped.

        Those being settled stay until their write is answered.
        """
        held = self._by_holder.get(holder)
        if not held:
            return []
        out = [d for d in held.values() if not d.settling]
        for d in out:
            self._forget(d)
            self.stray(d.id, d.attempt, d.key)
        return out

    def _forget(self, d: Delivery) -> None:
        del self._events[d.id]
        if d.settling:
            self._unsettle(d.holder)
        held = self._by_holder[d.holder]
        del held[d.id]
        if not held:
            del self._by_holder[d.holder]
        n = self._by_tenant[d.tenant] - 1
        if n:
            self._by_tenant[d.tenant] = n
        else:
            del self._by_tenant[d.tenant]
        self._count_key(d.key, -1)

    def check(self) -> None:
        """Raise AssertionError unless the two indexes agree (for tests)."""
        seen = 0
        for holder, held in self._by_holder.items():
            assert held, f"holder {holder} kept with nothing in hand"
            for ident, d in held.items():
                assert self._events.get(ident) is d and d.holder == holder, (holder, ident)
                seen += 1
        assert seen == len(self._events), (seen, len(self._events))
        counts: dict[str, int] = {}
        for d in self._events.values():
            counts[d.tenant] = counts.get(d.tenant, 0) + 1
        assert counts == self._by_tenant, (counts, self._by_tenant)
        keys: dict[str, int] = {}
        for d in self._events.values():
            if d.key is not None:
                keys[d.key] = keys.get(d.key, 0) + 1
        for ident, (_, key) in self._strays.items():
            assert ident not in self._events, ident
            keys[key] = keys.get(key, 0) + 1
        assert keys == self._by_key, (keys, self._by_key)
        settling: dict[int, int] = {}
        for d in self._events.values():
            if d.settling:
                settling[d.holder] = settling.get(d.holder, 0) + 1
        assert settling == self._settling, (settling, self._settling)
