"""Procrastinate measured as ``benchmarks.e2e`` measures this project: one JSON line on stdout.

* **drain**: ``--events`` jobs preloaded untimed (``batch_defer_async``, then ANALYZE and
  CHECKPOINT); ``--procs`` worker processes, each ``run_worker_async(wait=False)`` with
  ``--concurrency`` sub-workers and a pool of concurrency + 1 connections (its docs' advice for
  short jobs) and a no-op async task; the clock starts at the go and stops when the last worker
  returns (caught up, every job finished). Its best drain on 2 cores is 2 processes,
  concurrency 10, ``--delete-jobs always``. Procrastinate has no batch fetch: one fetch and
  one finish call per job, so keep ``--events`` small (it drains at hundreds a second).
* **latency**: one idle worker (``wait=True``, LISTEN/NOTIFY wake-up); this process defers
  ``--events`` jobs at ``--rate``/s with open-loop pacing, one transaction each (after warm-up
  jobs); raw commit -> handler start timings.

The driver and loop are its CLI's: psycopg 3's async pool on the asyncio loop.
"""

from __future__ import annotations

import asyncio
import importlib.metadata as md
import logging
import time
from typing import Any

from procrastinate import App, PsycopgConnector

from benchmarks.peers import harness
from benchmarks.peers.harness import Worker

QUEUE = "bench"
TASK = "noop"


def make_app(dsn: str, pool_size: int | None = None) -> App:
    sizes = {} if pool_size is None else {"min_size": pool_size, "max_size": pool_size}
    return App(connector=PsycopgConnector(conninfo=dsn, **sizes))


def register(app: App, w: Worker | None = None, ids: list[int] | None = None, receipts: list[Any] | None = None) -> Any:
    """The no-op task; in a worker it counts each start, and records (seq, start) when asked."""

    @app.task(name=TASK, queue=QUEUE)
    async def noop(seq: int, t: float) -> None:
        now = time.time()
        if w is not None:
            w.handled.value += 1
        if ids is not None:
            ids.append(seq)
        if receipts is not None:
            receipts.append((seq, now))

    return noop


async def install(dsn: str) -> None:
    app = make_app(dsn)
    async with app.open_async():
        await app.schema_manager.apply_schema_async()


async def defer_many(dsn: str, n: int, chunk: int = 1000) -> None:
    app = make_app(dsn)
    task = register(app)
    async with app.open_async():
        for start in range(0, n, chunk):
            b = min(chunk, n - start)
            await task.batch_defer_async(*[{"seq": start + k, "t": 0.0} for k in range(b)])


def worker(w: Worker, dsn: str, concurrency: int, wait: bool, record: bool, delete_jobs: str) -> None:
    """One procrastinate worker in a spawned process."""

    async def main() -> None:
        app = make_app(dsn, pool_size=concurrency + 1)
        ids: list[int] = []
        receipts: list[tuple[int, float]] = []
        register(app, w, ids, receipts if record else None)
        async with app.open_async():
            await w.wait_go()
            run = asyncio.create_task(
                app.run_worker_async(
                    queues=[QUEUE],
                    concurrency=concurrency,
                    wait=wait,
                    install_signal_handlers=False,
                    delete_jobs=delete_jobs,
                    name=f"bench{w.idx}",
                )
            )
            while not run.done():
                if w.stop.is_set():
                    run.cancel()  # the worker turns a cancellation into a graceful stop
                    break
                await asyncio.wait({run}, timeout=0.05)
            error = None
            try:
                await run
            except asyncio.CancelledError:
                pass
            except Exception as exc:  # reported, so the parent does not wait for nothing
                error = repr(exc)
            t_end = time.time()
            w.out_q.put(
                {"idx": w.idx, "handled": len(ids), "ids": ids, "receipts": receipts, "t_end": t_end, "error": error}
            )
            await w.wait_stop()  # the pool's backends stay until the parent has read the CPU

    asyncio.run(main())


def drain(dsn: str, args: Any) -> dict[str, Any]:
    asyncio.run(defer_many(dsn, args.events))
    harness.settle(dsn, ["procrastinate_jobs"])
    t0, results, cpu, cost = harness.run_workers(
        worker, args.procs, (dsn, args.concurrency, False, False, args.delete_jobs), args.budget, dsn
    )
    out = harness.drain_report(t0, results, args.procs, args.events, cpu, cost)
    out["left_in_jobs_table"] = harness.scalar(dsn, "SELECT count(*) FROM procrastinate_jobs")
    return out


def latency(dsn: str, args: Any) -> dict[str, Any]:
    async def produce(total: int, warmup: int) -> tuple[dict[int, tuple[float, float]], float]:
        app = make_app(dsn)
        task = register(app)
        async with app.open_async():
            return await harness.paced_sends(
                args.rate, total, warmup, lambda seq, t_call: task.defer_async(seq=seq, t=t_call)
            )

    # the worker listens and has found the queue empty: idle
    return harness.latency_run(
        worker,
        (dsn, args.concurrency, True, True, args.delete_jobs),
        lambda total, warmup: asyncio.run(produce(total, warmup)),
        args.rate,
        args.events,
    )


def options(parser: Any) -> None:
    parser.add_argument("--concurrency", type=int, default=10, help="async sub-workers per process (default 10)")
    parser.add_argument(
        "--delete-jobs",
        default="never",
        choices=("never", "successful", "always"),
        help="what a worker does with finished jobs (default never, the library's; always drains fastest)",
    )


def main() -> None:
    args = harness.parse_args((__doc__ or "").split("\n\n")[0], options)
    # The App is made in this module, which runs as __main__: procrastinate warns about that
    # for apps whose tasks are found by module path; ours are found by name.
    logging.getLogger("procrastinate.blueprints").setLevel(logging.ERROR)
    with harness.scratch_database(args.dsn, "procr") as dsn:
        asyncio.run(install(dsn))
        harness.log("procrastinate %s: %s", md.version("procrastinate"), args.measurement)
        result = drain(dsn, args) if args.measurement == "drain" else latency(dsn, args)
        harness.emit(
            "procrastinate",
            md.version("procrastinate"),
            args.measurement,
            dsn,
            result,
            driver=f"psycopg {md.version('psycopg')}, psycopg-pool {md.version('psycopg-pool')}",
            event_loop="asyncio",
            procs=args.procs if args.measurement == "drain" else 1,
            concurrency=args.concurrency,
            pool_size=args.concurrency + 1,
            delete_jobs=args.delete_jobs,
        )


if __name__ == "__main__":
    main()
