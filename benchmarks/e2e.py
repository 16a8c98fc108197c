"""End to end on one shard: backlog drain, commit-to-receipt latency, fire accuracy, and the peers.

Prints one JSON object on stdout (logs go to stderr). One shard (one database), one queue
(``bench_q``, 16 partitions, shuffle 4, other settings default), no-op receivers:

* **drain**: ``--events`` events preloaded untimed (``producer.enqueue_batch``, then ANALYZE and
  CHECKPOINT); a manager process leads and idles; the clock starts when the receiver processes are
  told to start (they connect, subscribe and ack) and stops when the receivers have been told that
  every event's ack is committed (``ack_result``; the manager answers only after the commit). The
  database is checked afterwards: every event ``acked`` (or deleted by its ack, in a queue with
  ``--queue-set retention_seconds=0``). Events/s for each configuration (receiver processes x
  credit), each the median of ``--reps``; per drained event, the CPU microseconds of PostgreSQL,
  the manager and the receivers (``per_event``) and the WAL bytes (``pg_current_wal_insert_lsn``
  before and after), and what that WAL holds by record type, full-page images apart
  (``wal_records``, from ``pg_walinspect``). With ``--other DIR`` (a checkout of another commit with
  its own ``.venv``), each drain run of ours alternates with one of that checkout's, set up and run
  by its own code in a database of its own on the same server (``drain.other``);
* **latency**: commit -> receipt. A producer process inserts one event per transaction (autocommit
  INSERT) with open-loop pacing at 200 and at 2,000 events/s; the payload carries the sequence number
  and the call's start time. Latency = the receiver's handler start minus the moment the producer's
  commit returned (all processes on one machine share ``time.time()``). Warm-up events are not counted;
  p50/p99/max are medians over ``--reps``;
* **fire accuracy**: events with ``fire_at`` in the future (spread evenly over a few seconds) are
  inserted ahead of time; lateness = the receiver's handler start minus ``fire_at``. Early receipts
  (negative lateness) are counted: the manager promises never to fire early;
* **receiver library** (``--library``, on by default): the drain (the bare receiver's best
  configuration; the library gets as many handler slots as that configuration's credit) and the
  200/s latency again, with :class:`receivers.Receiver` and with the bare receiver, alternated;
* **tracing** (``--tracing``; ``--tracing-only`` runs only the drain and this): the receiver
  library's drain with OpenTelemetry off and on, alternated. Off: events without a trace context,
  no OpenTelemetry in any process (today's path). On: every event has a traceparent; the receivers
  make a ``process`` and a settle span per event and the manager a span for ``--trace-sample`` of
  its fire and ack batches, into the SDK's batch span processor with an exporter that drops the
  spans (no network is measured). Reported: each side's drain and the cost per event (the
  difference of the medians' seconds per event);
* **peers** (``--peers``, on by default for a full run): PgQueuer and Procrastinate measured the
  same way (``benchmarks/peers``: drain and latency), in their best configurations, on the same
  PostgreSQL server, in their own virtualenv ``.venv-peers/`` (``make bench-peers-setup``; see
  ``benchmarks.lib.peers``). The report gives our drain / the faster
  peer's best drain (target >= 3), our latency p50 and p99 at 200/s / the faster peer's
  (target <= 1.0) and our fire lateness p99 (target < 5 ms), with its worst receipt over the reps and
  the count of receipts later than 20 ms (a p99 alone hides a rare stall).

Also reported: what a drained event costs (``comparison.cost_per_event``): ours (the best
configuration) beside each peer configuration of the same run, PostgreSQL CPU microseconds, WAL
bytes and WAL commit records per event, and the client side's CPU (our manager and receivers, the
peer's workers), with the targets PostgreSQL CPU at most a third of PgQueuer's and WAL under 600 B.
Also reported: events lost or stuck (``met.nothing_lost``), the manager's database calls during
each run (count, ms per call, items per call: ``manager_db_calls``), CPU per process group in % of
one core including ``rest_of_machine`` (other work on a shared machine; for the peers too),
``manager_stop_hangs`` (managers whose ``run()`` did not return within 5 s of ``request_stop()``:
their process is ended so the run goes on), and with ``--profile`` one extra drain under cProfile
(top functions on stderr and in ``profile``).

Processes: the manager runs in its own process, each receiver in its own process, the producer in
its own process (``multiprocessing`` spawn; entry points in ``benchmarks/lib/procs.py``). Unless
``--dsn`` is given, the run starts its own embedded PostgreSQL server with the default durability
(fsync and synchronous_commit on) in a temporary directory and stops it at the end; with ``--dsn``
(an administrative database of an existing server) it creates a throw-away database there.

    .venv/bin/python -m benchmarks.e2e [--quick] [--events 100000] [--reps 3] [--receivers 1,2]
                                      [--credit 1000,4000] [--no-peers] [--profile] [--dsn URI] [--json-only]
                                      [--queue-set FIELD=JSON] [--other DIR] [--drain-only]
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import pstats
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from benchmarks.lib import fleet
from benchmarks.lib.backlog import event_rows, preload, reset, state_counts
from benchmarks.lib.fleet import make_events, manager_process, start_producer, start_receivers
from benchmarks.lib.machine import code_version, count_server, cpu_delta, cpu_snapshot
from benchmarks.lib.peers import bench_peers, peers_python
from benchmarks.lib.report import emit, header, median_of, ratio, summary_ms
from benchmarks.lib.server import QUEUE, bench_server, checkout_database, one_shard_queue, server_info
from benchmarks.lib.timings import first_receipts, latencies
from benchmarks.lib.wal import wal_cost
from queue_manager.producer import Event, enqueue_batch

logger = logging.getLogger("bench.e2e")

QUEUE_SETTINGS: dict[str, Any] = {"partitions": 16, "shuffle": 4}
DRAIN_TARGET = 3.0  # our drain / the faster peer's best drain
PG_CPU_VS_PGQUEUER_MAX = 1 / 3  # our PostgreSQL CPU per drained event / PgQueuer's
WAL_BYTES_MAX = 600.0  # our WAL bytes per drained event
LATENCY_TARGET = 1.0  # our p50 and p99 at 200/s / the faster peer's: no worse
FIRE_P99_TARGET_MS = 5.0
FIRE_MAX_TARGET_MS = 20.0
LATENCY_WARMUP = 20  # per 200 events/s; scaled with the rate
FIRE_LEAD_S = 3.0  # the first fire_at is this far after the insert
LATENCY_CREDIT = 100  # the receiver's default credit, for latency and fire accuracy
STALL_TIMEOUT = 30.0  # a drain whose ack count does not move for this long is reported as timed out
#: ManagerConfig fields set by --manager-set for every manager of the run
MANAGER_OVERRIDES: dict[str, Any] = {}


def log(msg: str, *args: Any) -> None:
    logger.info(msg, *args)


# --------------------------------------------------------------------------- drain


@dataclass
class DrainConfig:
    receivers: int
    credit: int
    concurrency: int

    @property
    def label(self) -> str:
        return f"r{self.receivers}_c{self.credit}_w{self.concurrency}"


class WalMeter:
    """The WAL the server writes from its creation on (pg_current_wal_insert_lsn), on a connection
    opened before the measured interval; :meth:`stop` gives the bytes and the interval."""

    def __init__(self, dsn: str) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.start = self._lsn()

    def _lsn(self) -> str:
        row = self.conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
        assert row is not None
        return str(row[0])

    def stop(self) -> tuple[int, str, str]:
        end = self._lsn()
        row = self.conn.execute("SELECT pg_wal_lsn_diff(%s::pg_lsn, %s::pg_lsn)::bigint", (end, self.start)).fetchone()
        self.conn.close()
        assert row is not None
        return int(row[0]), self.start, end


def wal_records(dsn: str, start: str, end: str, n: int, top: int = 8) -> dict[str, Any] | None:
    """What the WAL between two positions holds, per record type (pg_walinspect): bytes per event of
    the records and of their full-page images, and records per event, for the ``top`` largest; None
    when the extension is not available or the WAL is already gone."""
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
            rows = conn.execute(
                'SELECT "resource_manager/record_type", count, record_size, fpi_size, combined_size '
                "FROM pg_get_wal_stats(%s::pg_lsn, %s::pg_lsn, true) ORDER BY combined_size DESC",
                (start, end),
            ).fetchall()
    except psycopg.Error as exc:
        logger.warning("WAL records not read: %s", str(exc).strip()[:200])
        return None
    fpi = sum(int(r[3]) for r in rows)
    return {
        "fpi_bytes_per_event": round(fpi / n, 1),
        "records_per_event": round(sum(int(r[1]) for r in rows) / n, 2),
        "top": {
            str(r[0]): {
                "records_per_event": round(int(r[1]) / n, 3),
                "record_bytes_per_event": round(int(r[2]) / n, 1),
                "fpi_bytes_per_event": round(int(r[3]) / n, 1),
            }
            for r in rows[:top]
            if int(r[4]) > 0
        },
    }


def per_event(
    cpu: dict[str, float], wall: float, wal_bytes: int | None, n: int, commits: int | None = None
) -> dict[str, float | None]:
    """CPU microseconds per drained event of each process group (from % of one core over ``wall``
    seconds), the WAL bytes and the WAL's commit records per event."""
    out: dict[str, float | None] = {
        f"{k}_cpu_us": round(v / 100 * wall / n * 1e6, 2)
        for k, v in cpu.items()
        if k in ("postgres", "manager", "receivers")
    }
    out["wal_bytes"] = None if wal_bytes is None else round(wal_bytes / n, 1)
    out["commits"] = None if commits is None else round(commits / n, 3)
    return out


