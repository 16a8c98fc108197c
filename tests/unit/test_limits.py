"""The arithmetic of the limits across shards (queue_manager/manager/limits.py), without a database:
the token bucket, the fair shares, a slice's two-step raise, liveness, and a simulation of the
whole publish/read protocol under every interleaving hypothesis finds."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from queue_manager.manager.limits import (
    BURST_SECONDS,
    INF,
    SATURATION_HOLD,
    WANT_HEADROOM,
    Liveness,
    Peer,
    QueueLimits,
    Slice,
    TokenBucket,
    allocate,
    allocate_int,
    burst_for,
)

# ---------------------------------------------------------------------------------------- bucket


def test_a_bucket_starts_empty_and_fires_at_its_rate() -> None:
    b = TokenBucket()
    b.set_rate(100.0, now=0.0)
    assert b.available(0.0) == 0
    assert b.wait(0.0) == pytest.approx(0.01)
    assert b.available(0.0099) == 0
    assert b.available(0.0101) == 1
    b.take(1, 0.0101)
    assert b.available(0.0101) == 0


def test_an_idle_bucket_earns_no_more_than_its_burst() -> None:
    """After a pause or an outage nothing fires faster to catch up."""
    b = TokenBucket()
    b.set_rate(200.0, now=0.0)
    assert b.available(3600.0) == int(burst_for(200.0)) == 8
    b.set_rate(10_000.0, now=3600.0)
    assert b.available(7200.0) == int(10_000 * BURST_SECONDS)


def test_a_lower_rate_cuts_the_tokens_to_its_burst_at_once() -> None:
    b = TokenBucket()
    b.set_rate(10_000.0, now=0.0)
    assert b.available(1.0) == 10_000 * BURST_SECONDS
    b.set_rate(100.0, now=1.0)
    assert b.available(1.0) == 100 * BURST_SECONDS
    b.set_rate(0.0, now=1.0)
    assert b.available(5.0) == 0 and b.wait(5.0) == INF


@settings(max_examples=200, deadline=None)
@given(
    rate=st.floats(min_value=0.5, max_value=5_000.0),
    gaps=st.lists(st.floats(min_value=0.0, max_value=0.05), min_size=1, max_size=400),
    greedy=st.lists(st.booleans(), min_size=1, max_size=400),
)
def test_no_window_admits_more_than_rate_times_its_length_plus_the_burst(
    rate: float, gaps: list[float], greedy: list[bool]
) -> None:
    b = TokenBucket()
    b.set_rate(rate, 0.0)
    now = 0.0
    fires: list[tuple[float, int]] = []
    for gap, take_all in zip(gaps, greedy, strict=False):
        now += gap
        n = b.available(now)
        n = n if take_all else min(n, 1)
        if n:
            b.take(n, now)
            fires.append((now, n))
    burst = burst_for(rate)
    for i, (start, _) in enumerate(fires):
        count = 0
        for t, n in fires[i:]:
            count += n
            assert count <= rate * (t - start) + burst + 1e-6


# --------------------------------------------------------------------------------------- shares


def test_fair_shares_give_the_modest_what_they_want_and_split_the_rest() -> None:
    assert allocate(200.0, {"s0": INF, "s1": INF}) == {"s0": 100.0, "s1": 100.0}
    assert allocate(200.0, {"s0": INF, "s1": 20.0}) == {"s0": 180.0, "s1": 20.0}
    # idle peers: nobody wants much, the rest is split evenly (a standing share each)
    assert allocate(200.0, {"s0": 0.0, "s1": 0.0}) == {"s0": 100.0, "s1": 100.0}
    assert allocate(200.0, {"s0": 30.0, "s1": 10.0}) == {"s0": 110.0, "s1": 90.0}
    assert allocate(200.0, {"s0": INF}) == {"s0": 200.0}
    assert allocate(200.0, {}) == {}


def test_whole_slots_never_add_up_to_more_than_the_limit() -> None:
    assert allocate_int(1, {"s0": 0.0, "s1": 0.0}) == {"s0": 1, "s1": 0}
    assert allocate_int(1, {"s0": 0.0, "s1": INF}) == {"s0": 0, "s1": 1}
    assert allocate_int(5, {"s0": INF, "s1": INF}) == {"s0": 3, "s1": 2}
    assert allocate_int(7, {"a": INF, "b": INF, "c": 1.0}) == {"a": 3, "b": 3, "c": 1}


@settings(max_examples=300, deadline=None)
@given(
    total=st.integers(min_value=1, max_value=10_000),
    wants=st.dictionaries(
        st.sampled_from(["s0", "s1", "s2", "s3", "s4"]),
        st.one_of(st.just(INF), st.floats(min_value=0.0, max_value=20_000.0)),
        min_size=1,
    ),
)
def test_shares_are_within_the_limit_and_max_min_fair(total: int, wants: dict[str, float]) -> None:
    shares = allocate(float(total), wants)
    assert sum(shares.values()) <= total * (1 + 1e-9)
    assert sum(shares.values()) == pytest.approx(total)  # nothing is left unused
    for name, want in wants.items():
        # someone who gets less than it wants gets at least as much as anybody else
        if shares[name] < want - 1e-6:
            assert all(shares[name] >= v - 1e-6 for v in shares.values())
    slots = allocate_int(total, wants)
    assert sum(slots.values()) == total
    assert all(abs(slots[k] - shares[k]) < 1 + 1e-6 for k in wants)


# ---------------------------------------------------------------------------------------- slice


def test_a_slice_is_lowered_at_once_and_raised_only_after_a_fresh_read() -> None:
    s = Slice(integral=False)
    assert not s.plan(200.0, "s1", INF, [])
    assert (s.used, s.target, s.claim, s.pending) == (0.0, 200.0, 200.0, True)
    # the fresh read shows s0 holding everything: no room yet
    holder = Peer("s0", INF, 200.0, False)
    assert not s.adopt(200.0, "s1", [holder], reached_all=True)
    assert s.used == 0.0
    # s0 saw us and lowered its slice
    s.plan(200.0, "s1", INF, [holder])
    assert s.target == 100.0
    assert s.adopt(200.0, "s1", [Peer("s0", INF, 100.0, False)], reached_all=True)
    assert s.used == 100.0
    # a peer that wants more again (its plan saw less want from us): ours goes down before we publish
    assert s.plan(200.0, "s1", 10.0, [Peer("s0", INF, 100.0, False)])
    assert s.used == s.claim == 10.0


def test_a_raise_waits_for_a_publish_that_reached_every_live_peer() -> None:
    s = Slice(integral=False)
    s.plan(200.0, "s0", INF, [])
    assert not s.adopt(200.0, "s0", [], reached_all=False)
    assert s.used == 0.0


def test_of_two_pending_raises_the_lower_shard_name_goes_first() -> None:
    a, b = Slice(integral=False), Slice(integral=False)
    a.plan(200.0, "s0", INF, [])
    b.plan(200.0, "s1", INF, [])
    # each sees the other's pending claim (200): s1 waits for s0; s0 finds no room for now
    assert not b.adopt(200.0, "s1", [Peer("s0", INF, a.claim, a.pending)], True)
    assert not a.adopt(200.0, "s0", [Peer("s1", INF, b.claim, b.pending)], True)
    # next round both plan with each other in view and publish pending claims of 100
    a.plan(200.0, "s0", INF, [Peer("s1", INF, b.claim, b.pending)])
    b.plan(200.0, "s1", INF, [Peer("s0", INF, a.claim, a.pending)])
    row_a, row_b = Peer("s0", INF, a.claim, a.pending), Peer("s1", INF, b.claim, b.pending)
    assert row_a.pending and row_b.pending
    assert a.adopt(200.0, "s0", [row_b], True)
    assert not b.adopt(200.0, "s1", [row_a], True)  # s0's raise was pending when s1 read
    # the round after, s1 reads s0's row without a pending raise
    assert b.adopt(200.0, "s1", [Peer("s0", INF, a.claim, a.pending)], True)
    assert a.used + b.used == 200.0


def test_three_raises_that_each_missed_another_cannot_all_be_taken() -> None:
    """Each of three raises saw one other's pending claim and missed the third's (a cycle, which
    the write-then-read order allows with three managers). Taking all three would use 450 of 300:
    the one that saw a lower shard name's pending raise waits."""
    slices = {name: Slice(integral=False) for name in ("s0", "s1", "s2")}
    for s in slices.values():
        s.target = s.claim = 150.0
    seen = {
        "s0": [Peer("s1", INF, 150.0, True), Peer("s2", INF, 0.0, False)],
        "s1": [Peer("s2", INF, 150.0, True), Peer("s0", INF, 0.0, False)],
        "s2": [Peer("s0", INF, 150.0, True), Peer("s1", INF, 0.0, False)],
    }
    for name, s in slices.items():
        s.adopt(300.0, name, seen[name], reached_all=True)
    assert sum(s.used for s in slices.values()) <= 300.0
    assert slices["s2"].used == 0.0


