"""The Spark bulk enqueue job against two real shards: routing, staging, publish, re-runs, 2PC."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

pytest.importorskip("pyspark", reason="pyspark is not installed (pip install -e '.[spark]')")
if shutil.which("java") is None and not Path(os.environ.get("JAVA_HOME") or "/nonexistent", "bin", "java").is_file():
    pytest.skip("Java is not installed: a local Spark session needs a JVM 17+", allow_module_level=True)

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from queue_manager import admin
from queue_manager.domain import routing
from queue_manager.domain.topology import Topology
from queue_manager.errors import ConfigurationError, UnknownQueueError
from spark_jobs import enqueue as ej
from spark_jobs import routing as sr

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def spark() -> Iterator[SparkSession]:
    if sr.find_jdbc_jar() is None:
        pytest.fail("no PostgreSQL JDBC jar: install libpostgresql-jdbc-java or set QM_JDBC_JAR")
    session = sr.spark_session("qm-test-enqueue")
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture
def queue(shards: Topology) -> str:
    admin.create_queue(shards, "bulk", {"partitions": 16, "shuffle": 4, "payload_limit_bytes": 200})
    return "bulk"


def events_df(spark: SparkSession, n: int, *, offset: int = 0, tenants: int = 500) -> Any:
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


def all_ns(topology: Topology, queue: str) -> list[int]:
    return sorted(n for rows in stored(topology, queue).values() for _, _, n in rows)


def ledger(topology: Topology, run: str) -> dict[str, Any]:
    out = {}
    for s in topology.shards:
        with psycopg.connect(s.dsn) as conn:
            row = conn.execute("SELECT state, published FROM qm.spark_runs WHERE run_id = %s", (run,)).fetchone()
            staged = conn.execute("SELECT count(*) FROM qm.spark_staging WHERE run_id = %s", (run,)).fetchone()
        out[s.name] = (row, staged[0] if staged else None)
    return out


def test_100k_rows_land_on_the_right_shards_and_partitions(
    spark: SparkSession, shards: Topology, queue: str, tmp_path: Path
) -> None:
    lines: list[tuple[str, str, int]] = []
    result = ej.load_events(
        events_df(spark, 100_000),
        shards,
        queue,
        run_id="r100k",
        work_dir=str(tmp_path),
        progress=lambda stage, shard, n: lines.append((stage, shard, n)),
    )
    assert result.rows == 100_000 and result.rejected == 0
    assert result.published == 100_000
    rows = stored(shards, queue)
    assert sum(len(v) for v in rows.values()) == 100_000
    assert sorted(n for v in rows.values() for _, _, n in v) == list(range(100_000))
    by_name = {s.name: s for s in shards.shards}
    used: dict[str, set[int]] = {}
    for name, events in rows.items():
        for tenant, partition, _ in events:
            assert by_name[name].key_range.contains(tenant), (tenant, name)
            assert partition in routing.shuffle_set(tenant, 16, 4), (tenant, partition)
            used.setdefault(tenant, set()).add(partition)
    # the database agrees (its own function) and each tenant's rows are spread over its whole set
    with psycopg.connect(by_name["s0"].dsn) as conn:
        for tenant, partition, _ in rows["s0"][:200]:
            sql_set = conn.execute("SELECT qm.shuffle_set(%s, 16, 4)", (tenant,)).fetchone()
            assert sql_set is not None and partition in sql_set[0]
    assert all(len(parts) == 4 for parts in used.values())
    # the load counters count every published event
    for s in shards.shards:
        with psycopg.connect(s.dsn) as conn:
            loads = conn.execute("SELECT qm.partition_loads(%s)", (queue,)).fetchone()
        assert loads is not None and sum(loads[0]) == len(rows[s.name])
    assert ("published", "s0", len(rows["s0"])) in lines and ("published", "s1", len(rows["s1"])) in lines
    assert {k: v[0][0] for k, v in ledger(shards, "r100k").items()} == {"s0": "published", "s1": "published"}
    assert {k: v[1] for k, v in ledger(shards, "r100k").items()} == {"s0": 0, "s1": 0}


def test_a_run_stopped_after_staging_shows_nothing_and_a_rerun_publishes_once(
    spark: SparkSession, shards: Topology, queue: str, tmp_path: Path
) -> None:
    df = events_df(spark, 3000)
    first = ej.load_events(df, shards, queue, run_id="crash1", work_dir=str(tmp_path), stop_after="staged")
    assert first.published == 0
    assert all_ns(shards, queue) == []  # staged, not visible
    assert all(v[1] > 0 for v in ledger(shards, "crash1").values())
    # a re-run (even from a different source object) publishes the materialised rows exactly once
    again = ej.load_events(events_df(spark, 10), shards, queue, run_id="crash1", work_dir=str(tmp_path))
    assert again.published == 3000
    assert all_ns(shards, queue) == list(range(3000))
    # and a re-run of the finished run adds nothing
    third = ej.load_events(df, shards, queue, run_id="crash1", work_dir=str(tmp_path))
    assert third.published == 0 and [s.state for s in third.shards] == ["published", "published"]
    assert all_ns(shards, queue) == list(range(3000))


def test_a_duplicated_task_adds_nothing(spark: SparkSession, shards: Topology, queue: str, tmp_path: Path) -> None:
    """A speculative or retried task writes its rows twice: the publish keeps one per row key."""
    ej.load_events(events_df(spark, 2000), shards, queue, run_id="dup", work_dir=str(tmp_path), stop_after="staged")
    for s in shards.shards:
        with psycopg.connect(s.dsn) as conn:
            conn.execute(
                "INSERT INTO qm.spark_staging SELECT * FROM qm.spark_staging WHERE run_id = 'dup' AND row_key % 3 = 0"
            )
            conn.commit()
    for s in shards.shards:
        with psycopg.connect(s.dsn) as conn:
            conn.execute("SELECT qm.publish_run('dup', %s)", (queue,))
            conn.commit()
    assert all_ns(shards, queue) == list(range(2000))


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
    rejects = spark.read.parquet(failed.value.rejects).select("tenant", "reason").collect()
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
    skipped = ej.load_events(df, shards, queue, run_id="bad2", columns=cols, work_dir=str(tmp_path), bad_rows="skip")
    assert skipped.published == 2 and skipped.rejected == 7
    assert all_ns(shards, queue) == [1, 9]


def test_a_row_the_database_refuses_fails_that_shards_publish_as_a_whole(
    spark: SparkSession, shards: Topology, queue: str, tmp_path: Path
) -> None:
    """Spark checks the payload's JSON text; the database its stored size: a payload of exactly the
    limit in text is a few bytes over it as jsonb. That shard's publish fails whole, nothing half."""
    owner = next(t for t in (f"t{i}" for i in range(100)) if shards.shards[1].key_range.contains(t))
    body = '{"n": 7, "p": "' + "y" * 200 + '"}'
    body = '{"n": 7, "p": "' + "y" * (200 - (len(body) - 200)) + '"}'
    assert len(body) == 200
    rows = [(owner, body)] + [(f"tenant-{i}", f'{{"n": {i}}}') for i in range(100)]
    df = spark.createDataFrame(rows, "tenant string, payload string")
    with pytest.raises(psycopg.errors.CheckViolation):
        ej.load_events(df, shards, queue, run_id="slip", work_dir=str(tmp_path))
    with psycopg.connect(shards.shards[1].dsn) as conn:
        assert conn.execute(f"SELECT count(*) FROM {queue}").fetchone() == (0,)
        # the run stays staged on that shard: fix the data (or the limit) and re-run
        assert conn.execute("SELECT state FROM qm.spark_runs WHERE run_id = 'slip'").fetchone() == ("staged",)


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
    assert all_ns(shards, queue) == []
    for s in shards.shards:
        with psycopg.connect(s.dsn) as conn:
            assert conn.execute("SELECT count(*) FROM pg_prepared_xacts").fetchone() == (0,)
    done = ej.load_events(events_df(spark, 1500), shards, queue, run_id="atom1", work_dir=str(tmp_path), atomic=True)
    assert done.published == 1500 and all_ns(shards, queue) == list(range(1500))


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
    outcome = ej.recover(shards)
    assert set(outcome.values()) == ({"committed"} if crash_at == "decided" else {"rolled back"})
    assert len(outcome) == 2
    assert all_ns(shards, queue) == (list(range(800)) if crash_at == "decided" else [])
    again = ej.load_events(events_df(spark, 800), shards, queue, run_id=run, work_dir=str(tmp_path), atomic=True)
    assert all_ns(shards, queue) == list(range(800))
    assert again.published == (0 if crash_at == "decided" else 800)


