"""End to end on one shard: backlog drain, commit-to-receipt latency, fire accuracy, and the peers.

Prints one JSON object on stdout (logs go to stderr). One shard (one database), one queue
(``bench_q``, 16 partitions, shuffle 4, other settings default), no-op receivers:

* **drain**: ``--events`` events preloaded untimed (``producer.enqueue_batch``, then ANALYZE and
  CHECKPOINT); a manager process leads and idles; the clock starts when the receiver processes are
  told to start (they connect, subscribe and ack) and stops when the receivers have been told that
  every event's ack is committed (``ack_result``; the manager answers only after the commit). The
  database is checked afterwards: every event ``acked``. Events/s for each configuration
  (receiver processes x credit), each the median of ``--reps``;
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
* **peers** (``--peers``, on by default for a full run): PgQueuer and Procrastinate ``process`` (drain)
  and ``latency`` from ``/work/shared/bench/peers`` (``PEERS_DIR``), in their best configurations,
  on the same PostgreSQL server (``PEERS_DSN``), with their own virtualenv ``/tmp/peers-venv``
  (created with their ``setup_venv.sh`` when missing). The report gives our drain / the faster
  peer's best drain (target >= 1.5), our latency p50 and p99 at 200/s / the faster peer's
  (target <= 1.0) and our fire lateness p99 (target < 5 ms).

Also reported: events lost or stuck (``met.nothing_lost``), the manager's database calls during
each run (count, ms per call, items per call: ``manager_db_calls``), CPU per process group in % of
one core including ``rest_of_machine`` (other work on a shared machine; for the peers too),
``manager_stop_hangs`` (managers whose ``run()`` did not return within 5 s of ``request_stop()``:
their process is ended so the run goes on), and with ``--profile`` one extra drain under cProfile
(top functions on stderr and in ``profile``).

Processes: the manager runs in its own process, each receiver in its own process, the producer in
its own process (``multiprocessing`` spawn; entry points in ``benchmarks/_e2e_procs.py``). Unless
``--dsn`` is given, the run starts its own embedded PostgreSQL server with the default durability
(fsync and synchronous_commit on) in a temporary directory and stops it at the end; with ``--dsn``
(an administrative database of an existing server) it creates a throw-away database there.

    .venv/bin/python benchmarks/e2e.py [--quick] [--events 100000] [--reps 3] [--receivers 1,2]
                                       [--credit 1000,4000] [--no-peers] [--profile] [--dsn URI] [--json-only]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import multiprocessing as mp
import os
import pstats
import random
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # spawned children import the entry points from here
    sys.path.insert(0, str(HERE))

import _e2e_procs as procs  # noqa: E402
from _bench_common import bench_server, machine_info, one_shard_queue, server_info  # noqa: E402

from queue_manager.producer import Event, enqueue_batch  # noqa: E402

logger = logging.getLogger("bench.e2e")

QUEUE = procs.QUEUE
QUEUE_SETTINGS = {"partitions": 16, "shuffle": 4}
PEERS_DIR = Path(os.environ.get("PEERS_DIR", "/work/shared/bench/peers"))
PEERS_VENV = Path(os.environ.get("PEERS_VENV", "/tmp/peers-venv"))
DRAIN_TARGET = 1.5  # our drain / the faster peer's best drain
LATENCY_TARGET = 1.0  # our p50 and p99 at 200/s / the faster peer's: no worse
FIRE_P99_TARGET_MS = 5.0
LATENCY_WARMUP = 20  # per 200 events/s; scaled with the rate
FIRE_LEAD_S = 3.0  # the first fire_at is this far after the insert
LATENCY_CREDIT = 100  # the receiver's default credit, for latency and fire accuracy
STALL_TIMEOUT = 30.0  # a drain whose ack count does not move for this long is reported as timed out
_CTX = mp.get_context("spawn")


def log(msg: str, *args: Any) -> None:
    logger.info(msg, *args)


# --------------------------------------------------------------------------- statistics


def percentile(sorted_vals: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile (p in 0..100) of a sorted list (as the peers' harness)."""
    if not sorted_vals:
        return float("nan")
    k = (len(sorted_vals) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    if lo == hi:
        return float(sorted_vals[lo])
    return float(sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (k - lo))


def summary_ms(values_s: Sequence[float]) -> dict[str, Any]:
    """min/p50/p95/p99/max/mean in ms, and how many values exceed 100 ms and 1 s."""
    v = sorted(x * 1000.0 for x in values_s)
    if not v:
        return {"n": 0}
    return {
        "n": len(v),
        "over_100ms": sum(1 for x in v if x > 100.0),
        "over_1s": sum(1 for x in v if x > 1000.0),
        "min_ms": round(v[0], 3),
        "p50_ms": round(percentile(v, 50), 3),
        "p95_ms": round(percentile(v, 95), 3),
        "p99_ms": round(percentile(v, 99), 3),
        "max_ms": round(v[-1], 3),
        "mean_ms": round(sum(v) / len(v), 3),
    }


def median_of(samples: Sequence[dict[str, Any]], key: str) -> float | None:
    vals = [
        s[key] for s in samples if s.get(key) is not None and not (isinstance(s[key], float) and math.isnan(s[key]))
    ]
    return round(statistics.median(vals), 3) if vals else None


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 3)


