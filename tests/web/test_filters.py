"""The event browser's filter parsing and the keyset merge across shards: pure, no database."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from queue_manager.web.browse import ShardPage, merge
from queue_manager.web.filters import (
    FilterError,
    format_cursor,
    parse_cursor,
    parse_filter,
    parse_payload_filter,
)

SHARDS = ("s0", "s1")


@pytest.mark.parametrize(
    ("text", "path", "op", "value"),
    [
        ("payload.order.id = 42", ("order", "id"), "=", 42),
        ("order.id=42", ("order", "id"), "=", 42),
        ("payload.order.status = shipped", ("order", "status"), "=", "shipped"),
        ('payload.note = "a, b"', ("note",), "=", "a, b"),
        ('payload.items.0.sku != "A-1"', ("items", "0", "sku"), "!=", "A-1"),
        ('payload."odd key".x = true', ("odd key", "x"), "=", True),
        ("payload.order.id", ("order", "id"), "exists", None),
        ("payload.tags = [1, 2]", ("tags",), "=", [1, 2]),
        ("payload.v = null", ("v",), "=", None),
    ],
)
def test_payload_filter_parses(text: str, path: tuple[str, ...], op: str, value: object) -> None:
    f = parse_payload_filter(text)
    assert f.path == path and f.op == op
    assert (f.value_json is None) if op == "exists" else json.loads(f.value_json or "") == value


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "empty"),
        ("payload", "name a field"),
        ("payload. = 1", "expected a field name"),
        ("payload.a..b = 1", "expected a field name"),
        ("payload.a = ", "value is missing"),
        ("payload.a > 3", "expected = or !="),
        ("payload.a = {broken", "neither JSON nor a plain word"),
        ("payload.a = 1; DROP TABLE orders", "neither JSON nor a plain word"),
        ("payload.a'b = 1", "expected = or !="),
        ("payload." + ".".join(["a"] * 20) + " = 1", "deeper than"),
        ("payload.a = " + "x" * 600, "longer than"),
    ],
)
def test_payload_filter_refuses_with_a_clear_message(text: str, says: str) -> None:
    with pytest.raises(FilterError, match=says):
        parse_payload_filter(text)


def test_filter_fields_round_trip_through_the_query_string() -> None:
    f = parse_filter(
        {
            "state": "failed",
            "tenant": " acme ",
            "id": "",
            "dedup_key": "k-1",
            "fire_from": "2026-11-27T10:00",
            "created_to": "2026-11-28T00:00:00+01:00",
            "payload": "payload.order.id = 42",
            "shard": "s1",
        },
        SHARDS,
    )
    assert f.tenant == "acme" and f.event_id is None and f.state == "failed"
    assert f.fire_from == datetime(2026, 11, 27, 10, tzinfo=UTC)
    assert f.created_to == datetime(2026, 11, 27, 23, tzinfo=UTC)
    assert parse_filter(f.query(), SHARDS) == f
    assert f.params()["jpath"] == ["order", "id"] and f.params()["jvalue"] == "42"


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"state": "done"}, "not a state"),
        ({"id": "12x"}, "not an event id"),
        ({"id": "-1"}, "not an event id"),
        ({"shard": "s9"}, "no shard named"),
        ({"fire_from": "yesterday"}, "not a time"),
        ({"tenant": "t" * 2000}, "longer than"),
    ],
)
def test_bad_filter_fields_are_refused(fields: dict[str, str], says: str) -> None:
    with pytest.raises(FilterError, match=says):
        parse_filter(fields, SHARDS)


def test_cursor_round_trip_and_refusal() -> None:
    assert parse_cursor(None, SHARDS) == {"s0": 0, "s1": 0}
    c = {"s0": 120, "s1": None}
    assert parse_cursor(format_cursor(c), SHARDS) == c
    for bad in ("s0", "s0:x", "s9:1", "s0:1,s0:2", "s0:1;DROP"):
        with pytest.raises(FilterError, match="cursor"):
            parse_cursor(bad, SHARDS)


T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _rows(ids: list[int]) -> list[dict[str, object]]:
    return [{"id": i, "created_at": T0 + timedelta(seconds=i)} for i in sorted(ids, reverse=True)]


@given(
    st.lists(st.integers(1, 400), unique=True, max_size=40),
    st.lists(st.integers(1, 400), unique=True, max_size=40),
    st.integers(1, 7),
    st.integers(1, 12),
    st.integers(0, 3),
)
def test_merged_pages_list_every_event_once_and_never_hold_a_shard_back(
    a: list[int], b: list[int], limit: int, scan: int, gap: int
) -> None:
    """Paging a model of two shards (ids as times) with capped looks: every matching row is seen
    once; each page is newest first and so is each shard's sequence of rows; and a page holds as
    many rows as the looks found, up to its size (a shard whose look found nothing, or less than
    it looked for, holds no other shard's rows back). Only every ``gap + 1``-th row of s0 matches,
    so s0's looks often find nothing while s1's find plenty."""
    table = {"s0": sorted(a, reverse=True), "s1": sorted(b, reverse=True)}
    matching = {"s0": set(table["s0"][:: gap + 1]), "s1": set(table["s1"])}
    cursor: dict[str, int | None] = {"s0": 0, "s1": 0}
    seen: list[tuple[str, int]] = []
    for _ in range(1000):
        pages = {}
        for name, ids in table.items():
            position = cursor[name]
            if position is None:
                continue
            below = [i for i in ids if position == 0 or i < position]
            window = below[:scan]  # the look: the newest `scan` rows below the cursor, matching or not
            rows = [i for i in window if i in matching[name]][:limit]
            if len(rows) == limit:
                pages[name] = ShardPage(_rows(rows), False, rows[-1])
            else:
                capped = len(below) > scan
                pages[name] = ShardPage(_rows(rows), not capped, window[-1] if capped else None)
        page = merge(cursor, pages, limit)
        found = sum(len(p.rows) for p in pages.values())
        assert len(page.rows) == min(limit, found), "a shard's rows were held back"
        times = [int(r["id"]) for _, r in page.rows]  # type: ignore[call-overload]
        assert times == sorted(times, reverse=True), "a page is newest first"
        seen += [(s, int(r["id"])) for s, r in page.rows]  # type: ignore[call-overload]
        cursor = page.cursor
        if not page.more:
            break
    else:
        raise AssertionError("paging never ended")
    expected = [("s0", i) for i in matching["s0"]] + [("s1", i) for i in matching["s1"]]
    assert len(seen) == len(set(seen)) and sorted(seen) == sorted(expected)
    for name in table:
        mine = [i for s, i in seen if s == name]
        assert mine == sorted(mine, reverse=True), f"{name}'s rows are newest first across the pages"
