"""A small Prometheus text-format registry (counters, gauges, histograms), no dependency.

Only what the manager needs: labelled series, one registry per manager, rendered on
``GET /metrics`` in the text exposition format 0.0.4.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from queue_manager.domain.health import ShardHealth

_LabelKey = tuple[tuple[str, str], ...]
_Series = list[tuple[dict[str, str], float]]
_Read = Callable[[], _Series]


def _fmt_labels(labels: _LabelKey, extra: tuple[tuple[str, str], ...] = ()) -> str:
    items = labels + extra
    if not items:
        return ""
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in items)
    return "{" + body + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt_value(value: float) -> str:
    if math.isnan(value):  # int(nan) would raise and fail the whole /metrics page
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str) -> None:
        self.name = name
        self.help = help_text

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} {self.kind}"


class _Valued(_Metric):
    """A metric that stores one value per label set."""

    def __init__(self, name: str, help_text: str) -> None:
        super().__init__(name, help_text)
        self.values: dict[_LabelKey, float] = {}

    def get(self, **labels: str) -> float:
        return self.values.get(tuple(sorted(labels.items())), 0.0)


class Counter(_Valued):
    """A monotonically increasing value per label set."""

    kind = "counter"

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0.0) + amount

    def total(self) -> float:
        return sum(self.values.values())

    def render(self) -> Iterable[str]:
        yield from super().render()
        for key, value in sorted(self.values.items()):
            yield f"{self.name}{_fmt_labels(key)} {_fmt_value(value)}"


class Gauge(_Valued):
    """A value that goes up and down, set directly or read from a callback at render time."""

    kind = "gauge"

    def __init__(
        self, name: str, help_text: str, read: Callable[[], Iterable[tuple[dict[str, str], float]]] | None = None
    ) -> None:
        super().__init__(name, help_text)
        self._read = read

    def set(self, value: float, **labels: str) -> None:
        self.values[tuple(sorted(labels.items()))] = value

    def render(self) -> Iterable[str]:
        yield from super().render()
        values = dict(self.values)
        if self._read is not None:
            for labels, value in self._read():
                values[tuple(sorted(labels.items()))] = value
        for key, value in sorted(values.items()):
            yield f"{self.name}{_fmt_labels(key)} {_fmt_value(value)}"


class Histogram(_Metric):
    """Cumulative buckets, sum and count per label set."""

    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: Iterable[float]) -> None:
        super().__init__(name, help_text)
        self.bounds = sorted(buckets)
        self.series: dict[_LabelKey, list[float]] = {}  # bucket counts..., sum, count

    def observe(self, value: float, **labels: str) -> None:
        self.observe_many((value,), **labels)

    def observe_many(self, values: Iterable[float], **labels: str) -> None:
        """Observe several values of one label set (a fired or acked batch) in one call."""
        key = tuple(sorted(labels.items()))
        row = self.series.get(key)
        if row is None:
            row = self.series[key] = [0.0] * (len(self.bounds) + 2)
        # sorted once, each bucket's count is a bisection: no Python step per value (a fired
        # batch's or an ack's values, on the manager's path of every event)
        ordered = sorted(values)
        below = 0
        for i, bound in enumerate(self.bounds):
            upto = bisect.bisect_right(ordered, bound)  # the values <= bound
            row[i] += upto - below
            below = upto
        row[-2] += sum(ordered)
        row[-1] += len(ordered)

    def count(self, **labels: str) -> float:
        row = self.series.get(tuple(sorted(labels.items())))
        return row[-1] if row else 0.0

    def render(self) -> Iterable[str]:
        yield from super().render()
        for key, row in sorted(self.series.items()):
            running = 0.0
            for bound, n in zip(self.bounds, row, strict=False):
                running += n
                yield f"{self.name}_bucket{_fmt_labels(key, (('le', _fmt_value(bound)),))} {_fmt_value(running)}"
            yield f"{self.name}_bucket{_fmt_labels(key, (('le', '+Inf'),))} {_fmt_value(row[-1])}"
            yield f"{self.name}_sum{_fmt_labels(key)} {_fmt_value(row[-2])}"
            yield f"{self.name}_count{_fmt_labels(key)} {_fmt_value(row[-1])}"


class TenantDwell:
    """Per-tenant dwell time (fire_at -> push) of one queue over a sliding window, for the
    busiest tenants: bounded memory and bounded label cardinality.

    The window (``window`` seconds) is cut into ``slices``; each slice keeps, per tenant, the events
    pushed and a sparse log-scale histogram of their dwell (buckets 2^(1/8) apart: a quantile is
    known within 9 %); large batches are sampled (:meth:`observe`). At most ``max_tenants`` tenants
    are kept per slice; later ones count as "other". Rendering merges the slices, names the ``top``
    tenants by events in the window and puts every other tenant in the ``other`` series.
    """

    OTHER = "other"
    #: most events of one batch observed (the rest are represented by them)
    SAMPLE = 64
    #: smallest bucket bound (seconds) and the ratio between bounds
    LOW = 0.0001
    RATIO = 2 ** (1 / 8)

    __slots__ = ("max_tenants", "slice_len", "slices", "top", "window")

    def __init__(self, top: int = 10, window: float = 60.0, slices: int = 6, max_tenants: int = 10_000) -> None:
        self.top = top
        self.window = window
        self.slice_len = window / slices
        self.max_tenants = max_tenants
        #: (start, {tenant: [events, sum of dwell, {bucket: events}]}), oldest first
        self.slices: list[tuple[float, dict[str, list[Any]]]] = []

    def _current(self, now: float) -> dict[str, list[Any]]:
        if not self.slices or now >= self.slices[-1][0] + self.slice_len:
            self.slices.append((now, {}))
            self._expire(now)
        return self.slices[-1][1]

    def _expire(self, now: float) -> None:
        while self.slices and self.slices[0][0] + self.slice_len <= now - self.window:
            self.slices.pop(0)

    def observe(self, tenants: Sequence[str], delays: Sequence[float], now: float) -> None:
        """One fired batch: the tenants and dwell times (seconds) of its events; ``now`` monotonic.

        A batch of more than SAMPLE events is sampled: every k-th event counts k times (a drain's
        batches of 1 000 then cost the manager 64 observations, not 1 000; measured 0.39 us per
        observation). Batches of a quiet queue are counted whole."""
        cur = self._current(now)
        low, log_ratio, cap = self.LOW, math.log(self.RATIO), self.max_tenants
        log = math.log
        n = len(tenants)
        k = 1 if n <= self.SAMPLE else -(-n // self.SAMPLE)
        for i in range(0, n, k):
            tenant = tenants[i]
            d = delays[i]
            row = cur.get(tenant)
            if row is None:
                if len(cur) >= cap:
                    tenant = self.OTHER
                    row = cur.get(tenant)
                if row is None:
                    row = cur[tenant] = [0, 0.0, {}]
            row[0] += k
            row[1] += d * k
            b = 0 if d <= low else int(log(d / low) / log_ratio) + 1
            h = row[2]
            h[b] = h.get(b, 0) + k

    def summary(self, now: float) -> list[tuple[str, int, float | None, float | None]]:
        """(tenant or "other", events, p50, p99) over the window: the top tenants by events, then other."""
        self._expire(now)
        merged: dict[str, list[Any]] = {}
        for _, part in self.slices:
            for tenant, (n, total, h) in part.items():
                row = merged.get(tenant)
                if row is None:
                    row = merged[tenant] = [0, 0.0, {}]
                row[0] += n
                row[1] += total
                mh = row[2]
                for b, c in h.items():
                    mh[b] = mh.get(b, 0) + c
        named = sorted((t for t in merged if t != self.OTHER), key=lambda t: (-merged[t][0], t))[: self.top]
        other: list[Any] = [0, 0.0, {}]
        for t, (n, total, h) in merged.items():
            if t in named:
                continue
            other[0] += n
            other[1] += total
            for b, c in h.items():
                other[2][b] = other[2].get(b, 0) + c
        out = [(t, merged[t][0], self._quantile(merged[t][2], 0.5), self._quantile(merged[t][2], 0.99)) for t in named]
        if other[0]:
            out.append((self.OTHER, other[0], self._quantile(other[2], 0.5), self._quantile(other[2], 0.99)))
        return out

    def _quantile(self, h: dict[int, int], q: float) -> float | None:
        """The bucket's upper bound at quantile q (the dwell is at most this, within 9 %)."""
        total = sum(h.values())
        if not total:
            return None
        rank = q * total
        seen = 0
        for b in sorted(h):
            seen += h[b]
            if seen >= rank:
                return self.LOW * self.RATIO**b
        return self.LOW * self.RATIO ** max(h)


LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Registry:
    """All metrics of one manager, rendered together."""

    def __init__(self) -> None:
        self.metrics: list[_Metric] = []

    def counter(self, name: str, help_text: str) -> Counter:
        m = Counter(name, help_text)
        self.metrics.append(m)
        return m

    def gauge(
        self, name: str, help_text: str, read: Callable[[], Iterable[tuple[dict[str, str], float]]] | None = None
    ) -> Gauge:
        m = Gauge(name, help_text, read)
        self.metrics.append(m)
        return m

    def histogram(self, name: str, help_text: str, buckets: Iterable[float] = LATENCY_BUCKETS) -> Histogram:
        m = Histogram(name, help_text, buckets)
        self.metrics.append(m)
        return m

    def render(self) -> str:
        lines: list[str] = []
        for m in self.metrics:
            lines.extend(m.render())
        return "\n".join(lines) + "\n"


class ManagerMetrics:
    """Every metric of one manager (docs/manager.md, "Observability"), in one registry.

    Gauges that read live state are bound by the manager (:meth:`bind_gauges`); the rest are
    moved by the parts that see the events.
    """

    def __init__(self) -> None:
        r = self.registry = Registry()
        self.fired = r.counter("qm_events_fired_total", "Events marked fired and pushed to a receiver.")
        self.acked_total = r.counter("qm_events_acked_total", "Events acked (commit confirmed).")
        self.nacked_total = r.counter("qm_events_nacked_total", "Events nacked by a receiver.")
        self.refired = r.counter(
            "qm_events_refired_total",
            "Events put back to to_be_fired, by reason (nack, disconnect, ack_timeout, drain).",
        )
        self.dead = r.counter("qm_events_dead_lettered_total", "Events moved to failed after max attempts.")
        self.settled_by_sql = r.counter(
            "qm_events_settled_by_sql_total",
            "Events in hand that an application settled by SQL (the manager freed their credit slot).",
        )
        self.pickup = r.histogram(
            "qm_pickup_delay_seconds", "Delay from an event's fire_at to its push (database clock)."
        )
        self.ack_latency = r.histogram("qm_ack_latency_seconds", "Time from push to the committed ack.")
        self.frame_errors = r.counter("qm_protocol_errors_total", "Client frames refused, by error code.")
        self.maintenance = r.counter(
            "qm_maintenance_runs_total",
            "Runs of the leader's maintenance jobs (the collector, the retention and reconciliation baseline "
            "passes) by job and outcome.",
        )
        self.slices = r.counter(
            "qm_maintenance_slices_total",
            "Maintenance slices by job, outcome (recruited, finished, aborted) and source (idle, standby, baseline; "
            "leader for the collector's runs).",
        )
        self.slice_aborts = r.counter(
            "qm_maintenance_slice_aborts_total",
            "Aborted maintenance slices by job and reason (lock, conflict, timeout, connection, error).",
        )
        self.purged = r.counter(
            "qm_events_purged_total", "Events deleted by the retention slices, by queue and state (acked, failed)."
        )
        self.load_drift = r.gauge(
            "qm_load_drift_events",
            "Sum over partitions of |counted load - live events| found by this process's last reconciliation slice "
            "of each partition.",
        )
        self.fences = r.counter("qm_fenced_writes_total", "Writes the database refused because the term was stale.")
        self.poll = r.counter(
            "qm_poll_mode_entries_total", "Times a queue's wake-ups came so fast that dispatch switched to polling."
        )
        self.wake_waits = r.counter(
            "qm_wake_lock_waits_total",
            "Times the dispatcher waited for a queue's wake-up lock behind an open producer transaction.",
        )
        self.vacuums = r.counter(
            "qm_queue_vacuums_total",
            "VACUUMs the leader ran on a queue table that autovacuum had left past its trigger.",
        )
        #: the leader's latest database health reading (manager/health.py), None when not leading
        self.health: ShardHealth | None = None
        self.health_warnings: list[str] = []
        self.health_read_seconds = 0.0
        self._health_gauges()

    def set_health(self, reading: ShardHealth | None, warnings: list[str], seconds: float = 0.0) -> None:
        self.health, self.health_warnings, self.health_read_seconds = reading, warnings, seconds

    def _health_gauges(self) -> None:
        """The database health gauges: read from the latest reading at render time, so they show
        nothing on a standby and never a queue the last reading did not find."""
        r = self.registry

        def shard(value: Callable[[ShardHealth], float | None]) -> _Read:
            def read() -> _Series:
                h = self.health
                v = None if h is None else value(h)
                return [] if v is None else [({}, v)]

            return read

        def tables(attr: str) -> _Read:
            def read() -> _Series:
                h = self.health
                rows = [] if h is None else [(t.queue, getattr(t, attr)) for t in h.tables]
                return [({"queue": q}, float(v)) for q, v in rows if v is not None]

            return read

        def indexes(attr: str) -> _Read:
            def read() -> _Series:
                h = self.health
                rows = [] if h is None else [(t.queue, i.name, getattr(i, attr)) for t in h.tables for i in t.indexes]
                return [({"queue": q, "index": n}, float(v)) for q, n, v in rows if v is not None]

            return read

        def slots(value: Callable[[ShardHealth], list[tuple[str, float]]]) -> _Read:
            def read() -> _Series:
                h = self.health
                return [] if h is None else [({"slot": name}, v) for name, v in value(h)]

            return read

        r.gauge(
            "qm_db_xmin_horizon_age_seconds",
            "Age of the oldest transaction (session or prepared) holding back vacuum on the shard's database; "
            "0 when none.",
            shard(lambda h: 0.0 if h.horizon is None or h.horizon.age_seconds is None else h.horizon.age_seconds),
        )
        r.gauge(
            "qm_db_xmin_horizon_xids",
            "Transactions begun since the oldest holder of the xmin horizon (session, prepared transaction or slot).",
            shard(lambda h: float(h.horizon.xid_age or 0) if h.horizon is not None else 0.0),
        )
        r.gauge(
            "qm_db_replication_slot_xmin_xids",
            "Transactions a replication slot holds back vacuum by (its xmin or catalog_xmin).",
            slots(lambda h: [(s.name, float(s.xid_age)) for s in h.slots]),
        )
        r.gauge(
            "qm_db_notify_queue_usage_ratio",
            "Fraction of the server's NOTIFY queue in use (pg_notification_queue_usage()).",
            shard(lambda h: h.notify_queue_usage),
        )
        r.gauge(
            "qm_db_health_warnings",
            "Database health readings past their thresholds (qm status prints what each is).",
            shard(lambda _h: float(len(self.health_warnings))),
        )
        r.gauge(
            "qm_db_health_read_seconds",
            "How long the latest database health reading took.",
            shard(lambda _h: self.health_read_seconds),
        )
        r.gauge("qm_table_live_tuples", "Live tuples of a queue table (statistics).", tables("live_tuples"))
        r.gauge("qm_table_dead_tuples", "Dead tuples of a queue table (statistics).", tables("dead_tuples"))
        r.gauge(
            "qm_table_autovacuum_trigger_tuples",
            "Dead tuples at which autovacuum vacuums a queue table.",
            tables("autovacuum_trigger"),
        )
        r.gauge(
            "qm_table_vacuum_age_seconds",
            "Seconds since a queue table was last vacuumed (autovacuum or by hand); absent if never.",
            tables("vacuum_age_seconds"),
        )
        r.gauge(
            "qm_table_autovacuum_age_seconds",
            "Seconds since autovacuum last vacuumed a queue table; absent if never.",
            tables("autovacuum_age_seconds"),
        )
        r.gauge(
            "qm_table_autoanalyze_age_seconds",
            "Seconds since autovacuum last analyzed a queue table; absent if never.",
            tables("autoanalyze_age_seconds"),
        )
        r.gauge("qm_table_size_bytes", "Size of a queue table's heap (with TOAST and maps).", tables("table_bytes"))
        r.gauge("qm_table_index_size_bytes", "Size of all indexes of a queue table.", tables("index_bytes"))
        r.gauge("qm_index_size_bytes", "Size of one index of a queue table.", indexes("size_bytes"))
        r.gauge(
            "qm_index_bloat_bytes",
            "Estimated wasted bytes of one index of a queue table (statistics-based; absent until known).",
            indexes("bloat_bytes"),
        )
        self.limit_share = r.gauge(
            "qm_limit_share",
            "This manager's slice of a queue's limit across shards, by limit (qps, concurrency).",
        )
        self.limit_peers = r.gauge(
            "qm_limit_peers_live", "Other shards' managers whose lease rows are live on this shard's database."
        )
        self.limit_lapses = r.counter(
            "qm_limit_trust_lapses_total",
            "Times this manager's slices of a queue's limits went untrusted (no publish reached every live peer in "
            "time): it fired nothing of that queue until the next one did.",
        )
        self.limit_publish_failures = r.counter(
            "qm_limit_publish_failures_total",
            "Publishes of this manager's slices that did not reach a shard's database, by shard.",
        )
        #: per queue: dwell of the busiest tenants (rendered by bind_gauges' gauges)
        self.dwell: dict[str, TenantDwell] = {}

    def observe_dwell(self, queue: str, tenants: Sequence[str], delays: Sequence[float], now: float) -> None:
        d = self.dwell.get(queue)
        if d is None:
            d = self.dwell[queue] = TenantDwell()
        d.observe(tenants, delays, now)

    def bind_gauges(
        self,
        queues: Callable[[], Iterable[tuple[str, float, float]]],
        leader: Callable[[], float],
        term: Callable[[], float],
        receivers: Callable[[], float],
        over_share: Callable[[], Iterable[tuple[str, float]]] = lambda: (),
        clock: Callable[[], float] | None = None,
        keys: Callable[[], Iterable[tuple[str, list[tuple[str, str, int, int | None]], int]]] = lambda: (),
    ) -> None:
        """``queues`` yields (name, events in flight, events cached) per queue; ``over_share``
        (name, tenants over their fair share); ``clock`` is the monotonic clock of the dwell windows;
        ``keys`` (name, the top concurrency keys as (tenant, key, events in hand, limit), keys held at
        their limit) per queue."""
        r = self.registry
        r.gauge(
            "qm_key_in_flight",
            "Events fired and not yet settled of the concurrency keys with the most of them (keys.TOP_KEYS per queue).",
            lambda: [
                ({"queue": name, "tenant": tenant, "key": key}, float(n))
                for name, top, _ in keys()
                for tenant, key, n, _ in top
            ],
        )
        r.gauge(
            "qm_keys_at_limit",
            "Concurrency keys whose events in hand reached their key_max_in_flight, per queue.",
            lambda: [({"queue": name}, float(at)) for name, _, at in keys()],
        )
        r.gauge(
            "qm_in_flight",
            "Events fired and not yet settled, per queue.",
            lambda: [({"queue": name}, n) for name, n, _ in queues()],
        )
        r.gauge(
            "qm_cache_events",
            "Events held in the window cache, per queue.",
            lambda: [({"queue": name}, n) for name, _, n in queues()],
        )
        r.gauge("qm_leader", "1 while this manager is the shard's active manager.", lambda: [({}, leader())])
        r.gauge("qm_term", "Current leadership term (0 when not leading).", lambda: [({}, term())])
        r.gauge("qm_receivers_connected", "Open receiver connections.", lambda: [({}, receivers())])
        r.gauge(
            "qm_tenants_over_fair_share",
            "Tenants whose events in flight exceed twice their weighted share of the queue's in-flight events.",
            lambda: [({"queue": name}, n) for name, n in over_share()],
        )
        if clock is not None:
            now = clock

            def rows() -> list[tuple[str, str, int, float | None, float | None]]:
                t = now()
                return [(q, *row) for q, d in sorted(self.dwell.items()) for row in d.summary(t)]

            r.gauge(
                "qm_tenant_dwell_seconds",
                "Dwell (fire_at to push) of the busiest tenants over the last 60 s, by quantile; "
                "the rest as tenant=other.",
                lambda: [
                    ({"queue": q, "tenant": t, "quantile": k}, v)
                    for q, t, _, p50, p99 in rows()
                    for k, v in (("0.5", p50), ("0.99", p99))
                    if v is not None
                ],
            )
            r.gauge(
                "qm_tenant_dwell_events",
                "Events pushed in the last 60 s, for the tenants of qm_tenant_dwell_seconds.",
                lambda: [({"queue": q, "tenant": t}, float(n)) for q, t, n, _, _ in rows()],
            )

    # the session's counters (queue_manager.wire.session.SessionMetrics)

    def frame_refused(self, code: str) -> None:
        self.frame_errors.inc(code=code)

    def acked(self, queue: str, count: int, latencies: list[float]) -> None:
        self.acked_total.inc(count, queue=queue)
        self.ack_latency.observe_many(latencies, queue=queue)

    def nacked(self, queue: str, requeued: int, failed: int) -> None:
        self.nacked_total.inc(requeued + failed, queue=queue)
        if requeued:
            self.refired.inc(requeued, queue=queue, reason="nack")
        if failed:
            self.dead.inc(failed, queue=queue)

    def render(self) -> str:
        return self.registry.render()
