"""What the web dashboard costs on a large queue: each page's server time, and the PostgreSQL CPU
an open overview costs.

Prints one JSON object on stdout (logs go to stderr). One shard, one queue (``bench_q``, 16
partitions, shuffle 4) holding ``--events`` events (default 10 million: loading them takes a while)
of 5 000 tenants, 90 % acked, 5 % dead letters, 5 % scheduled a day ahead, each payload
``{"order": {"id": i}, "kind": ...}``, on a dedicated embedded server with the default
durability (or ``--dsn``):

* **pages**: ``--requests`` requests of each page (the dashboard application in process, as
  ``qm web`` configures it, through Starlette's test client: server time, no network): p50, p99
  and max milliseconds. Target (issue 25): every page under 300 ms p99. The overview and the
  queue page serve the monitor's live reading (monitor.py), so **overview_reading** is timed too:
  one such reading of the shard (``reads.live``: load counters and bounded index reads), with the
  server CPU it costs; and **exact_counts**, the queue page's on-demand ``count(*)`` by state;
* **overview CPU**: the overview's live part read once a second (what one open, visible tab
  costs) for ``--overview-seconds`` while a ``NOTIFY qm_wake`` is sent every second (the worst
  case: a shard that announces a change every second, so the monitor reads it every second): the
  CPU time of every process of the PostgreSQL server in that time (embedded server only), as
  seconds per minute and percent of one core, and how many readings the window saw. Target:
  under 2 %.

    .venv/bin/python -m benchmarks.web [--events 10000000] [--requests 20] [--overview-seconds 60] [--dsn URI]
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

from benchmarks.lib.machine import machine_info
from benchmarks.lib.report import pct_ms
from benchmarks.lib.server import bench_server, one_shard_queue, server_info
from queue_manager.domain.topology import KeyRange, Shard, Topology

logger = logging.getLogger("bench.web")

QUEUE = "bench_q"
SECRET = "bench-web-admin-secret"
CHUNK = 1_000_000


def _ms(values: list[float]) -> dict[str, float | None]:
    return {
        "n": len(values),
        "p50_ms": pct_ms(values, 50, 2),
        "p99_ms": pct_ms(values, 99, 2),
        "max_ms": pct_ms(values, 100, 2),
    }


def _fill(dsn: str, events: int) -> float:
    """Insert the events through the queue's triggers, in chunks; returns the seconds it took."""
    started = time.perf_counter()
    with psycopg.connect(dsn, autocommit=True) as conn:
        done = 0
        while done < events:
            n = min(CHUNK, events - done)
            conn.execute(
                f"INSERT INTO {QUEUE} (tenant, payload, fire_at) "
                "SELECT 't-' || (i %% 5000), jsonb_build_object('order', jsonb_build_object('id', i), 'kind', "
                "CASE WHEN i %% 20 = 0 THEN 'dead' WHEN i %% 20 = 1 THEN 'later' ELSE 'done' END), "
                "CASE WHEN i %% 20 = 1 THEN now() + interval '1 day' ELSE now() - interval '1 hour' END "
                "FROM generate_series(%s::bigint, %s::bigint) i",
                (done + 1, done + n),
            )
            done += n
            logger.info("inserted %d of %d events", done, events)
        conn.execute(
            f"UPDATE {QUEUE} "
            "SET state = CASE WHEN payload->>'kind' = 'dead' THEN 'failed' ELSE 'acked' END::qm.event_state, "
            "attempts = 1, fired_at = now(), acked_at = CASE WHEN payload->>'kind' = 'done' THEN now() END "
            "WHERE payload->>'kind' <> 'later'"
        )
        conn.execute(f"VACUUM ANALYZE {QUEUE}")
        conn.execute("SELECT qm.reconcile_load(%s)", (QUEUE,))
    return time.perf_counter() - started


