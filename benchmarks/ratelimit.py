"""A queue's max_qps across two shards, measured: both managers up, one stopped, then restarted.

Prints one JSON object on stdout (logs go to stderr). Two embedded PostgreSQL servers (two shards
of one topology, the default durability), one queue limited to ``--qps`` (200) events/s with a
backlog on both shards, one ``qm manager`` process per shard (given the topology), and one
receiver per shard in this process, with plenty of credit (1 000) and a handler that does nothing.

* phase 1 (``--phase`` s): both managers up;
* phase 2: shard s1's manager is stopped, with SIGKILL by default (``--stop term``: SIGTERM, it
  drains and gives its slices back); s0's manager should take the whole limit;
* phase 3: s1's manager is started again (same port; after a SIGKILL it leads once its 2 s
  leadership lease has run out) and should take its share back.

The measured fire rate is the receipts (every delivery, re-fires included, at the receiving
handler, ``time.time()``) and, as a check, the databases' ``fired_at`` (the fire statement's
database time; a re-fire overwrites it). Every process and both servers run on this machine, so
they share one clock. Windows: every 10 s window and every 1 s window starting at a receipt within
the measurement (from the start of phase 1 to the end of phase 3); targets: the total within
``qps`` +/- 5 % over every 10 s window, never above ``qps`` * 1.05 in any 1 s window.

    .venv/bin/python -m benchmarks.ratelimit [--qps 200] [--phase 30] [--stop kill|term]
                                             [--rate-lease-ttl 0.6] [--json-only]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import urllib.request
from bisect import bisect_left
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg

from benchmarks.lib.machine import machine_info
from benchmarks.lib.server import server_info
from queue_manager import admin
from queue_manager.local import fleet
from queue_manager.producer import Event, Router
from receivers.testing import Delivery, MinimalClient

logger = logging.getLogger("bench.ratelimit")

QUEUE = "bench_rl"
SECRET = "ratelimit-benchmark-secret-01"
#: the shards' leadership lease: a killed manager's successor leads after this long
LEASE_TTL = 2.0


class ManagerProc(fleet.ManagerProcess):
    """``qm manager`` for one shard, on a fixed port (a restart keeps it: the receiver reconnects);
    :meth:`start` starts it."""

    def __init__(self, topo: Path, tokens: Path, shard: str, port: int, ttl: float, log: Path) -> None:
        super().__init__(
            topo,
            tokens,
            shard,
            port=port,
            log=log,
            start=False,
            lease_ttl=LEASE_TTL,
            rate_lease_ttl=ttl,
            drain_timeout=2,
        )

    def counters(self, *names: str) -> dict[str, float]:
        """Sums of the named counters on ``/metrics`` (over their labels)."""
        out = dict.fromkeys(names, 0.0)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=2) as resp:
                text = resp.read().decode()
        except OSError:
            return out
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in out:
                out[name] += float(line.rsplit(" ", 1)[1])
        return out

    def share(self) -> float:
        return float(self.health()[1].get("queues", {}).get(QUEUE, {}).get("qps_share", -1.0))

    def end(self, sig: signal.Signals) -> None:
        """Send ``sig`` and wait for the process to end (SIGKILL after 20 s)."""
        self.signal(sig)
        if not self.wait(20):
            self.kill()


async def wait_until(predicate: Any, timeout: float, what: str) -> float:
    """Poll ``predicate`` (run in a thread: it may do HTTP) every 20 ms; the time it took."""
    start = time.monotonic()
    while not await asyncio.to_thread(predicate):
        if time.monotonic() - start > timeout:
            raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


def windows(times: Sequence[float], start: float, end: float, width: float, step: float) -> list[int]:
    """Events in every window [t, t + width) for t from ``start`` to ``end - width`` by ``step``."""
    out = []
    t = start
    while t + width <= end + 1e-9:
        out.append(bisect_left(times, t + width) - bisect_left(times, t))
        t += step
    return out


def most_in_window(times: Sequence[float], start: float, end: float, width: float) -> tuple[int, float | None]:
    """The most events in any window [t, t + width) that starts at an event in [start, end - width]."""
    best, at = 0, None
    lo = bisect_left(times, start)
    hi = bisect_left(times, end - width)
    for i in range(lo, hi + 1):
        if i >= len(times):
            break
        n = bisect_left(times, times[i] + width) - i
        if n > best:
            best, at = n, times[i]
    return best, at


def rate(times: Sequence[float], start: float, end: float) -> float:
    return (bisect_left(times, end) - bisect_left(times, start)) / (end - start) if end > start else 0.0


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from queue_manager.local.embedded import LocalCluster

    work = Path(tempfile.mkdtemp(prefix="qm-bench-ratelimit-"))
    cluster = LocalCluster(work / "cluster", 2)  # started by fleet.start_shards, stopped here
    managers: list[ManagerProc] = []
    receipts: dict[str, list[float]] = {"s0": [], "s1": []}
    receivers: list[MinimalClient] = []
    tasks: list[asyncio.Task[None]] = []
    load: list[tuple[float, float]] = []
    try:
        topology = fleet.start_shards(cluster.directory, 2)
        dsns = [s.dsn for s in topology.shards]
        topo = cluster.directory / fleet.TOPOLOGY_FILE
        tokens = fleet.write_tokens(work / "tokens.toml", [fleet.Token("bench", SECRET, (QUEUE,))])
        admin.create_queue(
            topology,
            QUEUE,
            {"partitions": 16, "shuffle": 4, "max_qps": args.qps, "ack_timeout_seconds": 5.0},
        )
        per_shard = int(args.qps * (3 * args.phase + 30))  # enough for the whole limit on either
        with Router(topology) as router:
            tenants = [f"tenant-{i:04d}" for i in range(400)]
            for shard in topology.shards:
                mine = [t for t in tenants if shard.key_range.contains(t)]
                router.enqueue_batch(QUEUE, (Event(mine[i % len(mine)], {"n": i}) for i in range(per_shard)))
        for dsn in dsns:
            with psycopg.connect(dsn, autocommit=True) as c:
                c.execute(f"ANALYZE {QUEUE}")
        logger.info("backlog of %d events on each shard", per_shard)

        ports = [fleet.free_port(), fleet.free_port()]
        logs = work / "logs"
        logs.mkdir()
        managers = [
            ManagerProc(topo, tokens, f"s{i}", ports[i], args.rate_lease_ttl, logs / f"manager-s{i}.log")
            for i in range(2)
        ]
        for m in managers:
            m.start()

        def on_event(shard: str) -> Any:
            bucket = receipts[shard]

            async def handle(event: Delivery) -> None:
                bucket.append(time.time())

            return handle

        for i, m in enumerate(managers):
            r = MinimalClient(
                f"ws://127.0.0.1:{m.port}/", SECRET, QUEUE, on_event(f"s{i}"), credit=1000, reconnect_delay=0.05
            )
            receivers.append(r)
            tasks.append(asyncio.create_task(r.run()))

        async def sample_load() -> None:
            while True:
                load.append((time.time(), os.getloadavg()[0]))
                await asyncio.sleep(5)

        tasks.append(asyncio.create_task(sample_load()))
        await wait_until(lambda: all(0 < m.share() < args.qps for m in managers), 60, "both managers sharing")
        await asyncio.sleep(3.0)  # warm-up

        t1 = time.time()
        await asyncio.sleep(args.phase)
        t2 = time.time()
        # in threads: the receivers run on this loop and must not be held up (a burst of receipts)
        await asyncio.to_thread(managers[1].end, signal.SIGKILL if args.stop == "kill" else signal.SIGTERM)
        stopped = time.time()
        took_all = await wait_until(lambda: managers[0].share() == args.qps, 30, "s0 takes the whole limit")
        await asyncio.sleep(max(0.0, t2 + args.phase - time.time()))
        t3 = time.time()
        await asyncio.to_thread(managers[1].start)
        leads = await wait_until(lambda: managers[1].role() == "leader", 30, "the restarted manager")
        rejoined = await wait_until(lambda: 0 < managers[1].share() < args.qps, 30, "the restarted one's share")
        await asyncio.sleep(max(0.0, t3 + args.phase - time.time()))
        t4 = time.time()

        counters = {
            f"s{i}" + ("_restarted" if i == 1 else ""): m.counters(
                "qm_limit_trust_lapses_total", "qm_limit_publish_failures_total"
            )
            for i, m in enumerate(managers)
        }
        for r in receivers:
            r.stop()
        for m in managers:
            m.stop()
        fired: dict[str, list[float]] = {}
        for shard in topology.shards:
            with psycopg.connect(shard.dsn) as c:
                rows = c.execute(f"SELECT extract(epoch FROM fired_at)::float8 FROM {QUEUE} WHERE fired_at IS NOT NULL")
                fired[shard.name] = sorted(float(r[0]) for r in rows)
        server = server_info(dsns[0])
    finally:
        for r in receivers:
            r.stop()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for m in managers:
            with contextlib.suppress(Exception):
                m.stop()
        with contextlib.suppress(Exception):
            cluster.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    qps = args.qps
    phases = {"1_both": (t1, t2), "2_one_stopped": (t2, t3), "3_restarted": (t3, t4)}

    def analyse(by_shard: dict[str, list[float]]) -> dict[str, Any]:
        both = sorted(by_shard["s0"] + by_shard["s1"])
        ten = windows(both, t1, t4, 10.0, 0.1)
        rates10 = [n / 10.0 for n in ten]
        one, one_at = most_in_window(both, t1, t4, 1.0)
        per_phase = {}
        for name, (a, b) in phases.items():
            ten_p = [n / 10.0 for n in windows(both, a, b, 10.0, 0.1)]
            per_phase[name] = {
                "seconds": round(b - a, 2),
                "total_per_s": round(rate(both, a, b), 2),
                "s0_per_s": round(rate(by_shard["s0"], a, b), 2),
                "s1_per_s": round(rate(by_shard["s1"], a, b), 2),
                "ten_s_windows_inside": {"min": min(ten_p, default=None), "max": max(ten_p, default=None)},
                "max_in_1s": most_in_window(both, a, b, 1.0)[0],
            }
        series = {
            shard: [bisect_left(ts, t1 + k + 1) - bisect_left(ts, t1 + k) for k in range(int(t4 - t1))]
            for shard, ts in by_shard.items()
        }
        return {
            "per_second_by_shard": series,
            "events_measured": bisect_left(both, t4) - bisect_left(both, t1),
            "phases": per_phase,
            "ten_s_windows": {
                "count": len(rates10),
                "min_per_s": min(rates10),
                "max_per_s": max(rates10),
                "outside_target": sum(1 for r in rates10 if abs(r - qps) > 0.05 * qps),
                "min_starts_at_s": round(0.1 * rates10.index(min(rates10)), 1),
            },
            "one_s_windows": {"max": one, "max_at_s": None if one_at is None else round(one_at - t1, 2)},
            "met": {
                "every_10s_within_5pct": all(abs(r - qps) <= 0.05 * qps for r in rates10),
                "no_1s_above_105pct": one <= 1.05 * qps,
            },
        }

    return {
        "benchmark": "ratelimit",
        "config": {
            "qps": qps,
            "phase_seconds": args.phase,
            "stop": "SIGKILL" if args.stop == "kill" else "SIGTERM",
            "rate_lease_ttl": args.rate_lease_ttl,
            "leadership_lease_ttl": LEASE_TTL,
            "backlog_per_shard": per_shard,
            "receiver_credit": 1000,
        },
        "receipts": analyse(receipts),
        "fired_at": analyse(fired),
        "hand_over": {
            "s0_has_the_whole_limit_after_stop_s": round(stopped - t2 + took_all, 3),
            "restarted_leads_after_s": round(leads, 3),
            "restarted_shares_after_s": round(leads + rejoined, 3),
        },
        "manager_counters": counters,
        "load_average_1m": [round(v, 2) for _, v in load],
        "server": server,
        "machine": machine_info(),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--qps", type=float, default=200.0, help="the queue's max_qps (default 200)")
    parser.add_argument("--phase", type=float, default=30.0, help="seconds per phase (default 30; at least 10)")
    parser.add_argument("--stop", choices=["kill", "term"], default="kill", help="how s1's manager is stopped")
    parser.add_argument("--rate-lease-ttl", type=float, default=0.6, help="the managers' --rate-lease-ttl")
    parser.add_argument("--keep", action="store_true", help="keep the servers' data and the logs")
    parser.add_argument("--json-only", action="store_true", help="no log lines on stderr")
    args = parser.parse_args(argv)
    if args.phase < 10:
        parser.error("--phase must be at least 10 s (the 10 s windows)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.json_only else logging.INFO, stream=sys.stderr)
    report = asyncio.run(run(args))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