def run_drain(
    dsn: str,
    cfg: DrainConfig,
    events: list[Event],
    profile_dir: str | None = None,
    library: bool = False,
    trace_sample: float | None = None,
) -> dict[str, Any]:
    """``trace_sample`` (with ``library``): tracing on: the manager's spans at this sample rate and
    the receivers' spans, each process with the SDK (an exporter that drops the spans)."""
    n = len(events)
    logger.debug("drain %s: reset", cfg.label)
    reset(dsn)
    logger.debug("drain %s: preload", cfg.label)
    load_s = preload(dsn, events)
    logger.debug("drain %s: manager", cfg.label)
    budget = max(120.0, n / 500)
    mprof = str(Path(profile_dir) / "manager.prof") if profile_dir else None
    tracing = trace_sample is not None
    overrides = {**MANAGER_OVERRIDES, "trace_sample": trace_sample} if tracing else MANAGER_OVERRIDES
    with manager_process(dsn, overrides, mprof) as m:
        logger.debug("drain %s: receivers", cfg.label)
        recv = start_receivers(
            cfg.receivers, m.url, "drain", cfg.credit, cfg.concurrency, profile_dir, library, tracing=tracing
        )
        try:
            recv.wait_ready()
            logger.debug("drain %s: go", cfg.label)
            time.sleep(0.2)  # every receiver waits on go
            groups = {"manager": [int(m.proc.pid)], "receivers": recv.pids()}
            wal = WalMeter(dsn)
            snap0 = cpu_snapshot()
            m.reset_ev.set()
            t0 = time.time()
            recv.go.set()
            deadline = time.monotonic() + budget
            timed_out = False
            last_count, last_move = 0, time.monotonic()
            while (count := recv.acked_total()) < n:
                now = time.monotonic()
                if count != last_count:
                    last_count, last_move = count, now
                if now > deadline or now - last_move > STALL_TIMEOUT:
                    timed_out = True
                    logger.warning("drain %s: stopped waiting at %d of %d acks", cfg.label, count, n)
                    break
                time.sleep(0.002)
            t_seen = time.time()
            snap1 = cpu_snapshot()
            wal_bytes, wal_start, wal_end = wal.stop()
            t_end = max(float(v.value) for v in recv.last_ack) if not timed_out else t_seen
            logger.debug("drain %s: done", cfg.label)
        finally:
            results = recv.finish()
        logger.debug("drain %s: receivers stopped", cfg.label)
    logger.debug("drain %s: manager stopped", cfg.label)
    counts = state_counts(dsn)
    # acked rows, and the rows an ack deleted (a queue without retention): nothing else deletes
    # during a drain (no failed events, and retention keeps acked ones for longer than a run)
    acked_db = counts["states"].get("acked", 0) + n - sum(counts["states"].values())
    elapsed = t_end - t0
    cpu = cpu_delta(snap0, snap1, groups)
    out = {
        "config": cfg.label,
        "events": n,
        "elapsed_s": round(elapsed, 3),
        "events_per_s": round(acked_db / elapsed, 1),
        "timed_out": timed_out,
        "acked_in_db": acked_db,
        "db_states": counts["states"],
        "refired_in_db": counts["refired"],
        "delivered": sum(r.get("delivered", 0) for r in results),
        "acked_reported": sum(r.get("acked", 0) for r in results),
        "receiver_errors": sum(r.get("error_count", 0) for r in results),
        "preload_s": round(load_s, 3),
        "cpu_pct_of_one_core": cpu,
        "per_event": per_event(cpu, snap1.at - snap0.at, wal_bytes, n, wal_cost(dsn, wal_start, wal_end)["commits"]),
        "wal_records": wal_records(dsn, wal_start, wal_end, n),
        "manager_db_calls": m.counters(),
    }
    if acked_db != n or timed_out:
        logger.warning(
            "drain %s: %d of %d events acked in the database (timed out: %s)", cfg.label, acked_db, n, timed_out
        )
    return out


