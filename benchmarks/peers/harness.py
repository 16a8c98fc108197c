"""What the peers' benchmarks share: a scratch database, worker processes started together at a
"go", open-loop pacing, and the one-line JSON output.

Timestamps that cross processes are ``time.time()``, as in the e2e benchmark: every process and
the server run on one machine, so they share one clock.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import secrets
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql

from benchmarks.lib.machine import code_version, count_server, cpu_delta, cpu_snapshot, machine_info
from benchmarks.lib.timings import first_receipts, latencies
from benchmarks.lib.wal import insert_lsn, wal_cost

CTX = mp.get_context("spawn")
#: warm-up events before the latency measurement (per 200 events/s, as the e2e benchmark)
LATENCY_WARMUP = 20


def log(msg: str, *args: Any) -> None:
    print(time.strftime("%H:%M:%S"), msg % args if args else msg, file=sys.stderr, flush=True)


def parse_args(description: str, options: Callable[[argparse.ArgumentParser], None]) -> argparse.Namespace:
    """``drain`` or ``latency``, the options both peers take, and the peer's own (``options``)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("measurement", choices=("drain", "latency"))
    parser.add_argument("--dsn", required=True, help="administrative database of the server to measure on")
    parser.add_argument("--events", type=int, default=None, help="drain: backlog (20000); latency: events (500)")
    parser.add_argument("--procs", type=int, default=2, help="drain: worker processes (default 2)")
    parser.add_argument("--rate", type=float, default=200.0, help="latency: events/s (default 200)")
    parser.add_argument("--budget", type=float, default=150.0, help="seconds before a drain stops itself")
    options(parser)
    args = parser.parse_args()
    if args.events is None:
        args.events = 20_000 if args.measurement == "drain" else 500
    if min(args.events, args.procs) < 1 or args.rate <= 0 or args.budget <= 0:
        parser.error("--events, --procs, --rate and --budget must be positive")
    return args


def url_for(admin_dsn: str, dbname: str) -> str:
    """``admin_dsn`` (a postgresql:// URL: asyncpg takes no other form) with another database."""
    parts = urlsplit(admin_dsn)
    if parts.scheme not in ("postgresql", "postgres"):
        raise SystemExit(f"--dsn must be a postgresql:// URL, got {admin_dsn!r}")
    return urlunsplit((parts.scheme, parts.netloc, "/" + dbname, parts.query, parts.fragment))


@contextlib.contextmanager
def scratch_database(admin_dsn: str, prefix: str) -> Iterator[str]:
    """A fresh database on the server of ``admin_dsn``, dropped at the end; yields its DSN."""
    name = f"qm_peer_{prefix}_{secrets.token_hex(4)}"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield url_for(admin_dsn, name)
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def settle(dsn: str, tables: list[str]) -> None:
    """After the untimed preload: ANALYZE and CHECKPOINT, as the e2e benchmark does before a drain."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for table in tables:
            conn.execute(sql.SQL("ANALYZE {}").format(sql.Identifier(*table.split("."))))
        conn.execute("CHECKPOINT")


def scalar(dsn: str, query: str) -> Any:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(query).fetchone()  # type: ignore[call-overload]
    return row[0] if row else None


def server_info(dsn: str) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT current_setting('server_version'), current_setting('fsync'), current_setting('synchronous_commit')"
        ).fetchone()
    assert row is not None
    return {"postgres": row[0], "settings": {"fsync": row[1], "synchronous_commit": row[2]}}


# --------------------------------------------------------------------------- workers


@dataclass
class Worker:
    """What a worker process gets: its index, the barrier and the parent's counters."""

    idx: int
    ready: Any
    go: Any
    stop: Any
    handled: Any  # shared count of handler starts
    out_q: Any

    async def wait_go(self) -> float:
        """Say ready, wait for the parent's go (polling: the event loop stays free); the go time."""
        self.ready.set()
        while not self.go.is_set():
            await asyncio.sleep(0.001)
        return time.time()

    async def wait_stop(self) -> None:
        while not self.stop.is_set():
            await asyncio.sleep(0.05)


