"""Online resharding under load: 2 shards split to 4 while producers write 500 events/s through a
Router that follows the topology file and receivers keep up, over a 100k scheduled backlog and a
dedup-keyed retry stream; then the 4 merged back into 2 new shards.

Prints one JSON object on stdout (logs go to stderr):

* ``capture_cost``: single-row INSERT throughput on a shard with the reshard's change capture off
  and on (the cost on a source while it is copied), alternated, best of each;
* per move (``split``, ``merge``): the snapshot copy (events, seconds, events/s), the lag sampled
  while the sources keep serving, the cut-over's duration and the longest time one enqueue of the
  moved range waited (write-blocked), delivery latency p50/p99 of the live stream by phase
  (before / during / after), and the checks: lost, early, duplicates, after-ack;
* ``cutover_rounds`` (after the split, before its cleanup; ``--cutover-rounds``): the split range
  reversed and switched again, round after round, each cut-over after a burst of due events of the
  moved range (so that the managers fire and ack in full batches while it freezes): per round the
  write block, the cut-over's steps, and whether it rolled back; the deadlocks PostgreSQL counted
  on every shard over all rounds;
* with ``--only-copy``: the snapshot copy alone, without load, in rounds (start, then cancel).

Everything runs on embedded PostgreSQL servers started for the run (two servers; the targets are
new databases on them, created by ``qm reshard start``), with the managers, receivers and producers
in this process and each ``qm reshard`` command in a process of its own, as an operator runs it. A
measurement is only as good as the machine is quiet: the JSON carries the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg

from queue_manager import admin
from queue_manager.db.migrate import migrate_topology
from queue_manager.domain.stats import percentile
from queue_manager.domain.topology import KeyRange, Shard, Topology, even_ranges
from queue_manager.local import fleet
from queue_manager.manager import Manager, ManagerConfig
from queue_manager.manager.auth import TokenStore
from queue_manager.producer import Event, Router
from queue_manager.reshard.workflow import Reshard
from receivers.testing import Delivery, MinimalClient

logger = logging.getLogger("bench.reshard")
QUEUE = "bench_q"
SECRET = "reshard-benchmark-secret-01"
TENANTS = [f"tenant-{i:04d}" for i in range(400)]


def ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 1)


def with_dbname(dsn: str, name: str) -> str:
    return psycopg.conninfo.make_conninfo(dsn, dbname=name)


# --------------------------------------------------------------------------- the capture's cost


#: single-row INSERT statements run inside the server (one DO block: no client round trip per row),
#: and an UPDATE of each row as the manager's fire is (one statement per row)
SERVER_LOOP = """
DO $$
BEGIN
    FOR i IN 1..%s LOOP
        INSERT INTO cost_q (tenant, payload) VALUES ('tenant-' || (i %% 400), '{}');
    END LOOP;
