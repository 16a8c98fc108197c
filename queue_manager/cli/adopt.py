"""``qm queue adopt``: move a legacy queue table's events into a queue, while it is still written
(the work is :mod:`queue_manager.adopt`'s)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

from queue_manager.cli.common import Subparsers, command, duration, print_json, topology
from queue_manager.domain.adopt import DEFAULT_OUTBOX, AdoptMapping, parse_assignments

if TYPE_CHECKING:
    from queue_manager import adopt


def register(queue: Subparsers) -> None:
    """Add ``adopt`` to the ``qm queue`` group."""
    p = command(queue, "adopt", cmd_queue_adopt, topology=True)
    p.add_argument("queue", help="the target queue (must exist on every shard)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--from", dest="source_dsn", metavar="DSN", help="the legacy database (libpq DSN or URL)")
    source.add_argument("--from-shard", metavar="SHARD", help="the legacy table is in this shard's database")
    p.add_argument("--table", required=True, help="the legacy table: SCHEMA.TABLE, or a name on the search path")
    p.add_argument("--id-col", default="id", help="unique id column, never reused (default id)")
    p.add_argument("--payload-col", help="payload column: json, jsonb or text holding JSON (default payload)")
    p.add_argument("--payload-cols", metavar="COL,COL", help="or: these columns, as one JSON object")
    p.add_argument("--tenant-col", help="tenant column (text, enum, integer or uuid)")
    p.add_argument("--tenant", help="or: this tenant for every row")
    p.add_argument("--run-at-col", help="run-at column, the events' fire_at (default: due at once)")
    p.add_argument("--run-at-timezone", help="zone of a timestamp-without-time-zone run-at column, e.g. UTC")
    p.add_argument("--dedup-col", help="column to use as the events' dedup_key (default: none)")
    p.add_argument(
        "--filter",
        action="append",
        metavar="COLUMN=VALUE",
        help="adopt only rows with this value (repeat: "
        "values of one column are alternatives, columns must all match), e.g. status=pending",
    )
    p.add_argument("--filter-null", action="append", metavar="COLUMN", help="adopt only rows where COLUMN is NULL")
    p.add_argument(
        "--mark",
        action="append",
        metavar="COLUMN=VALUE",
        help="take a row by setting COLUMN (repeat) instead of "
        "deleting it; the row must then fail the filter, e.g. status=adopted",
    )
    p.add_argument("--slice", type=int, default=500, help="rows per slice, 1-10000 (default 500)")
    p.add_argument("--follow", action="store_true", help="keep adopting new rows until SIGINT/SIGTERM or --until-idle")
    p.add_argument(
        "--poll",
        type=duration,
        default=1.0,
        metavar="DURATION",
        help="with --follow, look again after this long (default 1 s)",
    )
    p.add_argument(
        "--until-idle",
        type=duration,
        metavar="DURATION",
        help="with --follow, stop once nothing was pending for this long",
    )
    p.add_argument(
        "--bad-rows",
        choices=["fail", "leave"],
        default="fail",
        help="rows the queue would refuse: stop before "
        "anything moves (fail, default), or leave them in the legacy table and adopt the rest (leave)",
    )
    p.add_argument("--rejects", help="append the rejected rows to this file (JSON lines)")
    p.add_argument("--name", help="the adoption's name (default DATABASE.SCHEMA.TABLE:QUEUE)")
    p.add_argument(
        "--outbox",
        default=DEFAULT_OUTBOX,
        help=f"outbox table beside the legacy table (default {DEFAULT_OUTBOX})",
    )
    p.add_argument("--check", action="store_true", help="check the mapping and the rows only; move nothing")
    p.add_argument(
        "--progress", type=duration, default=10.0, metavar="DURATION", help="print progress this often (default 10 s)"
    )
    p.add_argument("--json", action="store_true", help="print the outcome as JSON")


def _mapping(args: argparse.Namespace) -> AdoptMapping:
    payload_cols = [c.strip() for c in args.payload_cols.split(",") if c.strip()] if args.payload_cols else []
    return AdoptMapping.build(
        args.table,
        id_col=args.id_col,
        payload_col=args.payload_col,
        payload_cols=payload_cols,
        tenant_col=args.tenant_col,
        tenant=args.tenant,
        run_at_col=args.run_at_col,
        run_at_timezone=args.run_at_timezone,
        dedup_col=args.dedup_col,
        filters=parse_assignments(args.filter or [], "--filter"),
        filter_null=args.filter_null or [],
        marks=parse_assignments(args.mark or [], "--mark"),
    )


def _print_preflight(table: str, pre: adopt.Preflight) -> None:
    print(f"{table}: {pre.total} row(s), {pre.pending} pending, {pre.bad} the queue would refuse")
    for reason, n in sorted(pre.bad_by_reason.items()):
        print(f"  {n} {reason}")
    for example in pre.examples:
        print(f"  e.g. {example}")


def cmd_queue_adopt(args: argparse.Namespace) -> int:
    """move the events of a legacy queue table into a queue, in slices, while it is still written

    Take pending rows out of an existing, unsharded queue table (on any PostgreSQL database) and enqueue them, routed by
    tenant, slice by slice. Producers may keep writing to the table meanwhile; a run may be stopped or killed at any
    time and re-run: nothing is lost or enqueued twice. Checks the mapping and the rows first, before anything moves.
    Exit status: 0 done, 1 some rows rejected (left in the legacy table or the outbox), 2 error (nothing lost). See
    docs/operations.md, 'Adopting a legacy queue table'.

    example:
      qm queue adopt orders --from postgresql://legacy/app --table jobs --tenant-col account --check
      qm queue adopt orders --from postgresql://legacy/app --table jobs --tenant-col account --follow
    """
    from queue_manager import adopt

    topo = topology(args)
    source = topo.by_name(args.from_shard).dsn if args.from_shard else args.source_dsn
    mapping = _mapping(args)
    if args.check:
        pre = adopt.check_adoption(topo, args.queue, source, mapping)
        if args.json:
            print_json(vars(pre))
        else:
            _print_preflight(args.table, pre)
        return 0 if pre.bad == 0 else 1
    options = adopt.AdoptOptions(
        slice_rows=args.slice,
        follow=args.follow,
        poll_seconds=args.poll,
        until_idle=args.until_idle,
        bad_rows=args.bad_rows,
        name=args.name,
        outbox=args.outbox,
    )
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        if stop.is_set():  # a second signal: stop now (safe: a run may end anywhere)
            raise KeyboardInterrupt
        print(f"qm queue adopt: {signal.Signals(signum).name}: stopping after this slice", file=sys.stderr, flush=True)
        stop.set()

    last = [time.monotonic()]
    out = sys.stderr if args.json else sys.stdout

    def progress(report: adopt.AdoptReport) -> None:
        if time.monotonic() - last[0] >= args.progress:
            last[0] = time.monotonic()
            print(report.progress_line(), file=out, flush=True)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        report = adopt.adopt(topo, args.queue, source, mapping, options, stop=stop, progress=progress)
    except KeyboardInterrupt:
        print("qm queue adopt: interrupted; nothing is lost: run the same command again to finish", file=sys.stderr)
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if args.rejects and report.rejected:
        report.append_rejects(args.rejects)
    if args.json:
        print_json(report.as_dict())
    else:
        print(report.summary_line())
        if report.rejected and not args.rejects:
            for r in report.rejected[:20]:
                print(f"  rejected {r.legacy_id} ({r.where}): {r.reason}", file=sys.stderr)
            if len(report.rejected) > 20:
                print(f"  ... {len(report.rejected) - 20} more (use --rejects FILE)", file=sys.stderr)
    return 0 if report.complete else 1