#: one drain of the other checkout, by its own benchmarks.e2e.run_drain (the module layout of
#: 8b05774 or of later commits), with the WAL position read beside its two CPU snapshots; prints
#: the run's JSON on the last line of stdout
OTHER_DRAIN = """
import json, sys
import psycopg
from benchmarks import e2e
dsn, receivers, credit, concurrency, n = sys.argv[1], *map(int, sys.argv[2:6])
try:
    from benchmarks.lib.machine import count_server
    from benchmarks.lib.fleet import make_events
    count_server(dsn)
except ImportError:
    make_events = e2e.make_events
    e2e.POSTMASTER = e2e.find_postmaster(dsn)
conn = psycopg.connect(dsn, autocommit=True)
marks = []
snapshot = e2e.cpu_snapshot
def marked():
    snap = snapshot()
    marks.append((conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0], snap.at))
    return snap
e2e.cpu_snapshot = marked
r = e2e.run_drain(dsn, e2e.DrainConfig(receivers, credit, concurrency), make_events(n, 4242))
(end, t1), (start, t0) = marks[-1], marks[-2]
r["wal_bytes"] = int(conn.execute("SELECT pg_wal_lsn_diff(%s::pg_lsn, %s::pg_lsn)::bigint", (end, start)).fetchone()[0])
r["wal_interval"] = [start, end]
r["snapshot_wall_s"] = t1 - t0
print(json.dumps(r))
"""


@dataclass
class Other:
    """Another checkout of this repository whose drain runs beside ours, alternated (``--other``)."""

    checkout: Path
    dsn: str

    @property
    def python(self) -> str:
        return str(self.checkout / ".venv" / "bin" / "python")

    @classmethod
    def set_up(cls, checkout: Path, admin_dsn: str, settings: dict[str, Any]) -> Other:
        return cls(checkout, checkout_database(checkout, admin_dsn, "qm_e2e_other", QUEUE, settings))

    def drop(self, admin_dsn: str) -> None:
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                    sql.Identifier(str(conninfo_to_dict(self.dsn)["dbname"]))
                )
            )

    def drain(self, cfg: DrainConfig, n: int) -> dict[str, Any]:
        args = [str(v) for v in (cfg.receivers, cfg.credit, cfg.concurrency, n)]
        done = subprocess.run(
            [self.python, "-c", OTHER_DRAIN, self.dsn, *args],
            cwd=self.checkout,
            check=True,
            stdout=subprocess.PIPE,
            text=True,
            timeout=max(300.0, n / 200),
        )
        r: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        # its acked rows and those it deleted (the same count as run_drain's)
        counts = state_counts(self.dsn)
        r["acked_in_db"] = counts["states"].get("acked", 0) + n - sum(counts["states"].values())
        r["db_states"] = counts["states"]
        r["events_per_s"] = round(r["acked_in_db"] / r["elapsed_s"], 1)
        interval = r.pop("wal_interval")
        commits = wal_cost(self.dsn, *interval)["commits"]
        r["per_event"] = per_event(r["cpu_pct_of_one_core"], r.pop("snapshot_wall_s"), r.pop("wal_bytes"), n, commits)
        r["wal_records"] = wal_records(self.dsn, *interval, n)
        return r


def _drain_summary(cfg: DrainConfig, samples: list[dict[str, Any]], n: int) -> dict[str, Any]:
    med = statistics.median(s["events_per_s"] for s in samples)
    mid = min(samples, key=lambda s: abs(s["events_per_s"] - med))
    costs = {
        k: round(statistics.median(s["per_event"][k] for s in samples if s["per_event"].get(k) is not None), 2)
        for k in samples[0]["per_event"]
        if any(s["per_event"].get(k) is not None for s in samples)
    }
    return {
        "receivers": cfg.receivers,
        "credit": cfg.credit,
        "concurrency": cfg.concurrency,
        "events_per_s": round(med, 1),
        "samples": [s["events_per_s"] for s in samples],
        "per_event_median": costs,
        "per_event_samples": [s["per_event"] for s in samples],
        "all_acked": all(s["acked_in_db"] == n and not s["timed_out"] for s in samples),
        "refired": sum(s.get("refired_in_db", 0) for s in samples),
        "median_run": mid,
    }