def single_worker() -> Worker:
    """A worker the caller starts and stops itself (the latency measurement's one)."""
    return Worker(0, CTX.Event(), CTX.Event(), CTX.Event(), CTX.Value("q", 0, lock=False), CTX.Queue())


def run_workers(
    target: Callable[..., None], count: int, args: tuple[Any, ...], budget: float, dsn: str
) -> tuple[float, list[dict[str, Any]], dict[str, float], dict[str, Any]]:
    """``count`` spawn processes running ``target(worker, *args)``, started together.

    A worker sets up (connects, registers its handler), calls ``worker.wait_go()``, works, puts
    one dict on ``worker.out_q`` (with ``t_end``, time.time()), then waits for ``worker.stop``
    before it closes its connections. The parent sets ``stop`` once it has every report, or when
    ``budget`` seconds have passed (each report then says ``stopped_by_parent``). Returns the go
    time, the reports, the CPU use from go to the last report (% of one core) and what that
    interval cost: its seconds, WAL bytes and commit records (``wall_s``, ``wal``).
    """
    go, stop, out_q = CTX.Event(), CTX.Event(), CTX.Queue()
    workers = [Worker(i, CTX.Event(), go, stop, CTX.Value("q", 0, lock=False), out_q) for i in range(count)]
    procs = [CTX.Process(target=target, args=(w, *args), daemon=True) for w in workers]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 60
    for w in workers:
        if not w.ready.wait(max(0.1, deadline - time.monotonic())):
            for p in procs:
                p.kill()
            raise RuntimeError("a worker process did not become ready within 60 s")
    time.sleep(0.3)  # every worker is waiting for go
    count_server(dsn)
    lsn_conn = psycopg.connect(dsn, autocommit=True)
    lsn0 = insert_lsn(lsn_conn)
    snap = cpu_snapshot()
    t0 = time.time()
    go.set()
    results: list[dict[str, Any]] = []
    stop_deadline = time.monotonic() + budget
    stopped = False
    while len(results) < count:
        if not stopped and time.monotonic() > stop_deadline:
            stop.set()
            stopped = True
            stop_deadline = time.monotonic() + 30  # time to flush and report
        elif stopped and time.monotonic() > stop_deadline:
            break
        with contextlib.suppress(Exception):  # queue.Empty
            results.append(out_q.get(timeout=0.05))
    snap1 = cpu_snapshot()
    lsn1 = insert_lsn(lsn_conn)
    lsn_conn.close()
    cpu = cpu_delta(snap, snap1, {"workers": [int(p.pid or 0) for p in procs]})
    cost = {"wall_s": snap1.at - snap.at, "wal": wal_cost(dsn, lsn0, lsn1)}
    stop.set()
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    for r in results:
        r["stopped_by_parent"] = stopped
    return t0, results, cpu, cost


def drain_report(
    t0: float, results: list[dict[str, Any]], procs: int, events: int, cpu: dict[str, float], cost: dict[str, Any]
) -> dict[str, Any]:
    """The drain's figures, named as the e2e benchmark's: every event handled once, events/s to the
    last worker's return (its acks committed), and per job handled the CPU microseconds of
    PostgreSQL and of the workers, the WAL bytes and the commit records (``per_event``)."""
    handled = sum(r["handled"] for r in results)
    ids = [i for r in results for i in r["ids"]]
    t_end = max((r["t_end"] for r in results), default=float("nan"))
    elapsed = t_end - t0
    return {
        "jobs": events,
        "handled": handled,
        "duplicates": len(ids) - len(set(ids)),
        "elapsed_s": round(elapsed, 3),
        "jobs_per_s": round(handled / elapsed, 1) if elapsed > 0 else None,
        "timed_out": len(results) < procs or any(r["stopped_by_parent"] for r in results),
        "errors": [r["error"] for r in results if r.get("error")],
        "cpu": cpu,
        "per_event": per_job(cpu, cost, handled),
    }


def per_job(cpu: dict[str, float], cost: dict[str, Any], n: int) -> dict[str, float | None]:
    """Per job handled: the CPU microseconds of PostgreSQL and of the workers (from % of one core
    over the interval), the WAL bytes and the commit records; the e2e benchmark's names."""
    if n <= 0:
        return {}
    wall, wal = cost["wall_s"], cost["wal"]
    out: dict[str, float | None] = {
        f"{k}_cpu_us": round(cpu[k] / 100 * wall / n * 1e6, 2) for k in ("postgres", "workers") if k in cpu
    }
    out["wal_bytes"] = round(wal["bytes"] / n, 1)
    out["commits"] = None if wal["commits"] is None else round(wal["commits"] / n, 3)
    return out