# --------------------------------------------------------------------------- CPU accounting

_CLK = os.sysconf("SC_CLK_TCK")


def _proc_ticks() -> dict[int, tuple[str, int, int, int]]:
    """pid -> (command, parent pid, CPU ticks used (utime + stime), ticks of its reaped children)."""
    out: dict[int, tuple[str, int, int, int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                s = f.read()
        except OSError:
            continue
        comm = s[s.index("(") + 1 : s.rindex(")")]
        rest = s[s.rindex(")") + 2 :].split()
        out[int(d)] = (comm, int(rest[1]), int(rest[11]) + int(rest[12]), int(rest[13]) + int(rest[14]))
    return out


@dataclass
class CpuSnap:
    busy: int
    ticks: dict[int, tuple[str, int, int, int]]
    at: float
    children: float  # CPU seconds of this process's reaped children (subprocesses such as the peers)


def cpu_snapshot() -> CpuSnap:
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    idle = parts[3] + parts[4]
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return CpuSnap(sum(parts[:8]) - idle, _proc_ticks(), time.monotonic(), ru.ru_utime + ru.ru_stime)


def cpu_delta(
    a: CpuSnap, b: CpuSnap, groups: Mapping[str, Sequence[int]], reaped_group: str | None = None
) -> dict[str, float]:
    """CPU use between two snapshots in % of ONE core (200 = both cores of a 2-core machine busy).

    ``postgres`` counts the benchmark server's processes only when its postmaster is known (live
    backends, plus the backends that exited, through the postmaster's reaped-children time);
    ``groups`` are our processes by pid; ``reaped_group`` names the CPU of subprocesses this process
    started and reaped in the window (a peer benchmark and its workers); ``rest_of_machine`` is
    everything else that ran, e.g. other work on a shared machine.
    """
    wall = b.at - a.at
    if wall <= 0:
        return {}

    def pct(ticks: float) -> float:
        return round(ticks / _CLK / wall * 100, 1)

    out = {"machine_busy": pct(b.busy - a.busy)}
    ours = 0.0
    pg = 0.0
    for pid, (comm, ppid, t, reaped) in b.ticks.items():
        if comm == "postgres" and (POSTMASTER is None or pid == POSTMASTER or ppid == POSTMASTER):
            before = a.ticks.get(pid)
            pg += t - (before[2] if before else 0)
            if pid == POSTMASTER:
                pg += reaped - (before[3] if before else 0)
    out["postgres"] = pct(pg)
    ours += pg
    for name, pids in groups.items():
        ticks = sum(b.ticks[p][2] - (a.ticks[p][2] if p in a.ticks else 0) for p in pids if p in b.ticks)
        out[name] = pct(ticks)
        ours += ticks
    if reaped_group is not None:
        reaped_ticks = (b.children - a.children) * _CLK
        out[reaped_group] = pct(reaped_ticks)
        ours += reaped_ticks
    out["rest_of_machine"] = round(out["machine_busy"] - pct(ours), 1)
    return out


#: pid of the benchmark server's postmaster, when it runs on this machine (its backends are its children)
POSTMASTER: int | None = None


def find_postmaster(dsn: str) -> int | None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_backend_pid()").fetchone()
    try:
        info = _proc_ticks().get(int(row[0])) if row else None
    except (OSError, ValueError):
        return None
    return info[1] if info is not None and info[0] == "postgres" else None


# --------------------------------------------------------------------------- database


def reset(dsn: str) -> None:
    """Empty the queue, re-anchor its load counters and flush dirty pages (no manager may run)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"TRUNCATE {QUEUE}")
        conn.execute("SELECT qm.reconcile_load(%s)", (QUEUE,))
        checkpoint(conn)


def checkpoint(conn: psycopg.Connection[Any]) -> None:
    try:
        conn.execute("CHECKPOINT")
    except psycopg.errors.InsufficientPrivilege:
        logger.warning("CHECKPOINT refused (needs superuser or pg_checkpoint); measuring without it")


def preload(dsn: str, events: Sequence[Event]) -> float:
    """Insert the events in one transaction (COPY), then ANALYZE and CHECKPOINT; returns the load time."""
    t = time.perf_counter()
    with psycopg.connect(dsn) as conn:
        inserted = enqueue_batch(conn, QUEUE, events)
        conn.commit()
    elapsed = time.perf_counter() - t
    if inserted != len(events):
        raise RuntimeError(f"preload inserted {inserted} of {len(events)} events")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"ANALYZE {QUEUE}")
        checkpoint(conn)
    return elapsed


def state_counts(dsn: str) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            f"SELECT state::text, count(*), count(*) FILTER (WHERE attempts > 1) FROM {QUEUE} GROUP BY 1"
        ).fetchall()
    return {"states": {r[0]: int(r[1]) for r in rows}, "refired": sum(int(r[2]) for r in rows)}


def event_rows(dsn: str, where: str, param: Any) -> list[dict[str, Any]]:
    """Up to 10 events matching ``where`` (one %s parameter), as the database has them now."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            f"SELECT id, state::text, attempts, partition, payload::text, extract(epoch FROM fire_at)::float8, "
            f"extract(epoch FROM created_at)::float8, extract(epoch FROM fired_at)::float8, "
            f"extract(epoch FROM now())::float8 "
            f"FROM {QUEUE} WHERE {where} ORDER BY id LIMIT 10",
            (param,),
        ).fetchall()
    keys = ("id", "state", "attempts", "partition", "payload", "fire_at", "created_at", "fired_at", "db_now")
    return [dict(zip(keys, r, strict=True)) for r in rows]


# --------------------------------------------------------------------------- processes


@dataclass
class ManagerHandle:
    proc: Any
    port: int
    status_q: Any
    stop_ev: Any
    reset_ev: Any
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/"


#: times at which a manager did not stop within procs.STOP_TIMEOUT of request_stop() (see the report)
STOP_HANGS: list[float] = []
#: ManagerConfig fields set by --manager-set for every manager of the run
MANAGER_OVERRIDES: dict[str, Any] = {}


@contextlib.contextmanager
def manager_process(dsn: str, profile_path: str | None = None) -> Iterator[ManagerHandle]:
    """A manager in its own process, leading the shard; drained and stopped on exit."""
    status_q, stop_ev, reset_ev = _CTX.Queue(), _CTX.Event(), _CTX.Event()
    proc = _CTX.Process(
        target=procs.manager_main,
        args=(dsn, dict(MANAGER_OVERRIDES), status_q, stop_ev, reset_ev, profile_path),
        name="e2e-manager",
        daemon=True,
    )
    proc.start()
    handle: ManagerHandle | None = None
    try:
        kind, value = status_q.get(timeout=90)
        if kind != "ready":
            raise RuntimeError(f"the manager process failed to start: {value}")
        handle = ManagerHandle(proc, int(value), status_q, stop_ev, reset_ev)
        yield handle
    finally:
        stop_ev.set()
        with contextlib.suppress(Exception):
            while True:
                kind, value = status_q.get(timeout=procs.STOP_TIMEOUT + 30)
                if kind == "done":
                    if handle is not None:
                        handle.info = value
                    if value.get("stop_hung"):
                        STOP_HANGS.append(time.time())
                    break
                if kind == "error":
                    logger.warning("manager process: %s", value)
                    break
        proc.join(timeout=30)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=10)


