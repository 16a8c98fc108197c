"""Keyset paging across shards, pure: each shard's newest-first page merged into one page.

Event ids are per shard, so an event is (shard, id) and a cursor holds one position per shard.
Each shard returns up to ``limit`` rows below its position from a capped look at its newest rows.
The merge takes the rows of every shard newest first (by ``created_at``) until the page is full:
a shard whose look found nothing, or fewer rows than it looked for, never holds back another
shard's rows. Each shard's rows taken are a prefix of its page, so the next cursor continues,
for every shard, from where this page stopped for it: after its last row shown, or from where
its look stopped when every row it found was shown (no event shown twice, none skipped).

Within a page the rows are newest first; each shard's rows are newest first across the pages.
Between shards the order across pages is approximate: a later page may show an event of a shard
whose look had to go further back that is newer than one of another shard already shown (the
price of never holding a shard's matches back behind another's empty look).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any


@dataclass
class ShardPage:
    """What one shard returned for one page."""

    #: rows newest first (each has ``id`` and ``created_at``)
    rows: list[dict[str, Any]] = field(default_factory=list)
    #: True when the shard has no matching row below the last one returned
    complete: bool = True
    #: where to continue when every row was taken and the page is not complete (the look's floor)
    floor: int | None = None


@dataclass
class MergedPage:
    """One page of the event browser."""

    #: (shard, row), newest first
    rows: list[tuple[str, dict[str, Any]]]
    #: the next page's cursor (shard -> list ids below this; None: the shard is done; 0: from newest)
    cursor: dict[str, int | None]
    #: True when some shard still has rows to look at
    more: bool
    #: True when some shard's look hit its cap (the page may hold fewer rows than there are)
    capped: bool


def _key(row: Mapping[str, Any]) -> tuple[datetime, int]:
    return (row["created_at"], row["id"])


def merge(cursor: Mapping[str, int | None], pages: Mapping[str, ShardPage], limit: int) -> MergedPage:
    """Merge the pages of the shards still open in ``cursor`` into one page of at most ``limit``."""
    heads = dict.fromkeys(pages, 0)
    taken: list[tuple[str, dict[str, Any]]] = []
    while len(taken) < limit:
        open_ = [s for s, p in pages.items() if heads[s] < len(p.rows)]
        if not open_:
            break
        best = max(open_, key=lambda s: _key(pages[s].rows[heads[s]]))
        taken.append((best, pages[best].rows[heads[best]]))
        heads[best] += 1
    out: dict[str, int | None] = {}
    for name, position in cursor.items():
        page = pages.get(name)
        if page is None:
            out[name] = position
        elif heads[name] < len(page.rows):
            out[name] = page.rows[heads[name] - 1]["id"] if heads[name] else position
        elif page.complete:
            out[name] = None
        else:
            out[name] = page.floor if page.floor is not None else (page.rows[-1]["id"] if page.rows else None)
    capped = any(not p.complete and len(p.rows) < limit for p in pages.values())
    return MergedPage(taken, out, any(v is not None for v in out.values()), capped)
