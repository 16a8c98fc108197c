"""The Spark bulk enqueue job against two real shards: routing, staging, publish, re-runs, 2PC."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

pytest.importorskip("pyspark", reason="pyspark is not installed: run `make setup`")

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from queue_manager import admin
from queue_manager.cli.main import main as qm_main
from queue_manager.db.sqlfiles import query
from queue_manager.domain.topology import Topology
from queue_manager.errors import ConfigurationError, InvalidEventError, UnknownQueueError
from spark_jobs import enqueue as ej
from tests.conftest import count_on_shards

pytestmark = pytest.mark.spark


@pytest.fixture
def queue(shards: Topology) -> str:
    admin.create_queue(shards, "bulk", {"partitions": 16, "shuffle": 4, "payload_limit_bytes": 200})
    return "bulk"


def events_df(spark: SparkSession, n: int, *, offset: int = 0, tenants: int = 500) -> DataFrame:
    """``n`` events (a deterministic scan: spark.range), payload {"n": id, "kind": "bulk"}."""
    return spark.range(offset, offset + n).select(
        F.concat(F.lit("tenant-"), (F.col("id") % tenants).cast("string")).alias("tenant"),
        F.struct(F.col("id").alias("n"), F.lit("bulk").alias("kind")).alias("payload"),
    )


def stored(topology: Topology, queue: str) -> dict[str, list[tuple[str, int, int]]]:
    out = {}
    for s in topology.shards:
        with psycopg.connect(s.dsn) as conn:
            out[s.name] = [
                (r[0], int(r[1]), int(r[2]))
                for r in conn.execute(f"SELECT tenant, partition, (payload->>'n')::bigint FROM {queue}").fetchall()
            ]
    return out


def count_events(topology: Topology, queue: str) -> int:
    return count_on_shards(topology, f"SELECT count(*) FROM {queue}")


def all_ns(topology: Topology, queue: str) -> list[int]:
    return sorted(n for rows in stored(topology, queue).values() for _, _, n in rows)


def ledger(topology: Topology, run: str) -> dict[str, tuple[Any, ...] | None]:
    """Per shard: (state, published, rows in its stage table or None when it has none)."""
    out: dict[str, tuple[Any, ...] | None] = {}
    for s in topology.shards:
        with psycopg.connect(s.dsn) as conn:
            row = conn.execute(
                "SELECT state, published, stage_table FROM qm.spark_runs WHERE run_id = %s", (run,)
            ).fetchone()
            if row is None:
                out[s.name] = None
                continue
            staged = None
            if row[2] is not None:
                staged = conn.execute(f"SELECT count(*) FROM qm.{row[2]}").fetchone()[0]  # type: ignore[index]
            out[s.name] = (row[0], row[1], staged)
    return out


def stage_tables(topology: Topology) -> int:
    return count_on_shards(
        topology, "SELECT count(*) FROM pg_tables WHERE schemaname = 'qm' AND tablename LIKE 'spark_stage_%'"
    )


def prepared(topology: Topology) -> int:
    return count_on_shards(topology, "SELECT count(*) FROM pg_prepared_xacts WHERE database = current_database()")


def test_100k_rows_land_on_the_right_shards_and_partitions(
    spark: SparkSession, shards: Topology, queue: str, tmp_path: Path
) -> None:
    lines: list[tuple[str, str, int]] = []
    listeners = [psycopg.connect(s.dsn, autocommit=True) for s in shards.shards]
    for c in listeners:
        c.execute("LISTEN qm_wake")
    try:
        result = ej.load_events(
            events_df(spark, 100_000),
            shards,
            queue,
            run_id="r100k",
            work_dir=str(tmp_path),
            progress=lambda stage, shard, n: lines.append((stage, shard, n)),
        )
        wakes = [[n.payload for n in c.notifies(timeout=0.5) if n.payload.startswith(f"{queue} ")] for c in listeners]
    finally:
        for c in listeners:
            c.close()
    assert result.rows == 100_000 and result.rejected == 0 and result.published == 100_000
    assert not result.materialized  # spark.range is a deterministic scan: keyed in place
    rows = stored(shards, queue)
    assert sorted(n for v in rows.values() for _, _, n in v) == list(range(100_000))
    for s in shards.shards:
        with psycopg.connect(s.dsn) as conn:
            # the database's own rules, over every row: its shard's range, its tenant's shuffle set
            misplaced = conn.execute(
                f"SELECT count(*) FILTER (WHERE qm.shard_for(tenant) <> (SELECT name FROM qm.shard)), "
                f"count(*) FILTER (WHERE NOT partition = ANY (qm.shuffle_set(tenant, 16, 4))), "
                f"count(DISTINCT (tenant, partition)), count(DISTINCT tenant) FROM {queue}"
            ).fetchone()
            assert misplaced is not None and misplaced[:2] == (0, 0), s.name
            # each tenant's rows spread over its whole set (k = 4 partitions)
            assert misplaced[2] == 4 * misplaced[3], s.name
            loads = conn.execute("SELECT qm.partition_loads(%s)", (queue,)).fetchone()
            assert loads is not None and sum(loads[0]) == len(rows[s.name])
    assert all(rows[s.name] for s in shards.shards)
    for s in shards.shards:
        assert ("staged", s.name, len(rows[s.name])) in lines
        assert ("published", s.name, len(rows[s.name])) in lines
    assert ("validated", "*", 100_000) in lines
    assert ledger(shards, "r100k") == {s.name: ("published", len(rows[s.name]), None) for s in shards.shards}
    assert stage_tables(shards) == 0  # dropped by the publish: nothing left to vacuum
    # one wake-up per shard for the whole load, not one per row or per batch
    assert [len(w) for w in wakes] == [1, 1], wakes


@pytest.mark.parametrize("stage_with", ["copy", "jdbc"])
def test_awkward_text_arrives_as_it_was_written(
    spark: SparkSession, shards: Topology, queue: str, tmp_path: Path, stage_with: ej.StageWith
) -> None:
    """Staged by COPY of Spark's CSV files (the default) or through the JDBC writer, every value
    reaches the queue unchanged: separators, quotes, line breaks, backslashes, spaces at either end,
    an empty dedup key apart from none, text beyond ASCII."""
    tenants = [" lead", "trail ", "com,ma", 'q"uote', "new\nline", "back\\slash \\N", "\\.", "ünï 😀", "tab\tx", "#1"]
    keys = ["", None, " k ", 'a,"b"', "\r\n", "\\N", "x" * 50, None, "", "é"]
    payloads = [
        '{"s": "a,\\"b\\"\\nc"}',
        '{"s": " sp "}',
        '{"s": "\\\\"}',
        '{"s": "😀"}',
        "[1, 2]",
        '"text"',
        '{"s": ""}',
        "null",
        '{"s": "\\t"}',
        '{"s": "#"}',
    ]
    rows = [(t, p, k, i) for i, (t, p, k) in enumerate(zip(tenants, payloads, keys, strict=True))]
    df = spark.createDataFrame(rows, "tenant string, payload string, dedup string, i int")
    result = ej.load_events(
        df,
        shards,
        queue,
        run_id=f"awk-{stage_with}",
        columns=ej.Columns(dedup_key="dedup"),
        work_dir=str(tmp_path),
        stage_with=stage_with,
    )
    assert (result.rows, result.rejected, result.published) == (10, 0, 10)
    got = set()
    for s in shards.shards:
        with psycopg.connect(s.dsn) as conn:
            got |= set(conn.execute(f"SELECT tenant, payload::text, dedup_key FROM {queue}").fetchall())
    with psycopg.connect(shards.shards[0].dsn) as conn:  # the database's own text of each payload
        want = {(t, conn.execute("SELECT %s::jsonb::text", (p,)).fetchone()[0], k) for t, p, k, _ in rows}  # type: ignore[index]
    assert got == want
    assert not (tmp_path / queue / f"awk-{stage_with}" / "stage").exists()  # staged: the files are gone


def test_a_run_stopped_after_staging_shows_nothing_and_a_rerun_publishes_once(
    spark: SparkSession, shards: Topology, queue: str, tmp_path: Path
) -> None:
    df = events_df(spark, 3000)
    first = ej.load_events(df, shards, queue, run_id="crash1", work_dir=str(tmp_path), stop_after="staged")
    assert first.published == 0
    assert all_ns(shards, queue) == []  # staged, not visible
    assert all(v is not None and v[0] == "staged" and v[2] > 0 for v in ledger(shards, "crash1").values())
    # a re-run publishes what was staged, without Spark reading the source again (here: another one)
    again = ej.load_events(events_df(spark, 10), shards, queue, run_id="crash1", work_dir=str(tmp_path))
    assert again.published == 3000 and again.rows == 3000  # counted from the stage tables it resumed
    assert all_ns(shards, queue) == list(range(3000))
    # and a re-run of the finished run adds nothing
    third = ej.load_events(df, shards, queue, run_id="crash1", work_dir=str(tmp_path))
    assert third.published == 0 and [s.state for s in third.shards] == ["already published"] * 2
    assert third.rows == 3000
    assert all_ns(shards, queue) == list(range(3000))


def test_a_run_killed_while_staging_is_staged_again_and_published_once(
    spark: SparkSession, shards: Topology, queue: str, tmp_path: Path
) -> None:
    def die_after_first_shard(step: str, shard: str) -> None:
        if step == "staged" and shard == "s0":
            raise ej._Crash("killed")

    df = events_df(spark, 2000)
    with pytest.raises(ej._Crash):
        ej.load_events(df, shards, queue, run_id="half", work_dir=str(tmp_path), fault=die_after_first_shard)
    states = ledger(shards, "half")
    assert states["s0"] is not None and states["s0"][0] == "staged"
    assert states["s1"] == ("staging", None, 0)
    # the dead run's lock goes with its connection: the retry waits at most for the server to end
    # that connection's backend (it exits a moment after the client closed it; waiting 0 s here
    # failed now and then on a RunConflictError)
    done = ej.load_events(df, shards, queue, run_id="half", work_dir=str(tmp_path), wait_for_other_run=10)
    assert done.published == 2000 and all_ns(shards, queue) == list(range(2000))
    assert done.rows == 2000 and [p.state for p in done.shards] == ["published"] * 2


def test_a_duplicated_task_adds_nothing(spark: SparkSession, shards: Topology, queue: str, tmp_path: Path) -> None:
    """A speculative or retried task writes its rows twice (even after the stage was counted): the
    publish keeps one row per row key."""
    df = events_df(spark, 2000)
    ej.load_events(df, shards, queue, run_id="dup", work_dir=str(tmp_path), stop_after="staged")
    for s in shards.shards:
        with psycopg.connect(s.dsn) as conn:
            row = conn.execute("SELECT stage_table FROM qm.spark_runs WHERE run_id = 'dup'").fetchone()
            assert row is not None
            conn.execute(f"INSERT INTO qm.{row[0]} SELECT * FROM qm.{row[0]} WHERE row_key % 3 = 0")
    done = ej.load_events(df, shards, queue, run_id="dup", work_dir=str(tmp_path))
    assert done.published == 2000 and all_ns(shards, queue) == list(range(2000))
    with psycopg.connect(shards.shards[0].dsn) as conn:
        dups = conn.execute("SELECT duplicate_rows FROM qm.spark_runs WHERE run_id = 'dup'").fetchone()
    assert dups is not None and dups[0] > 0


def test_a_task_attempt_that_commits_during_the_publish_adds_nothing(
    spark: SparkSession, shards: Topology, queue: str, tmp_path: Path
) -> None:
    """A speculative attempt Spark gave up on still has its transaction open on the stage table when
    the publish starts: the publish waits for it (SHARE lock), then keeps one row per row key."""
    df = events_df(spark, 1000)
    ej.load_events(df, shards, queue, run_id="zombie", work_dir=str(tmp_path), stop_after="validated")
    s0 = shards.shards[0]
    zombie = psycopg.connect(s0.dsn)
    try:
        row = zombie.execute("SELECT stage_table FROM qm.spark_runs WHERE run_id = 'zombie'").fetchone()
        assert row is not None
        zombie.execute(f"INSERT INTO qm.{row[0]} SELECT * FROM qm.{row[0]}")  # every row again, not committed
        done: list[ej.LoadResult] = []
        publisher = threading.Thread(
            target=lambda: done.append(ej.load_events(df, shards, queue, run_id="zombie", work_dir=str(tmp_path)))
        )
        publisher.start()
        with psycopg.connect(s0.dsn, autocommit=True) as watcher:
            for _ in range(300):  # the publish waits for the zombie's lock (a condition, not a sleep to sync)
                waiting = watcher.execute(
                    "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = %s::regclass",
                    (f"qm.{row[0]}",),
                ).fetchone()
                if waiting and waiting[0]:
                    break
                publisher.join(timeout=0.1)
            else:
                pytest.fail("the publish did not wait for the open writer")
        zombie.commit()
    finally:
        zombie.close()
    publisher.join(timeout=60)
    assert done and done[0].published == 1000
    assert all_ns(shards, queue) == list(range(1000))


def test_a_source_that_spark_may_recompute_differently_is_materialised_once(
    spark: SparkSession, shards: Topology, queue: str, tmp_path: Path
) -> None:
    shuffled = events_df(spark, 1000).repartition(3)  # a shuffle: row order changes when recomputed
    assert not ej.is_deterministic_scan(shuffled) and ej.is_deterministic_scan(events_df(spark, 10))
    assert not ej.is_deterministic_scan(events_df(spark, 10).withColumn("r", F.rand()))
    result = ej.load_events(shuffled, shards, queue, run_id="mat", work_dir=str(tmp_path))
    assert result.materialized and result.published == 1000
    assert all_ns(shards, queue) == list(range(1000))
    assert not (tmp_path / queue / "mat" / "rows").exists()  # published everywhere: the keyed rows are gone


def test_bad_rows_go_to_rejects_and_fail_the_run_or_are_skipped(
    spark: SparkSession, shards: Topology, queue: str, tmp_path: Path
) -> None:
    rows = [
        ("t-good-1", '{"n": 1}', None),
        (None, '{"n": 2}', None),
        ("", '{"n": 3}', None),
        ("t-big", '{"n": 4, "pad": "' + "x" * 300 + '"}', None),
        ("t-json", "{not json", None),
        ("t-old", '{"n": 6}', "1999-01-01T00:00:00Z"),
        ("t-far", '{"n": 7}', "2999-01-01T00:00:00Z"),
        ("t-bad-time", '{"n": 8}', "yesterday-ish"),
        ("t-good-2", '{"n": 9}', "2030-01-01T00:00:00Z"),
    ]
    df = spark.createDataFrame(rows, "tenant string, payload string, fire_at string")
    cols = ej.Columns(fire_at="fire_at")
    admin.alter_queue(shards, queue, {"max_delay_seconds": 10 * 365 * 86400})
    with pytest.raises(ej.BadRowsError) as failed:
        ej.load_events(df, shards, queue, run_id="bad1", columns=cols, work_dir=str(tmp_path))
    assert failed.value.count == 7
    assert all_ns(shards, queue) == []
    # nothing was published, and the run's staging is gone: the same run id may run again
    assert all(v is None or v[0] == "abandoned" for v in ledger(shards, "bad1").values())
    assert stage_tables(shards) == 0
    rejects = spark.read.parquet(failed.value.rejects).select("tenant", "reason", "shard").collect()
    reasons = {r["tenant"]: r["reason"] for r in rejects}
    assert reasons == {
        None: "missing tenant",
        "": "missing tenant",
        "t-big": "payload too large for the queue",
        "t-json": "payload is not valid JSON",
        "t-old": "fire_at out of range",
        "t-far": "fire_at out of range",
        "t-bad-time": "invalid fire_at",
    }
    assert failed.value.reasons == {
        "missing tenant": 2,
        "payload too large for the queue": 1,
        "payload is not valid JSON": 1,
        "fire_at out of range": 2,
        "invalid fire_at": 1,
    }
    skipped = ej.load_events(df, shards, queue, run_id="bad1", columns=cols, work_dir=str(tmp_path), bad_rows="skip")
    assert skipped.published == 2 and skipped.rejected == 7
    assert all_ns(shards, queue) == [1, 9]
    fire = {}
    for s in shards.shards:
        with psycopg.connect(s.dsn) as conn:
            conn.execute("SET TimeZone = 'UTC'")
            fire.update(dict(conn.execute(f"SELECT tenant, fire_at::text FROM {queue}").fetchall()))
    assert fire["t-good-2"] == "2030-01-01 00:00:00+00"


def test_a_row_the_database_refuses_fails_that_shards_publish_as_a_whole(
    spark: SparkSession, shards: Topology, queue: str, tmp_path: Path
) -> None:
    """Spark checks the payload's JSON text; the database its stored size: a payload of exactly the
    limit in text is a few bytes over it as jsonb. That shard's publish fails whole, nothing half."""
    owner = next(t for t in (f"t{i}" for i in range(100)) if shards.shards[1].key_range.contains(t))
    rows = [(owner, slipping_payload(200))] + [(f"tenant-{i}", f'{{"n": {i}}}') for i in range(100)]
    df = spark.createDataFrame(rows, "tenant string, payload string")
    with pytest.raises(InvalidEventError, match="payload_within_limit"):
        ej.load_events(df, shards, queue, run_id="slip", work_dir=str(tmp_path))
    with psycopg.connect(shards.shards[1].dsn) as conn:
        assert conn.execute(f"SELECT count(*) FROM {queue}").fetchone() == (0,)
        # the run stays staged on that shard: fix the data (or the limit) and re-run
        assert conn.execute("SELECT state FROM qm.spark_runs WHERE run_id = 'slip'").fetchone() == ("staged",)


