"""The nemeses: what each scenario does in a round, and the stall bound it is held to.

A round injects the fault, holds it, heals it, then lets the system settle; its ``nemesis``
records (start, heal) name the shards it hit. The bounds (docs/faults.md) are those the docs state:
lease TTL + 1 s for a manager fault, the receivers' reconnect back-off + 1 s for a link fault
(counted from the heal: the time the fault itself is held is added), the ack timeout and back-off
for a receiver that holds events when it dies or freezes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from faults.cluster import (
    ACK_TIMEOUT,
    BACKOFF_MAX,
    LEASE_TTL,
    NAMES,
    RECONNECT_MAX,
    Deployment,
    ManagerSlot,
    Servers,
)
from faults.history import now
from queue_manager.local import fleet

Inject = Callable[["Ctx"], Awaitable[None]]


@dataclass
class Ctx:
    """What a round's nemesis works with."""

    dep: Deployment
    servers: Servers
    rng: random.Random
    round: int
    shards: list[str] = field(default_factory=list)

    def start(self, name: str, shards: list[str], **extra: Any) -> None:
        self.shards = shards
        self.dep.history.write("nemesis", round=self.round, name=name, phase="start", shards=shards, **extra)

    def heal(self, name: str, **extra: Any) -> None:
        self.dep.history.write("nemesis", round=self.round, name=name, phase="heal", shards=self.shards, **extra)

    def shard(self) -> str:
        return self.rng.choice(sorted(self.dep.managers))


@dataclass(frozen=True)
class Scenario:
    name: str
    inject: Inject
    #: the most any committed event may wait with a receiver free (seconds)
    bound_s: float
    #: what the bound is, in words (docs/faults.md)
    why: str
    #: extra receivers for this scenario: (name, kind, options)
    receivers: tuple[tuple[str, str, dict[str, Any]], ...] = ()
    #: not in the default run (slow or needs Spark)
    opt_in: bool = False
    #: shard s0's server gets a synchronous streaming standby, and its address follows the primary
    replica: bool = False
    #: the queue's settings beyond faults.cluster.QUEUE_SETTINGS (key limits)
    queue_settings: dict[str, Any] = field(default_factory=dict)
    #: the producers' events name a concurrency key or a rate key (faults.workload); the queue's
    #: state changes are recorded for the checker's key limits
    keys: str | None = None
    #: periodic schedules of 1 s on the shards during the rounds (faults/schedules.py)
    schedules: int = 0


MANAGER_BOUND = LEASE_TTL + 1.0
#: a frozen leader cannot close its receivers: they learn of the new leader by probing, every
#: second (the receivers library's ``leader_check``)
FROZEN_LEADER_BOUND = MANAGER_BOUND + 1.0
LINK_BOUND = RECONNECT_MAX + 1.0
#: a receiver that dies or freezes with events in hand: they come back after the ack timeout and back-off
HOLDER_BOUND = ACK_TIMEOUT + BACKOFF_MAX + 1.0
#: a promoted standby: the time to stop the primary, promote the standby and repoint the shard's
#: address (PROMOTION_S, measured), then a manager fault's bound
PROMOTION_S = 1.0
PROMOTION_BOUND = PROMOTION_S + MANAGER_BOUND


# --------------------------------------------------------------------------- managers


