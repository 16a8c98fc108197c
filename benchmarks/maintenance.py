"""What a maintenance slice costs, and what it costs the acks beside it.

Prints one JSON object on stdout (logs go to stderr). One shard, one queue (``bench_q``, 16
partitions, shuffle 4), on a dedicated embedded server with the default durability (or ``--dsn``):

* **retention**: ``--acked`` acked events, all past the retention, are deleted by consecutive
  retention slices (``--slice-rows`` per slice), partition after partition, on the maintenance
  connection a manager uses (the same statement and timeouts): milliseconds per slice (p50, p90,
  max) and events deleted per second by one process;
* **reconciliation**: with ``--backlog`` events due (to_be_fired) spread over the partitions,
  reconciliation slices round the partitions: milliseconds per slice (the time the queue's load
  lock is held, which is what an ack statement of that queue may wait);
* **acks beside slices**: ack statements (the manager's ``mgr_ack``, 100 events each, fenced) in a
  loop, in phases of ``--phase`` seconds alternating without and with a second connection that
  takes reconciliation slices back to back (the worst case: a real manager takes one every
  ``slice_interval`` at most, 0.2 s by default, and reconciliation gets 20 % of those), two pairs:
  ack statement p50/p99/max per phase.

    .venv/bin/python -m benchmarks.maintenance [--acked 160000] [--backlog 160000] [--slice-rows 500]
                                              [--phase 10] [--phase-events 100000] [--dsn URI]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

from benchmarks.lib.machine import machine_info
from benchmarks.lib.report import pct_ms
from benchmarks.lib.server import bench_server, one_shard_queue, server_info
from queue_manager.manager import store

logger = logging.getLogger("bench.maintenance")

QUEUE = "bench_q"
PARTITIONS = 16
ACK_BATCH = 100


def _ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {}
    return {
        "n": len(values),
        "p50_ms": pct_ms(values, 50),
        "p90_ms": pct_ms(values, 90),
        "p99_ms": pct_ms(values, 99),
        "max_ms": pct_ms(values, 100),
    }


def _fill(dsn: str, events: int, state: str) -> None:
    """``events`` events of tenants spread over the shuffle sets, then set to ``state``."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            f"INSERT INTO {QUEUE} (tenant, payload, fire_at) "
            "SELECT 't-' || (i %% 5000), '{}', now() - interval '1 hour' FROM generate_series(1, %s) i",
            (events,),
        )
        if state == "acked":
            conn.execute(
                f"UPDATE {QUEUE} SET state = 'acked', attempts = 1, acked_at = now() - interval '1 hour' "
                "WHERE state = 'to_be_fired'"
            )
        conn.execute(f"VACUUM ANALYZE {QUEUE}")
        conn.execute("SELECT qm.reconcile_load(%s)", (QUEUE,))


async def _settings(conn: store.AsyncConn) -> Any:
    [q] = [q for q in await store.load_queues(conn) if q.name == QUEUE]
    return q


async def retention(dsn: str, acked: int, rows: int) -> dict[str, Any]:
    _fill(dsn, acked, "acked")
    conn = await store.connect_maintenance(dsn, "bench-maint")
    try:
        q = await _settings(conn)
        times: list[float] = []
        deleted = 0
        started = time.perf_counter()
        for p in range(PARTITIONS):
            while True:
                t0 = time.perf_counter()
                a, f, full = await store.slice_purge(conn, q, p, rows)
                times.append(time.perf_counter() - t0)
                deleted += a + f
                if not full:
                    break
        took = time.perf_counter() - started
    finally:
        await conn.close()
    return {
        "acked": acked,
        "slice_rows": rows,
        "deleted": deleted,
        "slice": _ms(times),
        "events_per_s": round(deleted / took),
    }


