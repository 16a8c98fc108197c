"""The overview's live reading, kept fresh by one thread of the web process and pushed to the
open pages.

A reading (``data.live`` and the managers' ``/health``) is cheap and does not grow with the
tables, so it is simply taken again:

- at most once per ``refresh`` seconds after a notification on ``qm_wake`` from any shard (a
  listener thread per shard: inserts a waiting manager is told of, retries, reschedules, settles
  by SQL, settings and pauses), while someone watches (a page or a live stream served in the
  last ``watch_seconds``);
- every ``idle`` seconds whatever happens: the changes no notification announces (a manager's
  own fires and acks, inserts while it is busy) show within that time, and the history gets its
  samples while nobody watches.

Every reading goes into the :class:`~queue_manager.web.readings.History` of the charts and
rates. Pages are served the latest reading and never wait for one (only the very first).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from queue_manager.errors import QueueManagerError
from queue_manager.web.readings import History

logger = logging.getLogger(__name__)

#: a listener: run until the event is set, calling the function at every notification (and after
#: each connection: notifications sent while it was away are lost)
Listener = Callable[[threading.Event, Callable[[], None]], None]


class Monitor:
    """The latest reading, a version number that moves with each one, and the history."""

    def __init__(
        self,
        read: Callable[[], dict[str, Any]],
        listeners: Sequence[Listener] = (),
        *,
        history: History | None = None,
        refresh: float = 1.0,
        idle: float = 5.0,
        watch_seconds: float = 60.0,
    ) -> None:
        self._read = read
        self._listeners = listeners
        self.history = history if history is not None else History()
        self.refresh = refresh
        self.idle = idle
        self.watch_seconds = watch_seconds
        self._cond = threading.Condition()
        self._value: dict[str, Any] | None = None
        self.version = 0
        self.notices = 0
        self._noticed = False
        self._watched_until = 0.0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _start(self) -> None:
        """Start the reading and listener threads (at the first use; the caller holds the lock)."""
        if self._threads or self._stop.is_set():
            return
        self._threads.append(threading.Thread(target=self._run, name="qm-web-monitor", daemon=True))
        for i, listen in enumerate(self._listeners):
            self._threads.append(
                threading.Thread(target=listen, args=(self._stop, self._heard), name=f"qm-web-listen-{i}", daemon=True)
            )
        for t in self._threads:
            t.start()

    def _heard(self) -> None:
        with self._cond:
            self.notices += 1
            self._noticed = True
            self._cond.notify_all()

    def watch(self) -> None:
        """Someone looks: notifications bring readings for the next ``watch_seconds``."""
        with self._cond:
            self._watched_until = time.monotonic() + self.watch_seconds
            if self._noticed:
                self._cond.notify_all()

    def get(self, timeout: float = 30.0) -> dict[str, Any]:
        """The latest reading (``reading``: when it was taken, epoch seconds, and how long it took),
        waiting for the first one. Marks the dashboard watched."""
        self.watch()
        with self._cond:
            self._start()
            if self._value is None:
                self._cond.wait_for(lambda: self._value is not None or self._stop.is_set(), timeout)
            if self._value is None:
                raise QueueManagerError(
                    "the dashboard's first reading of the shards is not there yet: reload in a moment"
                )
            return self._value

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            with self._cond:
                self._noticed = False
            try:
                value = self._read()
                at = time.time()
                value["reading"] = {"at": at, "took": time.monotonic() - started}
                self.history.add(at, value)
                with self._cond:
                    self._value = value
                    self.version += 1
                    self._cond.notify_all()
            except Exception:  # the previous reading stays; the next one is tried after the wait
                logger.exception("the dashboard's reading failed", extra={"action": "web_reading_failed"})
            with self._cond:
                self._cond.wait_for(partial(self._due, started), self.idle)
                # a notice's reading waits until refresh seconds after the last one began
                while not self._stop.is_set() and time.monotonic() < started + self.refresh:
                    self._cond.wait(started + self.refresh - time.monotonic())

    def _due(self, started: float) -> bool:
        if self._stop.is_set():
            return True
        now = time.monotonic()
        return now >= started + self.idle or (self._noticed and now < self._watched_until)

    def close(self) -> None:
        """Stop the threads (each within a few seconds)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout=10)
