"""The archive job (spark_jobs.archive): settled events move to Parquet and leave the shards,
exactly once, whatever step a run is interrupted at."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

pytest.importorskip("pyspark", reason="pyspark is not installed: run `make setup`")

from pyspark.sql import SparkSession

from queue_manager import admin
from queue_manager.cli.main import main as qm_main
from queue_manager.domain.topology import Topology
from queue_manager.errors import ArchiveError, ConfigurationError, InvalidNameError, UnknownQueueError
from queue_manager.producer import Event, enqueue_batch
from spark_jobs.archive import ArchiveProgress, archive_events, read_archive
from spark_jobs.archive_plan import ArchiveLayout
from tests.conftest import tenants_of

pytestmark = pytest.mark.spark

OLDER_THAN = timedelta(days=7)
PER_SHARD = 600  # events of "orders" per shard; "billing" gets a sixth of that


class Crash(Exception):
    """Stands for the process dying at a chosen step."""


def crash_at(stage: str, *, shard: str | None = None, times: int = 1) -> Callable[[ArchiveProgress], None]:
    """A progress hook that raises at the ``times``-th report of ``stage`` (of ``shard``, when given)."""
    seen = 0

    def hook(p: ArchiveProgress) -> None:
        nonlocal seen
        if p.stage == stage and (shard is None or p.shard == shard):
            seen += 1
            if seen == times:
                raise Crash(f"crash at {stage} of shard {p.shard}")

    return hook


def crashed_run(
    spark: SparkSession, shards: Topology, out: Path, crash: Callable[[ArchiveProgress], None], **options: Any
) -> None:
    """Run ``r1`` of the archive until ``crash`` (a :func:`crash_at`) stops it, as a killed process would stop."""
    with pytest.raises(Crash):
        archive_events(spark, shards, older_than=OLDER_THAN, output=out, run_id="r1", progress=crash, **options)


@dataclass
class Populated:
    """What the fixture data holds, by (shard, queue): every id, and the ids an archive must take."""

    all_ids: dict[tuple[str, str], set[int]]
    archivable: dict[tuple[str, str], set[int]]
    #: (shard, queue, id) -> expected (state, day of the settle time)
    expected_rows: dict[tuple[str, str, int], tuple[str, str]]

    def expected(self, queues: tuple[str, ...] = ("orders", "billing")) -> set[tuple[str, str, int]]:
        return {(s, q, i) for (s, q), ids in self.archivable.items() if q in queues for i in ids}


def trace_context(i: int) -> dict[str, str]:
    """Event i's W3C trace context: every other event has one (traceparent, tracestate, baggage)."""
    if i % 2 == 0:
        return {}
    return {"traceparent": f"00-{i + 1:032x}-{i + 1:016x}-01", "tracestate": f"qm=t{i}", "baggage": f"i={i}"}