def slipping_payload(limit: int) -> str:
    """A JSON object of exactly ``limit`` bytes of text, a few bytes over ``limit`` as jsonb."""
    body = '{"n": 7, "p": "' + "y" * limit + '"}'
    body = '{"n": 7, "p": "' + "y" * (limit - (len(body) - limit)) + '"}'
    assert len(body) == limit
    return body


def test_atomic_failure_on_one_shard_leaves_both_without_the_run(
    spark: SparkSession, shards: Topology, queue: str, tmp_path: Path
) -> None:
    def fail_on_s1(step: str, shard: str) -> None:
        if step == "prepared" and shard == "s1":
            raise RuntimeError("the network went away")

    with pytest.raises(RuntimeError, match="network"):
        ej.load_events(
            events_df(spark, 1500), shards, queue, run_id="atom1", work_dir=str(tmp_path), atomic=True, fault=fail_on_s1
        )
    assert all_ns(shards, queue) == [] and prepared(shards) == 0
    done = ej.load_events(events_df(spark, 1500), shards, queue, run_id="atom1", work_dir=str(tmp_path), atomic=True)
    assert done.published == 1500 and all_ns(shards, queue) == list(range(1500))


def test_atomic_a_row_the_database_refuses_leaves_both_shards_without_the_run(
    spark: SparkSession, shards: Topology, queue: str, tmp_path: Path
) -> None:
    owner = next(t for t in (f"t{i}" for i in range(100)) if shards.shards[1].key_range.contains(t))
    rows = [(f"tenant-{i}", f'{{"n": {i}}}') for i in range(100)] + [(owner, slipping_payload(200))]
    df = spark.createDataFrame(rows, "tenant string, payload string")
    with pytest.raises(InvalidEventError):
        ej.load_events(df, shards, queue, run_id="slip2", work_dir=str(tmp_path), atomic=True)
    assert all_ns(shards, queue) == [] and prepared(shards) == 0  # s0 had prepared: rolled back


