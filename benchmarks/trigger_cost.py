"""What the enqueue path costs per row on the server, without the noise of commits: ours against a
plain table, and optionally against another checkout of this repository, alternated.

Prints one JSON object on stdout. One server (an embedded one unless ``--dsn``), one database per
side, each with queue ``bench_q`` (16 partitions, shuffle 4) set up by that side's own code, and a
plain table of the same columns without triggers. Two measurements, each the median of ``--reps``,
the sides alternated within each repetition:

* ``in_txn``: one ``DO`` block inserts ``--rows`` rows (1 000 tenants) one statement at a time, then
  rolls back: the server's time per inserted row (row trigger, statement trigger, index entries);
* ``single``: ``--single`` single-row autocommit INSERTs from one client with
  ``synchronous_commit = off``, so the WAL flush does not dominate: time per transaction, including
  what a transaction takes and gives back at its commit (locks, NOTIFY).

``benchmarks/enqueue.py`` measures what a producer sees (with durable commits, so its ratios move
with the disk's flush time from one run to the next); this one is for a change to the triggers,
measured against the code before it: ``--other DIR`` names a checkout whose ``.venv`` sets up its
side (``git worktree add DIR <commit>`` and ``make setup`` there).

    .venv/bin/python -m benchmarks.trigger_cost [--other DIR] [--reps 21] [--rows 20000]
                                                [--single 3000] [--dsn URI]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from benchmarks.lib.machine import ROOT, machine_info
from benchmarks.lib.server import bench_server, checkout_database, server_info

QUEUE = "bench_q"
PLAIN = "bench_plain"
#: the plain table beside the queue, with the queue table's columns
PLAIN_TABLE = (
    "CREATE TABLE bench_plain (id bigserial PRIMARY KEY, tenant text NOT NULL, payload jsonb NOT NULL,"
    " partition smallint, state text NOT NULL DEFAULT 'to_be_fired', fire_at timestamptz NOT NULL DEFAULT now())"
)


def set_up(admin_dsn: str, name: str, checkout: Path) -> str:
    """Each side's database, set up by its own checkout's code: the queue and the plain table."""
    return checkout_database(checkout, admin_dsn, name, QUEUE, {"partitions": 16, "shuffle": 4}, PLAIN_TABLE)


def in_txn(dsn: str, table: str, rows: int) -> float:
    """Microseconds per row of one DO block of ``rows`` single-row INSERTs, rolled back."""
    block = sql.SQL(
        "DO $$ BEGIN FOR i IN 1..{rows} LOOP INSERT INTO {table} (tenant, payload) "
        "VALUES ('tenant-' || (i % 1000), '{{\"n\": 1}}'); END LOOP; END $$"
    ).format(rows=sql.Literal(rows), table=sql.Identifier(table))
    with psycopg.connect(dsn) as conn:
        start = time.perf_counter()
        conn.execute(block)
        elapsed = time.perf_counter() - start
        conn.rollback()
    return elapsed / rows * 1e6


def single(dsn: str, table: str, n: int) -> float:
    """Microseconds per single-row autocommit INSERT (synchronous_commit off), after a warm-up."""
    insert = sql.SQL("INSERT INTO {} (tenant, payload) VALUES (%s, '{{\"n\": 1}}')").format(sql.Identifier(table))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = off")
        for i in range(200):
            conn.execute(insert, (f"tenant-{i % 1000}",), prepare=True)
        start = time.perf_counter()
        for i in range(n):
            conn.execute(insert, (f"tenant-{i % 1000}",), prepare=True)
        elapsed = time.perf_counter() - start
    return elapsed / n * 1e6


def summary(samples: list[float]) -> dict[str, float]:
    return {
        "median_us": round(statistics.median(samples), 2),
        "min_us": round(min(samples), 2),
        "max_us": round(max(samples), 2),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--other", type=Path, help="another checkout of this repository (with its .venv) to compare")
    parser.add_argument("--reps", type=int, default=21, help="repetitions; medians are reported (default 21)")
    parser.add_argument("--rows", type=int, default=20_000, help="rows per DO block (default 20000)")
    parser.add_argument("--single", type=int, default=3000, help="single-row transactions per sample (default 3000)")
    parser.add_argument("--dsn", help="administrative database of an existing server (default: an embedded one)")
    args = parser.parse_args(argv)
    if args.other is not None and not (args.other / ".venv" / "bin" / "python").exists():
        parser.error(f"--other {args.other}: no .venv/bin/python there (run make setup in it)")
    if args.reps < 1 or args.rows < 1 or args.single < 1:
        parser.error("--reps, --rows and --single take positive numbers")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with bench_server(args.dsn, "trigger-cost") as (admin_dsn, _):
        sides = {"ours": set_up(admin_dsn, "qm_tc_ours", ROOT)}
        if args.other is not None:
            sides["other"] = set_up(admin_dsn, "qm_tc_other", args.other.resolve())
        samples: dict[str, list[float]] = {f"{m}_{s}": [] for m in ("in_txn", "single") for s in [*sides, "plain"]}
        try:
            for rep in range(args.reps):
                order = list(sides) if rep % 2 == 0 else list(reversed(sides))
                for side in order:
                    samples[f"in_txn_{side}"].append(in_txn(sides[side], QUEUE, args.rows))
                samples["in_txn_plain"].append(in_txn(sides["ours"], PLAIN, args.rows))
                for side in order:
                    samples[f"single_{side}"].append(single(sides[side], QUEUE, args.single))
                samples["single_plain"].append(single(sides["ours"], PLAIN, args.single))
        finally:
            with psycopg.connect(admin_dsn, autocommit=True) as conn:
                for name in ("qm_tc_ours", "qm_tc_other"):
                    conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        info = server_info(admin_dsn)
    report: dict[str, Any] = {
        "benchmark": "trigger_cost",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(),
        **info,
        "params": {"reps": args.reps, "rows": args.rows, "single": args.single, "other": str(args.other)},
        "per_row": {k: summary(v) for k, v in samples.items()},
        "ratios": {},
    }
    med = {k: statistics.median(v) for k, v in samples.items()}
    for m in ("in_txn", "single"):
        report["ratios"][f"{m}_plain_over_ours"] = round(med[f"{m}_plain"] / med[f"{m}_ours"], 3)
        if "other" in sides:
            report["ratios"][f"{m}_ours_over_other"] = round(med[f"{m}_ours"] / med[f"{m}_other"], 3)
            report["ratios"][f"{m}_plain_over_other"] = round(med[f"{m}_plain"] / med[f"{m}_other"], 3)
    json.dump(report, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
