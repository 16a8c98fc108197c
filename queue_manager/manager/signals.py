"""Test signals: what tests wait for instead of sleeping ("scanned", "fired", "swept", ...).

A :class:`TestSignal` does nothing until a test calls :meth:`TestSignal.init`; then every
:meth:`TestSignal.emit` is queued, and the test awaits :meth:`TestSignal.wait`. River's habit.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, fields
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class TestSignal(Generic[T]):
    """A no-op in production; a queue of emitted values once initialised."""

    __test__ = False  # not a pytest test class, despite its name

    def __init__(self) -> None:
        self._queue: asyncio.Queue[T] | None = None

    def init(self) -> None:
        self._queue = asyncio.Queue()

    def emit(self, value: T) -> None:
        if self._queue is not None:
            self._queue.put_nowait(value)

    async def wait(self, timeout: float = 5.0) -> T:
        """The next emitted value; AssertionError after ``timeout`` seconds."""
        if self._queue is None:
            raise RuntimeError("call init() before waiting on a test signal")
        try:
            async with asyncio.timeout(timeout):
                return await self._queue.get()
        except TimeoutError:
            raise AssertionError(f"no signal within {timeout}s") from None

    async def wait_for(self, predicate: Any, timeout: float = 5.0) -> T:
        """The next emitted value for which ``predicate(value)`` holds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            value = await self.wait(max(0.0, deadline - loop.time()))
            if predicate(value):
                return value

    def clear(self) -> None:
        """Forget what was emitted so far."""
        if self._queue is not None:
            while not self._queue.empty():
                self._queue.get_nowait()


@dataclass
class ManagerSignals:
    """The manager's test signals; each carries the queue name (or the term) it is about."""

    #: a session of this term started (leadership taken)
    session_started: TestSignal[int] = field(default_factory=TestSignal)
    #: a scan of this queue's window finished: (queue, the partitions it covered, None for all)
    scanned: TestSignal[tuple[str, tuple[int, ...] | None]] = field(default_factory=TestSignal)
    #: the queue settings were (re)loaded
    reloaded: TestSignal[None] = field(default_factory=TestSignal)
    #: a standby tried to take the lease: the term it got, or None
    lease_tried: TestSignal[int | None] = field(default_factory=TestSignal)
    #: a fire statement committed for this queue (with or without rows)
    fired: TestSignal[str] = field(default_factory=TestSignal)
    #: the dispatcher found nothing to do and went to sleep
    idle: TestSignal[None] = field(default_factory=TestSignal)
    #: a run of the old-event collector finished
    swept: TestSignal[int] = field(default_factory=TestSignal)
    #: a baseline pass of the retention purge finished (events deleted)
    purged: TestSignal[int] = field(default_factory=TestSignal)
    #: a baseline pass of the load reconciliation finished (drift found)
    reconciled: TestSignal[int] = field(default_factory=TestSignal)
    #: a database health reading was taken (its warnings)
    health_read: TestSignal[list[str]] = field(default_factory=TestSignal)
    #: the leader vacuumed this queue's table (autovacuum was late)
    vacuumed: TestSignal[str] = field(default_factory=TestSignal)
    #: a maintenance slice ended (a queue_manager.manager.slices.SliceResult)
    sliced: TestSignal[Any] = field(default_factory=TestSignal)
    #: this queue's wake-up lock was taken
    armed: TestSignal[str] = field(default_factory=TestSignal)

    def init(self) -> None:
        for f in fields(self):
            getattr(self, f.name).init()