END
$$"""


def capture_cost(dsn: str, rows: int, rounds: int) -> dict[str, Any]:
    """The change capture's cost on a one-shard database, off and on, alternated, best of each:
    autocommit single-row INSERTs per second from a client (each its own transaction), and the
    server time per single-row INSERT statement (a DO loop, no round trips)."""
    topology = Topology((Shard("c0", dsn, KeyRange.parse("-")),))
    migrate_topology(topology)
    admin.create_queue(topology, "cost_q", {"partitions": 16, "shuffle": 4}, if_not_exists=True)
    rates: dict[str, list[float]] = {"off": [], "on": []}
    server_us: dict[str, list[float]] = {"off": [], "on": []}
    with psycopg.connect(dsn, autocommit=True) as c:
        for _ in range(rounds):
            for mode in ("off", "on"):
                c.execute("SELECT qm.set_capturing(%s)", (mode == "on",))
                c.execute("TRUNCATE qm.reshard_capture")
                t0 = time.perf_counter()
                for i in range(rows):
                    c.execute("INSERT INTO cost_q (tenant, payload) VALUES (%s, '{}')", (TENANTS[i % len(TENANTS)],))
                rates[mode].append(rows / (time.perf_counter() - t0))
                t0 = time.perf_counter()
                c.execute(SERVER_LOOP % (rows * 3))
                server_us[mode].append((time.perf_counter() - t0) / (rows * 3) * 1e6)
        c.execute("SELECT qm.set_capturing(false)")
    best = {k: max(v) for k, v in rates.items()}
    fastest = {k: min(v) for k, v in server_us.items()}
    return {
        "rows_per_round": rows,
        "rounds": rounds,
        "client_inserts_per_s_off": round(best["off"]),
        "client_inserts_per_s_on": round(best["on"]),
        "client_cost_pct": round(100 * (1 - best["on"] / best["off"]), 1),
        "server_us_per_insert_off": round(fastest["off"], 1),
        "server_us_per_insert_on": round(fastest["on"], 1),
        "server_cost_pct": round(100 * (fastest["on"] / fastest["off"] - 1), 1),
        "all_rounds": {
            "client_per_s": {k: [round(x) for x in v] for k, v in rates.items()},
            "server_us": {k: [round(x, 1) for x in v] for k, v in server_us.items()},
        },
    }


# --------------------------------------------------------------------------- load


class Producer:
    """Paced enqueues through a Router over the topology file, on threads. Each event's payload
    carries its sequence number and send time; every 5th has a dedup key, and every 25th re-sends
    the key of an earlier event (a retry that must be deduplicated)."""

    def __init__(self, topo: Path, rate: float, threads: int) -> None:
        self.router = Router.from_file(topo, moved_wait=10.0)
        self.rate = rate
        self.threads = threads
        self.stop_ev = threading.Event()
        self.lock = threading.Lock()
        #: seq -> (tenant, send start, commit returned)
        self.sent: dict[int, tuple[str, float, float]] = {}
        self.retries = 0
        self.retry_inserted = 0
        self.errors: list[str] = []
        #: (start, duration) of every enqueue call, and its tenant
        self.calls: list[tuple[float, float]] = []
        self.tenants: list[str] = []
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        t0 = time.monotonic() + 0.05
        for j in range(self.threads):
            th = threading.Thread(target=self._run, args=(j, t0), daemon=True)
            th.start()
            self._threads.append(th)

    def _run(self, j: int, t0: float) -> None:
        rng = random.Random(j)
        k = j
        while not self.stop_ev.is_set():
            delay = t0 + k / self.rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            tenant = rng.choice(TENANTS)
            key = f"k{k}" if k % 5 == 0 else None
            start = time.time()
            try:
                if k % 25 == 0 and k >= 50:  # a retry of an earlier keyed event: must do nothing
                    old = k - 50
                    with self.lock:
                        known = self.sent.get(old)
                    if known is not None:
                        got = self.router.enqueue(QUEUE, known[0], {"seq": -old, "t": start}, None, f"k{old}")
                        with self.lock:
                            self.retries += 1
                            self.retry_inserted += got is not None
                got = self.router.enqueue(QUEUE, tenant, {"seq": k, "t": start}, None, key)
                end = time.time()
                with self.lock:
                    self.calls.append((start, end - start))
                    self.tenants.append(tenant)
                    if got is not None:
                        self.sent[k] = (tenant, start, end)
            except Exception as exc:
                with self.lock:
                    self.errors.append(f"{k}: {exc!r}"[:300])
            k += self.threads

    def stop(self) -> None:
        self.stop_ev.set()
        for th in self._threads:
            th.join(timeout=30)
        self.router.close()


class Fleet:
    """In-process managers and one receiver per shard, recording every delivery."""

    def __init__(self) -> None:
        self.tokens = TokenStore.from_entries([fleet.Token("bench", SECRET, (QUEUE,)).entry()])
        self.managers: dict[str, tuple[Manager, asyncio.Task[None]]] = {}
        self.receivers: dict[str, tuple[MinimalClient, asyncio.Task[None]]] = {}
        #: (seq, attempt, received at, fire_at, shard)
        self.deliveries: list[tuple[int, int, float, float, str]] = []

    async def add(self, shard: Shard) -> None:
        m = Manager(
            ManagerConfig(dsn=shard.dsn, tokens=self.tokens, port=0, standby_poll=0.1, lease_ttl=3.0, shard=shard.name)
        )
        task = asyncio.create_task(m.run())
        await asyncio.wait_for(m.ready.wait(), 30)
        self.managers[shard.name] = (m, task)

        async def handle(event: Delivery, name: str = shard.name) -> None:
            payload = event.payload if isinstance(event.payload, dict) else {}
            self.deliveries.append((int(payload.get("seq", -1)), event.attempt, time.time(), event.fire_at, name))

        r = MinimalClient(f"ws://127.0.0.1:{m.port}/", SECRET, QUEUE, handle, credit=200, reconnect_delay=0.1)
        self.receivers[shard.name] = (r, asyncio.create_task(r.run()))

    async def leading(self, names: Sequence[str], timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not all(self.managers[n][0].role == "leader" for n in names):
            if time.monotonic() > deadline:
                raise RuntimeError(f"no leader on {names} within {timeout}s")
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        for r, t in self.receivers.values():
            r.stop()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(t, 10)
        for m, t in self.managers.values():
            m.request_stop()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(t, 30)


# --------------------------------------------------------------------------- one move


def copy_rounds(topo: Path, shards: Topology, dsns: Sequence[str], rounds: int) -> dict[str, Any]:
    """The snapshot copy alone: s0 split in two by ``start``, then cancelled, ``rounds`` times."""
    s0 = shards.shards[0]
    with psycopg.connect(s0.dsn) as c:
        events = int(c.execute(f"SELECT count(*) FROM {QUEUE}").fetchone()[0])  # type: ignore[index]
    low, high = KeyRange.parse("-40"), KeyRange.parse("40-80")  # s0 is -80
    targets = [Shard("c2", with_dbname(dsns[0], "qm_c2"), low), Shard("c3", with_dbname(dsns[1], "qm_c3"), high)]
    rates = []
    snapshots = []
    for _ in range(rounds):
        said: list[str] = []
        with Reshard(topo, say=said.append) as r:
            t0 = time.perf_counter()
            r.start(targets)
            seconds = time.perf_counter() - t0
            r.cancel()
        rates.append(round(events / seconds))
        snapshots += [x for x in said if x.startswith("snapshot")]
        logger.info("copy: %d events in %.1fs", events, seconds)
    return {
        "events": events,
        "rounds": rounds,
        "events_per_s": rates,
        "median": percentile(rates, 50),
        "spread": [min(rates), max(rates)],
        "snapshot_lines": snapshots,
        "note": "start (targets migrated, capture on, snapshot copy, apply) timed end to end; cancel between rounds",
    }


def target_args(targets: Sequence[Shard]) -> list[str]:
    return [a for t in targets for a in ("--target", t.name, str(t.key_range), t.dsn)]


async def qm_reshard(topo: Path, *args: str) -> tuple[float, list[str]]:
    """``qm reshard ARGS`` in a process of its own, as an operator runs it (in this process it
    would share the interpreter with the managers, receivers and producers of the benchmark):
    its duration and its output lines; RuntimeError with its stderr when it fails."""
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "queue_manager.cli.main",
        "reshard",
        *args,
        "--topology",
        str(topo),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"qm reshard {args[0]} exited {proc.returncode}: {err.decode()[-500:]}")
    return seconds, out.decode().splitlines()


def deadlocks(dsns: Sequence[str]) -> int:
    """Deadlocks PostgreSQL detected in these databases (pg_stat_database), summed."""
    total = 0
    for dsn in dsns:
        with psycopg.connect(dsn) as c:
            row = c.execute("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()").fetchone()
            total += int(row[0]) if row else 0
    return total


async def cutover_rounds(
    topo: Path, sources: list[Shard], targets: list[Shard], fleet: Fleet, producer: Producer, args: argparse.Namespace
) -> dict[str, Any]:
    """Reverse and switch the split range ``args.cutover_rounds`` times (it starts switched, to the
    targets), each after a burst of due events of the moved range; per round the write block."""
    moved = [t for t in TENANTS if any(s.key_range.contains(t) for s in sources)]
    dsns = [s.dsn for s in (*sources, *targets)]
    before = deadlocks(dsns)
    rounds: list[dict[str, Any]] = []
    blocked: list[float] = []
    for i in range(args.cutover_rounds + args.cutover_rounds % 2):  # an even count: it ends switched
        to_targets = i % 2 == 1
        with Router.from_file(topo) as burst:
            await asyncio.to_thread(
                burst.enqueue_batch, QUEUE, [Event(moved[j % len(moved)], {"burst": j}) for j in range(args.burst)]
            )
        start = time.time()
        error = None
        try:
            _, said = await qm_reshard(topo, "switch" if to_targets else "reverse")
        except RuntimeError as exc:  # a rolled-back round is a result, reported
            said, error = [], str(exc)[-300:]
        end = time.time()
        await fleet.leading([s.name for s in (targets if to_targets else sources)])
        await asyncio.sleep(args.cutover_pause)
        with producer.lock:
            window = [
                d
                for (s, d), t in zip(producer.calls, producer.tenants, strict=True)
                if start - 1 <= s <= end and any(x.key_range.contains(t) for x in sources)
            ]
        blocked.append(max(window, default=0.0))
        rounds.append(
            {
                "to": "targets" if to_targets else "sources",
                "write_blocked_ms": ms(blocked[-1]),
                "cutover_s": round(end - start, 3),
                "steps": [line for line in said if " done in " in line or line.startswith("caught up")],
                "error": error,
            }
        )
    return {
        "rounds": len(rounds),
        "burst": args.burst,
        "write_blocked_ms": {
            "max": ms(max(blocked, default=0.0)),
            "median": ms(percentile(blocked, 50)),
            "over_1s": sum(1 for b in blocked if b > 1.0),
        },
        "rolled_back": sum(1 for r in rounds if r["error"]),
        "deadlocks": deadlocks(dsns) - before,
        "per_round": rounds,
    }


async def move(topo: Path, targets: list[Shard], fleet: Fleet, producer: Producer, phase: float) -> dict[str, Any]:
    """Run start, sample the lag, switch, and report; the fleet gets the targets' managers."""
    marks: dict[str, float] = {"before": time.time()}
    await asyncio.sleep(phase)
    marks["start"] = time.time()
    with Reshard(topo) as r:
        plan = r.plan(targets)
        sources = list(plan.sources)
        backlog = 0
        for s in sources:
            with psycopg.connect(s.dsn) as c:
                backlog += int(c.execute(f"SELECT count(*) FROM {QUEUE}").fetchone()[0])  # type: ignore[index]
        copy_seconds, _ = await qm_reshard(topo, "start", *target_args(targets))
        for t in targets:
            await fleet.add(t)
        lags = []
        for _ in range(int(phase / 0.5)):
            await asyncio.sleep(0.5)
            lags.append(sum((await asyncio.to_thread(r.lag, sources)).values()))
        sync_seconds, sync_lines = await qm_reshard(topo, "sync")
        marks["switch"] = time.time()
        switch_seconds, switch_lines = await qm_reshard(topo, "switch")
        marks["switched"] = time.time()
        history = r.state().history[-4:]
    await fleet.leading([t.name for t in targets])
    marks["serving"] = time.time()
    await asyncio.sleep(phase)
    marks["after"] = time.time()
    with producer.lock:
        window = [d for s, d in producer.calls if marks["switch"] - 1 <= s <= marks["serving"]]
    blocked = max(window, default=0.0)
    return {
        "sources": [s.name for s in sources],
        "targets": [t.name for t in targets],
        "copy": {
            "events": backlog,
            "seconds": round(copy_seconds, 2),
            "events_per_s": round(backlog / copy_seconds) if copy_seconds else None,
        },
        "lag_while_serving": {"samples": lags, "max": max(lags, default=0)},
        "sync_before_switch": {"seconds": round(sync_seconds, 3), "said": sync_lines[-1:]},
        "switch_seconds": round(switch_seconds, 3),
        "steps": history,
        "switch_said": [line for line in switch_lines if " done in " in line or line.startswith("caught up")],
        "targets_dispatching_after_s": round(marks["serving"] - marks["switched"], 3),
        "write_blocked_max_ms": ms(blocked),
        "marks": marks,
    }


