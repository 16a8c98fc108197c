"""Per-tenant shares of dispatch: weights and in-flight caps, as pure data and functions.

A queue without tenant settings is dispatched round-robin over its partitions (``mgr_fire_due``,
``WindowCache.take``): shuffle sharding spreads tenants over partitions, producers write to the
least-loaded partition of their set, so a tenant with a backlog fills its own partitions and a
quiet tenant's events land in partitions of its set that the backlog does not hold. A queue with
tenant settings (a weight or cap override, or a default per-tenant cap) is dispatched by tenant:

**Caps.** A tenant whose events in flight (on this shard, from the ledger) reach its cap
(``max_in_flight``, else the queue's ``tenant_max_in_flight``) gets no fire until one of them is
settled; a batch never takes a tenant past its cap. Other tenants keep flowing.

**Weights: start-time fair queueing over tenants.** Each batch first takes candidates (the
earliest due events of each partition, round-robin from the cursor, about twice the batch and at
least 32, up to the batch or at least 8 per partition: :func:`candidate_quota`), then
fires the ``limit`` candidates with the smallest *start tags*. A tenant's j-th candidate (by
fire_at) has the tag ``max(F_t, V) + (j - 1) / w_t``, where ``F_t`` is the tenant's finish tag
(its served events / weight, carried across batches) and ``V`` the virtual time (the largest tag
fired so far). What it guarantees: among tenants that stay backlogged *and have candidates in
every batch*, fires are shared in proportion to the weights, whatever the batch size (1:3 for
weights 1 and 3), within one event per tenant; a tenant that was idle starts at ``V`` (it gets no
credit for its idle time, and is served before the tenants ahead of ``V``); weights never reorder
one tenant's own events (fire_at order), and never give a slot to an event that is not a
candidate (an event behind another tenant's backlog in a shared partition waits for its turn
there: weights share capacity between tenants, they do not make a partition skip its head).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from queue_manager.domain.settings import TenantSettings

K = TypeVar("K")

#: how many rows past its quota a partition's pick may look to pass events of capped tenants
CAP_LOOKAHEAD = 32
#: candidates per batch, as a multiple of the batch: room for the weights to choose
CANDIDATES_PER_FIRE = 2
#: the fewest candidates a batch looks at, and per partition: a small batch (the receivers'
#: credit frees a few slots at a time) still sees enough of each tenant for the weights to act
MIN_CANDIDATES = 32
MIN_PARTITION_CANDIDATES = 8


def candidate_quota(limit: int, partitions: int) -> tuple[int, int]:
    """(candidates per partition, candidates in all) of a fair pick of ``limit`` events."""
    per_part = min(limit, max(-(-CANDIDATES_PER_FIRE * limit // max(1, partitions)), MIN_PARTITION_CANDIDATES))
    return max(1, per_part), max(CANDIDATES_PER_FIRE * limit, MIN_CANDIDATES)


#: a tenant is over its fair share when its events in flight exceed this many times its share
OVER_SHARE_FACTOR = 2.0


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """A queue's per-tenant settings: weight and cap overrides, and the default cap."""

    weights: Mapping[str, float] = field(default_factory=dict)
    caps: Mapping[str, int] = field(default_factory=dict)
    default_cap: int | None = None

    @staticmethod
    def build(rows: Iterable[TenantSettings], default_cap: int | None) -> TenantPolicy:
        weights = {r.tenant: r.weight for r in rows if r.weight != 1.0}
        caps = {r.tenant: r.max_in_flight for r in rows if r.max_in_flight is not None}
        return TenantPolicy(weights, caps, default_cap)

    @property
    def active(self) -> bool:
        """Dispatch by tenant (the fair pick) rather than by partition alone."""
        return bool(self.weights or self.caps or self.default_cap is not None)

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def cap(self, tenant: str) -> int | None:
        return self.caps.get(tenant, self.default_cap)

    def room(self, tenant: str, in_flight: int) -> int | None:
        """Fires the tenant may still take now (None: no cap)."""
        cap = self.cap(tenant)
        return None if cap is None else max(0, cap - in_flight)


@dataclass(frozen=True, slots=True)
class FairPick:
    """The per-batch inputs of the fair pick (``mgr_fire_due_fair``)."""

    #: tenants at their cap: their rows are passed over
    capped: tuple[str, ...]
    #: tenants with a non-default tag offset, weight or room, and those values
    tenants: tuple[str, ...]
    ahead: tuple[float, ...]
    weights: tuple[float, ...]
    rooms: tuple[int | None, ...]
    #: room of a tenant not listed (it has nothing in flight): the default cap, None = no cap
    default_room: int | None


