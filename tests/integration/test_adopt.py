"""``qm queue adopt``: a legacy queue table moved into a queue of two shards, while it is still written.

The legacy table lives in a plain database of the test server (another "server" to the shards) or
in a shard's own database. Every event carries its legacy number ``n`` in its payload, so that the
tests can check that each legacy row is in the queue exactly once, on its tenant's shard.
"""

from __future__ import annotations

import json
import random
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from queue_manager import admin
from queue_manager.adopt import AdoptOptions, AdoptReport, Phase, adopt, check_adoption
from queue_manager.cli.main import main
from queue_manager.domain import routing
from queue_manager.domain.adopt import AdoptMapping
from queue_manager.domain.topology import Topology
from queue_manager.errors import AdoptError, ConfigurationError, UnknownQueueError
from tests import pgtest
from tests.conftest import count_on_shards

_ROOT = Path(__file__).resolve().parents[2]

JOBS = """
CREATE TABLE jobs (
    id       bigserial PRIMARY KEY,
    customer text,
    args     jsonb NOT NULL DEFAULT '{}',
    run_at   timestamptz NOT NULL DEFAULT now(),
    status   text NOT NULL DEFAULT 'pending'
)"""
#: tenants of both shards (md5 spreads them over -80 and 80-)
TENANTS = [f"tenant-{i}" for i in range(40)]
#: legacy row n runs at this time (in the past: due at once), or in 2030 for every 7th row
RUN_AT = "CASE WHEN n % 7 = 0 THEN timestamptz '2030-01-01 00:00:00+00' ELSE timestamptz '2025-01-01 00:00:00+00' END"

MAPPING: dict[str, Any] = {"table": "jobs", "payload_col": "args", "tenant_col": "customer", "run_at_col": "run_at"}


def mapping(**changes: Any) -> AdoptMapping:
    return AdoptMapping.build(**(MAPPING | changes))


def expected_run_at(n: int) -> str:
    return "2030-01-01T00:00:00+00:00" if n % 7 == 0 else "2025-01-01T00:00:00+00:00"


@pytest.fixture
def legacy_dsn(pg_admin_dsn: str) -> Iterator[str]:
    """A plain database (not a shard, never migrated) holding the legacy table ``jobs``."""
    name = f"qm_legacy_{uuid.uuid4().hex[:12]}"
    dsn = pgtest.fresh_database(pg_admin_dsn, None, name)
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(JOBS)
    yield dsn
    pgtest.drop_database(pg_admin_dsn, name)


def write_jobs(conn: psycopg.Connection[Any] | str, ns: range | list[int], status: str = "pending") -> None:
    """The legacy jobs ``ns`` (due, of the tenants ``TENANTS``) through ``conn``, or committed at once in
    a connection of their own when ``conn`` is a DSN."""
    if isinstance(conn, str):
        with psycopg.connect(conn, autocommit=True) as c:
            write_jobs(c, ns, status)
        return
    conn.execute(
        f"INSERT INTO jobs (customer, args, run_at, status) "
        f"SELECT (%(tenants)s::text[])[n %% 40 + 1], jsonb_build_object('n', n), {RUN_AT.replace('%', '%%')}, "
        f"%(status)s FROM unnest(%(ns)s::integer[]) AS n",
        {"tenants": TENANTS, "ns": list(ns), "status": status},
    )


def legacy_count(dsn: str, where: str = "true") -> int:
    with psycopg.connect(dsn) as c:
        row = c.execute(f"SELECT count(*) FROM jobs WHERE {where}").fetchone()
    assert row is not None
    return int(row[0])


def queued(topology: Topology, queue: str = "orders") -> list[dict[str, Any]]:
    """Every event of the queue on every shard, with its shard."""
    out = []
    for shard in topology.shards:
        with psycopg.connect(shard.dsn) as c:
            for tenant, n, fire_at, partition in c.execute(
                f"SELECT tenant, (payload->>'n')::integer, fire_at, partition FROM {queue}"
            ):
                out.append({"shard": shard.name, "tenant": tenant, "n": n, "fire_at": fire_at, "partition": partition})
    return out


