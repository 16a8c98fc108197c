"""A receiver process of the fault suite: ``python -m faults.receiver_proc CONFIG_JSON``.

Two kinds, each recording every delivery and settlement into its own history file:

* ``lib``: the receivers library (:class:`receivers.Receiver`) with a handler that, by a seeded
  draw per delivery, returns (the library acks over the socket), acks by SQL in a committed
  transaction, acks by SQL and rolls back (the library then acks over the socket), holds the SQL
  ack past the ack deadline and rolls back, raises :class:`receivers.Retry` (a nack), or runs
  slowly (the library extends the deadline). Confirmed socket acks are read from the
  ``ack_result`` frames the library receives;
* ``raw``: a minimal client of the protocol (docs/protocol.md) on websockets: subscribe with
  credit, ack, nack and extend over the socket, record each ``ack_result``.

The parent signals this process (SIGKILL, SIGSTOP/SIGCONT) and records those itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import sys
from pathlib import Path
from typing import Any

import psycopg
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from faults.history import HistoryWriter, now
from queue_manager.wire import frames as f
from queue_manager.wire.client import ClientSession
from queue_manager.wire.frames import PROTOCOL
from receivers import Receiver, Retry
from receivers.backoff import Backoff
from receivers.errors import EventNotFiredError
from receivers.receiver import Event
from receivers.sql import ack_in_transaction_async


def _weights(cfg: dict[str, Any]) -> tuple[list[str], list[float]]:
    mix: dict[str, float] = cfg.get("mix") or {"ack": 1.0}
    return list(mix), list(mix.values())


class Lib:
    """The library receiver with a recording, misbehaving-on-purpose handler."""

    def __init__(self, cfg: dict[str, Any], history: HistoryWriter) -> None:
        self.cfg = cfg
        self.h = history
        self.name: str = cfg["name"]
        self.queue: str = cfg["queue"]
        self.rng = random.Random(cfg.get("seed", 0))
        self.actions, self.weights = _weights(cfg)
        self.keys: dict[tuple[str, int, int], str] = {}
        self.receiver = Receiver(
            {s: list(u) for s, u in cfg["urls"].items()},
            self.queue,
            self.handle,
            concurrency=int(cfg.get("concurrency", 20)),
            tenants=cfg.get("tenants"),
            token=cfg["token"],
            extend_after=None if cfg.get("extend_after") is None else float(cfg["extend_after"]),
            extend_by=float(cfg.get("extend_by", 5.0)),
            drain_timeout=2.0,
            backoff=lambda: Backoff(initial=0.05, maximum=float(cfg.get("backoff_max", 0.5))),
        )
        self._patch_frames()

    def _patch_frames(self) -> None:
        """Record confirmed socket acks: the library keeps them to itself, so read the ack results its
        client session receives (each id's attempt from the ack frame the result answers)."""
        original = ClientSession._ack_result
        me = self

        def ack_result(session: ClientSession[Any], frame: f.AckResult) -> None:
            ref = frame.ref
            entry = session.outstanding.get(ref) if isinstance(ref, int) else None
            sent: dict[int, int] = dict(entry.items) if isinstance(entry, f.Ack) else {}
            for ident in frame.acked:
                attempt = sent.get(ident, session.book.in_hand.get(ident, 0))
                me.h.write(
                    "ack",
                    r=me.name,
                    shard=session.shard,
                    id=ident,
                    attempt=attempt,
                    k=me.keys.get((session.shard, ident, attempt)),
                    via="socket",
                    outcome="ok",
                )
            original(session, frame)

        ClientSession._ack_result = ack_result  # type: ignore[method-assign,assignment]

    async def handle(self, event: Event) -> None:
        k = event.payload.get("k") if isinstance(event.payload, dict) else None
        link = self.receiver._links.get(event.shard)
        self.keys[(event.shard, event.id, event.attempt)] = str(k)
        self.h.write(
            "deliver",
            r=self.name,
            shard=event.shard,
            term=None if link is None else link.term,
            id=event.id,
            attempt=event.attempt,
            k=k,
            tenant=event.tenant,
            fire_at=event.fire_at,
        )
        action = self.rng.choices(self.actions, self.weights)[0]
        base = {"r": self.name, "shard": event.shard, "id": event.id, "attempt": event.attempt, "k": k}
        if action == "slow":
            await asyncio.sleep(float(self.cfg.get("slow_s", 2.5)))
        elif action == "nack":
            self.h.write("nack", **base, outcome="sent")
            raise Retry("the fault suite's nack", delay=0)
        elif action in ("sql", "sql_rollback", "sql_late_rollback"):
            await self.sql_ack(event, action, base)

    async def sql_ack(self, event: Event, action: str, base: dict[str, Any]) -> None:
        try:
            # a connection per handler: its transaction is the handler's own
            async with (
                await psycopg.AsyncConnection.connect(self.cfg["dsns"][event.shard], connect_timeout=5) as conn,
                conn.transaction() as tx,
            ):
                await ack_in_transaction_async(conn, self.queue, event)
                if action == "sql_late_rollback":
                    # hold the row lock past the ack deadline, then roll back: the event must come
                    # back at once, not at the next full rescan
                    await asyncio.sleep(float(self.cfg.get("hold_s", 3.0)))
                if action != "sql":
                    event._settled_by_sql = False  # the library acks over the socket instead
                    raise psycopg.Rollback(tx)
            if action == "sql":
                self.h.write("ack", **base, via="sql", outcome="ok")
                return
            due_again = max(now(), event_deadline(event, self.cfg))
            self.h.write("ack", **base, via="sql", outcome="rollback", due_again=due_again)
            if action == "sql_late_rollback":
                raise Retry("rolled back late", delay=0)  # nothing to ack: the deadline has passed
        except EventNotFiredError as exc:
            self.h.write("ack", **base, via="sql", outcome="refused", error=str(exc)[:200])
            raise Retry("not fired any more", delay=0) from exc
        except psycopg.OperationalError as exc:
            self.h.write("ack", **base, via="sql", outcome="unknown", error=str(exc)[:200])
            raise

    async def run(self, subscribed: asyncio.Event) -> None:
        task = asyncio.create_task(self.receiver.run(handle_signals=True))
        with contextlib.suppress(TimeoutError):
            await self.receiver.wait_subscribed(60)
            subscribed.set()
        await task


def event_deadline(event: Event, cfg: dict[str, Any]) -> float:
    """When the manager's collector may take the event back: its ack deadline (by this clock)."""
    return now() - (asyncio.get_running_loop().time() - event.received_at) + float(cfg["ack_timeout"])


class Raw:
    """A minimal protocol client: one websocket per shard, acks, nacks and extends over the socket."""

    def __init__(self, cfg: dict[str, Any], history: HistoryWriter) -> None:
        self.cfg = cfg
        self.h = history
        self.name: str = cfg["name"]
        self.rng = random.Random(cfg.get("seed", 0))
        self.actions, self.weights = _weights(cfg)
        self.stop = asyncio.Event()
        self.subscribed: set[str] = set()
        self.on_subscribed = asyncio.Event()

    async def shard(self, shard: str, urls: list[str]) -> None:
        refs = itertools.count(1)
        for url in itertools.cycle(urls):
            if self.stop.is_set():
                return
            try:
                async with connect(
                    url,
                    additional_headers={"Authorization": f"Bearer {self.cfg['token']}"},
                    subprotocols=[PROTOCOL],  # type: ignore[list-item]
                    open_timeout=3,
                ) as ws:
                    welcome = f.parse_server(await asyncio.wait_for(ws.recv(), 3))
                    term = welcome.term if isinstance(welcome, f.Welcome) else None
                    tenants = self.cfg.get("tenants")
                    sub = f.Subscribe(self.cfg["queue"], None if tenants is None else tuple(tenants), 50)
                    await ws.send(sub.to_json())
                    self.subscribed.add(shard)
                    if self.subscribed >= set(self.cfg["urls"]):
                        self.on_subscribed.set()
                    sent: dict[Any, f.Ack | f.Nack | f.Extend] = {}
                    keys: dict[tuple[int, int], str | None] = {}
                    async for message in ws:
                        frame = f.parse_server(message)
                        if isinstance(frame, f.Deliver):
                            acks: list[tuple[int, int]] = []
                            nacks: list[f.NackItem] = []
                            extends: list[f.ExtendItem] = []
                            for e in frame.events:
                                k = e["payload"].get("k") if isinstance(e["payload"], dict) else None
                                keys[(e["id"], e["attempt"])] = k
                                self.h.write(
                                    "deliver",
                                    r=self.name,
                                    shard=shard,
                                    term=term,
                                    id=e["id"],
                                    attempt=e["attempt"],
                                    k=k,
                                    tenant=e["tenant"],
                                    fire_at=e["fire_at"],
                                )
                                action = self.rng.choices(self.actions, self.weights)[0]
                                if action == "nack":
                                    nacks.append(f.NackItem(e["id"], e["attempt"], delay=0))
                                else:
                                    if action == "extend":
                                        extends.append(f.ExtendItem(e["id"], e["attempt"], 10))
                                    acks.append((e["id"], e["attempt"]))
                            out: list[f.Ack | f.Nack | f.Extend] = []
                            if extends:
                                out.append(f.Extend(tuple(extends), next(refs)))
                            if nacks:
                                out.append(f.Nack(tuple(nacks), next(refs)))
                            if acks:
                                out.append(f.Ack(tuple(acks), next(refs)))
                            for frame_out in out:
                                sent[frame_out.ref] = frame_out
                                await ws.send(frame_out.to_json())
                        elif isinstance(frame, f.AckResult):
                            answered = sent.pop(frame.ref, None)
                            attempts = dict(answered.items) if isinstance(answered, f.Ack) else {}
                            for ident in frame.acked:
                                a = attempts.get(ident, 0)
                                self.h.write(
                                    "ack",
                                    r=self.name,
                                    shard=shard,
                                    id=ident,
                                    attempt=a,
                                    k=keys.pop((ident, a), None),
                                    via="socket",
                                    outcome="ok",
                                )
                        elif isinstance(frame, f.NackResult | f.ExtendResult):
                            sent.pop(frame.ref, None)
            except (OSError, TimeoutError, ConnectionClosed, InvalidHandshake, InvalidStatus):
                pass
            await asyncio.sleep(0.1)

    async def run(self, subscribed: asyncio.Event) -> None:
        async def signal_up() -> None:
            await self.on_subscribed.wait()
            subscribed.set()

        await asyncio.gather(signal_up(), *(self.shard(s, list(u)) for s, u in self.cfg["urls"].items()))


async def main(cfg: dict[str, Any]) -> None:
    history = HistoryWriter(Path(cfg["history"]))
    worker: Lib | Raw = Lib(cfg, history) if cfg["kind"] == "lib" else Raw(cfg, history)
    subscribed = asyncio.Event()

    async def up() -> None:  # up (free to take events) once subscribed on every shard
        await subscribed.wait()
        history.write("receiver", r=cfg["name"], state="up", tenants=cfg.get("tenants"))

    announce = asyncio.create_task(up())
    try:
        await worker.run(subscribed)
    finally:
        announce.cancel()
        history.write("receiver", r=cfg["name"], state="down")
        history.close()


if __name__ == "__main__":
    import logging
    import signal

    logging.basicConfig(level=logging.INFO, format="%(created).3f %(name)s %(message)s", stream=sys.stderr)

    config = json.loads(sys.argv[1])
    if config["kind"] == "raw":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with contextlib.suppress(KeyboardInterrupt, SystemExit):
        asyncio.run(main(config))
