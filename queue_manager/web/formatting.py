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
    changes = {k: v for k, v in detail.items() if k != "tenant"}
    settings = ", ".join(f"{k} {'none' if v is None else v}" for k, v in changes.items())
    if action.action == "tenant_set":
        return f"{queue}: tenant {detail.get('tenant')}: {settings or 'unchanged'} (on its shard)"
    if action.action == "tenant_unset":
        what = "removed" if action.affected else "none to remove"
        return f"{queue}: tenant {detail.get('tenant')}: overrides {what} (weight 1, the queue's default cap)"
    return f"{queue}: {settings} {everywhere}"


def clock(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%H:%M:%S UTC")


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


#: the Jinja filters of the pages
FILTERS: dict[str, Callable[..., Any]] = {"age": age, "clock": clock}