def ledger_size(topology: Topology) -> int:
    return count_on_shards(topology, "SELECT count(*) FROM qm.adopted")


def outbox_size(dsn: str) -> int:
    with psycopg.connect(dsn) as c:
        row = c.execute("SELECT count(*) FROM qm_adopt_outbox").fetchone()
    assert row is not None
    return int(row[0])


def assert_exactly_once(topology: Topology, legacy: str, expected: set[int]) -> list[dict[str, Any]]:
    """Each expected legacy row is in the queue once, on its tenant's shard; no outbox or ledger row is left."""
    events = queued(topology)
    counts = Counter(e["n"] for e in events)
    doubled = sorted(n for n, c in counts.items() if c > 1)
    missing = sorted(expected - set(counts))
    assert not doubled, f"{len(doubled)} legacy rows enqueued twice, e.g. {doubled[:10]}"
    assert not missing, f"{len(missing)} legacy rows lost, e.g. {missing[:10]}"
    assert set(counts) == expected
    for e in events:
        assert topology.shard_for(e["tenant"]).name == e["shard"], e
        assert e["tenant"] == TENANTS[e["n"] % 40]
    assert outbox_size(legacy) == 0
    assert ledger_size(topology) == 0
    return events


class LegacyProducer(threading.Thread):
    """Writes legacy rows ``start .. start + count - 1``, ``batch`` per transaction, as the old producers do."""

    def __init__(self, dsn: str, start: int, count: int, batch: int = 10, pause: float = 0.004) -> None:
        super().__init__(daemon=True)
        self.dsn, self.start_n, self.count, self.batch, self.pause = dsn, start, count, batch, pause
        self.written = 0
        self.error: BaseException | None = None
        self.finished_at = float("inf")

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as c:
                for i in range(self.start_n, self.start_n + self.count, self.batch):
                    with c.transaction():
                        write_jobs(c, range(i, min(i + self.batch, self.start_n + self.count)))
                    self.written = min(i + self.batch, self.start_n + self.count) - self.start_n
                    time.sleep(self.pause)
            self.finished_at = time.monotonic()
        except BaseException as exc:  # surfaced by the test
            self.error = exc

    def finish(self) -> None:
        self.join(60)
        assert not self.is_alive()
        assert self.error is None, self.error
        assert self.written == self.count


def test_adopt_in_slices_while_a_producer_still_writes(
    shards: Topology, make_queue: Callable[..., str], legacy_dsn: str
) -> None:
    make_queue("orders", partitions=8, shuffle=2)
    write_jobs(legacy_dsn, range(2000))
    producer = LegacyProducer(legacy_dsn, 2000, 3000)
    samples: list[tuple[int, bool]] = []

    def progress(report: AdoptReport) -> None:
        samples.append((report.adopted, producer.is_alive()))

    producer.start()
    report = adopt(
        shards,
        "orders",
        legacy_dsn,
        mapping(),
        AdoptOptions(slice_rows=100, follow=True, poll_seconds=0.05, until_idle=1.0),
        progress=progress,
    )
    stopped_at = time.monotonic()
    producer.finish()

    # the run overlapped the producer, and stopped on its own once the table stayed empty (cut-over)
    assert any(adopted > 0 and alive for adopted, alive in samples), "adopt never ran beside the producer"
    assert report.ended == "idle"
    assert stopped_at - producer.finished_at < 1.0 + 10.0  # drained and idle for 1 s soon after the last write
    assert (report.moved, report.adopted, report.already, report.deduplicated) == (5000, 5000, 0, 0)
    assert report.slices >= 50
    assert (report.left_pending, report.outbox_left, report.rejected) == (0, 0, [])
    assert legacy_count(legacy_dsn) == 0
    events = assert_exactly_once(shards, legacy_dsn, set(range(5000)))
    # the producers' path: each event in its tenant's shuffle set, its run-at kept, the load counters moved
    for e in events:
        assert e["partition"] in routing.shuffle_set(e["tenant"], 8, 2)
        assert e["fire_at"].isoformat() == expected_run_at(e["n"])
    for shard in shards.shards:
        with psycopg.connect(shard.dsn) as c:
            loads = c.execute("SELECT qm.partition_loads('orders')").fetchone()
        assert loads is not None
        assert sum(loads[0]) == sum(1 for e in events if e["shard"] == shard.name)


