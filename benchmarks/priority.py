"""Priorities: a priority-1 stream beside a 100k-event backlog of priority 3, a priority-5 event's
wait against the aging bound, and the backlog's drain against a build without priorities.

Prints one JSON object on stdout (logs go to stderr). One shard, one queue (``bench_q``, 16
partitions, shuffle 4), one manager process. Three parts:

* **stream** (``--reps`` pairs, alternating which comes first): the urgent tenant's producer commits
  ``--rate`` events/s of priority 1 (one autocommit INSERT each) for ``--seconds``, **alone**, and
  **beside** a backlog of ``--backlog`` events of priority 3 (the queue's default) from random
  tenants, preloaded by one COPY. ``--receivers`` receiver processes of ``--credit`` handler slots
  each, a handler of ``--service`` seconds: the backlog keeps every slot busy for the whole run
  (at most receivers x credit / service events/s), so a priority-1 event waits for a free slot and
  the next pick. Pickup delay = handler start (``time.time()``) minus the event's ``fire_at``. Per
  case the medians over the pairs and their spread; the target is p99 beside <= 1.2 x p99 alone.
  The queue's aging (30 s a level by default) leaves the backlog behind the stream for the run: its
  level counts one higher after 30 s, at the top after 60 s.
* **aging**: the same beside run, with ``priority_aging_seconds`` ``--aging`` and ``--late``
  events of priority 5 due a millisecond before the backlog, both scheduled ``--setup`` seconds
  ahead (the backlog and the fleet are set up meanwhile), the stream from then on. The
  level of priority 5 counts at the top once its oldest event has waited (5 - 1) x aging, and then
  goes first (its events are the oldest of all): each waits at most that, plus a free slot and a
  pick (``BOUND_SLACK``). Without aging it would wait for the whole backlog and the stream.
* **drain**: the backlog drained by fast no-op receivers (``make bench-e2e``'s drain, run as
  ``python -m benchmarks.e2e --drain-only`` on the same server). With ``--other DIR`` (a checkout
  of a build without priorities, with its own ``.venv``) the same backlog is drained by that build
  beside ours, alternated, in the same run; the target is ours >= 0.95 x the other's (medians).
  Also a backlog of the same size spread over priorities 1, 3 and 5 (``--event-priorities``), ours
  only.

    .venv/bin/python -m benchmarks.priority [--reps 3] [--seconds 30] [--rate 20] [--backlog 100000]
                                            [--receivers 2] [--credit 50] [--service 0.05]
                                            [--aging 5] [--late 3] [--drain-reps 3] [--other DIR]
                                            [--skip stream,aging,drain] [--dsn URI] [--json-only]
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg

from benchmarks.lib.backlog import count_where, preload, reset, wait_none_left
from benchmarks.lib.fleet import make_events, manager_process, start_producer, start_receivers
from benchmarks.lib.machine import code_version, count_server
from benchmarks.lib.report import alternated, beside_over_alone, emit, header, pct_ms, run_main
from benchmarks.lib.server import QUEUE, bench_server, one_shard_queue, server_info

logger = logging.getLogger("bench.priority")

PARTITIONS, SHUFFLE = 16, 4
QUEUE_SETTINGS = {"partitions": PARTITIONS, "shuffle": SHUFFLE}
#: the tenant of the priority-1 stream, and of the priority-5 events of the aging part
URGENT = "urgent-0"
LATE = "late-0"
TARGET_RATIO = 1.2
TARGET_DRAIN = 0.95
#: what a priority-5 event may wait beyond (5 - 1) x aging: a free slot (the service time) and a pick
BOUND_SLACK = 0.25
DEFAULT_AGING = 30.0


def alter(dsn: str, **settings: Any) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT qm.alter_queue(%s, %s::jsonb)", (QUEUE, json.dumps(settings)))


def insert_late(dsn: str, n: int, fire_at: datetime) -> None:
    with psycopg.connect(dsn) as conn:
        for i in range(n):
            conn.execute(
                f"INSERT INTO {QUEUE} (tenant, payload, priority, fire_at) VALUES (%s, %s, 5, %s)",
                (LATE, json.dumps({"late": i}), fire_at),
            )
        conn.commit()


def run_once(
    dsn: str, backlog: int, args: argparse.Namespace, seed: int, aging: float = DEFAULT_AGING, late: int = 0
) -> dict[str, Any]:
    """One run: the urgent tenant's stream of priority 1, beside ``backlog`` events of priority 3
    when > 0, with ``late`` events of priority 5 due a millisecond before the backlog. With
    ``late``, the backlog and the late events are scheduled ``--setup`` seconds ahead, so that the
    backlog and the fleet are set up before anything is due (``setup_s``: how long that took)."""
    reset(dsn)
    alter(dsn, priority_aging_seconds=aging)
    begin = time.time()
    due = datetime.fromtimestamp(begin + args.setup, UTC) if late else None
    if late and due is not None:
        insert_late(dsn, late, due - timedelta(milliseconds=1))
    if backlog:
        preload(dsn, make_events(backlog, seed, [due] * backlog if due is not None else None))
    n = int(args.rate * args.seconds)
    with manager_process(dsn) as m:
        recv = start_receivers(args.receivers, m.url, "tenant", args.credit, args.credit, service=args.service)
        try:
            recv.wait_ready()
            prod = start_producer(dsn, n, args.rate, seed=seed, tenant=URGENT, name="urgent-producer", priority=1)
            prod.wait_ready()
            recv.go.set()
            setup_s = time.time() - begin
            if due is not None:
                time.sleep(max(0.0, due.timestamp() - time.time()))
            time.sleep(args.settle)
            t0 = time.time()
            prod.go.set()
            prod.result(timeout=args.seconds + 120)
            t1 = time.time()
            backlog_left = count_where(dsn, "priority = 3 AND state = 'to_be_fired'")
            # the stream's (and the late) events: all handled
            wait_none_left(dsn, "priority <> 3 AND state IN ('to_be_fired', 'fired')")
            time.sleep(0.5)
        finally:
            results = recv.finish()
    first: dict[tuple[str, int], float] = {}
    fire_at: dict[tuple[str, int], float] = {}
    backlog_in_window = 0
    for r in results:
        for tenant, ident, fat, t in r["records"]:
            if tenant in (URGENT, LATE):
                key = (tenant, ident)
                first[key] = min(t, first.get(key, t))
                fire_at[key] = fat
            elif t0 <= t <= t1:
                backlog_in_window += 1
    urgent = [first[k] - fire_at[k] for k in first if k[0] == URGENT]
    late_waits = [first[k] - fire_at[k] for k in first if k[0] == LATE]
    out: dict[str, Any] = {
        "urgent_events": n,
        "received": len(urgent),
        "p50_ms": pct_ms(urgent, 50),
        "p99_ms": pct_ms(urgent, 99),
        "max_ms": pct_ms(urgent, 100),
        "backlog_received_per_s": round(backlog_in_window / (t1 - t0), 1) if backlog else 0.0,
        "backlog_left": backlog_left,
        "saturated_throughout": bool(backlog) and backlog_left > 0,
    }
    if late:
        out["aging_s"] = aging
        out["late_waits_s"] = sorted(round(w, 3) for w in late_waits)
        out["late_received"] = len(late_waits)
        out["setup_s"] = round(setup_s, 3)
    return out


def bench_stream(dsn: str, args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"alone": [], "beside": []}
    for rep, side in alternated(args.reps):
        r = run_once(dsn, args.backlog if side == "beside" else 0, args, seed=rep)
        logger.info("stream rep %d %s: %s", rep, side, json.dumps(r))
        runs[side].append(r)
    out = beside_over_alone(runs["alone"], runs["beside"], "backlog_received_per_s")
    ratio = out["p99_beside_over_alone"]
    return {**out, "target": TARGET_RATIO, "met": ratio is not None and ratio <= TARGET_RATIO}


def bench_aging(dsn: str, args: argparse.Namespace) -> dict[str, Any]:
    r = run_once(dsn, args.backlog, args, seed=99, aging=args.aging, late=args.late)
    logger.info("aging: %s", json.dumps(r))
    bound = (5 - 1) * args.aging
    waits = r["late_waits_s"]
    if r["setup_s"] >= args.setup:
        logger.warning("the setup took %.1f s, more than --setup %.1f s: raise it", r["setup_s"], args.setup)
    return {
        "aging_s": args.aging,
        "late_events": args.late,
        "late_waits_s": waits,
        "bound_s": bound,
        "slack_s": BOUND_SLACK,
        "setup_s": r["setup_s"],
        "backlog_left_after_stream": r["backlog_left"],
        "met": len(waits) == args.late and max(waits) <= bound + BOUND_SLACK and r["setup_s"] < args.setup,
        "run": r,
    }


def e2e_drain(admin_dsn: str, args: argparse.Namespace, *extra: str) -> dict[str, Any]:
    """``make bench-e2e``'s drain of ``--backlog`` events on this server (its own database), as
    its report's ``drain``."""
    cmd = [
        *(sys.executable, "-m", "benchmarks.e2e", "--drain-only", "--no-peers", "--no-library", "--dsn", admin_dsn),
        *("--events", str(args.backlog), "--reps", str(args.drain_reps), "--receivers", str(args.drain_receivers)),
        *("--credit", str(args.drain_credit), "--concurrency", str(args.drain_concurrency), *extra),
    ]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1]).stdout
    drain: dict[str, Any] = json.loads(out)["drain"]
    return drain


