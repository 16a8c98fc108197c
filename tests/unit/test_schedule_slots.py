"""The slots of periodic schedules on a fake clock (queue_manager/domain/schedules.py): cron and
interval over many slots, DST forward and back, the misfire policies after a leader gap, and every
bad definition refused."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from queue_manager.domain import schedules as sch
from queue_manager.errors import InvalidInputError

BERLIN = ZoneInfo("Europe/Berlin")


def _leader(
    spec: sch.Spec,
    start: datetime,
    end: datetime,
    every: float = 1.0,
    lookahead: float = 30.0,
    gaps: tuple[tuple[datetime, datetime], ...] = (),
) -> tuple[list[tuple[datetime, datetime]], int]:
    """A leader's passes every ``every`` seconds from ``start`` to ``end`` (none inside a gap): every
    (slot, time enqueued), and the slots skipped."""
    trig = sch.check(spec)
    cursor = start
    now = start
    out: list[tuple[datetime, datetime]] = []
    missed = 0
    while now <= end:
        if not any(a <= now < b for a, b in gaps):
            p = sch.plan(trig, spec, cursor, now, lookahead, grace=1.0)
            out += [(s, now) for s in p.enqueue]
            missed += p.missed
            assert p.next_at >= cursor
            cursor = p.next_at
        now += timedelta(seconds=every)
    return out, missed


def _spec(
    cron: str | None = None,
    every: float | None = None,
    tz: str = "UTC",
    anchor: datetime | None = None,
    misfire: sch.Misfire = "latest",
    catch_up: int = 1,
) -> sch.Spec:
    return sch.Spec(cron, every, tz, anchor or datetime(2026, 1, 1, tzinfo=UTC), misfire, catch_up)


def test_a_cron_schedule_over_many_slots_enqueues_each_once_ahead_of_its_time() -> None:
    start = datetime(2026, 6, 1, 10, 0, 0, 500_000, tzinfo=UTC)
    got, missed = _leader(_spec("*/5 * * * *"), start, start + timedelta(hours=6), every=1.0, lookahead=30)
    slots = [s for s, _ in got]
    assert missed == 0
    assert len(slots) == len(set(slots)) == 6 * 12
    assert slots == [datetime(2026, 6, 1, 10, 5, tzinfo=UTC) + timedelta(minutes=5 * i) for i in range(72)]
    # enqueued at least the lookahead less one pass ahead, never after its time
    assert all(timedelta(seconds=29) <= s - at <= timedelta(seconds=30) for s, at in got)


def test_an_interval_schedule_over_many_slots_counts_real_seconds_from_its_anchor() -> None:
    anchor = datetime(2026, 6, 1, 9, 59, 58, 250_000, tzinfo=UTC)
    start = datetime(2026, 6, 1, 10, 0, tzinfo=UTC)
    got, missed = _leader(_spec(every=7, anchor=anchor), start, start + timedelta(hours=1), every=0.5, lookahead=10)
    slots = [s for s, _ in got]
    assert missed == 0 and len(slots) == len(set(slots))
    first = anchor + timedelta(seconds=7)
    assert slots == [first + timedelta(seconds=7 * i) for i in range(len(slots))]
    assert len(slots) >= 3600 // 7
    assert all(s >= at for s, at in got)


def test_an_interval_of_an_hour_ignores_the_dst_change() -> None:
    start = datetime(2026, 3, 28, 22, 0, tzinfo=UTC)
    spec = _spec(every=3600, tz="Europe/Berlin", anchor=start)
    got, _ = _leader(spec, start, start + timedelta(hours=8), every=60, lookahead=120)
    slots = [s for s, _ in got]
    assert all(b - a == timedelta(hours=1) for a, b in itertools.pairwise(slots))


def test_dst_forward_a_daily_time_that_does_not_exist_fires_once_at_the_jump() -> None:
    trig = sch.check(_spec("30 2 * * *", tz="Europe/Berlin"))
    runs = trig.next_runs(datetime(2026, 3, 27, 12, 0, tzinfo=UTC), 4)
    assert [r.astimezone(BERLIN).strftime("%m-%d %H:%M %z") for r in runs] == [
        "03-28 02:30 +0100", "03-29 03:30 +0200", "03-30 02:30 +0200", "03-31 02:30 +0200",
    ]  # fmt: skip
    hourly = sch.check(_spec("0 * * * *", tz="Europe/Berlin"))
    day = hourly.slots(datetime(2026, 3, 28, 23, 0, tzinfo=UTC), datetime(2026, 3, 29, 21, 59, tzinfo=UTC), 100)
    assert len(day) == 23  # the local day of the jump has 23 hours
    assert "02:00" not in [r.astimezone(BERLIN).strftime("%H:%M") for r in day]


def test_dst_back_a_daily_time_fires_once_and_every_quarter_hour_fires_in_both_passes() -> None:
    trig = sch.check(_spec("30 2 * * *", tz="Europe/Berlin"))
    runs = trig.next_runs(datetime(2026, 10, 24, 12, 0, tzinfo=UTC), 3)
    assert [r.astimezone(UTC).strftime("%m-%d %H:%M") for r in runs] == ["10-25 00:30", "10-26 01:30", "10-27 01:30"]
    quarter = sch.check(_spec("*/15 * * * *", tz="Europe/Berlin"))
    day = quarter.slots(datetime(2026, 10, 24, 22, 0, tzinfo=UTC), datetime(2026, 10, 25, 22, 59, tzinfo=UTC), 1000)
    assert len(day) == 25 * 4  # the local day of the fall-back has 25 hours
    assert len(set(day)) == len(day) and day == sorted(day)
    # and the leader's passes through the night enqueue each once
    spec = _spec("*/15 * * * *", tz="Europe/Berlin")
    got, _ = _leader(
        spec,
        datetime(2026, 10, 24, 23, 0, tzinfo=UTC),
        datetime(2026, 10, 25, 3, 0, tzinfo=UTC),
        every=20,
        lookahead=60,
    )
    slots = [s for s, _ in got]
    assert len(slots) == len(set(slots)) == 4 * 4 + 1  # 23:00 to 03:00 UTC, both ends


@pytest.mark.parametrize(
    ("misfire", "catch_up", "expected_missed_kept"),
    [("skip", 1, 0), ("latest", 1, 1), ("catch_up", 3, 3), ("catch_up", 100, 10)],
)
@pytest.mark.parametrize("kind", ["cron", "interval"])
def test_misfire_policies_after_a_leader_gap(
    misfire: sch.Misfire, catch_up: int, expected_missed_kept: int, kind: str
) -> None:
    start = datetime(2026, 6, 1, 10, 0, 30, tzinfo=UTC)
    spec = (
        _spec("* * * * *", misfire=misfire, catch_up=catch_up)
        if kind == "cron"
        else _spec(every=60, anchor=datetime(2026, 6, 1, tzinfo=UTC), misfire=misfire, catch_up=catch_up)
    )
    gap = (start + timedelta(minutes=2), start + timedelta(minutes=12))  # nothing leads for 10 minutes
    got, missed = _leader(spec, start, start + timedelta(minutes=20), every=1.0, lookahead=30, gaps=(gap,))
    slots = [s for s, _ in got]
    assert len(slots) == len(set(slots))
    every_minute = [datetime(2026, 6, 1, 10, 1, tzinfo=UTC) + timedelta(minutes=i) for i in range(20)]
    # the slots enqueued before the gap (up to its start plus the lookahead) and after it are all there
    lost = [s for s in every_minute if s not in slots]
    late = [s for s, at in got if at > s]
    assert len(late) == expected_missed_kept
    # 10:03 to 10:12 were missed (10:02 was enqueued ahead, before the gap)
    assert missed == len(lost) == 10 - expected_missed_kept
    # those kept are the latest missed ones, enqueued when the leader came back
    assert late == sorted(late) and all(at == gap[1] for s, at in got if at > s)
    if late:
        assert late[-1] == datetime(2026, 6, 1, 10, 12, tzinfo=UTC)


def test_a_long_gap_of_a_cron_schedule_is_walked_over_several_passes() -> None:
    spec = _spec("* * * * *", misfire="catch_up", catch_up=2)
    trig = sch.check(spec)
    cursor = datetime(2026, 1, 1, tzinfo=UTC)
    now = cursor + timedelta(days=30)  # 43 200 missed minutes
    total = 0
    for _ in range(10):
        p = sch.plan(trig, spec, cursor, now, 30, 1.0)
        total += p.missed
        cursor = p.next_at
        if p.enqueue:
            break
    assert [s.strftime("%H:%M") for s in p.enqueue[:2]] == ["23:58", "23:59"]
    assert total == 30 * 1440 - 2


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (dict(cron="61 * * * *"), "cron expression '61 * * * *' is not valid"),
        (dict(cron="* * * *"), "give 5 fields"),
        (dict(cron="0 0 30 2 *"), "never matches"),
        (dict(cron="every minute please"), "not valid"),
        (dict(every=0.5), "from 1 second"),
        (dict(every=float("nan")), "from 1 second"),
        (dict(every=400 * 86400.0), "366 days"),
        (dict(), "either a cron expression"),
        (dict(cron="* * * * *", every=5), "not both"),
        (dict(cron="* * * * *", tz="Mars/Olympus"), "unknown time zone 'Mars/Olympus'"),
        (dict(cron="* * * * *", tz=""), "unknown time zone"),
        (dict(cron="* * * * *", misfire="sometimes"), "misfire must be one of skip, latest, catch_up"),
        (dict(cron="* * * * *", misfire="catch_up", catch_up=0), "catch_up must be an integer from 1 to 1000"),
        (dict(every=5, anchor=datetime(2026, 1, 1)), "must carry its offset"),
    ],
)
def test_every_bad_definition_is_refused_with_what_is_wrong(spec: dict[str, object], words: str) -> None:
    kw = dict(spec)
    args = _spec(
        cron=kw.get("cron"),  # type: ignore[arg-type]
        every=kw.get("every"),  # type: ignore[arg-type]
        tz=kw.get("tz", "UTC"),  # type: ignore[arg-type]
        anchor=kw.get("anchor"),  # type: ignore[arg-type]
        misfire=kw.get("misfire", "latest"),  # type: ignore[arg-type]
        catch_up=kw.get("catch_up", 1),  # type: ignore[arg-type]
    )
    with pytest.raises(InvalidInputError, match=words.replace("*", r"\*").replace("(", r"\(")):
        sch.check(args)


def test_names_as_typed() -> None:
    assert sch.check_name("nightly-report.v2") == "nightly-report.v2"
    for bad in ("", "-x", "a b", "x" * 101, "é"):
        with pytest.raises(InvalidInputError, match="schedule name"):
            sch.check_name(bad)


def test_dedup_keys_name_the_schedule_and_the_slot_to_the_microsecond() -> None:
    t = datetime(2026, 6, 1, 10, 0, 0, 123_456, tzinfo=UTC)
    assert sch.dedup_key(7, t) == f"qm:schedule:7:{int(t.timestamp()) * 1_000_000 + 123_456}"
    assert sch.dedup_key(7, t) != sch.dedup_key(7, t + timedelta(microseconds=1))
