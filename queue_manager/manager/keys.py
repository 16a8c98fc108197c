"""Concurrency and rate limits per key, as pure data and arithmetic: no I/O, no clock.

An event may name a ``concurrency_key`` and a ``rate_key``. Both are keys *of its tenant*: the
limits count the pair (tenant, key), written here as one string (:func:`scoped`), and a tenant
lives on one shard, so one manager sees every event of a key and the limits are exact.

**Concurrency.** At most ``max_in_flight`` events of one concurrency key are fired and unsettled at
once (the key's own, else the queue's ``key_max_in_flight``; :class:`KeyPolicy`). The manager counts
them in its in-flight ledger (``Ledger.by_key``): the deliveries it holds, and the events fired that
no connection holds (left by the previous leader, or on their way back to the table), which a new
session recounts from the table before its first pick. A pick passes over the events of a key at
its limit and takes at most a key's room (:func:`concurrency_rooms`); the other keys of the
partition go on (no head-of-line blocking).

**Rate.** At most ``max_qps`` events of one rate key are fired per second (the key's own, else the
queue's ``key_max_qps``), with a burst of one: :class:`RateBuckets` keeps a token bucket per key of
depth one token, so in any window of T seconds a key is fired at most ``max_qps * T + 1`` times. A
bucket that is full again is forgotten (a new one starts full, which is the same), so the buckets
held are those of the keys fired within the last ``1 / max_qps`` seconds: at most the manager's fire
rate times the longest ``1 / max_qps`` of the keys it fires.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from queue_manager.domain.settings import KeySettings

#: between a tenant and its key in a scoped key (the unit separator: not in any sensible key)
SEP = "\x1f"
#: a rate bucket holds at most this many tokens: the burst a key may be fired with
RATE_BURST = 1.0
#: tokens closer than this to a whole event count as that event (float rounding)
_EPS = 1e-9


def scoped(tenant: str, key: str | None) -> str | None:
    """The limits' name of a tenant's key (None: the event has none)."""
    return None if key is None else tenant + SEP + key


def unscoped(key: str) -> tuple[str, str]:
    """(tenant, key) of a scoped key."""
    tenant, _, name = key.partition(SEP)
    return tenant, name


@dataclass(frozen=True, slots=True)
class KeyPolicy:
    """A queue's key limits: the defaults and the overrides of single keys (scoped)."""

    default_in_flight: int | None = None
    default_qps: float | None = None
    in_flight: Mapping[str, int] = field(default_factory=dict)
    qps: Mapping[str, float] = field(default_factory=dict)

    @staticmethod
    def build(rows: Iterable[KeySettings], default_in_flight: int | None, default_qps: float | None) -> KeyPolicy:
        in_flight: dict[str, int] = {}
        qps: dict[str, float] = {}
        for r in rows:
            key = r.tenant + SEP + r.key
            if r.max_in_flight is not None:
                in_flight[key] = r.max_in_flight
            if r.max_qps is not None:
                qps[key] = r.max_qps
        return KeyPolicy(default_in_flight, default_qps, in_flight, qps)

    @property
    def limits_concurrency(self) -> bool:
        return self.default_in_flight is not None or bool(self.in_flight)

    @property
    def limits_rate(self) -> bool:
        return self.default_qps is not None or bool(self.qps)

    @property
    def active(self) -> bool:
        """Some key limit applies: picks go by the limited pick (``mgr_fire_due_fair``)."""
        return self.limits_concurrency or self.limits_rate

    def max_in_flight(self, key: str) -> int | None:
        return self.in_flight.get(key, self.default_in_flight)

    def max_qps(self, key: str) -> float | None:
        return self.qps.get(key, self.default_qps)


@dataclass(frozen=True, slots=True)
class KeyRooms:
    """What a pick may take of each key: none of ``blocked``; at most ``rooms[i]`` of ``keys[i]``;
    at most ``default`` of any other key (None: no limit)."""

    blocked: tuple[str, ...] = ()
    keys: tuple[str, ...] = ()
    rooms: tuple[int, ...] = ()
    default: int | None = None

    @property
    def holds_back(self) -> bool:
        """Some key may have nothing taken now."""
        return bool(self.blocked) or self.default == 0 or 0 in self.rooms

    def room(self, key: str) -> int | None:
        if key in self.blocked:
            return 0
        try:
            return self.rooms[self.keys.index(key)]
        except ValueError:
            return self.default


#: no key limit
UNLIMITED = KeyRooms()


def concurrency_rooms(policy: KeyPolicy, held: Mapping[str, int], limit: int) -> KeyRooms:
    """The rooms of a pick of at most ``limit`` events, from the events of each key in hand
    (``held``: scoped key -> events fired and unsettled): a key at its limit is blocked, a key
    with events in hand or its own limit is listed with its room, any other has the default."""
    if not policy.limits_concurrency:
        return UNLIMITED
    blocked: list[str] = []
    keys: list[str] = []
    rooms: list[int] = []
    for key, n in held.items():
        cap = policy.max_in_flight(key)
        if cap is None:
            continue  # no limit for this key
        if cap - n <= 0:
            blocked.append(key)
        else:
            keys.append(key)
            rooms.append(min(cap - n, limit))
    for key, cap in policy.in_flight.items():
        if key not in held:
            keys.append(key)
            rooms.append(min(cap, limit))
    default = policy.default_in_flight
    return KeyRooms(tuple(blocked), tuple(keys), tuple(rooms), None if default is None else min(default, limit))


