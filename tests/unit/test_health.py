"""The database health rules: each reading past its threshold gives one warning, and none below it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from queue_manager.domain import health
from queue_manager.domain.health import Horizon, IndexHealth, ShardHealth, Slot, TableHealth, Thresholds

TABLE = TableHealth(
    queue="orders",
    live_tuples=1_000_000,
    dead_tuples=1_000,
    autovacuum_trigger=20_050,
    autovacuum_enabled=True,
    vacuum_age_seconds=30.0,
    autovacuum_age_seconds=30.0,
    autoanalyze_age_seconds=30.0,
    autovacuum_count=3,
    queue_age_seconds=86_400.0,
    table_bytes=200 << 20,
    index_bytes=100 << 20,
    reloptions="",
    indexes=(IndexHealth("orders_pkey", 100 << 20, 10 << 20, 0.1),),
)
SESSION = Horizon("session", "report-job", 4242, "report-job", "idle in transaction", 5.0, 10)
HEALTHY = ShardHealth(horizon=SESSION, notify_queue_usage=0.0, tables=(TABLE,))


def test_a_healthy_shard_has_no_warning() -> None:
    assert health.warnings(HEALTHY) == []


def test_a_long_held_snapshot_names_its_holder() -> None:
    held = replace(HEALTHY, horizon=replace(SESSION, age_seconds=health.XMIN_WARN_SECONDS + 1))
    (w,) = health.warnings(held)
    assert "'report-job'" in w and "pid 4242" in w and "held back vacuum for 61 s" in w
    assert health.warnings(held, Thresholds(xmin_seconds=120)) == []


def test_replication_slots_warn_when_inactive_or_far_behind() -> None:
    active = Slot("standby", "physical", True, 99, None, 10, None)
    assert health.warnings(replace(HEALTHY, slots=(active,))) == []
    behind = replace(active, xmin_age=health.SLOT_WARN_XIDS + 1)
    inactive = Slot("old_cdc", "logical", False, None, "qm", None, 5)
    got = health.warnings(replace(HEALTHY, slots=(behind, inactive)))
    assert len(got) == 2
    assert "'standby' (active)" in got[0] and str(health.SLOT_WARN_XIDS + 1) in got[0]
    assert "'old_cdc' (inactive)" in got[1]


def test_the_notify_queue_warns_past_its_threshold() -> None:
    assert health.warnings(replace(HEALTHY, notify_queue_usage=health.NOTIFY_QUEUE_WARN)) == []
    (w,) = health.warnings(replace(HEALTHY, notify_queue_usage=0.25))
    assert "NOTIFY queue is 25% full" in w


def test_dead_tuples_past_autovacuum_trigger_without_a_recent_vacuum() -> None:
    late = replace(TABLE, dead_tuples=30_000, vacuum_age_seconds=health.VACUUM_STALE_SECONDS + 1)
    (w,) = health.warnings(replace(HEALTHY, tables=(late,)))
    assert "orders: 30000 dead tuples, past autovacuum's trigger (20050)" in w
    never = replace(late, vacuum_age_seconds=None)
    assert "never" in health.warnings(replace(HEALTHY, tables=(never,)))[0]
    # a queue created a minute ago and not vacuumed yet has not waited long
    assert health.warnings(replace(HEALTHY, tables=(replace(never, queue_age_seconds=60.0),))) == []
    # below the trigger, or vacuumed recently: nothing to say
    assert health.warnings(replace(HEALTHY, tables=(replace(late, dead_tuples=20_000),))) == []
    assert health.warnings(replace(HEALTHY, tables=(replace(late, vacuum_age_seconds=60.0),))) == []


def test_autovacuum_off_for_a_queue_table_is_a_warning() -> None:
    (w,) = health.warnings(replace(HEALTHY, tables=(replace(TABLE, autovacuum_enabled=False),)))
    assert "autovacuum is off" in w


@pytest.mark.parametrize(
    ("live", "dead", "warns"),
    [
        (100_000, 100_001, True),  # more than half dead, and over the minimum
        (10, 99_999, False),  # below the minimum count
        (200_000, 150_000, False),  # below the ratio
    ],
)
def test_dead_tuple_share(live: int, dead: int, warns: bool) -> None:
    t = replace(TABLE, live_tuples=live, dead_tuples=dead, autovacuum_trigger=None)
    got = health.warnings(replace(HEALTHY, tables=(t,)))
    assert bool(got) is warns
    if warns:
        assert "dead tuples, 50% of the table" in got[0]


def test_index_bloat_warns_past_ratio_and_size() -> None:
    big = IndexHealth("orders_acked", 512 << 20, 300 << 20, 300 / 512)
    (w,) = health.warnings(replace(HEALTHY, tables=(replace(TABLE, indexes=(big,)),)))
    assert "index orders_acked is about 59% bloat (300.0 MiB of 512.0 MiB" in w and "REINDEX INDEX CONCURRENTLY" in w
    small = IndexHealth("orders_acked", 8 << 20, 6 << 20, 0.75)  # most of it wasted, but small
    unknown = IndexHealth("orders_due", 512 << 20, None, None)  # no estimate yet
    assert health.warnings(replace(HEALTHY, tables=(replace(TABLE, indexes=(small, unknown)),))) == []
    assert health.warnings(
        replace(HEALTHY, tables=(replace(TABLE, indexes=(small,)),)), Thresholds(index_bloat_min_bytes=0)
    )


def test_plain_data_keeps_every_reading() -> None:
    data = health.as_data(replace(HEALTHY, slots=(Slot("s", "physical", True, 1, None, 7, None),)))
    assert data["slots"][0]["xid_age"] == 7
    (t,) = data["tables"]
    assert t["dead_ratio"] == round(1_000 / 1_001_000, 4)
    assert t["index_bloat_bytes"] == 10 << 20
    assert t["indexes"][0]["name"] == "orders_pkey"


def test_the_leader_vacuums_a_table_autovacuum_left_past_its_trigger() -> None:
    late = replace(TABLE, dead_tuples=30_000, vacuum_age_seconds=20.0, table_bytes=8 << 20, index_bytes=2 << 20)
    shard = replace(HEALTHY, tables=(late,))
    assert health.tables_to_vacuum(shard, 15.0) == ["orders"]
    assert health.tables_to_vacuum(shard, 0.0) == []  # off
    assert health.tables_to_vacuum(shard, 30.0) == []  # vacuumed recently enough
    assert health.tables_to_vacuum(replace(shard, tables=(replace(late, dead_tuples=20_000),)), 15.0) == []
    never = replace(late, vacuum_age_seconds=None)
    assert health.tables_to_vacuum(replace(shard, tables=(never,)), 15.0) == ["orders"]  # the queue is a day old
    young = replace(never, queue_age_seconds=5.0)
    assert health.tables_to_vacuum(replace(shard, tables=(young,)), 15.0) == []
    # autovacuum turned off is the operator's choice; a large table is autovacuum's
    assert health.tables_to_vacuum(replace(shard, tables=(replace(late, autovacuum_enabled=False),)), 15.0) == []
    big = replace(late, table_bytes=health.VACUUM_MAX_BYTES)
    assert health.tables_to_vacuum(replace(shard, tables=(big,)), 15.0) == []
    # a snapshot older than the last vacuum: another vacuum would remove nothing more
    held = replace(shard, horizon=replace(SESSION, age_seconds=25.0))
    assert health.tables_to_vacuum(held, 15.0) == []
    assert health.tables_to_vacuum(replace(shard, horizon=replace(SESSION, age_seconds=19.0)), 15.0) == ["orders"]
    slot = replace(shard, horizon=Horizon("slot", "standby", None, None, None, None, 500))
    assert health.tables_to_vacuum(slot, 15.0) == ["orders"]