def test_in_flight_events_are_claimed_until_they_settle() -> None:
    s = Slice(integral=True)
    s.plan(10, "s0", INF, [])
    assert s.adopt(10, "s0", [], True) and s.used == 10
    # a peer arrives: our slots go down to 5 at once, but 8 are still in flight
    s.plan(10, "s0", INF, [Peer("s1", INF, 0.0, True)], hold=8)
    assert (s.used, s.claim) == (5, 8)


# ------------------------------------------------------------------------------------- liveness


def test_liveness_by_the_database_clock_or_by_ours() -> None:
    live = Liveness()
    key = ("orders", "s1")
    # first sighting: the database's clock decides
    assert not live.live(key, (1, 5), db_live=False, resigned=False, ttl=0.6, now=10.0)
    assert live.live(key, (1, 5), db_live=True, resigned=False, ttl=0.6, now=10.1)
    # renewed (new version) though the database's clock jumped and calls it old: ours keeps it live
    assert live.live(key, (1, 6), db_live=False, resigned=False, ttl=0.6, now=10.2)
    assert live.live(key, (1, 6), db_live=False, resigned=False, ttl=0.6, now=10.79)
    assert not live.live(key, (1, 6), db_live=False, resigned=False, ttl=0.6, now=10.81)
    # a resigned row is never live
    assert not live.live(key, (1, 7), db_live=True, resigned=True, ttl=0.6, now=11.0)