async def _wait_new_term(ctx: Ctx, shard: str, term: int, timeout: float = 15.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while ctx.dep.terms.get(shard, (0, None))[0] <= term or ctx.dep.active(shard) is None:
        if loop.time() > deadline:
            return
        await asyncio.sleep(0.05)


async def _restart(ctx: Ctx, slots: list[ManagerSlot]) -> None:
    for slot in slots:
        if slot.proc is not None:
            await asyncio.to_thread(slot.proc.wait)
            slot.proc.stop()  # already gone: closes its pipe and log
    await asyncio.gather(*(ctx.dep.start_manager(s) for s in slots))


def _targets(ctx: Ctx, shard: str, which: str) -> list[ManagerSlot]:
    active, standby = ctx.dep.active(shard), ctx.dep.standby(shard)
    chosen = {"active": [active], "standby": [standby], "both": [active, standby]}[which]
    return [s for s in chosen if s is not None]


def manager_kill(which: str) -> Inject:
    async def inject(ctx: Ctx) -> None:
        shard = ctx.shard()
        term = ctx.dep.terms.get(shard, (0, None))[0]
        slots = _targets(ctx, shard, which)
        ctx.start(f"manager-kill-{which}", [shard], pids=[s.pid for s in slots])
        for s in slots:
            if s.pid is not None:
                s.proc.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
        if which == "both":
            await asyncio.sleep(1.0)
        await _restart(ctx, slots)
        ctx.heal(f"manager-kill-{which}")
        if which != "standby":
            await _wait_new_term(ctx, shard, term)

    return inject


def manager_pause(which: str, hold: float = 2 * LEASE_TTL) -> Inject:
    async def inject(ctx: Ctx) -> None:
        shard = ctx.shard()
        slots = _targets(ctx, shard, which)
        ctx.start(f"manager-pause-{which}", [shard], pids=[s.pid for s in slots], hold_s=hold)
        for s in slots:
            s.proc.proc.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
        await asyncio.sleep(hold)
        for s in slots:
            s.proc.proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
        ctx.heal(f"manager-pause-{which}")

    return inject


# --------------------------------------------------------------------------- receivers


def receiver_kill(ctx_hold: float = 1.0) -> Inject:
    async def inject(ctx: Ctx) -> None:
        name = ctx.rng.choice(sorted(ctx.dep.receivers))
        ctx.start("receiver-kill", sorted(ctx.dep.managers), receiver=name)
        ctx.dep.signal_receiver(name, signal.SIGKILL)
        ctx.dep.history.write("receiver", r=name, state="down")
        slot = ctx.dep.receivers[name]
        if slot.proc is not None:
            await asyncio.to_thread(slot.proc.wait)
        await asyncio.sleep(ctx_hold)
        ctx.dep.start_receiver(slot)  # it writes its own "up" once running
        ctx.heal("receiver-kill")

    return inject


def receiver_pause(hold: float = 3 * ACK_TIMEOUT) -> Inject:
    """A frozen receiver (SIGSTOP): after its first missed deadline it must be sent nothing until it
    wakes, and what timed out on it goes to the others. Events due around the freeze (within the ack
    timeout, the sweep and a second of it) may wait for their deadline: the round exempts them."""

    async def inject(ctx: Ctx) -> None:
        name = ctx.rng.choice([n for n in sorted(ctx.dep.receivers) if n != "r-vip"])
        exempt = ACK_TIMEOUT + BACKOFF_MAX + 1.5
        ctx.start("receiver-pause", sorted(ctx.dep.managers), receiver=name, hold_s=hold, exempt_s=exempt)
        ctx.dep.signal_receiver(name, signal.SIGSTOP)
        ctx.dep.history.write("receiver", r=name, state="down")
        await asyncio.sleep(hold)
        ctx.dep.signal_receiver(name, signal.SIGCONT)
        ctx.dep.history.write("receiver", r=name, state="up", tenants=ctx.dep.receivers[name].config["tenants"])
        ctx.heal("receiver-pause")

    return inject


# --------------------------------------------------------------------------- PostgreSQL


def pg_restart(down: float = 1.0) -> Inject:
    async def inject(ctx: Ctx) -> None:
        shard = ctx.shard()
        server = ctx.servers.servers[sorted(ctx.dep.managers).index(shard)]
        ctx.start("pg-restart", [shard], down_s=down)
        await asyncio.to_thread(server.stop, "immediate")
        await asyncio.sleep(down)
        await asyncio.to_thread(server.start)
        ctx.heal("pg-restart")

    return inject


def pg_terminate() -> Inject:
    """``pg_terminate_backend`` of every session on the shard's database but the harness's own: each
    manager's sessions, and the producers' and receivers' (their transactions die with them)."""

    async def inject(ctx: Ctx) -> None:
        shard = ctx.shard()
        ctx.start("pg-terminate-backend", [shard])
        with contextlib.suppress(psycopg.Error):
            async with await psycopg.AsyncConnection.connect(ctx.dep.dsn(shard), autocommit=True) as conn:
                await conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
        ctx.heal("pg-terminate-backend")

    return inject


def replica_promotion(kill_active: bool = False) -> Inject:
    """The shard's primary stopped (``-m immediate``), its synchronous standby promoted, the shard's
    address pointed at it; then the old primary's data directory is wiped and a new standby copied
    from the new primary into it, for the next round (it never comes back as a primary).
    ``kill_active``: the shard's active manager is SIGKILLed as the primary stops (and started
    again), so that the standby manager takes the lease on the promoted server, under a new term."""

    async def inject(ctx: Ctx) -> None:
        failover = ctx.dep.failover
        if failover is None:
            raise RuntimeError("replica-promotion needs a scenario with replica=True")
        shard = NAMES[failover.index]
        name = "promotion-and-kill-active" if kill_active else "replica-promotion"
        term = ctx.dep.terms.get(shard, (0, None))[0]
        killed = _targets(ctx, shard, "active") if kill_active else []
        ctx.start(name, [shard], pids=[s.pid for s in killed])
        promoted = 0.0

        async def promote() -> None:
            nonlocal promoted
            started = now()
            await failover.promote()
            promoted = now() - started

        for s in killed:
            s.proc.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
        await asyncio.gather(promote(), _restart(ctx, killed))
        ctx.heal(name, promote_s=round(promoted, 3))
        if kill_active:
            await _wait_new_term(ctx, shard, term)
        started = now()
        await failover.rebuild()
        ctx.dep.history.write("standby", shard=shard, rebuilt_s=round(now() - started, 3))

    return inject


# --------------------------------------------------------------------------- links

#: a lossy link: 5 % of the chunks lost (each held 200 ms, 400 ms more if lost again, ...), and one in
#: 500 resets its connection
LOSS = 0.05
RESET = 0.002
#: a chunk lost three times in a row waits 0.2 + 0.4 + 0.8 s (probability 1.25e-4 a chunk)
LOSSY_DELAY = 1.4


def link(where: str, how: str, hold: float = 2 * LEASE_TTL) -> Inject:
    """``where``: db (the active manager's link to its database) or front (the receivers' link to
    the active manager); ``how``: stall (a silent partition), slow (50 ms + up to 200 ms a chunk) or
    lossy (:data:`LOSS` of the chunks held for retransmission timeouts, :data:`RESET` resetting)."""

    async def inject(ctx: Ctx) -> None:
        shard = ctx.shard()
        slot = ctx.dep.active(shard)
        name = f"{where}-link-{ {'stall': 'partition', 'slow': 'slow', 'lossy': 'lossy'}[how] }"
        ctx.start(name, [shard], manager=None if slot is None else slot.index, hold_s=hold)
        if slot is not None:
            proxy = slot.db_proxy if where == "db" else slot.front
            if how == "stall":
                proxy.stall()
            elif how == "lossy":
                proxy.counts = dict.fromkeys(proxy.counts, 0)
                proxy.lossy(LOSS, RESET)
            else:
                proxy.slow(0.05, 0.2)
            await asyncio.sleep(hold)
            proxy.restore()
        ctx.heal(name, **(proxy.counts if slot is not None and how == "lossy" else {}))

    return inject


# --------------------------------------------------------------------------- Spark

#: rows of one Spark bulk enqueue
SPARK_ROWS = 2000
#: a bulk load lands its rows at once: the receivers are busy with the burst, not free, but the
#: checker counts a receiver as free while it is up (it does not see credit); measured: 2000 rows
#: drained in about 4 s on the loaded 2-core machine
SPARK_BOUND = 10.0


def _spark_input(ctx: Ctx) -> tuple[Path, list[tuple[str, str]]]:
    """A JSON-lines input of SPARK_ROWS events over both shards' tenants, and the topology file."""
    from faults.cluster import plain_tenants

    tenants = [t for r in ("-80", "80-") for t in plain_tenants(r)]
    rows = [(f"spark-{ctx.round}-{i}", tenants[i % len(tenants)]) for i in range(SPARK_ROWS)]
    path = ctx.dep.dir / f"spark-input-{ctx.round}.json"
    path.write_text("".join(json.dumps({"tenant": t, "k": k}) + "\n" for k, t in rows))
    topo = ctx.dep.dir / "spark-topology.toml"
    topo.write_text(ctx.dep.topology.to_toml())
    return path, rows


def _spark_run(ctx: Ctx, path: Path, run_id: str, log: str) -> subprocess.Popen[bytes]:
    from faults.cluster import QUEUE

    return subprocess.Popen(
        fleet.qm(
            "spark",
            "enqueue",
            "--topology",
            str(ctx.dep.dir / "spark-topology.toml"),
            "--queue",
            QUEUE,
            "--input",
            str(path),
            "--format",
            "json",
            "--payload-cols",
            "k",
            "--run-id",
            run_id,
            "--work-dir",
            str(ctx.dep.dir / f"spark-work-{run_id}"),
        ),
        stdin=subprocess.DEVNULL,
        stdout=(ctx.dep.dir / f"{log}.log").open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its JVM is killed with it (the process group)
    )


def _record_spark(ctx: Ctx, rows: list[tuple[str, str]], outcome: str) -> None:
    t = now()
    ranges = {s.name: s.key_range for s in ctx.dep.topology.shards}
    for k, tenant in rows:
        shard = next((n for n, r in ranges.items() if r.contains(tenant)), "?")
        ctx.dep.history.write(
            "enqueued", t=t, k=k, tenant=tenant, shard=shard, via="spark", outcome=outcome, fire_at=None
        )


def spark_twice() -> Inject:
    """Two live runs of one Spark job (one run id, one work directory) started at once, as an
    orchestrator retrying a task whose first attempt is still alive: every row published once."""

    async def inject(ctx: Ctx) -> None:
        path, rows = _spark_input(ctx)
        ctx.start("spark-twice", sorted(ctx.dep.managers), rows=len(rows))
        run_id = f"twice-{ctx.round}"
        procs = [_spark_run(ctx, path, run_id, f"spark-{run_id}-{n}") for n in (1, 2)]
        codes = [await asyncio.to_thread(p.wait) for p in procs]
        _record_spark(ctx, rows, "commit" if 0 in codes else "unknown")
        ctx.heal("spark-twice")

    return inject


def spark_killed() -> Inject:
    """The Spark bulk enqueue killed (its process group, JVM included) at a random moment, then
    run again with the same run id: every row published once."""

    async def inject(ctx: Ctx) -> None:
        path, rows = _spark_input(ctx)
        run_id = f"killed-{ctx.round}"
        ctx.start("spark-killed", sorted(ctx.dep.managers), rows=len(rows))
        first = _spark_run(ctx, path, run_id, f"spark-{run_id}-1")
        await asyncio.sleep(ctx.rng.uniform(3.0, 25.0))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)
        await asyncio.to_thread(first.wait)
        again = _spark_run(ctx, path, run_id, f"spark-{run_id}-2")
        code = await asyncio.to_thread(again.wait)
        _record_spark(ctx, rows, "commit" if code == 0 else "unknown")
        ctx.heal("spark-killed")

    return inject