def bench_drain(
    dsn: str,
    configs: list[DrainConfig],
    n: int,
    reps: int,
    other: Other | None = None,
    priorities: Sequence[int] = (),
) -> dict[str, Any]:
    """Each configuration ``reps`` times; with ``other``, each run of ours beside one of the other
    checkout, which goes first in every second pair. ``priorities``: our events take them in turn
    (none: the queue's default)."""
    events = make_events(n, 4242)
    if priorities:
        events = [replace(ev, priority=priorities[i % len(priorities)]) for i, ev in enumerate(events)]
    tried = []
    tried_other = []
    for cfg in configs:
        samples = []
        others = []
        for rep in range(reps):
            sides = ["ours", "other"] if other is not None else ["ours"]
            if rep % 2:
                sides.reverse()
            for side in sides:
                if side == "ours":
                    r = run_drain(dsn, cfg, events)
                    samples.append(r)
                else:
                    assert other is not None
                    r = other.drain(cfg, n)
                    others.append(r)
                log(
                    "drain %s %s rep=%d %9.1f events/s in %.2f s (cpu %s, per event %s; load %s)",
                    side,
                    cfg.label,
                    rep + 1,
                    r["events_per_s"],
                    r["elapsed_s"],
                    r["cpu_pct_of_one_core"],
                    r["per_event"],
                    " ".join(f"{x:.2f}" for x in os.getloadavg()),
                )
        tried.append(_drain_summary(cfg, samples, n))
        if others:
            tried_other.append(_drain_summary(cfg, others, n))
    best = max(tried, key=lambda t: t["events_per_s"])
    keys = ("receivers", "credit", "concurrency", "events_per_s", "samples", "per_event_median")
    out: dict[str, Any] = {
        "events": n,
        "reps": reps,
        "best": {k: best[k] for k in keys},
        "tried": tried,
    }
    if other is not None:
        best_other = max(tried_other, key=lambda t: t["events_per_s"])
        out["other"] = {
            "checkout": str(other.checkout),
            "code": _other_code(other.checkout),
            "best": {k: best_other[k] for k in keys},
            "tried": tried_other,
            "best_ratio": ratio(best["events_per_s"], best_other["events_per_s"]),
        }
    return out


def _other_code(checkout: Path) -> str | None:
    done = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], stdout=subprocess.PIPE, text=True, check=False
    )
    return done.stdout.strip() or None


def profile_drain(dsn: str, cfg: DrainConfig, n: int, top: int = 30) -> dict[str, Any]:
    """One extra, uncounted drain with cProfile in the manager and receiver processes."""
    events = make_events(n, 4242)
    pdir = tempfile.mkdtemp(prefix="qm-e2e-prof-")
    try:
        r = run_drain(dsn, cfg, events, profile_dir=pdir)
        out: dict[str, Any] = {
            "config": cfg.label,
            "events_per_s_with_profiler": r["events_per_s"],
            "elapsed_s": r["elapsed_s"],
        }
        for name in ["manager"] + [f"receiver-{i}" for i in range(cfg.receivers)]:
            path = Path(pdir) / f"{name}.prof"
            if not path.exists():
                continue
            buf = io.StringIO()
            st = pstats.Stats(str(path), stream=buf)
            total = st.total_tt  # type: ignore[attr-defined]
            st.sort_stats("tottime").print_stats(top)
            print(f"\n===== cProfile {name} (drain {cfg.label}, {n} events), by tottime =====", file=sys.stderr)
            print(buf.getvalue(), file=sys.stderr)
            buf = io.StringIO()
            st.stream = buf  # type: ignore[attr-defined]
            st.sort_stats("cumulative").print_stats(top)
            print(f"===== cProfile {name}, by cumulative =====", file=sys.stderr)
            print(buf.getvalue(), file=sys.stderr)
            rows = []
            for (file, line, func), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
                rows.append((tt, ct, nc, f"{Path(file).name}:{line}({func})"))
            rows.sort(reverse=True)
            out[name] = {
                "profiled_seconds": round(total, 3),
                "top_tottime": [
                    {
                        "func": f,
                        "tottime_s": round(tt, 3),
                        "pct": round(100 * tt / total, 1) if total else None,
                        "calls": nc,
                    }
                    for tt, _ct, nc, f in rows[:15]
                ],
            }
        out["manager_db_calls"] = r["manager_db_calls"]
        out["cpu_pct_of_one_core"] = r["cpu_pct_of_one_core"]
        return out
    finally:
        shutil.rmtree(pdir, ignore_errors=True)


# --------------------------------------------------------------------------- latency


def run_latency(dsn: str, n: int, rate: float, conns: int, seed: int, library: bool = False) -> dict[str, Any]:
    warmup = max(LATENCY_WARMUP, int(LATENCY_WARMUP * rate / 200))
    total = n + warmup
    reset(dsn)
    with manager_process(dsn, MANAGER_OVERRIDES) as m:
        recv = start_receivers(1, m.url, "latency", LATENCY_CREDIT, LATENCY_CREDIT, library=library)
        try:
            recv.wait_ready()
            prod = start_producer(dsn, n, rate, recv.go, warmup=warmup, conns=conns, seed=seed, name="e2e-producer")
            prod.wait_ready()
            time.sleep(1.0)  # the manager is idle and armed (waiting for a wake-up)
            m.reset_ev.set()
            recv.go.set()
            logger.debug("latency %g/s: go", rate)
            res = prod.result(timeout=n / rate + 120)
            logger.debug("latency %g/s: producer done", rate)
            deadline = time.monotonic() + 30
            while recv.handled_total() < total and time.monotonic() < deadline:
                time.sleep(0.01)
            logger.debug("latency %g/s: %d of %d received", rate, recv.handled_total(), total)
        finally:
            results = recv.finish()
    logger.debug("latency %g/s: stopped", rate)
    sent: dict[int, tuple[float, float]] = res["sent"]
    first, dup = first_receipts(record for r in results for record in r["records"])
    db_after = state_counts(dsn)  # after the manager stopped
    lost = sorted(set(sent) - set(first))
    lost_rows = event_rows(dsn, "(payload->>'seq')::int = ANY(%s)", lost[:10]) if lost else []
    enq, commit_lat, call_lat = latencies(sent, first)
    return {
        "events": n,
        "warmup_events": warmup,
        "rate_target": rate,
        "rate_achieved": round(total / res["elapsed"], 1),
        "producer_connections": conns,
        "received": len(commit_lat),
        "missing": n - len(commit_lat),
        "duplicates": dup,
        "db_states_at_end": db_after["states"],
        "not_received": lost_rows,
        "commit_to_receipt": summary_ms(commit_lat),
        "manager_db_calls": m.counters(),
        "call_to_receipt": summary_ms(call_lat),
        "enqueue_call": summary_ms(enq),
    }


def traced_events(events: list[Event]) -> list[Event]:
    """The events, each with a trace context of its own (as if each came from a traced request)."""
    return [
        replace(ev, trace_context={"traceparent": f"00-{i + 1:032x}-{i + 1:016x}-01"}) for i, ev in enumerate(events)
    ]


