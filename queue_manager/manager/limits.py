"""A queue's rate and concurrency limits across shards, as pure arithmetic: no I/O, no clock.

``max_qps`` and ``max_concurrency`` hold for all shards together. Each shard's active manager
holds a *slice* of each limit and publishes it, with what it wants, in a lease row that it writes
to every reachable shard's database (``qm.rate_leases``); it reads its peers' rows from its own
shard's database only (``budget.py`` does the I/O, docs/design.md "Rate and concurrency limits
across shards" gives the argument). This module decides:

- :func:`allocate`: the max-min fair shares of a limit among the live managers, by what each
  wants; what nobody wants is split evenly, so an idle shard keeps a standing share;
- :class:`Slice`: one manager's slice of one limit. It lowers its slice at once (before it
  publishes the lower value), and raises it in two steps: it publishes the higher value as a
  *pending claim*, then, after reading its peers again, takes what the peers' claims leave, unless
  a peer with a lower shard name has a pending claim too (which then goes first);
- :class:`Liveness`: whether a peer's row is live, by the database's clock or by ours;
- :class:`TokenBucket`: the fire rate at the slice, with a burst of at most ``BURST_SECONDS`` of
  it, so a pause or an outage never builds up credit to catch up with;
- :class:`QueueLimits`: what the dispatcher asks (how many may go now, how long to wait) and
  what the budget loop asks (what this manager wants), for one queue.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

INF = math.inf
#: a bucket holds at most this many seconds of its rate (and at least one event): the burst. It
#: must cover one fire's round trip (a fire waits for its WAL flush), or the rate is lost while the
#: bucket sits full; measured on a busy 2-core machine, 20 ms lost 5 % of 100/s, 40 ms kept it
BURST_SECONDS = 0.04
#: fires cut by a limit this recently, with more events due, make a manager ask for all it can get
SATURATION_HOLD = 1.0
#: a manager that is not cut by its rate asks for its measured rate times this (room to grow)
WANT_HEADROOM = 1.5
#: weight of the newest measurement in the smoothed fire rate, per second of measurement
RATE_SMOOTHING = 0.5
#: tokens closer than this to a whole event count as that event (float rounding)
_EPS = 1e-9


def _tolerance(value: float) -> float:
    """Float rounding in sums of shares (a third of 5 three times is not quite 5)."""
    return _EPS * max(1.0, abs(value))


def burst_for(rate: float) -> float:
    """A bucket's depth at ``rate``: BURST_SECONDS of it, at least one event, none at rate 0."""
    return 0.0 if rate <= 0 else max(1.0, rate * BURST_SECONDS)


class TokenBucket:
    """Events may be fired at ``rate`` per second, at most ``burst_for(rate)`` at once.

    The bucket starts empty and never holds more than its burst: time spent not firing (a pause,
    an outage, an empty queue) earns no credit beyond that, so nothing fires faster to catch up.
    In any interval of T seconds at most ``rate * T + burst`` events are admitted.
    """

    def __init__(self) -> None:
        self.rate = 0.0
        self.burst = 0.0
        self.tokens = 0.0
        self._at: float | None = None

    def _refill(self, now: float) -> None:
        if self._at is not None and now > self._at:
            self.tokens = min(self.burst, self.tokens + (now - self._at) * self.rate)
        if self._at is None or now > self._at:
            self._at = now

    def set_rate(self, rate: float, now: float) -> None:
        """Fire at ``rate`` from ``now`` on (what was earned until now at the old rate is kept,
        within the new burst)."""
        self._refill(now)
        self.rate = max(0.0, rate)
        self.burst = burst_for(self.rate)
        self.tokens = min(self.tokens, self.burst)

    def available(self, now: float) -> int:
        """Whole events that may be fired at ``now``."""
        self._refill(now)
        return int(self.tokens + _EPS)

    def take(self, n: int, now: float) -> None:
        """``n`` events go (at most what ``available`` said)."""
        self._refill(now)
        self.tokens = max(0.0, self.tokens - n)

    def give_back(self, n: int, now: float) -> None:
        """``n`` events taken were not fired after all (within the burst)."""
        self._refill(now)
        self.tokens = min(self.burst, self.tokens + n)

    def wait(self, now: float) -> float:
        """Seconds until one more event may be fired (inf at rate 0)."""
        self._refill(now)
        if self.tokens + _EPS >= 1.0:
            return 0.0
        if self.rate <= 0:
            return INF
        return (1.0 - self.tokens) / self.rate


