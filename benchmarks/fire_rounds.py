"""Scheduled fires in rounds: how late each event reaches its receiver, with maintenance slices due
and a standby reading the lease (the issue "Scheduled events, once in a while, fire 200 ms late").

Prints one JSON object on stdout (logs go to stderr). Each round: ``--events`` events (300) whose
fire_at is 0.5 to 5 s ahead (``--ahead``), inserted in ``--txns`` transactions (10, COPY each), on a
one-shard queue (16 partitions, shuffle 4); one receiver (the bare benchmark client, credit
``--credit``, 1 000) on the leader; lateness = the receiver's handler start - fire_at (every
process shares the host's clock). The round ends when every event has been received.

Maintenance is due throughout: the queue keeps acked events for 1 s (``retention_seconds``) and the
managers run the retention purge's baseline pass every second and the reconciliation's every 5 s
(``--purge-interval``, ``--reconcile-interval``), so the events of the rounds before are being
deleted by retention slices (the dispatcher's idle moments and the baseline passes) while this
round's fall due, beside the collector, the health reading and the leader's vacuums. A standby
manager (``--no-standby`` to leave it out) reads the lease meanwhile.

The managers are ``qm manager`` processes of the code measured. With ``--other DIR`` (another
checkout with its own ``.venv``, e.g. of ``main``), the same rounds run on that code's managers too,
in a database of its own on the same server set up by that code, alternated with ours round by
round: both pairs of managers run all the time, so both see the same machine.

Reported per code: each round's p50/p99/max and count over 20 ms; the pooled p50/p99/max and count
over 20 ms; the median and the worst of the rounds' p99 and max; early receipts (before fire_at)
and missing ones; the WAL segments each round crossed (a new segment is created, zero-filled and
flushed by the commit that needs it, which waits meanwhile); and the latest receipts, each with what
the manager's dispatch connection was seen waiting on between the event's fire_at and its receipt
(``pg_stat_activity``, sampled every 5 ms: a WAL flush, a lock, ...); and the leader's own count of
pushes later than 25 and 100 ms after fire_at (``qm_pickup_delay_seconds``): late receipts beside
pushes on time were held up after the push. ``met`` compares our pooled p99 and max with the
targets (5 ms, 20 ms).

    .venv/bin/python -m benchmarks.fire_rounds [--rounds 20] [--events 300] [--txns 10] [--ahead 0.5 5]
                                               [--credit 1000] [--no-standby] [--other DIR] [--dsn URI]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from benchmarks.lib import procs
from benchmarks.lib.fleet import Receivers, make_events, start_receivers
from benchmarks.lib.report import emit, header, summary_ms
from benchmarks.lib.server import QUEUE, bench_server, checkout_database, one_shard_queue, server_info
from queue_manager.domain.topology import KeyRange, Shard, Topology
from queue_manager.local import fleet
from queue_manager.producer import enqueue_batch

logger = logging.getLogger("bench.fire_rounds")

ROOT = Path(__file__).resolve().parents[1]
QUEUE_SETTINGS: dict[str, Any] = {"partitions": 16, "shuffle": 4, "retention_seconds": 1}
P99_TARGET_MS = 5.0
MAX_TARGET_MS = 20.0
#: a receipt later than this counts as late in the report (ms)
LATE_MS = 20.0
#: the dispatch connection's waits are sampled this often (seconds)
SAMPLE_EVERY = 0.005
#: latest receipts reported per code, with what the dispatcher waited on meanwhile
WORST = 8


@dataclass
class Code:
    """One code measured: its checkout, its database, its managers and its receiver."""

    name: str
    checkout: Path
    dsn: str
    managers: list[subprocess.Popen[str]] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)
    receiver: Receivers | None = None
    #: per round: (first id, last id, WAL segments crossed, round start)
    rounds: list[tuple[int, int, int, float]] = field(default_factory=list)
    received: int = 0

    @property
    def python(self) -> str:
        return str(self.checkout / ".venv" / "bin" / "python")

    @property
    def database(self) -> str:
        return str(psycopg.conninfo.conninfo_to_dict(self.dsn)["dbname"])


def start_managers(code: Code, workdir: Path, count: int, purge: float, reconcile: float) -> None:
    """``count`` ``qm manager`` processes of the code's checkout on its database; waits for a leader."""
    shard = Shard("s0", code.dsn, KeyRange.parse("-"))
    topo = workdir / f"topology-{code.name}.toml"
    topo.write_text(Topology((shard,)).to_toml())
    tokens = workdir / "tokens.toml"
    fleet.write_tokens(tokens, [fleet.Token("bench", procs.SECRET, (QUEUE,))])
    for i in range(count):
        log = (workdir / f"manager-{code.name}-{i}.log").open("ab")
        p = subprocess.Popen(
            [
                code.python,
                "-m",
                "queue_manager.cli.main",
                *fleet.manager_argv(topo, "s0", tokens, purge_interval=purge, reconcile_interval=reconcile),
            ],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            cwd=code.checkout,
        )
        assert p.stdout is not None
        line = p.stdout.readline()
        match = re.search(r"ws://127\.0\.0\.1:(\d+)/", line)
        if match is None:
            raise RuntimeError(f"{code.name}: unexpected first line from qm manager: {line!r} (see {log.name})")
        code.managers.append(p)
        code.urls.append(f"ws://127.0.0.1:{match.group(1)}/")


