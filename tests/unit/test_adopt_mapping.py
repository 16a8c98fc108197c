"""The adopt mapping, checked without a database: option consistency and legacy column types."""

from __future__ import annotations

import pytest

from queue_manager.domain.adopt import (
    AdoptMapping,
    LegacyColumn,
    check_slice_rows,
    parse_assignments,
    plan_columns,
)
from queue_manager.errors import ConfigurationError


def _columns(**types: str) -> dict[str, LegacyColumn]:
    categories = {"int8": "N", "int4": "N", "text": "S", "jsonb": "U", "json": "U", "timestamptz": "D"}
    categories |= {"timestamp": "D", "uuid": "U", "bool": "B", "job_state": "E", "float8": "N"}
    return {
        name: LegacyColumn(name, typname, typname, categories[typname], unique=(name == "id"))
        for name, typname in types.items()
    }


TABLE = _columns(id="int8", customer="text", args="jsonb", run_at="timestamptz", status="job_state")


def test_a_complete_mapping_plans_its_columns() -> None:
    m = AdoptMapping.build(
        "jobs", payload_col="args", tenant_col="customer", run_at_col="run_at", filters=[("status", "pending")]
    )
    plan = plan_columns(m, TABLE, server_version=180_000)
    assert (plan.payload, plan.run_at) == ("json", "timestamptz")
    assert m.mode == "delete"
    assert m.filters == (("status", ("pending",)),)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of --tenant-col"),
        ({"tenant_col": "customer", "tenant": "acme"}, "exactly one of --tenant-col"),
        ({"tenant": ""}, "--tenant must not be empty"),
        ({"tenant": "a", "run_at_timezone": "UTC"}, "--run-at-timezone needs --run-at-col"),
        ({"tenant": "a", "marks": [("status", "adopted")]}, "--mark needs a --filter"),
        (
            {"tenant": "a", "filters": [("status", "pending")], "marks": [("status", "pending")]},
            "a marked row would still be pending",
        ),
        (
            {"tenant": "a", "filters": [("status", "pending")], "marks": [("note", "x")]},
            "a marked row would still be pending",
        ),
        ({"tenant": "a", "filters": [("s", "1")], "filter_null": ["s"]}, "both --filter"),
        ({"tenant": "a", "payload_cols": ["x", "x"]}, "names a column twice"),
    ],
)
def test_inconsistent_options_are_refused_with_the_option_named(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        AdoptMapping.build("jobs", **kwargs)  # type: ignore[arg-type]


def test_marks_that_leave_the_filter_are_accepted() -> None:
    by_value = AdoptMapping.build("jobs", tenant="a", filters=[("status", "pending")], marks=[("status", "adopted")])
    by_null = AdoptMapping.build("jobs", tenant="a", filter_null=["done_at"], marks=[("done_at", "now")])
    assert by_value.mode == by_null.mode == "mark"


def test_every_column_problem_is_reported_at_once() -> None:
    m = AdoptMapping.build(
        "jobs", id_col="customer", payload_col="nope", tenant_col="args", run_at_col="status", dedup_col="run_at"
    )
    with pytest.raises(ConfigurationError) as err:
        plan_columns(m, TABLE, server_version=180_000)
    text = str(err.value)
    assert "--payload-col 'nope': no such column in jobs (columns: id, customer, args, run_at, status)" in text
    assert "--id-col 'customer' is not unique" in text
    assert "--tenant-col 'args' is jsonb" in text
    assert "--run-at-col 'status' is job_state: expected timestamptz" in text
    assert "--dedup-col 'run_at' is timestamptz" in text


@pytest.mark.parametrize(
    ("columns", "kwargs", "version", "message"),
    [
        (_columns(id="int8", p="int4"), {"payload_col": "p"}, 180_000, "--payload-col 'p' is int4: expected json"),
        (_columns(id="int8", p="text"), {"payload_col": "p"}, 150_000, "needs PostgreSQL 16"),
        (_columns(id="int8", p="json"), {"payload_col": "p"}, 120_000, "adopt needs 13 or later"),
        (
            _columns(id="int8", p="json", at="timestamp"),
            {"payload_col": "p", "run_at_col": "at"},
            180_000,
            "say which zone its times are in with --run-at-timezone",
        ),
    ],
)
def test_column_types_that_cannot_carry_the_mapping(
    columns: dict[str, LegacyColumn], kwargs: dict[str, object], version: int, message: str
) -> None:
    m = AdoptMapping.build("jobs", tenant="acme", **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=message):
        plan_columns(m, columns, server_version=version)


def test_text_payload_naive_run_at_and_payload_columns() -> None:
    cols = _columns(id="int8", p="text", at="timestamp", kind="text", n="float8")
    text = AdoptMapping.build("jobs", tenant="a", payload_col="p", run_at_col="at", run_at_timezone="UTC")
    plan = plan_columns(text, cols, server_version=160_000)
    assert (plan.payload, plan.run_at) == ("text", "timestamp")
    both = AdoptMapping.build("jobs", tenant="a", payload_cols=["kind", "n"])
    assert both.payload_col is None
    assert plan_columns(both, cols, server_version=130_000).payload == "columns"


def test_assignments_and_slice_sizes() -> None:
    assert parse_assignments(["status=pending", "note=a=b", "x="], "--filter") == (
        ("status", "pending"),
        ("note", "a=b"),
        ("x", ""),
    )
    for bad in ("status", "=pending"):
        with pytest.raises(ConfigurationError, match="write COLUMN=VALUE"):
            parse_assignments([bad], "--mark")
    assert check_slice_rows(1) == 1
    for bad_rows in (0, 10_001):
        with pytest.raises(ConfigurationError, match="--slice"):
            check_slice_rows(bad_rows)