def allocate(total: float, wants: Mapping[str, float]) -> dict[str, float]:
    """Max-min fair shares of ``total`` by what each participant wants (``inf``: all it can get).

    Participants that want less than an even split get what they want; the others split the rest
    evenly. What nobody wants is then split evenly among all, so that an idle participant keeps a
    standing share and fires its next event without asking first. Every participant computes the
    same shares from the same rows (ties go by name).
    """
    n = len(wants)
    if n == 0:
        return {}
    out: dict[str, float] = {}
    remaining = float(total)
    for i, (name, want) in enumerate(sorted(wants.items(), key=lambda kv: (kv[1], kv[0]))):
        give = max(0.0, min(max(0.0, want), remaining / (n - i)))
        out[name] = give
        remaining -= give
    if remaining > 0:
        for name in out:
            out[name] += remaining / n
    return out


def allocate_int(total: int, wants: Mapping[str, float]) -> dict[str, int]:
    """:func:`allocate` in whole units (in-flight slots): the floors, then the units left over one
    each by the largest fraction (ties by name), never more than ``total`` in all."""
    shares = allocate(total, wants)
    out = {name: max(0, math.floor(v + _EPS)) for name, v in shares.items()}
    order = sorted(shares, key=lambda k: (-(shares[k] - out[k]), k))
    left = total - sum(out.values())
    for name in order:
        if left <= 0:
            break
        out[name] += 1
        left -= 1
    for name in reversed(order):  # float rounding made the floors too many: take the excess back
        while left < 0 and out[name] > 0:
            out[name] -= 1
            left += 1
    return out


@dataclass(frozen=True, slots=True)
class Peer:
    """Another shard's manager, for one limit of one queue, as its live row says."""

    shard: str
    #: what it wants (inf: all it can get)
    want: float
    #: the most it may be using: its slice, a pending raise, or (concurrency) its events in flight
    claim: float
    #: it published a raise it has not taken yet
    pending: bool


class Slice:
    """One manager's slice of one limit of one queue.

    Invariant, for every peer that considers this manager live: what it uses (``used``) is at
    most the claim it published there. A lower slice is therefore used at once and published
    after; a higher one is published first (a pending claim) and used only after a fresh read of
    the peers' rows leaves room for it (:meth:`adopt`).
    """

    def __init__(self, integral: bool) -> None:
        #: whole units (in-flight slots) rather than a rate
        self.integral = integral
        #: the slice in force here
        self.used = 0.0
        #: what the last plan gave this manager
        self.target = 0.0
        #: what this manager publishes: at least ``used`` and ``target``
        self.claim = 0.0

    @property
    def pending(self) -> bool:
        return self.target - self.used > _tolerance(self.target)

    def plan(self, total: float, me: str, want: float, peers: Sequence[Peer], hold: float = 0.0) -> bool:
        """Before a publish: this manager's share of ``total`` given its peers' last rows; a lower
        share is used at once. ``hold``: what cannot be given back at once (events in flight).
        True when the slice went down."""
        wants = {p.shard: p.want for p in peers}
        wants[me] = want
        target = float((allocate_int(int(total), wants) if self.integral else allocate(total, wants))[me])
        self.target = target
        lowered = target < self.used
        if lowered:
            self.used = target
        self.claim = max(target, self.used, hold)
        return lowered

    def adopt(self, total: float, me: str, peers: Sequence[Peer], reached_all: bool) -> bool:
        """After the publish reached every live peer's database and a fresh read of the rows on
        this shard's database: take a pending raise as far as the peers' claims leave room for.

        Two managers raising at once each publish, then read: one of them sees the other's pending
        claim (each writes into the other's database before it reads its own), and of two that see
        each other the one with the higher shard name waits. So among the raises taken in one
        round, the one of the lowest name counted every other one's claim. True when it went up.
        """
        if not self.pending or not reached_all:
            return False
        if any(p.pending and p.shard < me for p in peers):
            return False
        room = total - sum(p.claim for p in peers)
        new = self.target if room >= self.target - _tolerance(total) else room
        if self.integral:
            new = float(math.floor(new + _EPS))
        if new > self.used:
            self.used = new
            return True
        return False

    def drop(self) -> None:
        """Nothing is used any more (the session ended)."""
        self.used = self.target = self.claim = 0.0


class Liveness:
    """Whether a peer's lease row is live, as read on this shard's database.

    By the database's clock: the row's age (``clock_timestamp() - renewed_at``, both of the
    database that stores this copy) is under its ttl, so skew between servers never enters. By
    ours: its version changed less than its ttl ago by our monotonic clock, which keeps a row we
    saw renewed live even if that database's clock stepped forward. Live if either says so. A
    resigned row is never live.
    """

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str], tuple[tuple[int, int], float]] = {}

    def live(
        self,
        key: tuple[str, str],
        version: tuple[int, int],
        db_live: bool,
        resigned: bool,
        ttl: float,
        now: float,
    ) -> bool:
        prev = self._seen.get(key)
        if prev is None:
            changed = -INF  # first sighting: when it changed is unknown, the database says
        elif prev[0] != version:
            changed = now
        else:
            changed = prev[1]
        self._seen[key] = (version, changed)
        if resigned:
            return False
        return db_live or now < changed + ttl

    def forget(self) -> None:
        self._seen.clear()


