"""Sustained churn with retention on: do the queue table and its indexes stay the same size?

Prints one JSON object on stdout (logs go to stderr). One shard, one queue (``bench_q``, 16
partitions, shuffle 4, ``retention_seconds`` 30 by default, so that the manager's retention purge
deletes continuously), one manager process, one receiver process that acks every event (credit and
concurrency 32, no-op handler), and an open-loop producer process (one autocommit INSERT per event)
at a steady rate (500/s by default: sized for a 2-core machine shared with other work) for
``--minutes`` (10 by default). Every event is inserted, fired, acked and, 30 s later, deleted: four
row versions, and dead tuples for vacuum to remove.

Two runs, each on a freshly truncated table:

* **clean**: nothing else runs on the database;
* **held** (``--held-seconds``, 120 by default): in the middle of the run a separate session runs
  ``BEGIN; SELECT txid_current();`` and stays idle in that transaction, so vacuum can remove
  nothing the queue makes meanwhile; then it rolls back.

Reported per run:

* ``checkpoints``: at the start, after the first minute, in the middle (for the held run: when the
  snapshot is released) and at the end: the table's and each index's size, live and dead tuples
  (the statistics collector's), autovacuum runs so far, the statistics-based index bloat estimate
  that ``qm status`` shows and, when the ``pgstattuple`` extension is available, the measured
  figures (dead tuples and free space of the heap, each index's leaf density) to check it against;
* ``samples``: the same sizes and tuple counts every ``--sample`` seconds (10);
* ``minutes``: per minute, events enqueued, delivered and purged, commit -> receipt p50/p99, the
  CPU per 1 000 events of PostgreSQL and of the manager, and the CPU of the rest of the machine
  (other work on a shared machine), in % of one core;
* ``metrics``: the manager's health gauges (``/metrics``) at the end, and how long its readings took;
* ``targets``: the issue's (size growth under 20 % after the first minute, no throughput decay beyond
  10 %, recovery within 2 minutes of the snapshot's release), with the figures they were judged on.

    .venv/bin/python -m benchmarks.churn [--minutes 10] [--rate 500] [--retention 30] [--runs clean,held | --held]
                                         [--held-seconds 120] [--vacuum-after 5] [--health-interval 5]
                                         [--table-options fillfactor=90,...]
                                         [--server-set autovacuum_naptime=10] [--dsn URI] [--json-only]

Unless ``--dsn`` is given, a dedicated embedded server with PostgreSQL's default durability and
autovacuum settings runs for the benchmark (``--server-set`` changes one for an experiment).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
import signal
import statistics
import sys
import time
import urllib.request
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql

from benchmarks.lib.backlog import reset
from benchmarks.lib.fleet import manager_process, start_producer, start_receivers
from benchmarks.lib.machine import code_version, count_server, cpu_delta, cpu_snapshot
from benchmarks.lib.report import depth_series, emit, header, pct_ms, run_main
from benchmarks.lib.server import QUEUE, bench_server, one_shard_queue, server_info
from queue_manager.db.health import read_health
from queue_manager.domain import health
from queue_manager.domain.stats import percentile

logger = logging.getLogger("bench.churn")

CREDIT = 32
#: the issue's targets
SIZE_GROWTH_MAX = 0.20
THROUGHPUT_DECAY_MAX = 0.10
RECOVER_WITHIN_S = 120.0
#: server settings every report records (autovacuum's, and what shapes the figures)
REPORTED_SETTINGS = (
    "autovacuum_naptime",
    "autovacuum_max_workers",
    "autovacuum_vacuum_cost_delay",
    "autovacuum_vacuum_cost_limit",
    "autovacuum_vacuum_threshold",
    "autovacuum_vacuum_scale_factor",
    "autovacuum_vacuum_insert_threshold",
    "autovacuum_vacuum_insert_scale_factor",
    "vacuum_cost_page_dirty",
    "maintenance_work_mem",
)
_OPTION_RE = re.compile(r"^[a-z_]+=[A-Za-z0-9_.]+$")


# --------------------------------------------------------------------------- readings


def autovacuum_settings(dsn: str) -> dict[str, str | None]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return {
            name: (row[0] if (row := conn.execute("SELECT current_setting(%s, true)", (name,)).fetchone()) else None)
            for name in REPORTED_SETTINGS
        }


def sample(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    """The queue table's sizes and tuple counts now (the same reading as ``qm status``)."""
    t0 = time.perf_counter()
    reading = read_health(conn)
    took = time.perf_counter() - t0
    (table,) = [t for t in reading.tables if t.queue == QUEUE]
    row = conn.execute(
        "SELECT n_tup_ins, n_tup_upd, n_tup_del, n_tup_hot_upd, vacuum_count, autovacuum_count, "
        "pg_relation_size(relid), to_jsonb(s) FROM pg_stat_user_tables s WHERE relid = %s::regclass",
        (QUEUE,),
    ).fetchone()
    assert row is not None
    # the manager's own rows: the lease (renewed every lease_ttl / 3) and the registry
    own = dict(conn.execute("SELECT relname, n_dead_tup FROM pg_stat_user_tables WHERE schemaname = 'qm'").fetchall())
    return {
        "t": time.time(),
        "heap_bytes": int(row[6]),
        "table_bytes": table.table_bytes,
        "index_bytes": table.index_bytes,
        "indexes": {i.name: i.size_bytes for i in table.indexes},
        "index_bloat_estimate_bytes": {i.name: i.bloat_bytes for i in table.indexes},
        "live_tuples": table.live_tuples,
        "dead_tuples": table.dead_tuples,
        "autovacuum_count": table.autovacuum_count,
        "vacuum_count": int(row[4]),
        # PostgreSQL 18 on: milliseconds spent in (auto)vacuum of the table so far
        "total_vacuum_ms": row[7].get("total_vacuum_time"),
        "total_autovacuum_ms": row[7].get("total_autovacuum_time"),
        "qm_tables_dead_tuples": {str(k): int(v) for k, v in own.items() if v},
        "inserted": int(row[0]),
        "updated": int(row[1]),
        "deleted": int(row[2]),
        "hot_updated": int(row[3]),
        "xmin_horizon_age_s": None if reading.horizon is None else reading.horizon.age_seconds,
        "warnings": health.warnings(reading),
        "reading_ms": round(took * 1000, 2),
    }