async def reconciliation(dsn: str, backlog: int, rounds: int = 5) -> dict[str, Any]:
    _fill(dsn, backlog, "to_be_fired")
    conn = await store.connect_maintenance(dsn, "bench-maint")
    try:
        q = await _settings(conn)
        times: list[float] = []
        for _ in range(rounds):
            for p in range(PARTITIONS):
                t0 = time.perf_counter()
                await store.slice_reconcile(conn, q, p)
                times.append(time.perf_counter() - t0)
    finally:
        await conn.close()
    return {"backlog": backlog, "per_partition": backlog // PARTITIONS, "slice": _ms(times)}


async def acks_beside_slices(dsn: str, phase: float, events: int) -> dict[str, Any]:
    """Each phase: ``events`` more due events (vacuumed first), fired and acked in batches."""
    ctl = await store.connect(dsn, "bench-ctl")
    writer = await store.connect(dsn, "bench-writer")
    maint = await store.connect_maintenance(dsn, "bench-maint")
    try:
        term = await store.acquire(ctl, "bench", 3600)
        assert term is not None
        q = await _settings(writer)
        phases: list[dict[str, Any]] = []
        for pair in range(2):
            for slicing in (False, True):
                await asyncio.to_thread(_fill, dsn, events, "to_be_fired")
                stop = asyncio.Event()
                sliced = 0
                aborted = 0

                async def slices(stop: asyncio.Event) -> None:
                    nonlocal sliced, aborted
                    p = 0
                    while not stop.is_set():
                        try:
                            await store.slice_reconcile(maint, q, p % PARTITIONS)
                            sliced += 1
                        except psycopg.errors.LockNotAvailable:
                            aborted += 1
                        p += 1

                task = asyncio.create_task(slices(stop)) if slicing else None
                times: list[float] = []
                cursor = 0
                deadline = time.perf_counter() + phase
                while time.perf_counter() < deadline:
                    rows, _, _ = await store.fire_due(writer, q, term, cursor, ACK_BATCH)
                    if not rows:
                        break
                    cursor = (rows[-1][2] + 1) % PARTITIONS
                    t0 = time.perf_counter()
                    await store.ack(writer, q, term, [(r[0], r[3]) for r in rows])
                    times.append(time.perf_counter() - t0)
                stop.set()
                if task is not None:
                    await task
                phases.append(
                    {
                        "pair": pair,
                        "slices": slicing,
                        "reconciliation_slices": sliced,
                        "slices_aborted": aborted,
                        "acked": len(times) * ACK_BATCH,
                        "ack_statement": _ms(times),
                    }
                )
        await store.resign(ctl, "bench", term)
    finally:
        for c in (ctl, writer, maint):
            await c.close()
    return {"ack_batch": ACK_BATCH, "phase_s": phase, "phases": phases}


def _loadavg() -> str | None:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return None


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"machine": machine_info(), "loadavg_before": _loadavg()}
    with bench_server(args.dsn, "maint") as (_, dsn):
        one_shard_queue(dsn, QUEUE, {"partitions": PARTITIONS, "shuffle": 4, "retention_seconds": 60})
        out["server"] = server_info(dsn)
        logger.info("retention")
        out["retention"] = await retention(dsn, args.acked, args.slice_rows)
        logger.info("reconciliation")
        out["reconciliation"] = await reconciliation(dsn, args.backlog)
        logger.info("acks beside slices")
        out["acks_beside_slices"] = await acks_beside_slices(dsn, args.phase, args.phase_events)
    out["loadavg_after"] = _loadavg()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--acked", type=int, default=160_000)
    parser.add_argument("--backlog", type=int, default=160_000)
    parser.add_argument("--slice-rows", type=int, default=500)
    parser.add_argument("--phase", type=float, default=10.0)
    parser.add_argument("--phase-events", type=int, default=100_000, help="due events added before each ack phase")
    parser.add_argument("--dsn", help="admin DSN of an existing server (default: a dedicated embedded one)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    print(json.dumps(asyncio.run(main_async(args)), indent=2))


if __name__ == "__main__":
    main()
