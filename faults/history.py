"""The history of a fault run: one JSON object per line, one file per process, merged by time.

Every record has ``t`` (seconds since the epoch, float) and ``kind``. **One clock**: ``t`` is the
host's real-time clock (``time.time()``) in every process of the run. The database servers of the
run are on the same host and PostgreSQL's ``now()`` and ``clock_timestamp()`` read that same
clock, so a record's ``t`` compares directly with an event's ``fire_at`` (which the product
defines by the database clock: "never early" is a statement about that clock). A monotonic clock
would be immune to clock steps but would need a translation to be compared with ``fire_at``, and
the run steps no clock. Events are named by a key ``k`` the producer puts into the payload, so
that an insert that rolled back (and has no id) or a row of a COPY batch is tracked like any other.

Kinds (fields besides ``t`` and ``kind``):

``enqueued``  k, tenant, shard, via, outcome (commit | rollback | unknown | skipped), fire_at
              (epoch seconds, or null for "now"), and in the key scenarios ckey and rkey (the
              event's concurrency_key and rate_key): written once the transaction's outcome is
              known; ``t`` is when the commit (or rollback) returned. ``unknown``: the connection
              died during COMMIT. ``skipped``: a duplicate dedup key, no row inserted.
``deliver``   r (receiver), shard, term (of the connection's manager), id, attempt, k, tenant, fire_at
``ack``       r, shard, id, attempt, k, via (socket | sql), outcome (ok | refused | rollback | unknown):
              ``ok`` is a confirmed ack (the manager's ``ack_result``, or the SQL transaction's COMMIT
              returned with one row updated)
``nack`` / ``extend``  r, shard, id, attempt, k, outcome
``receiver``  r, state (up | down), tenants (null: all): a receiver process started, resumed,
              was killed, paused or stopped
``nemesis``   round, name, phase (start | heal), shards, and what the nemesis measured (``promote_s``:
              the primary stopped, its standby promoted and the address repointed; a lossy link's
              ``chunks``, ``lost`` and ``resets``)
``standby``   shard, rebuilt_s: a new synchronous standby copied from the promoted primary
``term``      shard, term: a new leadership term observed on the shard
``final``     k, shard, state: the event's state read from the database at the end of the run
``state``     k, shard, tenant, ckey, rkey, attempt, old, new: in the key scenarios, a change of an
              event's state (``deleted`` for a delete of a fired event), as a trigger of the suite
              recorded it in the shard's database during the run (``t``: its clock_timestamp(),
              the same host clock), read at the end
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

Record = dict[str, Any]


def now() -> float:
    """The run's one clock (see the module's docstring)."""
    return time.time()


class HistoryWriter:
    """Appends records to one file, a line each, flushed at once (a killed process loses nothing
    it wrote before the kill)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: TextIO = path.open("a", encoding="utf-8")

    def write(self, kind: str, **fields: Any) -> None:
        fields.setdefault("t", now())
        self._file.write(json.dumps({"kind": kind, **fields}, separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read(paths: Iterable[Path]) -> list[Record]:
    """Every record of these files, ordered by time. A last line cut short by a kill is skipped."""
    out: list[Record] = []
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and "t" in rec and "kind" in rec:
                out.append(rec)
    out.sort(key=lambda r: float(r["t"]))
    return out


def files_in(directory: Path) -> Iterator[Path]:
    return (directory / name for name in sorted(os.listdir(directory)) if name.endswith(".jsonl"))