class RateBuckets:
    """One token bucket per rate key of a queue, of depth RATE_BURST, refilled at the key's max_qps.

    A key without a bucket has a full one, or, in the first moments of a leadership session, the
    tokens earned since the session's start (``origin``): a new leader does not know what its
    predecessor fired, so it starts every key empty, and a failover never adds a burst.
    :meth:`spent` takes one token per event fired; a bucket is dropped once it is full again
    (:meth:`prune`), so memory follows the keys fired lately.
    """

    __slots__ = ("_buckets", "_pruned_at", "origin")

    def __init__(self, origin: float = -math.inf) -> None:
        #: key -> (tokens, as of) for the keys below a full bucket
        self._buckets: dict[str, tuple[float, float]] = {}
        self._pruned_at = -math.inf
        #: every bucket was empty then (a session's start, monotonic seconds)
        self.origin = origin

    def __len__(self) -> int:
        return len(self._buckets)

    def tokens(self, key: str, rate: float, now: float) -> float:
        b = self._buckets.get(key)
        if b is None:
            b = (0.0, self.origin)
        tokens, at = b
        return min(RATE_BURST, tokens + max(0.0, now - at) * rate)

    def spent(self, key: str, rate: float, now: float, n: int = 1) -> None:
        """``n`` events of ``key`` were fired at ``now``."""
        self._buckets[key] = (max(0.0, self.tokens(key, rate, now) - n), now)

    def prune(self, policy: KeyPolicy, now: float, every: float = 1.0) -> None:
        """Forget the buckets that are full again (at most once per ``every`` seconds)."""
        if now - self._pruned_at < every:
            return
        self._pruned_at = now
        full = [
            k
            for k in self._buckets
            if (rate := policy.max_qps(k)) is None or self.tokens(k, rate, now) >= RATE_BURST - _EPS
        ]
        for k in full:
            del self._buckets[k]

    def rooms_at(self, policy: KeyPolicy, now: float) -> KeyRooms:
        """A pick's rooms at ``now``: none for a key with less than one token, at most one event of
        any other limited key (the burst is one); keys without a limit are not counted."""
        if not policy.limits_rate:
            return UNLIMITED

        def fresh(rate: float) -> int:
            """The room of a key not fired in this session: one once a whole token is earned."""
            return 1 if (now - self.origin) * rate >= 1.0 - _EPS else 0

        default = None if policy.default_qps is None else fresh(policy.default_qps)
        blocked = []
        keys: list[str] = []
        rooms: list[int] = []
        for key in self._buckets:
            rate = policy.max_qps(key)
            if rate is None:
                continue
            if self.tokens(key, rate, now) < 1.0 - _EPS:
                blocked.append(key)
            elif default != 1:  # a whole token (full again, not pruned yet): one event
                keys.append(key)
                rooms.append(1)
        for key, rate in policy.qps.items():
            if key not in self._buckets and (default is None or fresh(rate) != default):
                keys.append(key)
                rooms.append(fresh(rate))
        return KeyRooms(tuple(blocked), tuple(keys), tuple(rooms), default)

    def wait(self, policy: KeyPolicy, now: float) -> float:
        """Seconds until the next key below one token has one (inf: none is)."""
        best = math.inf
        for rate in (policy.default_qps, *policy.qps.values()):
            if rate and (now - self.origin) * rate < 1.0:  # a session's first token of a key not fired yet
                best = min(best, self.origin + 1.0 / rate - now)
        for key in self._buckets:
            rate = policy.max_qps(key)
            if rate is None or rate <= 0:
                continue
            missing = 1.0 - self.tokens(key, rate, now)
            if missing > _EPS:
                best = min(best, missing / rate)
        return best


class KeyAdmission:
    """One batch of the cached path, key by key: what it may still take of each key (the pick's
    rooms less what it took), and whether it passed over anything for want of room."""

    __slots__ = ("_c", "_r", "_took_c", "_took_r", "passed")

    def __init__(self, ckeys: KeyRooms, rkeys: KeyRooms) -> None:
        self._c = ckeys
        self._r = rkeys
        self._took_c: dict[str, int] = {}
        self._took_r: dict[str, int] = {}
        #: an event was refused for want of room
        self.passed = False

    @staticmethod
    def _left(rooms: KeyRooms, took: Mapping[str, int], key: str | None) -> bool:
        if key is None or rooms is UNLIMITED:
            return True
        room = rooms.room(key)
        return room is None or took.get(key, 0) < room

    def allows(self, ckey: str | None, rkey: str | None) -> bool:
        ok = self._left(self._c, self._took_c, ckey) and self._left(self._r, self._took_r, rkey)
        if not ok:
            self.passed = True
        return ok

    def took(self, ckey: str | None, rkey: str | None) -> None:
        if ckey is not None:
            self._took_c[ckey] = self._took_c.get(ckey, 0) + 1
        if rkey is not None:
            self._took_r[rkey] = self._took_r.get(rkey, 0) + 1


#: how many keys the metrics, /health and ``qm status`` list by events in hand
TOP_KEYS = 10


def top_keys(
    held: Mapping[str, int], policy: KeyPolicy, n: int = TOP_KEYS
) -> tuple[list[tuple[str, str, int, int | None]], int]:
    """The ``n`` concurrency keys with the most events in hand, as (tenant, key, events in hand, its
    limit or None), and how many keys are held at their limit."""
    at_limit = 0
    for key, count in held.items():
        cap = policy.max_in_flight(key)
        if cap is not None and count >= cap:
            at_limit += 1
    top = sorted(held.items(), key=lambda kv: (-kv[1], kv[0]))[:n]
    return [(*unscoped(k), c, policy.max_in_flight(k)) for k, c in top], at_limit
