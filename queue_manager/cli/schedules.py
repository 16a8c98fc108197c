"""``qm schedule add/list/show/pause/resume/remove``: periodic schedules (docs/operations.md, "Schedules")."""

from __future__ import annotations

import argparse
import json
from datetime import datetime
from typing import Any

from queue_manager.cli.common import Subparsers, command, duration, group, print_json, topology
from queue_manager.errors import ConfigurationError

SCHEDULE_HELP = """periodic schedules: an event enqueued at every slot of a cron expression or an interval

Periodic schedules. A schedule lives on the shard that owns its tenant; that shard's active manager enqueues an event at
each slot, ahead of time, with fire_at the slot's instant, so it fires at its time like any scheduled event, exactly
once per slot (docs/operations.md, "Schedules").

example:
  qm schedule add nightly --queue reports --tenant acme --cron '0 3 * * *' --tz Europe/Berlin
  qm schedule add heartbeat --queue pings --tenant acme --every 30s --payload '{"ping": 1}'
  qm schedule list
"""


def register(sub: Subparsers) -> None:
    g = group(sub, "schedule", SCHEDULE_HELP)
    p = command(g, "add", cmd_add, topology=True)
    p.add_argument("name", help="the schedule's name: letters, digits and _ . : - (unique across the shards)")
    p.add_argument("--queue", required=True, help="the queue its events go to")
    p.add_argument("--tenant", required=True, help="the tenant of its events (it picks the shard)")
    p.add_argument("--payload", default="{}", help="each event's JSON payload (default {})")
    when = p.add_mutually_exclusive_group(required=True)
    when.add_argument("--cron", metavar="EXPR", help="a 5-field cron expression: minute hour day month weekday")
    when.add_argument(
        "--every", metavar="DURATION", type=duration, help="an interval: 30s, 5min, 2h, 1d (at least 1 s)"
    )
    p.add_argument("--tz", default="UTC", help="the cron expression's time zone, an IANA name (default UTC)")
    p.add_argument("--start", metavar="TIME", help="an interval's first slot, ISO 8601 with offset (default now)")
    p.add_argument(
        "--misfire",
        choices=("skip", "latest", "catch_up"),
        default="latest",
        help="slots missed while no manager led the shard: skip them, enqueue the latest once (default), or "
        "the last --catch-up of them",
    )
    p.add_argument("--catch-up", type=int, default=1, metavar="N", help="with --misfire catch_up: at most N (1-1000)")
    p.add_argument("--priority", type=int, metavar="P", help="its events' priority, 1 (highest) to 5")
    p.add_argument("--paused", action="store_true", help="add it paused")
    p.add_argument("--replace", action="store_true", help="change the schedule of that name if there is one")

    p = command(g, "list", cmd_list, topology=True)
    p.add_argument("--queue", help="only this queue's schedules")
    p.add_argument("--json", action="store_true", help="as JSON")
    p = command(g, "show", cmd_show, topology=True)
    p.add_argument("name", help="the schedule's name")
    p.add_argument("--json", action="store_true", help="as JSON")
    for name, text in (
        ("pause", "pause a schedule: no slot is enqueued; the slots enqueued ahead and not yet due are dropped"),
        ("resume", "resume a paused schedule: its slots are enqueued from now on"),
        ("remove", "remove a schedule and its slots not yet due (its fired events stay)"),
    ):
        doc = f"{text}\n\nexample:\n  qm schedule {name} nightly"
        p = command(g, name, cmd_change, doc=doc, topology=True, change=name)
        p.add_argument("name", help="the schedule's name")


def _definition(args: argparse.Namespace) -> Any:
    from queue_manager.admin.schedules import Definition

    try:
        payload = json.loads(args.payload)
    except json.JSONDecodeError as exc:
        raise ConfigurationError(f"--payload must be JSON: {exc}") from None
    try:
        start = datetime.fromisoformat(args.start) if args.start else None
    except ValueError:
        raise ConfigurationError(
            f"--start {args.start!r} is not an ISO 8601 time (2026-12-01T09:00:00+01:00)"
        ) from None
    return Definition(
        args.name, args.queue, args.tenant, payload, cron=args.cron, every=args.every, timezone=args.tz,
        misfire=args.misfire, catch_up=args.catch_up, priority=args.priority, paused=args.paused, start=start,
    )  # fmt: skip


def _row(s: Any) -> dict[str, Any]:
    r = dict(s.row)
    r.pop("now", None)
    return {"shard": s.shard, **r, "next_runs": s.next_runs, "last_slot_due": s.last_slot, "last_state": s.last_state}


def _line(s: Any) -> str:
    r = s.row
    status = "paused" if r["paused"] else ("error" if r["error"] else "active")
    nxt = ", ".join(t.isoformat(timespec="seconds") for t in s.next_runs) or "-"
    last = "-" if s.last_slot is None else f"{s.last_slot.isoformat(timespec='seconds')} ({s.last_state or 'purged'})"
    head = f"{s.name:20} {r['queue']:14} {r['tenant']:14} {s.shard:4} {status:7} {s.describe()}"
    return f"{head}\n    next: {nxt}\n    last: {last}"


def cmd_add(args: argparse.Namespace) -> int:
    """add a schedule (or change one with --replace)

    Add a schedule: an event for TENANT in QUEUE at every slot of --cron (5 fields, in --tz) or of --every (from
    --start, default now: the first slot is at once). Every input is checked before any shard sees it; a bad one is
    refused and nothing changes.

    example:
      qm schedule add nightly --queue reports --tenant acme --cron '30 2 * * *' --tz Europe/Berlin
      qm schedule add poll --queue jobs --tenant acme --every 5min --misfire catch_up --catch-up 3
    """
    from queue_manager.admin import schedules

    s = schedules.add(topology(args), _definition(args), replace=args.replace, via="cli")
    print(f"schedule {s.name} {'set' if args.replace else 'added'} on shard {s.shard}: {s.describe()}")
    print("next runs: " + (", ".join(t.isoformat(timespec="seconds") for t in s.next_runs) or "none (paused)"))
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    """the schedules, with their next runs

    example:
      qm schedule list
      qm schedule list --json
    """
    from queue_manager.admin import schedules

    found = schedules.list_schedules(topology(args), args.queue)
    if args.json:
        print_json([_row(s) for s in found])
        return 0
    if not found:
        print("no schedules")
    for s in found:
        print(_line(s))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    """one schedule, every field

    example:
      qm schedule show nightly
    """
    from queue_manager.admin import schedules

    s = schedules.show(topology(args), args.name)
    if s is None:
        raise ConfigurationError(f"no schedule named {args.name!r} on any shard (qm schedule list shows them)")
    if args.json:
        print_json(_row(s))
        return 0
    for k, v in _row(s).items():
        print(f"{k:16} {v}")
    return 0


def cmd_change(args: argparse.Namespace) -> int:
    from queue_manager.admin import schedules

    change = {"pause": schedules.pause, "resume": schedules.resume, "remove": schedules.remove}[args.change]
    change(topology(args), args.name, via="cli")
    print(f"schedule {args.name}: {args.change}d" if args.change != "resume" else f"schedule {args.name}: resumed")
    return 0
