"""A queue's pick state without a database: nudges, rescan slices, where picks start, backlog and
cursor after a pick, tenants waiting for room."""

from __future__ import annotations

import pytest

from queue_manager.manager.fairness import TenantPolicy
from queue_manager.manager.pickstate import RESCAN_REASONS, RESCAN_SLICES, PickState, Reason

DB = 1_750_000_000.0  # the database's clock (epoch seconds)


def test_a_new_queue_is_rescanned_first_and_nothing_else_is_pending() -> None:
    s = PickState()
    assert (s.backlog, s.cursor, s.last_pick, s.cap_blocked, s.cache_held) == (False, 0, None, set(), False)
    assert s.take_nudges() == (True, False)  # a new queue's window is unknown
    assert s.take_nudges() == (False, False)  # taken once


@pytest.mark.parametrize("reason", list(Reason))
def test_each_reason_asks_for_what_it_needs(reason: Reason) -> None:
    s = PickState()
    s.take_nudges()
    s.nudge(reason)
    expected = (reason in RESCAN_REASONS, reason is Reason.DUE)
    assert s.take_nudges() == expected
    assert s.take_nudges() == (False, False)


def test_nudges_that_arrive_after_the_take_count_for_the_next_round() -> None:
    s = PickState()
    s.take_nudges()
    s.nudge(Reason.DUE)
    assert s.take_nudges() == (False, True)
    s.nudge(Reason.REQUEUED)  # meanwhile, while the round awaits its fire
    s.nudge(Reason.DUE)
    assert s.take_nudges() == (True, True)


def test_a_session_reset_rescans_and_keeps_the_round_robin_position() -> None:
    s = PickState()
    s.take_nudges()
    s.direct_fired({5: 1}, {5: DB}, None, DB, full=False, partitions=8)
    assert s.cursor == 6
    s.reset()
    assert s.take_nudges() == (True, False)
    assert s.cursor == 6  # fairness across sessions: the next pick goes on from where it was


@pytest.mark.parametrize("partitions", [1, 3, 4, 16, 17])
def test_the_rescan_slices_cover_every_partition_once_per_round(partitions: int) -> None:
    s = PickState()
    for _ in range(2):  # two full rounds: the turns wrap around
        seen = [p for _ in range(RESCAN_SLICES) for p in s.next_slice(partitions)]
        assert sorted(seen) == list(range(partitions))


def test_a_full_scan_records_its_kind_and_a_slice_does_not() -> None:
    s = PickState()
    s.scanned(full=True, future_only=True, next_scan=10.0)
    assert (s.scanned_future_only, s.next_scan) == (True, 10.0)
    s.scanned(full=False, future_only=False, next_scan=10.5)  # a slice says nothing of the whole window
    assert (s.scanned_future_only, s.next_scan) == (True, 10.5)
    s.scanned(full=True, future_only=False, next_scan=11.0)
    assert s.scanned_future_only is False


def test_sparse_partitions_go_first_only_behind_a_backlog() -> None:
    s = PickState()
    assert s.direct_start() == (0, None)
    s.direct_fired({0: 2, 1: 2}, {0: DB - 1, 1: DB - 1}, None, DB, full=True, partitions=4)
    assert s.backlog and s.last_pick == DB
    assert s.direct_start() == (2, DB)  # behind a backlog: from the last pick's time on
    s.direct_fired({2: 1}, {2: DB - 1}, DB, DB + 0.01, full=False, partitions=4)
    assert not s.backlog
    assert s.direct_start() == (3, None)  # everything due was taken: plain round robin


def test_the_cursor_moves_past_the_backlogged_partitions_only() -> None:
    s = PickState()
    s.direct_fired({0: 1}, {0: DB - 5}, None, DB, full=True, partitions=4)
    assert s.cursor == 1
    # from 1: partition 3's event is new since the last pick (sparse, served out of turn), 1 is backlogged
    s.direct_fired({1: 1, 3: 1}, {1: DB - 5, 3: DB + 0.001}, DB, DB + 0.01, full=True, partitions=4)
    assert s.cursor == 2
    # a pick that found nothing leaves the cursor, and the pick's time moves on
    s.direct_fired({}, {}, DB + 0.01, DB + 0.02, full=False, partitions=4)
    assert (s.cursor, s.last_pick, s.backlog) == (2, DB + 0.02, False)


def test_every_batch_starts_its_ties_one_subscriber_further_on() -> None:
    s = PickState()
    assert [s.next_turn() for _ in range(3)] == [1, 2, 3]


def test_a_tenant_held_at_its_cap_makes_the_next_round_fire_once_it_has_room() -> None:
    s = PickState()
    policy = TenantPolicy(caps={"a": 2}, default_cap=None)
    s.fair_fired({3: 2}, full=False, capped=["a"], partitions=4)
    assert s.cursor == 0 and s.cap_blocked == {"a"}
    assert not s.room_again({"a": 2}, policy)  # still at its cap
    assert s.cap_blocked == {"a"}
    assert s.room_again({"a": 1}, policy)  # an ack freed a slot
    assert s.cap_blocked == set()
    assert not s.room_again({}, policy)  # said once


def test_a_changed_policy_forgets_who_was_held_back() -> None:
    s = PickState()
    s.fair_fired({}, full=True, capped=["a", "b"], partitions=4)
    assert s.backlog and s.cap_blocked == {"a", "b"}
    s.policy_changed()
    assert s.cap_blocked == set()


def test_the_fair_pick_moves_the_cursor_past_the_last_partition_that_gave() -> None:
    s = PickState()
    s.fair_fired({1: 1, 2: 3}, full=True, capped=[], partitions=4)
    assert s.cursor == 3
    s.fair_fired({3: 1, 0: 1}, full=True, capped=[], partitions=4)  # from 3: 3 then 0
    assert s.cursor == 1
