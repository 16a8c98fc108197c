"""Per-tenant shares of dispatch (queue_manager/manager/fairness.py), the round-robin cursor, the
per-tenant ledger counts and the per-tenant dwell metric, as pure logic."""

from __future__ import annotations

import random

import pytest

from queue_manager.domain.settings import TENANT_SETTINGS, TenantSettings, check_tenant_settings
from queue_manager.errors import ConfigurationError
from queue_manager.manager import plan
from queue_manager.manager.cache import Entry, WindowCache
from queue_manager.manager.fairness import FairShare, TenantPolicy, candidate_quota, over_fair_share
from queue_manager.manager.metrics import TenantDwell
from queue_manager.wire.ledger import Ledger


def simulate(policy: TenantPolicy, backlog: dict[str, int], batches: int, limit: int) -> dict[str, int]:
    """Saturated dispatch by FairShare.order: every tenant always has ``backlog[t]`` candidates."""
    fair = FairShare()
    served: dict[str, int] = {t: 0 for t in backlog}
    for _ in range(batches):
        cands = [((t, i), t, float(i), 3, 2) for t in backlog for i in range(backlog[t])]
        chosen = fair.order(cands, policy, {}, limit)
        fair.charge((t for t, _ in chosen), policy)
        for t, _ in chosen:
            served[t] += 1
    return served


