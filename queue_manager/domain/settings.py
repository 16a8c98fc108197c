"""A queue's settings, spelled once: names, types, defaults, ranges and help text.

:class:`QueueSettings` is one row of ``qm.queues`` as the code sees it. Each settable field
carries a :class:`Setting` in its metadata, and everything else derives from that: the Python
validation of ``create``/``alter`` (:func:`check_settings`), the ``qm queue create|alter`` options,
and the manager's rows (loaded by column name). The database keeps its own CHECK constraints as
the last line for SQL clients; ``tests/integration/test_queue_settings.py`` checks the two sides
agree (same settable columns, same defaults, same bounds).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from queue_manager.errors import ConfigurationError

#: priorities run from 1 (highest) to this; each level is one range of the due index per partition
PRIORITY_LEVELS = 5


@dataclass(frozen=True, slots=True)
class Setting:
    """How one setting is typed, bounded, defaulted and offered on the command line."""

    #: int, float or bool (floats accept ints)
    kind: type
    default: int | float | bool | None
    #: the ``qm queue create|alter`` option
    flag: str | None
    help: str
    #: None is allowed (and means "no limit")
    nullable: bool = False
    minimum: float | None = None
    #: the minimum itself is refused (``> minimum``)
    exclusive_minimum: bool = False
    maximum: float | None = None

    def check(self, key: str, value: Any, what: str = "queue setting") -> int | float | bool | None:
        """``value`` if it is valid for this setting; ConfigurationError naming the key otherwise."""
        if value is None:
            if self.nullable:
                return None
            raise ConfigurationError(f"{what} {key!r} may not be null")
        if self.kind is bool:
            if not isinstance(value, bool):
                raise ConfigurationError(f"{what} {key!r} must be true or false, got {value!r}")
            return value
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or (self.kind is int and not isinstance(value, int))
        ):
            expected = "an integer" if self.kind is int else "a number"
            raise ConfigurationError(f"{what} {key!r} must be {expected}, got {value!r}")
        if not math.isfinite(value):
            raise ConfigurationError(f"{what} {key!r} must be finite, got {value!r}")
        too_low = self.minimum is not None and (
            value <= self.minimum if self.exclusive_minimum else value < self.minimum
        )
        if too_low or (self.maximum is not None and value > self.maximum):
            raise ConfigurationError(f"{what} {key!r} must be {self.range_text()}, got {value!r}")
        return value

    def range_text(self) -> str:
        lo = "" if self.minimum is None else f"{'>' if self.exclusive_minimum else '>='} {self.minimum:g}"
        hi = "" if self.maximum is None else f"<= {self.maximum:g}"
        return " and ".join(x for x in (lo, hi) if x) or "any value"


def _setting(default: Any, flag: str | None, help_text: str, kind: type, **bounds: Any) -> Any:
    return field(default=default, metadata={"setting": Setting(kind, default, flag, help_text, **bounds)})


@dataclass(frozen=True, slots=True)
class QueueSettings:
    """One queue's registry row: identity, shape and dispatch settings."""

    id: int
    name: str
    #: partitions that may still hold events: more than ``partitions`` while a shrink drains
    partitions_physical: int
    partitions: int = _setting(16, "--partitions", "partitions per shard, N", int, minimum=1, maximum=1024)
    shuffle: int = _setting(4, "--shuffle", "shuffle-shard size k: partitions per tenant", int, minimum=1, maximum=16)
    window_seconds: float = _setting(
        30.0,
        "--window",
        "seconds of upcoming events the manager caches",
        float,
        minimum=0,
        exclusive_minimum=True,
        maximum=3600,
    )
    cache_size: int = _setting(
        10_000, "--cache-size", "most events the manager caches", int, minimum=1, maximum=10_000_000
    )
    ack_timeout_seconds: float = _setting(
        30.0, "--ack-timeout", "seconds a receiver has to ack", float, minimum=0, exclusive_minimum=True, maximum=86_400
    )
    backoff_min_seconds: float = _setting(1.0, "--backoff-min", "first re-fire delay, seconds", float, minimum=0)
    backoff_max_seconds: float = _setting(300.0, "--backoff-max", "longest re-fire delay, seconds", float, minimum=0)
    max_attempts: int = _setting(
        20, "--max-attempts", "attempts before an event is dead-lettered", int, minimum=1, maximum=1000
    )
    max_qps: float | None = _setting(
        None,
        "--max-qps",
        "most events fired per second, all shards together",
        float,
        nullable=True,
        minimum=0,
        exclusive_minimum=True,
    )
    max_concurrency: int | None = _setting(
        None, "--max-concurrency", "most events in flight", int, nullable=True, minimum=1
    )
    retention_seconds: float = _setting(604_800.0, "--retention", "seconds acked events are kept", float, minimum=0)
    #: dead letters wait for `qm events retry` or an operator, so they are kept longer than acked events
    failed_retention_seconds: float | None = _setting(
        2_592_000.0,
        "--failed-retention",
        "seconds failed (dead-lettered) events are kept after their last fire; null keeps them",
        float,
        nullable=True,
        minimum=0,
    )
    payload_limit_bytes: int = _setting(
        65_536, "--payload-limit", "largest payload in bytes", int, minimum=16, maximum=104_857_600
    )
    max_delay_seconds: float = _setting(
        315_576_000.0,
        "--max-delay",
        "latest fire_at accepted, seconds from now",
        float,
        minimum=0,
        exclusive_minimum=True,
    )
    paused: bool = _setting(False, None, "refuse to dispatch", bool)
    tenant_max_in_flight: int | None = _setting(
        None,
        "--tenant-max-in-flight",
        "most events of one tenant in flight (per shard; a tenant's own max_in_flight wins)",
        int,
        nullable=True,
        minimum=1,
    )
    default_priority: int = _setting(
        3,
        "--default-priority",
        f"priority of an event that gives none: 1 (highest) to {PRIORITY_LEVELS}",
        int,
        minimum=1,
        maximum=PRIORITY_LEVELS,
    )
    #: an event waiting this long counts one level higher, per interval (None: no aging)
    priority_aging_seconds: float | None = _setting(
        30.0,
        "--priority-aging",
        "seconds its oldest event waits that make a priority level count one level higher (null, "
        "--no-priority-aging: no aging)",
        float,
        nullable=True,
        minimum=0,
        exclusive_minimum=True,
    )
    key_max_in_flight: int | None = _setting(
        None,
        "--key-max-in-flight",
        "most events of one concurrency_key of a tenant fired and unsettled at once (a key's own max_in_flight wins)",
        int,
        nullable=True,
        minimum=1,
    )
    key_max_qps: float | None = _setting(
        None,
        "--key-max-qps",
        "most events of one rate_key of a tenant fired per second (a key's own max_qps wins)",
        float,
        nullable=True,
        minimum=0,
        exclusive_minimum=True,
    )


