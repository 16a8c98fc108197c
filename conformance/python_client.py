"""The Python receiver library (:class:`receivers.Receiver`) under the conformance contract:
``python -m conformance.python_client --manager s0=ws://... --token T --queue Q`` (conformance/contract.py)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from conformance.contract import action, managers, parser
from receivers import Backoff, Event, Receiver, ReceiverError, Retry


def emit(kind: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"kind": kind, "t": time.time(), **fields}) + "\n")
    sys.stdout.flush()


class Failed(Exception):
    """The handler's failure the payload asked for."""


async def handle(event: Event) -> None:
    todo = action(event.payload, event.attempt)
    emit("start", shard=event.shard, id=event.id, attempt=event.attempt, tenant=event.tenant)
    outcome = "ack"
    try:
        if todo.kind == "sleep":
            await asyncio.sleep(todo.seconds)
        elif todo.kind == "nack":
            outcome = "nack"
            raise Retry("the payload asked for a nack", delay=todo.seconds)
        elif todo.kind == "fail":
            outcome = "fail"
            raise Failed("the payload asked for a failure")
    except asyncio.CancelledError:
        outcome = "cancelled"  # an operator cancelled the event: the cancel frame stopped the handler
        raise
    finally:
        emit("end", shard=event.shard, id=event.id, attempt=event.attempt, outcome=outcome)


async def report_refusals(receiver: Receiver) -> None:
    """The per-item errors the manager sent (the library keeps the last ones in its stats)."""
    seen: set[int] = set()
    while True:
        for err in list(receiver.stats.errors):
            if id(err) not in seen and "id" in err and "code" in err:
                seen.add(id(err))
                emit("refused", shard=err.get("shard"), id=err["id"], attempt=err.get("attempt"), code=err["code"])
        await asyncio.sleep(0.02)


async def main(argv: list[str]) -> int:
    args = parser("conformance.python_client").parse_args(argv)
    receiver = Receiver(
        managers(args.manager),
        args.queue,
        handle,
        token=args.token,
        concurrency=args.concurrency,
        extend_after=args.extend_after,
        extend_by=args.extend_by,
        drain_timeout=args.drain_timeout,
        backoff=lambda: Backoff(initial=0.05, maximum=0.5),
        leader_check=0.5,
    )
    reporter = asyncio.create_task(report_refusals(receiver))
    try:
        await receiver.run(handle_signals=True)
    except ReceiverError as exc:
        print(f"conformance.python_client: {exc}", file=sys.stderr)
        return 2
    finally:
        await asyncio.sleep(0.05)  # the last refusals
        reporter.cancel()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