def test_old_consumers_keep_taking_rows_and_rows_in_progress_stay(
    shards: Topology, make_queue: Callable[..., str]
) -> None:
    """The legacy table in shard s0's own database, taken by marking; its old consumers still run."""
    make_queue("orders", partitions=8, shuffle=2)
    legacy = shards.shards[0].dsn
    with psycopg.connect(legacy, autocommit=True) as c:
        c.execute(JOBS)
        write_jobs(c, range(3000))
        write_jobs(c, range(3000, 3100), status="running")  # in progress in the old system
        write_jobs(c, range(3100, 3200), status="done")
    taken_by_old: list[int] = []
    stop = threading.Event()

    def old_consumer() -> None:
        with psycopg.connect(legacy, autocommit=True) as c:
            while not stop.is_set():
                rows = c.execute(
                    "UPDATE jobs SET status = 'running' WHERE id IN (SELECT id FROM jobs WHERE status = 'pending' "
                    "ORDER BY id LIMIT 7 FOR UPDATE SKIP LOCKED) RETURNING (args->>'n')::integer"
                ).fetchall()
                taken_by_old.extend(n for (n,) in rows)
                time.sleep(0.002)

    consumer = threading.Thread(target=old_consumer, daemon=True)
    consumer.start()
    try:
        report = adopt(
            shards,
            "orders",
            legacy,
            mapping(filters=[("status", "pending")], marks=[("status", "adopted")]),
            AdoptOptions(slice_rows=50),
        )
    finally:
        stop.set()
        consumer.join(10)

    adopted = {e["n"] for e in queued(shards)}
    old = set(taken_by_old)
    assert adopted and old, "adopt and the old consumer did not both take rows"
    assert not adopted & old, f"rows taken by both: {sorted(adopted & old)[:10]}"
    assert adopted | old == set(range(3000)), "rows lost"
    assert len(taken_by_old) == len(old)
    assert_exactly_once(shards, legacy, adopted)
    assert report.adopted == len(adopted)
    with psycopg.connect(legacy) as c:
        by_status = {
            s: {n for (n,) in c.execute("SELECT (args->>'n')::integer FROM jobs WHERE status = %s", (s,))}
            for s in ("pending", "adopted", "running", "done")
        }
    assert by_status["adopted"] == adopted
    assert by_status["running"] == old | set(range(3000, 3100))  # in progress: left to the old system
    assert by_status["done"] == set(range(3100, 3200))
    assert by_status["pending"] == set()


class Crash(Exception):
    """Stands for a process dying between two commits."""


def crash_at(phase: Phase, nth: int) -> Callable[[Phase], None]:
    seen = Counter[str]()

    def hook(reached: Phase) -> None:
        seen[reached] += 1
        if reached == phase and seen[reached] == nth:
            raise Crash(phase)

    return hook


@pytest.mark.parametrize("phase", ["moved", "published", "forgotten"])
def test_a_run_that_fails_between_commits_is_finished_by_the_next_one(
    shards: Topology, make_queue: Callable[..., str], legacy_dsn: str, phase: Phase
) -> None:
    make_queue("orders")
    write_jobs(legacy_dsn, range(1000))
    with pytest.raises(Crash):
        # the third slice's; "published" comes once per shard, and each slice reaches both shards
        nth = 5 if phase == "published" else 3
        adopt(shards, "orders", legacy_dsn, mapping(), AdoptOptions(slice_rows=100), hook=crash_at(phase, nth))

    # what the crash left: each row in the legacy table, the outbox, or the queue; a row in both the
    # outbox and the queue (published, not yet forgotten) has its key in its shard's ledger
    in_queue, in_outbox, in_ledger = len(queued(shards)), outbox_size(legacy_dsn), ledger_size(shards)
    both = in_queue - 200 if phase == "published" else 0
    assert legacy_count(legacy_dsn) + in_outbox + in_queue - both == 1000
    if phase == "moved":  # the third slice taken, not published
        assert (in_queue, in_outbox) == (200, 100)
    elif phase == "published":  # one shard's part of the third slice published, the other's not
        assert 0 < both < 100 and in_outbox == 100
        assert in_ledger >= both
    else:  # published and gone from the outbox; the ledger keys not yet forgotten
        assert (in_queue, in_outbox) == (300, 0)
        assert in_ledger > 0

    started = time.monotonic()
    report = adopt(shards, "orders", legacy_dsn, mapping(), AdoptOptions(slice_rows=100))
    assert time.monotonic() - started < 30
    assert_exactly_once(shards, legacy_dsn, set(range(1000)))
    assert report.already == both
    assert report.adopted + report.already == 1000 - (in_queue - both)