def _server_cpu(dsn: str) -> float | None:
    """CPU seconds used so far by every process of the server (None when they cannot be read)."""
    try:
        import psutil
    except ImportError:
        return None
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute("SHOW data_directory").fetchone()
        assert row is not None
        pid = int((Path(row[0]) / "postmaster.pid").read_text().split()[0])
        root = psutil.Process(pid)
        # the backends that have exited count in the postmaster's children_* times (it reaps them)
        mine = root.cpu_times()
        total = mine.user + mine.system + mine.children_user + mine.children_system
        for p in root.children(recursive=True):
            t = p.cpu_times()
            total += t.user + t.system
        return total
    except Exception as exc:  # a server on another machine, or no permission
        logger.info("cannot read the server's CPU time: %s", exc)
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=10_000_000)
    parser.add_argument("--requests", type=int, default=20, help="requests per page (default 20)")
    parser.add_argument("--overview-seconds", type=float, default=60.0)
    parser.add_argument("--dsn", help="an existing server's administrative DSN (default: a dedicated embedded one)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")

    from starlette.testclient import TestClient

    from queue_manager.web.access import WebTokens
    from queue_manager.web.app import WebConfig, create_app

    with bench_server(args.dsn, "web") as (_, dsn):
        one_shard_queue(dsn, QUEUE, {"partitions": 16, "shuffle": 4, "failed_retention_seconds": None})
        fill_seconds = _fill(dsn, args.events)
        topology = Topology((Shard("s0", dsn, KeyRange.parse("-")),))
        tokens = WebTokens.from_entries([{"name": "bench", "secret": SECRET, "scope": "admin"}])
        config = WebConfig(topology=topology, tokens=tokens)
        app = create_app(config)
        headers = {"authorization": f"Bearer {SECRET}", "accept": "text/html"}
        with psycopg.connect(dsn) as conn:
            some = conn.execute(f"SELECT max(id) / 2 FROM {QUEUE}").fetchone()
        middle = int(some[0]) if some and some[0] else 1
        pages = {
            "overview": "/",
            "overview_live": "/partials/overview",
            "queue": f"/queues/{QUEUE}",
            "events": f"/queues/{QUEUE}/events",
            "events_dead_letters": f"/queues/{QUEUE}/events?state=failed",
            "events_tenant": f"/queues/{QUEUE}/events?tenant=t-42",
            "events_payload_path": f"/queues/{QUEUE}/events?payload=payload.order.id+%3D+{middle}",
            "events_id": f"/queues/{QUEUE}/events?id={middle}",
            "event": f"/queues/{QUEUE}/events/s0/{middle}",
            "database": "/database",
        }
        from queue_manager.web import reads
        from queue_manager.web import shards as web_shards

        shards = web_shards.Shards(web_shards.guarded(topology, config.limits), config.limits)
        readings = []
        reads.live(shards, config.limits)  # the pool's first connection
        reading_cpu_before = _server_cpu(dsn)
        for _ in range(args.requests):
            t0 = time.perf_counter()
            reads.live(shards, config.limits)
            readings.append(time.perf_counter() - t0)
        reading_cpu_after = _server_cpu(dsn)
        exact = []
        for _ in range(3):
            t0 = time.perf_counter()
            found = reads.exact_counts(shards, QUEUE)
            exact.append(time.perf_counter() - t0)
            if not isinstance(found["s0"], dict):
                raise SystemExit(f"exact counts failed: {found['s0']}")
        shards.close()
        results: dict[str, Any] = {"overview_reading": _ms(readings), "exact_counts": _ms(exact)}
        with TestClient(app) as client:
            for name, path in pages.items():
                times = []
                for _ in range(args.requests):
                    t0 = time.perf_counter()
                    r = client.get(path, headers=headers)
                    times.append(time.perf_counter() - t0)
                    if r.status_code != 200:
                        raise SystemExit(f"{path}: HTTP {r.status_code}: {r.text[:300]}")
                results[name] = _ms(times)
                logger.info("%s: %s", name, results[name])

            monitor = client.app.state.monitor  # type: ignore[attr-defined]
            cpu_before = _server_cpu(dsn)
            versions_before = monitor.version
            started = time.monotonic()
            reads = 0
            taken: set[str] = set()
            with psycopg.connect(dsn, autocommit=True) as notifier:
                while time.monotonic() - started < args.overview_seconds:
                    tick = time.monotonic()
                    notifier.execute("SELECT pg_notify('qm_wake', %s)", (QUEUE,))
                    page = client.get("/partials/overview", headers=headers).text
                    found = re.search(r"Read at ([0-9:]+ UTC)", page)
                    if found:
                        taken.add(found.group(1))
                    reads += 1
                    time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
            elapsed = time.monotonic() - started
            cpu_after = _server_cpu(dsn)
            readings_taken = monitor.version - versions_before
        overview_cpu: dict[str, Any] = {
            "requests": reads,
            "seconds": round(elapsed, 1),
            "readings_seen": len(taken),
            "readings_taken": readings_taken,
        }
        if cpu_before is not None and cpu_after is not None:
            per_minute = (cpu_after - cpu_before) * 60 / elapsed
            overview_cpu.update(
                cpu_seconds_per_minute=round(per_minute, 3), percent_of_one_core=round(100 * per_minute / 60, 2)
            )
        if reading_cpu_before is not None and reading_cpu_after is not None:
            per_reading = (reading_cpu_after - reading_cpu_before) / len(readings)
            overview_cpu.update(server_cpu_ms_per_reading=round(1000 * per_reading, 2))
        report = {
            "benchmark": "web",
            "events": args.events,
            "fill_seconds": round(fill_seconds, 1),
            "pages": results,
            "pages_over_300ms_p99": sorted(
                k for k, v in results.items() if v["p99_ms"] > 300 and k not in ("overview_reading", "exact_counts")
            ),
            "overview_open_one_read_per_second": overview_cpu,
            "server": server_info(dsn),
            "machine": machine_info(),
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
