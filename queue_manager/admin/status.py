"""Status of the queues across the shards of a topology, as plain data (``qm status --json``) and as
text (``qm status``): counts by state, depth per partition, the oldest due event, each shard's
database health and maintenance slices. Reads only: an operator action is in
:mod:`queue_manager.admin.actions`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from queue_manager.db.health import read_health
from queue_manager.db.sqlfiles import query
from queue_manager.domain import health
from queue_manager.domain.eventfilter import STATES
from queue_manager.domain.health import Thresholds, format_bytes
from queue_manager.domain.topology import Shard, Topology

#: ``qm status`` lists this many concurrency keys by events in hand, from at most KEYS_READ_CAP fired events
TOP_KEYS = 10
KEYS_READ_CAP = 100_000


@dataclass
class QueueStatus:
    """Length and health of one queue on one shard."""

    queue: str
    #: partitions written to (N)
    partitions: int
    #: partitions that may still hold events (> partitions while a shrink drains)
    partitions_physical: int
    shuffle: int
    paused: bool
    #: events by state
    counts: dict[str, int] = field(default_factory=dict)
    #: live events (to_be_fired + fired) per partition, index = partition
    depth: list[int] = field(default_factory=list)
    #: to_be_fired events whose fire_at has passed
    due_now: int = 0
    #: age of the oldest due event (seconds), None when nothing is due
    oldest_due_age_seconds: float | None = None
    #: live events still in partitions being dropped; the shrink completes when this is 0
    draining: int = 0
    #: the concurrency keys with the most events in hand: tenant, key, in_hand, max_in_flight
    top_keys: list[dict[str, Any]] = field(default_factory=list)
    #: concurrency keys whose events in hand reached their limit
    keys_at_limit: int = 0

    @property
    def length(self) -> int:
        """Live events: to_be_fired + fired, summed over partitions (the seed's Len)."""
        return sum(self.depth)


def shard_status(shard: Shard) -> list[QueueStatus]:
    """Status of every queue on one shard (completing any shrink whose partitions drained)."""
    out = []
    with psycopg.connect(shard.dsn, autocommit=True) as conn:
        queues = conn.execute(query("list_queues")).fetchall()
        for q in queues:
            name, n, physical, k = q[0], q[1], q[2], q[3]
            paused = q[15]
            if physical > n:
                remaining = conn.execute(query("finish_resize"), {"queue": name}).fetchone()
                if remaining is not None and remaining[0] == 0:
                    physical = n
            st = QueueStatus(name, n, physical, k, paused, counts=dict.fromkeys(STATES, 0))
            depth = [0] * max(physical, n)
            table = sql.Identifier(name)
            for part, state, cnt in conn.execute(sql.SQL(query("queue_state_counts")).format(queue=table)):
                st.counts[state] = st.counts.get(state, 0) + cnt
                if state in ("to_be_fired", "fired"):
                    if part >= len(depth):
                        depth.extend([0] * (part + 1 - len(depth)))
                    depth[part] += cnt
            st.depth = depth
            st.draining = sum(depth[n:])
            age, due = conn.execute(sql.SQL(query("queue_oldest_due")).format(queue=table)).fetchone() or (None, 0)
            st.oldest_due_age_seconds, st.due_now = age, due
            keys = conn.execute(
                sql.SQL(query("queue_keys_in_hand")).format(queue=table),
                {"queue": name, "cap": KEYS_READ_CAP, "top": TOP_KEYS},
            ).fetchall()
            st.top_keys = [{"tenant": t, "key": k, "in_hand": n, "max_in_flight": cap} for t, k, n, cap, _ in keys]
            st.keys_at_limit = int(keys[0][4]) if keys else 0
            out.append(st)
    return out


def maintenance_counts(shard: Shard) -> dict[str, dict[str, int]]:
    """The maintenance slices of every manager of the shard together, per job: recruited, finished,
    aborted, and the events they handled (deleted by retention, corrected by reconciliation, moved
    by the collector). Counted since the shard's revision 0009; docs/manager.md, "Maintenance slices"."""
    with psycopg.connect(shard.dsn, autocommit=True) as conn:
        rows = conn.execute(query("maintenance_counts")).fetchall()
    return {
        str(job): {"recruited": int(r), "finished": int(f), "aborted": int(a), "events": int(e)}
        for job, r, f, a, e in rows
    }


def render_maintenance(entry: dict[str, Any]) -> list[str]:
    """``qm status`` lines for a shard's maintenance counts (none when the entry has none)."""
    counts = entry.get("maintenance")
    if not counts:
        return []
    lines = ["  maintenance slices (all managers):"]
    for job, c in counts.items():
        lines.append(
            f"    {job:<15} recruited {c['recruited']}  finished {c['finished']}  aborted {c['aborted']}"
            f"  events {c['events']}"
        )
    return lines


def status(topology: Topology, thresholds: Thresholds | None = None, *, queue: str | None = None) -> dict[str, Any]:
    """Status of every queue (or only ``queue``) on every shard, as plain data (what ``qm status --json`` prints).

    Each shard also gets its database health (``xmin_horizon``: the oldest holder of the xmin
    horizon; ``health``: NOTIFY queue usage, replication slots holding xmin, and per queue table its
    tuples, vacuum ages, sizes and index bloat estimate) and ``warnings``: a line for each reading
    past its threshold (``queue_manager.domain.health``; docs/operations.md, "Database health").
    """
    shards = []
    for shard in topology.shards:
        entry: dict[str, Any] = {"shard": shard.name, "range": str(shard.key_range)}
        try:
            qs = shard_status(shard)
            with psycopg.connect(shard.dsn, autocommit=True) as conn:
                reading = read_health(conn)
            entry["maintenance"] = maintenance_counts(shard)
        except psycopg.OperationalError as exc:
            entry["error"] = f"unreachable: {exc}".strip()
            shards.append(entry)
            continue
        entry["queues"] = [{**asdict(s), "length": s.length} for s in qs if queue is None or s.queue == queue]
        entry["xmin_horizon"] = None if reading.horizon is None else asdict(reading.horizon)
        entry["health"] = health.as_data(reading)
        entry["warnings"] = health.warnings(reading, thresholds)
        shards.append(entry)
    return {"shards": shards}


def render_status(data: dict[str, Any]) -> str:
    """Human-readable form of ``admin.status``."""
    lines = []
    for shard in data["shards"]:
        lines.append(f"shard {shard['shard']} ({shard['range']})")
        if "error" in shard:
            lines.append(f"  {shard['error']}")
            continue
        horizon = shard.get("xmin_horizon")
        if horizon is not None:
            age = horizon.get("age_seconds")
            lines.append(
                f"  oldest xmin: {horizon['kind']} {horizon['holder']!r} pid {horizon['pid']} "
                f"{horizon['state'] or ''} age {'-' if age is None else f'{age:.1f}s'} ({horizon['xid_age']} xids)"
            )
        h = shard.get("health")
        if h is not None:
            lines.append(f"  notify queue: {h['notify_queue_usage']:.1%} used")
            for slot in h["slots"]:
                lines.append(
                    f"  slot {slot['name']!r} ({slot['kind']}, {'active' if slot['active'] else 'inactive'}) "
                    f"holds xmin back {slot['xid_age']} xids"
                )
        for warning in shard.get("warnings", []):
            lines.append(f"  WARNING: {warning}")
        lines.extend(render_maintenance(shard))
        tables = {t["queue"]: t for t in (h or {}).get("tables", [])}
        if not shard["queues"]:
            lines.append("  no queues")
        for q in shard["queues"]:
            c = q["counts"]
            age = q["oldest_due_age_seconds"]
            lines.append(
                f"  {q['queue']}: length {q['length']}  to_be_fired {c['to_be_fired']}  fired {c['fired']}  "
                f"acked {c['acked']}  cancelled {c['cancelled']}  failed {c['failed']}  due {q['due_now']}"
                f"  oldest due {'-' if age is None else f'{age:.1f}s'}{'  PAUSED' if q['paused'] else ''}"
            )
            lines.append(f"    depth by partition: {q['depth']}")
            if q.get("top_keys"):
                keys = ", ".join(
                    f"{k['tenant']}/{k['key']} {k['in_hand']}"
                    + ("" if k["max_in_flight"] is None else f"/{k['max_in_flight']}")
                    for k in q["top_keys"]
                )
                lines.append(f"    keys in hand: {keys}; {q['keys_at_limit']} at their limit")
            table = tables.get(q["queue"])
            if table is not None:
                lines.extend(f"    {line}" for line in _render_table(table))
            if q["partitions_physical"] > q["partitions"]:
                lines.append(
                    f"    shrinking {q['partitions_physical']} -> {q['partitions']}: "
                    f"{q['draining']} live events left in partitions {q['partitions']}..{q['partitions_physical'] - 1}"
                )
    return "\n".join(lines)


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def _render_table(t: dict[str, Any]) -> list[str]:
    bloat = t["index_bloat_bytes"]
    return [
        f"table: {format_bytes(t['table_bytes'])}, indexes {format_bytes(t['index_bytes'])} "
        f"(bloat estimate {format_bytes(bloat) if bloat is not None else 'not yet known'}); "
        f"tuples live {t['live_tuples']} dead {t['dead_tuples']} (autovacuum at {t['autovacuum_trigger']})",
        f"vacuum: last {_ago(t['vacuum_age_seconds'])}, autovacuum {_ago(t['autovacuum_age_seconds'])} "
        f"({t['autovacuum_count']} runs), autoanalyze {_ago(t['autoanalyze_age_seconds'])}",
    ]
