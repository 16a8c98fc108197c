"""``qm receive``: run a handler on a queue's events, received from every shard's managers (:mod:`receivers`).

Given a topology file (``--topology`` or ``$QM_TOPOLOGY``) it follows it: shards added by a reshard
are received from without a restart, and removed ones are drained and left."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence

from queue_manager.cli.common import Subparsers, command, duration
from queue_manager.domain.topology import TOPOLOGY_ENV, Topology
from queue_manager.errors import ConfigurationError


def register(sub: Subparsers) -> None:
    p = command(sub, "receive", cmd_receive, topology=True)
    p.add_argument("handler", help="module:function to call with each event (async or not), e.g. myapp.jobs:handle")
    p.add_argument("--queue", required=True, help="the queue to receive from")
    p.add_argument(
        "--manager",
        action="append",
        metavar="SHARD=URL",
        help="a manager of a shard, e.g. s0=ws://mgr-a:8765/ (repeat for each manager of each shard)",
    )
    p.add_argument("--concurrency", type=int, default=10, help="handlers at once, per shard (default 10)")
    p.add_argument("--tenant", action="append", help="only this tenant's events (repeat)")
    p.add_argument("--token", help="bearer secret (default: $QM_TOKEN)")
    p.add_argument(
        "--handler-timeout",
        type=duration,
        metavar="DURATION",
        help="a handler still running after this long is nacked (default: none)",
    )
    p.add_argument(
        "--extend-after",
        type=duration,
        default=5.0,
        metavar="DURATION",
        help="extend the ack deadline of handlers running this long (default 5 s; 0 = never)",
    )
    p.add_argument(
        "--extend-by", type=duration, default=60.0, metavar="DURATION", help="each extension (default 1 min)"
    )
    p.add_argument(
        "--drain-timeout",
        type=duration,
        default=30.0,
        metavar="DURATION",
        help="on SIGTERM or Ctrl-C, wait this long for the handlers in hand (default 30 s)",
    )
    p.add_argument(
        "--tracing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="OpenTelemetry spans per handler call (default: on when the process has OpenTelemetry set up, e.g. "
        "under opentelemetry-instrument; docs/observability.md)",
    )
    p.add_argument(
        "--trace-mode",
        default="first_parent",
        choices=["first_parent", "parent", "link", "none"],
        help="how a handler's span relates to the event's creation context (default first_parent)",
    )


def managers_by_shard(entries: Sequence[str], topology: Topology | None) -> dict[str, list[str]]:
    """``--manager shard=url`` options by shard; a bare URL belongs to the topology's only shard.
    With a topology, a shard may go without ``--manager`` when the file names its managers."""
    out: dict[str, list[str]] = {}
    for entry in entries:
        name, sep, address = entry.partition("=")
        if not sep or "://" in name:
            if topology is not None and len(topology.shards) > 1:
                raise ConfigurationError(
                    f"--manager {entry!r}: name its shard (--manager SHARD=URL); the topology has "
                    f"{len(topology.shards)} shards"
                )
            name, address = (topology.shards[0].name if topology is not None else "default"), entry
        if not name or not address:
            raise ConfigurationError(f"--manager {entry!r}: give SHARD=URL, e.g. s0=ws://mgr-a:8765/")
        out.setdefault(name, []).append(address)
    if not out and topology is None:
        raise ConfigurationError("qm receive: give the managers of every shard: --manager SHARD=URL (repeat)")
    if topology is not None:
        known = {s.name for s in topology.shards}
        unknown = sorted(set(out) - known)
        if unknown:
            raise ConfigurationError(
                f"--manager names shards the topology does not have: {', '.join(unknown)} "
                f"(shards: {', '.join(sorted(known))})"
            )
        missing = sorted(s.name for s in topology.shards if s.name not in out and not s.managers)
        if missing:
            raise ConfigurationError(
                f"no --manager for shard(s) {', '.join(missing)} and the topology file names none of their "
                'managers (managers = ["ws://host:port/", ...]): their events would never be received'
            )
    return out


def cmd_receive(args: argparse.Namespace) -> int:
    # lazy: the receiver library (websockets) is only needed here
    """receive a queue's events and run a handler on each

    Connect to the active manager of every shard, receive the queue's events and call the handler on each: it returns,
    the event is acked; it raises, the event is nacked and fired again after a back-off (dead-lettered after the queue's
    max attempts). Follows failovers and, with a topology file, reshards. SIGTERM or Ctrl-C drains: no new events, the
    ones in hand finish and are acked, then it exits 0. Logs at INFO: subscribed, drained; a failing handler at WARNING
    with its traceback.

    example:
      qm receive --queue orders --manager s0=ws://127.0.0.1:8765/ --manager s1=ws://127.0.0.1:8766/ myapp:handle
    """
    from receivers import load_handler, run_receiver

    path = args.topology or os.environ.get(TOPOLOGY_ENV)
    topology = Topology.load(path) if path else None
    managers = managers_by_shard(args.manager or [], topology)
    handler = load_handler(args.handler)
    try:
        stats = run_receiver(
            managers,
            args.queue,
            handler,
            concurrency=args.concurrency,
            tenants=args.tenant or None,
            token=args.token or os.environ.get("QM_TOKEN"),
            handler_timeout=args.handler_timeout,
            extend_after=None if args.extend_after == 0 else args.extend_after,
            extend_by=args.extend_by,
            drain_timeout=args.drain_timeout,
            topology_file=path or None,
            tracing=args.tracing,
            trace_mode=args.trace_mode,
        )
    except ValueError as exc:
        raise ConfigurationError(f"qm receive: {exc}") from None
    logging.getLogger("receivers").info(
        "receiver stopped: %d delivered, %d acked, %d settled by SQL, %d nacked, %d dead-lettered, %d timed out",
        stats.delivered,
        stats.acked,
        stats.settled_by_sql,
        stats.nacked,
        stats.dead_lettered,
        stats.timeouts,
    )
    return 0