def bench_tracing(dsn: str, cfg: DrainConfig, n: int, reps: int, sample: float) -> dict[str, Any]:
    """The receiver library's drain with tracing off and on, alternated. Off: events without a
    trace context, no OpenTelemetry in any process. On: every event with a traceparent, the
    receivers' process and settle spans and the manager's batch spans (``sample``), into the SDK's
    batch processor (an exporter that drops them). The cost per event is the difference of the
    medians' seconds per event."""
    plain = make_events(n, 4343)
    traced = traced_events(plain)
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for rep in range(reps):
        for kind in ("off", "on"):
            on = kind == "on"
            d = run_drain(dsn, cfg, traced if on else plain, library=True, trace_sample=sample if on else None)
            runs[kind].append(d)
            log("tracing %s rep=%d drain %.1f/s", kind, rep + 1, d["events_per_s"])
    out: dict[str, Any] = {"drain_config": cfg.label, "events": n, "reps": reps, "manager_trace_sample": sample}
    for kind, r in runs.items():
        out[kind] = {
            "drain_events_per_s": round(statistics.median(x["events_per_s"] for x in r), 1),
            "drain_samples": [x["events_per_s"] for x in r],
            "drain_all_acked": all(x["acked_in_db"] == n and not x["timed_out"] for x in r),
            "receiver_cpu_pct": statistics.median(x["cpu_pct_of_one_core"].get("receivers", 0.0) for x in r),
            "manager_cpu_pct": statistics.median(x["cpu_pct_of_one_core"].get("manager", 0.0) for x in r),
        }
    off, on = out["off"]["drain_events_per_s"], out["on"]["drain_events_per_s"]
    out["on_vs_off"] = ratio(on, off)
    out["cost_us_per_event"] = round((1 / on - 1 / off) * 1e6, 2) if on and off else None
    return out


def bench_library(dsn: str, cfg: DrainConfig, n: int, latency_events: int, reps: int) -> dict[str, Any]:
    """The receiver library's Receiver next to the bare benchmark receiver, alternated: the drain
    (``cfg``: the bare receiver's best configuration; the library gets ``cfg.credit`` handler
    slots per process) and commit -> receipt at 200/s."""
    events = make_events(n, 4343)
    runs: dict[str, dict[str, list[Any]]] = {k: {"drain": [], "latency": []} for k in ("bare", "library")}
    for rep in range(reps):
        for kind in ("bare", "library"):
            lib = kind == "library"
            d = run_drain(dsn, cfg, events, library=lib)
            lat = run_latency(dsn, latency_events, 200.0, 1, seed=2000 + rep, library=lib)
            runs[kind]["drain"].append(d)
            runs[kind]["latency"].append(lat)
            c = lat["commit_to_receipt"]
            log(
                "receiver %s rep=%d drain %.1f/s, 200/s p50=%s p99=%s ms",
                kind,
                rep + 1,
                d["events_per_s"],
                c.get("p50_ms"),
                c.get("p99_ms"),
            )
    out: dict[str, Any] = {"drain_config": cfg.label, "events": n, "latency_events": latency_events, "reps": reps}
    for kind, r in runs.items():
        out[kind] = {
            "drain_events_per_s": round(statistics.median(x["events_per_s"] for x in r["drain"]), 1),
            "drain_samples": [x["events_per_s"] for x in r["drain"]],
            "drain_all_acked": all(x["acked_in_db"] == n and not x["timed_out"] for x in r["drain"]),
            "latency_200_p50_ms": statistics.median(x["commit_to_receipt"]["p50_ms"] for x in r["latency"]),
            "latency_200_p99_ms": statistics.median(x["commit_to_receipt"]["p99_ms"] for x in r["latency"]),
            "latency_missing": sum(x["missing"] for x in r["latency"]),
        }
    return out


def bench_latency(dsn: str, plans: list[tuple[float, int, int]], reps: int) -> dict[str, Any]:
    out = {}
    for rate, n, conns in plans:
        samples = []
        for rep in range(reps):
            r = run_latency(dsn, n, rate, conns, seed=1000 + rep)
            samples.append(r)
            c = r["commit_to_receipt"]
            log(
                "latency %g/s rep=%d p50=%s p99=%s max=%s ms (achieved %.1f/s, missing %d)",
                rate,
                rep + 1,
                c.get("p50_ms"),
                c.get("p99_ms"),
                c.get("max_ms"),
                r["rate_achieved"],
                r["missing"],
            )
        lat = [s["commit_to_receipt"] for s in samples]
        out[f"{int(rate)}_per_s"] = {
            "rate": rate,
            "events": n,
            "producer_connections": conns,
            "p50_ms": median_of(lat, "p50_ms"),
            "p99_ms": median_of(lat, "p99_ms"),
            "max_ms": median_of(lat, "max_ms"),
            "rate_achieved": median_of(samples, "rate_achieved"),
            "missing": sum(s["missing"] for s in samples),
            "over_100ms": sum(s["commit_to_receipt"].get("over_100ms", 0) for s in samples),
            "samples": samples,
        }
    return out


# --------------------------------------------------------------------------- fire accuracy


def run_fire(dsn: str, n: int, spread: float, seed: int) -> dict[str, Any]:
    reset(dsn)
    with manager_process(dsn, MANAGER_OVERRIDES) as m:
        recv = start_receivers(1, m.url, "fire", LATENCY_CREDIT, LATENCY_CREDIT)
        try:
            recv.wait_ready()
            m.reset_ev.set()
            recv.go.set()
            time.sleep(0.5)
            base = time.time() + FIRE_LEAD_S
            fire_at = [datetime.fromtimestamp(base + i * spread / n, UTC) for i in range(n)]
            t_ins = time.perf_counter()
            with psycopg.connect(dsn) as conn:
                enqueue_batch(conn, QUEUE, make_events(n, seed, fire_at))
                conn.commit()
            insert_s = time.perf_counter() - t_ins
            deadline = time.monotonic() + FIRE_LEAD_S + spread + 30
            while recv.handled_total() < n and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            results = recv.finish()
    late = []
    attempts_gt1 = 0
    seen: set[int] = set()
    worst: list[tuple[float, int, float]] = []
    for r in results:
        for ident, f_at, t, attempt in r["records"]:
            if ident in seen:
                continue
            seen.add(ident)
            late.append(t - f_at)
            worst.append((t - f_at, ident, f_at))
            attempts_gt1 += attempt > 1
    worst.sort(reverse=True)
    early = [x for x in late if x < 0]
    db_after = state_counts(dsn)  # after the manager stopped
    lost_rows = event_rows(dsn, "NOT (id = ANY(%s))", sorted(seen)) if len(seen) < n else []
    return {
        "events": n,
        "spread_s": spread,
        "lead_s": FIRE_LEAD_S,
        "insert_s": round(insert_s, 3),
        "received": len(late),
        "missing": n - len(late),
        "early": len(early),
        "earliest_ms": round(min(early) * 1000, 3) if early else None,
        "redelivered": attempts_gt1,
        # the latest receipts: fire_at as seconds after the first scheduled fire_at
        "latest": [
            {"id": i, "fire_at_offset_s": round(f - base, 4), "late_ms": round(1000 * lt, 3)} for lt, i, f in worst[:5]
        ],
        "db_states_at_end": db_after["states"],
        "not_received": lost_rows[:10],
        "lateness": summary_ms(late),
    }


