"""Scheduled events behind a large backlog: fire lateness at 1 000/s and 4 000/s on one shard.

Prints one JSON object on stdout (logs go to stderr). One shard (an embedded PostgreSQL server
with the default durability, or ``--dsn``), one queue (``bench_q``, 16 partitions, shuffle 4,
the default window of 30 s and cache of 10 000 events), one manager process, one receiver process
(credit ``--credit``, a no-op handler that records each event's fire_at and its handler start):

* **backlog**: ``--events`` (2 000 000; 10 000 000 with ``ARGS="--events 10000000"``) events
  scheduled over the next hour, inserted untimed by ``INSERT ... SELECT generate_series`` with
  each row's partition given (one of its tenant's shuffle set, so the route trigger does not run;
  the verify trigger checks every row), then ``qm.reconcile_load``, ANALYZE and CHECKPOINT. Their
  fire_at values are spread evenly from just after the last measured phase to one hour after the
  load: the measured phases fire only their own events;
* **phases**: for each rate of ``--rates`` (1 000 and 4 000 events/s), a new manager and the
  receiver start; once the manager leads and the receiver listens, ``rate x --seconds`` events are
  inserted (a generate_series too, one statement: one notice), scheduled evenly over ``--seconds``
  (30) from ``--lead`` (5) seconds after their insert on; from the phase's start to its end a
  producer process schedules new events (``--schedule-rate``, 100/s, one autocommit INSERT each,
  fire_at uniform over the next hour). Measured over the phase: fire lateness (the receiver's
  handler start minus fire_at, both on this machine's clock; p50/p99/max, how many early: the
  manager promises none), the database's part of it (``fired_at``, the fire statement's
  transaction start, minus fire_at), events missing after the phase, the manager's resident memory
  (``VmRSS`` every 0.25 s and ``VmHWM``), CPU of the manager, the receiver and PostgreSQL per
  fired event and in % of one core (with ``rest_of_machine``: other work on a shared machine),
  the window cache's reads (the manager's scan statements per second and the rows they read per
  second), and the manager's calls over 20 ms and event-loop stalls (``slow_calls``).

Target: fire lateness p99 under 10 ms at both rates, none early; the manager's memory bounded by
the window (the cache holds at most ``cache_size`` (id, tenant, partition, fire_at) entries),
not by the backlog: compare ``manager_rss_mb`` of runs with 2 M and 10 M events.

    .venv/bin/python -m benchmarks.scheduled [--events 2000000] [--rates 1000,4000] [--seconds 30]
                                            [--reps 1] [--schedule-rate 100] [--quick] [--dsn URI]
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import random
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from benchmarks.lib import fleet
from benchmarks.lib.backlog import checkpoint
from benchmarks.lib.fleet import manager_process, start_receivers
from benchmarks.lib.machine import code_version, count_server, cpu_delta, cpu_snapshot
from benchmarks.lib.procs import TENANTS
from benchmarks.lib.report import emit, header, median_of, summary_ms
from benchmarks.lib.server import QUEUE, bench_server, one_shard_queue, server_info

logger = logging.getLogger("bench.scheduled")

CTX = mp.get_context("spawn")
QUEUE_SETTINGS: dict[str, Any] = {"partitions": 16, "shuffle": 4}
P99_TARGET_MS = 10.0
#: rows per INSERT ... SELECT of the backlog (one transaction each)
CHUNK = 500_000
#: the backlog's first fire_at, after the last measured phase (seconds after the load)
HORIZON_S = 3600.0


def log(msg: str, *args: Any) -> None:
    logger.info(msg, *args)


# --------------------------------------------------------------------------- set-up


def tenants_table(conn: psycopg.Connection[Any], partitions: int, shuffle: int) -> None:
    """A temporary table of the benchmark's tenants and their shuffle sets (``qm.shuffle_set``)."""
    conn.execute("CREATE TEMP TABLE IF NOT EXISTS bench_tenants (i integer PRIMARY KEY, name text, parts smallint[])")
    conn.execute("TRUNCATE bench_tenants")
    with conn.cursor().copy("COPY bench_tenants (i, name) FROM STDIN") as cp:
        for i, t in enumerate(TENANTS):
            cp.write_row((i, t))
    conn.execute("UPDATE bench_tenants SET parts = qm.shuffle_set(name, %s, %s)", (partitions, shuffle))
    conn.execute("ANALYZE bench_tenants")