def test_atomic_publish_with_a_waiting_manager_and_past_fire_at_wakes_it_after_commit(
    spark: SparkSession, shards: Topology, queue: str, tmp_path: Path
) -> None:
    """PREPARE TRANSACTION refuses a transaction that sent a NOTIFY, and the verify trigger sends one
    when a manager waits (it holds the queue's wake-up lock) or rows are due in the past: the
    two-phase publish defers it and sends it after COMMIT PREPARED."""
    managers = []
    for s in shards.shards:
        c = psycopg.connect(s.dsn, autocommit=True)
        c.execute("LISTEN qm_wake")
        c.execute(
            "SELECT pg_advisory_lock(qm.lock_class('wake'), (SELECT id FROM qm.queues WHERE name = %s))", (queue,)
        )
        managers.append(c)
    try:
        df = events_df(spark, 500).withColumn("fire_at", F.lit("2021-06-01T00:00:00Z"))
        done = ej.load_events(
            df, shards, queue, run_id="wake", columns=ej.Columns(fire_at="fire_at"), work_dir=str(tmp_path), atomic=True
        )
        wakes = [[n.payload for n in c.notifies(timeout=0.5)] for c in managers]
    finally:
        for c in managers:
            c.close()
    assert done.published == 500 and all_ns(shards, queue) == list(range(500))
    expected = f"{queue} at {1622505600 * 1_000_000}"
    assert wakes == [[expected], [expected]]


