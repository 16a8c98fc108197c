"""``qm queue create|alter|list|pause|resume``, ``qm queue tenant set|unset|list`` and
``qm queue key set|unset|list`` (``qm queue adopt``: :mod:`.adopt`)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Iterable
from typing import Any

from queue_manager.cli import adopt
from queue_manager.cli.common import Subparsers, command, duration, group, print_json, topology
from queue_manager.domain.durations import format_duration
from queue_manager.domain.settings import KEY_SETTINGS, SETTINGS, TENANT_SETTINGS, Setting

QUEUE_HELP = """create, alter, list, pause and resume queues

Manage queues. A queue exists on every shard, with the same settings on each; its events live in a table of its name,
which applications INSERT into (docs/sql.md).

example:
  qm queue create orders --partitions 16 --shuffle 4
  qm queue list
"""

TENANT_HELP = """a tenant's weight and in-flight cap in a queue (on the tenant's shard)

Per-tenant dispatch settings of a queue: a weight (a backlogged tenant's share of the fires against the others') and a
cap on its events in flight. Stored on the tenant's shard, which alone dispatches its events.

example:
  qm queue tenant set orders acme --weight 3
  qm queue tenant list orders
"""

KEY_HELP = """limits of one key of a tenant in a queue (on the tenant's shard)

Per-key limits of a queue: at most N events of a concurrency_key fired and unsettled at once (--max-in-flight), at most
R fires a second of a rate_key (--max-qps). A key belongs to its tenant and is stored on the tenant's shard, which alone
dispatches its events; a key without limits of its own has the queue's key_max_in_flight and key_max_qps.

example:
  qm queue key set orders acme account-7 --max-in-flight 1
  qm queue key list orders
"""


def register(sub: Subparsers) -> None:
    queue = group(sub, "queue", QUEUE_HELP)
    p = command(queue, "create", cmd_queue_create, topology=True)
    p.add_argument("name", help="the queue's name: lowercase letters, digits and _, starting with a letter")
    _setting_options(p, alter=False)
    p.add_argument("--paused", dest="paused", action="store_const", const=True, help="create it paused: no dispatch")
    p.add_argument(
        "--if-not-exists", action="store_true", help="a queue that exists is left unchanged, and that is no error"
    )

    p = command(queue, "alter", cmd_queue_alter, topology=True)
    p.add_argument("name", help="the queue")
    _setting_options(p, alter=True)
    p.add_argument("--paused", dest="paused", action="store_const", const=True, help="pause it (as qm queue pause)")

    p = command(queue, "list", cmd_queue_list, topology=True)
    p.add_argument("--json", action="store_true", help="every setting of every queue, as JSON")
    for verb, paused, text in (
        ("pause", True, "stop dispatching a queue's events (enqueue goes on)"),
        ("resume", False, "dispatch a paused queue's events again"),
    ):
        description = text[0].upper() + text[1:] + ", on every shard. The managers hear of it at once."
        doc = f"{text}\n\n{description}\n\nexample:\n  qm queue {verb} orders"
        p = command(queue, verb, cmd_queue_pause, doc=doc, topology=True, paused=paused)
        p.add_argument("name", help="the queue")

    tenant = group(queue, "tenant", TENANT_HELP)
    p = command(tenant, "set", cmd_queue_tenant_set, topology=True)
    p.add_argument("name", help="the queue")
    p.add_argument("tenant", help="the tenant")
    for key, spec in TENANT_SETTINGS.items():
        default = "the queue's tenant_max_in_flight" if spec.default is None else f"{spec.default:g}"
        assert spec.flag is not None
        p.add_argument(spec.flag, dest=key, type=spec.kind, help=f"{spec.help} (default {default})")
    p.add_argument(
        "--default-max-in-flight", action="store_true", help="drop the tenant's own cap (the queue's default applies)"
    )
    p = command(tenant, "unset", cmd_queue_tenant_unset, topology=True)
    p.add_argument("name", help="the queue")
    p.add_argument("tenant", help="the tenant")
    p = command(tenant, "list", cmd_queue_tenant_list, topology=True)
    p.add_argument("name", nargs="?", help="the queue (default: every queue)")
    p.add_argument("--json", action="store_true", help="as JSON")

    key = group(queue, "key", KEY_HELP)
    p = command(key, "set", cmd_queue_key_set, topology=True)
    p.add_argument("name", help="the queue")
    p.add_argument("tenant", help="the tenant")
    p.add_argument("key", help="the concurrency_key and/or rate_key the events name")
    for name, spec in KEY_SETTINGS.items():
        assert spec.flag is not None
        p.add_argument(spec.flag, dest=name, type=spec.kind, metavar="N", help=spec.help)
    p.add_argument(
        "--default-max-in-flight", action="store_true", help="drop the key's own in-flight limit (the queue's applies)"
    )
    p.add_argument("--default-max-qps", action="store_true", help="drop the key's own rate (the queue's applies)")
    p = command(key, "unset", cmd_queue_key_unset, topology=True)
    p.add_argument("name", help="the queue")
    p.add_argument("tenant", help="the tenant")
    p.add_argument("key", help="the key")
    p = command(key, "list", cmd_queue_key_list, topology=True)
    p.add_argument("name", nargs="?", help="the queue (default: every queue)")
    p.add_argument("--json", action="store_true", help="as JSON")

    adopt.register(queue)


def _is_duration(key: str) -> bool:
    return key.endswith("_seconds")


def _default_text(key: str, spec: Setting) -> str:
    if spec.default is None:
        return "unlimited" if key != "failed_retention_seconds" else "kept"
    if _is_duration(key):
        return format_duration(float(spec.default))
    return f"{spec.default:g}"


def _cli_help(key: str, spec: Setting) -> str:
    """A setting's help as the command line takes it: durations in any unit, not seconds."""
    if not _is_duration(key):
        return spec.help
    text = re.sub(r"^seconds ", "time ", spec.help).replace(", seconds", "").replace("; null keeps them", "")
    return text


def _setting_options(p: argparse.ArgumentParser, *, alter: bool) -> None:
    """The options of ``qm queue create|alter``, from the settings' own metadata: create shows each
    default, alter leaves what is omitted as it is."""
    for key, spec in SETTINGS.items():
        if spec.flag is None:
            continue
        text = _cli_help(key, spec)
        tail = "(unchanged if omitted)" if alter else f"(default {_default_text(key, spec)})"
        p.add_argument(
            spec.flag,
            dest=key,
            type=duration if _is_duration(key) else spec.kind,
            metavar="DURATION" if _is_duration(key) else "N",
            help=f"{text} {tail}",
        )
    p.add_argument("--no-priority-aging", action="store_true", help="no aging: a priority level never counts higher")


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    out = {key: getattr(args, key) for key, spec in SETTINGS.items() if spec.flag and getattr(args, key) is not None}
    if getattr(args, "paused", None) is not None:
        out["paused"] = args.paused
    if getattr(args, "no_priority_aging", False):
        out["priority_aging_seconds"] = None
    return out


def cmd_queue_create(args: argparse.Namespace) -> int:
    """create a queue on every shard

    Create a queue on every shard: its table, indexes and triggers, with the settings given (each setting's default
    otherwise). Durations take units: 30s, 5min, 12h, 7d. A queue that exists already is an error naming its shard,
    unless --if-not-exists (then it is left unchanged: qm queue alter changes settings).

    example:
      qm queue create orders
      qm queue create orders --partitions 32 --ack-timeout 2min --retention 3d
    """
    from queue_manager import admin

    settings = _settings(args)
    rows = admin.create_queue(topology(args), args.name, settings, if_not_exists=args.if_not_exists)
    for shard, row in rows.items():
        if row.get("existed"):
            note = " (settings given are not applied: qm queue alter changes them)" if settings else ""
            print(f"{shard}: queue {row['name']} exists (unchanged){note}")
        else:
            print(f"{shard}: queue {row['name']} created, partitions={row['partitions']} shuffle={row['shuffle']}")
    return 0


def cmd_queue_alter(args: argparse.Namespace) -> int:
    """change a queue's settings on every shard

    Change the settings given, on every shard; the others stay as they are. Managers apply the change at once. Fewer
    partitions: the dropped ones drain first (qm status shows them).

    example:
      qm queue alter orders --max-attempts 5
      qm queue alter orders --retention 14d --max-qps 200
    """
    from queue_manager import admin

    rows = admin.alter_queue(topology(args), args.name, _settings(args), via="cli")
    for shard, row in rows.items():
        shrink = ""
        if row["partitions_physical"] > row["partitions"]:
            shrink = f" (shrinking: partitions {row['partitions']}..{row['partitions_physical'] - 1} drain first)"
        print(f"{shard}: queue {row['name']} updated{shrink}")
    return 0


def cmd_queue_pause(args: argparse.Namespace) -> int:
    from queue_manager import admin

    paused = args.paused
    (admin.pause if paused else admin.resume)(topology(args), args.name, via="cli")
    print(f"queue {args.name} {'paused' if paused else 'resumed'} on every shard")
    return 0


def cmd_queue_list(args: argparse.Namespace) -> int:
    """list the queues of every shard and their settings

    example:
      qm queue list
      qm queue list --json
    """
    from queue_manager import admin

    data = admin.list_queues(topology(args))
    if args.json:
        print_json(data)
        return 0
    for shard, queues in data.items():
        print(f"shard {shard}:")
        for q in queues:
            print(
                f"  {q['name']:<24} N={q['partitions']:<4} k={q['shuffle']:<3} "
                f"window={format_duration(q['window_seconds'])} cache={q['cache_size']} "
                f"ack_timeout={format_duration(q['ack_timeout_seconds'])} max_attempts={q['max_attempts']}"
                f" priority={q['default_priority']} aging={_opt_duration(q['priority_aging_seconds'])}"
                f" key_max_in_flight={_opt(q['key_max_in_flight'])} key_max_qps={_opt(q['key_max_qps'])}"
                f"{' PAUSED' if q['paused'] else ''}"
            )
    return 0


def _opt(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _own_or(value: float | None, default: str) -> str:
    """A key's own limit, or what applies instead (``default``) when it has none."""
    return default if value is None else _opt(value)


def _opt_duration(value: float | None) -> str:
    return "-" if value is None else format_duration(value)


def _override_settings(args: argparse.Namespace, names: Iterable[str]) -> dict[str, Any]:
    """The override settings given (``--max-in-flight 5``), and None for each ``--default-<name>``:
    that override dropped, the queue's default applies."""
    settings = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    settings.update({name: None for name in names if getattr(args, f"default_{name}", False)})
    return settings


def cmd_queue_key_set(args: argparse.Namespace) -> int:
    """set a key's in-flight and/or rate limit

    example:
      qm queue key set orders acme account-7 --max-in-flight 1
      qm queue key set orders acme api --max-qps 5
    """
    from queue_manager import admin

    settings = _override_settings(args, KEY_SETTINGS)
    row = admin.set_key(topology(args), args.name, args.tenant, args.key, settings, via="cli")
    print(
        f"{row['shard']}: queue {args.name} tenant {args.tenant} key {args.key}: "
        f"max_in_flight={_own_or(row['max_in_flight'], 'queue default')} "
        f"max_qps={_own_or(row['max_qps'], 'queue default')}"
    )
    return 0


def cmd_queue_key_unset(args: argparse.Namespace) -> int:
    """drop a key's own limits (the queue's apply)

    example:
      qm queue key unset orders acme account-7
    """
    from queue_manager import admin

    removed = admin.unset_key(topology(args), args.name, args.tenant, args.key, via="cli")
    what = "removed" if removed else "had none"
    print(f"queue {args.name} tenant {args.tenant} key {args.key}: limits {what} (the queue's key limits apply)")
    return 0


def cmd_queue_key_list(args: argparse.Namespace) -> int:
    """list the keys' own limits

    example:
      qm queue key list
      qm queue key list orders
    """
    from queue_manager import admin

    return _print_rows(args, admin.list_keys(topology(args), args.name), _key_line, "no key limits of their own")


def _key_line(r: dict[str, Any]) -> str:
    cap = _own_or(r["max_in_flight"], f"default ({_opt(r['queue_default_max_in_flight'])})")
    qps = _own_or(r["max_qps"], f"default ({_opt(r['queue_default_max_qps'])})")
    return f"{r['shard']:<6} {r['queue']:<24} {r['tenant']:<24} {r['key']:<24} max_in_flight={cap} max_qps={qps}"


def cmd_queue_tenant_set(args: argparse.Namespace) -> int:
    """set a tenant's weight and/or in-flight cap

    example:
      qm queue tenant set orders acme --weight 3
      qm queue tenant set orders acme --max-in-flight 10
    """
    from queue_manager import admin

    row = admin.set_tenant(topology(args), args.name, args.tenant, _override_settings(args, TENANT_SETTINGS), via="cli")
    cap = "queue default" if row["max_in_flight"] is None else row["max_in_flight"]
    print(f"{row['shard']}: queue {args.name} tenant {args.tenant}: weight={row['weight']:g} max_in_flight={cap}")
    return 0


def cmd_queue_tenant_unset(args: argparse.Namespace) -> int:
    """drop a tenant's overrides (back to weight 1 and the queue's cap)

    example:
      qm queue tenant unset orders acme
    """
    from queue_manager import admin

    removed = admin.unset_tenant(topology(args), args.name, args.tenant, via="cli")
    what = "removed" if removed else "had none"
    print(f"queue {args.name} tenant {args.tenant}: overrides {what} (weight 1, the queue's default cap)")
    return 0


def cmd_queue_tenant_list(args: argparse.Namespace) -> int:
    """list the tenant overrides

    example:
      qm queue tenant list
      qm queue tenant list orders
    """
    from queue_manager import admin

    return _print_rows(args, admin.list_tenants(topology(args), args.name), _tenant_line, "no tenant overrides")


def _tenant_line(r: dict[str, Any]) -> str:
    cap = r["max_in_flight"] if r["max_in_flight"] is not None else f"default ({r['queue_default_max_in_flight']})"
    return f"{r['shard']:<6} {r['queue']:<24} {r['tenant']:<32} weight={r['weight']:g} max_in_flight={cap}"


def _print_rows(
    args: argparse.Namespace, rows: list[dict[str, Any]], line: Callable[[dict[str, Any]], str], empty: str
) -> int:
    """The rows as JSON with --json, otherwise one ``line`` a row (``empty`` when there is none)."""
    if args.json:
        print_json(rows)
        return 0
    for r in rows:
        print(line(r))
    if not rows:
        print(empty)
    return 0
