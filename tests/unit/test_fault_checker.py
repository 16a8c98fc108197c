"""The fault suite's checker on injected histories: each violation is flagged, a clean history passes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from faults.checker import FIELDS, check
from faults.history import HistoryWriter, read

BOUND = 3.0


def enq(
    k: str, t: float, *, tenant: str = "t-a", shard: str = "s0", outcome: str = "commit", fire_at: float | None = None
) -> dict[str, Any]:
    return {
        "kind": "enqueued",
        "t": t,
        "k": k,
        "tenant": tenant,
        "shard": shard,
        "via": "sql",
        "outcome": outcome,
        "fire_at": fire_at,
    }


def dlv(
    k: str, t: float, *, r: str = "r1", attempt: int = 1, term: int = 1, tenant: str = "t-a", ident: int = 1
) -> dict[str, Any]:
    return {
        "kind": "deliver",
        "t": t,
        "r": r,
        "shard": "s0",
        "term": term,
        "id": ident,
        "attempt": attempt,
        "k": k,
        "tenant": tenant,
        "fire_at": None,
    }


def ack(k: str, t: float, *, attempt: int = 1, outcome: str = "ok", via: str = "socket") -> dict[str, Any]:
    return {
        "kind": "ack",
        "t": t,
        "r": "r1",
        "shard": "s0",
        "id": 1,
        "attempt": attempt,
        "k": k,
        "via": via,
        "outcome": outcome,
    }


def up(t: float, r: str = "r1", tenants: list[str] | None = None) -> dict[str, Any]:
    return {"kind": "receiver", "t": t, "r": r, "state": "up", "tenants": tenants}


def down(t: float, r: str = "r1") -> dict[str, Any]:
    return {"kind": "receiver", "t": t, "r": r, "state": "down"}


def clean() -> list[dict[str, Any]]:
    """Two events, each delivered once and acked; one scheduled, delivered after its fire_at."""
    return [
        up(0.0),
        {"kind": "nemesis", "t": 0.5, "round": 1, "name": "kill", "phase": "start", "shards": ["s0"]},
        enq("a", 1.0),
        dlv("a", 1.1),
        ack("a", 1.2),
        enq("b", 1.0, fire_at=2.0),
        dlv("b", 2.05, ident=2),
        ack("b", 2.1),
        enq("rolled", 1.0, outcome="rollback"),
        {"kind": "final", "t": 3.0, "k": "a", "shard": "s0", "state": "acked"},
    ]


def test_a_clean_history_passes_and_its_line_has_exactly_the_fields() -> None:
    report = check(clean(), scenario="clean", stall_bound_s=BOUND)
    line = report.line()
    assert tuple(line) == FIELDS
    assert line["pass"] is True, report.examples
    assert (line["events"], line["rounds"], line["duplicates"]) == (2, 1, 0)
    assert line["recovery_s_p99"] is not None and abs(line["recovery_s_p99"] - 0.6) < 1e-9
    assert line["max_stall_s"] <= 0.11


def test_a_lost_event_is_flagged() -> None:
    history = [*clean(), enq("c", 1.5)]  # committed, never delivered nor acked
    report = check(history, scenario="x", stall_bound_s=100.0)
    assert report.lost == 1 and not report.passed
    assert report.examples["lost"][0]["k"] == "c"
    # acked in the final read of the database (its confirmation was never seen): not lost;
    # dead-lettered is not lost either; still waiting (to_be_fired) is
    for state, lost in (("acked", 0), ("failed", 0), ("to_be_fired", 1)):
        final = {"kind": "final", "t": 4, "k": "c", "shard": "s0", "state": state}
        assert check([*history, final], scenario="x", stall_bound_s=100.0).lost == lost, state
    # an unconfirmed ack (refused, or its SQL transaction rolled back) does not count
    assert (
        check(
            [*history, dlv("c", 1.6), ack("c", 1.7, via="sql", outcome="rollback")], scenario="x", stall_bound_s=100.0
        ).lost
        == 1
    )


def test_an_unexpected_delivery_of_a_rolled_back_or_unknown_key_is_flagged() -> None:
    report = check([*clean(), dlv("rolled", 1.5, ident=9)], scenario="x", stall_bound_s=BOUND)
    assert report.unexpected == 1 and not report.passed
    assert check([*clean(), dlv("never-enqueued", 1.5, ident=9)], scenario="x", stall_bound_s=BOUND).unexpected == 1
    # one key published as two rows (two ids): the second row is unexpected
    assert check([*clean(), dlv("a", 1.15, ident=7)], scenario="x", stall_bound_s=BOUND).unexpected == 1
    # a key whose commit outcome is unknown may be delivered
    history = [*clean(), enq("maybe", 1.0, outcome="unknown"), dlv("maybe", 1.5, ident=9)]
    assert check(history, scenario="x", stall_bound_s=BOUND).unexpected == 0


def test_an_early_delivery_is_flagged() -> None:
    history = [*clean(), enq("c", 1.0, fire_at=5.0), dlv("c", 4.9, ident=3), ack("c", 5.0)]
    report = check(history, scenario="x", stall_bound_s=BOUND)
    assert report.early == 1 and not report.passed
    assert report.examples["early"][0]["k"] == "c"
    # on time (within the clock reading's rounding): fine
    ok = [*clean(), enq("c", 1.0, fire_at=5.0), dlv("c", 4.9995, ident=3), ack("c", 5.1)]
    assert check(ok, scenario="x", stall_bound_s=BOUND).early == 0


def test_a_delivery_after_a_confirmed_ack_is_flagged() -> None:
    history = [*clean(), dlv("a", 1.5, attempt=2)]  # "a" was acked (confirmed) at 1.2
    report = check(history, scenario="x", stall_bound_s=BOUND)
    assert report.after_ack == 1 and report.duplicates == 1 and not report.passed
    # the acked attempt pushed a second time after the ack
    assert check([*clean(), dlv("a", 1.5, r="r2")], scenario="x", stall_bound_s=BOUND).after_ack == 1
    # an earlier attempt's push read late by a receiver that was frozen: sent before the ack, not flagged
    late = [up(0), enq("c", 1.0), dlv("c", 4.0, attempt=2), ack("c", 4.1, attempt=2), dlv("c", 9.0, r="frozen")]
    report = check(late, scenario="x", stall_bound_s=BOUND)
    assert report.after_ack == 0 and report.duplicates == 1
    # the same by SQL: a committed SQL ack is a confirmation, a rolled-back one is not
    sql = [up(0), enq("c", 1.0), dlv("c", 1.1), ack("c", 1.2, via="sql"), dlv("c", 1.5, attempt=2)]
    assert check(sql, scenario="x", stall_bound_s=BOUND).after_ack == 1
    rolled = [
        up(0),
        enq("c", 1.0),
        dlv("c", 1.1),
        ack("c", 1.2, via="sql", outcome="rollback"),
        dlv("c", 1.5, attempt=2),
        ack("c", 1.6, attempt=2),
    ]
    report = check(rolled, scenario="x", stall_bound_s=BOUND)
    assert report.after_ack == 0 and report.duplicates == 1 and report.passed


def test_a_cross_tenant_delivery_is_flagged() -> None:
    # the receiver subscribed to tenant t-b only and got an event of t-a
    history = [up(0.0, "scoped", tenants=["t-b"]), enq("c", 1.0), dlv("c", 1.1, r="scoped"), ack("c", 1.2)]
    report = check(history, scenario="x", stall_bound_s=BOUND)
    assert report.cross_tenant == 1 and not report.passed
    # a delivery that names another tenant than the one enqueued
    history = [up(0.0), enq("c", 1.0), dlv("c", 1.1, tenant="t-z"), ack("c", 1.2)]
    assert check(history, scenario="x", stall_bound_s=BOUND).cross_tenant == 1


def test_a_delivery_by_a_deposed_leader_is_flagged() -> None:
    # attempt 1 under term 3 (the new leader), then attempt 2 under term 2: the old leader fired after
    # it was deposed
    history = [
        up(0.0),
        enq("c", 1.0),
        dlv("c", 1.1, term=3),
        dlv("c", 1.5, attempt=2, term=2),
        ack("c", 1.6, attempt=2),
    ]
    report = check(history, scenario="x", stall_bound_s=BOUND)
    assert report.deposed_deliveries == 1 and not report.passed
    # one attempt fired by two leaders
    history = [up(0.0), enq("c", 1.0), dlv("c", 1.1, term=2), dlv("c", 1.2, term=3, r="r2"), ack("c", 1.6)]
    assert check(history, scenario="x", stall_bound_s=BOUND).deposed_deliveries == 1
    # a takeover re-fires with a higher attempt under a higher term: fine (a duplicate)
    history = [
        up(0.0),
        enq("c", 1.0),
        dlv("c", 1.1, term=2),
        dlv("c", 4.0, attempt=2, term=3),
        ack("c", 4.1, attempt=2),
    ]
    report = check(history, scenario="x", stall_bound_s=BOUND)
    assert report.deposed_deliveries == 0 and report.duplicates == 1 and report.passed


def test_a_stall_with_a_receiver_free_is_flagged_and_time_without_one_is_not_counted() -> None:
    nemesis = {"kind": "nemesis", "t": 1.0, "round": 1, "name": "kill", "phase": "start", "shards": ["s0"]}
    history = [up(0.0), nemesis, enq("c", 1.0), dlv("c", 6.0), ack("c", 6.1)]
    report = check(history, scenario="x", stall_bound_s=BOUND)
    assert abs(report.max_stall_s - 5.0) < 1e-9 and report.stall_by_round == {1: report.max_stall_s}
    assert not report.passed and report.examples["max_stall"][0]["k"] == "c"
    assert report.recovery_s_p99 is not None and abs(report.recovery_s_p99 - 5.0) < 1e-9
    # the only receiver was down from 1.5 to 5.5: 1 s of waiting counts
    history = [up(0.0), nemesis, enq("c", 1.0), down(1.5), up(5.5), dlv("c", 6.0), ack("c", 6.1)]
    report = check(history, scenario="x", stall_bound_s=BOUND)
    assert abs(report.max_stall_s - 1.0) < 1e-9 and report.passed
    # a receiver whose tenant filter excludes the event does not count as free
    history = [up(0.0, "scoped", tenants=["t-b"]), nemesis, enq("c", 1.0), up(5.0), dlv("c", 6.0), ack("c", 6.1)]
    assert abs(check(history, scenario="x", stall_bound_s=BOUND).max_stall_s - 1.0) < 1e-9
    # an SQL ack rolled back late: due again at once, and the next attempt took 4 s
    rb = {**ack("c", 3.0, via="sql", outcome="rollback"), "due_again": 3.0}
    history = [
        up(0.0),
        enq("c", 1.0),
        dlv("c", 1.1),
        rb,
        dlv("c", 2.0, r="frozen"),
        dlv("c", 7.0, attempt=2),
        ack("c", 7.1, attempt=2),
    ]
    report = check(history, scenario="x", stall_bound_s=BOUND)
    assert abs(report.max_stall_s - 4.0) < 1e-9 and not report.passed
    # ... or the receiver acked it over the socket after the rollback: nothing waited
    history = [up(0.0), enq("c", 1.0), dlv("c", 1.1), rb, ack("c", 3.1)]
    assert check(history, scenario="x", stall_bound_s=BOUND).max_stall_s < 0.2
    # ... or its socket ack committed but the answer was lost with a reset: settled in the final
    # read and no later attempt fired, so it was never due again (found at 64 s on a lossy link)
    settled = {"kind": "final", "t": 9.0, "k": "c", "shard": "s0", "state": "acked"}
    history = [up(0.0), enq("c", 1.0), dlv("c", 1.1), rb, settled]
    assert check(history, scenario="x", stall_bound_s=BOUND).max_stall_s < 0.2
    # ... but still in the queue in the final read, it waited to the end of the history
    history = [up(0.0), enq("c", 1.0), dlv("c", 1.1), rb, {**settled, "state": "fired"}]
    assert not check(history, scenario="x", stall_bound_s=BOUND).passed
    # a scheduled event waits from its fire_at, not from its commit
    history = [up(0.0), enq("c", 1.0, fire_at=5.0), dlv("c", 5.2), ack("c", 5.3)]
    assert check(history, scenario="x", stall_bound_s=BOUND).max_stall_s < 0.3


def test_histories_round_trip_through_files_and_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    writer = HistoryWriter(tmp_path / "a.jsonl")
    writer.write("enqueued", t=2.0, k="a", tenant="t-a", shard="s0", via="sql", outcome="commit", fire_at=None)
    writer.close()
    other = tmp_path / "b.jsonl"
    other.write_text(json.dumps(up(1.0)) + "\n" + '{"kind": "deliver", "t": 3')  # killed mid-line
    records = read([tmp_path / "a.jsonl", other])
    assert [r["kind"] for r in records] == ["receiver", "enqueued"]


def state(
    k: str, t: float, old: str, new: str, *, ckey: str | None = "acct", rkey: str | None = None
) -> dict[str, Any]:
    """A change of an event's state as the shard's database recorded it (the key scenarios' trigger)."""
    return {
        "kind": "state",
        "t": t,
        "k": k,
        "shard": "s0",
        "tenant": "t-a",
        "ckey": ckey,
        "rkey": rkey,
        "attempt": 1,
        "old": old,
        "new": new,
    }


def test_a_key_with_more_events_in_hand_than_its_limit_is_flagged_and_settles_free_its_slots() -> None:
    fine = [
        state("a", 1.0, "to_be_fired", "fired"),
        state("b", 1.1, "to_be_fired", "fired"),
        state("a", 1.2, "fired", "acked"),
        state("c", 1.3, "to_be_fired", "fired"),  # a settled first: two in hand
        state("b", 1.4, "fired", "to_be_fired"),  # taken back (nack, collector): no longer in hand
        state("d", 1.5, "to_be_fired", "fired"),
        state("x", 1.5, "to_be_fired", "fired", ckey="other"),  # another key counts apart
        state("c", 1.6, "fired", "deleted"),
        state("e", 1.7, "to_be_fired", "fired"),
    ]
    report = check(clean() + fine, scenario="keys", stall_bound_s=BOUND, key_max_in_flight=2)
    assert report.key_over_limit == 0 and report.key_most_in_hand == 2 and report.passed
    over = [*fine, state("f", 1.8, "to_be_fired", "fired")]  # d, e and f in hand
    report = check(clean() + over, scenario="keys", stall_bound_s=BOUND, key_max_in_flight=2)
    assert report.key_over_limit == 1 and not report.passed
    assert report.examples["key_over_limit"][0]["k"] == "f"
    # without a limit to hold to, the same history passes (the scenario does not limit keys)
    assert check(clean() + over, scenario="keys", stall_bound_s=BOUND).key_over_limit == 0


def test_a_rate_key_fired_more_than_its_rate_plus_one_in_a_second_is_flagged() -> None:
    # 2 a second, burst one: three fires in one second pass, four do not
    fine = [state(f"e{i}", 10.0 + i * 0.5, "to_be_fired", "fired", ckey=None, rkey="api") for i in range(6)]
    fine.append(state("e9", 10.5, "to_be_fired", "fired", ckey=None, rkey="api"))  # the burst's token
    report = check(clean() + fine, scenario="rate", stall_bound_s=BOUND, key_max_qps=2.0)
    assert report.key_over_rate == 0 and report.key_most_per_second == 3 and report.passed
    over = [*fine, state("e8", 10.8, "to_be_fired", "fired", ckey=None, rkey="api")]
    report = check(clean() + over, scenario="rate", stall_bound_s=BOUND, key_max_qps=2.0)
    assert report.key_over_rate >= 1 and not report.passed
    # a re-fire counts as a fire; a fire of another key does not
    other = [state("o1", 10.8, "to_be_fired", "fired", ckey=None, rkey="web")]
    assert check(clean() + fine + other, scenario="rate", stall_bound_s=BOUND, key_max_qps=2.0).key_over_rate == 0


def _slot_history(slots: list[int], rows: int = 1) -> list[dict[str, Any]]:
    """A schedule of 1 s and its slot events (at second ``s``, each delivered and acked by key)."""
    out: list[dict[str, Any]] = [up(0.0), {"kind": "schedule", "t": 0.0, "schedule_id": "7", "interval_s": 1.0}]
    for i, s in enumerate(slots):
        k = f"qm:schedule:7:{s * 1_000_000}"
        for _ in range(rows):
            out.append(enq(k, s - 30.0, fire_at=float(s)))
        out += [dlv(k, s + 0.001, ident=100 + i), ack(k, s + 0.01)]
    return out


def test_every_slot_of_a_schedule_enqueued_once_passes_a_gap_or_a_second_row_does_not() -> None:
    from faults.schedules import relabel

    report = check(_slot_history([100, 101, 102, 103]), scenario="schedules", stall_bound_s=BOUND)
    assert (report.slots, report.slots_missing, report.slots_twice, report.passed) == (4, 0, 0, True)
    gap = check(_slot_history([100, 101, 104]), scenario="schedules", stall_bound_s=BOUND)
    assert (gap.slots_missing, gap.passed) == (2, False)
    assert gap.examples["slots_missing"][0]["missing"] == 2
    twice = check(_slot_history([100, 101], rows=2), scenario="schedules", stall_bound_s=BOUND)
    assert (twice.slots_twice, twice.passed) == (2, False)
    # the receivers' records of a slot event (its payload has no key) take the slot's key by (shard, id)
    records = [
        {"kind": "enqueued", "t": 1.0, "k": "qm:schedule:7:5", "shard": "s0", "id": 9, "op": "schedule"},
        {"kind": "deliver", "t": 2.0, "k": None, "shard": "s0", "id": 9},
        {"kind": "deliver", "t": 2.0, "k": "x", "shard": "s1", "id": 9},
    ]
    assert [r["k"] for r in relabel(records)] == ["qm:schedule:7:5", "qm:schedule:7:5", "x"]