@pytest.mark.parametrize("limit", [1, 2, 3, 7, 50])
def test_weights_share_fires_among_backlogged_tenants_whatever_the_batch_size(limit: int) -> None:
    policy = TenantPolicy(weights={"b": 3.0})
    served = simulate(policy, {"a": 40, "b": 40}, batches=400 // limit + 1, limit=limit)
    ratio = served["b"] / served["a"]
    assert 2.7 <= ratio <= 3.3, (limit, served)


def test_equal_weights_alternate_and_an_idle_tenant_gets_no_credit() -> None:
    policy = TenantPolicy(default_cap=None, weights={"x": 1.5})  # active, but a and b weigh 1
    fair = FairShare()
    for _ in range(100):
        chosen = fair.order([("a1", "a", 0.0, 3, 2), ("a2", "a", 1.0, 3, 2)], policy, {}, 1)
        fair.charge(["a"], policy)
        assert chosen == ["a1"]
    # b comes back after a long idle time: it is served next, but only its share from then on
    got = []
    for _ in range(10):
        chosen = fair.order([("a", "a", 0.0, 3, 2), ("b", "b", 0.0, 3, 2)], policy, {}, 1)
        fair.charge(chosen, policy)
        got += chosen
    assert got[0] == "b" and got.count("b") == 5, got


def test_a_tenant_never_gets_past_its_room() -> None:
    policy = TenantPolicy(caps={"a": 3}, default_cap=10)
    fair = FairShare()
    cands = [(f"a{i}", "a", float(i), 3, 2) for i in range(20)] + [(f"b{i}", "b", float(i), 3, 2) for i in range(20)]
    chosen = fair.order(cands, policy, {"a": 1}, 100)
    assert sum(1 for c in chosen if c.startswith("a")) == 2  # cap 3, one in flight
    assert sum(1 for c in chosen if c.startswith("b")) == 10  # the queue's default cap
    # one tenant's events keep their fire_at order
    assert [c for c in chosen if c.startswith("b")] == [f"b{i}" for i in range(10)]


def test_the_fair_pick_lists_capped_tenants_and_rooms() -> None:
    policy = TenantPolicy(weights={"w": 2.0}, caps={"c": 2}, default_cap=5)
    fair = FairShare()
    fair.charge(["x", "x", "x"], policy)
    pick = fair.pick(policy, {"c": 2, "d": 4, "e": 5, "far": 1}, 3)
    assert set(pick.capped) == {"c", "e"}
    rows = dict(zip(pick.tenants, zip(pick.ahead, pick.weights, pick.rooms, strict=True), strict=True))
    assert rows["d"] == (0.0, 1.0, 1)
    assert rows["w"] == (0.0, 2.0, 5)
    assert rows["x"][0] > 0 and rows["x"][2] == 5  # ahead of the virtual time
    assert "far" not in rows  # room 4 cannot bind a batch of 3: it goes as an unlisted tenant
    assert pick.default_room == 5
    # a default room below the batch binds unlisted tenants: a tenant with a larger own cap is listed
    pick = FairShare().pick(TenantPolicy(caps={"big": 50}, default_cap=2), {"small": 1}, 10)
    assert dict(zip(pick.tenants, pick.rooms, strict=True)) == {"small": 1, "big": 50}
    assert not TenantPolicy().active and TenantPolicy(default_cap=1).active
    built = TenantPolicy.build([TenantSettings(1, "a", 2.0, None), TenantSettings(1, "b", 1.0, 4)], None)
    assert built == TenantPolicy(weights={"a": 2.0}, caps={"b": 4})


def test_over_fair_share_counts_tenants_above_twice_their_weighted_share() -> None:
    policy = TenantPolicy(weights={"heavy": 10.0})
    assert over_fair_share({"noisy": 95, "q1": 1, "q2": 1, "q3": 1, "q4": 1, "q5": 1}, TenantPolicy()) == 1
    assert over_fair_share({"a": 10, "b": 10}, TenantPolicy()) == 0
    assert over_fair_share({"only": 100}, TenantPolicy()) == 0
    assert over_fair_share({"heavy": 50, "b": 5}, policy) == 0  # its weight makes 50 its share


def test_the_cursor_moves_past_the_last_partition_of_the_walk() -> None:
    # walk from 14 over 16 partitions: 14, 15, 0, 1, ...; the last one served was 1
    assert plan.next_cursor(14, {15: 2, 1: 1, 14: 3}, 16) == 2
    assert plan.next_cursor(3, {3: 1}, 16) == 4
    assert plan.next_cursor(5, {}, 16) == 5
    assert plan.next_cursor(15, {15: 1}, 16) == 0


def test_round_robin_with_the_cursor_gives_every_partition_its_turn() -> None:
    """Batches of one event over 5 non-empty partitions: each gets one turn in every 5 batches."""
    busy = [1, 3, 5, 9, 13]
    cursor, served = 0, []
    for _ in range(50):
        p = next(p for p in sorted(busy, key=lambda p: (p - cursor) % 16))
        served.append(p)
        cursor = plan.next_cursor(cursor, {p: 1}, 16)
    for i in range(0, 50, 5):
        assert sorted(served[i : i + 5]) == busy


def test_sparse_partitions_are_those_with_nothing_due_at_the_previous_pick() -> None:
    heads = {3: 100.0, 7: 104.9, 11: 105.0, 12: 106.5}
    assert plan.sparse_partitions(heads, 105.0) == {11, 12}
    assert plan.sparse_partitions(heads, None) == frozenset()
    assert plan.sparse_partitions({}, 105.0) == frozenset()


def test_a_sparse_partition_served_out_of_turn_does_not_move_the_cursor() -> None:
    """Backlogged partitions 1, 3, 5 and a quiet tenant's partition 9 that has an event now and
    then: 9 is served at once each time, and the backlogged ones still take turns in order."""
    busy = [1, 3, 5]
    cursor, served = 0, []
    for i in range(30):
        order = sorted(busy, key=lambda p: (p - cursor) % 16)
        if i % 4 == 0:  # the quiet event, sparse: walked first
            served.append(9)
            heads = {9: float(i), order[0]: -1.0}
            fired = {9: 1, order[0]: 1}
            served.append(order[0])
        else:
            heads = {order[0]: -1.0}
            fired = {order[0]: 1}
            served.append(order[0])
        cursor = plan.cursor_after(cursor, fired, heads, float(i) - 0.5, 16)
    bulk = [p for p in served if p != 9]
    assert bulk == [busy[i % 3] for i in range(len(bulk))]
    assert served.count(9) == 8


def test_a_pick_of_sparse_partitions_only_still_turns_the_walk() -> None:
    """Should ``since`` lag so far that every partition looks sparse, the cursor moves as before."""
    assert plan.cursor_after(3, {3: 1, 5: 2}, {3: 10.0, 5: 11.0}, 0.0, 16) == 6
    assert plan.cursor_after(3, {3: 1, 5: 2}, {3: 10.0, 5: 11.0}, 10.5, 16) == 4
    assert plan.cursor_after(3, {3: 1, 5: 2}, {3: 10.0, 5: 11.0}, None, 16) == 6


def test_the_ledger_counts_events_in_flight_by_tenant() -> None:
    ledger = Ledger()
    rng = random.Random(3)
    for i in range(200):
        ledger.hold(rng.randrange(4), i, 1, 0.0, f"t{i % 3}")
    ledger.check()
    assert ledger.by_tenant() == {"t0": 67, "t1": 67, "t2": 66}
    for i in range(0, 200, 2):
        ledger.drop(i)
    ledger.release_holder(0)
    ledger.check()
    assert sum(ledger.by_tenant().values()) == len(ledger)
    for h in range(4):
        ledger.release_holder(h)
    assert ledger.by_tenant() == {}


def test_cached_take_in_fair_order_respects_caps_and_weights() -> None:
    cache = WindowCache()
    entries = [Entry(i, "a" if i % 2 else "b", i % 4, float(i)) for i in range(40)]
    cache.replace(entries, [])
    policy = TenantPolicy(caps={"a": 2}, weights={"b": 3.0})
    fair = FairShare()

    def order(cands: list[Entry], n: int) -> list[Entry]:
        return fair.order([(e, e.tenant, e.fire_at, e.priority, e.priority - 1) for e in cands], policy, {}, n)

    taken = cache.take_ordered(100.0, 8, lambda e: "r", order)
    tenants = [e.tenant for e, _ in taken]
    assert tenants.count("a") == 2 and tenants.count("b") == 6
    assert len(cache) == 32
    assert cache.discard_ids({e.id for e in entries[:10]}) == 10 - sum(1 for e, _ in taken if e.id < 10)


def test_tenant_settings_are_checked_like_queue_settings() -> None:
    assert check_tenant_settings({"weight": 3, "max_in_flight": None}) == {"weight": 3, "max_in_flight": None}
    for bad in ({"weight": 0}, {"weight": 1001}, {"max_in_flight": 0}, {"weight": "x"}, {"cap": 1}):
        with pytest.raises(ConfigurationError, match="tenant setting"):
            check_tenant_settings(bad)
    assert set(TENANT_SETTINGS) == {"weight", "max_in_flight"}


def test_dwell_names_the_busiest_tenants_and_folds_the_rest_into_other() -> None:
    d = TenantDwell(top=2, window=60.0, slices=6)
    d.observe(
        ["big"] * 100 + ["mid"] * 50 + [f"small{i}" for i in range(30)], [0.01] * 100 + [0.1] * 50 + [1.0] * 30, 0.0
    )
    rows = {t: (n, p50, p99) for t, n, p50, p99 in d.summary(1.0)}
    assert set(rows) == {"big", "mid", "other"}
    assert rows["other"][0] == 30
    assert rows["big"][1] == pytest.approx(0.01, rel=0.1) and rows["mid"][2] == pytest.approx(0.1, rel=0.1)
    assert rows["other"][1] == pytest.approx(1.0, rel=0.1)
    # a minute later the window is empty
    assert d.summary(200.0) == []
    # at most max_tenants per slice: the others count as other
    small = TenantDwell(top=5, max_tenants=3)
    small.observe([f"t{i}" for i in range(10)], [0.001] * 10, 0.0)
    assert {t: n for t, n, _, _ in small.summary(0.0)} == {"t0": 1, "t1": 1, "t2": 1, "other": 7}


def test_a_tenant_with_its_own_cap_is_listed_with_its_room_before_it_has_anything_in_flight() -> None:
    pick = FairShare().pick(TenantPolicy(caps={"own": 2}, default_cap=3), {}, 10)
    assert dict(zip(pick.tenants, pick.rooms, strict=True)) == {"own": 2} and pick.default_room == 3


def test_candidate_quota_gives_small_batches_enough_candidates_per_tenant() -> None:
    assert candidate_quota(4, 8) == (4, 32)
    assert candidate_quota(1, 16) == (1, 32)
    assert candidate_quota(1000, 16) == (125, 2000)
    assert candidate_quota(100, 1024) == (8, 200)


def test_dwell_samples_large_batches_and_keeps_the_counts() -> None:
    d = TenantDwell()
    d.observe(["a"] * 640 + ["b"] * 640, [0.002] * 640 + [0.2] * 640, 0.0)
    rows = {t: (n, p50, p99) for t, n, p50, p99 in d.summary(0.0)}
    assert rows["a"][0] == 640 and rows["b"][0] == 640
    assert rows["b"][1] == pytest.approx(0.2, rel=0.1)
