"""The demo behind ``make demo``: real local shards, a queue, transactional enqueue from many tenants.

What it shows, step by step, with visible progress:

1. N embedded PostgreSQL servers start (or are reused) and are migrated;
2. a queue ``demo_events`` exists on every shard;
3. an application transaction writes its own row *and* an event, then rolls back: nothing is left;
4. many tenants enqueue events, each in a transaction with the application's own write, through
   the Router (each tenant lands on its own shard, in its own shuffle-shard partitions);
5. a misrouted insert, an oversized payload and an explicit NULL fire_at are refused;
6. a batch load with COPY;
7. ``qm status``: length per shard, per partition and state;
8. two managers per shard (one active, one standby) and a receiver per shard: every event is
   fired, delivered over a websocket and acked, with progress each second; a scheduled event
   fires on time; the active manager of the first shard drains and hands over to its standby;
9. ``qm status`` again: everything acked.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from pathlib import Path

import psycopg

from queue_manager import admin
from queue_manager.db.migrate import migrate_topology
from queue_manager.domain import routing
from queue_manager.domain.topology import Shard, Topology, even_ranges, shard_names
from queue_manager.errors import QueueManagerError
from queue_manager.producer import Event, Router, enqueue

QUEUE = "demo_events"


def _say(msg: str) -> None:
    print(msg, flush=True)


def run_demo(directory: Path, *, shards: int = 2, tenants: int = 200, events: int = 20) -> int:
    """Run the demo; returns a process exit code."""
    from queue_manager.local.embedded import LocalCluster

    _say(f"== 1. starting {shards} embedded PostgreSQL shard(s) in {directory}")
    dsns = LocalCluster(directory, shards).start()
    topology = Topology(
        tuple(Shard(n, d, r) for n, d, r in zip(shard_names(shards), dsns, even_ranges(shards), strict=True))
    )
    (directory / "topology.toml").write_text(topology.to_toml())
    migrate_topology(topology)
    for s in topology.shards:
        _say(f"   shard {s.name} owns keyspace {s.key_range}: {s.dsn}")

    _say(f"== 2. queue {QUEUE!r} on every shard (16 partitions, 4 per tenant)")
    admin.create_queue(topology, QUEUE, {"partitions": 16, "shuffle": 4}, if_not_exists=True)
    for s in topology.shards:
        with psycopg.connect(s.dsn, autocommit=True) as conn:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS demo_orders (id bigserial PRIMARY KEY, tenant text, total numeric)"
            )

    with Router(topology) as router:
        tenant = "tenant-rollback"
        _say(f"== 3. a rolled-back transaction: an order and an event for {tenant!r}, then ROLLBACK")
        with router.pool(router.shard_for(tenant)).connection() as conn:
            with conn.transaction(force_rollback=True):
                conn.execute("INSERT INTO demo_orders (tenant, total) VALUES (%s, 10)", (tenant,))
                event_id = enqueue(conn, QUEUE, tenant, {"order": "rolled back"})
                _say(f"   inside the transaction: event {event_id} exists")
            left = conn.execute(f"SELECT count(*) FROM {QUEUE} WHERE tenant = %s", (tenant,)).fetchone()
            _say(f"   after ROLLBACK: {left[0] if left else '?'} event(s) for {tenant!r}")

        total = tenants * events
        _say(f"== 4. {tenants} tenants x {events} events, each with its order row in one transaction")
        started = time.perf_counter()
        done = 0
        for i in range(events):
            for t in range(tenants):
                name = f"tenant-{t}"
                with router.transaction(name) as conn:
                    conn.execute("INSERT INTO demo_orders (tenant, total) VALUES (%s, %s)", (name, i))
                    enqueue(conn, QUEUE, name, {"order": i, "tenant": name})
                done += 1
            if (i + 1) % max(1, events // 5) == 0 or i + 1 == events:
                rate = done / (time.perf_counter() - started)
                _say(f"   {done:>7}/{total} events committed ({rate:,.0f}/s)")
        sample = "tenant-7"
        _say(
            f"   tenant {sample!r} -> shard {router.shard_for(sample).name}, partitions "
            f"{list(routing.shuffle_set(sample, 16, 4))} of 16"
        )

        _say("== 5. bad input is refused by the database, clearly")
        wrong = next(s for s in topology.shards if s.name != router.shard_for(sample).name) if shards > 1 else None
        checks: list[tuple[str, Shard, str, tuple[object, ...]]] = [
            (
                "oversized payload",
                router.shard_for(sample),
                f"INSERT INTO {QUEUE} (tenant, payload) VALUES (%s, %s)",
                (sample, '{"blob": "' + "x" * 70000 + '"}'),
            ),
            (
                "explicit NULL fire_at",
                router.shard_for(sample),
                f"INSERT INTO {QUEUE} (tenant, payload, fire_at) VALUES (%s, '{{}}', NULL)",
                (sample,),
            ),
        ]
        if wrong is not None:
            checks.insert(
                0, ("misrouted tenant", wrong, f"INSERT INTO {QUEUE} (tenant, payload) VALUES (%s, '{{}}')", (sample,))
            )
        for label, shard, stmt, params in checks:
            try:
                with psycopg.connect(shard.dsn) as conn:
                    conn.execute(stmt, params)
                _say(f"   {label}: ACCEPTED (unexpected)")
            except psycopg.Error as exc:
                _say(f"   {label}: {exc.diag.message_primary}")

        _say("== 6. a batch of 20,000 events with COPY (partitions chosen client-side, checked by the database)")
        started = time.perf_counter()
        batch = [Event(f"bulk-{i % 500}", {"n": i}) for i in range(20_000)]
        try:
            n = router.enqueue_batch(QUEUE, batch)
        except QueueManagerError as exc:
            _say(f"   batch failed: {exc}")
            return 1
        _say(f"   {n} events loaded in {time.perf_counter() - started:.2f}s")

    _say("== 7. qm status")
    _say(admin.render_status(admin.status(topology)))

    _say("== 8. managers (active + standby per shard) fire everything to websocket receivers")
    ok = asyncio.run(_deliver(topology))
    _say("== 9. qm status")
    _say(admin.render_status(admin.status(topology)))
    _say(f"\nthe shards keep running; stop them with: qm local stop --dir {directory}")
    return 0 if ok else 1


async def _pending(topology: Topology) -> dict[str, int]:
    out = {}
    for s in topology.shards:
        async with await psycopg.AsyncConnection.connect(s.dsn) as conn:
            cur = await conn.execute(f"SELECT count(*) FROM {QUEUE} WHERE state IN ('to_be_fired', 'fired')")
            row = await cur.fetchone()
            out[s.name] = int(row[0]) if row else 0
    return out


async def _deliver(topology: Topology) -> bool:
    from queue_manager.manager import Manager, ManagerConfig
    from queue_manager.manager.auth import TokenStore
    from receivers.client import Event as Delivered
    from receivers.client import Receiver

    secret = secrets.token_urlsafe(24)
    tokens = TokenStore.from_entries([{"name": "demo", "secret": secret, "queues": [QUEUE]}])
    managers: dict[str, list[Manager]] = {}
    tasks: list[asyncio.Task[None]] = []
    for s in topology.shards:
        pair = [Manager(ManagerConfig(dsn=s.dsn, tokens=tokens, shard=s.name, lease_ttl=3.0)) for _ in range(2)]
        managers[s.name] = pair
        for m in pair:
            tasks.append(asyncio.create_task(m.run()))
            await m.ready.wait()
    got: dict[str, int] = {s.name: 0 for s in topology.shards}
    scheduled: list[float] = []

    def handler_for(shard: str):  # type: ignore[no-untyped-def]
        async def handle(event: Delivered) -> None:
            got[shard] += 1
            if isinstance(event.payload, dict) and event.payload.get("scheduled"):
                scheduled.append(time.time() - event.fire_at)

        return handle

    receivers = []
    for s in topology.shards:
        urls = [f"ws://127.0.0.1:{m.port}/" for m in managers[s.name]]
        r = Receiver(urls, secret, QUEUE, handler_for(s.name), credit=1000, concurrency=50)
        receivers.append(r)
        tasks.append(asyncio.create_task(r.run()))

    def leaders() -> str:
        parts = []
        for name, pair in managers.items():
            active = [m for m in pair if m.role == "leader"]
            parts.append(f"{name}: {'term ' + str(active[0].term) if active else 'electing'}")
        return ", ".join(parts)

    try:
        start = time.perf_counter()
        pending = await _pending(topology)
        _say(f"   {sum(pending.values())} events waiting; receivers connect to both managers of their shard")
        while sum(pending.values()) > 0 and time.perf_counter() - start < 300:
            await asyncio.sleep(1.0)
            pending = await _pending(topology)
            total = sum(got.values())
            _say(
                f"   t={time.perf_counter() - start:4.0f}s  delivered {total:>7} "
                f"({', '.join(f'{k}: {v}' for k, v in got.items())})  still pending {sum(pending.values()):>7}  "
                f"[{leaders()}]"
            )
        if sum(pending.values()) > 0:
            _say("   delivery did not finish within 300 s")
            return False
        _say(f"   all delivered and acked in {time.perf_counter() - start:.1f}s")

        first = topology.shards[0]
        tenant = next(f"demo-late-{i}" for i in range(10_000) if first.key_range.contains(f"demo-late-{i}"))
        async with await psycopg.AsyncConnection.connect(first.dsn) as conn:
            await conn.execute(
                f"INSERT INTO {QUEUE} (tenant, payload, fire_at) VALUES (%s, %s, now() + interval '2 seconds')",
                (tenant, '{"scheduled": true}'),
            )
        _say("   scheduled one event 2 s ahead ...")
        while not scheduled:
            await asyncio.sleep(0.05)
        _say(f"   ... it fired {scheduled[0] * 1000:.1f} ms after its fire_at")

        active = next(m for m in managers[first.name] if m.role == "leader")
        standby = next(m for m in managers[first.name] if m is not active)
        _say(f"   SIGTERM-style drain of shard {first.name}'s active manager (term {active.term}) ...")
        handover = time.perf_counter()
        active.request_stop()
        while standby.role != "leader":
            await asyncio.sleep(0.02)
        _say(f"   ... its standby leads (term {standby.term}) after {time.perf_counter() - handover:.2f}s")
        before = got[first.name]
        async with await psycopg.AsyncConnection.connect(first.dsn) as conn:
            await conn.execute(
                f"INSERT INTO {QUEUE} (tenant, payload) SELECT %s, jsonb_build_object('after_handover', g) "
                "FROM generate_series(1, 100) g",
                (tenant,),
            )
        while got[first.name] < before + 100:
            await asyncio.sleep(0.05)
        _say("   100 events enqueued after the handover were delivered by the new active manager")
        return True
    finally:
        for r in receivers:
            r.stop()
        for pair in managers.values():
            for m in pair:
                m.request_stop()
        await asyncio.gather(*tasks, return_exceptions=True)