class FairShare:
    """Start-time fair queueing state of one queue: the virtual time and the tenants ahead of it."""

    __slots__ = ("finish", "vtime")

    def __init__(self) -> None:
        self.vtime = 0.0
        #: finish tags above vtime (tenants served more than their share lately)
        self.finish: dict[str, float] = {}

    def ahead(self, tenant: str) -> float:
        """How far the tenant's next start tag is above the virtual time."""
        f = self.finish.get(tenant)
        return 0.0 if f is None or f <= self.vtime else f - self.vtime

    def pick(self, policy: TenantPolicy, in_flight: Mapping[str, int], limit: int) -> FairPick:
        """The inputs of one fair pick of at most ``limit`` events, from the policy, the tenants'
        events in flight and this state.

        A tenant is listed when something about it differs from an unlisted tenant's: a weight, a
        start ahead of the virtual time, or a room that could bind in this batch (below ``limit``,
        or above a default room that is). With a default cap, the tenants in flight are many: only
        those near their cap cost a place in the arrays."""
        default = policy.default_cap
        # an unlisted tenant's room binds only when it is below the batch
        default_binds = default is not None and default < limit
        capped = []
        listed: dict[str, int | None] = {}

        def consider(tenant: str, room: int | None) -> None:
            # room None: no cap at all (no override, no default), as for an unlisted tenant
            if room is not None and (room < limit or (default_binds and room != default)):
                listed[tenant] = room

        for tenant, n in in_flight.items():
            room = policy.room(tenant, n)
            if room is not None and room <= 0:
                capped.append(tenant)
            elif n:
                consider(tenant, room)
        for tenant in policy.caps:
            if tenant not in listed and tenant not in in_flight:
                consider(tenant, policy.room(tenant, 0))
        for tenant in (*policy.weights, *self.finish):
            if tenant not in listed and tenant not in capped:
                listed[tenant] = policy.room(tenant, in_flight.get(tenant, 0))
        names = tuple(listed)
        return FairPick(
            capped=tuple(capped),
            tenants=names,
            ahead=tuple(self.ahead(t) for t in names),
            weights=tuple(policy.weight(t) for t in names),
            rooms=tuple(listed[t] for t in names),
            default_room=default,
        )

    def order(
        self,
        candidates: Sequence[tuple[K, str, float, int, int]],
        policy: TenantPolicy,
        in_flight: Mapping[str, int],
        limit: int,
    ) -> list[K]:
        """The cached path's choice among (key, tenant, fire_at, level count, level tie) candidates
        given in walk order (priority.level_counts, priority.level_ties; the tie names the level):
        up to ``limit`` of them by count, then start tag (ties in walk order), each tenant within its
        room, a tenant's candidates ranked by count, then their turn in their level (fire_at order),
        then the tie; what the SQL pick does for the direct path."""
        turn: dict[tuple[str, int], int] = {}
        lt: list[int] = [0] * len(candidates)
        for i in sorted(range(len(candidates)), key=lambda i: candidates[i][2]):
            level = (candidates[i][1], candidates[i][4])
            lt[i] = turn.get(level, 0)
            turn[level] = lt[i] + 1
        seen: dict[str, int] = {}
        tagged: list[tuple[int, float, int, K]] = []
        ranked = sorted(range(len(candidates)), key=lambda i: (candidates[i][3], lt[i], candidates[i][4]))
        for i in ranked:
            key, tenant, _, count, _ = candidates[i]
            j = seen.get(tenant, 0)
            room = policy.room(tenant, in_flight.get(tenant, 0))
            if room is not None and j >= room:
                continue
            seen[tenant] = j + 1
            tagged.append((count, self.ahead(tenant) + j / policy.weight(tenant), i, key))
        tagged.sort(key=lambda x: (x[0], x[1], x[2]))
        return [k for _, _, _, k in tagged[: max(0, limit)]]

    def charge(self, tenants: Iterable[str], policy: TenantPolicy) -> None:
        """Fires went to these tenants (one entry per event): advance their finish tags and the
        virtual time (to the largest start tag fired), and forget the tenants no longer ahead."""
        counts: dict[str, int] = {}
        for t in tenants:
            counts[t] = counts.get(t, 0) + 1
        if not counts:
            return
        v = self.vtime
        top = v
        for t, n in counts.items():
            w = policy.weight(t)
            start = max(self.finish.get(t, v), v)
            top = max(top, start + (n - 1) / w)
            self.finish[t] = start + n / w
        self.vtime = top
        for t in [t for t, f in self.finish.items() if f <= top]:
            del self.finish[t]


def over_fair_share(in_flight: Mapping[str, int], policy: TenantPolicy) -> int:
    """Tenants whose events in flight exceed OVER_SHARE_FACTOR times their fair share: the queue's
    events in flight split by weight among the tenants that have some in flight (SQS fair queues
    flag such tenants as noisy)."""
    total = sum(in_flight.values())
    if total <= 0 or len(in_flight) < 2:
        return 0
    weights = {t: policy.weight(t) for t, n in in_flight.items() if n > 0}
    wsum = sum(weights.values())
    return sum(1 for t, w in weights.items() if in_flight[t] > OVER_SHARE_FACTOR * total * w / wsum)