def bench_fire(dsn: str, n: int, spread: float, reps: int) -> dict[str, Any]:
    samples = []
    for rep in range(reps):
        r = run_fire(dsn, n, spread, seed=77 + rep)
        samples.append(r)
        lt = r["lateness"]
        log(
            "fire rep=%d lateness p50=%s p99=%s max=%s ms over 20 ms=%s early=%d missing=%d",
            rep + 1,
            lt.get("p50_ms"),
            lt.get("p99_ms"),
            lt.get("max_ms"),
            lt.get("over_20ms"),
            r["early"],
            r["missing"],
        )
    lat = [s["lateness"] for s in samples]
    maxes = [x["max_ms"] for x in lat if x.get("max_ms") is not None]
    return {
        "events": n,
        "spread_s": spread,
        "p50_ms": median_of(lat, "p50_ms"),
        "p99_ms": median_of(lat, "p99_ms"),
        "max_ms": median_of(lat, "max_ms"),
        # a p99 alone hides a rare stall (issue 36): the worst receipt of every rep, and the count
        # of receipts over 20 ms
        "max_ms_worst": max(maxes) if maxes else None,
        "late_over_20ms": sum(s["lateness"].get("over_20ms", 0) for s in samples),
        "early": sum(s["early"] for s in samples),
        "missing": sum(s["missing"] for s in samples),
        "late_over_100ms": sum(s["lateness"].get("over_100ms", 0) for s in samples),
        "samples": samples,
    }


# --------------------------------------------------------------------------- cost per event

COST_KEYS = ("postgres_cpu_us", "wal_bytes", "commits", "manager_cpu_us", "receivers_cpu_us", "workers_cpu_us")


def cost_table(drain: dict[str, Any], peers: dict[str, Any] | None) -> dict[str, Any]:
    """What a drained event costs, ours (the best configuration) beside each peer configuration of
    the same run (medians of its runs): PostgreSQL CPU microseconds, WAL bytes, WAL commit records,
    and the client side's CPU (our manager and receivers; the peer's worker processes)."""
    best = drain["best"]
    rows: dict[str, dict[str, Any]] = {
        "ours": {
            "config": f"r{best['receivers']}_c{best['credit']}",
            "events_per_s": best["events_per_s"],
            **{k: best["per_event_median"].get(k) for k in COST_KEYS if k in best["per_event_median"]},
        }
    }
    for name, d in (peers or {}).get("drain", {}).items():
        pe = d.get("per_event_median") or {}
        rows[name] = {
            "config": name,
            "events_per_s": d.get("jobs_per_s"),
            **{k: pe.get(k) for k in COST_KEYS if k in pe},
        }
    pgq = max(
        (v for k, v in rows.items() if k.startswith("pgqueuer") and v.get("events_per_s")),
        key=lambda v: v["events_per_s"],
        default=None,
    )
    ours_pg = rows["ours"].get("postgres_cpu_us")
    return {
        "rows": rows,
        "postgres_cpu_vs_pgqueuer_best": None if pgq is None else ratio(ours_pg, pgq.get("postgres_cpu_us")),
        "python_cpu_us": round(
            (rows["ours"].get("manager_cpu_us") or 0) + (rows["ours"].get("receivers_cpu_us") or 0), 2
        ),
    }


# --------------------------------------------------------------------------- orchestration


