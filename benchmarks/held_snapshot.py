"""Dispatch while a long transaction holds back vacuum: latency, depth and PostgreSQL's cost, by phase.

Prints one JSON object on stdout (logs go to stderr). One shard, one queue (``bench_q``, 16
partitions, shuffle 4), one manager process, one receiver process (credit and concurrency 32,
no-op handler), and an open-loop producer process (one autocommit INSERT per event) at a steady
rate. For each rate (500/s, then 2 000/s) three phases follow each other without a pause:

* **clean** (``--clean`` s);
* **held** (``--held`` s): a separate session runs ``BEGIN; SELECT txid_current();`` and stays
  idle in that transaction, so vacuum can remove nothing the queue makes meanwhile;
* **recovery** (``--recovery`` s): that session has rolled back.

Per phase: commit -> receipt p50/p99/max (receipt = the receiver's handler start; commit = the
moment the producer's INSERT returned; same machine, same ``time.time()``), the p99 of each
1-second window (median and worst), the queue depth (committed, not yet received; max and at
the end), PostgreSQL's CPU seconds per 1 000 events (the server's processes, from /proc), the
manager's CPU per 1 000 events, ``pg_stat_statements`` for the manager's statements (calls, buffer
hits per call, ms per call), the size of the due-index, the dead tuples of the queue table (and of
``qm.queue_load`` where it exists) and the share of HOT updates at the phase's end; checkpoints
completed during the phase, and the manager's stalls: its database calls that took over 20 ms and
its event loop's stalls over 20 ms, with their times (where a burst of latency comes from).
``recovered_after_s``: seconds after the release until the 1-second p99 stays within 2x the clean
phase's p99.

Targets (issue "Dispatch that stays fast while a long transaction holds back vacuum"), per rate:
held p99 <= 2x clean p99 (and < 20 ms at 500/s); PostgreSQL CPU per event held <= 1.5x clean;
the queue depth does not grow (the held phase's depth p99 <= 2x clean's + rate/100 events, and
its median in the phase's last third <= in its first third + rate/100); clean figures back within
5 s of the release (p99 of everything committed from 5 s after the release on <= 2x clean p99).

    .venv/bin/python -m benchmarks.held_snapshot [--rates 500,2000] [--clean 60] [--held 180]
                                                 [--recovery 60] [--long] [--dsn URI] [--json-only]

``--long`` runs 500/s only, with the snapshot held 600 s (the 10-minute run). Unless ``--dsn`` is
given, a dedicated embedded server with the default durability and ``pg_stat_statements`` runs
for the benchmark.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import psycopg

from benchmarks.lib.backlog import reset
from benchmarks.lib.fleet import manager_process, start_producer, start_receivers
from benchmarks.lib.machine import code_version, count_server, cpu_delta, cpu_snapshot
from benchmarks.lib.report import depth_series, emit, header, run_main
from benchmarks.lib.server import QUEUE, bench_server, one_shard_queue, server_info
from queue_manager.domain.stats import percentile

logger = logging.getLogger("bench.held")

QUEUE_SETTINGS = {"partitions": 16, "shuffle": 4}
CREDIT = 32
SERVER_SETTINGS = {"shared_preload_libraries": "pg_stat_statements", "pg_stat_statements.track": "all"}
#: producer connections per rate (8 at 2 000/s, as in the e2e benchmark)
CONNS = {500: 2, 2000: 8}
HELD_P99_FACTOR = 2.0
HELD_P99_MS_AT_500 = 20.0
CPU_FACTOR = 1.5
RECOVER_WITHIN_S = 5.0

#: the manager's statements, recognised in pg_stat_statements by distinctive text
STATEMENTS = {
    "fire_due": ("generate_series(", "SKIP LOCKED", "UPDATE"),
    "scan": ("CROSS JOIN LATERAL", "clock_timestamp()", "SELECT e.id"),
    "fire": ("SET state = 'fired'", "fire_at <= now()", "RETURNING"),
    "ack": ("state = 'acked'", "add_done"),
    "sweep": ("ack_deadline <= now()", "SKIP LOCKED"),
    "insert": (f"INSERT INTO {QUEUE}",),
}


def classify(query: str) -> str | None:
    for name, needles in STATEMENTS.items():
        if name == "fire" and "generate_series(" in query:
            continue
        if all(n in query for n in needles):
            return name
    return None


def statement_stats(dsn: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT query, calls, shared_blks_hit + shared_blks_read, total_exec_time, rows, max_exec_time "
            "FROM pg_stat_statements "
            "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
        ).fetchall()
    for query, calls, blocks, ms, nrows, max_ms in rows:
        name = classify(str(query))
        if name is None or not calls:
            continue
        s = out.setdefault(name, {"calls": 0, "blocks": 0.0, "ms": 0.0, "rows": 0, "max_ms": 0.0})
        s["calls"] += int(calls)
        s["blocks"] += float(blocks)
        s["ms"] += float(ms)
        s["rows"] += int(nrows)
        s["max_ms"] = max(s["max_ms"], float(max_ms))
    return {
        name: {
            "calls": s["calls"],
            "buffers_per_call": round(s["blocks"] / s["calls"], 1),
            "ms_per_call": round(s["ms"] / s["calls"], 3),
            "rows_per_call": round(s["rows"] / s["calls"], 1),
            "total_ms": round(s["ms"], 1),
            "max_ms": round(s["max_ms"], 2),
        }
        for name, s in out.items()
    }


def table_stats(dsn: str) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_force_next_flush()")
        row = conn.execute(
            "SELECT pg_relation_size(%s), pg_relation_size(%s), pg_relation_size(%s)",
            (f"{QUEUE}_due", f"{QUEUE}_fired", f"{QUEUE}_pkey"),
        ).fetchone()
        # qm.queue_load (the done counters' row until revision 0004) where it still exists
        dead = dict(
            conn.execute(
                "SELECT relname, n_dead_tup FROM pg_stat_user_tables "
                "WHERE relid = %s::regclass OR relid = to_regclass('qm.queue_load')",
                (QUEUE,),
            ).fetchall()
        )
        hot = conn.execute(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relid = %s::regclass", (QUEUE,)
        ).fetchone()
    assert row is not None and hot is not None
    return {
        "due_index_kb": row[0] // 1024,
        "fired_index_kb": row[1] // 1024,
        "pkey_kb": row[2] // 1024,
        "dead_tuples": {str(k): int(v) for k, v in dead.items()},
        "updates": int(hot[0]),
        "hot_updates": int(hot[1]),
    }


def checkpoints(dsn: str) -> int:
    """Checkpoints completed so far (PostgreSQL 17's pg_stat_checkpointer, else pg_stat_bgwriter)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        if conn.execute("SELECT to_regclass('pg_catalog.pg_stat_checkpointer')").fetchone() != (None,):
            row = conn.execute("SELECT num_timed + num_requested FROM pg_stat_checkpointer").fetchone()
        else:
            row = conn.execute("SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter").fetchone()
    assert row is not None
    return int(row[0])


def stalls(slow: list[tuple[str, float, float]], start: float, end: float) -> dict[str, Any]:
    """The manager's slow database calls and event-loop stalls (see benchmarks.lib.procs.SLOW_CALL) in [start, end):
    per name, how many, the longest and their sum (ms); and the five longest with their time into the phase."""
    inside = [(n, t, d) for n, t, d in slow if start <= t < end]
    by_name: dict[str, dict[str, float]] = {}
    for n, _, d in inside:
        b = by_name.setdefault(n, {"count": 0, "max_ms": 0.0, "sum_ms": 0.0})
        b["count"] += 1
        b["max_ms"] = max(b["max_ms"], round(d * 1000, 1))
        b["sum_ms"] = round(b["sum_ms"] + d * 1000, 1)
    worst = sorted(inside, key=lambda x: -x[2])[:5]
    return {"by_call": by_name, "worst": [[n, round(t - start, 2), round(d * 1000, 1)] for n, t, d in worst]}


def reset_statements(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_statements_reset()")


def pct(values: Sequence[float], p: float) -> float:
    """The percentile of a non-empty list."""
    v = percentile(values, p)
    assert v is not None
    return v


def phase_report(
    name: str,
    start: float,
    end: float,
    lat: list[tuple[float, float]],
    cpu: dict[str, float],
    stmts: dict[str, Any],
    tables: dict[str, Any],
) -> dict[str, Any]:
    """``lat``: (commit time, latency s) of the events committed in [start, end)."""
    vals = [v for _, v in lat]
    windows = []
    t = start
    while t < end:
        w = [v for c, v in lat if t <= c < t + 1.0]
        if w:
            windows.append(pct(w, 99) * 1000)
        t += 1.0
    wall = end - start
    events = len(lat)
    k = max(1.0, events / 1000)
    return {
        "phase": name,
        "seconds": round(wall, 1),
        "events": events,
        "p50_ms": round(pct(vals, 50) * 1000, 3) if vals else None,
        "p99_ms": round(pct(vals, 99) * 1000, 3) if vals else None,
        "max_ms": round(max(vals) * 1000, 3) if vals else None,
        "p99_1s_windows_ms": {
            "median": round(statistics.median(windows), 3) if windows else None,
            "worst": round(max(windows), 3) if windows else None,
        },
        "postgres_cpu_s_per_1000": round(cpu.get("postgres", 0.0) / 100 * wall / k, 4),
        "manager_cpu_s_per_1000": round(cpu.get("manager", 0.0) / 100 * wall / k, 4),
        "cpu_pct_of_one_core": cpu,
        "statements": stmts,
        "tables": tables,
    }


def recovered_after(
    sent: dict[int, tuple[float, float]], first: dict[int, float], released_at: float, clean_p99_ms: float
) -> float | None:
    """Seconds after the release from which every 1-second window's p99 stays within 2x clean."""
    windows: dict[int, list[float]] = {}
    for seq, (_, c) in sent.items():
        if c >= released_at and seq in first:
            windows.setdefault(int(c - released_at), []).append(first[seq] - c)
    p99 = {k: pct(v, 99) * 1000 for k, v in windows.items()}
    bad = [k for k, v in p99.items() if v > HELD_P99_FACTOR * clean_p99_ms]
    if not p99:
        return None
    return float(max(bad) + 1) if bad else 0.0


def run_rate(dsn: str, rate: int, phases: list[tuple[str, float]], seed: int) -> dict[str, Any]:
    conns = CONNS.get(rate, max(1, rate // 250))
    total = int(rate * sum(d for _, d in phases))
    reset(dsn)
    with manager_process(dsn) as m:
        recv = start_receivers(1, m.url, "latency", CREDIT, CREDIT)
        try:
            recv.wait_ready()
            prod = start_producer(dsn, total, rate, recv.go, conns=conns, seed=seed, name="held-producer")
            prod.wait_ready()
            time.sleep(1.0)
            groups = {"manager": [int(m.proc.pid)], "receivers": recv.pids()}
            reset_statements(dsn)
            recv.go.set()
            bounds: list[tuple[str, float, float, dict[str, float], dict[str, Any], dict[str, Any], int]] = []
            holder: psycopg.Connection[Any] | None = None
            released_at: float | None = None
            for name, seconds in phases:
                t0 = time.time()
                snap = cpu_snapshot()
                ckpt0 = checkpoints(dsn)
                if name == "held":
                    holder = psycopg.connect(dsn)
                    holder.execute("SELECT txid_current()")
                    logger.info("%d/s: snapshot held", rate)
                time.sleep(seconds)
                if name == "held" and holder is not None:
                    holder.rollback()
                    holder.close()
                    holder = None
                    released_at = time.time()
                    logger.info("%d/s: snapshot released", rate)
                cpu = cpu_delta(snap, cpu_snapshot(), groups)
                stmts = statement_stats(dsn)
                reset_statements(dsn)
                bounds.append((name, t0, time.time(), cpu, stmts, table_stats(dsn), checkpoints(dsn) - ckpt0))
            res = prod.result(timeout=120)
            deadline = time.monotonic() + 60
            while recv.handled_total() < total and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            results = recv.finish()
    sent: dict[int, tuple[float, float]] = res["sent"]
    first: dict[int, float] = {}
    for r in results:
        for seq, t in r["records"]:
            first[seq] = min(t, first.get(seq, t))
    commits = [c for _, c in sent.values()]
    receipts = list(first.values())
    out: dict[str, Any] = {
        "rate": rate,
        "producer_connections": conns,
        "rate_achieved": round(total / res["elapsed"], 1),
        "missing": sorted(set(sent) - set(first))[:20],
        "phases": [],
        # the manager's database calls over the whole run (count, seconds, ms and items per call)
        "manager_db_calls": m.counters(),
    }
    slow = [(str(n), float(t), float(d)) for n, t, d in m.info.get("slow", [])]
    for name, start, end, cpu, stmts, tables, ckpts in bounds:
        lat = [(c, first[s] - c) for s, (_, c) in sent.items() if start <= c < end and s in first]
        report = phase_report(name, start, end, lat, cpu, stmts, tables)
        report["checkpoints"] = ckpts
        report["manager_stalls"] = stalls(slow, start, end)
        depth = depth_series(commits, receipts, start, end)
        report["depth_max"] = max(depth) if depth else 0
        report["depth_p99"] = round(pct(depth, 99), 1) if depth else 0
        third = max(1, len(depth) // 3)
        # growth: the median depth of the phase's last third against its first third
        report["depth_first_third_median"] = statistics.median(depth[:third]) if depth else 0
        report["depth_last_third_median"] = statistics.median(depth[-third:]) if depth else 0
        report["depth_end"] = depth[-1] if depth else 0
        out["phases"].append(report)
    if released_at is not None:
        clean_p99 = out["phases"][0]["p99_ms"] or 0.0
        out["recovered_after_s"] = recovered_after(sent, first, released_at, clean_p99)
        after = [first[q] - c for q, (_, c) in sent.items() if c >= released_at + RECOVER_WITHIN_S and q in first]
        out["p99_from_5s_after_release_ms"] = round(pct(after, 99) * 1000, 3) if after else None
    return out


def targets(run: dict[str, Any]) -> dict[str, Any]:
    by = {p["phase"]: p for p in run["phases"]}
    clean, held = by.get("clean"), by.get("held")
    if clean is None or held is None or clean["p99_ms"] is None or held["p99_ms"] is None:
        return {}
    cpu_ratio = (
        held["postgres_cpu_s_per_1000"] / clean["postgres_cpu_s_per_1000"] if clean["postgres_cpu_s_per_1000"] else None
    )
    p99_ratio = held["p99_ms"] / clean["p99_ms"] if clean["p99_ms"] else None
    slack = run["rate"] / 100  # events of 10 ms
    after = run.get("p99_from_5s_after_release_ms")
    met = {
        "held_p99_within_2x_clean": p99_ratio is not None and p99_ratio <= HELD_P99_FACTOR,
        "postgres_cpu_per_event_within_1.5x": cpu_ratio is not None and cpu_ratio <= CPU_FACTOR,
        # no backlog builds up: depth stays near clean's (p99) and does not trend up across the phase
        "depth_does_not_grow": held["depth_p99"] <= 2 * clean["depth_p99"] + slack
        and held["depth_last_third_median"] <= held["depth_first_third_median"] + slack,
        # everything committed from 5 s after the release on is back within 2x the clean p99
        "recovered_within_5s": after is not None and after <= HELD_P99_FACTOR * (clean["p99_ms"] or 0.0),
    }
    if run["rate"] == 500:
        met["held_p99_under_20ms"] = held["p99_ms"] < HELD_P99_MS_AT_500
    return {
        "held_over_clean_p99": round(p99_ratio, 2) if p99_ratio else None,
        "held_over_clean_postgres_cpu_per_event": round(cpu_ratio, 2) if cpu_ratio else None,
        "met": met,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="500,2000", help="events/s, one run each (default 500,2000)")
    parser.add_argument("--clean", type=float, default=60.0)
    parser.add_argument("--held", type=float, default=180.0)
    parser.add_argument("--recovery", type=float, default=60.0)
    parser.add_argument("--long", action="store_true", help="500/s with the snapshot held 600 s")
    parser.add_argument("--dsn", help="administrative database of an existing server (needs pg_stat_statements)")
    parser.add_argument("--json-only", action="store_true", help="no logs on stderr (only warnings)")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.json_only else logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s"
    )
    rates = [500] if args.long else [int(r) for r in args.rates.split(",") if r]
    held = 600.0 if args.long else args.held
    phases = [("clean", args.clean), ("held", held), ("recovery", args.recovery)]
    started = time.time()
    with bench_server(args.dsn, "held", SERVER_SETTINGS) as (_admin, dsn):
        one_shard_queue(dsn, QUEUE, QUEUE_SETTINGS)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        count_server(dsn)
        info = server_info(dsn)
        runs = []
        for rate in rates:
            logger.info("rate %d/s: phases %s", rate, phases)
            run = run_rate(dsn, rate, phases, args.seed)
            run["targets"] = targets(run)
            runs.append(run)
    report = {
        **header("held_snapshot"),
        **info,
        "code": code_version(),
        "params": {"phases": phases, "rates": rates, "credit": CREDIT, "queue": {"name": QUEUE, **QUEUE_SETTINGS}},
        "runs": runs,
        "met": all(all(r["targets"].get("met", {"x": False}).values()) for r in runs),
        "wall_s": round(time.time() - started, 1),
    }
    emit(report)
    return 0


if __name__ == "__main__":
    run_main(main)
