"""``qm enqueue`` (one event, routed to its tenant's shard) and ``qm events retry`` (dead letters back)."""

from __future__ import annotations

import argparse
import json
from datetime import datetime

from queue_manager.cli.common import Subparsers, command, group, topology, with_topology
from queue_manager.errors import ConfigurationError


def register_enqueue(sub: Subparsers) -> None:
    p = with_topology(
        command(
            sub,
            "enqueue",
            help="enqueue one event (routed to its tenant's shard)",
            description="Enqueue one event into a queue, on the shard that owns the tenant, and print its id. "
            "Applications enqueue by INSERT in their own transaction (docs/sql.md) or from Python "
            "(queue_manager.producer); this command is for trying things and for scripts.",
            example=(
                "qm enqueue orders acme '{\"order\": 42}'",
                "qm enqueue orders acme '{\"remind\": 42}' --fire-at 2026-01-01T12:00:00+00:00 --dedup-key remind-42",
            ),
        )
    )
    p.add_argument("queue", help="the queue")
    p.add_argument("tenant", help="the tenant the event belongs to (it picks the shard and the partitions)")
    p.add_argument("payload", nargs="?", default="{}", help="the event's JSON payload (default {})")
    p.add_argument(
        "--fire-at", metavar="TIME", help="fire at this ISO-8601 time with offset, e.g. 2026-01-01T12:00:00+00:00"
    )
    p.add_argument("--dedup-key", metavar="KEY", help="no second event with this key while the first is in the queue")
    p.set_defaults(func=cmd_enqueue)


def register(sub: Subparsers) -> None:
    events = group(
        sub,
        "events",
        help="act on events",
        description="Act on the events of a queue (the dashboard, qm web, does more: docs/dashboard.md).",
        example="qm events retry orders --tenant acme",
    )
    p = with_topology(
        command(
            events,
            "retry",
            help="put dead-lettered (failed) events back to to_be_fired",
            description="Put dead-lettered (failed) events of a queue back: due now, with their attempts reset. "
            "Every failed event of the queue, or only those given by --id or --tenant.",
            example=("qm events retry orders", "qm events retry orders --id 42 --id 43"),
        )
    )
    p.add_argument("queue", help="the queue")
    p.add_argument("--id", type=int, action="append", help="only this event id (repeat)")
    p.add_argument("--tenant", help="only this tenant's events")
    p.set_defaults(func=cmd_events_retry)


def cmd_enqueue(args: argparse.Namespace) -> int:
    from queue_manager.producer import Router

    try:
        payload = json.loads(args.payload)
    except json.JSONDecodeError as exc:
        raise ConfigurationError(f"payload must be JSON: {exc}") from None
    fire_at = datetime.fromisoformat(args.fire_at) if args.fire_at else None
    with Router(topology(args)) as router:
        shard = router.shard_for(args.tenant)
        event_id = router.enqueue(args.queue, args.tenant, payload, fire_at=fire_at, dedup_key=args.dedup_key)
    if event_id is None:
        print(f"duplicate: an event with dedup key {args.dedup_key!r} exists on shard {shard.name}")
    else:
        print(f"enqueued event {event_id} on shard {shard.name}")
    return 0


def cmd_events_retry(args: argparse.Namespace) -> int:
    from queue_manager import admin  # psycopg: only for the commands that reach a shard

    total = admin.retry_failed(topology(args), args.queue, ids=args.id or None, tenant=args.tenant, via="cli")
    print(f"{total} failed event(s) of {args.queue} put back to to_be_fired")
    return 0