# --------------------------------------------------------------------------- the four faults of the issue


def quiet() -> Inject:
    """A round without an injected fault: the receivers misbehave on their own (scenario receivers)."""

    async def inject(ctx: Ctx) -> None:
        ctx.start("workload", sorted(ctx.dep.managers))
        await asyncio.sleep(3.0)
        ctx.heal("workload")

    return inject


def rotate(*injects: Inject) -> Inject:
    """Round n injects the nth of ``injects``, in turn."""

    async def inject(ctx: Ctx) -> None:
        await injects[(ctx.round - 1) % len(injects)](ctx)

    return inject


#: a key's events in hand at a manager fault keep its slots until the collector takes them back
KEY_BOUND = FROZEN_LEADER_BOUND + ACK_TIMEOUT + BACKOFF_MAX
#: the limits of the key scenarios: two in hand at once, 5 fires a second. faults.workload sends
#: 0.75 to 2.2 events a second per key (more the quieter the machine), in bursts: a batch's events
#: of one key wait for their tokens. A rate at the arrival rate never drains what a fault gathers:
#: at 2 a second, 10 rounds on a quiet machine (2026-11-29, 439c765; 1.7-2.2 a second a key)
#: queued 15 s, then 36 s behind the limit, a stall of the workload, not of the failover
KEY_MAX_IN_FLIGHT = 2
KEY_MAX_QPS = 5.0
#: what a key gathers while a fault holds it, then served at its rate beside its new events
KEY_RATE_BOUND = FROZEN_LEADER_BOUND + 5.0


