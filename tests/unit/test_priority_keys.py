"""The pick's priorities, aging and key limits as pure functions: the order of the levels, the
cached path's take (priority order, aging, key limits, no head-of-line blocking), the rooms a pick
may take of each key, the rate buckets, and the ledger's count of a key's events in hand."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from queue_manager.domain.settings import KEY_SETTINGS, KeySettings, check_key_settings
from queue_manager.errors import ConfigurationError
from queue_manager.manager.cache import LOOKAHEAD, Entry, WindowCache
from queue_manager.manager.keys import (
    SEP,
    UNLIMITED,
    KeyAdmission,
    KeyPolicy,
    KeyRooms,
    RateBuckets,
    concurrency_rooms,
    scoped,
    unscoped,
)
from queue_manager.manager.pickstate import PickState
from queue_manager.manager.priority import aging_bound, effective, level_counts, level_ties, next_caps
from queue_manager.wire.ledger import Ledger

NOW = 1_750_000_000.0


def entry(ident: int, part: int, priority: int, fire_at: float, tenant: str = "t", ckey: str | None = None) -> Entry:
    return Entry(ident, tenant, part, fire_at, priority=priority, ckey=scoped(tenant, ckey))


def anyone(_: Entry) -> str:
    return "r"


# ---------------------------------------------------------------------------------- levels


def test_a_level_counts_one_higher_per_aging_interval_of_its_oldest_event_never_above_one() -> None:
    assert effective(5, NOW, NOW, 30.0) == 5
    assert effective(5, NOW - 29.9, NOW, 30.0) == 5
    assert effective(5, NOW - 30.0, NOW, 30.0) == 4
    assert effective(5, NOW - 119.0, NOW, 30.0) == 2
    assert effective(5, NOW - 3600.0, NOW, 30.0) == 1
    assert effective(3, NOW - 3600.0, NOW, None) == 3  # no aging
    assert effective(3, NOW + 5.0, NOW, 30.0) == 3  # not due yet: no age
    assert aging_bound(5, 30.0) == 120.0 and aging_bound(1, 30.0) == 0.0 and aging_bound(3, None) == math.inf


def test_each_level_counts_by_its_oldest_event_and_levels_of_one_count_take_turns() -> None:
    assert level_counts({}, NOW, 30.0) == [1, 2, 3, 4, 5]  # nothing known: each at its own level
    # level 5's oldest waited 4 intervals: it counts 1, as level 1 does
    assert level_counts({1: NOW - 1.0, 3: NOW - 2.0, 5: NOW - 125.0}, NOW, 30.0) == [1, 2, 3, 4, 1]
    # level 3 counts 2 after one interval, as a fresh level 2 (nothing due at the last pick)
    assert level_counts({3: NOW - 31.0, 2: None}, NOW, 30.0) == [1, 2, 2, 4, 5]
    assert level_counts({3: NOW - 1000.0}, NOW, None) == [1, 2, 3, 4, 5]  # no aging
    # which level of one count goes first rotates, pick by pick: each goes first once in five
    assert level_ties(0) == [0, 1, 2, 3, 4]
    assert level_ties(1) == [4, 0, 1, 2, 3]
    firsts = {min(range(5), key=lambda v: level_ties(turn)[v]) for turn in range(5)}
    assert firsts == {0, 1, 2, 3, 4}


# ---------------------------------------------------------------------------------- the cached pick


def test_the_higher_level_goes_first_across_partitions_then_round_robin_within_a_level() -> None:
    c = WindowCache()
    c.replace(
        [entry(i, 0, 3, NOW - 10 + i * 0.01) for i in range(5)]  # a backlog of level 3 in partition 0
        + [entry(10 + i, 1, 3, NOW - 5 + i * 0.01) for i in range(5)]  # and in partition 1
        + [entry(20, 2, 1, NOW - 0.001), entry(21, 3, 1, NOW)],  # two fresh events of level 1
        [],
    )
    out = [e.id for e, _ in c.take(NOW, 6, anyone, aging=30.0)]
    assert out[:2] == [20, 21]  # priority before fairness
    assert out[2:] == [0, 10, 1, 11]  # round-robin within level 3, each partition in fire_at order


def test_a_level_that_waited_its_aging_shares_the_pick_with_a_stream_of_higher_events() -> None:
    def fill() -> None:
        c.replace(
            [entry(1 + i, 0, 5, NOW - 121.0 + i) for i in range(3)]
            + [entry(10 + i, 0, 1, NOW - 1 + i * 0.01) for i in range(20)],
            [],
        )

    c = WindowCache()
    fill()
    # 4 intervals of 30 s: level 5 counts 1, as level 1 does: they take turns, level 1 first in this pick
    assert [e.id for e, _ in c.take(NOW, 4, anyone, aging=30.0)] == [10, 1, 11, 2]
    # a pick of one event: the levels go first in turn (level 5 at the next)
    fill()
    assert [e.id for e, _ in c.take(NOW, 1, anyone, aging=30.0, turn=1)] == [1]
    # without aging it waits for the whole of level 1
    fill()
    assert not {1, 2, 3} & {e.id for e, _ in c.take(NOW, 15, anyone, aging=None)}


def test_an_aged_backlog_does_not_shut_out_a_stream_of_higher_events() -> None:
    """A backlog of level 3 that waited two intervals counts 1: the fresh events of level 1 still
    get every other place of a pick, not the place after the whole backlog."""
    c = WindowCache()
    c.replace([entry(i, i % 4, 3, NOW - 300.0 + i * 0.01) for i in range(200)] + [entry(1000, 1, 1, NOW - 0.001)], [])
    assert 1000 in [e.id for e, _ in c.take(NOW, 2, anyone, aging=30.0)]


def test_aging_never_reorders_the_events_of_one_level() -> None:
    """An old backlog of a level does not go before a quiet tenant's fresh event of the same level:
    aging moves whole levels (event-by-event aging put the noisy backlog first)."""
    c = WindowCache()
    c.replace(
        [entry(i, 0, 3, NOW - 600 + i, tenant="noisy") for i in range(50)] + [entry(100, 1, 3, NOW, tenant="quiet")],
        [],
    )
    out = [e.tenant for e, _ in c.take(NOW, 2, anyone, aging=30.0)]
    assert out == ["noisy", "quiet"]  # one per partition per turn, the cursor at partition 0


def test_a_key_at_its_limit_does_not_block_the_other_keys_of_its_partition() -> None:
    c = WindowCache()
    c.replace(
        [entry(i, 0, 3, NOW - 10 + i, ckey="busy") for i in range(10)]
        + [entry(100 + i, 0, 3, NOW - 1 + i * 0.01, ckey=f"k{i}") for i in range(3)],
        [],
    )
    policy = KeyPolicy(default_in_flight=2)
    held = {"t" + SEP + "busy": 2}  # at its limit
    admit = KeyAdmission(concurrency_rooms(policy, held, 10), UNLIMITED)

    def choose(e: Entry) -> str | None:
        if not admit.allows(e.ckey, e.rkey):
            return None
        admit.took(e.ckey, e.rkey)
        return "r"

    out = [e.id for e, _ in c.take(NOW, 10, choose)]
    assert out == [100, 101, 102]  # past the ten events of the key at its limit
    assert admit.passed and len(c) == 10


def test_a_batch_takes_a_key_up_to_its_room_and_no_further() -> None:
    c = WindowCache()
    c.replace([entry(i, i % 4, 3, NOW - 10 + i, ckey="k") for i in range(12)], [])
    policy = KeyPolicy(default_in_flight=5, in_flight={})
    admit = KeyAdmission(concurrency_rooms(policy, {"t" + SEP + "k": 2}, 12), UNLIMITED)

    def choose(e: Entry) -> str | None:
        if admit.allows(e.ckey, e.rkey):
            admit.took(e.ckey, e.rkey)
            return "r"
        return None

    assert len(c.take(NOW, 12, choose)) == 3  # 5 - 2 in hand


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 5), st.floats(0, 300), st.sampled_from([None, "a", "b", "c"])),
        min_size=1,
        max_size=60,
    ),
    st.integers(1, 20),
    st.sampled_from([None, 10.0, 30.0]),
)
def test_the_cached_pick_serves_the_levels_in_order_and_keeps_every_key_within_its_room(
    rows: list[tuple[int, int, float, str | None]], limit: int, aging: float | None
) -> None:
    c = WindowCache()
    entries = [entry(i, p, v, NOW - age, ckey=k) for i, (p, v, age, k) in enumerate(rows)]
    c.replace(entries, [])
    policy = KeyPolicy(default_in_flight=2)
    admit = KeyAdmission(concurrency_rooms(policy, {}, limit), UNLIMITED)

    def choose(e: Entry) -> str | None:
        if admit.allows(e.ckey, e.rkey):
            admit.took(e.ckey, e.rkey)
            return "r"
        return None

    taken = [e for e, _ in c.take(NOW, limit, choose, aging)]
    assert len(taken) <= limit
    per_key: dict[str, int] = {}
    for e in taken:
        if e.ckey is not None:
            per_key[e.ckey] = per_key.get(e.ckey, 0) + 1
    assert all(n <= 2 for n in per_key.values())
    # levels by count: a level's events never follow those of a higher count
    oldest: dict[int, float | None] = {}
    for e in entries:
        t = oldest.get(e.priority)
        oldest[e.priority] = e.fire_at if t is None else min(e.fire_at, t)
    counts = level_counts(oldest, NOW, aging)
    ranks = [counts[e.priority - 1] for e in taken]
    assert ranks == sorted(ranks)
    # nothing left behind that could have been taken: a level served later only once the earlier
    # ones had nothing more to give within the keys' rooms (when every event was a candidate)
    streams: dict[tuple[int, int], int] = {}
    for e in entries:
        streams[(e.partition, e.priority)] = streams.get((e.partition, e.priority), 0) + 1
    if len(taken) < limit and max(streams.values()) <= LOOKAHEAD:
        left = [e for e in entries if e not in taken]
        for e in left:
            assert e.ckey is not None and per_key.get(e.ckey, 0) >= 2


# ---------------------------------------------------------------------------------- rooms


def test_the_rooms_of_a_pick_block_keys_at_their_limit_and_list_the_others_with_events_in_hand() -> None:
    policy = KeyPolicy.build(
        [KeySettings(1, "t", "big", max_in_flight=10), KeySettings(1, "t", "fast", max_qps=5.0)], 3, None
    )
    held = {scoped("t", "a"): 3, scoped("t", "b"): 1, scoped("t", "big"): 4}
    rooms = concurrency_rooms(policy, held, 8)
    assert rooms.blocked == ("t" + SEP + "a",)
    assert rooms.room("t" + SEP + "b") == 2 and rooms.room("t" + SEP + "big") == 6
    assert rooms.room("t" + SEP + "other") == 3  # the default, nothing in hand
    assert concurrency_rooms(KeyPolicy(), held, 8) is UNLIMITED
    assert unscoped("t" + SEP + "a" + SEP + "x") == ("t", "a" + SEP + "x")
    # a key's own limit wins over the default, up and down
    lone = KeyPolicy.build([KeySettings(1, "t", "one", max_in_flight=1)], None, None)
    assert concurrency_rooms(lone, {}, 8).room("t" + SEP + "one") == 1
    assert concurrency_rooms(lone, {}, 8).room("t" + SEP + "free") is None


def test_key_settings_are_checked_like_queue_settings() -> None:
    assert check_key_settings({"max_in_flight": 2, "max_qps": None}) == {"max_in_flight": 2, "max_qps": None}
    for bad in ({"max_in_flight": 0}, {"max_qps": 0}, {"max_qps": "x"}, {"weight": 1}):
        with pytest.raises(ConfigurationError, match="key setting"):
            check_key_settings(bad)
    assert set(KEY_SETTINGS) == {"max_in_flight", "max_qps"}


@settings(max_examples=100, deadline=None)
@given(st.floats(0.5, 50.0), st.lists(st.floats(0.0, 0.2), min_size=10, max_size=300))
def test_a_rate_key_is_fired_at_most_its_rate_plus_one_in_any_window(rate: float, gaps: list[float]) -> None:
    """Whatever the moments the dispatcher looks, the fires it may do (one per token, the bucket one
    token deep) are at most rate * T + 1 in any window of T seconds."""
    policy = KeyPolicy(default_qps=rate)
    buckets = RateBuckets()
    key = "t" + SEP + "k"
    now = 0.0
    fired: list[float] = []
    for gap in gaps:
        now += gap
        if buckets.rooms_at(policy, now).room(key) == 1:
            buckets.spent(key, rate, now)
            fired.append(now)
        buckets.prune(policy, now)
    for i, start in enumerate(fired):
        for window in (1.0, 0.5, 3.0):
            n = sum(1 for t in fired[i:] if t < start + window)
            assert n <= rate * window + 1 + 1e-6


def test_a_full_bucket_is_forgotten_and_the_wait_names_the_next_token() -> None:
    policy = KeyPolicy(default_qps=2.0, qps={"t" + SEP + "slow": 0.5})
    b = RateBuckets()
    b.spent("t" + SEP + "k", 2.0, 0.0)
    b.spent("t" + SEP + "slow", 0.5, 0.0)
    rooms = b.rooms_at(policy, 0.1)
    assert set(rooms.blocked) == {"t" + SEP + "k", "t" + SEP + "slow"} and rooms.default == 1
    assert b.wait(policy, 0.1) == pytest.approx(0.4)  # k has a token at 0.5 s
    b.prune(policy, 0.6)
    assert len(b) == 1  # k is full again: forgotten; slow is not
    b.prune(policy, 1.0)  # pruned at most once a second
    assert len(b) == 1
    b.prune(policy, 2.1)
    assert len(b) == 0 and b.wait(policy, 2.1) == math.inf
    # without a default, only the keys with their own rate are limited
    only = KeyPolicy(qps={"t" + SEP + "slow": 1.0})
    assert only.limits_rate and b.rooms_at(only, 0.0) == KeyRooms((), ("t" + SEP + "slow",), (1,), None)


def test_a_key_held_at_its_limit_makes_the_next_round_fire_once_it_has_room() -> None:
    s = PickState()
    policy = KeyPolicy(default_in_flight=2)
    s.keys_passed(["t" + SEP + "k"], rate_until=None)
    assert not s.key_room_again({"t" + SEP + "k": 2}, policy, 0.0)
    assert s.key_room_again({"t" + SEP + "k": 1}, policy, 0.0)
    assert not s.key_room_again({}, policy, 0.0)  # said once
    s.keys_passed([], rate_until=5.0)
    assert s.rate_wait(4.0) == 1.0 and not s.key_room_again({}, policy, 4.0)
    assert s.key_room_again({}, policy, 5.0) and s.rate_wait(5.0) == math.inf
    s.keys_passed(["x"], rate_until=1.0)
    s.policy_changed()
    assert s.key_blocked == set() and s.rate_until is None


# ---------------------------------------------------------------------------------- the ledger


def test_a_keys_count_holds_its_deliveries_and_its_strays_until_each_leaves_fired() -> None:
    ledger = Ledger()
    k = "t" + SEP + "k"
    ledger.hold(1, 10, 1, 0.0, "t", k)
    ledger.hold(1, 11, 1, 0.0, "t", k)
    ledger.hold(2, 12, 1, 0.0, "t", None)
    assert ledger.by_key() == {k: 2}
    # the holder went away: its events go back to the table, their key counts them until then
    assert {d.id for d in ledger.release_holder(1)} == {10, 11}
    assert ledger.by_key() == {k: 2} and len(ledger) == 1 and ledger.strays == 2
    ledger.drop(10, 1)  # the release committed
    assert ledger.by_key() == {k: 1}
    ledger.drop(11, 2)  # another attempt: not this one
    assert ledger.by_key() == {k: 1}
    # a new session finds the table's fired events of the key: those no connection holds are strays
    assert ledger.strays_found([(11, 1, k), (30, 4, k), (12, 1, "t" + SEP + "j")]) == 2
    assert ledger.by_key() == {k: 2}  # 12 is held: its delivery counts it
    ledger.check()
    ledger.hold(3, 30, 5, 0.0, "t", k)  # re-fired and pushed again: a delivery, no longer a stray
    assert ledger.by_key() == {k: 2}
    ledger.check()
    ledger.stray(40, 1, None)  # no key: nothing to count
    assert ledger.strays == 1
    for ident in (11, 30, 12):
        ledger.drop(ident)
    assert ledger.by_key() == {}
    ledger.check()


def test_random_ledger_operations_keep_every_key_count_exact() -> None:
    rng = random.Random(7)
    ledger = Ledger()
    keys = ["t" + SEP + c for c in "abc"] + [None]
    for step in range(3000):
        op = rng.random()
        ident = rng.randrange(60)
        if op < 0.4:
            ledger.hold(rng.randrange(4), ident, rng.randrange(1, 3), 0.0, "t", rng.choice(keys))
        elif op < 0.6:
            ledger.drop(ident, rng.choice([None, 1, 2]))
        elif op < 0.7:
            ledger.release_holder(rng.randrange(4))
        elif op < 0.8:
            key = rng.choice(keys)
            if key is not None:
                ledger.stray(ident, 1, key)
        elif op < 0.85:
            fired = [(i, 1, rng.choice(keys[:3])) for i in rng.sample(range(60), 5)]
            ledger.strays_found([(i, a, k) for i, a, k in fired if k is not None])
        else:
            _, d = ledger.claim(rng.randrange(4), ident, rng.randrange(1, 3))
            if d is not None and rng.random() < 0.5:
                ledger.settle(ident, d.attempt)
        if step % 97 == 0:
            ledger.check()
    ledger.check()


# ---------------------------------------------------------------------------------- the direct pick's inputs


def test_the_first_levels_streams_that_gave_all_they_could_are_read_further_next_time() -> None:
    def caps(
        fired: dict[tuple[int, int], int], counts: list[int], old: dict[tuple[int, int], int] | None = None
    ) -> dict[tuple[int, int], int]:
        return next_caps(fired, counts, old or {}, quota=2, limit=8)

    # level 1 in one partition gave its quota of 2 while the batch of 8 went to level 3: next time
    # that stream may give the room left
    assert caps({(0, 1): 2, (1, 3): 2, (2, 3): 2, (3, 3): 2}, [1, 2, 3, 4, 5]) == {(0, 1): 8}
    # two streams of the first level, one of which had less than its quota: the other takes the rest
    assert caps({(0, 1): 2, (1, 1): 1, (2, 3): 2}, [1, 2, 3, 4, 5]) == {(0, 1): 7}
    # the first level filled the batch, or none of its streams was cut: every stream at its quota
    assert caps({(0, 1): 8}, [1, 2, 3, 4, 5], {(0, 1): 8}) == {}
    assert caps({(0, 1): 1, (1, 3): 2}, [1, 2, 3, 4, 5]) == {}
    # the counts decide which levels are first; levels of one count are first together
    assert caps({(0, 1): 2, (1, 5): 2}, [2, 2, 3, 4, 1]) == {(1, 5): 8}
    assert caps({(0, 1): 2, (1, 5): 2}, [1, 2, 3, 4, 1]) == {(0, 1): 4, (1, 5): 4}
    assert caps({}, [1, 2, 3, 4, 5]) == {}


def test_a_new_sessions_rate_keys_start_empty_so_a_failover_adds_no_burst() -> None:
    policy = KeyPolicy(default_qps=2.0)
    b = RateBuckets(origin=100.0)  # a session started at 100 s
    assert b.rooms_at(policy, 100.1).default == 0  # a key not fired yet has earned a fifth of a token
    assert b.wait(policy, 100.1) == pytest.approx(0.4)
    assert b.rooms_at(policy, 100.5).default == 1
    assert b.rooms_at(KeyPolicy(qps={"t" + SEP + "k": 4.0}), 100.3) == KeyRooms((), ("t" + SEP + "k",), (1,), None)
    assert RateBuckets().rooms_at(policy, 0.0).default == 1  # a queue new to the session: full


@pytest.mark.parametrize("default", [None, 2.0])
def test_a_key_whose_bucket_holds_a_token_gets_at_most_one_event_a_pick(default: float | None) -> None:
    """A bucket full again but not pruned yet (pruning runs once a second) still allows one event:
    the burst is one token, whether or not the queue has a default rate."""
    key = "t" + SEP + "k"
    policy = KeyPolicy(default_qps=default, qps={key: 4.0})
    b = RateBuckets()
    b.spent(key, 4.0, 0.0)
    assert b.rooms_at(policy, 0.1).room(key) == 0
    assert b.rooms_at(policy, 0.3).room(key) == 1  # a whole token again, the bucket still held
    admit = KeyAdmission(UNLIMITED, b.rooms_at(policy, 0.3))
    assert admit.allows(None, key)
    admit.took(None, key)
    assert not admit.allows(None, key)