@dataclass
class Receivers:
    procs: list[Any]
    ready: list[Any]
    go: Any
    stop: Any
    handled: list[Any]
    acked: list[Any]
    last_ack: list[Any]
    out_q: Any
    results: list[dict[str, Any]] = field(default_factory=list)

    def pids(self) -> list[int]:
        return [int(p.pid) for p in self.procs]

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        for r in self.ready:
            if not r.wait(max(0.1, deadline - time.monotonic())):
                raise RuntimeError("a receiver process did not become ready in time")

    def handled_total(self) -> int:
        return sum(int(h.value) for h in self.handled)

    def acked_total(self) -> int:
        return sum(int(a.value) for a in self.acked)

    def finish(self, timeout: float = 60) -> list[dict[str, Any]]:
        self.stop.set()
        deadline = time.monotonic() + timeout
        while len(self.results) < len(self.procs) and time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                self.results.append(self.out_q.get(timeout=0.5))
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        errors = [r["error"] for r in self.results if r.get("error")]
        if errors:
            logger.warning("receiver errors: %s", errors)
        if len(self.results) < len(self.procs):
            raise RuntimeError(f"only {len(self.results)} of {len(self.procs)} receivers reported")
        return self.results


def start_receivers(
    count: int,
    url: str,
    mode: str,
    credit: int,
    concurrency: int,
    profile_dir: str | None = None,
    library: bool = False,
    service: float = 0.0,
) -> Receivers:
    go, stop, out_q = _CTX.Event(), _CTX.Event(), _CTX.Queue()
    ready = [_CTX.Event() for _ in range(count)]
    handled = [_CTX.Value("q", 0, lock=False) for _ in range(count)]
    acked = [_CTX.Value("q", 0, lock=False) for _ in range(count)]
    last_ack = [_CTX.Value("d", 0.0, lock=False) for _ in range(count)]
    ps = []
    for i in range(count):
        prof = str(Path(profile_dir) / f"receiver-{i}.prof") if profile_dir else None
        ps.append(
            _CTX.Process(
                target=procs.spawned,
                args=(
                    procs.receiver,
                    out_q,
                    {"idx": i},
                    i,
                    url,
                    mode,
                    credit,
                    concurrency,
                    ready[i],
                    go,
                    stop,
                    handled[i],
                    acked[i],
                    last_ack[i],
                    out_q,
                    prof,
                    library,
                    service,
                ),
                name=f"e2e-receiver-{i}",
                daemon=True,
            )
        )
    for p in ps:
        p.start()
    return Receivers(ps, ready, go, stop, handled, acked, last_ack, out_q)


