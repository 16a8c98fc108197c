"""``qm manager``: run the manager of one shard. Every flag's default is :class:`ManagerConfig`'s."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from queue_manager.cli.common import Subparsers, command, duration, topology
from queue_manager.domain.durations import format_duration
from queue_manager.domain.topology import TOPOLOGY_ENV, Topology
from queue_manager.domain.topology_file import forget_manager, record_manager
from queue_manager.errors import ConfigurationError, QueueManagerError
from queue_manager.manager.config import ManagerConfig

logger = logging.getLogger(__name__)

#: the port ``qm manager`` listens on unless told (the library's default, 0, takes any free port)
DEFAULT_PORT = 8765

_d = ManagerConfig.default


def register(sub: Subparsers) -> None:
    p = command(sub, "manager", cmd_manager, topology=True)
    p.add_argument("--shard", required=True, help="the shard's name in the topology file")
    p.add_argument(
        "--tokens", metavar="FILE", help="the receivers' token file, TOML (default: $QM_TOKENS; docs/protocol.md)"
    )
    p.add_argument("--host", default=_d("host"), help=f"the address to listen on (default {_d('host')})")
    p.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help=f"websocket, metrics and health port (default {DEFAULT_PORT}; 0 = any)",
    )
    p.add_argument("--allow-origin", action="append", help="allowed Origin header (repeat; default: any)")
    _seconds(p, FIRST_SECONDS)
    p.add_argument(
        "--slice-rows",
        type=int,
        default=_d("slice_rows"),
        help=f"most acked (and failed) events one retention slice deletes (default {_d('slice_rows')})",
    )
    p.add_argument(
        "--idle-slices",
        action=argparse.BooleanOptionalAction,
        default=_d("idle_slices"),
        help=f"take maintenance slices when the dispatcher is idle (default {_on(_d('idle_slices'))})",
    )
    p.add_argument(
        "--standby-slices",
        action=argparse.BooleanOptionalAction,
        default=_d("standby_slices"),
        help=f"take maintenance slices while a standby (default {_on(_d('standby_slices'))})",
    )
    _seconds(p, LAST_SECONDS)
    p.add_argument(
        "--trace-sample",
        type=float,
        default=_d("trace_sample"),
        help="the share (0 to 1) of fire and ack batches that get an OpenTelemetry span linked to their events' "
        "trace contexts, exported by OTLP (OTEL_EXPORTER_OTLP_ENDPOINT) or to stdout (OTEL_TRACES_EXPORTER=console); "
        "needs the [otel] extra (default 0: off, see docs/observability.md)",
    )
    p.add_argument(
        "--record",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="while it runs, list this manager's URL (ws://HOST:PORT/) among its shard's managers in the topology "
        "file, where qm receive --topology finds it (default on; not with a --host of every address; "
        "--no-record for a file you keep by hand)",
    )
    p.add_argument(
        "--async-fires",
        action="store_true",
        default=not _d("durable_fires"),
        help="fires do not wait for their WAL flush (faster; after a PostgreSQL crash an attempt number may repeat, "
        "see docs/manager.md)",
    )


#: the flags that take seconds, in the order of ``--help``: (flag, help, after the default); the
#: flag names ManagerConfig's field, whose default each one shows
FIRST_SECONDS = (
    ("--lease-ttl", "the leadership lease: a standby takes over this long after the leader stopped renewing", ""),
    ("--drain-timeout", "on SIGTERM, wait this long for the acks of the events in hand", ""),
    ("--sweep-interval", "the old-event collector's period (events past their ack deadline fire again)", ""),
    ("--purge-interval", "the retention purge's baseline pass period", ""),
    ("--reconcile-interval", "the load counter reconciliation's baseline pass period", ""),
    ("--slice-interval", "least time between two maintenance slices this manager recruits itself for", ""),
)
LAST_SECONDS = (
    (
        "--rate-lease-ttl",
        "a shard's slice of a queue's max_qps/max_concurrency lives this long unrenewed; a down shard's share "
        "is taken after about this long",
        "",
    ),
    ("--health-interval", "the database health reading's period (for the metrics)", ""),
    ("--ping-interval", "a websocket ping to each receiver connection this often", ""),
    ("--ping-timeout", "close a receiver connection (1011) whose pong is this late", ""),
    ("--vacuum-after", "vacuum a queue table autovacuum leaves past its trigger this long", "; 0: never"),
)


def _seconds(p: argparse.ArgumentParser, flags: tuple[tuple[str, str, str], ...]) -> None:
    for flag, text, after in flags:
        field = flag.removeprefix("--").replace("-", "_")
        p.add_argument(
            flag,
            type=duration,
            default=_d(field),
            metavar="DURATION",
            help=f"{text} (default {format_duration(_d(field))}{after})",
        )


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def _with_reshard_target(topo: Topology, path: Path, name: str) -> Topology:
    """The topology to start the manager of shard ``name`` with: the file's, or, for a target of a
    reshard recorded next to it that has not switched yet, the topology after the switch (the
    manager waits as a standby until its shard serves; docs/operations.md, "Resharding")."""
    if any(s.name == name for s in topo.shards):
        return topo
    from queue_manager.reshard.workflow import load_state

    state = load_state(path)
    if state is not None and state.active and any(t.name == name for t in state.plan.targets):
        return state.plan.new
    return topo  # by_name then says which shards the file has


def cmd_manager(args: argparse.Namespace) -> int:
    """run the manager of one shard

    Run a manager of one shard until SIGTERM or Ctrl-C (then it drains: the events in hand get their acks, up to
    --drain-timeout). One manager per shard leads: it holds the shard's lease, fires due events to the receivers over
    websockets and takes their acks; others wait as standbys and take over when the lease runs out (--lease-ttl). Each
    serves /metrics, /health and /health/leader on its port. Logs at INFO: leadership taken and lost, drains, receivers
    connecting.

    example:
      qm manager --shard s0 --tokens tokens.toml --port 8765
      qm manager --shard s0 --tokens tokens.toml --port 8767      # a standby of s0
    """
    import asyncio
    import signal

    from queue_manager.manager import Manager
    from queue_manager.manager.auth import TokenStore

    topo = topology(args)
    path = Path(args.topology or os.environ[TOPOLOGY_ENV])
    topo = _with_reshard_target(topo, path, args.shard)
    shard = topo.by_name(args.shard)
    tokens_path = args.tokens or os.environ.get("QM_TOKENS")
    if not tokens_path:
        raise ConfigurationError("no receiver tokens: pass --tokens FILE or set QM_TOKENS (see docs/protocol.md)")
    try:
        config = ManagerConfig(
            dsn=shard.dsn,
            shard=shard.name,
            tokens=TokenStore.load(tokens_path),
            host=args.host,
            port=args.port,
            allowed_origins=frozenset(args.allow_origin) if args.allow_origin else None,
            lease_ttl=args.lease_ttl,
            drain_timeout=args.drain_timeout,
            sweep_interval=args.sweep_interval,
            purge_interval=args.purge_interval,
            reconcile_interval=args.reconcile_interval,
            health_interval=args.health_interval,
            ping_interval=args.ping_interval,
            ping_timeout=args.ping_timeout,
            vacuum_after=args.vacuum_after,
            slice_interval=args.slice_interval,
            slice_rows=args.slice_rows,
            idle_slices=args.idle_slices,
            standby_slices=args.standby_slices,
            durable_fires=not args.async_fires,
            topology=topo,
            topology_file=path,
            rate_lease_ttl=args.rate_lease_ttl,
            trace_sample=args.trace_sample,
        )
    except ValueError as exc:
        raise ConfigurationError(f"qm manager: {exc}") from None

    if config.trace_sample > 0:
        from queue_manager import tracing

        tracing.setup_exporter(f"qm-manager {shard.name}")

    async def serve() -> None:
        manager = Manager(config)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, manager.request_stop)
        task = asyncio.create_task(manager.run())
        await manager.ready.wait()
        assert manager.port is not None  # set before ready
        recorded = _record(path, shard.name, args.host, manager.port) if args.record else None
        print(
            f"qm manager: shard {shard.name}, ws://{args.host}:{manager.port}/ (metrics /metrics, health /health), "
            f"holder {config.holder}",
            flush=True,
        )
        try:
            await task
        finally:
            if recorded is not None:
                _forget(path, shard.name, recorded)

    asyncio.run(serve())
    return 0


def _record(path: Path, shard: str, host: str, port: int) -> str | None:
    """List this manager's URL among the shard's managers in the topology file (docs/operations.md,
    "Topology file"); the URL, or None when it is not listed (the reason logged)."""
    if host in ("", "0.0.0.0", "::"):
        logger.info(
            "listening on every address: no URL to record in the topology file; list this manager there by hand",
            extra={"action": "topology_record", "shard": shard},
        )
        return None
    url = f"ws://[{host}]:{port}/" if ":" in host else f"ws://{host}:{port}/"
    try:
        listed = record_manager(path, shard, url)
    except (OSError, QueueManagerError) as exc:
        logger.warning(
            "could not record this manager in the topology file; receivers need its URL another way",
            extra={"action": "topology_record", "shard": shard, "url": url, "error": str(exc)},
        )
        return None
    if not listed:  # a reshard's target before the switch: the switch writes the targets' managers
        logger.info(
            "the topology file has no shard %s yet: this manager is not recorded",
            shard,
            extra={"action": "topology_record", "shard": shard},
        )
        return None
    logger.info("recorded in the topology file", extra={"action": "topology_record", "shard": shard, "url": url})
    return url


def _forget(path: Path, shard: str, url: str) -> None:
    """Take this manager's URL off the topology file as it stops (a killed one stays listed: receivers skip
    a manager that does not answer)."""
    try:
        forget_manager(path, shard, url)
    except (OSError, QueueManagerError) as exc:
        logger.warning(
            "could not take this manager off the topology file",
            extra={"action": "topology_record", "shard": shard, "url": url, "error": str(exc)},
        )
