"""``qm enqueue`` (one event, routed to its tenant's shard) and ``qm events retry`` (dead letters back)."""

from __future__ import annotations

import argparse
import json
from datetime import datetime

from queue_manager import admin
from queue_manager.cli.common import Subparsers, topology, with_topology
from queue_manager.errors import ConfigurationError


def register_enqueue(sub: Subparsers) -> None:
    p = with_topology(sub.add_parser("enqueue", help="enqueue one event"))
    p.add_argument("queue")
    p.add_argument("tenant")
    p.add_argument("payload", nargs="?", default="{}", help="JSON payload (default {})")
    p.add_argument("--fire-at", help="ISO-8601 time with offset, e.g. 2026-01-01T12:00:00+00:00")
    p.add_argument("--dedup-key")
    p.set_defaults(func=cmd_enqueue)


def register(sub: Subparsers) -> None:
    events = sub.add_parser("events", help="act on events").add_subparsers(dest="events_command", required=True)
    p = with_topology(events.add_parser("retry", help="put dead-lettered (failed) events back to to_be_fired"))
    p.add_argument("queue")
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
    total = admin.retry_failed(topology(args), args.queue, ids=args.id or None, tenant=args.tenant, via="cli")
    print(f"{total} failed event(s) of {args.queue} put back to to_be_fired")
    return 0