def make_events(n: int, seed: int, fire_at: Sequence[datetime] | None = None) -> list[Event]:
    rng = random.Random(seed)
    return [
        Event(rng.choice(procs.TENANTS), {"n": i, "kind": "bench"}, fire_at[i] if fire_at is not None else None)
        for i in range(n)
    ]


# --------------------------------------------------------------------------- drain


@dataclass
class DrainConfig:
    receivers: int
    credit: int
    concurrency: int

    @property
    def label(self) -> str:
        return f"r{self.receivers}_c{self.credit}_w{self.concurrency}"


def run_drain(
    dsn: str, cfg: DrainConfig, events: list[Event], profile_dir: str | None = None, library: bool = False
) -> dict[str, Any]:
    n = len(events)
    logger.debug("drain %s: reset", cfg.label)
    reset(dsn)
    logger.debug("drain %s: preload", cfg.label)
    load_s = preload(dsn, events)
    logger.debug("drain %s: manager", cfg.label)
    budget = max(120.0, n / 500)
    mprof = str(Path(profile_dir) / "manager.prof") if profile_dir else None
    with manager_process(dsn, mprof) as m:
        logger.debug("drain %s: receivers", cfg.label)
        recv = start_receivers(cfg.receivers, m.url, "drain", cfg.credit, cfg.concurrency, profile_dir, library)
        try:
            recv.wait_ready()
            logger.debug("drain %s: go", cfg.label)
            time.sleep(0.2)  # every receiver waits on go
            groups = {"manager": [int(m.proc.pid)], "receivers": recv.pids()}
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
            t_end = max(float(v.value) for v in recv.last_ack) if not timed_out else t_seen
            logger.debug("drain %s: done", cfg.label)
        finally:
            results = recv.finish()
        logger.debug("drain %s: receivers stopped", cfg.label)
    logger.debug("drain %s: manager stopped", cfg.label)
    counts = state_counts(dsn)
    acked_db = counts["states"].get("acked", 0)
    elapsed = t_end - t0
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
        "cpu_pct_of_one_core": cpu_delta(snap0, snap1, groups),
        "manager_db_calls": _counters(m.info.get("counters", {})),
    }
    if acked_db != n or timed_out:
        logger.warning(
            "drain %s: %d of %d events acked in the database (timed out: %s)", cfg.label, acked_db, n, timed_out
        )
    return out


