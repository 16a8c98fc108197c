"""The command-line contract of a client under test (docs/conformance.md), shared by the suite and
the Python client: its options, and what an event's payload asks the handler to do.

    CLIENT --manager SHARD=URL [--manager SHARD=URL ...] --token SECRET --queue QUEUE
           [--concurrency N] [--extend-after S] [--extend-by S] [--drain-timeout S]

The client receives the queue from every shard's managers, runs at most ``--concurrency`` handlers
at once (default 10), extends the ack deadline of a handler still running after ``--extend-after``
seconds by ``--extend-by`` seconds (default: never), and on SIGTERM or SIGINT drains (the handlers
running finish and are settled; at most ``--drain-timeout`` seconds, default 10) and exits 0. When a
manager refuses its token (HTTP 401) or its subscription (``forbidden``), it exits non-zero.

Each event's payload says what the handler does: ``{"do": [ACTION, ...]}``, the action of attempt
*n* being the list's *n*-th (its last for later attempts; no ``do``: ``ack``). An action is
``ack``; ``nack:DELAY`` (nack, due again after DELAY seconds); ``fail`` (the handler fails: nack
with the queue's back-off); ``sleep:S`` (sleep S seconds, then ack).

It writes one JSON object per line on stdout, each with ``kind`` and ``t`` (epoch seconds):
``{"kind": "start", "shard", "id", "attempt", "tenant"}`` when a handler starts,
``{"kind": "end", "shard", "id", "attempt", "outcome"}`` (``ack``, ``nack`` or ``fail``, or
``cancelled`` when a ``cancel`` frame stopped it) when it returns, and
``{"kind": "refused", "shard", "id", "attempt", "code"}`` for each item of an ack, nack or extend
that the manager refused (its per-item code).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Action:
    kind: str  # ack, nack, fail or sleep
    seconds: float = 0.0


def action(payload: Any, attempt: int) -> Action:
    """What the handler does with this attempt of an event of this payload."""
    steps = payload.get("do") if isinstance(payload, dict) else None
    if not isinstance(steps, list) or not steps:
        return Action("ack")
    text = str(steps[min(attempt, len(steps)) - 1])
    kind, _, arg = text.partition(":")
    if kind not in ("ack", "nack", "fail", "sleep"):
        raise ValueError(f"unknown action {text!r}")
    return Action(kind, float(arg) if arg else 0.0)


def parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="a qm.v1 client under the conformance suite's contract")
    p.add_argument("--manager", action="append", required=True, metavar="SHARD=URL")
    p.add_argument("--token", required=True)
    p.add_argument("--queue", required=True)
    p.add_argument("--concurrency", type=int, default=10)
    p.add_argument("--extend-after", type=float, default=None)
    p.add_argument("--extend-by", type=float, default=60.0)
    p.add_argument("--drain-timeout", type=float, default=10.0)
    return p


def managers(values: list[str]) -> dict[str, list[str]]:
    """``SHARD=URL`` options, by shard (a shard named several times has several managers)."""
    out: dict[str, list[str]] = {}
    for value in values:
        shard, sep, url = value.partition("=")
        if not sep or not shard or not url:
            raise ValueError(f"--manager takes SHARD=URL, got {value!r}")
        out.setdefault(shard, []).append(url)
    return out
