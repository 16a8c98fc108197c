"""The Spark jobs on a real standalone cluster (tests/spark_cluster/cluster.py), run as docs/spark.md
tells a user: ``spark-submit --master spark://... --jars <JDBC jar> spark_jobs/<job>.py ...``, the
work directory (and the archive's output) in the one directory the driver and the executors share.

An executor JVM is SIGKILLed in the middle of a Spark stage, or while the driver publishes: the job
finishes (Spark runs the lost tasks again on a new executor) or fails cleanly, and a re-run of the
run id leaves every event exactly once. ``make test`` runs four cases once (46 to 111 s each in a
run at load 20 to 34 on 2 cores; each submission starts a driver JVM and two executor JVMs; each
test fails past its stated bound, ``SUBMIT_TIMEOUT`` per submission); ``make test-spark-cluster``
repeats every case in rounds (``QM_SPARK_CLUSTER_ROUNDS``), a worker's whole JVM killed too.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import psycopg
import pytest

from queue_manager import admin
from queue_manager.domain.topology import Topology
from tests.spark_cluster.cluster import SparkCluster, wait_for

pytestmark = [pytest.mark.spark, pytest.mark.spark_cluster]

ROOT = Path(__file__).resolve().parents[2]
ENQUEUE = str(ROOT / "spark_jobs" / "enqueue.py")
ARCHIVE = str(ROOT / "spark_jobs" / "archive.py")
READ_ARCHIVE = str(Path(__file__).with_name("read_archive.py"))
ROWS = 200_000
#: how long one submission may take before the test fails (a bound for a loaded machine: whole tests of up
#: to three submissions took 46 to 192 s at load 13 to 34 on 2 cores)
SUBMIT_TIMEOUT = 240.0
#: the kill tests' rounds: 1 in make test, more in make test-spark-cluster
ROUNDS = int(os.environ.get("QM_SPARK_CLUSTER_ROUNDS", "1"))
#: what a kill takes down: the executor's JVM (in make test), or the whole worker's (a machine lost;
#: make test-spark-cluster)
TARGETS = os.environ.get("QM_SPARK_CLUSTER_TARGETS", "executor").split(",")
#: every (loader mode, kill point) pair (make test-spark-cluster), or two of them (make test): the
#: plain loader killed mid-stage, the atomic one mid-publish
FULL = os.environ.get("QM_SPARK_CLUSTER_FULL") == "1"
LOADER_CASES = (
    [("plain", "stage"), ("plain", "publish"), ("atomic", "stage"), ("atomic", "publish")]
    if FULL
    else [("plain", "stage"), ("atomic", "publish")]
)


def write_source(directory: Path, rows: int, files: int = 4) -> Path:
    """``rows`` events as CSV with a header, in ``files`` files: tenant ``tenant-<n % 5000>``, payload
    {"n": "<n>"} (CSV columns are text: no schema inference, no extra pass)."""
    directory.mkdir(parents=True)
    per = rows // files
    for f in range(files):
        last = rows if f == files - 1 else (f + 1) * per
        text = "tenant,n\n" + "".join(f"tenant-{n % 5000},{n}\n" for n in range(f * per, last))
        (directory / f"part-{f}.csv").write_text(text, encoding="utf-8")
    return directory


def make_queue(shards: Topology, name: str = "bulk") -> str:
    admin.create_queue(shards, name, {"partitions": 16, "shuffle": 4})
    return name


def topology_file(cluster: SparkCluster, shards: Topology) -> str:
    path = cluster.shared / f"topology-{uuid.uuid4().hex[:8]}.toml"
    path.write_text(shards.to_toml(), encoding="utf-8")
    return str(path)


def enqueue_args(topology: str, queue: str, source: Path, run_id: str, work: Path, *extra: str) -> list[str]:
    return [
        "--topology", topology, "--queue", queue, "--input", str(source), "--format", "csv",
        "--run-id", run_id, "--payload-cols", "n", "--work-dir", str(work), *extra,
    ]  # fmt: skip


def check_exact(shards: Topology, queue: str, rows: int) -> None:
    """Every n of 0..rows-1 exactly once, on its tenant's shard, in its tenant's shuffle set, the
    partition loads counting each."""
    seen: list[int] = []
    for s in shards.shards:
        with psycopg.connect(s.dsn) as conn:
            seen += [int(r[0]) for r in conn.execute(f"SELECT (payload->>'n')::bigint FROM {queue}")]
            bad = conn.execute(
                f"SELECT count(*) FILTER (WHERE qm.shard_for(tenant) <> (SELECT name FROM qm.shard)), "
                f"count(*) FILTER (WHERE NOT partition = ANY (qm.shuffle_set(tenant, 16, 4))), count(*) FROM {queue}"
            ).fetchone()
            assert bad is not None and bad[:2] == (0, 0), s.name
            loads = conn.execute("SELECT qm.partition_loads(%s)", (queue,)).fetchone()
            assert loads is not None and sum(loads[0]) == bad[2], s.name
    assert len(seen) == rows and sorted(seen) == list(range(rows))


def stage_attempts(work: Path, queue: str, run_id: str) -> bool:
    """Whether a task of the staging pass is writing (an attempt directory of Spark's committer)."""
    return any((work / queue / run_id / "stage" / "_temporary").glob("*/_temporary/attempt_*"))


def kill(cluster: SparkCluster, target: str) -> None:
    if target == "worker":
        cluster.kill_worker(0)
    else:
        cluster.kill_executor()


def finish_or_rerun(cluster: SparkCluster, first: object, script: str, args: list[str]) -> tuple[int, str]:
    """The first submission's end; when it failed, a re-run's (which must succeed). Returns the
    first's exit code and the output that finished the job."""
    from tests.spark_cluster.cluster import Submission

    assert isinstance(first, Submission)
    rc = first.finish(SUBMIT_TIMEOUT)
    if rc == 0:
        return rc, first.output()
    cluster.ensure_workers()
    again = cluster.submit(script, args)
    assert again.finish(SUBMIT_TIMEOUT) == 0, again.output()
    return rc, again.output()


def lost_executor(output: str) -> bool:
    """Whether the driver's log tells of the executor the test killed (the kill hit a live job)."""
    return "Lost executor" in output or "ExecutorLostFailure" in output or "Executor lost" in output


@pytest.mark.timeout(3 * SUBMIT_TIMEOUT)
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(("mode", "point"), LOADER_CASES)
@pytest.mark.parametrize("round_", range(ROUNDS))
def test_the_loader_on_a_cluster_puts_200k_rows_on_their_shards_once_with_an_executor_killed(
    spark_cluster: SparkCluster, shards: Topology, round_: int, mode: str, point: str, target: str
) -> None:
    """200 000 rows through spark-submit on the cluster, an executor SIGKILLed mid-stage (while the
    staging pass writes) or mid-publish (the driver publishing, atomic: after a shard's prepare):
    the job finishes, or fails cleanly and its re-run finishes; every row is then in the queue once,
    on its tenant's shard and shuffle set; a re-run of the finished run adds nothing. Fails past 3 x
    240 s (three submissions at most)."""
    cluster = spark_cluster
    queue = make_queue(shards)
    source = write_source(cluster.shared / f"src-{uuid.uuid4().hex[:8]}", ROWS)
    work = cluster.shared / f"work-{uuid.uuid4().hex[:8]}"
    run = f"c{mode}"
    args = enqueue_args(
        topology_file(cluster, shards), queue, source, run, work, *(["--atomic"] if mode == "atomic" else [])
    )
    first = cluster.submit(ENQUEUE, args)
    if point == "stage":
        wait_for(
            "a task of the staging pass",
            lambda: stage_attempts(work, queue, run) or first.proc.poll() is not None,
            SUBMIT_TIMEOUT,
        )
        assert first.proc.poll() is None, first.output()
        kill(cluster, target)
        assert not (work / queue / run / "stage" / "_SUCCESS").exists()  # the kill came mid-stage
    else:
        first.wait_line(rf"run {run}: {'prepared' if mode == 'atomic' else 'validated'} ", SUBMIT_TIMEOUT)
        kill(cluster, target)
    rc, output = finish_or_rerun(cluster, first, ENQUEUE, args)
    assert f"run {run}: done: {ROWS} good rows, 0 rejected" in output, output
    if point == "stage":
        assert lost_executor(first.stderr_text()), first.output()
    check_exact(shards, queue, ROWS)
    if FULL or rc != 0:  # a re-run of the finished run adds nothing (in make test: when it took one)
        cluster.ensure_workers()
        again = cluster.submit(ENQUEUE, args)
        assert again.finish(SUBMIT_TIMEOUT) == 0, again.output()
        assert "0 events published by this call" in again.output() and "already published" in again.output()
        check_exact(shards, queue, ROWS)
    # what the run left: no stage files, no stage table, no prepared part; the ledgers published
    assert not (work / queue / run / "stage").exists()
    for s in shards.shards:
        with psycopg.connect(s.dsn) as conn:
            row = conn.execute("SELECT state, stage_table FROM qm.spark_runs WHERE run_id = %s", (run,)).fetchone()
            assert row == ("published", None), s.name
            assert conn.execute("SELECT count(*) FROM pg_prepared_xacts").fetchone() == (0,)
    print(json.dumps({"mode": mode, "point": point, "target": target, "first_rc": rc}))


@pytest.mark.timeout(3 * SUBMIT_TIMEOUT)
def test_a_work_directory_the_executors_cannot_see_fails_the_loader_cleanly(
    spark_cluster: SparkCluster, shards: Topology
) -> None:
    """On a cluster the run's files must be where the driver and the executors both read them. No
    --work-dir: refused before anything changes. A directory of the driver's own (its /tmp, which
    each worker has its own of): the driver finds fewer staged rows than the executors wrote, and
    the run fails with nothing published; a run of the id with a shared directory then loads every
    row once (in make test-spark-cluster). Fails past 3 x 240 s."""
    cluster = spark_cluster
    queue = make_queue(shards)
    rows = 2000
    source = write_source(cluster.shared / f"src-{uuid.uuid4().hex[:8]}", rows, files=2)
    topology = topology_file(cluster, shards)
    args = enqueue_args(topology, queue, source, "hidden", cluster.shared / "unused")
    without = args[: args.index("--work-dir")]
    if FULL:  # in make test: tests/unit/test_spark_work_dir.py checks the refusal without a cluster
        refused = cluster.submit(ENQUEUE, without)
        assert refused.finish(SUBMIT_TIMEOUT) == 2, refused.output()
        assert "the job needs --work-dir" in refused.output() and "Nothing was changed" in refused.output()
        for s in shards.shards:
            with psycopg.connect(s.dsn) as conn:
                assert conn.execute("SELECT count(*) FROM qm.spark_runs").fetchone() == (0,)

    private = Path(f"/tmp/qm-driver-only-{uuid.uuid4().hex[:8]}")  # the driver's /tmp, not the workers'
    try:
        hidden = cluster.submit(ENQUEUE, [*without, "--work-dir", str(private)])
        assert hidden.finish(SUBMIT_TIMEOUT) == 2, hidden.output()
        assert "the work directory must be one that the driver and every executor share" in hidden.output()
    finally:
        import shutil

        shutil.rmtree(private, ignore_errors=True)
    for s in shards.shards:
        with psycopg.connect(s.dsn) as conn:
            assert conn.execute(f"SELECT count(*) FROM {queue}").fetchone() == (0,)
            # the run's staging stays, for its next attempt
            assert conn.execute("SELECT state FROM qm.spark_runs WHERE run_id = 'hidden'").fetchone() == ("staging",)
    if FULL:
        shared = cluster.submit(ENQUEUE, args)
        assert shared.finish(SUBMIT_TIMEOUT) == 0, shared.output()
        check_exact(shards, queue, rows)


# ------------------------------------------------------------------------------------ the archive

ARCHIVE_PER_SHARD = 12_000


def settle_events(shards: Topology) -> dict[str, set[int]]:
    """``ARCHIVE_PER_SHARD`` events of queue ``orders`` per shard: a third acked 8 days ago, a third
    failed 9 days ago (both to archive), a third still to be fired. Returns the ids to archive per
    shard."""
    from queue_manager.producer import Event, enqueue_batch
    from tests.conftest import tenants_of
    from tests.spark.test_spark_archive import trace_context

    admin.create_queue(shards, "orders", {"partitions": 4, "shuffle": 2})
    archivable: dict[str, set[int]] = {}
    for shard in shards.shards:
        tenants = tenants_of(shard, 20)
        with psycopg.connect(shard.dsn) as conn:
            events = [
                Event(tenants[i % len(tenants)], {"i": i}, trace_context=trace_context(i))
                for i in range(ARCHIVE_PER_SHARD)
            ]
            assert enqueue_batch(conn, "orders", events) == ARCHIVE_PER_SHARD
            conn.execute(
                """UPDATE orders SET state = 'acked', attempts = 1, fired_at = now() - interval '8 days 1 minute',
                          acked_at = now() - interval '8 days' WHERE id % 3 = 0"""
            )
            conn.execute(
                """UPDATE orders SET state = 'failed', attempts = 3, last_error = 'boom',
                          fired_at = now() - interval '9 days' WHERE id % 3 = 1"""
            )
            conn.commit()
            archivable[shard.name] = {r[0] for r in conn.execute("SELECT id FROM orders WHERE id % 3 IN (0, 1)")}
    return archivable


@pytest.mark.timeout(3 * SUBMIT_TIMEOUT)
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("point", ["stage", "delete"] if FULL else ["stage"])
@pytest.mark.parametrize("round_", range(ROUNDS))
def test_the_archive_on_a_cluster_archives_every_settled_event_once_with_an_executor_killed(
    spark_cluster: SparkCluster, shards: Topology, round_: int, point: str, target: str
) -> None:
    """The archive through spark-submit on the cluster, its output in the shared directory, an
    executor SIGKILLed while the Parquet files are written (or while the ids to delete are read back,
    in make test-spark-cluster): the run finishes or fails cleanly, and a re-run with its run id
    finishes it; every settled event is then in the archive once and no longer in its shard, and
    every other event is still there. Fails past 3 x 240 s."""
    cluster = spark_cluster
    archivable = settle_events(shards)
    output = cluster.shared / f"archive-{uuid.uuid4().hex[:8]}"
    args = [
        "--topology", topology_file(cluster, shards), "--output", str(output), "--older-than", "7d",
        "--run-id", "arc1", "--rows-per-partition", "2000", "--delete-slice", "2000", "--json",
    ]  # fmt: skip
    first = cluster.submit(ARCHIVE, args)
    if point == "stage":
        staging = output / "_staging" / "run=arc1"
        wait_for(
            "a task of the archive's write",
            lambda: any(staging.glob("*/_temporary/*/_temporary/attempt_*")) or first.proc.poll() is not None,
            SUBMIT_TIMEOUT,
        )
        assert first.proc.poll() is None, first.output()
        kill(cluster, target)
        assert not list(output.glob("run=arc1/shard=*"))  # the kill came before any commit
    else:
        # the step lines are the driver's stderr, which spark-submit's Python runner sends to stdout
        first.wait_line(r"archive arc1: shard \S+, queue orders: deleted", SUBMIT_TIMEOUT)
        assert first.proc.poll() is None, first.output()
        kill(cluster, target)
    rc, output_text = finish_or_rerun(cluster, first, ARCHIVE, args)
    # spark-submit's Python runner sends the driver's stderr (the step lines) to stdout too: the
    # JSON is what follows the last line that opens an object
    stdout = output_text[: output_text.index("\n--- stderr")]
    summary = json.loads(stdout[stdout.rindex("\n{\n") + 1 :])
    expected = sum(len(ids) for ids in archivable.values())
    assert summary["archived"] == expected, output_text
    # the archive holds each settled event once, with its trace context (read back by a job of its own)
    check = cluster.submit(READ_ARCHIVE, [str(output)], master="local[1]")
    assert check.finish(SUBMIT_TIMEOUT) == 0, check.output()
    found = json.loads(check.lines[-1])
    for shard in shards.shards:
        ids = found["ids"][shard.name]
        assert len(ids) == len(set(ids)) and set(ids) == archivable[shard.name], shard.name
        with psycopg.connect(shard.dsn) as conn:
            left = {r[0] for r in conn.execute("SELECT id FROM orders")}
        assert not left & archivable[shard.name] and len(left) == ARCHIVE_PER_SHARD - len(archivable[shard.name])
    assert found["traced"] == found["traced_expected"] > 0
    print(json.dumps({"point": point, "target": target, "first_rc": rc}))
