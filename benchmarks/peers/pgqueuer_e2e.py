"""PgQueuer measured as ``benchmarks.e2e`` measures this project: one JSON line on stdout.

* **drain**: ``--events`` jobs preloaded untimed (the batch ``Queries.enqueue``, then ANALYZE and
  CHECKPOINT); ``--procs`` worker processes, each one ``PgQueuer`` on its own asyncpg connection
  with a no-op async handler, run in drain mode with ``--batch-size``; the clock starts at the
  go and stops when the last worker's ``run()`` returns (its statuses flushed, the job rows
  deleted). PgQueuer's best drain on 2 cores is 2 processes and a batch of 500 to 1 000.
* **latency**: one worker in continuous mode idles (LISTEN/NOTIFY wake-up); this process enqueues
  ``--events`` jobs at ``--rate``/s with open-loop pacing, one transaction each (after warm-up
  jobs), the payload carrying the sequence number; raw commit -> handler start timings.

The driver and loop are PgQueuer's own choice for ``pgq run``: asyncpg on uvloop.
"""

from __future__ import annotations

import asyncio
import importlib.metadata as md
import json
import time
from typing import Any

import asyncpg
import uvloop
from pgqueuer import PgQueuer, Queries
from pgqueuer.models import Job
from pgqueuer.types import QueueExecutionMode

from benchmarks.peers import harness
from benchmarks.peers.harness import Worker

ENTRYPOINT = "noop"


def payload(seq: int, t: float) -> bytes:
    return json.dumps({"seq": seq, "t": t}).encode()


async def install(dsn: str) -> list[str]:
    """PgQueuer's schema in the scratch database; its queue and log tables."""
    conn = await asyncpg.connect(dsn)
    try:
        queries = Queries.from_asyncpg_connection(conn)
        await queries.install()
        settings = queries.qbe.settings
        return [settings.queue_table, settings.queue_table_log]
    finally:
        await conn.close()


async def enqueue_many(dsn: str, n: int, chunk: int = 1000) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        queries = Queries.from_asyncpg_connection(conn)
        for start in range(0, n, chunk):
            b = min(chunk, n - start)
            await queries.enqueue([ENTRYPOINT] * b, [payload(start + k, 0.0) for k in range(b)], [0] * b)
    finally:
        await conn.close()


def worker(w: Worker, dsn: str, batch_size: int, mode: str, record: bool) -> None:
    """One PgQueuer on its own connection, in a spawned process."""

    async def main() -> None:
        conn = await asyncpg.connect(dsn)
        pgq = PgQueuer.from_asyncpg_connection(conn)
        ids: list[int] = []
        receipts: list[tuple[int, float]] = []

        @pgq.entrypoint(ENTRYPOINT)
        async def noop(job: Job) -> None:
            t = time.time()
            w.handled.value += 1
            ids.append(int(job.id))
            if record and job.payload is not None:
                receipts.append((json.loads(job.payload)["seq"], t))

        async def stop_on_request() -> None:
            await w.wait_stop()
            pgq.shutdown.set()

        await w.wait_go()
        stopper = asyncio.create_task(stop_on_request())
        error = None
        try:
            await pgq.run(batch_size=batch_size, mode=QueueExecutionMode(mode))
        except Exception as exc:  # reported, so the parent does not wait for nothing
            error = repr(exc)
        t_end = time.time()
        w.out_q.put(
            {"idx": w.idx, "handled": len(ids), "ids": ids, "receipts": receipts, "t_end": t_end, "error": error}
        )
        await w.wait_stop()  # the backend stays until the parent has read the CPU
        stopper.cancel()
        await conn.close()

    uvloop.run(main())


def drain(dsn: str, tables: list[str], args: Any) -> dict[str, Any]:
    uvloop.run(enqueue_many(dsn, args.events))
    harness.settle(dsn, tables)
    t0, results, cpu, cost = harness.run_workers(
        worker, args.procs, (dsn, args.batch_size, "drain", False), args.budget, dsn
    )
    out = harness.drain_report(t0, results, args.procs, args.events, cpu, cost)
    out["left_in_queue_table"] = harness.scalar(dsn, f"SELECT count(*) FROM {tables[0]}")
    return out


def latency(dsn: str, args: Any) -> dict[str, Any]:
    async def produce(total: int, warmup: int) -> tuple[dict[int, tuple[float, float]], float]:
        conn = await asyncpg.connect(dsn)
        queries = Queries.from_asyncpg_connection(conn)
        sent = await harness.paced_sends(
            args.rate, total, warmup, lambda seq, t_call: queries.enqueue(ENTRYPOINT, payload(seq, t_call))
        )
        await conn.close()
        return sent

    # the worker in run(): schema checked, LISTEN, an empty dequeue, then idle
    return harness.latency_run(
        worker,
        (dsn, args.batch_size, "continuous", True),
        lambda total, warmup: uvloop.run(produce(total, warmup)),
        args.rate,
        args.events,
    )


def main() -> None:
    args = harness.parse_args(
        (__doc__ or "").split("\n\n")[0],
        lambda p: p.add_argument("--batch-size", type=int, default=10, help="dequeue batch size (pgq run's: 10)"),
    )
    with harness.scratch_database(args.dsn, "pgq") as dsn:
        tables = uvloop.run(install(dsn))
        harness.log("pgqueuer %s: %s", md.version("pgqueuer"), args.measurement)
        result = drain(dsn, tables, args) if args.measurement == "drain" else latency(dsn, args)
        harness.emit(
            "pgqueuer",
            md.version("pgqueuer"),
            args.measurement,
            dsn,
            result,
            driver=f"asyncpg {md.version('asyncpg')}",
            event_loop=f"uvloop {md.version('uvloop')}",
            procs=args.procs if args.measurement == "drain" else 1,
            batch_size=args.batch_size,
        )


if __name__ == "__main__":
    main()
