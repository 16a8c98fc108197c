"""The protocol's hot paths without a socket or a database: ``python -m benchmarks.wire_codec``.

Both ends of a connection, driven through their sans-I/O sessions' public methods only (so the same
script measures any checkout: ``PYTHONPATH=OTHER_CHECKOUT python -m benchmarks.wire_codec``):

- ``server``: the manager's :class:`~queue_manager.wire.session.ReceiverSession` reads an ``ack``
  of ``--batch`` items, claims them and writes the ``ack_result`` (parse, claims, result frame);
- ``client``: the receiver's :class:`~queue_manager.wire.client.ClientSession` reads a ``deliver``
  of ``--batch`` events, completes each, sends the ``ack`` and reads the ``ack_result``.

The frames are written as JSON text here, not with the typed frames of ``queue_manager.wire.frames``,
so that both checkouts read the same bytes whatever their API.

Each side runs ``--rounds`` rounds of ``--events`` events; the report gives events per second of this
process's CPU (``time.process_time``: on a shared machine, the time it waited for a core is left
out) per round (median, min, max) and the module each side was imported from.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from benchmarks.lib.report import emit, header
from queue_manager.wire import client as wire_client
from queue_manager.wire import frames
from queue_manager.wire.client import ACK, ClientSession, Start
from queue_manager.wire.ledger import Ledger
from queue_manager.wire.session import ReceiverSession, Resolve, Send, Write
from receivers import ReceiverStats

LIMITS = {
    "max_frame_bytes": 1 << 20,
    "max_items_per_frame": 10_000,
    "max_credit": 100_000,
    "max_events_per_deliver": 500,
    "max_tenants_per_subscription": 10_000,
    "max_error_text": 4096,
    "max_ref_length": 200,
    "max_extend_seconds": 86400.0,
    "max_error_messages": 100,
}


class _Scope:
    name = "bench"

    def allows_queue(self, queue: str) -> bool:
        return True

    def allowed_tenants(self, requested: Iterable[str] | None) -> frozenset[str] | None:
        return None


class _Metrics:
    def frame_refused(self, code: str) -> None:
        pass

    def acked(self, queue: str, count: int, latencies: list[float]) -> None:
        pass

    def nacked(self, queue: str, requeued: int, failed: int) -> None:
        pass


@dataclass(slots=True)
class _Event:
    id: int
    attempt: int
    payload: Any


def _make_event(queue: str, raw: Mapping[str, Any]) -> _Event:
    return _Event(raw["id"], raw["attempt"], raw["payload"])


def server_side(events: int, batch: int) -> float:
    """Seconds for ``events`` events acked in frames of ``batch`` items."""
    ledger = Ledger()
    session = ReceiverSession(1, _Scope(), db_time=lambda: 1.0, metrics=_Metrics())
    (resolve,) = session.receive(json.dumps({"type": "subscribe", "queue": "orders", "credit": batch}), 0.0)
    assert isinstance(resolve, Resolve)
    session.subscribed(resolve, ledger)
    ident = 1
    took = 0.0
    for ref in range(events // batch):
        items = []
        for _ in range(batch):
            ledger.hold(1, ident, 1, 0.0, "t")
            items.append([ident, 1])
            ident += 1
        text = json.dumps({"type": "ack", "ref": ref, "events": items}, separators=(",", ":"))
        t0 = time.process_time()
        (write, *_) = session.receive(text, 0.0)
        assert isinstance(write, Write)
        (send, *_) = session.settled(write, {it[0] for it in write.items}, 0.0)
        assert isinstance(send, Send)
        took += time.process_time() - t0
    return took


def client_side(events: int, batch: int) -> float:
    """Seconds for ``events`` events delivered in frames of ``batch``, each acked and confirmed."""
    session: ClientSession[_Event] = ClientSession(
        "s0", "orders", slots=batch, make_event=_make_event, stats=ReceiverStats()
    )
    session.connected()
    welcome = {"type": "welcome", "protocol": "qm.v1", "shard": "s0", "term": 1, "manager": "m", "limits": LIMITS}
    session.receive(json.dumps(welcome))
    session.receive(
        json.dumps({"type": "subscribed", "ref": "subscribe", "queue": "orders", "tenants": None, "credit": batch})
    )
    session.frames()
    ident = 1
    took = 0.0
    for _ in range(events // batch):
        evs = [
            {
                "id": i,
                "attempt": 1,
                "tenant": "tenant-1",
                "partition": 3,
                "fire_at": 1763719200.104512,
                "payload": {"n": 1},
            }
            for i in range(ident, ident + batch)
        ]
        ident += batch
        deliver = json.dumps({"type": "deliver", "queue": "orders", "events": evs}, separators=(",", ":"))
        t0 = time.process_time()
        effects = session.receive(deliver)
        for e in effects:
            assert isinstance(e, Start)
            session.completed(e.event, e.gen, ACK)
        for e in effects:
            assert isinstance(e, Start)
            session.slot_freed(e.event)
        (ack,) = session.frames()
        sent = json.loads(ack)
        result = json.dumps(
            {"type": "ack_result", "ref": sent["ref"], "acked": [i for i, _ in sent["events"]], "errors": []},
            separators=(",", ":"),
        )
        session.receive(result)
        took += time.process_time() - t0
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    sides = {"server": server_side, "client": client_side}
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, run in sides.items():
            rates[name].append(args.events / run(args.events, args.batch))
    report = header("wire_codec")
    report["modules"] = {"frames": frames.__file__, "client": wire_client.__file__}
    report["events"], report["batch"], report["rounds"] = args.events, args.batch, args.rounds
    for name, values in rates.items():
        report[name] = {
            "events_per_s_median": round(statistics.median(values)),
            "min": round(min(values)),
            "max": round(max(values)),
        }
    emit(report)


if __name__ == "__main__":
    main()
