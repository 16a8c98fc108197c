"""The overview's numbers, made from a reading of the shards: plain functions and one ring buffer
(no I/O, no clock of their own; times are passed in).

- :func:`live_counts`: one queue's row on one shard, from its load counters and bounded reads,
  with what is exact, capped or estimated said in the row itself;
- :class:`History`: the samples of the last hour kept by the web process (it starts empty when
  the process starts), the rates (enqueued/s, done/s) made from the counters' differences, and
  the series the charts draw;
- :func:`sparkline`: a small SVG chart of one or two series, drawn on the server.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from queue_manager.domain.stats import percentile


def live_counts(
    queue: str,
    *,
    paused: bool,
    partitions: int,
    enq: Sequence[int],
    done: Sequence[int],
    fired: int,
    failed: int,
    cap: int,
    due_now: int,
    due_capped: bool,
    oldest_due_age_seconds: float | None,
    pickup_delays: Sequence[float],
    acked_estimate: float | None,
    failed_estimate: float | None,
) -> dict[str, Any]:
    """One queue's overview row on one shard.

    ``enq``/``done`` are the partitions' counters (their difference is a partition's load: its
    live events, to_be_fired + fired, approximate by design); ``fired`` and ``failed`` were counted
    up to ``cap``, ``due_now`` up to its cap (``due_capped``); ``pickup_delays`` are the pickup
    delays of the newest acked events, sorted; the estimates are index statistics (``reltuples``;
    negative: never counted)."""
    loads = [max(0, e - d) for e, d in zip(enq, done, strict=False)]
    live = sum(loads)
    return {
        "queue": queue,
        "paused": paused,
        "partitions": partitions,
        "loads": loads,
        "enqueued_total": sum(enq),
        "done_total": sum(done),
        #: from the load counters (approximate by design)
        "live": live,
        "to_be_fired": max(0, live - fired),
        #: exact up to cap
        "fired": fired,
        "fired_capped": fired >= cap,
        "failed": failed,
        "failed_capped": failed >= cap,
        "failed_estimate": _estimate(failed_estimate),
        "acked_estimate": _estimate(acked_estimate),
        "due_now": due_now,
        "due_capped": due_capped,
        "oldest_due_age_seconds": oldest_due_age_seconds,
        "pickup_sample": len(pickup_delays),
        "pickup_p50": percentile(pickup_delays, 50),
        "pickup_p99": percentile(pickup_delays, 99),
    }


def _estimate(value: float | None) -> int | None:
    return None if value is None or value < 0 else round(value)


@dataclass(frozen=True)
class Sample:
    """One queue on one shard at one time."""

    at: float
    enqueued: int
    done: int
    live: int
    failed: int
    pickup_p99: float | None


Key = tuple[str, str]  # (shard, queue)


class History:
    """The samples of the last ``keep_seconds`` (one at most every ``every_seconds``) per queue and
    shard, kept in memory by the web process: its charts start when the process starts."""

    def __init__(self, every_seconds: float = 5.0, keep_seconds: float = 3600.0) -> None:
        self.every = every_seconds
        self.keep = keep_seconds
        self._samples: dict[Key, deque[Sample]] = {}
        self._latest: dict[Key, Sample] = {}

    def add(self, at: float, reading: dict[str, Any]) -> None:
        """Take the samples of a reading (:func:`queue_manager.web.reads.live`) taken at ``at``
        (epoch seconds). Every reading updates the latest sample; one is kept per ``every_seconds``."""
        seen: set[Key] = set()
        for entry in reading.get("shards", []):
            for q in entry.get("queues") or []:
                key = (entry["shard"], q["queue"])
                seen.add(key)
                failed = q["failed_estimate"] if q["failed_capped"] and q["failed_estimate"] else q["failed"]
                sample = Sample(at, q["enqueued_total"], q["done_total"], q["live"], failed, q["pickup_p99"])
                self._latest[key] = sample
                kept = self._samples.setdefault(key, deque(maxlen=int(self.keep / self.every) + 2))
                if not kept or at - kept[-1].at >= self.every:
                    kept.append(sample)
                while kept and kept[0].at < at - self.keep:
                    kept.popleft()
        readable = {e["shard"] for e in reading.get("shards", []) if "error" not in e}
        for key in [k for k in self._samples if k[0] in readable and k not in seen]:
            del self._samples[key]  # a dropped queue
            self._latest.pop(key, None)

    def rates(self, shard: str, queue: str, span: float | None = None) -> tuple[float, float] | None:
        """(enqueued/s, done/s) between the latest sample and the newest kept one at least ``span``
        seconds older (default: two sample intervals), from the counters' differences; None until
        the history spans that long. "Done" counts every event that left the queue: acked,
        dead-lettered or deleted."""
        span = 2 * self.every if span is None else span
        latest = self._latest.get((shard, queue))
        kept = self._samples.get((shard, queue))
        if latest is None or not kept:
            return None
        older = next((s for s in reversed(kept) if latest.at - s.at >= span), None)
        if older is None:
            return None
        return _rate(older, latest, "enqueued"), _rate(older, latest, "done")

    def span(self, now: float) -> float:
        """The time the charts cover: the last ``keep_seconds``, or less while the history is younger
        (since its oldest sample, at least ``every_seconds`` times 12)."""
        since = self.since()
        young = self.every * 12 if since is None else max(self.every * 12, now - since)
        return min(self.keep, young)

    def series(self, shard: str, queue: str, now: float, buckets: int = 60) -> dict[str, list[float | None]]:
        """Per bucket of the last :meth:`span` seconds (``buckets`` of them, fewer while the history
        is young so that no bucket is narrower than a sample interval; oldest first): enqueued/s,
        done/s, live events, dead letters and pickup p99; None where no sample fell."""
        span = self.span(now)
        buckets = max(2, min(buckets, int(span / self.every)))
        width = span / buckets
        out: dict[str, list[float | None]] = {k: [None] * buckets for k in ("enq", "done", "live", "failed", "p99")}
        kept = list(self._samples.get((shard, queue), ()))
        previous: Sample | None = None
        for sample in kept:
            i = math.ceil((sample.at - (now - span)) / width) - 1  # buckets of (now - span, now]
            if 0 <= i < buckets:
                out["live"][i] = float(sample.live)
                out["failed"][i] = float(sample.failed)
                if sample.pickup_p99 is not None:
                    out["p99"][i] = sample.pickup_p99
                if previous is not None and sample.at > previous.at:
                    for name, field in (("enq", "enqueued"), ("done", "done")):
                        rate = _rate(previous, sample, field)
                        current = out[name][i]
                        out[name][i] = rate if current is None else max(current, rate)
            previous = sample
        return out

    def since(self) -> float | None:
        """When the oldest kept sample was taken (epoch seconds), None before the first."""
        firsts = [kept[0].at for kept in self._samples.values() if kept]
        return min(firsts) if firsts else None


def _rate(a: Sample, b: Sample, field: str) -> float:
    # a reconciliation may set a done counter back, and a dropped queue's come back at zero: no negative rate
    change: float = getattr(b, field) - getattr(a, field)
    return max(0.0, change / (b.at - a.at))


def sparkline(series: Sequence[Sequence[float | None]], width: int = 120, height: int = 24, label: str = "") -> str:
    """An inline SVG of one or more series (each a polyline, class ``s0``, ``s1``...) on a shared
    scale from 0 to their maximum; a None breaks a line. ``label`` becomes the chart's title."""
    values = [v for s in series for v in s if v is not None]
    top = max(values) if values else 0.0
    scale = (height - 2) / top if top > 0 else 0.0
    lines = []
    for n, s in enumerate(series):
        step = width / max(1, len(s) - 1)
        runs: list[list[str]] = [[]]
        for i, v in enumerate(s):
            if v is None:
                if runs[-1]:
                    runs.append([])
                continue
            runs[-1].append(f"{i * step:.1f},{height - 1 - v * scale:.1f}")
        for run in runs:
            if len(run) == 1:
                x, y = run[0].split(",")
                lines.append(f'<circle class="s{n}" cx="{x}" cy="{y}" r="1.2"/>')
            elif run:
                lines.append(f'<polyline class="s{n}" points="{" ".join(run)}"/>')
    title = _xml(f"{label} (max {top:.3g})" if label else f"max {top:.3g}")
    return (
        f'<svg class="spark" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img">'
        f"<title>{title}</title>{''.join(lines)}</svg>"
    )


def bars(values: Sequence[int], height: int = 40, label: str = "partition") -> str:
    """An inline SVG of one bar per value (each 6 px wide, on a scale from 0 to their maximum, at
    least 4 px high), each titled ``label index: value``: the live events per partition. SVG
    attributes, not inline styles, so the page's Content-Security-Policy needs no 'unsafe-inline'."""
    top = max(values, default=0)
    width = 7 * len(values)
    rects = []
    for i, v in enumerate(values):
        h = 4 + round((height - 4) * v / top) if top else 4
        title = _xml(f"{label} {i}: {v}")
        rects.append(f'<rect x="{7 * i}" y="{height - h}" width="6" height="{h}"><title>{title}</title></rect>')
    return (
        f'<svg class="depth" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img">'
        f"{''.join(rects)}</svg>"
    )


def _xml(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