def latency_by_phase(
    fleet: Fleet, producer: Producer, marks: dict[str, float], first_delivery: dict[int, float]
) -> dict[str, Any]:
    phases = {
        "before": (marks["before"], marks["start"]),
        "during": (marks["start"], marks["serving"]),
        "after": (marks["serving"], marks["after"]),
    }
    out: dict[str, Any] = {}
    for name, (a, b) in phases.items():
        lat = [
            first_delivery[seq] - sent[2]
            for seq, sent in producer.sent.items()
            if a <= sent[1] < b and seq in first_delivery
        ]
        out[name] = {"events": len(lat), "p50_ms": ms(percentile(lat, 50)), "p99_ms": ms(percentile(lat, 99))}
    return out


def checks(topo: Path, fleet: Fleet, producer: Producer) -> dict[str, Any]:
    """lost: committed events found on no serving shard, or never delivered; early: deliveries
    before their fire_at (database clock, same machine); duplicates: deliveries beyond the first
    of an event (at-least-once redeliveries); after_ack: a delivery of an attempt above the one the
    event was acked at."""
    topology = Topology.load(topo)
    final: dict[int, tuple[str, int]] = {}
    keys: dict[str, int] = defaultdict(int)
    for s in topology.shards:
        with psycopg.connect(s.dsn) as c:
            for seq, state, attempts, key in c.execute(
                f"SELECT (payload->>'seq')::bigint, state::text, attempts, dedup_key FROM {QUEUE} WHERE payload ? 'seq'"
            ):
                final[int(seq)] = (str(state), int(attempts))
                if key is not None:
                    keys[str(key)] += 1
    delivered: dict[int, list[int]] = defaultdict(list)
    early = 0
    for seq, attempt, at, fire_at, _ in fleet.deliveries:
        delivered[seq].append(attempt)
        if at < fire_at - 0.001:
            early += 1
    lost = [s for s in producer.sent if s not in final or s not in delivered]
    after_ack = sum(
        1 for seq, atts in delivered.items() if seq in final and final[seq][0] == "acked" and max(atts) > final[seq][1]
    )
    return {
        "sent": len(producer.sent),
        "lost": len(lost),
        "lost_examples": lost[:10],
        "early": early,
        "duplicates": sum(len(a) - 1 for a in delivered.values()),
        "after_ack": after_ack,
        "not_acked": sum(1 for s in producer.sent if final.get(s, ("?",))[0] != "acked"),
        "dedup_retries": producer.retries,
        "dedup_retries_inserted": producer.retry_inserted,
        "dedup_keys_twice": sum(1 for n in keys.values() if n > 1),
        "producer_errors": len(producer.errors),
        "producer_error_examples": producer.errors[:5],
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from queue_manager.local.embedded import LocalCluster

    work = Path(tempfile.mkdtemp(prefix="qm-bench-reshard-"))
    cluster = LocalCluster(work / "cluster", 2)
    fleet = Fleet()
    producer: Producer | None = None
    try:
        dsns = cluster.start()
        result: dict[str, Any] = {}
        if not args.only_copy:
            _create_db(dsns[0], "capture_cost")
            result["capture_cost"] = await asyncio.to_thread(
                capture_cost, with_dbname(dsns[0], "capture_cost"), args.cost_rows, args.cost_rounds
            )
        result["loadavg_start"] = os.getloadavg()
        if args.only_cost:
            return result
        shards = Topology(
            tuple(Shard(f"s{i}", dsn, kr) for i, (dsn, kr) in enumerate(zip(dsns, even_ranges(2), strict=True)))
        )
        migrate_topology(shards)
        topo = work / "topology.toml"
        topo.write_text(shards.to_toml())
        admin.create_queue(shards, QUEUE, {"partitions": 16, "shuffle": 4, "ack_timeout_seconds": 10.0})
        later = datetime.now(UTC) + timedelta(hours=1)
        with Router(shards) as router:
            router.enqueue_batch(
                QUEUE,
                (
                    Event(TENANTS[i % len(TENANTS)], {"b": i}, later + timedelta(seconds=i % 3600))
                    for i in range(args.backlog)
                ),
            )
        for s in shards.shards:
            with psycopg.connect(s.dsn, autocommit=True) as c:
                c.execute(f"ANALYZE {QUEUE}")
        logger.info("backlog of %d scheduled events", args.backlog)
        if args.only_copy:
            result["copy_only"] = await asyncio.to_thread(copy_rounds, topo, shards, dsns, args.copy_rounds)
            result["loadavg_end"] = os.getloadavg()
            return result
        for s in shards.shards:
            await fleet.add(s)
        await fleet.leading([s.name for s in shards.shards])
        producer = Producer(topo, args.rate, args.threads)
        producer.start()

        def split_targets() -> list[Shard]:
            names = ("s2", "s3", "s4", "s5")
            ranges = even_ranges(4)
            return [
                Shard(n, with_dbname(dsns[i // 2], f"qm_{n}"), kr)
                for i, (n, kr) in enumerate(zip(names, ranges, strict=True))
            ]

        targets = split_targets()
        split = await move(topo, targets, fleet, producer, args.phase)
        if args.cutover_rounds:
            result["cutover_rounds"] = await cutover_rounds(topo, list(shards.shards), targets, fleet, producer, args)
        await qm_reshard(topo, "cleanup")
        merge_targets = [
            Shard("s6", with_dbname(dsns[0], "qm_s6"), KeyRange.parse("-80")),
            Shard("s7", with_dbname(dsns[1], "qm_s7"), KeyRange.parse("80-")),
        ]
        merge = await move(topo, merge_targets, fleet, producer, args.phase)
        producer.stop()
        # the receivers drain what was sent
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            got = {d[0] for d in fleet.deliveries}
            if all(s in got for s in producer.sent):
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(2.0)
        first: dict[int, float] = {}
        for seq, _a, at, _f, _s in fleet.deliveries:
            first.setdefault(seq, at)
        for name, m in (("split_2_to_4", split), ("merge_4_to_2", merge)):
            m["delivery_latency"] = latency_by_phase(fleet, producer, m.pop("marks"), first)
            result[name] = m
        result["checks"] = checks(topo, fleet, producer)
        result["load"] = {"rate_per_s": args.rate, "producer_threads": args.threads, "backlog": args.backlog}
        result["loadavg_end"] = os.getloadavg()
        return result
    finally:
        if producer is not None:
            producer.stop()
        await fleet.close()
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)


def _create_db(dsn: str, name: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(f"CREATE DATABASE {name}")


def code_version() -> dict[str, Any]:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], capture_output=True, text=True, check=False).stdout.strip()

    return {"commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(git("status", "--porcelain"))}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=500.0, help="events per second produced (default 500)")
    p.add_argument("--threads", type=int, default=6, help="producer threads (default 6)")
    p.add_argument("--backlog", type=int, default=100_000, help="scheduled events preloaded (default 100000)")
    p.add_argument("--phase", type=float, default=10.0, help="seconds before, while copying, after (default 10)")
    p.add_argument("--cost-rows", type=int, default=3000, help="inserts per capture-cost round (default 3000)")
    p.add_argument("--cost-rounds", type=int, default=5, help="capture-cost rounds, off and on (default 5)")
    p.add_argument("--only-cost", action="store_true", help="measure the capture's cost only")
    p.add_argument(
        "--cutover-rounds", type=int, default=6, help="cut-overs back and forth after the split (default 6; 0: none)"
    )
    p.add_argument("--burst", type=int, default=500, help="due events of the moved range before each round (500)")
    p.add_argument("--cutover-pause", type=float, default=1.0, help="seconds between rounds (default 1)")
    p.add_argument("--only-copy", action="store_true", help="measure the snapshot copy alone, without load")
    p.add_argument("--copy-rounds", type=int, default=3, help="copies with --only-copy (default 3)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    logger.setLevel(logging.INFO)
    started = datetime.now(UTC)
    version = code_version()  # the code that runs, before anything can change the checkout
    result = asyncio.run(run(args))
    print(
        json.dumps(
            {"benchmark": "reshard", "at": started.isoformat(timespec="seconds"), **version, **result},
            indent=2,
            default=str,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
