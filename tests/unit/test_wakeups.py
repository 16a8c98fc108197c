"""How notifications become nudges, without a database."""

from __future__ import annotations

from typing import Any

from queue_manager.manager.wakeups import Listener


def listener(calls: list[tuple[Any, ...]]) -> Listener:
    return Listener(
        conn=None,  # type: ignore[arg-type]  # handle() does no I/O
        on_wake=lambda q, due, t: calls.append(("wake", q, due, t)),
        on_settled=lambda q, i, a: calls.append(("settled", q, i, a)),
        on_unknown=lambda: calls.append(("unknown",)),
        known={"orders", "audit"}.__contains__,
        loop_time=lambda: 42.0,
    )


def test_wake_ups_due_or_not_settled_notices_and_unknown_queues() -> None:
    calls: list[tuple[Any, ...]] = []
    lst = listener(calls)
    for payload in ("orders", "orders due", "audit settled 9223372036854775807 3", "newqueue", "newqueue due"):
        lst.handle(payload)
    assert calls == [
        ("wake", "orders", False, 42.0),
        ("wake", "orders", True, 42.0),
        ("settled", "audit", 9223372036854775807, 3),
        ("unknown",),
        ("unknown",),
    ]


def test_a_malformed_settled_notice_is_ignored() -> None:
    calls: list[tuple[Any, ...]] = []
    listener(calls).handle("orders settled x 1")
    assert calls == []
