"""The producers of the fault suite: every way in, each recorded with its transaction's outcome.

Per shard, one loop draws an operation at a time (seeded):

* ``sql``: a plain ``INSERT`` of 1 to 3 rows in an explicit transaction, one in ten rolled back;
* ``helper``: ``queue_manager.producer.aenqueue`` in a transaction;
* ``sched``: an ``INSERT`` with a ``fire_at`` 0.5 to 3 s ahead;
* ``dedup``: ``aenqueue`` with a dedup key, each key tried twice (the second is skipped);
* ``batch``: ``enqueue_batch`` (COPY) of 20 events, in a thread with a sync connection.

An operation that fails before COMMIT records its keys as ``rollback``; a COMMIT that fails with a
broken connection records them as ``unknown`` (it may have committed).

With ``keys`` (``concurrency`` or ``rate``), every event goes to one of the first HOT_TENANTS
tenants and names one of KEYS_PER_TENANT keys of its tenant as its ``concurrency_key`` or its
``rate_key``, recorded with it (``ckey``, ``rkey``): about 0.75 events/s a key, in bursts (a batch
puts several into one key at once), so that the limits bind now and then.
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
INSERT = (
    f"INSERT INTO {QUEUE} (tenant, payload, fire_at, concurrency_key, rate_key) "
    "VALUES (%s, %s, coalesce(%s, now()), %s, %s)"
)
#: the keys of a tenant's events, with ``keys``: few, of few tenants, so that each key is busy
KEYS_PER_TENANT = 8
HOT_TENANTS = 2


class Producer:
    def __init__(
        self,
        shard: str,
        dsn: str,
        tenants: list[str],
        history: HistoryWriter,
        seed: int,
        pace: float = 0.08,
        keys: str | None = None,
    ) -> None:
        self.keys = keys
        self.shard = shard
        self.dsn = dsn
        self.tenants = tenants if keys is None else tenants[:HOT_TENANTS]
        self.h = history
        self.rng = random.Random(seed)
        self.pace = pace
        self.n = 0
        self.dedup_pending: list[tuple[str, str]] = []
        self.committed = 0

    def key(self) -> str:
        self.n += 1
        return f"{self.shard}-{self.n}"

    def key_of(self, k: str) -> tuple[str | None, str | None]:
        """The concurrency_key and rate_key of event ``k`` (both None without ``keys``)."""
        name = f"key-{int(k.rsplit('-', 1)[1]) % KEYS_PER_TENANT}"
        return (name if self.keys == "concurrency" else None, name if self.keys == "rate" else None)

    def record(self, keys: list[tuple[str, str, float | None]], outcome: str, via: str) -> None:
        t = now()
        for k, tenant, fire_at in keys:
            extra = {}
            if self.keys is not None:
                ckey, rkey = self.key_of(k)
                extra = {"ckey": ckey, "rkey": rkey}
            self.h.write(
                "enqueued",
                t=t,
                k=k,
                tenant=tenant,
                shard=self.shard,
                via=via,
                outcome=outcome,
                fire_at=fire_at,
                **extra,
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
                        await conn.execute(INSERT, self.row(keys[-1], None))
                elif op == "sched":
                    fire_at = now() + 0.5 + self.rng.random() * 2.5
                    keys.append((self.key(), self.rng.choice(self.tenants), fire_at))
                    at = datetime.fromtimestamp(fire_at, UTC)
                    await conn.execute(INSERT, self.row(keys[-1], at))
                elif op == "helper":
                    keys.append((self.key(), self.rng.choice(self.tenants), None))
                    await aenqueue(
                        conn,
                        QUEUE,
                        keys[-1][1],
                        {"k": keys[-1][0]},
                        concurrency_key=self.key_of(keys[-1][0])[0],
                        rate_key=self.key_of(keys[-1][0])[1],
                    )
                else:  # dedup: a new key, or the second try of a pending one
                    if self.dedup_pending and self.rng.random() < 0.5:
                        tenant, dkey = self.dedup_pending.pop(0)
                    else:
                        tenant, dkey = self.rng.choice(self.tenants), f"d-{self.key()}"
                        self.dedup_pending.append((tenant, dkey))
                    item = (self.key(), tenant, None)
                    got = await aenqueue(
                        conn,
                        QUEUE,
                        tenant,
                        {"k": item[0]},
                        dedup_key=dkey,
                        concurrency_key=self.key_of(item[0])[0],
                        rate_key=self.key_of(item[0])[1],
                    )
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

    def row(self, item: tuple[str, str, float | None], fire_at: datetime | None) -> tuple[Any, ...]:
        """The parameters of INSERT for one event."""
        return (item[1], json.dumps({"k": item[0]}), fire_at, *self.key_of(item[0]))

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
                enqueue_batch(
                    conn,
                    QUEUE,
                    [
                        Event(tenant, {"k": k}, concurrency_key=self.key_of(k)[0], rate_key=self.key_of(k)[1])
                        for k, tenant, _ in items
                    ],
                )
                stage = "commit"
                conn.commit()
            return "commit"
        except psycopg.Error:
            return "unknown" if stage == "commit" else "rollback"


def producers(
    dsns: dict[str, str],
    tenants: Callable[[str], list[str]],
    history: HistoryWriter,
    seed: int,
    keys: str | None = None,
) -> list[Producer]:
    return [
        Producer(shard, dsn, tenants(shard), history, seed + i, keys=keys)
        for i, (shard, dsn) in enumerate(sorted(dsns.items()))
    ]
