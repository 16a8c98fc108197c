"""Percentiles of measured samples: the one definition the demo's live view, the benchmarks and
their peer comparison share, so a p99 means the same thing on every page."""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], p: float) -> float | None:
    """The ``p``-th percentile (0..100) of ``values``, linearly interpolated between the two
    nearest ranks (numpy's default, "linear"); None when there are no values.

    ``values`` need not be sorted (a sorted list costs one linear pass)."""
    if not 0 <= p <= 100 or math.isnan(p):
        raise ValueError(f"a percentile is between 0 and 100, got {p!r}")
    ordered = sorted(values)
    if not ordered:
        return None
    k = (len(ordered) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    if lo == hi:
        return float(ordered[lo])
    return float(ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo))
