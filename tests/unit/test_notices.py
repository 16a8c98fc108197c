"""The notices on channel qm_wake: every shape its senders use, and malformed payloads."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from queue_manager.manager.notices import (
    Due,
    MalformedNotice,
    Notice,
    Poke,
    Scheduled,
    SettingsChanged,
    Settled,
    parse,
)
from queue_manager.manager.wakeups import Listener


@pytest.mark.parametrize(
    ("payload", "notice"),
    [
        ("orders", Poke("orders")),  # events_wake (qm events retry), an operator's NOTIFY
        ("orders due 1750000000123456", Due("orders", 1750000000.123456)),  # the verify trigger
        ("orders due", Due("orders", None)),  # revision 0001's verify trigger
        ("orders at 1750000000000000", Scheduled("orders", 1750000000.0)),  # verify, rescheduled, Spark
        ("orders at", Scheduled("orders", None)),
        ("audit settled 9223372036854775807 3 15 acked", Settled("audit", 9223372036854775807, 3, 15, "acked")),
        ("audit settled 7 1 0 deleted", Settled("audit", 7, 1, 0, "deleted")),
        ("audit settled 7 2 0 to_be_fired", Settled("audit", 7, 2, 0, "to_be_fired")),
        ("orders settings", SettingsChanged("orders")),  # qm.queues' and qm.tenant_settings' triggers
    ],
)
def test_every_shape_parses_into_its_own_value(payload: str, notice: Notice) -> None:
    assert parse(payload) == notice


@pytest.mark.parametrize(
    "payload",
    [
        "",
        " due 1",  # no queue name
        "orders ",  # a trailing space: an empty word
        "orders due soon",
        "orders due 1 2",
        "orders due 1.5",
        "orders at " + "9" * 400,  # an integer, but too large for a float
        "orders settled x 1 0 acked",
        "orders settled 1 1",
        "orders settled 1 1 0",
        "orders settled 1 1 0 ",
        "orders settled 1 1 0 acked extra",
        "orders settings now",
        "orders paused",
        "orders  due 1",
    ],
)
def test_a_malformed_payload_raises_an_error_that_names_it(payload: str) -> None:
    with pytest.raises(MalformedNotice, match="malformed qm_wake notice") as e:
        parse(payload)
    assert repr(payload[:200]) in str(e.value)


def _payload(n: Notice) -> str:
    """The text each sender writes for ``n``."""
    if isinstance(n, Poke):
        return n.queue
    if isinstance(n, Due | Scheduled):
        kind = "due" if isinstance(n, Due) else "at"
        return f"{n.queue} {kind}" if n.since is None else f"{n.queue} {kind} {round(n.since * 1e6)}"
    if isinstance(n, Settled):
        return f"{n.queue} settled {n.id} {n.attempt} {n.partition} {n.state}"
    return f"{n.queue} settings"


_queues = st.from_regex(r"[a-z][a-z0-9_]{0,39}", fullmatch=True)
_times = st.none() | st.integers(min_value=0, max_value=4_102_444_800_000_000).map(lambda us: us / 1e6)
_words = st.from_regex(r"[a-z_]{1,12}", fullmatch=True)
_notices = st.one_of(
    st.builds(Poke, _queues),
    st.builds(Due, _queues, _times),
    st.builds(Scheduled, _queues, _times),
    st.builds(Settled, _queues, st.integers(1, 2**63 - 1), st.integers(0, 2**31 - 1), st.integers(0, 2047), _words),
    st.builds(SettingsChanged, _queues),
)


@given(_notices)
def test_what_a_sender_writes_parses_back_to_the_same_notice(n: Notice) -> None:
    assert parse(_payload(n)) == n


@given(st.text(st.characters(codec="utf-8"), max_size=80) | st.lists(_words | st.integers().map(str)).map(" ".join))
def test_any_payload_parses_or_raises_a_malformed_notice(payload: str) -> None:
    try:
        n = parse(payload)
    except MalformedNotice as e:
        assert "malformed qm_wake notice" in str(e)
    else:
        assert n.queue == payload.split(" ", 1)[0] != ""


def test_the_listener_logs_a_malformed_notice_and_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[tuple[Any, ...]] = []
    lst = Listener(
        conn=None,  # type: ignore[arg-type]  # handle() does no I/O
        on_wake=lambda q, due, since, t: calls.append(("wake", q, due, since)),
        on_settled=lambda *a: calls.append(("settled", *a)),
        on_unknown=lambda: calls.append(("unknown",)),
        on_settings=lambda: calls.append(("settings",)),
        known={"orders"}.__contains__,
        loop_time=lambda: 0.0,
    )
    with caplog.at_level(logging.WARNING, logger="queue_manager.manager.wakeups"):
        lst.handle("orders due " + "9" * 400)
        lst.handle("newqueue due soon")  # malformed: not taken for a queue to load
        lst.handle("orders at 2000000")
    assert calls == [("wake", "orders", False, 2.0)]
    assert [r.getMessage() for r in caplog.records] == ["malformed notice", "malformed notice"]
    assert all(getattr(r, "action", None) == "listen" for r in caplog.records)