def test_bad_input_gets_a_clear_error(spark: SparkSession, shards: Topology, queue: str, tmp_path: Path) -> None:
    df = events_df(spark, 10)
    with pytest.raises(UnknownQueueError, match="no queue named 'nope'"):
        ej.load_events(df, shards, "nope", run_id="x1", work_dir=str(tmp_path))
    with pytest.raises(ConfigurationError, match="run id"):
        ej.load_events(df, shards, queue, run_id="bad id!", work_dir=str(tmp_path))
    with pytest.raises(ConfigurationError, match="no tenant column 'who'"):
        ej.load_events(df, shards, queue, run_id="x2", columns=ej.Columns(tenant="who"), work_dir=str(tmp_path))
    with pytest.raises(ConfigurationError, match="unknown input format"):
        ej.read_source(spark, str(tmp_path), "xml")


def test_the_cli_loads_a_parquet_source_with_a_line_per_stage(
    spark: SparkSession, shards: Topology, queue: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from queue_manager.cli.main import main as qm

    source = str(tmp_path / "src")
    events_df(spark, 1200).write.parquet(source)
    topo = tmp_path / "topology.toml"
    topo.write_text(shards.to_toml())
    argv = [
        "spark",
        "enqueue",
        "--topology",
        str(topo),
        "--queue",
        queue,
        "--input",
        source,
        "--run-id",
        "cli-1",
        "--work-dir",
        str(tmp_path / "work"),
    ]
    assert qm(argv) == 0
    out = capsys.readouterr().out
    assert "run cli-1: validated * rows=1200" in out
    assert "run cli-1: staged s0" in out and "run cli-1: published s1" in out
    assert "1200 events published by this call" in out
    assert qm(argv) == 0  # a re-run adds nothing
    assert "0 events published by this call" in capsys.readouterr().out
    assert all_ns(shards, queue) == list(range(1200))
    assert qm(["spark", "recover", "--topology", str(topo)]) == 0
    assert "no two-phase run was left prepared" in capsys.readouterr().out