def leader_url(code: Code, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for url in code.urls:
            probe = url.replace("ws://", "http://") + "health/leader"
            with contextlib.suppress(urllib.error.URLError, OSError), urllib.request.urlopen(probe, timeout=1) as r:
                if r.status == 200:
                    return url
        time.sleep(0.05)
    raise RuntimeError(f"{code.name}: no manager led within {timeout} s")


def pushes(code: Code) -> dict[str, int] | None:
    """The manager's own view of the same fires, from the leader's ``qm_pickup_delay_seconds`` (fire_at
    to push, by its estimate of the database's clock): how many pushes, and how many later than 25 ms
    and 100 ms (its bucket bounds). Receipts late beside pushes on time were held up after the push
    (the socket, the receiver's process)."""
    try:
        url = leader_url(code, timeout=5).replace("ws://", "http://") + "metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
    except (RuntimeError, urllib.error.URLError, OSError):
        return None
    buckets: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"qm_pickup_delay_seconds_bucket\{(.*)\} (\S+)$", line)
        if m and f'queue="{QUEUE}"' in m.group(1):
            le = re.search(r'le="([^"]+)"', m.group(1))
            if le:
                buckets[le.group(1)] = float(m.group(2))
    total = buckets.get("+Inf")
    if total is None:
        return None
    return {
        "n": int(total),
        "over_25ms": int(total - buckets.get("0.025", total)),
        "over_100ms": int(total - buckets.get("0.1", total)),
    }


def stop_managers(code: Code) -> None:
    for p in code.managers:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in code.managers:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        if p.stdout is not None:
            p.stdout.close()