def _counters(raw: dict[str, list[float]]) -> dict[str, Any]:
    """{name: {calls, seconds, items, ms_per_call, items_per_call}} of the manager's timed calls."""
    out = {}
    for name, (calls, seconds, items) in sorted(raw.items()):
        entry: dict[str, Any] = {"calls": int(calls), "items": int(items)}
        if name != "deliver_frames":
            entry["seconds"] = round(seconds, 3)
            entry["ms_per_call"] = round(1000 * seconds / calls, 3) if calls else None
        entry["items_per_call"] = round(items / calls, 1) if calls else None
        out[name] = entry
    return out


def bench_drain(dsn: str, configs: list[DrainConfig], n: int, reps: int) -> dict[str, Any]:
    events = make_events(n, 4242)
    tried = []
    for cfg in configs:
        samples = []
        for rep in range(reps):
            r = run_drain(dsn, cfg, events)
            samples.append(r)
            log(
                "drain %s rep=%d %9.1f events/s in %.2f s (cpu %s)",
                cfg.label,
                rep + 1,
                r["events_per_s"],
                r["elapsed_s"],
                r["cpu_pct_of_one_core"],
            )
        med = statistics.median(s["events_per_s"] for s in samples)
        mid = min(samples, key=lambda s: abs(s["events_per_s"] - med))
        tried.append(
            {
                "receivers": cfg.receivers,
                "credit": cfg.credit,
                "concurrency": cfg.concurrency,
                "events_per_s": round(med, 1),
                "samples": [s["events_per_s"] for s in samples],
                "all_acked": all(s["acked_in_db"] == n and not s["timed_out"] for s in samples),
                "refired": sum(s["refired_in_db"] for s in samples),
                "median_run": mid,
            }
        )
    best = max(tried, key=lambda t: t["events_per_s"])
    return {
        "events": n,
        "reps": reps,
        "best": {k: best[k] for k in ("receivers", "credit", "concurrency", "events_per_s", "samples")},
        "tried": tried,
    }


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
    with manager_process(dsn) as m:
        recv = start_receivers(1, m.url, "latency", LATENCY_CREDIT, LATENCY_CREDIT, library=library)
        try:
            recv.wait_ready()
            ready, out_q = _CTX.Event(), _CTX.Queue()
            prod = _CTX.Process(
                target=procs.spawned,
                args=(procs.produce, out_q, {}, dsn, n, warmup, rate, conns, seed, ready, recv.go, out_q),
                name="e2e-producer",
                daemon=True,
            )
            prod.start()
            if not ready.wait(60):
                raise RuntimeError("the producer did not become ready")
            time.sleep(1.0)  # the manager is idle and armed (waiting for a wake-up)
            m.reset_ev.set()
            recv.go.set()
            logger.debug("latency %g/s: go", rate)
            res = out_q.get(timeout=n / rate + 120)
            logger.debug("latency %g/s: producer done", rate)
            prod.join(timeout=10)
            if "error" in res:
                raise RuntimeError(f"producer failed: {res['error']}")
            deadline = time.monotonic() + 30
            while recv.handled_total() < total and time.monotonic() < deadline:
                time.sleep(0.01)
            logger.debug("latency %g/s: %d of %d received", rate, recv.handled_total(), total)
        finally:
            results = recv.finish()
    logger.debug("latency %g/s: stopped", rate)
    sent: dict[int, tuple[float, float]] = res["sent"]
    first: dict[int, float] = {}
    dup = 0
    for r in results:
        for seq, t in r["records"]:
            if seq in first:
                dup += 1
                first[seq] = min(first[seq], t)
            else:
                first[seq] = t
    db_after = state_counts(dsn)  # after the manager stopped
    lost = sorted(set(sent) - set(first))
    lost_rows = event_rows(dsn, "(payload->>'seq')::int = ANY(%s)", lost[:10]) if lost else []
    commit_lat, call_lat, enq = [], [], []
    for seq, (t_call, t_commit) in sent.items():
        if seq < 0:
            continue
        enq.append(t_commit - t_call)
        if seq in first:
            commit_lat.append(first[seq] - t_commit)
            call_lat.append(first[seq] - t_call)
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
        "manager_db_calls": _counters(m.info.get("counters", {})),
        "call_to_receipt": summary_ms(call_lat),
        "enqueue_call": summary_ms(enq),
    }


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
    with manager_process(dsn) as m:
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
            "fire rep=%d lateness p50=%s p99=%s max=%s ms early=%d missing=%d",
            rep + 1,
            lt.get("p50_ms"),
            lt.get("p99_ms"),
            lt.get("max_ms"),
            r["early"],
            r["missing"],
        )
    lat = [s["lateness"] for s in samples]
    return {
        "events": n,
        "spread_s": spread,
        "p50_ms": median_of(lat, "p50_ms"),
        "p99_ms": median_of(lat, "p99_ms"),
        "max_ms": median_of(lat, "max_ms"),
        "early": sum(s["early"] for s in samples),
        "missing": sum(s["missing"] for s in samples),
        "late_over_100ms": sum(s["lateness"].get("over_100ms", 0) for s in samples),
        "samples": samples,
    }