# --------------------------------------------------------------------------------- queue limits


def test_a_limited_queue_fires_nothing_until_its_slice_is_trusted() -> None:
    lim = QueueLimits()
    lim.rate.used = 100.0
    assert lim.admit(50, 0, 100.0, None, now=1.0) == 0
    assert lim.cut
    lim.trusted_until = 2.0
    # untrusted time earned nothing: the bucket fills from the moment the slice is trusted
    assert lim.admit(50, 0, 100.0, None, now=1.5) == 0
    assert BURST_SECONDS == 0.04
    assert lim.admit(50, 0, 100.0, None, now=1.9) == 4  # a burst of 4 at 100/s
    lim.spent(4, 1.9)
    assert lim.admit(50, 0, 100.0, None, now=1.9) == 0
    assert lim.wait(0, 100.0, None, 1.9) == pytest.approx(0.01)
    # taken at admit: the bucket refills while the fire runs; what was not fired comes back
    assert lim.admit(50, 0, 100.0, None, now=1.94) == 4
    assert lim.bucket.available(1.945) == 0  # the four are out while their fire runs
    # an admit whose fire never came: the next one gets its tokens back (within the burst)
    assert lim.admit(1, 0, 100.0, None, now=1.945) == 1
    lim.spent(1, 1.945)
    assert lim.admit(50, 0, 100.0, None, now=1.945) == 3
    lim.spent(0, 1.945)  # not fired after all
    assert lim.bucket.available(1.945) == 3
    assert lim.admit(50, 0, 100.0, None, now=2.5) == 0  # trust ran out
    assert lim.wait(0, 100.0, None, 2.5) == INF


def test_an_unlimited_queue_is_not_held_back() -> None:
    lim = QueueLimits()
    assert lim.admit(50, 10, None, None, now=1.0) == 50
    assert not lim.cut and lim.wait(10, None, None, 1.0) == 0.0


def test_the_concurrency_slice_caps_events_in_flight() -> None:
    lim = QueueLimits()
    lim.concurrency.used = 4
    lim.trusted_until = 10.0
    assert lim.admit(50, 1, None, 10, now=1.0) == 3
    assert lim.admit(50, 4, None, 10, now=1.0) == 0
    assert lim.wait(4, None, 10, 1.0) == INF
    # a lower queue limit applies before the budget's next round
    assert lim.admit(50, 1, None, 2, now=1.0) == 1


def test_a_manager_asks_for_all_it_can_get_only_when_cut_with_more_due() -> None:
    lim = QueueLimits()
    lim.trusted_until = 100.0
    lim.rate.used = 10.0
    lim.measure(0.0)
    lim.admit(50, 0, 100.0, None, now=1.0)  # cut by the rate
    lim.spent(0, 1.0)
    assert lim.wants(1.5, more_due=True, in_flight=3, dispatching=True) == (INF, 3.0)
    assert lim.wants(1.5, more_due=False, in_flight=3, dispatching=True)[0] < INF
    assert lim.wants(1.0 + SATURATION_HOLD + 0.1, more_due=True, in_flight=3, dispatching=True)[0] < INF
    assert lim.wants(1.5, more_due=True, in_flight=3, dispatching=False) == (0.0, 3.0)


