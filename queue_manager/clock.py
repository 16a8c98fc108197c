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


#: how far (seconds) beyond what its round trip allows a reading must contradict the kept skew for
#: it to be taken as a step of a clock (see :meth:`DatabaseClock.observe`)
STEP_MARGIN = 0.05


class DatabaseClock:
    """The database's clock, estimated as the local wall clock plus a measured skew.

    Each observation is a database timestamp read between two local wall-clock readings; the
    measurement with the smallest round trip wins, and an old tight measurement slowly loses its
    weight so that drift is followed. A step of the local wall clock (NTP, an operator) is followed
    at the next reading: see :meth:`observe`.
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
        """A database timestamp read between two local wall readings ``sent_at`` and ``received_at``.

        A reading across a step of the wall clock says nothing: a step back makes its round trip
        negative and it is dropped (kept, it would set the skew halfway through the step, and its
        negative round trip would refuse every later reading of 2 ms or more); a step forward makes
        it long and it loses. After a step between two readings the kept skew is wrong by the step:
        the next reading whose window (the skew is within half its round trip of its midpoint)
        excludes the kept skew by more than STEP_MARGIN proves it and replaces it at once, however
        slow (waiting for a tight one left the estimate wrong by the step for dozens of readings).
        """
        rtt = received_at - sent_at
        if rtt < 0:
            return
        skew = db_time - (sent_at + received_at) / 2
        if rtt <= self._rtt * 1.5 or rtt < 0.002 or abs(skew - self.skew) > rtt / 2 + STEP_MARGIN:
            self.skew = skew
            self._rtt = rtt
        else:
            self._rtt *= 1.1

    def lean_later(self, seconds: float) -> None:
        """We fired a hair before the database's clock allowed: estimate it a little later."""
        self.skew -= seconds
