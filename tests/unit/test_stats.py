"""The one percentile definition (queue_manager.domain.stats) the demo and the benchmarks share."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from queue_manager.domain.stats import percentile


def test_interpolates_between_the_nearest_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile(range(101), 99) == 99.0


def test_no_values_and_bad_p() -> None:
    assert percentile([], 50) is None
    assert percentile([7.0], 99) == 7.0
    for p in (-1, 101, math.nan):
        with pytest.raises(ValueError, match="between 0 and 100"):
            percentile([1.0], p)


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.floats(0, 100))
def test_within_the_samples_and_monotonic(values: list[float], p: float) -> None:
    got = percentile(values, p)
    assert got is not None
    assert min(values) <= got <= max(values)
    higher = percentile(values, min(100.0, p + 1))
    assert higher is not None and higher >= got - 1e-9 * max(1.0, abs(got))
