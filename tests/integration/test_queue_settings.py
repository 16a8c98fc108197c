"""One source of truth for queue settings: the Python metadata agrees with the database.

``queue_manager.domain.settings`` drives the CLI options and the validation before anything
reaches a shard; the database keeps its own CHECK constraints for SQL clients. These tests fail
as soon as the two drift: another settable column, another default, another bound.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import psycopg
import pytest

from queue_manager.domain.settings import (
    SETTINGS,
    TENANT_SETTINGS,
    QueueSettings,
    TenantSettings,
    check_settings,
    check_tenant_settings,
)
from queue_manager.domain.topology import Shard
from queue_manager.errors import ConfigurationError
from queue_manager.manager import store


def test_the_settable_columns_are_the_settings(shard: Shard) -> None:
    with psycopg.connect(shard.dsn) as conn:
        row = conn.execute("SELECT qm.settable_columns()").fetchone()
    assert row is not None and list(row[0]) == list(SETTINGS)


def test_defaults_agree_with_the_column_defaults(shard: Shard, make_queue: Any) -> None:
    make_queue("plain")
    with psycopg.connect(shard.dsn) as conn:
        row = conn.execute(
            "SELECT " + ", ".join(SETTINGS) + " FROM qm.queues WHERE name = 'plain'"  # names from the metadata
        ).fetchone()
    assert row is not None
    assert dict(zip(SETTINGS, row, strict=True)) == {k: s.default for k, s in SETTINGS.items()}


async def test_the_manager_loads_rows_by_column_name_into_every_field(shard: Shard, make_queue: Any) -> None:
    make_queue("named", partitions=8, shuffle=2, max_qps=12.5, max_concurrency=3, paused=True)
    conn = await store.connect(shard.dsn, "test")
    try:
        (q,) = [q for q in await store.load_queues(conn) if q.name == "named"]
    finally:
        await conn.close()
    assert isinstance(q, QueueSettings)
    assert {f.name for f in fields(QueueSettings)} >= set(SETTINGS)
    assert (q.partitions, q.partitions_physical, q.shuffle, q.max_qps, q.max_concurrency, q.paused) == (
        8,
        8,
        2,
        12.5,
        3,
        True,
    )


def _python_accepts(check: Callable[[dict[str, Any]], object], settings: dict[str, Any]) -> bool:
    try:
        check(settings)
    except ConfigurationError:
        return False
    return True


def _sql_accepts(conn: psycopg.Connection[Any], statement: str, settings: dict[str, Any]) -> bool:
    """True when ``statement`` (settings as its one JSON parameter) passes the tables' CHECKs; rolled back."""
    try:
        conn.execute(statement, (json.dumps(settings),))
    except psycopg.errors.CheckViolation:
        return False
    finally:
        conn.rollback()
    return True


def _boundaries() -> list[tuple[str, Any, bool]]:
    """(setting, value, valid) at and just beyond every bound the metadata states."""
    out: list[tuple[str, Any, bool]] = []
    for key, spec in SETTINGS.items():
        step = 1 if spec.kind is int else 1e-6
        if spec.minimum is not None:
            lo = spec.minimum
            if spec.exclusive_minimum:
                out += [(key, lo, False), (key, lo + step, True)]
            else:
                out += [(key, lo, True), (key, lo - step, False)]
        if spec.maximum is not None:
            out += [(key, spec.maximum, True), (key, spec.maximum + step, False)]
        if spec.nullable:
            out.append((key, None, True))
    return out


def test_python_and_sql_accept_and_refuse_the_same_bounds(shard: Shard) -> None:
    # bounds that other settings constrain: companions that let the setting under test alone decide
    companions: dict[str, dict[str, Any]] = {
        "partitions": {"shuffle": 1},
        "shuffle": {"partitions": 1024},
        "backoff_min_seconds": {"backoff_max_seconds": 1e9},
        "backoff_max_seconds": {"backoff_min_seconds": 0},
    }
    cases = _boundaries()
    assert len(cases) > 20
    wrong = []
    with psycopg.connect(shard.dsn) as conn:
        for key, value, valid in cases:
            if SETTINGS[key].kind is int and value is not None:
                value = int(value)
            settings = {**companions.get(key, {}), key: value}
            python_ok = _python_accepts(check_settings, settings)
            sql_ok = _sql_accepts(conn, "SELECT qm.create_queue('bounds', %s::jsonb)", settings)
            if (python_ok, sql_ok) != (valid, valid):
                wrong.append(f"{key}={value!r}: python {python_ok}, sql {sql_ok}, expected {valid}")
    assert not wrong, wrong


def test_tenant_settings_bounds_agree_between_python_and_sql(shard: Shard, make_queue: Any) -> None:
    """qm.tenant_settings' CHECKs and qm.set_tenant accept and refuse what TENANT_SETTINGS does;
    its column defaults are the declared defaults."""
    make_queue("tq")
    wrong = []
    cases: list[tuple[str, Any, bool]] = []
    for key, spec in TENANT_SETTINGS.items():
        step = 1 if spec.kind is int else 1e-6
        if spec.minimum is not None:
            lo = spec.minimum
            cases += [(key, lo, False), (key, lo + step, True)] if spec.exclusive_minimum else [(key, lo, True)]
            if not spec.exclusive_minimum:
                cases.append((key, lo - step, False))
        if spec.maximum is not None:
            cases += [(key, spec.maximum, True), (key, spec.maximum + step, False)]
        if spec.nullable:
            cases.append((key, None, True))
    assert len(cases) >= 6
    with psycopg.connect(shard.dsn) as conn:
        for key, value, valid in cases:
            if TENANT_SETTINGS[key].kind is int and value is not None:
                value = int(value)
            python_ok = _python_accepts(check_tenant_settings, {key: value})
            sql_ok = _sql_accepts(conn, "SELECT qm.set_tenant('tq', 'acme', %s::jsonb)", {key: value})
            if (python_ok, sql_ok) != (valid, valid):
                wrong.append(f"{key}={value!r}: python {python_ok}, sql {sql_ok}, expected {valid}")
        row = conn.execute("SELECT weight, max_in_flight FROM qm.set_tenant('tq', 'fresh', '{}')").fetchone()
        assert row == tuple(TENANT_SETTINGS[k].default for k in ("weight", "max_in_flight"))
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="unknown tenant setting"):
            conn.execute("SELECT qm.set_tenant('tq', 'acme', '{\"cap\": 1}')")
    assert not wrong, wrong


async def test_the_manager_loads_tenant_settings_into_their_fields(shard: Shard, make_queue: Any) -> None:
    make_queue("tl", tenant_max_in_flight=7)
    with psycopg.connect(shard.dsn, autocommit=True) as c:
        c.execute("SELECT qm.set_tenant('tl', 'acme', '{\"weight\": 2.5, \"max_in_flight\": 3}')")
        c.execute("SELECT qm.set_tenant('tl', 'beta', '{\"weight\": 4}')")
        c.execute("SELECT qm.set_tenant('tl', 'beta', '{\"max_in_flight\": 9}')")  # keeps the weight
    conn = await store.connect(shard.dsn, "test")
    try:
        (q,) = [q for q in await store.load_queues(conn) if q.name == "tl"]
        rows = [t for t in await store.load_tenant_settings(conn) if t.queue_id == q.id]
    finally:
        await conn.close()
    assert q.tenant_max_in_flight == 7
    assert rows == [TenantSettings(q.id, "acme", 2.5, 3), TenantSettings(q.id, "beta", 4.0, 9)]
