"""The ``qm`` command line.

    qm local start --shards N --dir DIR     start N embedded PostgreSQL shards, migrate, write DIR/topology.toml
    qm local stop --dir DIR                 stop them (a later start reuses the data)
    qm migrate --topology T                 apply the schema history to every shard
    qm queue create|alter|list|pause|resume manage queues on every shard
    qm queue tenant set|unset|list Q [T]    a tenant's weight and in-flight cap
    qm queue adopt QUEUE --from DSN --table T   move a legacy queue table's events into QUEUE, while it is written
    qm enqueue QUEUE TENANT [PAYLOAD]       enqueue one event (routed to the tenant's shard)
    qm status [--json]                      length and state of every queue on every shard
    qm manager --shard S --tokens F         run the manager of one shard (websocket, metrics, health)
    qm events retry QUEUE [--id ..]         put dead-lettered (failed) events back
    qm receive --queue Q module:function    run a receiver (docs/receivers.md) on every shard's managers
    qm demo --dir DIR                       the end-to-end demo on local shards
    qm web --tokens F [--port 8080]         the web dashboard over every shard (docs/dashboard.md)
    qm spark enqueue --queue Q --input SRC --run-id R   bulk enqueue from Spark, once (docs/spark.md)
    qm spark recover|cleanup                finish two-phase enqueue runs; drop the staging of dead runs
    qm spark archive --output DIR --older-than 30d
                                            move settled events to Parquet, then delete them (needs pyspark)

``--topology`` defaults to ``$QM_TOPOLOGY``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

from queue_manager import admin, adopt, logs
from queue_manager.cli import reshard
from queue_manager.domain.adopt import AdoptMapping, parse_assignments
from queue_manager.domain.settings import SETTINGS, TENANT_SETTINGS
from queue_manager.domain.topology import Shard, Topology, even_ranges, shard_names
from queue_manager.errors import ConfigurationError, QueueManagerError


def _queue_options() -> list[tuple[str, str, type, str]]:
    """(flag, setting key, type, help) of ``qm queue create|alter``, from the settings' own metadata."""
    out = []
    for key, spec in SETTINGS.items():
        if spec.flag is None:
            continue
        default = "unlimited" if spec.default is None else f"{spec.default:g}"
        out.append((spec.flag, key, spec.kind, f"{spec.help} (default {default})"))
    return out


def _topology(args: argparse.Namespace) -> Topology:
    path = args.topology or os.environ.get("QM_TOPOLOGY")
    if not path:
        raise ConfigurationError("no topology: pass --topology FILE or set QM_TOPOLOGY")
    return Topology.load(path)


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    out = {key: getattr(args, key) for _, key, _, _ in _queue_options() if getattr(args, key) is not None}
    if getattr(args, "paused", None) is not None:
        out["paused"] = args.paused
    return out


def _print(data: Any, as_json: bool) -> None:
    if as_json:
        print(json.dumps(data, indent=2, default=str))
    else:
        print(data)


def cmd_local_start(args: argparse.Namespace) -> int:
    from queue_manager.db.migrate import migrate_topology
    from queue_manager.local.embedded import LocalCluster

    directory = Path(args.dir).resolve()
    settings = {"fsync": "off", "synchronous_commit": "off"} if args.fsync_off else None
    cluster = LocalCluster(directory, args.shards, settings=settings)
    dsns = cluster.start()
    ranges = even_ranges(len(dsns))
    topology = Topology(
        tuple(Shard(name, dsn, kr) for name, dsn, kr in zip(shard_names(len(dsns)), dsns, ranges, strict=True))
    )
    path = directory / "topology.toml"
    path.write_text(topology.to_toml())
    migrate_topology(topology)
    print(f"started {len(dsns)} PostgreSQL shard(s) in {directory}:")
    for shard in topology.shards:
        print(f"  {shard.name}  range {shard.key_range!s:<6} {shard.dsn}")
    print(f"topology: {path}   (export QM_TOPOLOGY={path})")
    return 0


def cmd_local_stop(args: argparse.Namespace) -> int:
    from queue_manager.local.embedded import LocalCluster

    LocalCluster.from_directory(Path(args.dir).resolve()).stop()
    print(f"stopped the shards in {args.dir}")
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    from queue_manager.db.migrate import migrate_topology

    for name in migrate_topology(_topology(args)):
        print(f"migrated shard {name}")
    return 0


