"""``qm enqueue`` (one event, routed to its tenant's shard), ``qm events list`` and ``show`` (read
events without SQL), ``qm events retry`` (dead letters back) and ``qm events cancel``."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from typing import Any

from queue_manager.cli.common import Subparsers, command, group, print_json, topology
from queue_manager.errors import ConfigurationError


def register_enqueue(sub: Subparsers) -> None:
    p = command(sub, "enqueue", cmd_enqueue, topology=True)
    p.add_argument("queue", help="the queue")
    p.add_argument("tenant", help="the tenant the event belongs to (it picks the shard and the partitions)")
    p.add_argument("payload", nargs="?", default="{}", help="the event's JSON payload (default {})")
    p.add_argument(
        "--fire-at", metavar="TIME", help="fire at this ISO-8601 time with offset, e.g. 2026-01-01T12:00:00+00:00"
    )
    p.add_argument("--dedup-key", metavar="KEY", help="no second event with this key while the first is in the queue")
    p.add_argument("--priority", type=int, metavar="N", help="1 (highest) to 5 (default: the queue's default_priority)")
    p.add_argument(
        "--concurrency-key", metavar="KEY", help="a key of the tenant, limited by the queue's key_max_in_flight"
    )
    p.add_argument("--rate-key", metavar="KEY", help="a key of the tenant, limited by the queue's key_max_qps")


EVENTS_HELP = """act on events

Act on the events of a queue (the dashboard, qm web, does more: docs/dashboard.md).

example:
  qm events retry orders --tenant acme
