"""Fair dispatch: a quiet tenant's pickup delay alone and beside a noisy tenant's 100k-event backlog.

Prints one JSON object on stdout (logs go to stderr). One shard, one queue (``bench_q``, 16
partitions, shuffle 4), one manager process, ``--receivers`` receiver processes with
``--credit`` handler slots each and a handler that takes ``--service`` seconds per event (so the
receivers drain at most receivers x credit / service events/s, and a 100k backlog keeps them
saturated for the whole measurement).

For each case (the quiet tenant sharing ``overlap`` of its 4 partitions with the noisy tenant's),
``--reps`` pairs of runs, alternating which comes first:

* **alone**: no backlog; the quiet tenant's producer commits ``--rate`` events/s (one autocommit
  INSERT each) for ``--seconds``;
* **beside**: the noisy tenant's ``--noisy-events`` events are preloaded (one COPY, all due), the
  receivers subscribe and fill every slot, and ``--settle`` seconds later the quiet tenant's
  producer runs as above;
* **capped** (with ``--tenant-cap C``, after each pair): beside again, with the queue's
  ``tenant_max_in_flight`` at C, so the fair pick dispatches by tenant and a noisy tenant capped
  below the receivers' slots leaves some free for the others.

Pickup delay = the receiver's handler start (``time.time()``) minus the event's ``fire_at``
(database clock, the moment the row was formed; same machine, same clock). Per run: p50, p99 and
max of the quiet tenant's events; the noisy tenant's events received per second while the quiet
producer ran, and its backlog left when the producer stopped (> 0: the receivers were saturated
all along). Per case: the medians over the reps, their spread (min, max), and p99 beside / p99
alone (target: at most 2).

    .venv/bin/python -m benchmarks.fairness [--reps 3] [--overlaps 2,0] [--seconds 30] [--rate 20]
                                            [--receivers 2] [--credit 50] [--service 0.05]
                                            [--noisy-events 100000] [--tenant-cap C] [--dsn URI]
                                            [--json-only]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

import psycopg

from benchmarks.lib.backlog import count_where, preload, reset, wait_none_left
from benchmarks.lib.fleet import manager_process, start_producer, start_receivers
from benchmarks.lib.machine import code_version, count_server
from benchmarks.lib.report import alternated, beside_over_alone, emit, header, pct_ms, run_main, spread
from benchmarks.lib.server import QUEUE, bench_server, one_shard_queue, server_info
from queue_manager.domain.routing import shuffle_set
from queue_manager.producer import Event

logger = logging.getLogger("bench.fairness")

PARTITIONS, SHUFFLE = 16, 4
QUEUE_SETTINGS = {"partitions": PARTITIONS, "shuffle": SHUFFLE}
NOISY = "noisy-0"
TARGET_RATIO = 2.0


def quiet_tenant(overlap: int) -> str:
    """The first ``quiet-<i>`` whose shuffle set shares exactly ``overlap`` partitions with the noisy tenant's."""
    noisy = set(shuffle_set(NOISY, PARTITIONS, SHUFFLE))
    for i in range(100_000):
        t = f"quiet-{i}"
        if len(noisy & set(shuffle_set(t, PARTITIONS, SHUFFLE))) == overlap:
            return t
    raise RuntimeError(f"no quiet tenant shares {overlap} partitions with {NOISY}")


def set_tenant_cap(dsn: str, cap: int | None) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT qm.alter_queue(%s, %s::jsonb)", (QUEUE, json.dumps({"tenant_max_in_flight": cap})))