# --------------------------------------------------------------------------- peers


def ensure_peers_venv() -> Path:
    py = PEERS_VENV / "bin" / "python"
    if not py.exists():
        log("creating the peers' virtualenv %s with %s", PEERS_VENV, PEERS_DIR / "setup_venv.sh")
        subprocess.run(
            [str(PEERS_DIR / "setup_venv.sh")],
            check=True,
            stdout=sys.stderr,
            env={**os.environ, "PEERS_VENV": str(PEERS_VENV)},
        )
    return py


def run_peer(py: Path, admin_dsn: str, script: str, args: list[str], timeout: float = 300) -> dict[str, Any]:
    cmd = [str(py), script, *args]
    env = {**os.environ, "PEERS_DSN": admin_dsn, "PYTHONDONTWRITEBYTECODE": "1"}
    t = time.monotonic()
    snap0 = cpu_snapshot()
    try:
        proc = subprocess.run(cmd, cwd=PEERS_DIR, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s", "cmd": " ".join(cmd[1:])}
    # the whole subprocess (setup, preload and test): what else ran on the machine meanwhile
    cpu_whole_run = cpu_delta(snap0, cpu_snapshot(), {}, reaped_group="peer_processes")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = proc.stderr.strip().splitlines()[-5:]
        return {"error": f"rc={proc.returncode}", "stderr_tail": tail, "cmd": " ".join(cmd[1:])}
    out: dict[str, Any] = json.loads(lines[-1])
    out["wall_s"] = round(time.monotonic() - t, 1)
    out["cmd"] = " ".join(cmd[1:])
    out["cpu_whole_run_pct_of_one_core"] = cpu_whole_run
    return out


def _peer_drain_summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [s for s in samples if "error" not in s]
    rates = [s["jobs_per_s"] for s in ok if not s.get("timed_out") and s.get("handled") == s.get("jobs")]
    return {
        "jobs_per_s": round(statistics.median(rates), 1) if rates else None,
        "samples": [s.get("jobs_per_s") for s in ok],
        "errors": [s for s in samples if "error" in s],
        "cpu": ok[len(ok) // 2].get("cpu") if ok else None,
        "rest_of_machine_pct": [s.get("cpu_whole_run_pct_of_one_core", {}).get("rest_of_machine") for s in ok],
        "jobs": ok[0].get("jobs") if ok else None,
    }


def _peer_latency_summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [s for s in samples if "error" not in s]
    lat = [s["commit_to_handler_start"] for s in ok]
    return {
        "p50_ms": median_of(lat, "p50_ms"),
        "p99_ms": median_of(lat, "p99_ms"),
        "max_ms": median_of(lat, "max_ms"),
        "samples": [{k: s[k] for k in ("p50_ms", "p99_ms", "max_ms")} for s in lat],
        "missing": sum(s.get("missing", 0) for s in ok),
        "rest_of_machine_pct": [s.get("cpu_whole_run_pct_of_one_core", {}).get("rest_of_machine") for s in ok],
        "errors": [s for s in samples if "error" in s],
    }


def bench_peers(admin_dsn: str, args: argparse.Namespace) -> dict[str, Any]:
    py = ensure_peers_venv()
    drains: dict[str, dict[str, Any]] = {}
    lats: dict[str, dict[str, Any]] = {}
    # PgQueuer: 2 worker processes and a large dequeue batch are its best drain (README, reference results)
    for bs in args.pgq_batch_sizes:
        samples = []
        for rep in range(args.reps):
            r = run_peer(
                py,
                admin_dsn,
                "bench_pgqueuer.py",
                ["process", "--n", str(args.pgq_events), "--procs", "2", "--batch-size", str(bs)],
            )
            samples.append(r)
            log(
                "peer pgqueuer process p2 b%d rep=%d: %s jobs/s %s",
                bs,
                rep + 1,
                r.get("jobs_per_s"),
                r.get("error", ""),
            )
        drains[f"pgqueuer_p2_b{bs}"] = {"lib": "pgqueuer", "procs": 2, "batch_size": bs, **_peer_drain_summary(samples)}
    # Procrastinate: 2 processes, concurrency 10, delete_jobs=always was its best (reference results)
    samples = []
    for rep in range(args.procr_reps):
        r = run_peer(
            py,
            admin_dsn,
            "bench_procrastinate.py",
            [
                "process",
                "--n",
                str(args.procr_events),
                "--procs",
                "2",
                "--concurrency",
                "10",
                "--delete-jobs",
                "always",
            ],
        )
        samples.append(r)
        log(
            "peer procrastinate process p2 c10 delete=always rep=%d: %s jobs/s %s",
            rep + 1,
            r.get("jobs_per_s"),
            r.get("error", ""),
        )
    drains["procrastinate_p2_c10_del-always"] = {
        "lib": "procrastinate",
        "procs": 2,
        "concurrency": 10,
        **_peer_drain_summary(samples),
    }
    for lib in ("pgqueuer", "procrastinate"):
        samples = []
        for rep in range(args.reps):
            r = run_peer(py, admin_dsn, f"bench_{lib}.py", ["latency", "--n", "500", "--rate", "200", "--budget", "60"])
            samples.append(r)
            c = r.get("commit_to_handler_start", {})
            log(
                "peer %s latency 200/s rep=%d: p50=%s p99=%s ms %s",
                lib,
                rep + 1,
                c.get("p50_ms"),
                c.get("p99_ms"),
                r.get("error", ""),
            )
        lats[lib] = {"lib": lib, "rate": 200, "events": 500, **_peer_latency_summary(samples)}
    versions = {}
    with contextlib.suppress(Exception):
        v = subprocess.run(
            [
                str(py),
                "-c",
                "import importlib.metadata as m, json; "
                "print(json.dumps({p: m.version(p) for p in ('pgqueuer', 'procrastinate', 'asyncpg', 'psycopg')}))",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        versions = json.loads(v.stdout)
    return {"versions": versions, "drain": drains, "latency_200_per_s": lats}


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
    parser.add_argument("--json-only", action="store_true", help="no logs on stderr (only warnings)")
    parser.add_argument(
        "--manager-set",
        action="append",
        default=[],
        metavar="FIELD=JSON",
        help="a ManagerConfig field for every manager of the run, e.g. durable_fires=false (repeatable)",
    )
    args = parser.parse_args(argv)
    for item in args.manager_set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--manager-set takes FIELD=JSON, got {item!r}")
        MANAGER_OVERRIDES[key] = json.loads(value)
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
    if args.pgq_events is None:
        args.pgq_events = args.events
    if (
        min(args.reps, args.events, args.latency_events, args.fast_latency_events, args.fire_events, args.concurrency)
        < 1
    ):
        parser.error("--reps, --events, --concurrency and the event counts must be positive")
    return args


def code_version() -> dict[str, Any]:
    """The commit measured, and whether the working tree differed from it."""
    root = HERE.parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    import queue_manager

    return {
        "commit": commit or None,
        "modified_files": sorted(line[3:] for line in status.splitlines() if line.strip()),
        "queue_manager_imported_from": str(Path(queue_manager.__file__).resolve().parent),
    }


def main(argv: Sequence[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up (stop the embedded server) on kill
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.json_only else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(message)s",
    )
    started = time.monotonic()
    code_at_start = code_version()
    configs = [DrainConfig(r, c, args.concurrency) for r in args.receivers for c in args.credit]
    with bench_server(args.dsn, "e2e") as (admin_dsn, dsn):
        log("benchmark database: %s", conninfo_to_dict(dsn).get("dbname"))
        one_shard_queue(dsn, QUEUE, QUEUE_SETTINGS)
        info = server_info(dsn)
        global POSTMASTER
        POSTMASTER = find_postmaster(dsn)
        drain = bench_drain(dsn, configs, args.events, args.reps)
        latency = bench_latency(
            dsn, [(200.0, args.latency_events, 1), (2000.0, args.fast_latency_events, args.fast_producers)], args.reps
        )
        fire = bench_fire(dsn, args.fire_events, args.fire_spread, args.reps)
        library = None
        if args.library:
            b = drain["best"]
            library = bench_library(
                dsn,
                DrainConfig(b["receivers"], b["credit"], b["concurrency"]),
                args.events,
                args.latency_events,
                args.reps,
            )
        profile = None
        if args.profile:
            b = drain["best"]
            profile = profile_drain(dsn, DrainConfig(b["receivers"], b["credit"], b["concurrency"]), args.events)
        peers = bench_peers(admin_dsn, args) if args.peers else None
    ours_drain = drain["best"]["events_per_s"]
    lat200 = latency["200_per_s"]
    comparison: dict[str, Any] = {"fire_lateness_p99_ms": fire["p99_ms"], "fire_early": fire["early"]}
    met: dict[str, Any] = {
        "fire_p99_under_5ms": fire["p99_ms"] is not None and fire["p99_ms"] < FIRE_P99_TARGET_MS,
        "fire_never_early": fire["early"] == 0,
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
            met["drain_ratio_at_least_1.5"] = (
                comparison["drain_ratio"] is not None and comparison["drain_ratio"] >= DRAIN_TARGET
            )
        if fast_lat is not None:
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
    comparison["lost_or_stuck"] = lost
    met["nothing_lost"] = not any(lost.values())
    met["all"] = all(v for v in met.values())
    report = {
        "benchmark": "e2e",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
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
        },
        "drain": drain,
        "latency": latency,
        "fire": fire,
        "receiver_library": library,
        "profile": profile,
        "peers": peers,
        "comparison": comparison,
        "targets": {
            "drain_ratio_min": DRAIN_TARGET,
            "latency_200_ratio_max": LATENCY_TARGET,
            "fire_p99_ms_max": FIRE_P99_TARGET_MS,
            "fire_early": 0,
        },
        "met": met,
        "manager_stop_hangs": len(STOP_HANGS),
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(json.dumps(report, indent=2))
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