def insert_spread(conn: psycopg.Connection[Any], n: int, first_s: float, span_s: float, seed: int) -> tuple[int, int]:
    """``n`` events with fire_at from now + ``first_s`` evenly over ``span_s`` seconds, their
    partitions given (one of the tenant's shuffle set), in chunks of CHUNK rows, one transaction
    each; returns the (first, last) id inserted."""
    k = int(QUEUE_SETTINGS["shuffle"])
    nt = len(TENANTS)
    tenants_table(conn, int(QUEUE_SETTINGS["partitions"]), k)
    stmt = sql.SQL(
        "WITH ins AS (INSERT INTO {} (tenant, partition, payload, fire_at) "
        "SELECT t.name, t.parts[1 + (g * 7 + %(seed)s) %% %(k)s], jsonb_build_object('n', g), "
        "%(base)s::timestamptz + make_interval(secs => %(first)s::float8 + %(span)s::float8 * g / %(n)s::float8) "
        "FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) g "
        "JOIN bench_tenants t ON t.i = (g * 31 + %(seed)s) %% %(nt)s ORDER BY g RETURNING id) "
        "SELECT min(id), max(id) FROM ins"
    ).format(sql.Identifier(QUEUE))
    row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    params = {"seed": seed, "k": k, "base": row[0], "first": first_s, "span": span_s, "n": n, "nt": nt}
    first_id, last_id = None, None
    for lo in range(0, n, CHUNK):
        with conn.transaction():
            got = conn.execute(stmt, {**params, "lo": lo, "hi": min(n, lo + CHUNK) - 1}).fetchone()
        assert got is not None
        first_id = got[0] if first_id is None else first_id
        last_id = got[1]
    conn.execute("SELECT qm.reconcile_load(%s)", (QUEUE,))
    assert first_id is not None and last_id is not None
    return int(first_id), int(last_id)


def load_backlog(dsn: str, n: int, first_s: float) -> dict[str, Any]:
    """The untimed backlog: ``n`` events from ``first_s`` to HORIZON_S seconds from now."""
    t = time.perf_counter()
    with psycopg.connect(dsn, autocommit=True) as conn:
        insert_spread(conn, n, first_s, HORIZON_S - first_s, 1)
        inserted = time.perf_counter() - t
        conn.execute(sql.SQL("ANALYZE {}").format(sql.Identifier(QUEUE)))
        checkpoint(conn)
        size = conn.execute("SELECT pg_total_relation_size(%s)", (QUEUE,)).fetchone()
    return {
        "events": n,
        "insert_s": round(inserted, 1),
        "insert_rows_per_s": round(n / inserted),
        "total_s": round(time.perf_counter() - t, 1),
        "table_and_indexes_mb": round(int(size[0]) / 2**20, 1) if size else None,
    }


# --------------------------------------------------------------------------- producer


def schedule_new(dsn: str, rate: float, seconds: float, seed: int, go: Any, out_q: Any) -> None:
    """A producer process: from ``go`` on, one autocommit INSERT of an event scheduled uniformly
    over the next hour every 1/``rate`` seconds (open loop) for ``seconds``; reports how many."""
    rng = random.Random(seed)
    sent = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.cursor()
        stmt = f"INSERT INTO {QUEUE} (tenant, payload, fire_at) VALUES (%s, %s, now() + make_interval(secs => %s))"
        go.wait(120)
        start = time.monotonic()
        total = int(rate * seconds)
        for k in range(total):
            delay = start + k / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            cur.execute(stmt, (rng.choice(TENANTS), '{"new": true}', rng.uniform(1.0, HORIZON_S)), prepare=True)
            sent += 1
    out_q.put({"sent": sent, "elapsed_s": round(time.monotonic() - start, 2)})


# --------------------------------------------------------------------------- one phase