def _ints(text: str, what: str, parser: argparse.ArgumentParser) -> list[int]:
    try:
        vals = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        parser.error(f"{what} must be comma-separated integers, got {text!r}")
    if not vals or min(vals) < 1:
        parser.error(f"{what} needs at least one value, each >= 1")
    return vals


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--events", type=int, default=100_000, help="backlog size of the drain (default 100000)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each measurement; medians are reported")
    parser.add_argument("--receivers", default="1,2", help="receiver process counts to try for the drain (default 1,2)")
    parser.add_argument(
        "--credit", default="1000,4000", help="receiver credits to try for the drain (default 1000,4000)"
    )
    parser.add_argument(
        "--concurrency", type=int, default=32, help="handler tasks per receiver in the drain (default 32)"
    )
    parser.add_argument("--latency-events", type=int, default=500, help="events at 200/s (default 500)")
    parser.add_argument("--fast-latency-events", type=int, default=5000, help="events at 2000/s (default 5000)")
    parser.add_argument("--fast-producers", type=int, default=8, help="producer connections at 2000/s (default 8)")
    parser.add_argument("--fire-events", type=int, default=2000, help="scheduled events (default 2000)")
    parser.add_argument("--fire-spread", type=float, default=4.0, help="seconds the fire_at values span (default 4)")
    lib = parser.add_mutually_exclusive_group()
    lib.add_argument(
        "--library",
        dest="library",
        action="store_true",
        default=True,
        help="also run the drain and the 200/s latency with the receiver library, alternated with the bare receiver "
        "(default)",
    )
    lib.add_argument("--no-library", dest="library", action="store_false", help="skip the receiver library runs")
    peers = parser.add_mutually_exclusive_group()
    peers.add_argument("--peers", dest="peers", action="store_true", default=None, help="run the peers too (default)")
    peers.add_argument("--no-peers", dest="peers", action="store_false", help="skip the peers")
    parser.add_argument(
        "--pgq-batch-sizes", default="500,1000", help="PgQueuer dequeue batch sizes to try (2 processes)"
    )
    parser.add_argument("--pgq-events", type=int, default=None, help="PgQueuer drain size (default: --events)")
    parser.add_argument(
        "--procr-events", type=int, default=10_000, help="Procrastinate drain size (default 10000: it drains at ~700/s)"
    )
    parser.add_argument("--procr-reps", type=int, default=1, help="Procrastinate drain repetitions (default 1)")
    parser.add_argument(
        "--profile", action="store_true", help="one extra drain with cProfile in the manager and receivers"
    )
    parser.add_argument("--dsn", help="administrative database of an existing server (default: an embedded one)")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 10000 events, 1 rep, small latency/fire runs, no peers"
    )
    parser.add_argument(
        "--tracing",
        action="store_true",
        help="also run the receiver library's drain with OpenTelemetry tracing off and on, alternated "
        "(docs/observability.md; needs the [otel] extra)",
    )
    parser.add_argument(
        "--tracing-only",
        action="store_true",
        help="only the drain and the tracing runs (no latency, fire, library or peers)",
    )
    parser.add_argument(
        "--trace-sample",
        type=float,
        default=0.01,
        help="with --tracing: the manager's sample of fire and ack batches (default 0.01)",
    )
    parser.add_argument("--json-only", action="store_true", help="no logs on stderr (only warnings)")
    parser.add_argument(
        "--manager-set",
        action="append",
        default=[],
        metavar="FIELD=JSON",
        help="a ManagerConfig field for every manager of the run, e.g. durable_fires=false (repeatable)",
    )
    parser.add_argument(
        "--queue-set",
        action="append",
        default=[],
        metavar="FIELD=JSON",
        help="a queue setting of bench_q, e.g. retention_seconds=0 (repeatable; both sides with --other)",
    )
    parser.add_argument(
        "--other",
        type=Path,
        help="another checkout of this repository (with its .venv): its drain runs beside ours, alternated",
    )
    parser.add_argument(
        "--drain-only", action="store_true", help="only the drain (and the peers unless --no-peers): no latency runs"
    )
    parser.add_argument(
        "--event-priorities",
        default="",
        help="the drain's events take these priorities in turn, e.g. 1,3,5 (default: the queue's)",
    )
    args = parser.parse_args(argv)
    if args.tracing_only:
        args.tracing, args.library, args.peers = True, False, False
    for item in args.manager_set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--manager-set takes FIELD=JSON, got {item!r}")
        MANAGER_OVERRIDES[key] = json.loads(value)
    for item in args.queue_set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--queue-set takes FIELD=JSON, got {item!r}")
        QUEUE_SETTINGS[key] = json.loads(value)
    if args.other is not None and not (args.other / ".venv" / "bin" / "python").exists():
        parser.error(f"--other {args.other}: no .venv/bin/python there (run make setup in it)")
    if args.quick:
        args.events, args.reps, args.receivers = 10_000, 1, "1"
        args.latency_events, args.fast_latency_events, args.fire_events, args.fire_spread = 200, 1000, 500, 2.0
        if args.peers is None:
            args.peers = False
        args.procr_events = min(args.procr_events, 2000)
    if args.peers is None:
        args.peers = True
    args.receivers = _ints(args.receivers, "--receivers", parser)
    args.credit = _ints(args.credit, "--credit", parser)
    args.pgq_batch_sizes = _ints(args.pgq_batch_sizes, "--pgq-batch-sizes", parser)
    args.event_priorities = _ints(args.event_priorities, "--event-priorities", parser) if args.event_priorities else []
    if args.pgq_events is None:
        args.pgq_events = args.events
    if (
        min(args.reps, args.events, args.latency_events, args.fast_latency_events, args.fire_events, args.concurrency)
        < 1
    ):
        parser.error("--reps, --events, --concurrency and the event counts must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up (stop the embedded server) on kill
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.json_only else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(message)s",
    )
    if args.peers:
        peers_python()  # before any measurement: a missing virtualenv fails now, not in 5 minutes
    started = time.monotonic()
    code_at_start = code_version()
    configs = [DrainConfig(r, c, args.concurrency) for r in args.receivers for c in args.credit]
    with bench_server(args.dsn, "e2e") as (admin_dsn, dsn):
        log("benchmark database: %s", conninfo_to_dict(dsn).get("dbname"))
        one_shard_queue(dsn, QUEUE, QUEUE_SETTINGS)
        info = server_info(dsn)
        count_server(dsn)
        other = None if args.other is None else Other.set_up(args.other.resolve(), admin_dsn, QUEUE_SETTINGS)
        try:
            drain = bench_drain(dsn, configs, args.events, args.reps, other, args.event_priorities)
        finally:
            if other is not None:
                other.drop(admin_dsn)

        def traced() -> dict[str, Any]:
            b = drain["best"]
            cfg = DrainConfig(b["receivers"], b["credit"], b["concurrency"])
            return bench_tracing(dsn, cfg, args.events, args.reps, args.trace_sample)

        if args.tracing_only:
            emit({**header("e2e"), **info, "code": code_at_start, "drain": drain, "tracing": traced()})
            return 0
        latency: dict[str, Any] = {}
        fire: dict[str, Any] = {"p99_ms": None, "max_ms_worst": None, "late_over_20ms": 0, "early": 0, "missing": 0}
        if not args.drain_only:
            latency = bench_latency(
                dsn,
                [(200.0, args.latency_events, 1), (2000.0, args.fast_latency_events, args.fast_producers)],
                args.reps,
            )
            fire = bench_fire(dsn, args.fire_events, args.fire_spread, args.reps)
        library = None
        if args.library and not args.drain_only:
            b = drain["best"]
            library = bench_library(
                dsn,
                DrainConfig(b["receivers"], b["credit"], b["concurrency"]),
                args.events,
                args.latency_events,
                args.reps,
            )
        tracing = traced() if args.tracing else None
        profile = None
        if args.profile:
            b = drain["best"]
            profile = profile_drain(dsn, DrainConfig(b["receivers"], b["credit"], b["concurrency"]), args.events)
        peers = None
        if args.peers:
            peers = bench_peers(
                admin_dsn,
                reps=args.reps,
                pgq_events=args.pgq_events,
                pgq_batch_sizes=args.pgq_batch_sizes,
                procr_events=args.procr_events,
                procr_reps=args.procr_reps,
            )
    ours_drain = drain["best"]["events_per_s"]
    lat200 = latency.get("200_per_s")
    comparison: dict[str, Any] = {
        "fire_lateness_p99_ms": fire["p99_ms"],
        "fire_lateness_max_ms": fire["max_ms_worst"],
        "fire_late_over_20ms": fire["late_over_20ms"],
        "fire_early": fire["early"],
    }
    met: dict[str, Any] = {}
    if not args.drain_only:
        met["fire_p99_under_5ms"] = fire["p99_ms"] is not None and fire["p99_ms"] < FIRE_P99_TARGET_MS
        met["fire_max_under_20ms"] = fire["max_ms_worst"] is not None and fire["max_ms_worst"] < FIRE_MAX_TARGET_MS
        met["fire_never_early"] = fire["early"] == 0
    if "other" in drain:
        comparison["drain_vs_other"] = {
            "other_code": drain["other"]["code"],
            "ratio": drain["other"]["best_ratio"],
            "ours_per_event": drain["best"]["per_event_median"],
            "other_per_event": drain["other"]["best"]["per_event_median"],
        }
    if peers is not None:
        best_peer = max(
            ((k, v) for k, v in peers["drain"].items() if v.get("jobs_per_s")),
            key=lambda kv: kv[1]["jobs_per_s"],
            default=None,
        )
        fast_lat = min(
            ((k, v) for k, v in peers["latency_200_per_s"].items() if v.get("p50_ms") is not None),
            key=lambda kv: kv[1]["p50_ms"],
            default=None,
        )
        if best_peer is not None:
            comparison["drain_ratio"] = ratio(ours_drain, best_peer[1]["jobs_per_s"])
            comparison["drain_vs"] = {
                "peer": best_peer[0],
                "peer_jobs_per_s": best_peer[1]["jobs_per_s"],
                "ours_events_per_s": ours_drain,
            }
            met[f"drain_ratio_at_least_{DRAIN_TARGET:g}"] = (
                comparison["drain_ratio"] is not None and comparison["drain_ratio"] >= DRAIN_TARGET
            )
        if fast_lat is not None and lat200 is not None:
            comparison["latency_200_p50_ratio"] = ratio(lat200["p50_ms"], fast_lat[1]["p50_ms"])
            comparison["latency_200_p99_ratio"] = ratio(lat200["p99_ms"], fast_lat[1]["p99_ms"])
            comparison["latency_vs"] = {
                "peer": fast_lat[0],
                "peer_p50_ms": fast_lat[1]["p50_ms"],
                "peer_p99_ms": fast_lat[1]["p99_ms"],
                "ours_p50_ms": lat200["p50_ms"],
                "ours_p99_ms": lat200["p99_ms"],
            }
            for key in ("p50", "p99"):
                r = comparison[f"latency_200_{key}_ratio"]
                met[f"latency_200_{key}_no_worse"] = r is not None and r <= LATENCY_TARGET
    lost = {
        "drain_not_all_acked": sum(not t["all_acked"] for t in drain["tried"]),
        "latency_missing": sum(v["missing"] for v in latency.values()),
        "fire_missing": fire["missing"],
    }
    if library is not None:
        lost["library_runs_not_all_acked"] = sum(not library[k]["drain_all_acked"] for k in ("bare", "library"))
        lost["library_runs_latency_missing"] = sum(library[k]["latency_missing"] for k in ("bare", "library"))
    costs = cost_table(drain, peers)
    comparison["cost_per_event"] = costs
    wal = costs["rows"]["ours"].get("wal_bytes")
    met[f"wal_under_{WAL_BYTES_MAX:g}_bytes_per_event"] = wal is not None and wal < WAL_BYTES_MAX
    if costs["postgres_cpu_vs_pgqueuer_best"] is not None:
        met["postgres_cpu_at_most_a_third_of_pgqueuers"] = (
            costs["postgres_cpu_vs_pgqueuer_best"] <= PG_CPU_VS_PGQUEUER_MAX
        )
    comparison["lost_or_stuck"] = lost
    met["nothing_lost"] = not any(lost.values())
    met["all"] = all(v for v in met.values())
    report = {
        **header("e2e"),
        **info,
        "code": code_at_start,
        "params": {
            "queue": {"name": QUEUE, **QUEUE_SETTINGS},
            "events": args.events,
            "reps": args.reps,
            "receivers": args.receivers,
            "credit": args.credit,
            "concurrency": args.concurrency,
            "latency_credit": LATENCY_CREDIT,
            "quick": args.quick,
            "manager_overrides": MANAGER_OVERRIDES,
            "other": None if args.other is None else str(args.other),
            "drain_only": args.drain_only,
            "event_priorities": args.event_priorities,
        },
        "drain": drain,
        "latency": latency,
        "fire": fire,
        "receiver_library": library,
        "tracing": tracing,
        "profile": profile,
        "peers": peers,
        "comparison": comparison,
        "targets": {
            "drain_ratio_min": DRAIN_TARGET,
            "latency_200_ratio_max": LATENCY_TARGET,
            "fire_p99_ms_max": FIRE_P99_TARGET_MS,
            "fire_max_ms_max": FIRE_MAX_TARGET_MS,
            "fire_early": 0,
            "postgres_cpu_vs_pgqueuer_max": round(PG_CPU_VS_PGQUEUER_MAX, 3),
            "wal_bytes_per_event_max": WAL_BYTES_MAX,
        },
        "met": met,
        "manager_stop_hangs": len(fleet.stop_hangs),
        "wall_s": round(time.monotonic() - started, 1),
    }
    emit(report)
    best = max(drain["tried"], key=lambda t: t["events_per_s"])
    print(
        "manager database calls in the median drain run of the best configuration "
        f"(receivers={best['receivers']}, credit={best['credit']}): "
        f"{json.dumps(best['median_run']['manager_db_calls'])}",
        file=sys.stderr,
    )
    for k, v in met.items():
        if k != "all" and not v:
            print(f"target missed: {k}", file=sys.stderr)
    print(f"comparison: {json.dumps(comparison)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
