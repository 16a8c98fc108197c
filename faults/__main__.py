"""``python -m faults`` (``make faults``): run the scenarios, print one JSON line each.

    python -m faults                       # every default scenario, 2 rounds each
    python -m faults --rounds 10           # more rounds
    python -m faults --minutes 30          # repeat the scenarios for 30 minutes (a soak)
    python -m faults --scenario pg-restart --scenario frozen-receiver
    python -m faults --list

Each scenario: fresh databases on the two servers, two managers per shard, four receivers, the
producers; warm-up, the rounds, then the producers stop and the run drains (until every committed
event is settled, at most 60 s); the final state of every event is read from the databases; the
checker reads the merged history. The histories are kept under ``--dir`` (default: a new directory
in /dev/shm or /tmp, removed at the end unless ``--keep``). Exit status 1 when any scenario failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import psycopg
from psycopg.rows import dict_row

from faults import checker, history
from faults import schedules as sched
from faults.cluster import NAMES, QUEUE, RANGES, Deployment, Failover, Servers, plain_tenants, vip_tenants
from faults.scenarios import SCENARIOS, Ctx, Scenario
from faults.workload import producers
from queue_manager import admin
from queue_manager.domain.topology import Topology

#: seconds of workload before the first round, and between rounds
WARMUP = 2.0
SETTLE = 3.0
DRAIN_TIMEOUT = 60.0


def all_plain() -> list[str]:
    return [t for r in RANGES for t in plain_tenants(r)]


async def receivers_up(dep: Deployment, timeout: float = 60.0) -> None:
    """Wait until every receiver has subscribed on every shard (its history says ``up``)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    for slot in dep.receivers.values():
        path = Path(slot.config["history"])
        while not (path.exists() and '"state":"up"' in path.read_text()):
            if loop.time() > deadline:
                raise RuntimeError(f"receiver {slot.name} did not subscribe within {timeout} s (see {slot.name}.log)")
            await asyncio.sleep(0.05)


async def drain(dep: Deployment, timeout: float) -> None:
    """Wait until every event of every shard is acked or dead-lettered."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        left = 0
        for shard in dep.topology.shards:
            with contextlib.suppress(psycopg.Error):
                async with await psycopg.AsyncConnection.connect(shard.dsn, connect_timeout=3) as conn:
                    cur = await conn.execute(f"SELECT count(*) FROM {QUEUE} WHERE state NOT IN ('acked', 'failed')")
                    row = await cur.fetchone()
                    left += int(row[0]) if row else 0
        if left == 0:
            return
        await asyncio.sleep(0.25)


#: the key scenarios' record of every change of an event's state, as the database sees it (the
#: checker's key limits count events fired and unsettled from it)
KEY_AUDIT = f"""
CREATE TABLE faults_key_audit (t timestamptz NOT NULL DEFAULT clock_timestamp(), k text, tenant text, ckey text,
                               rkey text, attempt integer, old text, new text);
CREATE FUNCTION faults_key_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        INSERT INTO faults_key_audit (k, tenant, ckey, rkey, attempt, old, new)
        VALUES (OLD.payload->>'k', OLD.tenant, OLD.concurrency_key, OLD.rate_key, OLD.attempts, OLD.state::text,
                'deleted');
    ELSE
        INSERT INTO faults_key_audit (k, tenant, ckey, rkey, attempt, old, new)
        VALUES (NEW.payload->>'k', NEW.tenant, NEW.concurrency_key, NEW.rate_key, NEW.attempts, OLD.state::text,
                NEW.state::text);
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER faults_key_audit AFTER UPDATE OF state ON {QUEUE} FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state) EXECUTE FUNCTION faults_key_audit();
CREATE TRIGGER faults_key_audit_delete AFTER DELETE ON {QUEUE} FOR EACH ROW
    WHEN (OLD.state = 'fired') EXECUTE FUNCTION faults_key_audit();