# --------------------------------------------------------------------------- latency


def pacing(rate: float, total: int) -> Iterator[tuple[int, float]]:
    """Open-loop pacing: (k, seconds to wait) with event k due at t0 + k/rate (no drift)."""
    t0 = time.monotonic()
    for k in range(total):
        yield k, max(0.0, t0 + k / rate - time.monotonic())


async def paced_sends(
    rate: float, total: int, warmup: int, send: Callable[[int, float], Awaitable[object]]
) -> tuple[dict[int, tuple[float, float]], float]:
    """A peer's producer, open loop at ``rate``: ``send(seq, t_call)`` for ``total`` events, seq from
    -``warmup`` on (negative: warm-up, not measured). Returns per seq (the call's time, its
    return's) and the seconds the sends took."""
    sent: dict[int, tuple[float, float]] = {}
    started = time.monotonic()
    for k, wait in pacing(rate, total):
        if wait:
            await asyncio.sleep(wait)
        seq = k - warmup
        t_call = time.time()
        await send(seq, t_call)
        sent[seq] = (t_call, time.time())
    return sent, time.monotonic() - started


def latency_run(
    target: Callable[..., None],
    worker_args: tuple[Any, ...],
    produce: Callable[[int, int], tuple[dict[int, tuple[float, float]], float]],
    rate: float,
    events: int,
) -> dict[str, Any]:
    """The latency measurement around one peer's worker and producer: ``target(worker,
    *worker_args)`` in a spawned process, started and left to idle, then ``produce(total, warmup)``
    (it sends ``total`` jobs paced at the rate, the first ``warmup`` of them not measured, and
    returns what it sent and how long it took), then the worker's receipts, as :func:`latency_report`."""
    warmup = max(LATENCY_WARMUP, int(LATENCY_WARMUP * rate / 200))
    total = warmup + events
    w = single_worker()
    proc = CTX.Process(target=target, args=(w, *worker_args), daemon=True)
    proc.start()
    if not w.ready.wait(60):
        proc.kill()
        raise RuntimeError("the worker did not become ready within 60 s")
    w.go.set()
    time.sleep(1.5)  # the worker has set up, listens and found the queue empty: idle
    sent, elapsed = produce(total, warmup)
    deadline = time.monotonic() + 30
    while w.handled.value < total and time.monotonic() < deadline:
        time.sleep(0.02)
    w.stop.set()
    res = w.out_q.get(timeout=60)
    proc.join(timeout=10)
    out = latency_report(sent, res["receipts"], events, warmup, elapsed)
    out["errors"] = [res["error"]] if res.get("error") else []
    return out


def latency_report(
    sent: dict[int, tuple[float, float]], receipts: list[tuple[int, float]], n: int, warmup: int, elapsed: float
) -> dict[str, Any]:
    """Raw timings in seconds (the e2e benchmark summarises them): commit returned -> handler
    start, call start -> handler start, and the enqueue call, for every measured event."""
    first, duplicates = first_receipts(receipts)
    enqueue, commit, call = latencies(sent, first)
    return {
        "jobs": n,
        "warmup_jobs": warmup,
        "rate_achieved": round((n + warmup) / elapsed, 1) if elapsed > 0 else None,
        "handled": len(commit),
        "missing": n - len(commit),
        "duplicates": duplicates,
        "timings_s": {"commit_to_handler_start": commit, "call_to_handler_start": call, "enqueue_call": enqueue},
    }


def emit(lib: str, version: str, measurement: str, dsn: str, result: dict[str, Any], **extra: Any) -> None:
    """One JSON line on stdout."""
    out = {
        "lib": lib,
        "version": version,
        "measurement": measurement,
        **extra,
        **server_info(dsn),
        "machine": machine_info(),
        "code": code_version(),
        **result,
    }
    print(json.dumps(out), flush=True)
