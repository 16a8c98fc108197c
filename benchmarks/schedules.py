"""Periodic schedules at scale: 10 000 schedules firing every second on two shards, how late each
slot reaches its receiver, and what the managers' CPU costs per slot (``make bench-schedules``).

Prints one JSON object on stdout (logs go to stderr). Two shards (two databases of one embedded
server: the machine has 2 cores), one queue (16 partitions, shuffle 4, a window of ``--window``
seconds, acked events kept an hour: the run counts the slot events of its span afterwards), one ``qm manager``
per shard and one receiver process per shard (the bare benchmark client). ``--schedules`` (10 000)
schedules of ``--every`` seconds (1), half on each shard, for 500 tenants per shard, their anchors
spread evenly over the interval (each slot is its own instant; a burst of thousands due at one
instant measures the drain of the burst instead).

After the schedules are added, the run warms up for ``--warmup`` seconds (the first passes enqueue a
window's worth of slots at once), then measures for ``--seconds``: every slot whose instant falls in
the measured span, from the receivers' records (lateness = handler start - the slot's instant: every
process shares the host's clock), and the CPU of each manager process and of the PostgreSQL server
over the span (/proc), divided by the slots fired in it. Reported: the lateness p50/p99/max, early
receipts (before the instant) and slots missing (not received), the slots fired per second, the
CPU per slot (manager, server) in microseconds, and ``met`` (p99 < 10 ms, none early).

    .venv/bin/python -m benchmarks.schedules [--schedules 10000] [--every 1] [--seconds 30] [--warmup 20]
                                              [--window 5] [--dsn URI]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from benchmarks.lib import procs
from benchmarks.lib.fleet import start_receivers
from benchmarks.lib.machine import count_server, cpu_delta, cpu_snapshot
from benchmarks.lib.report import emit, header, summary_ms
from benchmarks.lib.server import QUEUE, bench_server, server_info, tenants_for, two_shards
from queue_manager import admin
from queue_manager.domain.topology import Topology
from queue_manager.local import fleet

logger = logging.getLogger("bench.schedules")

TENANTS_PER_SHARD = 500
P99_TARGET_MS = 10.0


def add_schedules(topology: Topology, count: int, every: float) -> None:
    """``count`` schedules, half on each shard, anchors spread evenly over one interval."""
    per_shard = count // len(topology.shards)
    for s, shard in enumerate(topology.shards):
        tenants = tenants_for(shard.key_range, TENANTS_PER_SHARD)
        with psycopg.connect(shard.dsn) as conn:
            # one anchor a whole number of intervals back, the schedules spread over the interval
            conn.execute(
                "SELECT qm.schedule_add('b' || %(s)s || '-' || g, %(queue)s, (%(tenants)s::text[])[1 + g %% %(nt)s],"
                " '{\"bench\": true}', interval_seconds => %(every)s,"
                " anchor => date_trunc('second', now()) + make_interval(secs => %(every)s * g / %(n)s))"
                " FROM generate_series(0, %(n)s - 1) g",
                {"s": s, "queue": QUEUE, "tenants": tenants, "nt": len(tenants), "every": every, "n": per_shard},
            )
            conn.commit()


def start_managers(topology: Topology, workdir: Path) -> list[fleet.ManagerProcess]:
    """A ``qm manager`` per shard, its log in ``workdir``."""
    topo = workdir / "topology.toml"
    topo.write_text(topology.to_toml())
    tokens = workdir / "tokens.toml"
    fleet.write_tokens(tokens, [fleet.Token("bench", procs.SECRET, (QUEUE,))])
    return [
        fleet.ManagerProcess(topo, tokens, shard.name, log=workdir / f"manager-{shard.name}.log")
        for shard in topology.shards
    ]


def stop(managers: list[fleet.ManagerProcess]) -> None:
    """All asked to stop at once, then each waited for (killed after 20 s)."""
    for m in managers:
        m.signal(signal.SIGTERM)
    for m in managers:
        m.stop(20.0)


def slots_enqueued(topology: Topology, start: float, end: float) -> int:
    """Slot events on every shard whose instant lies in [start, end): those the receivers should have."""
    total = 0
    for shard in topology.shards:
        with psycopg.connect(shard.dsn) as conn:
            stmt = sql.SQL(
                "SELECT count(*) FROM {} WHERE dedup_key LIKE 'qm:schedule:%%'"
                " AND fire_at >= to_timestamp(%s) AND fire_at < to_timestamp(%s)"
            ).format(sql.Identifier(QUEUE))
            row = conn.execute(stmt, (start, end)).fetchone()
        total += int(row[0]) if row else 0
    return total


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks.schedules", description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--schedules", type=int, default=10_000, help="schedules in all, half per shard (default 10000)")
    p.add_argument("--every", type=float, default=1.0, help="their interval, seconds (default 1)")
    p.add_argument("--seconds", type=float, default=30.0, help="the measured span (default 30)")
    p.add_argument("--warmup", type=float, default=20.0, help="seconds before it (default 20)")
    p.add_argument("--window", type=float, default=5.0, help="the queue's window_seconds (default 5)")
    p.add_argument("--credit", type=int, default=2000, help="each receiver's credit (default 2000)")
    p.add_argument("--dsn", help="an administrative DSN of an existing server (default: an embedded one)")
    args = p.parse_args(argv)
    if args.schedules < 2 or args.every < 1 or args.seconds <= 0 or args.warmup < 0:
        p.error("--schedules at least 2, --every at least 1, --seconds above 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    report: dict[str, Any] = header("schedules")
    settings = {"partitions": 16, "shuffle": 4, "window_seconds": args.window, "retention_seconds": 3600}
    report["config"] = {k: v for k, v in vars(args).items() if k != "dsn"} | {"queue": settings}
    with contextlib.ExitStack() as stack:
        admin_dsn, first_dsn = stack.enter_context(bench_server(args.dsn, "schedules"))
        report["server"] = server_info(first_dsn)
        topology, _ = two_shards(admin_dsn, first_dsn)
        stack.callback(_drop, admin_dsn, topology.shards[1].dsn)
        admin.create_queue(topology, QUEUE, settings)
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="qm-bench-schedules-")))
        managers = start_managers(topology, workdir)
        stack.callback(stop, managers)
        receivers = [start_receivers(1, m.url, "fire", args.credit, args.credit) for m in managers]
        for r in receivers:
            r.wait_ready()
            r.go.set()
        added = time.time()
        add_schedules(topology, args.schedules, args.every)
        logger.info("%d schedules added in %.1f s", args.schedules, time.time() - added)
        time.sleep(args.warmup)
        count_server(admin_dsn)
        start = time.time()
        before = cpu_snapshot()
        time.sleep(args.seconds)
        after = cpu_snapshot()
        end = time.time()
        time.sleep(2.0)  # the span's last slots are received
        enqueued = slots_enqueued(topology, start, end)
        cpu = cpu_delta(
            before,
            after,
            {"managers": [p.pid for p in managers], "receivers": [p for r in receivers for p in r.pids()]},
        )
        # (shard, id) -> lateness of its first receipt, for the slots whose instant is in the span
        received: dict[tuple[int, int], float] = {}
        for i, r in enumerate(receivers):
            for res in r.finish():
                for x in res["records"]:
                    ident, fire_at, t, attempt = int(x[0]), float(x[1]), float(x[2]), int(x[3])
                    if attempt == 1 and start <= fire_at < end:  # a re-fire's fire_at is its back-off's
                        received.setdefault((i, ident), t - fire_at)
    late = list(received.values())
    due = len(received)
    s = summary_ms(late)
    fired_per_s = due / (end - start)
    wall = end - start
    per_slot_us = {
        name: round(cpu[name] / 100 * wall / due * 1e6, 1) if due else None
        for name in ("managers", "postgres", "receivers")
        if name in cpu
    }
    report["result"] = {
        "slots_received": due,
        "slots_enqueued": enqueued,
        "slots_of_the_grid": round(args.schedules * wall / args.every),
        "missing": enqueued - due,
        "slots_per_s": round(fired_per_s, 1),
        "lateness_ms": s,
        "early": sum(1 for v in late if v < 0),
        "earliest_ms": round(min(late) * 1000, 3) if late else None,
        "cpu_percent_of_one_core": cpu,
        "cpu_per_slot_us": per_slot_us,
    }
    report["met"] = {
        "p99_under_10ms": s.get("p99_ms") is not None and s["p99_ms"] < P99_TARGET_MS,
        "none_early": report["result"]["early"] == 0,
    }
    emit(report)
    return 0


def _drop(admin_dsn: str, dsn: str) -> None:
    name = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(str(name))))


if __name__ == "__main__":
    sys.exit(main())
