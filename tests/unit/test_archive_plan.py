"""The pure half of the archive job (spark_jobs.archive_plan)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest

from queue_manager.errors import ArchiveError, ConfigurationError, InvalidNameError
from spark_jobs.archive_plan import (
    ArchiveLayout,
    DeletionRecord,
    QueuePlan,
    RunPlan,
    ShardManifest,
    WrittenStats,
    check_queues,
    check_run_id,
    check_sizes,
    id_slices,
    manifest_for,
    new_run_id,
    parse_age,
    parse_time,
    read_partitions,
    resolve_cutoff,
    verify_shard,
)

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def test_ages_and_times_parse_or_say_what_is_expected() -> None:
    assert parse_age("90") == timedelta(seconds=90)
    assert parse_age("15m") == timedelta(minutes=15)
    assert parse_age(" 1.5h ") == timedelta(minutes=90)
    assert parse_age("30d") == timedelta(days=30)
    assert parse_age("2w") == timedelta(days=14)
    for bad in ("", "-3d", "0", "3 days", "d", "1y"):
        with pytest.raises(ConfigurationError, match="age"):
            parse_age(bad)
    assert parse_time("2026-01-01T00:00:00Z") == datetime(2026, 1, 1, tzinfo=UTC)
    with pytest.raises(ConfigurationError, match="UTC offset"):
        parse_time("2026-01-01T00:00:00")
    with pytest.raises(ConfigurationError, match="ISO-8601"):
        parse_time("yesterday")


def test_cutoff_is_now_minus_the_age_or_a_past_aware_time() -> None:
    assert resolve_cutoff(timedelta(days=7), NOW) == NOW - timedelta(days=7)
    past = datetime(2026, 2, 1, tzinfo=timezone(timedelta(hours=2)))
    assert resolve_cutoff(past, NOW) == past
    with pytest.raises(ConfigurationError, match="in the future"):
        resolve_cutoff(NOW + timedelta(seconds=1), NOW)
    with pytest.raises(ConfigurationError, match="positive"):
        resolve_cutoff(timedelta(seconds=-1), NOW)
    with pytest.raises(ConfigurationError, match="no time zone"):
        resolve_cutoff(datetime(2026, 1, 1), NOW)
    with pytest.raises(ConfigurationError, match="timedelta"):
        resolve_cutoff(7, NOW)  # type: ignore[arg-type]


def test_names_and_sizes_are_checked() -> None:
    assert check_run_id("r1") == "r1"
    for bad in ("", "1abc", "../x", "a/b", "a=b", "x" * 65):
        with pytest.raises(ConfigurationError, match="invalid run id"):
            check_run_id(bad)
    assert new_run_id(NOW, "ab12") == "archive-20260301T120000Z-ab12"
    assert check_queues(None) is None
    assert check_queues(["b", "a", "b"]) == ("a", "b")
    assert check_queues("orders") == ("orders",)
    with pytest.raises(ConfigurationError, match="no queue"):
        check_queues([])
    with pytest.raises(InvalidNameError):
        check_queues(["DROP TABLE"])
    with pytest.raises(ConfigurationError, match="rows_per_partition"):
        check_sizes(delete_slice=1, rows_per_partition=0)
    with pytest.raises(ConfigurationError, match="delete_slice"):
        check_sizes(delete_slice=True, rows_per_partition=1)


def test_read_partitions_grow_with_the_rows_within_bounds() -> None:
    assert read_partitions(0, 50_000) == 1
    assert read_partitions(50_000, 50_000) == 1
    assert read_partitions(50_001, 50_000) == 2
    assert read_partitions(10**9, 50_000) == 64
    assert read_partitions(10, 1, max_partitions=4) == 4


def test_id_slices_cover_every_id_once_in_order() -> None:
    assert list(id_slices(range(7), 3)) == [[0, 1, 2], [3, 4, 5], [6]]
    assert list(id_slices([], 3)) == []
    with pytest.raises(ConfigurationError):
        list(id_slices([1], 0))


def test_layout_names_hidden_files_and_hive_directories(tmp_path: Path) -> None:
    layout = ArchiveLayout(tmp_path, "r1")
    assert layout.run_dir == tmp_path / "run=r1"
    assert layout.shard_dir("s0") == tmp_path / "run=r1" / "shard=s0"
    assert layout.queue_dir("s0", "orders") == tmp_path / "run=r1" / "shard=s0" / "queue=orders"
    # everything that is not data starts with "_", which Parquet readers skip
    for path in (layout.plan_file, layout.manifest_file("s0"), layout.deleted_file("s0"), layout.lock_file):
        assert path.name.startswith("_")
    assert layout.staging_dir.relative_to(tmp_path).parts[0].startswith("_")


def plan() -> RunPlan:
    return RunPlan(
        "r1",
        NOW - timedelta(days=7),
        NOW,
        ("billing", "orders"),
        {
            "s0": {"orders": QueuePlan(100, 40, 2, 90), "billing": QueuePlan(10, 0, None, None)},
            "s1": {"orders": QueuePlan(80, 30, 1, 77), "billing": QueuePlan(5, 2, 1, 3)},
        },
    )


def test_plan_round_trips_and_a_resume_must_match_it() -> None:
    p = plan()
    assert RunPlan.from_json(p.to_json(), source="x") == p
    p.check_resume(queues=None, shards=["s1", "s0"], older_than=timedelta(days=30))  # an age: the plan's cut-off stands
    p.check_resume(queues=("billing", "orders"), shards=["s0", "s1"], older_than=p.cutoff)
    with pytest.raises(ConfigurationError, match="same queues"):
        p.check_resume(queues=("orders",), shards=["s0", "s1"], older_than=p.cutoff)
    with pytest.raises(ConfigurationError, match="shards s0, s1"):
        p.check_resume(queues=None, shards=["s0"], older_than=p.cutoff)
    with pytest.raises(ConfigurationError, match="same cut-off"):
        p.check_resume(queues=None, shards=["s0", "s1"], older_than=NOW - timedelta(days=1))
    with pytest.raises(ArchiveError, match="not a valid archive plan"):
        RunPlan.from_json('{"run_id": "r1"}', source="x")


def test_verification_requires_every_row_read_to_be_written_once_within_the_bound() -> None:
    qp = plan().shards["s0"]
    good = {"orders": WrittenStats(40, 40, 2, 90)}
    assert verify_shard("s0", qp, {"orders": 40}, good) == []
    assert verify_shard("s0", qp, {}, {}) == []  # nothing read (all gone since the plan), nothing written
    problems = verify_shard("s0", qp, {"orders": 41}, good)
    assert problems == ["shard s0, queue orders: 41 rows read but 40 written"]
    assert "2 duplicate ids" in verify_shard("s0", qp, {"orders": 40}, {"orders": WrittenStats(40, 38, 2, 90)})[0]
    assert (
        "above the run's bound 100"
        in verify_shard("s0", qp, {"orders": 1}, {"orders": WrittenStats(1, 1, 101, 101)})[0]
    )
    assert "not in the plan" in verify_shard("s0", qp, {"other": 1}, {"other": WrittenStats(1, 1, 1, 1)})[0]


def test_manifest_and_deletion_record_round_trip() -> None:
    m = manifest_for("r1", "s0", NOW, plan().shards["s0"], {"orders": WrittenStats(40, 40, 2, 90)}, NOW)
    assert m.rows == 40 and m.queues["billing"].rows == 0 and m.queues["orders"].max_id == 100
    assert ShardManifest.from_json(m.to_json(), source="x") == m
    record = DeletionRecord(39, 1, [("orders", 7)], NOW)
    assert DeletionRecord.from_json(record.to_json(), source="x") == record
    with pytest.raises(ArchiveError, match="nothing was deleted"):
        ShardManifest.from_json("[]", source="x")