def both(a: Inject, b: Inject) -> Inject:
    async def inject(ctx: Ctx) -> None:
        await asyncio.gather(a(ctx), b(Ctx(ctx.dep, ctx.servers, ctx.rng, ctx.round)))

    return inject


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("manager-kill-active", manager_kill("active"), MANAGER_BOUND, "lease TTL + 1 s"),
    Scenario("manager-kill-standby", manager_kill("standby"), MANAGER_BOUND, "lease TTL + 1 s"),
    Scenario(
        "manager-kill-both", manager_kill("both"), 1.0 + 3.0 + MANAGER_BOUND, "1 s down + 3 s start + lease TTL + 1 s"
    ),
    Scenario(
        "manager-pause-active",
        manager_pause("active"),
        FROZEN_LEADER_BOUND,
        "lease TTL + 1 s + the receivers' leader check (1 s)",
    ),
    Scenario("manager-pause-standby", manager_pause("standby"), MANAGER_BOUND, "lease TTL + 1 s"),
    Scenario("manager-pause-both", manager_pause("both", 3.0), 3.0 + MANAGER_BOUND, "3 s paused + lease TTL + 1 s"),
    Scenario("receiver-kill", receiver_kill(), HOLDER_BOUND, "ack timeout + back-off max + 1 s"),
    Scenario(
        "frozen-receiver",
        receiver_pause(),
        LINK_BOUND,
        "reconnect back-off + 1 s (events due around the freeze exempt)",
    ),
    Scenario("pg-restart", pg_restart(), 1.0 + 3.0 + MANAGER_BOUND, "1 s down + 3 s recovery + lease TTL + 1 s"),
    Scenario("pg-terminate-backend", pg_terminate(), MANAGER_BOUND, "lease TTL + 1 s"),
    Scenario("db-link-partition", link("db", "stall"), MANAGER_BOUND, "lease TTL + 1 s"),
    Scenario("db-link-slow", link("db", "slow"), MANAGER_BOUND, "lease TTL + 1 s"),
    Scenario(
        "receiver-link-partition",
        link("front", "stall"),
        2 * LEASE_TTL + LINK_BOUND,
        "4 s partition + reconnect back-off + 1 s",
    ),
    Scenario(
        "receiver-link-slow", link("front", "slow"), LINK_BOUND + 1.0, "reconnect back-off + 1 s + 1 s of link delay"
    ),
    Scenario("db-link-lossy", link("db", "lossy"), MANAGER_BOUND, "lease TTL + 1 s"),
    Scenario(
        "receiver-link-lossy",
        link("front", "lossy"),
        LINK_BOUND + LOSSY_DELAY,
        "reconnect back-off + 1 s + 1.4 s of retransmissions (three losses in a row)",
    ),
    Scenario(
        "replica-promotion",
        replica_promotion(),
        PROMOTION_BOUND,
        "promotion (stop + promote + repoint, measured under 1 s) + lease TTL + 1 s",
        replica=True,
    ),
    Scenario(
        "promotion-and-kill-active",
        replica_promotion(kill_active=True),
        PROMOTION_BOUND,
        "promotion (measured under 1 s) + lease TTL + 1 s: the standby takes the lease on the promoted server",
        replica=True,
    ),
    Scenario(
        "sql-ack-outlives-deadline-rollback",
        quiet(),
        BACKOFF_MAX + 1.0,
        "back-off max + 1 s after the rollback",
        receivers=(
            (
                "r-late",
                "lib",
                {"mix": {"ack": 0.7, "sql_late_rollback": 0.3}, "extend_after": None, "hold_s": ACK_TIMEOUT + 1.0},
            ),
        ),
    ),
    Scenario(
        "sql-ack-then-more",
        quiet(),
        1.0,
        "1 s (the SQL-acking receiver is its tenants' only one)",
        receivers=(("r-vip2", "lib", {"mix": {"sql": 1.0}, "concurrency": 2, "vip": True}),),
    ),
    Scenario(
        "spark-twice",
        spark_twice(),
        SPARK_BOUND,
        "the drain of a 2000-event burst (the receivers are busy, not free)",
        opt_in=True,
    ),
    Scenario(
        "spark-killed",
        spark_killed(),
        SPARK_BOUND,
        "the drain of a 2000-event burst (the receivers are busy, not free)",
        opt_in=True,
    ),
    Scenario(
        "schedules",
        rotate(manager_kill("active"), manager_pause("active"), pg_restart()),
        1.0 + 3.0 + MANAGER_BOUND,
        "its worst fault, a PostgreSQL restart: 1 s down + 3 s recovery + lease TTL + 1 s",
        schedules=10,
    ),
    Scenario(
        "kill-active-and-receiver-link-partition",
        both(manager_kill("active"), link("front", "stall")),
        2 * LEASE_TTL + LINK_BOUND,
        "4 s partition + reconnect back-off + 1 s",
    ),
    Scenario(
        "pause-active-and-pg-terminate",
        both(manager_pause("active"), pg_terminate()),
        FROZEN_LEADER_BOUND,
        "lease TTL + 1 s + the receivers' leader check (1 s)",
    ),
    Scenario(
        "key-concurrency-kill-and-pause",
        rotate(manager_kill("active"), manager_pause("active")),
        KEY_BOUND,
        "lease TTL + 1 s + the receivers' leader check (1 s) + ack timeout + back-off max: a killed or paused "
        "leader's events in hand hold their keys' slots until the collector takes them back",
        queue_settings={"key_max_in_flight": KEY_MAX_IN_FLIGHT},
        keys="concurrency",
    ),
    Scenario(
        "key-rate-kill-and-pause",
        rotate(manager_kill("active"), manager_pause("active")),
        KEY_RATE_BOUND,
        "lease TTL + 1 s + the receivers' leader check + 5 s: what a key gathers during the fault, served at its rate",
        queue_settings={"key_max_qps": KEY_MAX_QPS},
        keys="rate",
    ),
)
