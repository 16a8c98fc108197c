"""The producers of the fault suite: every way in, each recorded with its transaction's outcome.

Per shard, one loop draws an operation at a time (seeded):

* ``sql``: a plain ``INSERT`` of 1 to 3 rows in an explicit transaction, one in ten rolled back;
* ``helper``: ``queue_manager.producer.aenqueue`` in a transaction;
* ``sched``: an ``INSERT`` with a ``fire_at`` 0.5 to 3 s ahead;
* ``dedup``: ``aenqueue`` with a dedup key, each key tried twice (the second is skipped);
* ``batch``: ``enqueue_batch`` (COPY) of 20 events, in a thread with a sync connection.

An operation that fails before COMMIT records its keys as ``rollback``; a COMMIT that fails with a
broken connection records them as ``unknown`` (it may have committed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import psycopg

from faults.cluster import QUEUE
from faults.history import HistoryWriter, now
from queue_manager.producer import Event, aenqueue, enqueue_batch

OPS = ("sql", "sql", "sql", "helper", "sched", "dedup", "batch")
INSERT = f"INSERT INTO {QUEUE} (tenant, payload, fire_at) VALUES (%s, %s, coalesce(%s, now()))"


class Producer:
    def __init__(
        self, shard: str, dsn: str, tenants: list[str], history: HistoryWriter, seed: int, pace: float = 0.08
    ) -> None:
        self.shard = shard
        self.dsn = dsn
        self.tenants = tenants
        self.h = history
        self.rng = random.Random(seed)
        self.pace = pace
        self.n = 0
        self.dedup_pending: list[tuple[str, str]] = []
        self.committed = 0

    def key(self) -> str:
        self.n += 1
        return f"{self.shard}-{self.n}"

    def record(self, keys: list[tuple[str, str, float | None]], outcome: str, via: str) -> None:
        t = now()
        for k, tenant, fire_at in keys:
            self.h.write(
                "enqueued", t=t, k=k, tenant=tenant, shard=self.shard, via=via, outcome=outcome, fire_at=fire_at
            )
        if outcome == "commit":
            self.committed += len(keys)

    async def run(self, stop: asyncio.Event) -> None:
        conn: psycopg.AsyncConnection[Any] | None = None
        while not stop.is_set():
            op = self.rng.choice(OPS)
            try:
                if conn is None or conn.closed:
                    conn = await psycopg.AsyncConnection.connect(self.dsn, connect_timeout=3)
                if op == "batch":
                    await self.batch()
                else:
                    await self.one(conn, op)
            except psycopg.Error:
                if conn is not None:
                    with contextlib.suppress(Exception):
                        await conn.close()
                conn = None
                await asyncio.sleep(0.2)
            await asyncio.sleep(self.pace * (0.5 + self.rng.random()))
        if conn is not None:
            await conn.close()

    async def one(self, conn: psycopg.AsyncConnection[Any], op: str) -> None:
        keys: list[tuple[str, str, float | None]] = []
        rollback = op == "sql" and self.rng.random() < 0.1
        skipped: list[tuple[str, str, float | None]] = []
        try:
            async with conn.transaction() as tx:
                if op == "sql":
                    for _ in range(self.rng.randint(1, 3)):
                        keys.append((self.key(), self.rng.choice(self.tenants), None))
                        await conn.execute(INSERT, (keys[-1][1], json.dumps({"k": keys[-1][0]}), None))
                elif op == "sched":
                    fire_at = now() + 0.5 + self.rng.random() * 2.5
                    keys.append((self.key(), self.rng.choice(self.tenants), fire_at))
                    at = datetime.fromtimestamp(fire_at, UTC)
                    await conn.execute(INSERT, (keys[-1][1], json.dumps({"k": keys[-1][0]}), at))
                elif op == "helper":
                    keys.append((self.key(), self.rng.choice(self.tenants), None))
                    await aenqueue(conn, QUEUE, keys[-1][1], {"k": keys[-1][0]})
                else:  # dedup: a new key, or the second try of a pending one
                    if self.dedup_pending and self.rng.random() < 0.5:
                        tenant, dkey = self.dedup_pending.pop(0)
                    else:
                        tenant, dkey = self.rng.choice(self.tenants), f"d-{self.key()}"
                        self.dedup_pending.append((tenant, dkey))
                    item = (self.key(), tenant, None)
                    got = await aenqueue(conn, QUEUE, tenant, {"k": item[0]}, dedup_key=dkey)
                    (keys if got is not None else skipped).append(item)
                if rollback:
                    raise psycopg.Rollback(tx)
        except psycopg.OperationalError:
            # the connection broke: in COMMIT (outcome unknown) or before it (nothing committed)
            self.record(keys, "unknown", op)
            self.record(skipped, "skipped", op)
            raise
        except psycopg.Error:
            self.record(keys + skipped, "rollback", op)
            raise
        self.record(keys, "rollback" if rollback else "commit", op)
        self.record(skipped, "skipped", op)

    async def batch(self) -> None:
        items: list[tuple[str, str, float | None]] = [
            (self.key(), self.rng.choice(self.tenants), None) for _ in range(10)
        ]
        outcome = await asyncio.to_thread(self._batch_sync, items)
        self.record(items, outcome, "batch")
        if outcome != "commit":
            raise psycopg.OperationalError("batch failed")

    def _batch_sync(self, items: list[tuple[str, str, float | None]]) -> str:
        stage = "before"
        try:
            with psycopg.connect(self.dsn, connect_timeout=3) as conn:
                enqueue_batch(conn, QUEUE, [Event(tenant, {"k": k}) for k, tenant, _ in items])
                stage = "commit"
                conn.commit()
            return "commit"
        except psycopg.Error:
            return "unknown" if stage == "commit" else "rollback"


def producers(
    dsns: dict[str, str], tenants: Callable[[str], list[str]], history: HistoryWriter, seed: int
) -> list[Producer]:
    return [
        Producer(shard, dsn, tenants(shard), history, seed + i) for i, (shard, dsn) in enumerate(sorted(dsns.items()))
    ]
