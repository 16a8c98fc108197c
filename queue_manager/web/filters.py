"""The event browser's keyset cursors; the filters themselves are
:mod:`queue_manager.domain.eventfilter` (the operator actions select events by them too).

Pure: a cursor string in, a position per shard out, or a :class:`FilterError`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from queue_manager.domain.eventfilter import (
    STATES,
    EventFilter,
    FilterError,
    PayloadFilter,
    parse_filter,
    parse_payload_filter,
    parse_time,
)

__all__ = [
    "STATES",
    "EventFilter",
    "FilterError",
    "PayloadFilter",
    "format_cursor",
    "format_ids",
    "parse_cursor",
    "parse_filter",
    "parse_ids",
    "parse_payload_filter",
    "parse_time",
]


# -------------------------------------------------------------------------------- cursors


def parse_cursor(raw: str | None, shards: tuple[str, ...]) -> dict[str, int | None]:
    """A keyset cursor ``s0:1234,s1:-`` (per shard: list ids below this one; ``-``: that shard is
    done) as a dict; no cursor = every shard from its newest event. FilterError when malformed."""
    if not raw:
        return {name: 0 for name in shards}
    out: dict[str, int | None] = {}
    for part in raw.split(","):
        name, sep, value = part.partition(":")
        if not sep or name not in shards or name in out or not (value == "-" or re.fullmatch(r"[0-9]{1,18}", value)):
            raise FilterError(f"cursor: {raw[:80]!r} is malformed; go back to the first page")
        out[name] = None if value == "-" else int(value)
    return out


def format_cursor(cursor: Mapping[str, int | None]) -> str:
    """The inverse of :func:`parse_cursor` (0: from the newest event)."""
    return ",".join(f"{name}:{'-' if v is None else v}" for name, v in cursor.items())


# -------------------------------------------------------------------------------- bound ids


def format_ids(ids: Mapping[str, list[int]]) -> str:
    """Event ids per shard as the confirmation form carries them: ``s0:12-10,7;s1:3`` (runs of
    consecutive ids as ranges, so that a confirmation of 10 000 dead letters stays a short field)."""
    parts = []
    for name, values in ids.items():
        runs: list[str] = []
        ordered = sorted(set(values), reverse=True)
        i = 0
        while i < len(ordered):
            j = i
            while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] - 1:
                j += 1
            runs.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
            i = j + 1
        if runs:
            parts.append(f"{name}:{','.join(runs)}")
    return ";".join(parts)


def parse_ids(raw: str, shards: tuple[str, ...], cap: int) -> dict[str, list[int]]:
    """The inverse of :func:`format_ids`, at most ``cap`` ids in all; FilterError when malformed."""
    out: dict[str, list[int]] = {}
    total = 0
    for part in raw.split(";") if raw else []:
        name, sep, runs = part.partition(":")
        if not sep or name not in shards or name in out or not runs:
            raise FilterError(f"bound events: {part[:40]!r} is not shard:ids; confirm from the confirmation page")
        ids: list[int] = []
        for run in runs.split(","):
            m = re.fullmatch(r"([0-9]{1,18})(?:-([0-9]{1,18}))?", run)
            if m is None or int(m.group(1)) < 1 or (m.group(2) is not None and int(m.group(2)) > int(m.group(1))):
                raise FilterError(f"bound events: {run[:40]!r} is not an id or a range high-low")
            high, low = int(m.group(1)), int(m.group(2) or m.group(1))
            total += high - low + 1
            if total > cap:
                raise FilterError(f"bound events: more than {cap}; confirm from the confirmation page")
            ids += range(high, low - 1, -1)
        out[name] = ids
    return out