def run_once(
    dsn: str, quiet: str, noisy_events: int, args: argparse.Namespace, seed: int, cap: int | None = None
) -> dict[str, Any]:
    """One run: the quiet tenant's trickle, with the noisy backlog when ``noisy_events`` > 0, and
    with the queue's per-tenant cap ``cap`` (the fair pick) when given."""
    reset(dsn)
    set_tenant_cap(dsn, cap)
    if noisy_events:
        preload(dsn, [Event(NOISY, {"n": i}) for i in range(noisy_events)])
    n = int(args.rate * args.seconds)
    with manager_process(dsn) as m:
        recv = start_receivers(args.receivers, m.url, "tenant", args.credit, args.credit, service=args.service)
        try:
            recv.wait_ready()  # subscribed: with a backlog, every slot is busy from here on
            prod = start_producer(dsn, n, args.rate, seed=seed, tenant=quiet, name="fair-producer")
            prod.wait_ready()
            recv.go.set()
            time.sleep(args.settle)
            m.reset_ev.set()  # the manager's call counters count from here
            t0 = time.time()
            prod.go.set()
            prod.result(timeout=args.seconds + 120)
            t1 = time.time()
            noisy_left = count_where(dsn, "tenant = %s AND state = 'to_be_fired'", NOISY)
            # the quiet tenant's last events: wait until they are in (the receivers count every event)
            wait_none_left(dsn, "tenant = %s AND state = 'to_be_fired'", quiet)
            time.sleep(0.5)
        finally:
            results = recv.finish()
    with psycopg.connect(dsn, autocommit=True) as conn:
        parts = dict(
            conn.execute(
                f"SELECT partition, count(*) FROM {QUEUE} WHERE tenant = %s GROUP BY 1 ORDER BY 1", (quiet,)
            ).fetchall()
        )
        # the database's side: fire_at -> the fire statement's start (the wait for a pick)
        fired = dict(
            conn.execute(
                f"SELECT id, extract(epoch FROM fired_at - fire_at)::float8 FROM {QUEUE} "
                "WHERE tenant = %s AND fired_at IS NOT NULL",
                (quiet,),
            ).fetchall()
        )
    first: dict[int, float] = {}
    fire_at: dict[int, float] = {}
    noisy_in_window = 0
    for r in results:
        for tenant, ident, fat, t in r["records"]:
            if tenant == quiet:
                first[ident] = min(t, first.get(ident, t))
                fire_at[ident] = fat
            elif t0 <= t <= t1:
                noisy_in_window += 1
    delays = [first[i] - fire_at[i] for i in first]
    waits = [max(0.0, float(v)) for v in fired.values()]
    return {
        "quiet_events": n,
        "received": len(first),
        "p50_ms": pct_ms(delays, 50),
        "p99_ms": pct_ms(delays, 99),
        "max_ms": pct_ms(delays, 100),
        "until_fired_p50_ms": pct_ms(waits, 50),
        "until_fired_p99_ms": pct_ms(waits, 99),
        "manager_db_calls": m.counters(),
        "quiet_partitions_used": {str(k): int(v) for k, v in parts.items()},
        "noisy_received_per_s": round(noisy_in_window / (t1 - t0), 1) if noisy_events else 0.0,
        "noisy_backlog_left": noisy_left,
        "saturated_throughout": bool(noisy_events) and noisy_left > 0,
    }


