"""The TypeScript receiver against the Python library: ``python -m benchmarks.ts_receiver``
(``make bench-ts-receiver``; JSON on stdout).

One shard and one manager (the conformance suite's fleet); per run a fresh queue is loaded with
``--events`` events (COPY, before the receiver starts), then one receiver process drains it with a
no-op handler and ``--concurrency`` handler slots: the Python library (``qm receive``) or the
TypeScript receiver (``clients/typescript``, ``node dist/src/cli.js``), alternated run by run. A
run's rate is its events over the time from the receiver's start to the last ack committed (the
database's count, polled every 50 ms); the steady rate leaves out the first 5 % (start-up and
connection). The report gives each run, each client's median, and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from benchmarks.lib.backlog import preload
from benchmarks.lib.report import emit, header
from conformance.fleet import SECRET_ALL, SHARD, Fleet, FleetConfig
from queue_manager import admin
from queue_manager.local import fleet as local
from queue_manager.producer import Event

ROOT = Path(__file__).resolve().parents[1]
TS_CLI = ROOT / "clients" / "typescript" / "dist" / "src" / "cli.js"
NOOP_PY = "async def handle(event):\n    pass\n"
NOOP_JS = "export async function handle(event) {}\n"


def acked(dsn: str, queue: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            sql.SQL("SELECT count(*) FROM {} WHERE state = 'acked'").format(sql.Identifier(queue))
        ).fetchone()
    return int(row[0]) if row else 0


def one_run(fleet: Fleet, client: str, n: int, concurrency: int, handlers: Path, run: int) -> dict[str, Any]:
    assert fleet.topology is not None
    queue = f"bench_{client[:2]}_{run}"
    admin.create_queue(fleet.topology, queue, {"partitions": 16, "shuffle": 4, "ack_timeout_seconds": 60})
    rng = random.Random(run)
    load_s = preload(fleet.dsn, [Event(f"tenant-{rng.randrange(200)}", {"n": i}) for i in range(n)], queue)
    url = f"{SHARD}={fleet.urls[0]}"
    if client == "python":
        managers = {SHARD: fleet.urls[:1]}
        argv = local.qm(
            *local.receiver_argv(
                queue, "noop:handle", managers=managers, token=SECRET_ALL, concurrency=concurrency, extend_after=0
            )
        )
    else:
        argv = ["node", str(TS_CLI), "--queue", queue, "--manager", url, "--token", SECRET_ALL]
        argv += ["--concurrency", str(concurrency), "--extend-after", "0", str(handlers / "noop.mjs")]
    started = time.monotonic()
    proc = subprocess.Popen(argv, cwd=handlers, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marks: dict[float, float] = {}
    try:
        done = 0
        while done < n:
            if proc.poll() is not None:
                raise RuntimeError(f"the {client} receiver exited ({proc.returncode}) with {done} of {n} acked")
            if time.monotonic() - started > 600:
                raise RuntimeError(f"the {client} receiver acked {done} of {n} in 600 s")
            time.sleep(0.05)
            done = acked(fleet.dsn, queue)
            marks.setdefault(done, time.monotonic())
        total = time.monotonic() - started
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        if proc.poll() is None:
            proc.kill()
    warm = min((t for c, t in marks.items() if c >= n * 0.05), default=started)
    steady = (n * 0.95) / max(total - (warm - started), 1e-9)
    return {
        "client": client,
        "run": run,
        "events": n,
        "load_s": round(load_s, 2),
        "drain_s": round(total, 2),
        "events_per_s": round(n / total),
        "steady_events_per_s": round(steady),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3, help="runs per client, alternated")
    args = parser.parse_args()
    if not TS_CLI.exists():
        sys.exit(f"{TS_CLI} is not built: make setup builds clients/typescript")
    report = header("ts_receiver")
    report.update(events=args.events, concurrency=args.concurrency, handler="no-op")
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="qm-bench-ts-") as tmp:
        handlers = Path(tmp)
        (handlers / "noop.py").write_text(NOOP_PY)
        (handlers / "noop.mjs").write_text(NOOP_JS)
        fleet = Fleet(FleetConfig(managers=1, ping_interval=10, ping_timeout=10, lease_ttl=5))
        try:
            fleet.start()
            for i in range(args.runs):
                order = ("python", "typescript") if i % 2 == 0 else ("typescript", "python")
                for client in order:
                    result = one_run(fleet, client, args.events, args.concurrency, handlers, i)
                    print(result, file=sys.stderr, flush=True)
                    runs.append(result)
        finally:
            fleet.stop()
    report["runs"] = runs
    medians = {}
    for client in ("python", "typescript"):
        rates = [r["events_per_s"] for r in runs if r["client"] == client]
        steady = [r["steady_events_per_s"] for r in runs if r["client"] == client]
        medians[client] = {
            "events_per_s_median": round(statistics.median(rates)),
            "min": min(rates),
            "max": max(rates),
            "steady_events_per_s_median": round(statistics.median(steady)),
        }
    report["medians"] = medians
    report["typescript_over_python"] = round(
        medians["typescript"]["events_per_s_median"] / medians["python"]["events_per_s_median"], 2
    )
    emit(report)


if __name__ == "__main__":
    main()