def cmd_queue_create(args: argparse.Namespace) -> int:
    rows = admin.create_queue(_topology(args), args.name, _settings(args), if_not_exists=args.if_not_exists)
    for shard, row in rows.items():
        print(f"{shard}: queue {row['name']} partitions={row['partitions']} shuffle={row['shuffle']}")
    return 0


def cmd_queue_alter(args: argparse.Namespace) -> int:
    rows = admin.alter_queue(_topology(args), args.name, _settings(args))
    for shard, row in rows.items():
        shrink = ""
        if row["partitions_physical"] > row["partitions"]:
            shrink = f" (shrinking: partitions {row['partitions']}..{row['partitions_physical'] - 1} drain first)"
        print(f"{shard}: queue {row['name']} updated{shrink}")
    return 0


def cmd_queue_pause(args: argparse.Namespace, paused: bool) -> int:
    admin.alter_queue(_topology(args), args.name, {"paused": paused})
    print(f"queue {args.name} {'paused' if paused else 'resumed'} on every shard")
    return 0


def cmd_queue_list(args: argparse.Namespace) -> int:
    data = admin.list_queues(_topology(args))
    if args.json:
        _print(data, True)
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
    row = admin.set_tenant(_topology(args), args.name, args.tenant, settings)
    cap = "queue default" if row["max_in_flight"] is None else row["max_in_flight"]
    print(f"{row['shard']}: queue {args.name} tenant {args.tenant}: weight={row['weight']:g} max_in_flight={cap}")
    return 0


def cmd_queue_tenant_unset(args: argparse.Namespace) -> int:
    removed = admin.unset_tenant(_topology(args), args.name, args.tenant)
    what = "removed" if removed else "had none"
    print(f"queue {args.name} tenant {args.tenant}: overrides {what} (weight 1, the queue's default cap)")
    return 0


def cmd_queue_tenant_list(args: argparse.Namespace) -> int:
    rows = admin.list_tenants(_topology(args), args.name)
    if args.json:
        _print(rows, True)
        return 0
    for r in rows:
        cap = r["max_in_flight"] if r["max_in_flight"] is not None else f"default ({r['queue_default_max_in_flight']})"
        print(f"{r['shard']:<6} {r['queue']:<24} {r['tenant']:<32} weight={r['weight']:g} max_in_flight={cap}")
    if not rows:
        print("no tenant overrides")
    return 0


def _adopt_mapping(args: argparse.Namespace) -> AdoptMapping:
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
    topology = _topology(args)
    source = topology.by_name(args.from_shard).dsn if args.from_shard else args.source_dsn
    mapping = _adopt_mapping(args)
    if args.check:
        pre = adopt.check_adoption(topology, args.queue, source, mapping)
        if args.json:
            _print(vars(pre), True)
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
            print(
                f"adopt {report.adoption}: {report.moved} moved, {report.adopted} adopted, "
                f"{len(report.rejected)} rejected, {report.slices} slices",
                file=out,
                flush=True,
            )

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        report = adopt.adopt(topology, args.queue, source, mapping, options, stop=stop, progress=progress)
    except KeyboardInterrupt:
        print("qm queue adopt: interrupted; nothing is lost: run the same command again to finish", file=sys.stderr)
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if args.rejects and report.rejected:
        with open(args.rejects, "a", encoding="utf-8") as f:
            for r in report.rejected:
                f.write(json.dumps({"adoption": report.adoption, **vars(r)}) + "\n")
    if args.json:
        _print(report.as_dict(), True)
    else:
        print(
            f"adopt {report.adoption}: {report.ended}: {report.adopted} event(s) adopted into {report.queue} "
            f"({report.moved} taken from {report.table}, {report.already} published by an earlier run, "
            f"{report.deduplicated} dedup hits), {len(report.rejected)} rejected; "
            f"{report.left_pending} still pending in {report.table}, {report.outbox_left} in {report.outbox}"
        )
        if report.rejected and not args.rejects:
            for r in report.rejected[:20]:
                print(f"  rejected {r.legacy_id} ({r.where}): {r.reason}", file=sys.stderr)
            if len(report.rejected) > 20:
                print(f"  ... {len(report.rejected) - 20} more (use --rejects FILE)", file=sys.stderr)
    return 1 if report.rejected or report.outbox_left else 0


