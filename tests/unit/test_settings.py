"""Queue settings' validation, without a database (the SQL side: tests/integration/test_queue_settings.py)."""

from __future__ import annotations

import math

import pytest

from queue_manager.domain.settings import SETTINGS, check_settings
from queue_manager.errors import ConfigurationError


def test_cross_setting_rules_are_checked_before_a_shard_is_touched() -> None:
    with pytest.raises(ConfigurationError, match=r"shuffle \(4\) may not exceed partitions \(2\)"):
        check_settings({"partitions": 2, "shuffle": 4})
    with pytest.raises(ConfigurationError, match="backoff_max_seconds"):
        check_settings({"backoff_min_seconds": 10, "backoff_max_seconds": 5})
    with pytest.raises(ConfigurationError, match="unknown queue setting 'partitons'"):
        check_settings({"partitons": 4})
    with pytest.raises(ConfigurationError, match="must be an integer"):
        check_settings({"cache_size": 1.5})
    with pytest.raises(ConfigurationError, match="must be true or false"):
        check_settings({"paused": 1})


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_numbers_are_refused(value: float) -> None:
    with pytest.raises(ConfigurationError, match="must be finite"):
        check_settings({"window_seconds": value})


def test_null_only_where_it_means_no_limit() -> None:
    assert check_settings({"max_qps": None, "max_concurrency": None}) == {"max_qps": None, "max_concurrency": None}
    with pytest.raises(ConfigurationError, match="may not be null"):
        check_settings({"partitions": None})


def test_every_setting_but_paused_has_a_flag_and_a_default_in_range() -> None:
    for key, spec in SETTINGS.items():
        assert (spec.flag is None) == (key == "paused"), key
        if spec.default is not None:
            assert spec.check(key, spec.default) == spec.default