def populate(shards: Topology) -> Populated:
    """Events of two queues on both shards, a fifth each acked long ago, failed long ago, acked
    recently, fired long ago (not settled), and to be fired."""
    for queue in ("orders", "billing"):
        admin.create_queue(shards, queue, {"partitions": 4, "shuffle": 2})
    all_ids: dict[tuple[str, str], set[int]] = {}
    archivable: dict[tuple[str, str], set[int]] = {}
    expected_rows: dict[tuple[str, str, int], tuple[str, str]] = {}
    for shard in shards.shards:
        tenants = tenants_of(shard, 12)
        with psycopg.connect(shard.dsn) as conn:
            for queue, count in (("orders", PER_SHARD), ("billing", PER_SHARD // 6)):
                events = [
                    Event(tenants[i % len(tenants)], {"i": i, "queue": queue}, trace_context=trace_context(i))
                    for i in range(count)
                ]
                assert enqueue_batch(conn, queue, events) == count
                conn.commit()
                ids = {r[0] for r in conn.execute(f"SELECT id FROM {queue}")}
                # acked 8-10 days ago (three different days), failed 9 days ago, acked an hour ago,
                # fired 10 days ago and never settled, and the rest still to be fired
                conn.execute(
                    f"""UPDATE {queue} SET state = 'acked', attempts = 1,
                               fired_at = now() - make_interval(days => 8 + id::int % 3, mins => 5),
                               acked_at = now() - make_interval(days => 8 + id::int % 3)
                         WHERE id % 5 = 0"""
                )
                conn.execute(
                    f"""UPDATE {queue} SET state = 'failed', attempts = 3, last_error = 'boom',
                               fired_at = now() - interval '9 days' WHERE id % 5 = 1"""
                )
                conn.execute(
                    f"""UPDATE {queue} SET state = 'acked', attempts = 1, fired_at = now() - interval '2 hours',
                               acked_at = now() - interval '1 hour' WHERE id % 5 = 2"""
                )
                conn.execute(
                    f"""UPDATE {queue} SET state = 'fired', attempts = 1, fired_at = now() - interval '10 days',
                               ack_deadline = now() - interval '10 days' WHERE id % 5 = 3"""
                )
                rows = conn.execute(
                    f"""SELECT id, state::text,
                               to_char(coalesce(acked_at, fired_at) AT TIME ZONE 'UTC', 'YYYY-MM-DD')
                          FROM {queue} WHERE id % 5 IN (0, 1)"""
                ).fetchall()
                conn.commit()
                all_ids[(shard.name, queue)] = ids
                archivable[(shard.name, queue)] = {r[0] for r in rows}
                for i, state, day in rows:
                    expected_rows[(shard.name, queue, i)] = (state, day)
    return Populated(all_ids, archivable, expected_rows)


def ids_in_shards(shards: Topology, queues: tuple[str, ...] = ("orders", "billing")) -> set[tuple[str, str, int]]:
    out = set()
    for shard in shards.shards:
        with psycopg.connect(shard.dsn) as conn:
            for queue in queues:
                out |= {(shard.name, queue, r[0]) for r in conn.execute(f"SELECT id FROM {queue}")}
    return out


def archived_keys(spark: SparkSession, output: Path) -> list[tuple[str, str, int]]:
    """(shard, queue, id) of every archived row, duplicates kept."""
    return [
        (r["shard"], r["queue"], r["id"]) for r in read_archive(spark, output).select("shard", "queue", "id").collect()
    ]


def file_tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under root with its size and modification time (ns)."""
    out = {}
    for directory, _dirs, files in os.walk(root):
        for name in files:
            st = os.stat(os.path.join(directory, name))
            out[os.path.relpath(os.path.join(directory, name), root)] = (st.st_size, st.st_mtime_ns)
    return out


def test_archive_moves_settled_old_events_to_parquet_and_deletes_exactly_those(
    spark: SparkSession, shards: Topology, tmp_path: Path
) -> None:
    data = populate(shards)
    before = ids_in_shards(shards)
    expected = data.expected()
    assert len(expected) == 2 * 2 * (PER_SHARD + PER_SHARD // 6) // 5
    seen: list[ArchiveProgress] = []
    out = tmp_path / "archive"

    result = archive_events(
        spark, shards, older_than=OLDER_THAN, output=out, run_id="r1", delete_slice=100, progress=seen.append
    )

    assert result.archived == result.deleted == len(expected)
    assert result.kept == 0 and not result.resumed
    # exactly the archived rows left the shards: unsettled, recent and other rows stay
    assert ids_in_shards(shards) == before - expected
    rows = read_archive(spark, out).collect()
    keys = [(r["shard"], r["queue"], r["id"]) for r in rows]
    assert len(keys) == len(set(keys)) == len(expected)
    assert set(keys) == expected
    for r in rows:
        state, day = data.expected_rows[(r["shard"], r["queue"], r["id"])]
        assert (r["state"], r["day"].isoformat(), r["run"]) == (state, day, "r1")
        assert r["settled_at"].astimezone(UTC) < datetime.now(UTC) - OLDER_THAN  # Spark gives local naive times
        assert json.loads(r["payload"])["queue"] == r["queue"]
        # the trace context travels with the event into the archive
        context = trace_context(json.loads(r["payload"])["i"])
        assert (r["traceparent"], r["tracestate"], r["baggage"]) == tuple(
            context.get(k) for k in ("traceparent", "tracestate", "baggage")
        )
        assert r["tenant"] and r["partition"] in range(4)
    assert {r["state"] for r in rows} == {"acked", "failed"}
    assert any(r["traceparent"] for r in rows) and any(r["traceparent"] is None for r in rows)
    assert len({r["day"] for r in rows}) >= 3
    # the layout: one committed directory per shard, partitioned by queue and day, staging gone
    layout = ArchiveLayout(out.resolve(), "r1")
    for shard in shards.shards:
        manifest = json.loads(layout.manifest_file(shard.name).read_text())
        shard_expected = {k for k in expected if k[0] == shard.name}
        assert manifest["rows"] == len(shard_expected)
        assert manifest["queues"]["orders"]["rows"] == len({k for k in shard_expected if k[1] == "orders"})
        assert json.loads(layout.deleted_file(shard.name).read_text())["deleted"] == len(shard_expected)
        days = sorted(p.name for p in layout.queue_dir(shard.name, "orders").iterdir())
        assert days and all(d.startswith("day=") for d in days)
    assert not layout.staging_dir.exists()
    # one report per stage per shard, and the delete went in slices of 100
    for shard in shards.shards:
        stages = [p.stage for p in seen if p.shard == shard.name]
        assert [s for s in stages if s != "delete_slice"] == [
            "planned",
            "read",
            "written",
            "verified",
            "committed",
            "deleted",
        ]
        slices = [p for p in seen if p.shard == shard.name and p.stage == "delete_slice"]
        assert all(p.rows <= 100 for p in slices)
        assert sum(p.rows for p in slices) == len({k for k in expected if k[0] == shard.name})
        # the shard's ledger (what qm web's health page shows): the run finished, with its rows
        n = len({k for k in expected if k[0] == shard.name})
        with psycopg.connect(shard.dsn) as conn:
            ledger = conn.execute("SELECT stage, planned, archived, deleted FROM qm.archive_runs WHERE run_id = 'r1'")
            assert ledger.fetchall() == [("deleted", n, n, n)]


def test_a_run_interrupted_before_its_commit_is_rewritten_and_nothing_is_deleted_meanwhile(
    spark: SparkSession, shards: Topology, tmp_path: Path
) -> None:
    data = populate(shards)
    before = ids_in_shards(shards)
    out = tmp_path / "archive"
    # the Parquet is written to staging, the process dies before anything is verified or renamed
    crashed_run(spark, shards, out, crash_at("written"))
    assert ids_in_shards(shards) == before
    assert archived_keys(spark, out) == []  # staged files are not part of the archive
    layout = ArchiveLayout(out.resolve(), "r1")
    assert any(layout.staging_dir.rglob("*.parquet"))
    # a new run may not start while this one has rows in the shards
    with pytest.raises(ArchiveError, match=r"run 'r1' .* is unfinished"):
        archive_events(spark, shards, older_than=OLDER_THAN, output=out, run_id="r2")

    result = archive_events(spark, shards, older_than=timedelta(days=30), output=out, run_id="r1")

    # the plan's cut-off (7 days, fixed at the first start) stands, not the re-run's age
    assert result.resumed and result.cutoff < datetime.now(UTC) - OLDER_THAN
    keys = archived_keys(spark, out)
    assert len(keys) == len(set(keys)) and set(keys) == data.expected()
    assert ids_in_shards(shards) == before - data.expected()
    assert not layout.staging_dir.exists()


def test_a_run_interrupted_between_two_shard_commits_keeps_the_first_and_writes_the_second(
    spark: SparkSession, shards: Topology, tmp_path: Path
) -> None:
    data = populate(shards)
    before = ids_in_shards(shards)
    out = tmp_path / "archive"
    layout = ArchiveLayout(out.resolve(), "r1")
    crashed_run(spark, shards, out, crash_at("committed", shard="s0"))
    assert ids_in_shards(shards) == before  # committed, but nothing deleted
    assert layout.manifest_file("s0").is_file() and not layout.shard_dir("s1").exists()
    s0_files = file_tree(layout.shard_dir("s0"))
    seen: list[ArchiveProgress] = []

    result = archive_events(spark, shards, older_than=OLDER_THAN, output=out, run_id="r1", progress=seen.append)

    # s0 was not read or written again; s1 was
    assert {p.stage for p in seen if p.shard == "s0"} == {"delete_slice", "deleted"}
    assert "committed" in [p.stage for p in seen if p.shard == "s1"]
    assert {k: v for k, v in file_tree(layout.shard_dir("s0")).items() if not k.startswith("_deleted")} == s0_files
    keys = archived_keys(spark, out)
    assert len(keys) == len(set(keys)) and set(keys) == data.expected()
    assert result.deleted == len(data.expected())
    assert ids_in_shards(shards) == before - data.expected()


def test_a_run_interrupted_between_delete_slices_finishes_the_deletion_without_duplicates(
    spark: SparkSession, shards: Topology, tmp_path: Path
) -> None:
    data = populate(shards)
    before = ids_in_shards(shards)
    out = tmp_path / "archive"
    crashed_run(spark, shards, out, crash_at("delete_slice"), delete_slice=30)
    after_crash = ids_in_shards(shards)
    assert len(before - after_crash) == 30  # one slice committed
    assert (before - after_crash) <= data.expected()

    result = archive_events(spark, shards, older_than=OLDER_THAN, output=out, run_id="r1", delete_slice=30)

    assert result.deleted == len(data.expected()) - 30
    assert ids_in_shards(shards) == before - data.expected()
    keys = archived_keys(spark, out)
    assert len(keys) == len(set(keys)) and set(keys) == data.expected()


def test_re_running_a_finished_run_changes_nothing(spark: SparkSession, shards: Topology, tmp_path: Path) -> None:
    data = populate(shards)
    out = tmp_path / "archive"
    first = archive_events(spark, shards, older_than=OLDER_THAN, output=out, run_id="r1", queues=["orders"])
    assert first.archived == len(data.expected(("orders",)))
    remaining = ids_in_shards(shards)
    # more events become archivable meanwhile: a finished run does not take them
    for shard in shards.shards:
        with psycopg.connect(shard.dsn) as conn:
            conn.execute("UPDATE orders SET state = 'acked', acked_at = now() - interval '20 days' WHERE id % 5 = 4")
    files = file_tree(out)
    seen: list[ArchiveProgress] = []

    again = archive_events(spark, shards, older_than=OLDER_THAN, output=out, run_id="r1", progress=seen.append)

    assert again.resumed and again.deleted == 0 and again.archived == first.archived
    assert all(s.finished_before for s in again.shards.values())
    assert {p.stage for p in seen} == {"finished_before"}
    assert file_tree(out) == files
    assert ids_in_shards(shards) == remaining
    # and billing, never named, kept all its rows
    assert ids_in_shards(shards, ("billing",)) == {
        (s, q, i) for (s, q), ids in data.all_ids.items() if q == "billing" for i in ids
    }


def test_a_row_changed_after_it_was_read_is_kept_in_the_shard(
    spark: SparkSession, shards: Topology, tmp_path: Path
) -> None:
    data = populate(shards)
    s0 = shards.by_name("s0")
    with psycopg.connect(s0.dsn) as conn:
        row = conn.execute("SELECT min(id) FROM orders WHERE id % 5 = 1").fetchone()
    assert row is not None
    retried = row[0]

    def retry_after_read(p: ArchiveProgress) -> None:
        if p.stage == "verified" and p.shard == "s0":
            with psycopg.connect(s0.dsn) as conn:  # what 'qm events retry' does, on s0 only
                conn.execute(
                    """UPDATE orders SET state = 'to_be_fired', attempts = 0, fire_at = now(), last_error = NULL,
                              fired_at = NULL WHERE id = %s AND state = 'failed'""",
                    [retried],
                )

    result = archive_events(
        spark, shards, older_than=OLDER_THAN, output=tmp_path / "a", run_id="r1", progress=retry_after_read
    )

    assert result.kept == 1 and result.shards["s0"].kept == 1
    assert result.deleted == len(data.expected()) - 1
    remaining = ids_in_shards(shards)
    assert ("s0", "orders", retried) in remaining
    assert remaining & data.expected() == {("s0", "orders", retried)}
    deleted = json.loads(ArchiveLayout((tmp_path / "a").resolve(), "r1").deleted_file("s0").read_text())
    assert deleted["kept"] == 1 and deleted["kept_ids"] == [["orders", retried]]


def test_bad_input_gets_a_clear_error_and_touches_nothing(
    spark: SparkSession, shards: Topology, tmp_path: Path
) -> None:
    populate(shards)
    before = ids_in_shards(shards)
    out = tmp_path / "archive"

    def run(**kwargs: object) -> None:
        args: dict[str, object] = {"older_than": OLDER_THAN, "output": out, "run_id": "r1"}
        args.update(kwargs)
        archive_events(spark, shards, **args)  # type: ignore[arg-type]

    with pytest.raises(ConfigurationError, match="positive age"):
        run(older_than=timedelta(0))
    with pytest.raises(ConfigurationError, match="in the future"):
        run(older_than=datetime.now(UTC) + timedelta(hours=1))
    with pytest.raises(ConfigurationError, match="no time zone"):
        run(older_than=datetime(2020, 1, 1))
    with pytest.raises(ConfigurationError, match="timedelta"):
        run(older_than="7d")
    with pytest.raises(UnknownQueueError, match=r"'nope' does not exist on shard.*s0, s1"):
        run(queues=["orders", "nope"])
    with pytest.raises(InvalidNameError):
        run(queues=["Orders"])
    with pytest.raises(ConfigurationError, match="invalid run id"):
        run(run_id="../r1")
    with pytest.raises(ConfigurationError, match="not a local directory"):
        run(output="s3a://bucket/archive")
    with pytest.raises(ConfigurationError, match="delete_slice"):
        run(delete_slice=0)
    assert ids_in_shards(shards) == before
    assert not list(out.glob("run=*"))
    # a re-run may not change what its first start fixed
    archive_events(spark, shards, older_than=OLDER_THAN, output=out, run_id="r1", queues=["billing"])
    with pytest.raises(ConfigurationError, match="re-run it with the same queues"):
        run(queues=["orders"])
    with pytest.raises(ConfigurationError, match="re-run it with the same cut-off"):
        run(older_than=datetime(2020, 1, 1, tzinfo=UTC))


def test_cli_reports_every_stage_and_refuses_a_bad_cutoff(
    shards: Topology, tmp_path: Path, capsys: pytest.CaptureFixture[str], spark: SparkSession
) -> None:
    data = populate(shards)
    topo = tmp_path / "topology.toml"
    topo.write_text(shards.to_toml())
    out = tmp_path / "archive"
    base = ["spark", "archive", "--topology", str(topo), "--output", str(out)]
    assert qm_main([*base, "--older-than=-3d"]) == 2
    assert "invalid age '-3d'" in capsys.readouterr().err
    assert qm_main([*base, "--before", "2999-01-01T00:00:00Z"]) == 2
    assert "is in the future" in capsys.readouterr().err
    assert qm_main([*base, "--older-than", "7d", "--queue", "nope"]) == 2
    assert "queue 'nope' does not exist" in capsys.readouterr().err
    # the CLI uses the running session and leaves it running
    assert qm_main([*base, "--older-than", "7d", "--queue", "orders", "--run-id", "cli1"]) == 0
    text = capsys.readouterr().out
    for stage in ("planned", "read", "written", "verified", "committed", "deleted"):
        assert f"archive cli1: shard s0: {stage} " in text and f"archive cli1: shard s1: {stage} " in text
    assert f"{len(data.expected(('orders',))):,} rows archived" in text
    # with --json the stages go to stderr and stdout is one JSON document
    assert qm_main([*base, "--older-than", "7d", "--run-id", "cli1", "--json"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert summary["archived"] == len(data.expected(("orders",))) and summary["deleted"] == 0
    assert all(s["finished_before"] for s in summary["shards"].values())
    assert "archive cli1: shard s0: already finished, archived " in captured.err