def measured(conn: psycopg.Connection[Any], have_pgstattuple: bool) -> dict[str, Any] | None:
    """pgstattuple's figures: what the estimates above are checked against (reads every page)."""
    if not have_pgstattuple:
        return None
    heap = conn.execute(
        "SELECT table_len, tuple_count, dead_tuple_count, free_space FROM pgstattuple(%s::regclass)", (QUEUE,)
    ).fetchone()
    assert heap is not None
    idx = conn.execute(
        "SELECT c.relname, s.leaf_pages, s.avg_leaf_density, s.empty_pages, s.deleted_pages "
        "FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid, pgstatindex(i.indexrelid::regclass) s "
        "WHERE i.indrelid = %s::regclass ORDER BY c.relname",
        (QUEUE,),
    ).fetchall()
    return {
        "heap": {"bytes": heap[0], "live_tuples": heap[1], "dead_tuples": heap[2], "free_bytes": heap[3]},
        "indexes": {
            str(r[0]): {
                "leaf_pages": r[1],
                "avg_leaf_density_pct": None if r[2] != r[2] else r[2],  # NaN for an empty index
                "empty_pages": r[3],
                "deleted_pages": r[4],
            }
            for r in idx
        },
    }


def scrape_health_metrics(port: int) -> dict[str, float]:
    """The manager's ``qm_db_*``, ``qm_table_*`` and ``qm_index_*`` series."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(("qm_db_", "qm_table_", "qm_index_")):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


# --------------------------------------------------------------------------- one run


def prepare(dsn: str, table_options: str | None) -> None:
    """An empty queue table with fresh statistics and the options of this experiment."""
    reset(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        if table_options:
            conn.execute(
                sql.SQL("ALTER TABLE {} SET ({})").format(
                    sql.Identifier(QUEUE),
                    sql.SQL(table_options),  # checked by parse_args
                )
            )
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(QUEUE)))
        conn.execute("SELECT pg_stat_reset_single_table_counters(%s::regclass)", (QUEUE,))


def run_once(
    dsn: str, args: argparse.Namespace, overrides: dict[str, Any], held: bool, have_pgstattuple: bool
) -> dict[str, Any]:
    rate, seconds = args.rate, args.minutes * 60.0
    total = int(rate * seconds)
    hold_at = seconds / 2 - args.held_seconds / 2 if held else None
    prepare(dsn, args.table_options)
    samples: list[dict[str, Any]] = []
    checkpoints: dict[str, dict[str, Any]] = {}
    cpu_minutes: list[dict[str, float]] = []
    held_window: tuple[float, float] | None = None
    metrics: dict[str, float] = {}
    with manager_process(dsn, overrides) as m, psycopg.connect(dsn, autocommit=True) as conn:
        recv = start_receivers(1, m.url, "latency", CREDIT, CREDIT)
        try:
            recv.wait_ready()
            prod = start_producer(dsn, total, rate, recv.go, conns=2, seed=args.seed, name="churn-producer")
            prod.wait_ready()
            groups = {"manager": [int(m.proc.pid)], "receivers": recv.pids(), "producer": [prod.pid]}

            def checkpoint(name: str) -> None:
                s = sample(conn)
                s["measured"] = measured(conn, have_pgstattuple)
                checkpoints[name] = s
                logger.info(
                    "%s: heap %d kB, indexes %d kB, dead %d",
                    name,
                    s["heap_bytes"] // 1024,
                    s["index_bytes"] // 1024,
                    s["dead_tuples"],
                )

            checkpoint("start")
            recv.go.set()
            t0 = time.time()
            next_sample, next_minute = t0 + args.sample, t0 + 60.0
            snap = cpu_snapshot()
            holder: psycopg.Connection[Any] | None = None
            middle = t0 + (hold_at + args.held_seconds if hold_at is not None else seconds / 2)
            marks = {"after_1_minute": t0 + 60.0, "middle": middle}
            while True:
                now = time.time()
                if hold_at is not None and holder is None and held_window is None and now >= t0 + hold_at:
                    holder = psycopg.connect(dsn, application_name="churn-held-snapshot")
                    holder.execute("SELECT txid_current()")  # then idle in transaction
                    held_window = (now, now + args.held_seconds)
                    logger.info("snapshot held")
                if holder is not None and held_window is not None and now >= held_window[1]:
                    holder.rollback()
                    holder.close()
                    holder = None
                    held_window = (held_window[0], time.time())
                    logger.info("snapshot released")
                for name, at in list(marks.items()):
                    if now >= at and holder is None:
                        checkpoint(name)
                        del marks[name]
                if now >= next_minute:
                    after = cpu_snapshot()
                    cpu_minutes.append(cpu_delta(snap, after, groups))
                    snap = after
                    next_minute += 60.0
                if now >= next_sample:
                    samples.append(sample(conn))
                    next_sample += args.sample
                if now >= t0 + seconds:
                    break
                time.sleep(0.2)
            res = prod.result(timeout=120)
            deadline = time.monotonic() + 60
            while recv.handled_total() < total and time.monotonic() < deadline:
                time.sleep(0.05)
            checkpoint("end")
            if held:
                # what gives the indexes' pages back after a held snapshot (vacuum does not)
                t_reindex = time.perf_counter()
                conn.execute(sql.SQL("REINDEX TABLE CONCURRENTLY {}").format(sql.Identifier(QUEUE)))
                reindex_s = round(time.perf_counter() - t_reindex, 2)
                checkpoint("after_reindex")
                checkpoints["after_reindex"]["reindex_seconds"] = reindex_s
            with contextlib.suppress(OSError, ValueError):
                metrics = scrape_health_metrics(m.port)
        finally:
            results = recv.finish()
    return summarize(t0, seconds, res, results, samples, checkpoints, cpu_minutes, held_window, metrics, rate)


# --------------------------------------------------------------------------- report


def summarize(
    t0: float,
    seconds: float,
    res: dict[str, Any],
    results: list[dict[str, Any]],
    samples: list[dict[str, Any]],
    checkpoints: dict[str, dict[str, Any]],
    cpu_minutes: list[dict[str, float]],
    held_window: tuple[float, float] | None,
    metrics: dict[str, float],
    rate: float,
) -> dict[str, Any]:
    sent: dict[int, tuple[float, float]] = res["sent"]
    first: dict[int, float] = {}
    for r in results:
        for seq, t in r["records"]:
            first[seq] = min(t, first.get(seq, t))
    commits = sorted(c for _, c in sent.values())
    minutes = []
    for i in range(int(seconds // 60)):
        a, b = t0 + 60 * i, t0 + 60 * (i + 1)
        lat = sorted(first[s] - c for s, (_, c) in sent.items() if a <= c < b and s in first)
        delivered = sum(1 for t in first.values() if a <= t < b)
        inside = [s for s in samples if a <= s["t"] < b + 1e-9]
        before = [s for s in samples if s["t"] < a] or [checkpoints["start"]]
        purged = (inside[-1]["deleted"] - before[-1]["deleted"]) if inside else None
        cpu = cpu_minutes[i] if i < len(cpu_minutes) else {}
        k = max(1.0, delivered / 1000)
        minutes.append(
            {
                "minute": i + 1,
                "enqueued": sum(1 for c in commits if a <= c < b),
                "delivered": delivered,
                "purged": purged,
                "p50_ms": pct_ms(lat, 50, 2),
                "p99_ms": pct_ms(lat, 99, 2),
                "postgres_cpu_s_per_1000": round(cpu.get("postgres", 0.0) / 100 * 60 / k, 4) if cpu else None,
                "manager_cpu_s_per_1000": round(cpu.get("manager", 0.0) / 100 * 60 / k, 4) if cpu else None,
                "cpu_pct_of_one_core": cpu,
            }
        )
    out: dict[str, Any] = {
        "events": len(sent),
        "delivered": len(first),
        "missing": len(set(sent) - set(first)),
        "rate_achieved": round(len(sent) / res["elapsed"], 1),
        "checkpoints": {k: _rel(v, t0) for k, v in checkpoints.items()},
        "minutes": minutes,
        "samples": [
            {
                "t_s": round(s["t"] - t0, 1),
                "heap_kb": s["heap_bytes"] // 1024,
                "table_kb": s["table_bytes"] // 1024,
                "index_kb": s["index_bytes"] // 1024,
                "live": s["live_tuples"],
                "dead": s["dead_tuples"],
                "autovacuums": s["autovacuum_count"],
                "vacuums_by_the_leader": s["vacuum_count"],
                "warnings": len(s["warnings"]),
                "reading_ms": s["reading_ms"],
            }
            for s in samples
        ],
        "health_reading_ms": _spread([s["reading_ms"] for s in samples]),
        "manager_health_metrics": metrics,
    }
    if held_window is not None:
        out["held"] = {"from_s": round(held_window[0] - t0, 1), "released_s": round(held_window[1] - t0, 1)}
        out["recovery"] = recovery(samples, sent, first, held_window, t0)
    out["depth_max"] = max(depth_series(list(commits), list(first.values()), t0, t0 + seconds) or [0])
    out["targets"] = targets(out, rate)
    return out


def _rel(s: dict[str, Any], t0: float) -> dict[str, Any]:
    return {**s, "t": round(s["t"] - t0, 1)}


def _spread(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    v = sorted(values)
    return {"median": round(statistics.median(v), 2), "p90": round(percentile(v, 90) or 0.0, 2), "max": v[-1]}


def recovery(
    samples: list[dict[str, Any]],
    sent: dict[int, tuple[float, float]],
    first: dict[int, float],
    held: tuple[float, float],
    t0: float,
) -> dict[str, Any]:
    """How long after the release the dead tuples and the latency are back to the pre-hold figures.

    Dead tuples: back at or under the most seen in any sample before the hold (vacuum has removed
    what the snapshot kept). Latency: every 10-second window's p99 from then on within 2x the
    median window p99 before the hold.
    """
    start, released = held
    before = [s for s in samples if t0 + 60 <= s["t"] < start]
    after = [s for s in samples if s["t"] >= released]
    dead_before = max((s["dead_tuples"] for s in before), default=None)
    dead_back = next(
        (s["t"] - released for s in after if dead_before is not None and s["dead_tuples"] <= dead_before), None
    )
    windows: dict[int, list[float]] = {}
    for seq, (_, c) in sent.items():
        if seq in first:
            windows.setdefault(int((c - t0) // 10), []).append(first[seq] - c)
    p99 = {w: (percentile(v, 99) or 0.0) * 1000 for w, v in windows.items()}
    base = [v for w, v in p99.items() if t0 + 60 <= t0 + w * 10 and t0 + (w + 1) * 10 <= start]
    base_p99 = statistics.median(base) if base else None
    after_w = sorted(w for w in p99 if t0 + w * 10 >= released)
    bad = [w for w in after_w if base_p99 is not None and p99[w] > 2 * base_p99]
    lat_back = (max(bad) + 1) * 10 - (released - t0) if bad else 0.0
    held_w = [v for w, v in p99.items() if start <= t0 + w * 10 < released]
    peak = max((s["table_bytes"] + s["index_bytes"] for s in samples if s["t"] >= start), default=None)
    return {
        "dead_tuples_before_hold_max": dead_before,
        "dead_tuples_at_release": next((s["dead_tuples"] for s in after), None),
        "dead_tuples_back_after_s": None if dead_back is None else round(dead_back, 1),
        "p99_10s_windows_ms": {
            "before_hold_median": round(base_p99, 2) if base_p99 is not None else None,
            "held_worst": round(max(held_w), 2) if held_w else None,
        },
        "latency_back_after_s": round(lat_back, 1),
        "size_peak_kb": None if peak is None else peak // 1024,
    }


def targets(run: dict[str, Any], rate: float) -> dict[str, Any]:
    cp = run["checkpoints"]
    one, end = cp.get("after_1_minute"), cp.get("end")
    out: dict[str, Any] = {}
    met: dict[str, bool] = {}
    if one is not None and end is not None:
        size1 = one["table_bytes"] + one["index_bytes"]
        size_end = end["table_bytes"] + end["index_bytes"]
        growth = (size_end - size1) / size1 if size1 else None
        out["size_after_1_minute_kb"] = size1 // 1024
        out["size_end_kb"] = size_end // 1024
        out["size_growth_after_first_minute"] = None if growth is None else round(growth, 3)
        met["size_growth_under_20pct"] = growth is not None and growth < SIZE_GROWTH_MAX
        # the sizes swing with each vacuum: the last minute's samples, as a spread
        last = [s for s in run["samples"] if s["t_s"] >= end["t"] - 60]
        if last:
            totals = sorted(s["table_kb"] + s["index_kb"] for s in last)
            out["size_last_minute_kb"] = {"min": totals[0], "median": statistics.median(totals), "max": totals[-1]}
            out["size_growth_last_minute_median"] = round(statistics.median(totals) / (size1 / 1024) - 1, 3)
    # The producer is open-loop: a minute it could not keep its pace (the machine was busy) offers
    # fewer events, and that is not the queue's decay. Decay is the queue falling behind what was
    # offered (delivered / enqueued per minute), or costing more per event.
    full = [m for m in run["minutes"] if m["enqueued"]]
    if len(full) >= 3:
        keep_up = [m["delivered"] / m["enqueued"] for m in full[1:]]  # minute 1: the table fills
        out["delivered_per_minute"] = [m["delivered"] for m in full]
        out["delivered_over_enqueued_worst"] = round(min(keep_up), 4)
        out["throughput_decay"] = round(max(0.0, 1 - min(keep_up)), 3)
        met["throughput_decay_under_10pct"] = 1 - min(keep_up) <= THROUGHPUT_DECAY_MAX
        starved = [m["minute"] for m in full if m["enqueued"] < 0.9 * rate * 60]
        out["minutes_the_producer_fell_behind"] = starved
        cpu = [m["postgres_cpu_s_per_1000"] for m in full[1:] if m["postgres_cpu_s_per_1000"] is not None]
        third = max(1, len(cpu) // 3)
        if len(cpu) >= 3:
            out["postgres_cpu_per_1000_last_third_over_first"] = round(
                statistics.median(cpu[-third:]) / statistics.median(cpu[:third]), 2
            )
    rec = run.get("recovery")
    if rec is not None:
        back = [rec["dead_tuples_back_after_s"], rec["latency_back_after_s"]]
        met["recovered_within_2_minutes"] = all(b is not None and b <= RECOVER_WITHIN_S for b in back)
    out["met"] = met
    return out


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="length of each run (default 10)")
    parser.add_argument("--rate", type=float, default=500.0, help="events/s (default 500)")
    parser.add_argument("--retention", type=float, default=30.0, help="the queue's retention_seconds (default 30)")
    parser.add_argument("--runs", default="clean,held", help="clean, held or both (default clean,held)")
    parser.add_argument("--held-seconds", type=float, default=120.0, help="how long the snapshot is held (120)")
    parser.add_argument("--sample", type=float, default=10.0, help="seconds between samples (default 10)")
    parser.add_argument("--table-options", help="ALTER TABLE ... SET (these) before each run, for experiments")
    parser.add_argument("--server-set", action="append", default=[], help="NAME=VALUE for the embedded server")
    parser.add_argument(
        "--vacuum-after",
        type=float,
        default=5.0,
        help="the manager's vacuum_after (default 5; 0: leave vacuum to autovacuum alone)",
    )
    parser.add_argument("--health-interval", type=float, default=5.0, help="the manager's health_interval (default 5)")
    parser.add_argument("--held", action="store_true", help="the held run only (same as --runs held)")
    parser.add_argument("--dsn", help="administrative database of an existing server")
    parser.add_argument("--json-only", action="store_true", help="no logs on stderr (only warnings)")
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args(argv)
    runs = ["held"] if args.held else [r for r in args.runs.split(",") if r]
    if not runs or set(runs) - {"clean", "held"}:
        parser.error("--runs takes clean, held or clean,held")
    args.runs = runs
    if args.table_options and not all(_OPTION_RE.match(o) for o in args.table_options.split(",")):
        parser.error("--table-options: name=value pairs separated by commas")
    for item in args.server_set:
        if not _OPTION_RE.match(item):
            parser.error(f"--server-set {item!r}: NAME=VALUE")
    if args.minutes < 3:
        parser.error("--minutes: at least 3 (a first minute, a reference minute and one more)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the embedded server on kill
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.json_only else logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s"
    )
    settings = dict(item.split("=", 1) for item in args.server_set)
    overrides = {"vacuum_after": args.vacuum_after, "health_interval": args.health_interval}
    queue = {"partitions": 16, "shuffle": 4, "retention_seconds": args.retention}
    started = time.time()
    code = code_version()  # before the runs: the tree may change during 25 minutes
    with bench_server(args.dsn, "churn", settings) as (_admin, dsn):
        one_shard_queue(dsn, QUEUE, queue)
        with psycopg.connect(dsn, autocommit=True) as conn:
            try:
                conn.execute("CREATE EXTENSION IF NOT EXISTS pgstattuple")
                have_pgstattuple = True
            except psycopg.Error:
                have_pgstattuple = False
            options = conn.execute("SELECT reloptions FROM pg_class WHERE oid = %s::regclass", (QUEUE,)).fetchone()
        count_server(dsn)
        info = server_info(dsn)
        autovacuum = autovacuum_settings(dsn)
        runs = {}
        for name in args.runs:
            logger.info("run %s: %.0f min at %.0f/s", name, args.minutes, args.rate)
            runs[name] = run_once(dsn, args, overrides, name == "held", have_pgstattuple)
    report = {
        **header("churn"),
        **info,
        "autovacuum": autovacuum,
        "code": code,
        "params": {
            "minutes": args.minutes,
            "rate": args.rate,
            "held_seconds": args.held_seconds,
            "queue": {"name": QUEUE, **queue},
            "table_options_at_create": options[0] if options else None,
            "table_options_set": args.table_options,
            "server_set": settings,
            "credit": CREDIT,
            "manager": overrides,
            "pgstattuple": have_pgstattuple,
        },
        "runs": runs,
        "met": {name: run["targets"]["met"] for name, run in runs.items()},
        "wall_s": round(time.time() - started, 1),
    }
    emit(report)
    return 0


if __name__ == "__main__":
    run_main(main)