@pytest.mark.parametrize("crash_at", ["prepared", "decided"])
def test_recovery_finishes_or_rolls_back_a_run_left_prepared(
    spark: SparkSession, shards: Topology, queue: str, tmp_path: Path, crash_at: str
) -> None:
    """A job killed after preparing both shards: without a decision the run is rolled back; with
    one it is committed on every shard. Either way a re-run ends with the run published once."""

    def crash(step: str, shard: str) -> None:
        if step == crash_at and (step == "decided" or shard == "s1"):
            raise ej._Crash(step)

    run = f"atom-{crash_at}"
    with pytest.raises(ej._Crash):
        ej.load_events(
            events_df(spark, 800), shards, queue, run_id=run, work_dir=str(tmp_path), atomic=True, fault=crash
        )
    assert all_ns(shards, queue) == []  # prepared, not visible
    assert ej.recover(shards) == {}  # younger than min_age: its job may still be deciding
    outcome = ej.recover(shards, min_age=0)
    assert set(outcome.values()) == ({"committed"} if crash_at == "decided" else {"rolled back"})
    assert len(outcome) == 2 and prepared(shards) == 0
    assert all_ns(shards, queue) == (list(range(800)) if crash_at == "decided" else [])
    again = ej.load_events(events_df(spark, 800), shards, queue, run_id=run, work_dir=str(tmp_path), atomic=True)
    assert all_ns(shards, queue) == list(range(800))
    assert again.published == (0 if crash_at == "decided" else 800)