#: the settable fields, in registry order: key -> Setting
SETTINGS: Mapping[str, Setting] = {
    f.name: f.metadata["setting"] for f in fields(QueueSettings) if "setting" in f.metadata
}


#: a tenant's overrides of its queue's dispatch (``qm.tenant_settings``; ``qm queue tenant set``)
TENANT_SETTINGS: Mapping[str, Setting] = {
    "weight": Setting(
        float,
        1.0,
        "--weight",
        "the tenant's share of fires among backlogged tenants, relative to the others' weights",
        minimum=0,
        exclusive_minimum=True,
        maximum=1000,
    ),
    "max_in_flight": Setting(
        int,
        None,
        "--max-in-flight",
        "most events of the tenant in flight (per shard; unset: the queue's tenant_max_in_flight)",
        nullable=True,
        minimum=1,
    ),
}


@dataclass(frozen=True, slots=True)
class TenantSettings:
    """One row of ``qm.tenant_settings`` as the manager loads it."""

    queue_id: int
    tenant: str
    weight: float = 1.0
    max_in_flight: int | None = None


#: one key's limits (``qm.key_settings``; ``qm queue key set``): a concurrency_key's and a rate_key's
KEY_SETTINGS: Mapping[str, Setting] = {
    "max_in_flight": Setting(
        int,
        None,
        "--max-in-flight",
        "most events of the key fired and unsettled at once (unset: the queue's key_max_in_flight)",
        nullable=True,
        minimum=1,
    ),
    "max_qps": Setting(
        float,
        None,
        "--max-qps",
        "most events of the key fired per second (unset: the queue's key_max_qps)",
        nullable=True,
        minimum=0,
        exclusive_minimum=True,
    ),
}


@dataclass(frozen=True, slots=True)
class KeySettings:
    """One row of ``qm.key_settings`` as the manager loads it: the limits of one key of one tenant."""

    queue_id: int
    tenant: str
    key: str
    max_in_flight: int | None = None
    max_qps: float | None = None


def _check_each(specs: Mapping[str, Setting], settings: Mapping[str, Any], what: str) -> dict[str, Any]:
    """Each of ``settings`` checked by its spec in ``specs``; an unknown name is refused."""
    out: dict[str, Any] = {}
    for key, value in settings.items():
        spec = specs.get(key)
        if spec is None:
            raise ConfigurationError(f"unknown {what} {key!r}; known settings: {', '.join(specs)}")
        out[key] = spec.check(key, value, what)
    return out


def check_key_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """As :func:`check_settings`, for a key's limits (``qm.set_key`` checks them again)."""
    return _check_each(KEY_SETTINGS, settings, "key setting")


def check_tenant_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """As :func:`check_settings`, for a tenant's overrides (``qm.set_tenant`` checks them again)."""
    return _check_each(TENANT_SETTINGS, settings, "tenant setting")


def check_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Refuse unknown keys, wrong types and out-of-range values before anything reaches a shard.

    Rules between two settings are checked when both are given (the database checks them
    against the stored values too).
    """
    out = _check_each(SETTINGS, settings, "queue setting")
    if "shuffle" in out and "partitions" in out and out["shuffle"] > out["partitions"]:
        raise ConfigurationError(
            f"invalid settings: shuffle ({out['shuffle']}) may not exceed partitions ({out['partitions']})"
        )
    lo, hi = out.get("backoff_min_seconds"), out.get("backoff_max_seconds")
    if lo is not None and hi is not None and hi < lo:
        raise ConfigurationError(
            f"invalid settings: backoff_max_seconds ({hi:g}) may not be below backoff_min_seconds ({lo:g})"
        )
    return out
