"""A benchmark's JSON report: the header every report carries, the summaries of measured
samples (all through the one percentile of :mod:`queue_manager.domain.stats`), and the output."""

from __future__ import annotations

import bisect
import contextlib
import json
import math
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from benchmarks.lib.machine import machine_info
from queue_manager.domain.stats import percentile


def header(benchmark: str) -> dict[str, Any]:
    """``benchmark``, ``date`` (UTC, now) and ``machine``: the first fields of every report."""
    return {
        "benchmark": benchmark,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
    }


def emit(report: Mapping[str, Any]) -> None:
    """The report as one JSON object on stdout (logs go to stderr)."""
    print(json.dumps(report, indent=2, default=str))
    sys.stdout.flush()


def run_main(main: Callable[[], int]) -> None:
    """Run a benchmark's ``main`` and exit with its status; Ctrl-C stops a long run quietly
    (no traceback, no report)."""
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())


def pct_ms(values_s: Sequence[float], p: float, digits: int = 3) -> float | None:
    """The ``p``-th percentile of ``values_s`` (seconds) in ms, or None without values."""
    v = percentile(values_s, p)
    return None if v is None else round(v * 1000, digits)


def summary_ms(values_s: Sequence[float]) -> dict[str, Any]:
    """min/p50/p95/p99/max/mean in ms, and how many values exceed 20 ms, 100 ms and 1 s."""
    v = sorted(x * 1000.0 for x in values_s)
    if not v:
        return {"n": 0}
    return {
        "n": len(v),
        "over_20ms": sum(1 for x in v if x > 20.0),
        "over_100ms": sum(1 for x in v if x > 100.0),
        "over_1s": sum(1 for x in v if x > 1000.0),
        "min_ms": round(v[0], 3),
        "p50_ms": round(percentile(v, 50) or 0.0, 3),
        "p95_ms": round(percentile(v, 95) or 0.0, 3),
        "p99_ms": round(percentile(v, 99) or 0.0, 3),
        "max_ms": round(v[-1], 3),
        "mean_ms": round(sum(v) / len(v), 3),
    }


def depth_series(commits: Sequence[float], receipts: Sequence[float], start: float, end: float) -> list[int]:
    """Events committed and not yet received, sampled every 100 ms from ``start`` to ``end``."""
    commits = sorted(commits)
    receipts = sorted(receipts)
    out = []
    t = start
    while t <= end:
        out.append(bisect.bisect_right(commits, t) - bisect.bisect_right(receipts, t))
        t += 0.1
    return out


def median_of(samples: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """The median of ``key`` over the samples that have it (NaN and None left out)."""
    vals = [
        s[key] for s in samples if s.get(key) is not None and not (isinstance(s[key], float) and math.isnan(s[key]))
    ]
    return round(statistics.median(vals), 3) if vals else None


def spread(runs: Sequence[Mapping[str, Any]], key: str) -> dict[str, float | None]:
    """The median, min and max of ``key`` over the runs that have it (None without any)."""
    vals = [r[key] for r in runs if r.get(key) is not None]
    if not vals:
        return {"median": None, "min": None, "max": None}
    return {"median": round(statistics.median(vals), 3), "min": min(vals), "max": max(vals)}


def alternated(reps: int, *then: str) -> list[tuple[int, str]]:
    """(rep, side) for ``reps`` pairs of runs ``alone`` and ``beside``, which comes first
    alternating, each pair followed by the sides ``then``."""
    pairs = (("alone", "beside"), ("beside", "alone"))
    return [(rep, side) for rep in range(reps) for side in (*pairs[rep % 2], *then)]


def beside_over_alone(alone: list[dict[str, Any]], beside: list[dict[str, Any]], beside_rate: str) -> dict[str, Any]:
    """A latency's runs alone and beside a load: the spreads of their p50 and p99 (and of the
    beside runs' ``beside_rate``, and whether the load lasted through each), the ratio of the p99
    medians and the p99 ratio of each pair."""
    a99, b99 = spread(alone, "p99_ms")["median"], spread(beside, "p99_ms")["median"]
    return {
        "alone": {"p50_ms": spread(alone, "p50_ms"), "p99_ms": spread(alone, "p99_ms"), "runs": alone},
        "beside": {
            "p50_ms": spread(beside, "p50_ms"),
            "p99_ms": spread(beside, "p99_ms"),
            beside_rate: spread(beside, beside_rate),
            "saturated_throughout": all(r["saturated_throughout"] for r in beside),
            "runs": beside,
        },
        "p99_beside_over_alone": round(b99 / a99, 2) if a99 and b99 else None,
        "p99_ratio_per_pair": [
            round(b["p99_ms"] / a["p99_ms"], 2) if a["p99_ms"] and b["p99_ms"] else None
            for a, b in zip(alone, beside, strict=True)
        ],
    }


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 3)