"""


async def key_audit(topology: Topology) -> None:
    for shard in topology.shards:
        async with await psycopg.AsyncConnection.connect(shard.dsn, autocommit=True) as conn:
            await conn.execute(KEY_AUDIT)


async def key_states(dep: Deployment) -> None:
    """The recorded changes of state, as ``state`` records of the history."""
    for shard in dep.topology.shards:
        async with await psycopg.AsyncConnection.connect(shard.dsn, row_factory=dict_row) as conn:
            cur = await conn.execute(
                "SELECT extract(epoch FROM t)::float8 AS t, k, %s::text AS shard, tenant, ckey, rkey, attempt, old,"
                " new FROM faults_key_audit ORDER BY t",
                (shard.name,),
            )
            for row in await cur.fetchall():
                dep.history.write("state", **row)


async def final_states(dep: Deployment) -> None:
    for shard in dep.topology.shards:
        async with await psycopg.AsyncConnection.connect(shard.dsn) as conn:
            cur = await conn.execute(f"SELECT {sched.final_key_sql()}, state::text FROM {QUEUE}")
            t = history.now()
            for k, state in await cur.fetchall():
                dep.history.write("final", t=t, k=k, shard=shard.name, state=state)


async def run_scenario(
    servers: Servers, root: Path, scenario: Scenario, rounds: int, seed: int, index: int
) -> checker.Report:
    work = root / f"{index:02d}-{scenario.name}"
    work.mkdir(parents=True)
    db = f"faults_{index}_{scenario.name.replace('-', '_')}"[:60]
    failover = Failover(servers, 0) if scenario.replica else None
    try:
        if failover is not None:
            await failover.start()
        topology = await asyncio.to_thread(servers.fresh, db)
    except BaseException:
        if failover is not None:
            await failover.close()
        raise
    if scenario.queue_settings:
        await asyncio.to_thread(admin.alter_queue, topology, QUEUE, scenario.queue_settings)
    if scenario.keys is not None:
        await key_audit(topology)
    if failover is not None:  # shard s0 reached at the address that follows its primary
        topology = Topology(
            tuple(replace(s, dsn=failover.dsn(s.dsn)) if s.name == NAMES[0] else s for s in topology.shards)
        )
    dep = Deployment(
        work,
        topology,
        work / "tokens.toml",
        history.HistoryWriter(work / "harness.jsonl"),
        seed=seed,
        failover=failover,
    )
    stop_watch, stop_produce = asyncio.Event(), asyncio.Event()
    watcher = asyncio.create_task(dep.watch_terms(stop_watch))
    rng = random.Random(seed)
    tasks: list[asyncio.Task[None]] = []
    try:
        await dep.start_managers()
        await dep.wait_leaders()
        plain = all_plain()
        dep.add_receiver(
            "r-lib-1",
            "lib",
            tenants=plain,
            mix={"ack": 0.75, "sql": 0.1, "sql_rollback": 0.05, "nack": 0.05, "slow": 0.05},
        )
        dep.add_receiver("r-lib-2", "lib", tenants=plain, mix={"ack": 0.9, "sql": 0.1})
        dep.add_receiver("r-raw", "raw", tenants=plain, mix={"ack": 0.9, "nack": 0.05, "extend": 0.05})
        dep.add_receiver("r-vip", "lib", tenants=vip_tenants(), vip=True, mix={"sql": 0.8, "ack": 0.2}, concurrency=4)
        for name, kind, options in scenario.receivers:
            opts = dict(options)
            vip = bool(opts.pop("vip", False))
            dep.add_receiver(name, kind, tenants=vip_tenants() if vip else plain, vip=vip, **opts)
        await receivers_up(dep)
        if scenario.schedules:
            await sched.add(dep, scenario.schedules)
        dsns = {s.name: s.dsn for s in topology.shards}
        by_name = {s.name: s for s in topology.shards}

        def tenants(shard: str) -> list[str]:
            key_range = by_name[shard].key_range
            return plain_tenants(str(key_range)) + [t for t in vip_tenants() if key_range.contains(t)]

        procs = producers(dsns, tenants, dep.history, seed, keys=scenario.keys)
        tasks = [asyncio.create_task(p.run(stop_produce)) for p in procs]
        await asyncio.sleep(WARMUP)
        for number in range(1, rounds + 1):
            await scenario.inject(Ctx(dep, servers, rng, number))
            await asyncio.sleep(SETTLE)
        stop_produce.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        if scenario.schedules:
            await sched.remove(dep)
        await drain(dep, DRAIN_TIMEOUT)
        await final_states(dep)
        if scenario.keys is not None:
            await key_states(dep)
        if scenario.schedules:
            await sched.record_slots(dep)
    finally:
        stop_produce.set()
        stop_watch.set()
        await asyncio.gather(*tasks, watcher, return_exceptions=True)
        await dep.stop()
        dep.history.close()
        await asyncio.to_thread(servers.drop, db)
        if failover is not None:
            await failover.close()
    records = sched.relabel(history.read(history.files_in(work)))
    report = check(records, scenario)
    (work / "report.json").write_text(
        json.dumps(
            {
                **report.line(),
                "bound_s": scenario.bound_s,
                "stall_by_round": report.stall_by_round,
                "keys": {
                    "most_in_hand": report.key_most_in_hand,
                    "fires_at_limit": report.key_fires_at_limit,
                    "most_fired_in_1s": report.key_most_per_second,
                },
                "examples": report.examples,
            },
            indent=1,
            default=str,
        )
    )
    return report


def check(records: list[history.Record], scenario: Scenario) -> checker.Report:
    return checker.check(
        records,
        scenario=scenario.name,
        stall_bound_s=scenario.bound_s,
        key_max_in_flight=scenario.queue_settings.get("key_max_in_flight"),
        key_max_qps=scenario.queue_settings.get("key_max_qps"),
    )


async def main_async(args: argparse.Namespace) -> int:
    chosen = [s for s in SCENARIOS if (s.name in args.scenario if args.scenario else not s.opt_in)]
    unknown = set(args.scenario or ()) - {s.name for s in SCENARIOS}
    if unknown:
        print(f"unknown scenario(s): {', '.join(sorted(unknown))}; --list shows them", file=sys.stderr)
        return 2
    root = (
        Path(args.dir)
        if args.dir
        else Path(tempfile.mkdtemp(prefix="qm-faults-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    )
    root.mkdir(parents=True, exist_ok=True)
    servers = Servers(root / "servers")
    await asyncio.to_thread(servers.start)
    failed = 0
    index = 0
    started = time.monotonic()
    try:
        while True:
            for scenario in chosen:
                index += 1
                try:
                    report = await run_scenario(servers, root / "runs", scenario, args.rounds, args.seed + index, index)
                except Exception as exc:  # the harness itself failed: say so, keep the data, go on
                    failed += 1
                    line = {name: None for name in checker.FIELDS} | {"scenario": scenario.name, "pass": False}
                    print(json.dumps(line), flush=True)
                    print(f"  {scenario.name}: the harness failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                    continue
                print(json.dumps(report.line()), flush=True)
                if not report.passed:
                    failed += 1
                    print(f"  history and examples: {root / 'runs'} (seed {args.seed + index})", file=sys.stderr)
            if args.minutes is None or time.monotonic() - started > args.minutes * 60:
                break
    finally:
        await asyncio.to_thread(servers.stop)
        if not args.keep and not failed:
            shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m faults", description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the nemesis per scenario (default 2)")
    parser.add_argument(
        "--minutes", type=float, default=None, help="repeat the scenarios until this many minutes have passed"
    )
    parser.add_argument(
        "--scenario", action="append", help="run this scenario (repeat; default: every default scenario)"
    )
    parser.add_argument("--seed", type=int, default=1, help="seed of the nemesis and workload draws (default 1)")
    parser.add_argument("--dir", help="keep the servers and histories here")
    parser.add_argument("--keep", action="store_true", help="keep the histories of a passing run")
    parser.add_argument("--list", action="store_true", help="list the scenarios and their bounds")
    parser.add_argument(
        "--check", metavar="RUN_DIR", help="only check the kept history of one scenario's run (a directory under runs/)"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.check:
        run = Path(args.check)
        name = run.name.split("-", 1)[-1]
        scenario = next((s for s in SCENARIOS if s.name == name), None)
        if scenario is None or not run.is_dir():
            parser.error(f"{run} is not the run directory of a scenario (runs/NN-<scenario>)")
        report = check(sched.relabel(history.read(history.files_in(run))), scenario)
        print(json.dumps(report.line()))
        return 0 if report.passed else 1
    if args.list:
        for s in SCENARIOS:
            print(f"{s.name:42} bound {s.bound_s:4.1f} s  ({s.why}){'  [opt-in]' if s.opt_in else ''}")
        return 0
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