def test_any_rerun_first_recovers_its_own_run_left_prepared(
    spark: SparkSession, shards: Topology, queue: str, tmp_path: Path
) -> None:
    """The prepared parts hold the run's ledger rows: a re-run without --atomic must not wait on them."""

    def crash(step: str, shard: str) -> None:
        if step == "prepared":
            raise ej._Crash(step)

    df = events_df(spark, 400)
    with pytest.raises(ej._Crash):
        ej.load_events(df, shards, queue, run_id="mixed", work_dir=str(tmp_path), atomic=True, fault=crash)
    assert prepared(shards) > 0 and all_ns(shards, queue) == []
    done = ej.load_events(df, shards, queue, run_id="mixed", work_dir=str(tmp_path))
    assert done.published == 400 and all_ns(shards, queue) == list(range(400)) and prepared(shards) == 0


def test_a_recovery_racing_a_job_before_its_decision_aborts_the_whole_run(
    spark: SparkSession, shards: Topology, queue: str, tmp_path: Path
) -> None:
    seen: list[str] = []
    lock = threading.Lock()

    def recovery_meanwhile(step: str, shard: str) -> None:
        with lock:  # the shards prepare at once, each in its own thread: act after the last one
            seen.append(step)
            if seen.count("prepared") == 2:
                assert len(ej.recover(shards, min_age=0)) == 2  # another process recovers: records an abort

    with pytest.raises(ej.RunAbortedError):
        ej.load_events(
            events_df(spark, 300),
            shards,
            queue,
            run_id="race",
            work_dir=str(tmp_path),
            atomic=True,
            fault=recovery_meanwhile,
        )
    assert all_ns(shards, queue) == [] and prepared(shards) == 0


