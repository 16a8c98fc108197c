"""``qm queue create|alter|list|pause|resume`` and ``qm queue tenant set|unset|list``
(``qm queue adopt``: :mod:`.adopt`)."""

from __future__ import annotations

import argparse
from typing import Any

from queue_manager import admin
from queue_manager.cli import adopt
from queue_manager.cli.common import Subparsers, print_json, topology, with_topology
from queue_manager.domain.settings import SETTINGS, TENANT_SETTINGS


def register(sub: Subparsers) -> None:
    queue = sub.add_parser("queue", help="create, alter, list, pause and resume queues").add_subparsers(
        dest="queue_command", required=True
    )
    for verb, func in (("create", cmd_queue_create), ("alter", cmd_queue_alter)):
        p = with_topology(queue.add_parser(verb, help=f"{verb} a queue on every shard"))
        p.add_argument("name")
        for flag, key, typ, help_ in _queue_options():
            p.add_argument(flag, dest=key, type=typ, help=help_)
        p.add_argument("--paused", dest="paused", action="store_const", const=True, help="refuse to dispatch")
        if verb == "create":
            p.add_argument("--if-not-exists", action="store_true", help="succeed if the queue exists")
        p.set_defaults(func=func)
    p = with_topology(queue.add_parser("list", help="list queues and their settings"))
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_queue_list)
    for verb, paused in (("pause", True), ("resume", False)):
        p = with_topology(queue.add_parser(verb, help=f"{verb} dispatching of a queue"))
        p.add_argument("name")
        p.set_defaults(func=lambda a, paused=paused: cmd_queue_pause(a, paused))

    tenant = queue.add_parser(
        "tenant", help="per-tenant weight and in-flight cap of a queue (on the tenant's shard)"
    ).add_subparsers(dest="tenant_command", required=True)
    p = with_topology(tenant.add_parser("set", help="set a tenant's weight and/or in-flight cap"))
    p.add_argument("name", help="queue")
    p.add_argument("tenant")
    for key, spec in TENANT_SETTINGS.items():
        default = "the queue's tenant_max_in_flight" if spec.default is None else f"{spec.default:g}"
        assert spec.flag is not None
        p.add_argument(spec.flag, dest=key, type=spec.kind, help=f"{spec.help} (default {default})")
    p.add_argument(
        "--default-max-in-flight", action="store_true", help="drop the tenant's own cap (the queue's default applies)"
    )
    p.set_defaults(func=cmd_queue_tenant_set)
    p = with_topology(tenant.add_parser("unset", help="drop a tenant's overrides"))
    p.add_argument("name", help="queue")
    p.add_argument("tenant")
    p.set_defaults(func=cmd_queue_tenant_unset)
    p = with_topology(tenant.add_parser("list", help="list tenant overrides"))
    p.add_argument("name", nargs="?", help="queue (default: every queue)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_queue_tenant_list)

    adopt.register(queue)


def _queue_options() -> list[tuple[str, str, type, str]]:
    """(flag, setting key, type, help) of ``qm queue create|alter``, from the settings' own metadata."""
    out = []
    for key, spec in SETTINGS.items():
        if spec.flag is None:
            continue
        default = "unlimited" if spec.default is None else f"{spec.default:g}"
        out.append((spec.flag, key, spec.kind, f"{spec.help} (default {default})"))
    return out


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    out = {key: getattr(args, key) for _, key, _, _ in _queue_options() if getattr(args, key) is not None}
    if getattr(args, "paused", None) is not None:
        out["paused"] = args.paused
    return out


def cmd_queue_create(args: argparse.Namespace) -> int:
    rows = admin.create_queue(topology(args), args.name, _settings(args), if_not_exists=args.if_not_exists)
    for shard, row in rows.items():
        print(f"{shard}: queue {row['name']} partitions={row['partitions']} shuffle={row['shuffle']}")
    return 0


def cmd_queue_alter(args: argparse.Namespace) -> int:
    rows = admin.alter_queue(topology(args), args.name, _settings(args), via="cli")
    for shard, row in rows.items():
        shrink = ""
        if row["partitions_physical"] > row["partitions"]:
            shrink = f" (shrinking: partitions {row['partitions']}..{row['partitions_physical'] - 1} drain first)"
        print(f"{shard}: queue {row['name']} updated{shrink}")
    return 0


def cmd_queue_pause(args: argparse.Namespace, paused: bool) -> int:
    (admin.pause if paused else admin.resume)(topology(args), args.name, via="cli")
    print(f"queue {args.name} {'paused' if paused else 'resumed'} on every shard")
    return 0


def cmd_queue_list(args: argparse.Namespace) -> int:
    data = admin.list_queues(topology(args))
    if args.json:
        print_json(data)
        return 0
    for shard, queues in data.items():
        print(f"shard {shard}:")
        for q in queues:
            print(
                f"  {q['name']:<24} N={q['partitions']:<4} k={q['shuffle']:<3} window={q['window_seconds']}s "
                f"cache={q['cache_size']} ack_timeout={q['ack_timeout_seconds']}s max_attempts={q['max_attempts']}"
                f"{' PAUSED' if q['paused'] else ''}"
            )
    return 0


def cmd_queue_tenant_set(args: argparse.Namespace) -> int:
    settings = {key: getattr(args, key) for key in TENANT_SETTINGS if getattr(args, key) is not None}
    if args.default_max_in_flight:
        settings["max_in_flight"] = None
    row = admin.set_tenant(topology(args), args.name, args.tenant, settings, via="cli")
    cap = "queue default" if row["max_in_flight"] is None else row["max_in_flight"]
    print(f"{row['shard']}: queue {args.name} tenant {args.tenant}: weight={row['weight']:g} max_in_flight={cap}")
    return 0


def cmd_queue_tenant_unset(args: argparse.Namespace) -> int:
    removed = admin.unset_tenant(topology(args), args.name, args.tenant, via="cli")
    what = "removed" if removed else "had none"
    print(f"queue {args.name} tenant {args.tenant}: overrides {what} (weight 1, the queue's default cap)")
    return 0


def cmd_queue_tenant_list(args: argparse.Namespace) -> int:
    rows = admin.list_tenants(topology(args), args.name)
    if args.json:
        print_json(rows)
        return 0
    for r in rows:
        cap = r["max_in_flight"] if r["max_in_flight"] is not None else f"default ({r['queue_default_max_in_flight']})"
        print(f"{r['shard']:<6} {r['queue']:<24} {r['tenant']:<32} weight={r['weight']:g} max_in_flight={cap}")
    if not rows:
        print("no tenant overrides")
    return 0