class QueueLimits:
    """One queue's limits in this manager: the slices, the bucket, and what it wants.

    Until the budget has published and confirmed a slice (``trusted_until``, by the monotonic
    clock), a limited queue fires nothing.
    """

    def __init__(self) -> None:
        self.rate = Slice(integral=False)
        self.concurrency = Slice(integral=True)
        self.bucket = TokenBucket()
        #: the slices may be used until then (monotonic seconds)
        self.trusted_until = -INF
        #: the trust ran out before a publish renewed it (counted once per lapse)
        self.lapsed = False
        #: the last admit() gave less than asked: by the rate, by the concurrency slice
        self.cut = False
        self.cut_by_rate_at = -INF
        self.cut_by_concurrency_at = -INF
        #: tokens taken by the last admit() and not yet settled by spent()
        self._reserved = 0
        #: events fired since the last measure()
        self._fired = 0
        self._measured_at: float | None = None
        #: smoothed fire rate, events per second
        self.fire_rate = 0.0

    def trusted(self, now: float) -> bool:
        return now < self.trusted_until

    def rate_now(self, max_qps: float, now: float) -> float:
        """The rate this manager may fire at: its slice, never above the queue's limit (a lower
        limit applies before the budget's next round), 0 while the slice is not trusted."""
        return min(self.rate.used, max_qps) if self.trusted(now) else 0.0

    def concurrency_now(self, max_concurrency: int, now: float) -> int:
        return min(int(self.concurrency.used), max_concurrency) if self.trusted(now) else 0

    def _sync(self, max_qps: float, now: float) -> None:
        rate = self.rate_now(max_qps, now)
        if rate != self.bucket.rate:
            self.bucket.set_rate(rate, now)

    def admit(self, limit: int, in_flight: int, max_qps: float | None, max_concurrency: int | None, now: float) -> int:
        """How many of ``limit`` events (what credit and the batch allow) may be fired now.

        Their tokens are taken at once, so the bucket refills while the fire runs; :meth:`spent`
        gives back those not fired (as does the next admit(), for a fire that never happened).
        """
        if self._reserved:
            self.bucket.give_back(self._reserved, now)
            self._reserved = 0
        allowed = limit
        if max_concurrency is not None:
            room = self.concurrency_now(max_concurrency, now) - in_flight
            if room < allowed:
                allowed = room
                self.cut_by_concurrency_at = now
        if max_qps is not None:
            self._sync(max_qps, now)
            tokens = self.bucket.available(now)
            if tokens < allowed:
                allowed = tokens
                self.cut_by_rate_at = now
        self.cut = allowed < limit
        allowed = max(0, allowed)
        if max_qps is not None and allowed:
            self.bucket.take(allowed, now)
            self._reserved = allowed
        return allowed

    def spent(self, fired: int, now: float) -> None:
        """``fired`` of the events the last admit() allowed were fired."""
        unused = self._reserved - fired
        self._reserved = 0
        if unused > 0:
            self.bucket.give_back(unused, now)
        self._fired += max(0, fired)

    def wait(self, in_flight: int, max_qps: float | None, max_concurrency: int | None, now: float) -> float:
        """Seconds until the limits admit one more event: 0 when they do now, inf when only an
        ack or a larger slice can."""
        if max_concurrency is not None and self.concurrency_now(max_concurrency, now) - in_flight <= 0:
            return INF
        if max_qps is None:
            return 0.0
        self._sync(max_qps, now)
        return self.bucket.wait(now)

    def measure(self, now: float) -> None:
        """Fold the events fired since the last call into the smoothed fire rate."""
        if self._measured_at is not None and now > self._measured_at:
            dt = now - self._measured_at
            weight = min(1.0, dt * RATE_SMOOTHING)
            self.fire_rate += weight * (self._fired / dt - self.fire_rate)
        self._fired = 0
        self._measured_at = now

    def wants(self, now: float, more_due: bool, in_flight: int, dispatching: bool) -> tuple[float, float]:
        """(rate, in-flight slots) this manager asks for: all it can get of a limit that cut its
        fires recently while more events are due; otherwise its measured rate with room to grow,
        and the slots it holds. Nothing while it does not dispatch the queue (paused, no receiver)."""
        if not dispatching:
            return 0.0, float(in_flight)
        rate = INF if more_due and now - self.cut_by_rate_at < SATURATION_HOLD else self.fire_rate * WANT_HEADROOM
        slots = INF if more_due and now - self.cut_by_concurrency_at < SATURATION_HOLD else float(in_flight)
        return rate, slots
