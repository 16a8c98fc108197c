"""Time, injected: the local monotonic and wall clocks, and the database's clock as estimated.

Logic never reads ``time`` itself: it takes a :class:`Clock` (or a ``now`` argument), so tests pin
time with :class:`FakeClock`. Deadlines inside one process use :meth:`Clock.monotonic` (the same
base as the asyncio loop's ``loop.time()``); anything compared with database timestamps, such as
an event's ``fire_at``, uses :class:`DatabaseClock`, because "never early" is judged by the
database's clock, not ours.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """The two local clocks."""

    def monotonic(self) -> float:
        """Seconds on a clock that never jumps (the asyncio loop's clock)."""
        ...

    def wall(self) -> float:
        """Epoch seconds, as the operating system tells them."""
        ...


class SystemClock:
    """The real clocks."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


class FakeClock:
    """A clock that moves only when told to (``advance``), for tests."""

    def __init__(self, monotonic: float = 1_000.0, wall: float = 1_750_000_000.0) -> None:
        self._mono = monotonic
        self._wall = wall

    def monotonic(self) -> float:
        return self._mono

    def wall(self) -> float:
        return self._wall

    def advance(self, seconds: float) -> None:
        self._mono += seconds
        self._wall += seconds


class DatabaseClock:
    """The database's clock, estimated as the local wall clock plus a measured skew.

    Each observation is a database timestamp read between two local wall-clock readings; the
    measurement with the smallest round trip wins, and an old tight measurement slowly loses its
    weight so that drift is followed.
    """

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        #: database clock - local wall clock, seconds
        self.skew = 0.0
        self._rtt = float("inf")

    def now(self) -> float:
        """The database's current epoch seconds, as estimated."""
        return self.clock.wall() + self.skew

    def observe(self, db_time: float, sent_at: float, received_at: float) -> None:
        """A database timestamp read between two local wall readings ``sent_at`` and ``received_at``."""
        rtt = received_at - sent_at
        if rtt <= self._rtt * 1.5 or rtt < 0.002:
            self.skew = db_time - (sent_at + received_at) / 2
            self._rtt = rtt
        else:
            self._rtt *= 1.1

    def lean_later(self, seconds: float) -> None:
        """We fired a hair before the database's clock allowed: estimate it a little later."""
        self.skew -= seconds