def run_case(dsn: str, overlap: int, args: argparse.Namespace) -> dict[str, Any]:
    quiet = quiet_tenant(overlap)
    noisy_set = shuffle_set(NOISY, PARTITIONS, SHUFFLE)
    quiet_set = shuffle_set(quiet, PARTITIONS, SHUFFLE)
    logger.info("overlap %d: quiet %s %s, noisy %s %s", overlap, quiet, quiet_set, NOISY, noisy_set)
    runs: dict[str, list[dict[str, Any]]] = {"alone": [], "beside": [], "capped": []}
    for rep, side in alternated(args.reps, *(["capped"] if args.tenant_cap else [])):
        events = 0 if side == "alone" else args.noisy_events
        r = run_once(dsn, quiet, events, args, seed=rep, cap=args.tenant_cap if side == "capped" else None)
        logger.info("overlap %d rep %d %s: %s", overlap, rep, side, json.dumps(r))
        runs[side].append(r)
    capped = runs["capped"]
    compared = beside_over_alone(runs["alone"], runs["beside"], "noisy_received_per_s")
    ratio, a99 = compared["p99_beside_over_alone"], compared["alone"]["p99_ms"]["median"]
    return {
        "overlap": overlap,
        "quiet_tenant": quiet,
        "quiet_partitions": list(quiet_set),
        "noisy_tenant": NOISY,
        "noisy_partitions": list(noisy_set),
        "shared_partitions": sorted(set(noisy_set) & set(quiet_set)),
        **compared,
        "beside_noisy_capped": None
        if not capped
        else {
            "tenant_max_in_flight": args.tenant_cap,
            "p50_ms": spread(capped, "p50_ms"),
            "p99_ms": spread(capped, "p99_ms"),
            "p99_over_alone": round(spread(capped, "p99_ms")["median"] / a99, 2)
            if a99 and spread(capped, "p99_ms")["median"]
            else None,
            "runs": capped,
        },
        # a quiet tenant whose every partition the noisy one shares waits behind its backlog by
        # design (shuffle sharding bounds how many tenants that is: about (k/N)^k); reported, not a target
        "counts_for_target": overlap < SHUFFLE,
        "met": ratio is not None and ratio <= TARGET_RATIO,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3, help="pairs of runs (alone, beside) per case (default 3)")
    parser.add_argument(
        "--overlaps", default="2,0", help="partitions the quiet tenant shares with the noisy one, a case each"
    )
    parser.add_argument("--seconds", type=float, default=30.0, help="how long the quiet tenant sends (default 30)")
    parser.add_argument("--rate", type=float, default=20.0, help="the quiet tenant's events/s (default 20)")
    parser.add_argument("--receivers", type=int, default=2, help="receiver processes (default 2)")
    parser.add_argument("--credit", type=int, default=50, help="handler slots per receiver (default 50)")
    parser.add_argument("--service", type=float, default=0.05, help="seconds the handler takes (default 0.05)")
    parser.add_argument("--noisy-events", type=int, default=100_000, help="the noisy tenant's backlog (default 100000)")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds between subscribe and the quiet trickle")
    parser.add_argument(
        "--tenant-cap",
        type=int,
        help="also run beside with the queue's tenant_max_in_flight at this value (the fair pick; below the "
        "receivers' slots, the noisy tenant leaves some free)",
    )
    parser.add_argument("--dsn", help="administrative database of an existing server (default: an embedded one)")
    parser.add_argument("--json-only", action="store_true", help="no logs on stderr (only warnings)")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.json_only else logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s"
    )
    overlaps = [int(x) for x in args.overlaps.split(",") if x]
    capacity = args.receivers * args.credit / args.service
    if args.noisy_events < capacity * (args.settle + args.seconds):
        logger.warning(
            "the backlog (%d) drains in %.0f s at %.0f/s: less than the measurement",
            args.noisy_events,
            args.noisy_events / capacity,
            capacity,
        )
    started = time.time()
    with bench_server(args.dsn, "fair") as (_admin, dsn):
        one_shard_queue(dsn, QUEUE, QUEUE_SETTINGS)
        count_server(dsn)
        info = server_info(dsn)
        cases = [run_case(dsn, o, args) for o in overlaps]
    report = {
        **header("fairness"),
        **info,
        "code": code_version(),
        "params": {
            "queue": {"name": QUEUE, **QUEUE_SETTINGS},
            "reps": args.reps,
            "quiet_rate_per_s": args.rate,
            "quiet_seconds": args.seconds,
            "receivers": args.receivers,
            "credit": args.credit,
            "service_s": args.service,
            "receiver_capacity_per_s": capacity,
            "noisy_events": args.noisy_events,
            "tenant_cap": args.tenant_cap,
            "target_p99_ratio_max": TARGET_RATIO,
        },
        "cases": cases,
        "met": all(c["met"] for c in cases if c["counts_for_target"]),
        "wall_s": round(time.time() - started, 1),
    }
    emit(report)
    return 0


if __name__ == "__main__":
    run_main(main)