def cmd_enqueue(args: argparse.Namespace) -> int:
    from queue_manager.producer import Router

    try:
        payload = json.loads(args.payload)
    except json.JSONDecodeError as exc:
        raise ConfigurationError(f"payload must be JSON: {exc}") from None
    fire_at = datetime.fromisoformat(args.fire_at) if args.fire_at else None
    with Router(_topology(args)) as router:
        shard = router.shard_for(args.tenant)
        event_id = router.enqueue(args.queue, args.tenant, payload, fire_at=fire_at, dedup_key=args.dedup_key)
    if event_id is None:
        print(f"duplicate: an event with dedup key {args.dedup_key!r} exists on shard {shard.name}")
    else:
        print(f"enqueued event {event_id} on shard {shard.name}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    data = admin.status(_topology(args))
    if args.queue:
        for shard in data["shards"]:
            shard["queues"] = [q for q in shard.get("queues", []) if q["queue"] == args.queue]
    print(json.dumps(data, indent=2, default=str) if args.json else admin.render_status(data))
    return 0


def cmd_manager(args: argparse.Namespace) -> int:
    import asyncio
    import signal

    from queue_manager.manager import Manager, ManagerConfig
    from queue_manager.manager.auth import TokenStore

    topology = _topology(args)
    shard = topology.by_name(args.shard)
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
            vacuum_after=args.vacuum_after,
            slice_interval=args.slice_interval,
            slice_rows=args.slice_rows,
            idle_slices=args.idle_slices,
            standby_slices=args.standby_slices,
            durable_fires=not args.async_fires,
            topology=topology,
            rate_lease_ttl=args.rate_lease_ttl,
        )
    except ValueError as exc:
        raise ConfigurationError(f"qm manager: {exc}") from None

    async def serve() -> None:
        manager = Manager(config)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, manager.request_stop)
        task = asyncio.create_task(manager.run())
        await manager.ready.wait()
        print(
            f"qm manager: shard {shard.name}, ws://{args.host}:{manager.port}/ (metrics /metrics, health /health), "
            f"holder {config.holder}",
            flush=True,
        )
        await task

    asyncio.run(serve())
    return 0


def _managers(entries: Sequence[str], topology: Topology | None) -> dict[str, list[str]]:
    """``--manager shard=url`` options by shard; a bare URL belongs to the topology's only shard."""
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
    if not out:
        raise ConfigurationError("qm receive: give the managers of every shard: --manager SHARD=URL (repeat)")
    if topology is not None:
        known = {s.name for s in topology.shards}
        unknown = sorted(set(out) - known)
        if unknown:
            raise ConfigurationError(
                f"--manager names shards the topology does not have: {', '.join(unknown)} "
                f"(shards: {', '.join(sorted(known))})"
            )
        missing = sorted(known - set(out))
        if missing:
            raise ConfigurationError(
                f"no --manager for shard(s) {', '.join(missing)}: their events would never be received"
            )
    return out


def cmd_receive(args: argparse.Namespace) -> int:
    # lazy: the receiver library (websockets) is only needed here
    from receivers import load_handler, run_receiver

    path = args.topology or os.environ.get("QM_TOPOLOGY")
    topology = Topology.load(path) if path else None
    managers = _managers(args.manager or [], topology)
    handler = load_handler(args.handler)
    logs.configure(getattr(logging, args.log_level))
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


def cmd_events_retry(args: argparse.Namespace) -> int:
    total = admin.retry_failed(_topology(args), args.queue, ids=args.id or None, tenant=args.tenant)
    print(f"{total} failed event(s) of {args.queue} put back to to_be_fired")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from queue_manager.demo import run_demo

    return run_demo(
        Path(args.dir).resolve(),
        shards=args.shards,
        duration=args.duration,
        rate=args.rate,
        receivers=args.receivers,
        keep=args.keep,
        live=False if args.plain else None,
    )


def cmd_web(args: argparse.Namespace) -> int:
    try:
        from queue_manager.web.access import WebTokens
        from queue_manager.web.app import WebConfig
        from queue_manager.web.server import serve
    except ImportError as exc:
        raise ConfigurationError(f"qm web needs the web extra: pip install 'queue-manager[web]' ({exc})") from None

    tokens_path = args.tokens or os.environ.get("QM_TOKENS")
    if not tokens_path:
        raise ConfigurationError("no tokens: pass --tokens FILE or set QM_TOKENS, with [[web_token]] tables")
    config = WebConfig(
        topology=_topology(args),
        tokens=WebTokens.load(tokens_path),
        session_secret=os.environ.get("QM_WEB_SESSION_SECRET") or None,
        root_path=args.root_path.rstrip("/"),
        secure_cookie=args.secure_cookie,
    )
    serve(config, args.host, args.port)
    return 0


