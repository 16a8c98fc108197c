"""The readings' cache: one reading of every shard shared by every request (the health page's;
the overview's is the monitor's, monitor.py), taken in the background so that no page waits."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class Shared:
    """One reading shared by every request. It is taken again only after ``ttl`` seconds and after
    ``1 / share`` times as long as the last reading took, in a thread of its own while requests
    go on being served the previous one (only the very first reading makes a request wait): however
    many tabs are open and however large the tables, the readings keep the database busy at most
    ``share`` of the time, and no page waits for them."""

    def __init__(self, ttl: float, read: Callable[[], dict[str, Any]], share: float = 0.02) -> None:
        self.ttl = ttl
        self.share = share
        self._read = read
        self._first = threading.Lock()
        self._lock = threading.Lock()
        self._value: dict[str, Any] | None = None
        self._at = float("-inf")
        self._took = 0.0
        self._busy = False

    def _take(self) -> None:
        started = time.monotonic()
        try:
            value = self._read()
        finally:
            took = time.monotonic() - started
            with self._lock:
                self._at, self._took = time.monotonic(), took
        value["reading"] = {"at": time.time(), "took": took}
        with self._lock:
            self._value = value

    def _background(self) -> None:
        try:
            self._take()
        except Exception:  # the previous reading stays; the next request tries again after the wait
            logger.exception("the dashboard's shared reading failed", extra={"action": "web_reading_failed"})
        finally:
            with self._lock:
                self._busy = False

    def get(self) -> dict[str, Any]:
        """The reading, with ``reading``: when it was taken (epoch seconds) and how long it took."""
        if self._value is None:
            with self._first:
                if self._value is None:
                    self._take()
        with self._lock:
            due = time.monotonic() - self._at >= max(self.ttl, self._took / self.share)
            if due and not self._busy:
                self._busy = True
                threading.Thread(target=self._background, name="qm-web-reading", daemon=True).start()
            assert self._value is not None
            return self._value
