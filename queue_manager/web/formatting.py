"""How the dashboard's pages write numbers, times and what an action did (Jinja filters and
functions; pure)."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from queue_manager import admin


def told(action: admin.Action) -> str:
    """The notice of an action just taken, told from its audit (never from text in the URL)."""
    queue = action.queue or ""
    where = ", ".join(f"{s} {p.affected} of {p.requested}" for s, p in action.parts.items())
    if action.missing:
        where += "; not reached: " + ", ".join(action.missing)
    event_action = admin.ACTIONS.get(action.action)
    if event_action is not None:
        return (
            f"{event_action.verb}: {action.affected} {event_action.noun} of {queue} changed, "
            f"of {action.requested} bound ({where})"
        )
    try:
        detail = json.loads(action.detail)
    except ValueError:
        detail = {}
    everywhere = "on every shard" if action.finished else f"not on every shard ({where})"
    if action.action in ("pause", "resume"):
        return f"{queue} {'paused' if action.action == 'pause' else 'resumed'} {everywhere}"
    changes = {k: v for k, v in detail.items() if k not in ("tenant", "key")}
    settings = ", ".join(f"{k} {'none' if v is None else v}" for k, v in changes.items())
    if action.action == "tenant_set":
        return f"{queue}: tenant {detail.get('tenant')}: {settings or 'unchanged'} (on its shard)"
    if action.action == "tenant_unset":
        what = "removed" if action.affected else "none to remove"
        return f"{queue}: tenant {detail.get('tenant')}: overrides {what} (weight 1, the queue's default cap)"
    if action.action == "key_set":
        return (
            f"{queue}: tenant {detail.get('tenant')} key {detail.get('key')}: {settings or 'unchanged'} (on its shard)"
        )
    if action.action == "key_unset":
        what = "removed" if action.affected else "none to remove"
        return f"{queue}: tenant {detail.get('tenant')} key {detail.get('key')}: limits {what} (the queue's key limits)"
    return f"{queue}: {settings} {everywhere}"


def clock(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%H:%M:%S UTC")


def number(value: float, decimals: int = 1) -> str:
    """``value`` with at most ``decimals`` decimals, none when they are 0 (``1.5``, ``12``)."""
    text = f"{value:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _plural(value: float, unit: str) -> str:
    text = number(value)
    return f"{text} {unit}" if text == "1" else f"{text} {unit}s"


#: seconds in a (Julian) year, as the settings' years are counted (max_delay_seconds: 10 years)
YEAR = 365.25 * 86400


def duration(seconds: float | None) -> str:
    """A duration in the unit that reads best: ``250 ms`` (below a second, so a pickup delay of a
    few milliseconds shows as such), ``1.5 s``, ``12 s``, ``5 min``, ``2.5 h``, ``7 days``,
    ``10 years``; ``-`` when there is none."""
    if seconds is None:
        return "-"
    sign, s = ("-" if seconds < 0 else ""), abs(float(seconds))
    if round(s * 1000) < 1000:
        ms = s * 1000
        return f"{sign}{number(ms, 1 if ms < 10 else 0)} ms"
    if s < 60:
        return f"{sign}{number(s, 1 if s < 10 else 0)} s"
    if s < 3600:
        return f"{sign}{number(s / 60)} min"
    if s < 86400:
        return f"{sign}{number(s / 3600)} h"
    if s < YEAR:
        return sign + _plural(s / 86400, "day")
    return sign + _plural(s / YEAR, "year")


def size(n: float | None) -> str:
    """A size in bytes as PostgreSQL's ``pg_size_pretty`` writes it (1 kB = 1024 bytes): ``512 B``,
    ``64 kB``, ``1.5 MB``, ``2 GB``; ``-`` when there is none."""
    if n is None:
        return "-"
    for unit, scale in (("TB", 1 << 40), ("GB", 1 << 30), ("MB", 1 << 20), ("kB", 1 << 10)):
        if abs(n) >= scale:
            return f"{number(n / scale)} {unit}"
    return f"{number(n, 0)} B"


def yesno(value: object) -> str:
    return "yes" if value else "no"


def when(value: datetime | None) -> str:
    return "-" if value is None else value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def setting(key: str, value: Any) -> str:
    """A queue setting (a registry column) as an operator reads it: a duration for ``*_seconds``,
    a size for ``*_bytes``, yes/no, a time; ``none`` when it is not set."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return yesno(value)
    if isinstance(value, datetime):
        return when(value)
    if key.endswith("_seconds"):
        return duration(value)
    if key.endswith("_bytes"):
        return size(value)
    if isinstance(value, float):
        return number(value, 3)
    return str(value)


#: the Jinja filters of the pages
FILTERS: dict[str, Callable[..., Any]] = {
    "clock": clock,
    "duration": duration,
    "number": number,
    "size": size,
    "yesno": yesno,
    "when": when,
}