#: qm as a child process
QM = [sys.executable, "-m", "queue_manager.cli.main"]


def adopt_argv(topo_file: Path, legacy_dsn: str) -> list[str]:
    """``qm queue adopt orders`` of the legacy ``jobs`` table (payload ``args``, tenant ``customer``)."""
    source = ["--from", legacy_dsn, "--table", "jobs", "--payload-col", "args", "--tenant-col", "customer"]
    return ["queue", "adopt", "orders", "--topology", str(topo_file), *source]


def _spawn(argv: list[str]) -> subprocess.Popen[str]:
    """``argv`` started from the repository's root, its stdout and stderr piped (text)."""
    return subprocess.Popen(argv, cwd=_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _reap(proc: subprocess.Popen[str]) -> None:
    """Kill ``proc`` if it still runs, and close its pipes."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def _child(
    topo: Path, queue: str, dsn: str, phase: str, nth: int, mapping_json: dict[str, Any]
) -> subprocess.Popen[str]:
    module = [sys.executable, "-m", "tests.adopt_child"]
    return _spawn([*module, str(topo), queue, dsn, phase, str(nth), json.dumps(mapping_json)])


def _wait_line(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        proc.kill()
        raise AssertionError(f"no line from the child within {timeout} s")
    return proc.stdout.readline().strip()


@pytest.mark.parametrize("phase", ["moved", "published"])
def test_a_killed_process_loses_nothing_and_doubles_nothing(
    shards: Topology, make_queue: Callable[..., str], legacy_dsn: str, topo_file: Path, phase: str
) -> None:
    """SIGKILL exactly between two databases' commits, then ``qm queue adopt`` again."""
    make_queue("orders")
    write_jobs(legacy_dsn, range(1000))
    # the fourth slice taken; or the third slice published on its first shard, not on the other
    child = _child(topo_file, "orders", legacy_dsn, phase, 4 if phase == "moved" else 5, MAPPING)
    try:
        assert _wait_line(child, 60) == f"halted at {phase}"
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    finally:
        _reap(child)
    assert outbox_size(legacy_dsn) == 100  # the killed run's slice, taken and not forgotten
    published_before = len(queued(shards))
    if phase == "moved":
        assert published_before == 300
    else:
        assert 200 < published_before < 300 and ledger_size(shards) >= published_before - 200

    started = time.monotonic()
    code = main([*adopt_argv(topo_file, legacy_dsn), "--run-at-col", "run_at", "--slice", "100"])
    assert code == 0
    assert time.monotonic() - started < 30  # the dead run's lock went with its connections
    assert_exactly_once(shards, legacy_dsn, set(range(1000)))


def test_killed_again_and_again_while_producers_write(
    shards: Topology, make_queue: Callable[..., str], legacy_dsn: str, topo_file: Path
) -> None:
    """``qm queue adopt --follow`` killed with SIGKILL at random moments beside a producer, then re-run."""
    make_queue("orders")
    write_jobs(legacy_dsn, range(1000))
    producer = LegacyProducer(legacy_dsn, 1000, 3000, batch=5, pause=0.003)
    producer.start()
    command = [*QM, *adopt_argv(topo_file, legacy_dsn), "--run-at-col", "run_at", "--slice", "50"]
    rng = random.Random(13)
    kills = 0
    while producer.is_alive() or kills < 3:
        proc = _spawn([*command, "--follow", "--poll", "0.02", "--progress", "0"])
        try:
            assert _wait_line(proc, 60).startswith("adopt ")  # a first slice done: the run is under way
            time.sleep(rng.uniform(0.0, 0.4))
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            assert proc.stderr is not None
            err = proc.stderr.read()
            assert "error" not in err, err
        finally:
            _reap(proc)
        kills += 1
    producer.finish()
    done = subprocess.run(
        [*command, "--follow", "--poll", "0.05", "--until-idle", "0.5"], cwd=_ROOT, capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert kills >= 3
    assert legacy_count(legacy_dsn) == 0
    assert_exactly_once(shards, legacy_dsn, set(range(4000)))


def test_bad_mappings_are_refused_before_anything_moves(
    shards: Topology, make_queue: Callable[..., str], legacy_dsn: str
) -> None:
    make_queue("orders")
    with psycopg.connect(legacy_dsn, autocommit=True) as c:
        write_jobs(c, range(10))
        c.execute("CREATE TABLE nokey (id bigint, p jsonb, t text)")
        c.execute("CREATE TYPE job_state AS ENUM ('pending', 'running', 'done')")
        c.execute("CREATE TABLE typed (id bigint PRIMARY KEY, t text, p jsonb, at timestamp, n integer, s job_state)")
        c.execute("INSERT INTO typed VALUES (1, 'a', '{}', '2025-01-01', 1, 'pending')")
    cases: list[tuple[AdoptMapping, str]] = [
        (mapping(table="nope"), "no table 'nope' in the legacy database"),
        (mapping(tenant_col="client"), "--tenant-col 'client': no such column in jobs"),
        (mapping(table="nokey", payload_col="p", tenant_col="t", run_at_col=None), "--id-col 'id' is not unique"),
        (mapping(table="typed", payload_col="n", tenant_col="t", run_at_col=None), "--payload-col 'n' is integer"),
        (mapping(table="typed", payload_col="p", tenant_col="t", run_at_col="at"), "--run-at-timezone"),
        (mapping(table="typed", payload_col="p", tenant_col="p", run_at_col=None), "--tenant-col 'p' is jsonb"),
        (
            mapping(table="typed", payload_col="p", tenant_col="t", run_at_col=None, filters=[("s", "waiting")]),
            'invalid input value for enum job_state: "waiting"',
        ),
        (
            mapping(
                table="typed",
                payload_col="p",
                tenant_col="t",
                run_at_col=None,
                filters=[("s", "pending")],
                marks=[("s", "adopted")],
            ),
            'taking rows from public.typed .--mark.: invalid input value for enum job_state: "adopted"',
        ),
        (
            mapping(table="typed", payload_col="p", tenant_col="t", run_at_col="at", run_at_timezone="Mars/Olympus"),
            'time zone "Mars/Olympus" not recognized',
        ),
    ]
    for m, message in cases:
        with pytest.raises(ConfigurationError, match=message):
            adopt(shards, "orders", legacy_dsn, m)
    with pytest.raises(UnknownQueueError, match="queue 'invoices' does not exist on shard 's0'"):
        adopt(shards, "invoices", legacy_dsn, mapping())
    # nothing moved, nothing created
    assert legacy_count(legacy_dsn) == 10
    assert queued(shards) == []
    with psycopg.connect(legacy_dsn) as c:
        assert c.execute("SELECT to_regclass('qm_adopt_outbox')").fetchone() == (None,)
        assert c.execute("SELECT count(*) FROM typed").fetchone() == (1,)


def test_rows_the_queue_would_refuse(shards: Topology, make_queue: Callable[..., str], legacy_dsn: str) -> None:
    """Stop before anything moves (fail, the default), or leave them in the legacy table (leave)."""
    make_queue("orders", payload_limit_bytes=200)
    with psycopg.connect(legacy_dsn, autocommit=True) as c:
        write_jobs(c, range(100))
        c.execute("UPDATE jobs SET customer = NULL WHERE (args->>'n')::integer IN (3, 4)")
        c.execute("UPDATE jobs SET customer = '' WHERE (args->>'n')::integer = 5")
        c.execute("UPDATE jobs SET args = args || jsonb_build_object('big', repeat('x', 300)) WHERE id = 11")
        c.execute("UPDATE jobs SET run_at = '1999-12-31+00' WHERE id = 12")
        c.execute("UPDATE jobs SET run_at = '2099-01-01+00' WHERE id = 13")  # beyond max_delay_seconds (10 years)
    bad = {"4": "tenant is NULL or empty", "5": "tenant is NULL or empty", "6": "tenant is NULL or empty"}
    bad |= {"11": "payload over the queue's payload_limit_bytes", "12": "run-at before 2000-01-01 or infinite"}
    bad |= {"13": "run-at beyond the queue's max_delay_seconds"}

    pre = check_adoption(shards, "orders", legacy_dsn, mapping())
    assert (pre.pending, pre.bad) == (100, 6)
    assert pre.bad_by_reason["tenant is NULL or empty"] == 3
    with pytest.raises(AdoptError, match=r"6 of the 100 pending row\(s\) of public.jobs would be refused") as err:
        adopt(shards, "orders", legacy_dsn, mapping())
    assert "4: tenant is NULL or empty" in str(err.value) and "Nothing was moved" in str(err.value)
    assert legacy_count(legacy_dsn) == 100 and queued(shards) == []

    report = adopt(shards, "orders", legacy_dsn, mapping(), AdoptOptions(slice_rows=7, bad_rows="leave"))
    assert {r.legacy_id: r.reason for r in report.rejected} == bad
    assert {r.where for r in report.rejected} == {"legacy table"}
    assert (report.adopted, report.left_pending, report.outbox_left) == (94, 6, 0)
    with psycopg.connect(legacy_dsn) as c:
        assert {str(i) for (i,) in c.execute("SELECT id FROM jobs")} == set(bad)  # left, not lost
    assert_exactly_once(shards, legacy_dsn, set(range(100)) - {3, 4, 5, 10, 11, 12})


def test_a_row_refused_when_published_stays_in_the_outbox(
    shards: Topology, make_queue: Callable[..., str], legacy_dsn: str
) -> None:
    """A row taken while the queue accepted it, refused after its limit was lowered: kept, reported, published
    once the limit is back."""
    make_queue("orders")
    with psycopg.connect(legacy_dsn, autocommit=True) as c:
        write_jobs(c, range(300))
        c.execute("UPDATE jobs SET args = args || jsonb_build_object('big', repeat('x', 300)) WHERE id = 250")
    with pytest.raises(Crash):
        adopt(shards, "orders", legacy_dsn, mapping(), AdoptOptions(slice_rows=100), hook=crash_at("moved", 3))
    admin.alter_queue(shards, "orders", {"payload_limit_bytes": 200})

    with pytest.raises(AdoptError, match=r"kept in the outbox public\.qm_adopt_outbox \(not lost\)") as err:
        adopt(shards, "orders", legacy_dsn, mapping(), AdoptOptions(slice_rows=100))
    assert "250: " in str(err.value)
    assert outbox_size(legacy_dsn) == 1

    report = adopt(shards, "orders", legacy_dsn, mapping(), AdoptOptions(slice_rows=100, bad_rows="leave"))
    assert [(r.legacy_id, r.where) for r in report.rejected] == [("250", "outbox")]
    assert "payload" in report.rejected[0].reason
    assert (report.outbox_left, report.left_pending) == (1, 0)

    admin.alter_queue(shards, "orders", {"payload_limit_bytes": 65536})
    report = adopt(shards, "orders", legacy_dsn, mapping())
    assert (report.adopted, report.rejected, report.outbox_left) == (1, [], 0)
    assert_exactly_once(shards, legacy_dsn, set(range(300)))


def test_one_run_per_adoption_at_a_time(shards: Topology, make_queue: Callable[..., str], legacy_dsn: str) -> None:
    make_queue("orders")
    write_jobs(legacy_dsn, range(300))
    halted, release = threading.Event(), threading.Event()
    outcome: list[object] = []

    def hold(reached: Phase) -> None:
        if reached == "moved" and not halted.is_set():
            halted.set()
            release.wait(30)

    def first() -> None:
        try:
            outcome.append(adopt(shards, "orders", legacy_dsn, mapping(), AdoptOptions(slice_rows=100), hook=hold))
        except BaseException as exc:
            outcome.append(exc)

    t = threading.Thread(target=first, daemon=True)
    t.start()
    try:
        assert halted.wait(30)
        with pytest.raises(AdoptError, match="is already running"):
            adopt(shards, "orders", legacy_dsn, mapping())
    finally:
        release.set()
        t.join(30)
    assert isinstance(outcome[0], AdoptReport)
    assert_exactly_once(shards, legacy_dsn, set(range(300)))


def test_adopted_events_wake_a_waiting_manager(
    shards: Topology, make_queue: Callable[..., str], legacy_dsn: str
) -> None:
    make_queue("orders")
    write_jobs(legacy_dsn, range(1, 7))  # none is a 7th row: all due (run-at in the past)
    waiting = {}
    for shard in shards.shards:
        manager = psycopg.connect(shard.dsn, autocommit=True)
        qid = manager.execute("SELECT id FROM qm.queues WHERE name = 'orders'").fetchone()
        manager.execute("LISTEN qm_wake")
        manager.execute("SELECT pg_advisory_lock(qm.lock_class('wake'), %s)", qid)  # armed: waiting for a wake-up
        waiting[shard.name] = manager
    try:
        adopt(shards, "orders", legacy_dsn, mapping())
        shards_with_events = {e["shard"] for e in queued(shards)}
        for name, manager in waiting.items():
            notices = [n.payload for n in manager.notifies(timeout=1.0, stop_after=1)]
            if name in shards_with_events:
                assert notices and notices[0].startswith("orders due "), (name, notices)
            else:
                assert notices == []
    finally:
        for manager in waiting.values():
            manager.close()


def test_other_column_shapes(shards: Topology, make_queue: Callable[..., str], legacy_dsn: str) -> None:
    """A constant tenant, payload made of columns, a naive run-at with its zone, a dedup column, text JSON."""
    make_queue("orders")
    with psycopg.connect(legacy_dsn, autocommit=True) as c:
        c.execute(
            "CREATE TABLE tasks (task_id uuid PRIMARY KEY DEFAULT gen_random_uuid(), kind text, n integer, "
            "due timestamp, ref text, body text, done_at timestamptz)"
        )
        c.execute(
            "INSERT INTO tasks (kind, n, due, ref, body) VALUES "
            "('mail', 1, '2025-06-01 12:00', 'r1', '{\"a\": 1}'), ('mail', 2, '2025-06-01 12:00', 'r1', '[]'), "
            "('sms', 3, NULL, NULL, 'not json'), ('sms', 4, NULL, 'r4', '4')"
        )
    shaped = AdoptMapping.build(
        "public.tasks",
        id_col="task_id",
        payload_cols=["kind", "n"],
        tenant="acme",
        run_at_col="due",
        run_at_timezone="Europe/Paris",
        dedup_col="ref",
        filter_null=["done_at"],
        marks=[("done_at", "now")],
    )
    report = adopt(shards, "orders", legacy_dsn, shaped)
    assert (report.moved, report.adopted, report.deduplicated) == (4, 3, 1)  # r1 twice: one event
    shard = shards.shard_for("acme")
    with psycopg.connect(shard.dsn) as c:
        rows = c.execute("SELECT payload, fire_at, dedup_key FROM orders ORDER BY payload->>'n'").fetchall()
    # rows 1 and 2 share dedup key r1: whichever came first (uuid order) is the event
    assert rows[0][0] in ({"kind": "mail", "n": 1}, {"kind": "mail", "n": 2})
    assert [r[0] for r in rows[1:]] == [{"kind": "sms", "n": 3}, {"kind": "sms", "n": 4}]
    assert rows[0][1].isoformat() == "2025-06-01T10:00:00+00:00"  # 12:00 in Paris, summer time
    assert [r[2] for r in rows] == ["r1", None, "r4"]
    with psycopg.connect(legacy_dsn) as c:
        assert c.execute("SELECT count(*) FROM tasks WHERE done_at IS NULL").fetchone() == (0,)

    text = AdoptMapping.build("tasks", id_col="task_id", payload_col="body", tenant="acme")
    with psycopg.connect(legacy_dsn, autocommit=True) as c:
        c.execute("UPDATE tasks SET done_at = NULL")
    report = adopt(shards, "orders", legacy_dsn, text, AdoptOptions(bad_rows="leave", name="bodies"))
    assert [r.reason for r in report.rejected] == ["payload is not JSON"]
    assert report.adopted == 3


def test_the_cli(
    shards: Topology,
    make_queue: Callable[..., str],
    legacy_dsn: str,
    tmp_path: Path,
    topo_file: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    make_queue("orders")
    with psycopg.connect(legacy_dsn, autocommit=True) as c:
        write_jobs(c, range(50))
        c.execute("UPDATE jobs SET customer = NULL WHERE id = 7")
    base = [*adopt_argv(topo_file, legacy_dsn), "--run-at-col", "run_at"]

    assert main([*base, "--check"]) == 1
    out = capsys.readouterr().out
    assert "jobs: 50 row(s), 50 pending, 1 the queue would refuse" in out
    assert "1 tenant is NULL or empty" in out and "e.g. 7: tenant is NULL or empty" in out

    assert main(base) == 2
    assert "qm: error: 1 of the 50 pending row(s) of public.jobs would be refused" in capsys.readouterr().err

    assert main([*base, "--tenant", "x"]) == 2
    assert "exactly one of --tenant-col COLUMN and --tenant VALUE" in capsys.readouterr().err

    rejects = tmp_path / "rejects.jsonl"
    assert main([*base, "--bad-rows", "leave", "--rejects", str(rejects), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert (report["adopted"], report["left_pending"], report["ended"]) == (49, 1, "drained")
    assert [json.loads(line)["legacy_id"] for line in rejects.read_text().splitlines()] == ["7"]

    with psycopg.connect(legacy_dsn, autocommit=True) as c:
        c.execute("UPDATE jobs SET customer = 'tenant-6'")  # row 7 is legacy number 6
    assert main([*base, "--name", "second"]) == 0
    assert "adopt second: drained: 1 event(s) adopted into orders" in capsys.readouterr().out
    assert_exactly_once(shards, legacy_dsn, set(range(50)))

    # --from-shard: the legacy table in a shard's database
    with psycopg.connect(shards.shards[1].dsn, autocommit=True) as c:
        c.execute(JOBS)
        write_jobs(c, range(50, 60))
    from_shard = ["--from-shard", "s1", *base[base.index("--table") :]]
    assert main([*base[: base.index("--from")], *from_shard]) == 0
    assert "10 event(s) adopted into orders" in capsys.readouterr().out
    assert sorted(e["n"] for e in queued(shards)) == list(range(60))


def test_sigterm_stops_a_follow_run_after_its_slice(
    shards: Topology, make_queue: Callable[..., str], legacy_dsn: str, topo_file: Path
) -> None:
    """A graceful stop leaves nothing in between: no outbox row, no ledger row."""
    make_queue("orders")
    write_jobs(legacy_dsn, range(3000))
    command = [*QM, *adopt_argv(topo_file, legacy_dsn)]
    proc = _spawn([*command, "--slice", "10", "--follow", "--progress", "0"])
    try:
        assert _wait_line(proc, 60).startswith("adopt ")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=10)  # stops within a slice, not after the table is drained
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "SIGTERM: stopping after this slice" in err
    assert ": stopped: " in out
    left = legacy_count(legacy_dsn)
    assert 0 < left < 3000
    assert outbox_size(legacy_dsn) == 0 and ledger_size(shards) == 0
    events = queued(shards)
    assert len(events) == len({e["n"] for e in events}) == 3000 - left