def bench_drains(admin_dsn: str, args: argparse.Namespace) -> dict[str, Any]:
    same = e2e_drain(admin_dsn, args, *(() if args.other is None else ("--other", str(args.other.resolve()))))
    # the same size spread over three levels: each pick reads the levels it finds
    mixed = e2e_drain(admin_dsn, args, "--event-priorities", "1,3,5")
    out: dict[str, Any] = {
        "events": args.backlog,
        "config": {
            "receivers": args.drain_receivers,
            "credit": args.drain_credit,
            "concurrency": args.drain_concurrency,
        },
        "priority_3": same["best"],
        "mixed_levels_events_per_s": {
            "median": mixed["best"]["events_per_s"],
            "samples": mixed["best"]["samples"],
            "per_event_median": mixed["best"]["per_event_median"],
        },
    }
    if "other" in same:
        out["other"] = {k: same["other"][k] for k in ("checkout", "code", "best")}
        out["ratio_to_other"] = same["other"]["best_ratio"]
        out["target"] = TARGET_DRAIN
        out["met"] = same["other"]["best_ratio"] is not None and same["other"]["best_ratio"] >= TARGET_DRAIN
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3, help="pairs of runs (alone, beside) of the stream (default 3)")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long the stream runs (default 30)")
    parser.add_argument("--rate", type=float, default=20.0, help="the stream's events/s of priority 1 (default 20)")
    parser.add_argument("--backlog", type=int, default=100_000, help="the backlog of priority 3 (default 100000)")
    parser.add_argument("--receivers", type=int, default=2, help="receiver processes (default 2)")
    parser.add_argument("--credit", type=int, default=50, help="handler slots per receiver (default 50)")
    parser.add_argument("--service", type=float, default=0.05, help="seconds the handler takes (default 0.05)")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds between subscribe and the stream")
    parser.add_argument("--aging", type=float, default=5.0, help="priority_aging_seconds of the aging run (default 5)")
    parser.add_argument("--late", type=int, default=3, help="events of priority 5 in the aging run (default 3)")
    parser.add_argument(
        "--setup", type=float, default=30.0, help="seconds the aging run's events are scheduled ahead (default 30)"
    )
    parser.add_argument("--drain-reps", type=int, default=3, help="drains of each side (default 3)")
    parser.add_argument("--drain-receivers", type=int, default=1, help="receiver processes of the drain (default 1)")
    parser.add_argument("--drain-credit", type=int, default=4000, help="credit of a drain receiver (default 4000)")
    parser.add_argument("--drain-concurrency", type=int, default=32, help="handler tasks of a drain receiver")
    parser.add_argument(
        "--other", type=Path, help="a checkout of a build without priorities (with its .venv): its drain, alternated"
    )
    parser.add_argument("--skip", default="", help="parts to skip: stream, aging, drain (comma-separated)")
    parser.add_argument("--dsn", help="administrative database of an existing server (default: an embedded one)")
    parser.add_argument("--json-only", action="store_true", help="no logs on stderr (only warnings)")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.json_only else logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s"
    )
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if args.other is not None and not (args.other / ".venv" / "bin" / "python").exists():
        parser.error(f"--other {args.other}: no .venv/bin/python there (run make setup in it)")
    capacity = args.receivers * args.credit / args.service
    if args.backlog < capacity * (args.settle + args.seconds):
        logger.warning(
            "the backlog drains in %.0f s at %.0f/s: less than the stream", args.backlog / capacity, capacity
        )
    started = time.time()
    with bench_server(args.dsn, "prio") as (admin_dsn, dsn):
        one_shard_queue(dsn, QUEUE, QUEUE_SETTINGS)
        count_server(dsn)
        info = server_info(dsn)
        stream = None if "stream" in skip else bench_stream(dsn, args)
        aging = None if "aging" in skip else bench_aging(dsn, args)
        drain = None if "drain" in skip else bench_drains(admin_dsn, args)
    met = [part["met"] for part in (stream, aging, drain) if part is not None and "met" in part]
    report = {
        **header("priority"),
        **info,
        "code": code_version(),
        "params": {
            "queue": {"name": QUEUE, **QUEUE_SETTINGS},
            "reps": args.reps,
            "urgent_rate_per_s": args.rate,
            "urgent_seconds": args.seconds,
            "backlog": args.backlog,
            "receivers": args.receivers,
            "credit": args.credit,
            "service_s": args.service,
            "receiver_capacity_per_s": capacity,
            "aging_s": args.aging,
            "targets": {"p99_ratio_max": TARGET_RATIO, "drain_ratio_min": TARGET_DRAIN},
        },
        "stream": stream,
        "aging": aging,
        "drain": drain,
        "met": all(met) if met else None,
        "wall_s": round(time.time() - started, 1),
    }
    emit(report)
    return 0


if __name__ == "__main__":
    run_main(main)