class WaitSampler:
    """What each code's dispatch connection is waiting on, sampled from pg_stat_activity: (database,
    epoch seconds, wait) for every active statement of a ``qm-manager-work`` connection older than
    5 ms."""

    def __init__(self, admin_dsn: str) -> None:
        self.admin_dsn = admin_dsn
        self.samples: list[tuple[str, float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wait-sampler", daemon=True)

    def __enter__(self) -> WaitSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            while not self._stop.is_set():
                rows = conn.execute(
                    "SELECT datname, extract(epoch FROM clock_timestamp())::float8, "
                    "coalesce(wait_event_type || ':' || wait_event, 'cpu'), left(query, 40) "
                    "FROM pg_stat_activity WHERE application_name LIKE 'qm-manager-work%' AND state = 'active' "
                    "AND clock_timestamp() - query_start > interval '5 ms'"
                ).fetchall()
                for db, at, wait, query in rows:
                    self.samples.append((str(db), float(at), f"{wait} in {' '.join(str(query).split())}"))
                time.sleep(SAMPLE_EVERY)

    def during(self, database: str, start: float, end: float) -> dict[str, int]:
        """The waits sampled for ``database`` from ``start`` to ``end`` (counts of 5 ms samples)."""
        return dict(Counter(w for db, at, w in self.samples if db == database and start <= at <= end))


def wal_segment_bytes(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT setting::bigint FROM pg_settings WHERE name = 'wal_segment_size'").fetchone()
    return int(row[0]) if row else 16 << 20


def wal_lsn(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint").fetchone()
    return int(row[0]) if row else 0


def last_id(conn: psycopg.Connection[Any]) -> int:
    """The last id the queue's id sequence gave out (0: none yet)."""
    seq = conn.execute("SELECT pg_get_serial_sequence(%s, 'id')", (QUEUE,)).fetchone()
    assert seq is not None and seq[0] is not None, f"{QUEUE} has no id sequence"
    row = conn.execute(
        sql.SQL("SELECT last_value, is_called FROM {}").format(sql.Identifier(*seq[0].split(".")))
    ).fetchone()
    conn.commit()
    return int(row[0]) if row and row[1] else 0


def run_round(code: Code, n: int, txns: int, ahead: tuple[float, float], rng: random.Random, seg: int) -> None:
    """Insert one round's events and wait until the receiver has them all (or the deadline)."""
    started = time.time()
    lsn0 = wal_lsn(code.dsn)
    per_txn = [n // txns + (1 if i < n % txns else 0) for i in range(txns)]
    with psycopg.connect(code.dsn) as conn:
        # ids from the queue's sequence: retention deletes the rows of the rounds before meanwhile
        first = last_id(conn) + 1
        for k in per_txn:
            now = time.time()
            fire_at = [datetime.fromtimestamp(now + rng.uniform(*ahead), UTC) for _ in range(k)]
            enqueue_batch(conn, QUEUE, make_events(k, rng.randrange(1 << 30), fire_at))
            conn.commit()
        last = last_id(conn)
    code.received += n
    assert code.receiver is not None
    deadline = time.monotonic() + ahead[1] + 15
    while code.receiver.handled_total() < code.received and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)  # the last acks commit
    code.rounds.append((first, last, wal_lsn(code.dsn) // seg - lsn0 // seg, started))


def summarize(code: Code, records: list[tuple[int, float, float, int]], sampler: WaitSampler) -> dict[str, Any]:
    first_receipt: dict[int, tuple[float, float]] = {}
    for ident, fire_at, t, _attempt in records:
        if ident not in first_receipt:
            first_receipt[ident] = (fire_at, t)
    rounds = []
    pooled: list[float] = []
    worst: list[tuple[float, int, float, float, int]] = []
    for i, (first, last, segments, _started) in enumerate(code.rounds):
        late = []
        for ident in range(first, last + 1):
            if ident in first_receipt:
                f, t = first_receipt[ident]
                late.append((t - f, ident, f, t))
        values = [x[0] for x in late]
        pooled.extend(values)
        worst.extend((lt, ident, f, t, i) for lt, ident, f, t in late)
        s = summary_ms(values)
        rounds.append(
            {
                "round": i,
                "n": s.get("n", 0),
                "missing": last - first + 1 - len(values),
                "early": sum(1 for v in values if v < 0),
                "p50_ms": s.get("p50_ms"),
                "p99_ms": s.get("p99_ms"),
                "max_ms": s.get("max_ms"),
                f"over_{LATE_MS:g}ms": sum(1 for v in values if v * 1000 > LATE_MS),
                "wal_segments_crossed": segments,
            }
        )
    worst.sort(reverse=True)
    pooled_s = summary_ms(pooled)
    p99s = [r["p99_ms"] for r in rounds if r["p99_ms"] is not None]
    maxes = [r["max_ms"] for r in rounds if r["max_ms"] is not None]
    return {
        "pooled": {
            "n": pooled_s.get("n", 0),
            "p50_ms": pooled_s.get("p50_ms"),
            "p99_ms": pooled_s.get("p99_ms"),
            "max_ms": pooled_s.get("max_ms"),
            f"over_{LATE_MS:g}ms": sum(1 for v in pooled if v * 1000 > LATE_MS),
            "early": sum(1 for v in pooled if v < 0),
            "missing": sum(r["missing"] for r in rounds),
        },
        "round_p99_ms": {"median": statistics.median(p99s), "max": max(p99s)} if p99s else None,
        "round_max_ms": {"median": statistics.median(maxes), "max": max(maxes)} if maxes else None,
        "rounds_with_a_new_wal_segment": sum(1 for r in rounds if r["wal_segments_crossed"]),
        "latest": [
            {
                "round": i,
                "id": ident,
                "late_ms": round(lt * 1000, 2),
                "dispatcher_waits": sampler.during(code.database, f, t),
                "round_crossed_wal_segments": rounds[i]["wal_segments_crossed"],
            }
            for lt, ident, f, t, i in worst[:WORST]
        ],
        "rounds": rounds,
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks.fire_rounds", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=20, help="rounds per code (default 20)")
    p.add_argument("--events", type=int, default=300, help="events per round (default 300)")
    p.add_argument("--txns", type=int, default=10, help="transactions per round (default 10)")
    p.add_argument("--ahead", type=float, nargs=2, default=(0.5, 5.0), metavar=("MIN", "MAX"), help="fire_at ahead, s")
    p.add_argument("--credit", type=int, default=1000, help="the receiver's credit (default 1000)")
    p.add_argument("--standby", action=argparse.BooleanOptionalAction, default=True, help="run a standby too")
    p.add_argument("--purge-interval", type=float, default=1.0, help="managers' retention pass period, s")
    p.add_argument("--reconcile-interval", type=float, default=5.0, help="managers' reconciliation pass period, s")
    p.add_argument("--other", type=Path, help="another checkout (with its own .venv) alternated with this one")
    p.add_argument("--dsn", help="an administrative DSN of an existing server (default: an embedded one)")
    p.add_argument("--seed", type=int, default=36)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.events < 1 or not 1 <= args.txns <= args.events or args.credit < 1:
        p.error("--rounds, --events and --credit must be at least 1, --txns from 1 to --events")
    if not 0 < args.ahead[0] <= args.ahead[1]:
        p.error("--ahead MIN MAX: 0 < MIN <= MAX")
    if args.other is not None and not (args.other / ".venv" / "bin" / "python").exists():
        p.error(f"--other {args.other}: no .venv/bin/python there")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    report: dict[str, Any] = header("fire_rounds")
    report["config"] = {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("dsn",)
    } | {"queue": QUEUE_SETTINGS}
    with contextlib.ExitStack() as stack:
        admin_dsn, ours_dsn = stack.enter_context(bench_server(args.dsn, "fire-rounds"))
        report["server"] = server_info(ours_dsn)
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="qm-fire-rounds-")))
        one_shard_queue(ours_dsn, QUEUE, QUEUE_SETTINGS)
        codes = [Code("ours", ROOT, ours_dsn)]
        if args.other is not None:
            other_dsn = checkout_database(args.other, admin_dsn, "qm_fire_rounds_other", QUEUE, QUEUE_SETTINGS)
            stack.callback(_drop, admin_dsn, "qm_fire_rounds_other")
            codes.append(Code("other", args.other.resolve(), other_dsn))
        seg = wal_segment_bytes(admin_dsn)
        for code in codes:
            stack.callback(stop_managers, code)
            start_managers(code, workdir, 2 if args.standby else 1, args.purge_interval, args.reconcile_interval)
            code.receiver = start_receivers(1, leader_url(code), "fire", args.credit, args.credit)
        for code in codes:
            assert code.receiver is not None
            code.receiver.wait_ready()
            code.receiver.go.set()
        rng = random.Random(args.seed)
        sampler = stack.enter_context(WaitSampler(admin_dsn))
        for r in range(args.rounds):
            for code in codes:
                run_round(code, args.events, args.txns, tuple(args.ahead), rng, seg)
                logger.info(
                    "%s round %d done (%d received)",
                    code.name,
                    r + 1,
                    code.receiver.handled_total() if code.receiver else 0,
                )
        manager_view = {code.name: pushes(code) for code in codes}
        for code in codes:
            assert code.receiver is not None
            results = code.receiver.finish()
            records = [(int(x[0]), float(x[1]), float(x[2]), int(x[3])) for res in results for x in res["records"]]
            report[code.name] = summarize(code, records, sampler) | {"manager_pushes": manager_view[code.name]}
    ours = report["ours"]["pooled"]
    report["met"] = {
        "p99_under_5ms": ours["p99_ms"] is not None and ours["p99_ms"] < P99_TARGET_MS,
        "max_under_20ms": ours["max_ms"] is not None and ours["max_ms"] < MAX_TARGET_MS,
        "nothing_early_or_missing": ours["early"] == 0 and ours["missing"] == 0,
    }
    emit(report)
    return 0


def _drop(admin_dsn: str, name: str) -> None:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


if __name__ == "__main__":
    sys.exit(main())