def test_staging_of_a_dead_run_is_dropped_after_its_ttl(
    spark: SparkSession, shards: Topology, queue: str, tmp_path: Path
) -> None:
    df = events_df(spark, 500)
    ej.load_events(df, shards, queue, run_id="dead", work_dir=str(tmp_path), stop_after="staged")
    assert stage_tables(shards) == 2
    assert ej.cleanup(shards, older_than=3600) == {"s0": 0, "s1": 0}
    assert ej.cleanup(shards, older_than=0) == {"s0": 1, "s1": 1}
    assert stage_tables(shards) == 0
    assert all(v is not None and v[0] == "abandoned" for v in ledger(shards, "dead").values())
    again = ej.load_events(df, shards, queue, run_id="dead", work_dir=str(tmp_path))
    assert again.published == 500 and all_ns(shards, queue) == list(range(500))


def test_qm_spark_enqueue_command(
    spark: SparkSession, shards: Topology, queue: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "events.csv"
    source.write_text(
        "who,amount,when,key\n" + "".join(f"tenant-{i % 40},{i},2024-01-01T00:00:00Z,k{i % 150}\n" for i in range(200)),
        encoding="utf-8",
    )
    topo = tmp_path / "topology.toml"
    topo.write_text(shards.to_toml(), encoding="utf-8")
    args = [
        "spark", "enqueue", "--input", str(source), "--topology", str(topo), "--queue", queue, "--run-id", "cli-1",
        "--format", "csv", "--tenant-col", "who", "--payload-cols", "amount,key", "--fire-at-col", "when",
        "--dedup-col", "key", "--work-dir", str(tmp_path / "work"),
    ]  # fmt: skip
    assert qm_main(args) == 0
    out = capsys.readouterr().out
    assert "run cli-1: written * rows=200" in out  # the stage files (COPY staging, the default), every row
    assert "run cli-1: staged" in out and "run cli-1: validated" in out and "run cli-1: published" in out
    assert count_events(shards, queue) == 200  # 200 distinct (tenant, dedup key) pairs
    with psycopg.connect(shards.shards[0].dsn) as conn:
        row = conn.execute(f"SELECT payload, fire_at = '2024-01-01T00:00:00Z' FROM {queue} LIMIT 1").fetchone()
    assert row is not None and set(row[0]) == {"amount", "key"} and row[1] is True
    assert qm_main(args) == 0  # the same run again: nothing added
    assert "already published" in capsys.readouterr().out
    # another run, staged through the JDBC writer: every key exists
    assert qm_main([*args[:8], "--run-id", "cli-2", *args[10:], "--stage-with", "jdbc"]) == 0
    assert "run cli-2: written" not in capsys.readouterr().out
    assert count_events(shards, queue) == 200  # every (tenant, dedup key) exists: nothing added
    assert qm_main(["spark", "cleanup", "--topology", str(topo), "--older-than", "0"]) == 0
    assert (
        qm_main(
            ["spark", "enqueue", "--input", str(source), "--topology", str(topo), "--queue", "nope", "--run-id", "x"]
        )
        == 2
    )
    assert "no queue named 'nope'" in capsys.readouterr().err


def test_bad_input_gets_a_clear_error(spark: SparkSession, shards: Topology, queue: str, tmp_path: Path) -> None:
    df = events_df(spark, 10)
    with pytest.raises(UnknownQueueError, match="no queue named 'nope'"):
        ej.load_events(df, shards, "nope", run_id="x1", work_dir=str(tmp_path))
    with pytest.raises(ConfigurationError, match="run id"):
        ej.load_events(df, shards, queue, run_id="bad id!", work_dir=str(tmp_path))
    with pytest.raises(ConfigurationError, match="no tenant column 'who'"):
        ej.load_events(df, shards, queue, run_id="x2", columns=ej.Columns(tenant="who"), work_dir=str(tmp_path))
    with pytest.raises(ConfigurationError, match="payload column 'n' is long"):
        ej.load_events(
            df.withColumn("n", F.lit(1).cast("long")), shards, queue, run_id="x3", columns=ej.Columns(payload="n")
        )
    with pytest.raises(ConfigurationError, match="stage_with must be 'copy' or 'jdbc'"):
        ej.load_events(df, shards, queue, run_id="x4", stage_with="ftp", work_dir=str(tmp_path))  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="unknown input format"):
        ej.read_source(spark, str(tmp_path), "xml")


def test_concurrent_runs_of_two_ids_both_land(
    spark: SparkSession, shards: Topology, queue: str, tmp_path: Path
) -> None:
    errors: list[BaseException] = []

    def run(run_id: str, offset: int) -> None:
        try:
            ej.load_events(events_df(spark, 700, offset=offset), shards, queue, run_id=run_id, work_dir=str(tmp_path))
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(f"c{i}", i * 700)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    assert all_ns(shards, queue) == list(range(1400))