"""


def register(sub: Subparsers) -> None:
    events = group(sub, "events", EVENTS_HELP)
    p = command(events, "retry", cmd_events_retry, topology=True)
    p.add_argument("queue", help="the queue")
    p.add_argument("--id", type=int, action="append", help="only this event id (repeat)")
    p.add_argument("--tenant", help="only this tenant's events")

    p = command(events, "list", cmd_events_list, topology=True)
    p.add_argument("queue", help="the queue")
    _filters(p)
    p.add_argument("--limit", type=int, default=50, help="events per page (1 to 1000, default 50)")
    p.add_argument("--cursor", metavar="SHARD:ID,...", help="where the page starts (printed by the page before)")
    p.add_argument("--json", action="store_true", help="as JSON")

    p = command(events, "show", cmd_events_show, topology=True)
    p.add_argument("queue", help="the queue")
    p.add_argument("id", type=int, help="the event's id")
    p.add_argument("--shard", help="only on this shard")
    p.add_argument("--json", action="store_true", help="as JSON")

    p = command(events, "cancel", cmd_events_cancel, topology=True)
    p.add_argument("queue", help="the queue")
    p.add_argument("--id", type=int, action="append", help="this event id (repeat)")
    _filters(p, states=("to_be_fired", "fired"))
    p.add_argument("--cap", type=int, default=10_000, help="at most this many events by filter (default 10000)")
    p.add_argument("--yes", action="store_true", help="confirm without asking")


def _filters(p: Any, states: tuple[str, ...] | None = None) -> None:
    from queue_manager.domain.eventfilter import STATES

    p.add_argument("--state", choices=states or STATES, help="only events in this state")
    p.add_argument("--tenant", help="only this tenant's events")
    p.add_argument("--dedup-key", help="only the event with this dedup key")
    p.add_argument("--payload", metavar="FILTER", help="a payload filter: payload.order.id = 42 (docs/dashboard.md)")
    p.add_argument("--shard", dest="on_shard", metavar="SHARD", help="only this shard's events")


def _flt(args: argparse.Namespace) -> Any:
    from queue_manager.domain.eventfilter import parse_filter

    fields = {"state": args.state, "tenant": args.tenant, "dedup_key": args.dedup_key, "payload": args.payload,
              "shard": args.on_shard}  # fmt: skip
    shards = tuple(s.name for s in topology(args).shards)
    return parse_filter({k: v for k, v in fields.items() if v is not None}, shards)


def cmd_enqueue(args: argparse.Namespace) -> int:
    """enqueue one event (routed to its tenant's shard)

    Enqueue one event into a queue, on the shard that owns the tenant, and print its id. Applications enqueue by INSERT
    in their own transaction (docs/sql.md) or from Python (queue_manager.producer); this command is for trying things
    and for scripts.

    example:
      qm enqueue orders acme '{"order": 42}'
      qm enqueue orders acme '{"remind": 42}' --fire-at 2026-01-01T12:00:00+00:00 --dedup-key remind-42
      qm enqueue orders acme '{"sync": 7}' --priority 1 --concurrency-key account-7
    """
    from queue_manager.producer import Router

    try:
        payload = json.loads(args.payload)
    except json.JSONDecodeError as exc:
        raise ConfigurationError(f"payload must be JSON: {exc}") from None
    fire_at = datetime.fromisoformat(args.fire_at) if args.fire_at else None
    with Router(topology(args)) as router:
        shard = router.shard_for(args.tenant)
        event_id = router.enqueue(
            args.queue,
            args.tenant,
            payload,
            fire_at=fire_at,
            dedup_key=args.dedup_key,
            priority=args.priority,
            concurrency_key=args.concurrency_key,
            rate_key=args.rate_key,
        )
    if event_id is None:
        print(f"duplicate: an event with dedup key {args.dedup_key!r} exists on shard {shard.name}")
    else:
        print(f"enqueued event {event_id} on shard {shard.name}")
    return 0


def cmd_events_retry(args: argparse.Namespace) -> int:
    """put dead-lettered (failed) events back to to_be_fired

    Put dead-lettered (failed) events of a queue back: due now, with their attempts reset. Every failed event of the
    queue, or only those given by --id or --tenant.

    example:
      qm events retry orders
      qm events retry orders --id 42 --id 43
    """
    from queue_manager import admin  # psycopg: only for the commands that reach a shard

    total = admin.retry_failed(topology(args), args.queue, ids=args.id or None, tenant=args.tenant, via="cli")
    print(f"{total} failed event(s) of {args.queue} put back to to_be_fired")
    return 0


def cmd_events_list(args: argparse.Namespace) -> int:
    """a page of a queue's events across the shards, newest first

    A page of a queue's events on every shard, newest first (by creation), filtered by state, tenant, dedup key or
    payload. The last line gives the --cursor of the next page.

    example:
      qm events list orders --state failed
      qm events list orders --tenant acme --json
    """
    from queue_manager.admin import browse

    topo = topology(args)
    cursor = browse.parse_cursor(args.cursor, tuple(s.name for s in topo.shards)) if args.cursor else None
    page = browse.list_events(topo, args.queue, _flt(args), limit=args.limit, cursor=cursor)
    if args.json:
        print_json({"events": page.events, "next_cursor": page.cursor_text() if page.more else None})
        return 0
    print(f"{'shard':5} {'id':>10} {'state':11} {'att':>3} {'tenant':16} {'fire_at':25} last error / payload")
    for e in page.events:
        tail = e["last_error"] if e["last_error"] else e["payload"]
        print(f"{e['shard']:5} {e['id']:>10} {e['state']:11} {e['attempts']:>3} {e['tenant'][:16]:16} "
              f"{e['fire_at'].isoformat(timespec='milliseconds'):25} {tail[:80]}")  # fmt: skip
    if not page.events:
        print("no events")
    if page.more:
        print(f"next page: --cursor {page.cursor_text()}")
    return 0


def cmd_events_show(args: argparse.Namespace) -> int:
    """one event, every column (its last error, its attempts)

    One event, every column: its state, attempts, times, last error and payload. Event ids are per shard: without
    --shard, every shard's event of that id is shown.

    example:
      qm events show orders 1041
      qm events show orders 1041 --shard s1 --json
    """
    from queue_manager.admin import browse

    found = browse.show_event(topology(args), args.queue, args.id, args.shard)
    if not found:
        where = f"shard {args.shard}" if args.shard else "any shard"
        raise ConfigurationError(f"no event {args.id} of queue {args.queue!r} on {where}")
    if args.json:
        print_json(found if len(found) > 1 else found[0])
        return 0
    for i, e in enumerate(found):
        if i:
            print()
        for k, v in e.items():
            if k == "payload":
                v = json.dumps(v, indent=2)
            print(f"{k:13} {v}")
    return 0


def cmd_events_cancel(args: argparse.Namespace) -> int:
    """cancel events not yet settled (to_be_fired or fired): they end cancelled, never fired again

    Cancel events: by --id (on every shard, ids being per shard), or every event matching the filters after a
    confirmation that shows how many match (--yes confirms at once; at most --cap events). A to_be_fired event is
    cancelled at once; a fired one is cancelled in the table, and the manager tells the receiver holding it to stop its
    handler (docs/protocol.md, "cancel").

    example:
      qm events cancel orders --id 1041
      qm events cancel orders --tenant acme --state to_be_fired
    """
    from queue_manager import admin

    topo = topology(args)
    action = admin.ACTIONS["cancel"]
    if args.id:
        if any(v is not None for v in (args.state, args.tenant, args.dedup_key, args.payload)):
            raise ConfigurationError("give either --id or filters, not both")
        ids = {s.name: args.id for s in topo.shards}
        out = admin.run(topo, args.queue, action, None, ids, via="cli")
        print(f"{out.total} event(s) of {args.queue} cancelled (of {len(args.id)} id(s) given, on each shard)")
        return 0
    flt = _flt(args)
    binding = admin.bind(topo, args.queue, action, flt, cap=args.cap, count_cap=args.cap)
    what = flt.describe() or "every event"
    count = f"more than {binding.count_cap}" if binding.more else str(binding.total)
    print(f"{count} event(s) of {args.queue} match ({what}); {binding.bound} would be cancelled")
    if binding.bound == 0:
        return 0
    if not args.yes:
        if not sys.stdin.isatty():
            print("not cancelled: confirm with --yes")
            return 1
        if input(f"cancel these {binding.bound} event(s)? [y/N] ").strip().lower() not in ("y", "yes"):
            print("not cancelled")
            return 1
    out = admin.run(
        topo, args.queue, action, flt, binding.ids, via="cli", description=f"{what} (confirmed {binding.bound})"
    )
    print(f"{out.total} event(s) of {args.queue} cancelled")
    return 0