def rss_kb(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process in kB, (0, 0) when it is gone."""
    rss = hwm = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1])
    except OSError:
        pass
    return rss, hwm


def run_phase(
    dsn: str,
    rate: int,
    seconds: float,
    lead: float,
    credit: int,
    schedule_rate: float,
    seed: int,
    profile: str | None = None,
) -> dict[str, Any]:
    n = int(rate * seconds)
    prod_q, prod_go = CTX.Queue(), CTX.Event()
    with manager_process(dsn, None, profile) as m:
        recv = start_receivers(1, m.url, "fire", credit, 32)
        prod = CTX.Process(target=schedule_new, args=(dsn, schedule_rate, seconds, seed, prod_go, prod_q), daemon=True)
        prod.start()
        try:
            recv.wait_ready()
            recv.go.set()
            # the phase's events, inserted once the manager leads and the receiver listens (one
            # statement: one notice), fire_at in [t0, t1) (database clock = this machine's clock)
            with psycopg.connect(dsn, autocommit=True) as conn:
                first_id, last_id = insert_spread(conn, n, lead, seconds, seed)
                row = conn.execute("SELECT extract(epoch FROM now())::float8").fetchone()
            assert row is not None
            t0 = float(row[0]) + lead
            t1 = t0 + seconds
            if time.time() > t0 - 1:
                logger.warning(
                    "phase %d/s: its events were inserted only %.2f s before the first is due", rate, t0 - time.time()
                )
            base_rss = rss_kb(int(m.proc.pid))[0]
            while time.time() < t0:
                time.sleep(0.005)
            groups = {"manager": [int(m.proc.pid)], "receivers": recv.pids(), "producer": [int(prod.pid or 0)]}
            snap0 = cpu_snapshot()
            snap0_wall = time.time()
            m.reset_ev.set()
            prod_go.set()
            rss: list[int] = []
            while time.time() < t1:
                rss.append(rss_kb(int(m.proc.pid))[0])
                time.sleep(0.25)
            snap1 = cpu_snapshot()
            hwm = rss_kb(int(m.proc.pid))[1]
            deadline = time.monotonic() + 30
            while recv.handled_total() < n and time.monotonic() < deadline:
                time.sleep(0.02)
            produced = prod_q.get(timeout=60)
            prod.join(timeout=10)
        finally:
            results = recv.finish()
    records = [r for res in results for r in res.get("records", [])]
    lateness = [t - fire_at for (ident, fire_at, t, _attempt) in records if first_id <= ident <= last_id]
    seen = {ident for (ident, *_rest) in records if first_id <= ident <= last_id}
    early = sum(1 for x in lateness if x < 0)
    with psycopg.connect(dsn, autocommit=True) as conn:
        db_late = [
            float(r[0])
            for r in conn.execute(
                sql.SQL(
                    "SELECT extract(epoch FROM fired_at - fire_at)::float8 FROM {} "
                    "WHERE id BETWEEN %s AND %s AND fired_at IS NOT NULL"
                ).format(sql.Identifier(QUEUE)),
                (first_id, last_id),
            ).fetchall()
        ]
    wall = snap1.at - snap0.at
    cpu = cpu_delta(snap0, snap1, groups)
    fired_in_phase = len(lateness)
    calls = m.counters()
    per_s = {
        name: {"calls_per_s": round(c["calls"] / wall, 1), "rows_per_s": round(c["items"] / wall, 1)}
        for name, c in calls.items()
        if name in ("scan", "fire", "fire_due")
    }
    out = {
        "rate": rate,
        "seconds": seconds,
        "events": n,
        "received": len(seen),
        "missing": n - len(seen),
        "lateness": summary_ms(lateness),
        "early": early,
        "fired_minus_fire_at": summary_ms(db_late),
        "manager_rss_mb": {
            "before": round(base_rss / 1024, 1),
            "median": round(statistics.median(rss) / 1024, 1) if rss else None,
            "max": round(max(rss) / 1024, 1) if rss else None,
            "hwm": round(hwm / 1024, 1),
        },
        "cpu_pct_of_one_core": cpu,
        "cpu_us_per_fired_event": {
            k: round(v / 100 * wall / max(1, fired_in_phase) * 1e6, 1)
            for k, v in cpu.items()
            if k in ("postgres", "manager", "receivers")
        },
        "cache_reads": per_s,
        "manager_db_calls": calls,
        "scheduled_new": produced,
        "slow_calls": slow_calls(m.info.get("slow", []), snap0_wall, snap0_wall + wall),
    }
    return out


def slow_calls(slow: list[tuple[str, float, float]], start: float, end: float) -> dict[str, Any]:
    """The manager's database calls (and event-loop stalls: ``loop_lag``) over 20 ms in the phase,
    by name: how many and the longest (ms)."""
    out: dict[str, Any] = {}
    for name, at, took in slow:
        if start <= at <= end:
            e = out.setdefault(name, {"count": 0, "max_ms": 0.0})
            e["count"] += 1
            e["max_ms"] = round(max(e["max_ms"], took * 1000), 1)
    return out


# --------------------------------------------------------------------------- orchestration


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--events", type=int, default=2_000_000, help="events scheduled over the hour (default 2000000)"
    )
    parser.add_argument("--rates", default="1000,4000", help="fire rates of the measured phases (default 1000,4000)")
    parser.add_argument("--seconds", type=float, default=30.0, help="seconds of each phase (default 30)")
    parser.add_argument("--lead", type=float, default=5.0, help="seconds from a phase's insert to its first fire_at")
    parser.add_argument("--reps", type=int, default=1, help="phases per rate (default 1; medians reported)")
    parser.add_argument("--credit", type=int, default=1000, help="the receiver's credit (default 1000)")
    parser.add_argument("--schedule-rate", type=float, default=100.0, help="new events scheduled per second (100)")
    parser.add_argument("--dsn", help="administrative database of an existing server (default: an embedded one)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 100 000 events, phases of 10 s")
    parser.add_argument("--profile", help="directory: the manager's cProfile of each phase (manager-<rate>.prof)")
    parser.add_argument("--json-only", action="store_true", help="no logs on stderr (only warnings)")
    args = parser.parse_args(argv)
    try:
        args.rates = [int(x) for x in args.rates.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--rates must be comma-separated integers, got {args.rates!r}")
    if args.quick:
        args.events, args.seconds = 100_000, 10.0
    if not args.rates or min(args.rates) < 1 or args.events < 1 or args.seconds <= 0 or args.reps < 1:
        parser.error("--rates, --events, --seconds and --reps must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.json_only else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(message)s",
    )
    started = time.monotonic()
    code = code_version()
    phases_span = len(args.rates) * args.reps * (args.seconds + args.lead + 30) + 120
    with bench_server(args.dsn, "scheduled") as (_admin, dsn):
        log("benchmark database: %s", conninfo_to_dict(dsn).get("dbname"))
        one_shard_queue(dsn, QUEUE, QUEUE_SETTINGS)
        info = server_info(dsn)
        count_server(dsn)
        log("loading %d scheduled events", args.events)
        backlog = load_backlog(dsn, args.events, phases_span)
        log("backlog loaded: %s", backlog)
        runs: dict[int, list[dict[str, Any]]] = {r: [] for r in args.rates}
        for rep in range(args.reps):
            for rate in args.rates:
                prof = None if args.profile is None else str(Path(args.profile) / f"manager-{rate}.prof")
                r = run_phase(dsn, rate, args.seconds, args.lead, args.credit, args.schedule_rate, 100 + rep, prof)
                runs[rate].append(r)
                lt = r["lateness"]
                log(
                    "phase %d/s rep=%d lateness p50=%s p99=%s max=%s ms early=%d missing=%d rss=%s MB scans/s=%s",
                    rate,
                    rep + 1,
                    lt.get("p50_ms"),
                    lt.get("p99_ms"),
                    lt.get("max_ms"),
                    r["early"],
                    r["missing"],
                    r["manager_rss_mb"]["max"],
                    r["cache_reads"].get("scan", {}).get("calls_per_s"),
                )
    summary = {}
    for rate, rs in runs.items():
        lat = [x["lateness"] for x in rs]
        summary[f"{rate}_per_s"] = {
            "p50_ms": median_of(lat, "p50_ms"),
            "p99_ms": median_of(lat, "p99_ms"),
            "max_ms": median_of(lat, "max_ms"),
            "p99_ms_samples": [x.get("p99_ms") for x in lat],
            "early": sum(x["early"] for x in rs),
            "missing": sum(x["missing"] for x in rs),
            "manager_rss_mb_max": max(x["manager_rss_mb"]["max"] or 0 for x in rs),
            "scans_per_s": median_of([x["cache_reads"].get("scan", {}) for x in rs], "calls_per_s"),
            "scan_rows_per_s": median_of([x["cache_reads"].get("scan", {}) for x in rs], "rows_per_s"),
            "manager_cpu_us_per_event": median_of([x["cpu_us_per_fired_event"] for x in rs], "manager"),
            "postgres_cpu_us_per_event": median_of([x["cpu_us_per_fired_event"] for x in rs], "postgres"),
        }
    met = {
        f"p99_under_{P99_TARGET_MS:g}ms_at_{rate}_per_s": s["p99_ms"] is not None and s["p99_ms"] < P99_TARGET_MS
        for rate, s in zip(args.rates, summary.values(), strict=True)
    }
    met["never_early"] = all(s["early"] == 0 for s in summary.values())
    met["nothing_missing"] = all(s["missing"] == 0 for s in summary.values())
    met["all"] = all(met.values())
    emit(
        {
            **header("scheduled"),
            **info,
            "code": code,
            "params": {
                "queue": {"name": QUEUE, **QUEUE_SETTINGS},
                "events": args.events,
                "rates": args.rates,
                "seconds": args.seconds,
                "lead": args.lead,
                "reps": args.reps,
                "credit": args.credit,
                "schedule_rate": args.schedule_rate,
            },
            "backlog": backlog,
            "summary": summary,
            "phases": runs,
            "targets": {"lateness_p99_ms_max": P99_TARGET_MS, "early": 0},
            "met": met,
            "manager_stop_hangs": len(fleet.stop_hangs),
            "wall_s": round(time.monotonic() - started, 1),
        }
    )
    for k, v in met.items():
        if k != "all" and not v:
            print(f"target missed: {k}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