def cmd_spark_enqueue(args: argparse.Namespace) -> int:
    # imported here only: `qm` must start without pyspark, and core modules never import it
    try:
        from spark_jobs.enqueue import run_cli
    except ImportError as exc:
        raise ConfigurationError(f"qm spark enqueue needs pyspark ({exc}): pip install -e '.[spark]'") from None
    return run_cli(args, _topology(args), lambda line: print(line, flush=True))


def cmd_spark_recover(args: argparse.Namespace) -> int:
    from spark_jobs.enqueue import recover

    outcome = recover(_topology(args), run_id=args.run_id, min_age=args.min_age)
    for gid, what in sorted(outcome.items()):
        print(f"{gid}: {what}")
    if not outcome:
        print("no two-phase run was left prepared")
    return 0


def cmd_spark_cleanup(args: argparse.Namespace) -> int:
    from spark_jobs.enqueue import cleanup

    for shard, n in cleanup(_topology(args), older_than=args.older_than).items():
        print(f"{shard}: {n} run(s) unfinished for more than {args.older_than:g} s abandoned (staging dropped)")
    return 0


def cmd_spark_archive(args: argparse.Namespace) -> int:
    # imported here only: `qm` must start without pyspark, and core modules never import it
    try:
        from spark_jobs.archive import archive_events, cli_session
    except ImportError as exc:
        raise ConfigurationError(f"qm spark archive needs pyspark ({exc}): pip install -e '.[spark]'") from None
    from spark_jobs.archive_plan import check_run_id, new_run_id, parse_age, parse_time, resolve_cutoff

    topology = _topology(args)
    older_than = parse_age(args.older_than) if args.older_than is not None else parse_time(args.before)
    resolve_cutoff(
        older_than, datetime.now(UTC)
    )  # a time in the future fails before Spark starts (the job asks the database)
    run_id = check_run_id(args.run_id) if args.run_id else new_run_id(datetime.now(UTC), os.urandom(2).hex())
    # with --json, stdout carries the JSON only
    out = sys.stderr if args.json else sys.stdout
    print(
        f"archive {run_id}: starting (if it stops early, re-run with --run-id {run_id} to finish it)",
        file=out,
        flush=True,
    )
    with cli_session(args.jdbc_jar) as spark:
        result = archive_events(
            spark,
            topology,
            older_than=older_than,
            output=args.output,
            queues=args.queue,
            run_id=run_id,
            delete_slice=args.delete_slice,
            rows_per_partition=args.rows_per_partition,
            progress=lambda p: print(p.line(), file=out, flush=True),
        )
    summary = {
        "run_id": result.run_id,
        "cutoff": result.cutoff.isoformat(),
        "run_dir": str(result.run_dir),
        "archived": result.archived,
        "deleted": result.deleted,
        "kept": result.kept,
        "shards": {name: vars(s) for name, s in result.shards.items()},
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(
            f"archive {result.run_id}: done: {result.archived:,} rows archived in {result.run_dir} "
            f"(cut-off {result.cutoff.isoformat()}), {result.deleted:,} deleted now, "
            f"{result.kept:,} kept in the shards (changed after they were read)"
        )
    return 0


def _add_adopt_parser(queue: Any) -> None:
    p = queue.add_parser(
        "adopt",
        help="move the events of a legacy queue table into a queue, in slices, while it is still written",
        description="Take pending rows out of an existing, unsharded queue table (on any PostgreSQL database) and "
        "enqueue them, routed by tenant, slice by slice. Producers may keep writing to the table meanwhile; a run "
        "may be stopped or killed at any time and re-run: nothing is lost or enqueued twice. Checks the mapping and "
        "the rows first, before anything moves. Exit status: 0 done, 1 some rows rejected (left in the legacy table "
        "or the outbox), 2 error (nothing lost). See docs/operations.md, 'Adopting a legacy queue table'.",
    )
    p.add_argument("--topology", help="topology TOML file (default: $QM_TOPOLOGY)")
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
    p.add_argument("--poll", type=float, default=1.0, help="with --follow, look again after this long, s (default 1)")
    p.add_argument("--until-idle", type=float, help="with --follow, stop once nothing was pending for this long, s")
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
        default=adopt.DEFAULT_OUTBOX,
        help=f"outbox table beside the legacy table (default {adopt.DEFAULT_OUTBOX})",
    )
    p.add_argument("--check", action="store_true", help="check the mapping and the rows only; move nothing")
    p.add_argument("--progress", type=float, default=10.0, help="print progress every this many seconds (default 10)")
    p.add_argument("--json", action="store_true", help="print the outcome as JSON")
    p.set_defaults(func=cmd_queue_adopt)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qm", description="Sharded, table-backed queue manager on PostgreSQL")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    def with_topology(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--topology", help="topology TOML file (default: $QM_TOPOLOGY)")
        return p

    local = sub.add_parser("local", help="embedded PostgreSQL shards on this machine").add_subparsers(
        dest="local_command", required=True
    )
    p = local.add_parser("start", help="start N shards (reusing DIR's data), migrate them, write DIR/topology.toml")
    p.add_argument("--shards", type=int, default=2, help="number of shards, a power of two (default 2)")
    p.add_argument("--dir", required=True, help="directory for the data and the topology file")
    p.add_argument("--fsync-off", action="store_true", help="fsync=off, synchronous_commit=off (throwaway data)")
    p.set_defaults(func=cmd_local_start)
    p = local.add_parser("stop", help="stop the shards started in DIR")
    p.add_argument("--dir", required=True)
    p.set_defaults(func=cmd_local_stop)

    with_topology(sub.add_parser("migrate", help="apply the schema to every shard")).set_defaults(func=cmd_migrate)

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

    _add_adopt_parser(queue)

    p = with_topology(sub.add_parser("enqueue", help="enqueue one event"))
    p.add_argument("queue")
    p.add_argument("tenant")
    p.add_argument("payload", nargs="?", default="{}", help="JSON payload (default {})")
    p.add_argument("--fire-at", help="ISO-8601 time with offset, e.g. 2026-01-01T12:00:00+00:00")
    p.add_argument("--dedup-key")
    p.set_defaults(func=cmd_enqueue)

    p = with_topology(sub.add_parser("status", help="queue length and state on every shard"))
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--queue", help="only this queue")
    p.set_defaults(func=cmd_status)

    p = with_topology(sub.add_parser("manager", help="run the manager of one shard"))
    p.add_argument("--shard", required=True, help="shard name from the topology")
    p.add_argument("--tokens", help="receiver token file, TOML (default: $QM_TOKENS)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8765, help="websocket, metrics and health port (default 8765; 0 = any)")
    p.add_argument("--allow-origin", action="append", help="allowed Origin header (repeat; default: any)")
    p.add_argument("--lease-ttl", type=float, default=5.0, help="leadership lease, seconds (default 5)")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="on SIGTERM, wait this long for acks (default 30)")
    p.add_argument("--sweep-interval", type=float, default=1.0, help="old-event collector period, seconds (default 1)")
    p.add_argument(
        "--purge-interval", type=float, default=5.0, help="the retention purge's baseline pass period, s (default 5)"
    )
    p.add_argument(
        "--reconcile-interval",
        type=float,
        default=60.0,
        help="the load counter reconciliation's baseline pass period, s (default 60)",
    )
    p.add_argument(
        "--slice-interval",
        type=float,
        default=0.2,
        help="least time between two maintenance slices this manager recruits itself for, s (default 0.2)",
    )
    p.add_argument(
        "--slice-rows", type=int, default=500, help="most acked (and failed) events one retention slice deletes"
    )
    p.add_argument(
        "--idle-slices",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="take maintenance slices when the dispatcher is idle (default on)",
    )
    p.add_argument(
        "--standby-slices",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="take maintenance slices while a standby (default on)",
    )
    p.add_argument(
        "--rate-lease-ttl",
        type=float,
        default=0.6,
        help="a shard's slice of a queue's max_qps/max_concurrency lives this long unrenewed; a down shard's share "
        "is taken after about this long, s (default 0.6)",
    )
    p.add_argument(
        "--health-interval",
        type=float,
        default=5.0,
        help="database health reading period for the metrics, seconds (default 5)",
    )
    p.add_argument(
        "--vacuum-after",
        type=float,
        default=5.0,
        help="vacuum a queue table autovacuum leaves past its trigger this long, seconds (default 5; 0: never)",
    )
    p.add_argument(
        "--async-fires",
        action="store_true",
        help="fires do not wait for their WAL flush (faster; after a PostgreSQL crash an attempt number may repeat, "
        "see docs/manager.md)",
    )
    p.set_defaults(func=cmd_manager)

    p = with_topology(sub.add_parser("receive", help="receive a queue's events and run a handler on each"))
    p.add_argument("handler", help="module:function to call with each event (async or not), e.g. myapp.jobs:handle")
    p.add_argument("--queue", required=True)
    p.add_argument(
        "--manager",
        action="append",
        metavar="SHARD=URL",
        help="a manager of a shard, e.g. s0=ws://mgr-a:8765/ (repeat for each manager of each shard)",
    )
    p.add_argument("--concurrency", type=int, default=10, help="handlers at once, per shard (default 10)")
    p.add_argument("--tenant", action="append", help="only this tenant's events (repeat)")
    p.add_argument("--token", help="bearer secret (default: $QM_TOKEN)")
    p.add_argument("--handler-timeout", type=float, help="seconds; a handler still running then is nacked")
    p.add_argument(
        "--extend-after",
        type=float,
        default=5.0,
        help="extend the ack deadline of handlers running this long, seconds (default 5; 0 = never)",
    )
    p.add_argument("--extend-by", type=float, default=60.0, help="each extension, seconds (default 60)")
    p.add_argument(
        "--drain-timeout", type=float, default=30.0, help="on SIGTERM, wait this long for handlers (default 30)"
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="default INFO")
    p.set_defaults(func=cmd_receive)

    events = sub.add_parser("events", help="act on events").add_subparsers(dest="events_command", required=True)
    p = with_topology(events.add_parser("retry", help="put dead-lettered (failed) events back to to_be_fired"))
    p.add_argument("queue")
    p.add_argument("--id", type=int, action="append", help="only this event id (repeat)")
    p.add_argument("--tenant", help="only this tenant's events")
    p.set_defaults(func=cmd_events_retry)

    p = with_topology(sub.add_parser("web", help="serve the web dashboard over every shard (docs/dashboard.md)"))
    p.add_argument("--tokens", help="token file with [[web_token]] tables (default: $QM_TOKENS)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="listen port (default 8080)")
    p.add_argument("--root-path", default="", help="serve under this sub-path, e.g. /qm (behind a reverse proxy)")
    p.add_argument("--secure-cookie", action="store_true", help="send the session cookie over HTTPS only")
    p.set_defaults(func=cmd_web)

    spark = sub.add_parser("spark", help="Spark jobs (need pyspark and Java)").add_subparsers(
        dest="spark_command", required=True
    )
    p = with_topology(
        spark.add_parser(
            "enqueue",
            help="bulk enqueue a Parquet/CSV/JSON source or a table into a queue on every shard, once",
            description="Route and check every row in Spark, stage each shard's rows through JDBC, then publish "
            "them in one transaction per shard (--atomic: across all shards). Safe to re-run with the same "
            "--run-id. See docs/spark.md.",
        )
    )
    p.add_argument("--queue", required=True, help="target queue (must exist on every shard)")
    p.add_argument("--input", required=True, help="source path (or table name with --format table)")
    p.add_argument("--format", default="parquet", choices=["parquet", "csv", "json", "orc", "table"])
    p.add_argument("--run-id", required=True, help="names the run: a re-run with the same id adds nothing twice")
    p.add_argument("--tenant-col", default="tenant", help="tenant column (default tenant)")
    p.add_argument("--payload-col", default="payload", help="payload column: JSON text or a struct (default payload)")
    p.add_argument("--fire-at-col", help="fire_at column (timestamp or ISO text; default: now)")
    p.add_argument("--payload-cols", help="comma-separated columns that make the payload, as one JSON object")
    p.add_argument("--dedup-col", help="dedup key column (default: none)")
    p.add_argument("--bad-rows", choices=["fail", "skip"], default="fail", help="fail the run (default) or skip them")
    p.add_argument("--rejects", help="where rejected rows go, Parquet (default: under the work directory)")
    p.add_argument("--work-dir", help="where the run keeps its keyed rows (shared by every executor)")
    p.add_argument(
        "--materialize",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="write the keyed rows once as Parquet before staging (default: only when the source's plan is not a "
        "deterministic scan)",
    )
    p.add_argument("--atomic", action="store_true", help="visible on every shard or none (needs prepared transactions)")
    p.add_argument(
        "--staging-ttl",
        type=float,
        default=86_400.0,
        help="drop staging of runs unfinished this long, s (default 1 day)",
    )
    p.add_argument("--tasks-per-shard", type=int, default=2, help="JDBC write tasks per shard (default 2)")
    p.add_argument("--batch-size", type=int, default=10_000, help="rows per JDBC batch (default 10000)")
    p.add_argument("--stop-after", choices=["validated", "staged"], help="stop early (a dry run: validated)")
    p.add_argument(
        "--wait-for-other-run",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="wait this long for another live run of the same --run-id to end, then refuse; 0: refuse at once "
        "(default 3600)",
    )
    p.add_argument("--jdbc-jar", help="PostgreSQL JDBC driver jar (default: $QM_JDBC_JAR, else Debian's, else Maven)")
    p.set_defaults(func=cmd_spark_enqueue)

    p = with_topology(spark.add_parser("recover", help="finish or roll back two-phase enqueue runs left prepared"))
    p.add_argument("--run-id", help="only this run (default: every run left prepared --min-age ago)")
    p.add_argument("--min-age", type=float, default=60.0, help="leave younger prepared parts alone, s (default 60)")
    p.set_defaults(func=cmd_spark_recover)

    p = with_topology(spark.add_parser("cleanup", help="drop the staging of enqueue runs left unfinished"))
    p.add_argument("--older-than", type=float, default=86_400.0, help="unfinished for this long, s (default 1 day)")
    p.set_defaults(func=cmd_spark_cleanup)

    p = with_topology(
        spark.add_parser(
            "archive",
            help="move acked and failed events settled before a cut-off to Parquet, then delete them",
            description="Archive acked and failed events settled before a cut-off to Parquet under OUTPUT "
            "(partitioned by run, shard, queue and day), verify the files, then delete exactly those rows. "
            "Safe to interrupt: re-run with the same --run-id to finish. See docs/spark-archive.md.",
        )
    )
    p.add_argument("--output", required=True, help="archive root directory (a local path)")
    cut = p.add_mutually_exclusive_group(required=True)
    cut.add_argument("--older-than", help="settled longer ago than this: 30d, 12h, 90m, 3600 (seconds)")
    cut.add_argument("--before", help="settled before this time: ISO-8601 with offset, e.g. 2026-01-01T00:00:00Z")
    p.add_argument("--queue", action="append", help="only this queue (repeat; default: every queue)")
    p.add_argument("--run-id", help="finish or repeat this run (default: a new run)")
    p.add_argument("--delete-slice", type=int, default=10_000, help="ids deleted per transaction (default 10000)")
    p.add_argument(
        "--rows-per-partition", type=int, default=50_000, help="candidate rows per JDBC read partition (default 50000)"
    )
    p.add_argument("--jdbc-jar", help="PostgreSQL JDBC driver jar (default: $QM_JDBC_JAR, else Debian's)")
    p.add_argument("--json", action="store_true", help="print the outcome as JSON")
    p.set_defaults(func=cmd_spark_archive)

    p = sub.add_parser(
        "demo",
        help="run the whole system live on local embedded shards until Ctrl-C",
        description="Local shards, two managers per shard, receiver processes, a producer, a live view, a manager "
        "failover at a third of the run, and a summary checked against the database at the end.",
    )
    p.add_argument("--dir", default=".qm-local", help="directory for the local shards (default .qm-local)")
    p.add_argument("--shards", type=int, default=2, help="number of shards (default 2)")
    p.add_argument("--duration", type=float, help="stop after this many seconds (default: run until Ctrl-C)")
    p.add_argument("--rate", type=float, default=150.0, help="events per second the producer commits (default 150)")
    p.add_argument("--receivers", type=int, default=3, help="receiver processes (default 3)")
    p.add_argument("--keep", action="store_true", help="leave the shards running at the end")
    p.add_argument("--plain", action="store_true", help="plain progress lines, even on a terminal")
    p.set_defaults(func=cmd_demo)
    reshard.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``qm`` console command."""
    args = build_parser().parse_args(argv)
    logs.configure(logging.INFO if args.verbose else logging.WARNING)
    try:
        result: int = args.func(args)
        return result
    except QueueManagerError as exc:
        print(f"qm: error: {exc}", file=sys.stderr)
        return 2
    except psycopg.OperationalError as exc:
        print(f"qm: database unreachable: {exc}".rstrip(), file=sys.stderr)
        return 3


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
