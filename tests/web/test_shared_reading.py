"""The dashboard's shared reading (app.Shared): one reading for every request, taken again in the
background only after its wait, so no page waits for it but the very first."""

from __future__ import annotations

import threading
import time
from typing import Any

from queue_manager.web.cache import Shared


def test_a_stale_reading_is_served_while_the_next_one_is_taken() -> None:
    calls: list[int] = []
    release = threading.Event()

    def read() -> dict[str, Any]:
        calls.append(1)
        if len(calls) == 2:
            assert release.wait(10)
        return {"n": len(calls)}

    shared = Shared(ttl=0.0, read=read, share=1.0)
    assert shared.get()["n"] == 1  # the first reading: the request waits for it
    assert shared.get()["n"] == 1  # due again: served at once, the next reading runs meanwhile
    deadline = time.monotonic() + 10
    while len(calls) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert shared.get()["n"] == 1 and len(calls) == 2  # one reading at a time
    release.set()
    while shared.get()["n"] != 2:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert shared.get()["reading"]["took"] >= 0


def test_a_slow_reading_waits_longer_before_the_next() -> None:
    calls: list[float] = []

    def read() -> dict[str, Any]:
        calls.append(time.monotonic())
        return {}

    shared = Shared(ttl=3600.0, read=read, share=0.02)
    shared.get()
    shared.get()
    assert len(calls) == 1  # within the wait: no new reading


def test_a_failed_background_reading_keeps_the_last_one() -> None:
    calls: list[int] = []
    done = threading.Event()

    def read() -> dict[str, Any]:
        calls.append(1)
        if len(calls) == 2:
            done.set()
            raise RuntimeError("shard unreachable")
        return {"n": len(calls)}

    shared = Shared(ttl=0.0, read=read, share=1.0)
    assert shared.get()["n"] == 1
    assert shared.get()["n"] == 1
    assert done.wait(10)
    assert shared.get()["n"] in (1, 3)