def test_the_measured_rate_follows_the_fires() -> None:
    lim = QueueLimits()
    lim.measure(0.0)
    for i in range(1, 41):  # 50 events/s for 4 s, measured every 0.1 s
        lim.spent(5, i * 0.1)
        lim.measure(i * 0.1)
    assert lim.fire_rate == pytest.approx(50.0, rel=0.15)
    assert lim.wants(4.0, more_due=False, in_flight=0, dispatching=True)[0] == pytest.approx(
        50.0 * WANT_HEADROOM, rel=0.15
    )


# --------------------------------------------------------------- the protocol, every interleaving


@dataclass
class _Manager:
    """One shard's manager in the simulation: its slice and where it is in its round."""

    name: str
    slice: Slice
    view: list[Peer] = field(default_factory=list)
    #: None: between rounds; else the row being published and the databases still to write
    row: Peer | None = None
    to_write: list[int] = field(default_factory=list)


class _Protocol:
    """n managers and n databases. A round is plan, one write per database (each its own step, in
    any order), a read of the manager's own database and the adoption right after it. Steps of
    different managers interleave as the test says. Every peer is live (no expiry here)."""

    def __init__(self, n: int, total: float, integral: bool) -> None:
        self.total = total
        self.managers = [_Manager(f"s{i}", Slice(integral)) for i in range(n)]
        self.dbs: list[dict[str, Peer]] = [{} for _ in range(n)]

    def step(self, i: int, want: float, order: int) -> None:
        m = self.managers[i]
        if m.row is None:
            m.slice.plan(self.total, m.name, want, m.view)
            m.row = Peer(m.name, want, m.slice.claim, m.slice.pending)
            m.to_write = list(range(len(self.dbs)))
        elif m.to_write:
            db = m.to_write.pop(order % len(m.to_write))
            self.dbs[db][m.name] = m.row
        else:
            m.view = [p for name, p in self.dbs[i].items() if name != m.name]
            m.slice.adopt(self.total, m.name, m.view, reached_all=True)
            m.row = None

    def used(self) -> float:
        return sum(m.slice.used for m in self.managers)

    def claims_cover_use(self) -> bool:
        """What each manager uses is at most the claim every other database holds for it."""
        for m in self.managers:
            for j, db in enumerate(self.dbs):
                if self.managers[j] is m:
                    continue
                claim = db[m.name].claim if m.name in db else 0.0
                if m.slice.used > claim + 1e-9:
                    return False
        return True


_WANTS = st.sampled_from([0.0, 5.0, 40.0, INF])


@settings(max_examples=400, deadline=None)
@given(
    n=st.integers(min_value=2, max_value=4),
    total=st.sampled_from([1.0, 5.0, 200.0]),
    integral=st.booleans(),
    steps=st.lists(st.tuples(st.integers(0, 3), _WANTS, st.integers(0, 3)), max_size=300),
)
def test_the_slices_never_add_up_to_more_than_the_limit_in_any_interleaving(
    n: int, total: float, integral: bool, steps: list[tuple[int, float, int]]
) -> None:
    p = _Protocol(n, total, integral)
    for who, want, order in steps:
        p.step(who % n, want, order)
        assert p.used() <= total + 1e-9
        assert p.claims_cover_use()


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(min_value=2, max_value=4),
    total=st.sampled_from([5.0, 200.0]),
    integral=st.booleans(),
    wants=st.lists(_WANTS, min_size=4, max_size=4),
    noise=st.lists(st.tuples(st.integers(0, 3), _WANTS, st.integers(0, 3)), max_size=100),
)
def test_with_steady_wants_the_slices_reach_the_fair_shares(
    n: int, total: float, integral: bool, wants: list[float], noise: list[tuple[int, float, int]]
) -> None:
    p = _Protocol(n, total, integral)
    for who, want, order in noise:  # whatever happened before
        p.step(who % n, want, order)
    for _ in range(2 * n + 2):  # then whole rounds each, in turn (raises go one shard at a time)
        for i in range(n):
            for _ in range(n + 2):
                p.step(i, wants[i], 0)
    by_name = {f"s{i}": wants[i] for i in range(n)}
    fair = allocate_int(int(total), by_name) if integral else allocate(total, by_name)
    for i, m in enumerate(p.managers):
        assert m.slice.used == pytest.approx(fair[m.name]), (i, [x.slice.used for x in p.managers], fair)
    assert math.isclose(p.used(), total) or p.used() <= total