def test_the_cli_loads_a_parquet_source_with_a_line_per_stage(
    spark: SparkSession, shards: Topology, queue: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = str(tmp_path / "src")
    events_df(spark, 1200).write.parquet(source)
    topo = tmp_path / "topology.toml"
    topo.write_text(shards.to_toml())
    argv = [
        "spark", "enqueue", "--topology", str(topo), "--queue", queue, "--input", source, "--run-id", "cli-1",
        "--work-dir", str(tmp_path / "work"),
    ]  # fmt: skip
    assert qm_main(argv) == 0
    out = capsys.readouterr().out
    assert "run cli-1: validated * rows=1200" in out
    assert "run cli-1: staged s0" in out and "run cli-1: published s1" in out
    assert "1200 events published by this call" in out
    with psycopg.connect(shards.shards[0].dsn) as other:  # another live job of the run id holds it
        # the finished job's lock goes when its backend has exited, a moment after its connection closed
        for _ in range(100):
            if other.execute(query("run_lock", "spark.sql"), {"queue": queue, "run": "cli-1"}).fetchone() == (True,):
                break
            time.sleep(0.05)
        else:
            pytest.fail("the finished job's run lock was not released within 5 s")
        assert qm_main([*argv, "--wait-for-other-run", "0.2"]) == 2
    refused = capsys.readouterr()
    assert "run cli-1: waiting for another live run of this run id" in refused.out
    assert "another run of 'cli-1'" in refused.err and "nothing was changed" in refused.err
    assert qm_main(argv) == 0  # its lock went with its connection; and a re-run adds nothing
    assert "0 events published by this call" in capsys.readouterr().out
    assert all_ns(shards, queue) == list(range(1200))
    assert qm_main(["spark", "recover", "--topology", str(topo)]) == 0
    assert "no two-phase run was left prepared" in capsys.readouterr().out


class _TwoRuns:
    """Two live runs of one run id in two threads, the first held after staging shard s0 (its s1 still
    staging) until the test lets it go."""

    def __init__(self) -> None:
        self.first_held = threading.Event()
        self.release_first = threading.Event()
        self.second_paused = threading.Event()
        self.release_second = threading.Event()
        self.second_lines: list[tuple[str, str, int]] = []
        self.results: dict[str, ej.LoadResult] = {}
        self.errors: dict[str, BaseException] = {}

    def hold_first(self, step: str, shard: str) -> None:
        if step == "staged" and shard == "s0":
            self.first_held.set()
            assert self.release_first.wait(60)

    def second_progress(self, stage: str, shard: str, n: int) -> None:
        self.second_lines.append((stage, shard, n))
        if stage in ("waiting", "materialized"):
            # waiting: it waits for the first (the run lock). materialized: it got past the start and
            # made the run's stage tables its own without waiting; holding it here lets the first count
            # and publish the second's empty stage table of s1, as an unlucky race would.
            self.second_paused.set()
            if stage == "materialized":
                self.release_second.wait(60)

    def start(self, name: str, **kwargs: Any) -> threading.Thread:
        def run() -> None:
            try:
                self.results[name] = ej.load_events(**kwargs)
            except BaseException as exc:  # reported by the test's assertions
                self.errors[name] = exc

        thread = threading.Thread(target=run, name=f"run-{name}")
        thread.start()
        return thread


def test_a_second_live_run_of_an_id_waits_for_the_first_and_reports_what_it_published(
    spark: SparkSession, shards: Topology, queue: str, tmp_path: Path
) -> None:
    """An orchestrator retries a task whose first attempt is still alive: the second run of the id
    waits for the first, then finds every shard published and says so with the real counts. Every
    row is published once."""
    df = events_df(spark, 2000)
    runs = _TwoRuns()
    same = {"df": df, "topology": shards, "queue": queue, "run_id": "twice", "work_dir": str(tmp_path)}
    first = runs.start("first", **same, fault=runs.hold_first)
    assert runs.first_held.wait(60)
    second = runs.start("second", **same, materialize=True, progress=runs.second_progress)
    assert runs.second_paused.wait(60)
    runs.release_first.set()
    first.join(timeout=120)
    runs.release_second.set()
    second.join(timeout=120)
    assert all_ns(shards, queue) == list(range(2000))  # every row once
    assert runs.errors == {}
    per_shard = {name: len(rows) for name, rows in stored(shards, queue).items()}
    one, two = runs.results["first"], runs.results["second"]
    assert (one.rows, one.published) == (2000, 2000)
    assert (two.rows, two.published) == (2000, 0)
    assert ("waiting", "s0", ej.OTHER_RUN_WAIT_SECONDS) in runs.second_lines
    assert [(p.shard, p.state, p.rows) for p in two.shards] == [
        (name, "already published", n) for name, n in per_shard.items()
    ]
    assert [line for line in runs.second_lines if line[0] == "already published"] == [
        ("already published", name, n) for name, n in per_shard.items()
    ]
    assert ledger(shards, "twice") == {name: ("published", n, None) for name, n in per_shard.items()}


def test_a_second_live_run_of_an_id_refuses_after_its_bounded_wait_and_changes_nothing(
    spark: SparkSession, shards: Topology, queue: str, tmp_path: Path
) -> None:
    df = events_df(spark, 1000)
    runs = _TwoRuns()
    same = {"df": df, "topology": shards, "queue": queue, "run_id": "busy", "work_dir": str(tmp_path)}
    first = runs.start("first", **same, fault=runs.hold_first)
    try:
        assert runs.first_held.wait(60)
        before = ledger(shards, "busy")
        assert before["s0"] is not None and before["s0"][0] == "staged"
        assert before["s1"] == ("staging", None, 0)
        lines: list[tuple[str, str, int]] = []
        with pytest.raises(ej.RunConflictError, match=r"another run of 'busy' .* is alive") as refused:
            ej.load_events(**same, materialize=True, wait_for_other_run=0.3, progress=lambda *line: lines.append(line))
        assert "nothing was changed" in str(refused.value)
        assert lines == [("waiting", "s0", 1)]  # the wait, in whole seconds
        assert ledger(shards, "busy") == before  # the first run's staging is untouched
        with pytest.raises(ej.RunConflictError):
            ej.load_events(**same, wait_for_other_run=0)  # no wait: refused at once
    finally:
        runs.release_first.set()
        first.join(timeout=120)
    assert runs.errors == {} and runs.results["first"].published == 1000
    assert all_ns(shards, queue) == list(range(1000))


def test_a_run_counts_and_publishes_only_its_own_stage_table(
    spark: SparkSession, shards: Topology, queue: str, tmp_path: Path
) -> None:
    """Behind the run lock: should another run of the id replace a stage table all the same (one
    that never took the lock), the run stops instead of counting and publishing the other's table
    (here still empty: s1 would have been marked published with none of its rows)."""
    df = events_df(spark, 1000)

    def another_run_restages_s1(step: str, shard: str) -> None:
        if step == "staged" and shard == "s0":
            with psycopg.connect(shards.shards[1].dsn) as conn:
                conn.execute("SELECT qm.stage_run('fenced', %s)", (queue,))

    with pytest.raises(ej.RunConflictError, match=r"shard 's1': the ledger says staging with stage table .* not"):
        ej.load_events(df, shards, queue, run_id="fenced", work_dir=str(tmp_path), fault=another_run_restages_s1)
    assert all_ns(shards, queue) == []  # stopped before any publish
    assert ledger(shards, "fenced")["s1"] == ("staging", None, 0)  # the other's table, untouched
    done = ej.load_events(df, shards, queue, run_id="fenced", work_dir=str(tmp_path))
    assert (done.rows, done.published) == (1000, 1000) and all_ns(shards, queue) == list(range(1000))


def test_events_carry_their_source_rows_trace_context_and_a_malformed_one_is_rejected(
    spark: SparkSession, shards: Topology, queue: str, tmp_path: Path
) -> None:
    """The trace context comes from the source's columns (Columns.traceparent, .tracestate): stored
    with each event as given (the manager sends it to the receiver from there); a malformed
    traceparent rejects its row with a reason, the others are published (bad_rows="skip")."""
    tp = "00-4bf92f3577b34da6a3ce929d0e0e{:04x}-00f067aa0ba902b7-01"
    rows = [
        ("t-1", '{"n": 1}', tp.format(1), "congo=t61rcWkgMzE"),
        ("t-2", '{"n": 2}', tp.format(2), None),
        ("t-3", '{"n": 3}', None, None),
        ("t-4", '{"n": 4}', "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01", None),
    ]
    df = spark.createDataFrame(rows, "tenant string, payload string, tp string, ts string")
    cols = ej.Columns(traceparent="tp", tracestate="ts")
    result = ej.load_events(df, shards, queue, run_id="traced", columns=cols, work_dir=str(tmp_path), bad_rows="skip")
    assert result.published == 3 and result.rejected == 1
    assert result.reasons == {"invalid traceparent": 1} and result.rejects_path is not None
    rejects = spark.read.parquet(result.rejects_path).select("tenant", "reason").collect()
    assert [(r["tenant"], r["reason"]) for r in rejects] == [("t-4", "invalid traceparent")]
    got = {}
    for s in shards.shards:
        with psycopg.connect(s.dsn) as conn:
            got.update({r[0]: r[1:] for r in conn.execute(f"SELECT tenant, traceparent, tracestate FROM {queue}")})
    assert got == {"t-1": (tp.format(1), "congo=t61rcWkgMzE"), "t-2": (tp.format(2), None), "t-3": (None, None)}
