"""The overview's numbers from a reading (web/readings.py): the counts and what each is (counted,
capped, estimated), the rates from the counters' differences, the last hour's series and the SVG
sparklines. Pure: no database, times passed in."""

from __future__ import annotations

import re
from typing import Any

from queue_manager.web.readings import History, live_counts, sparkline


def row(enq: list[int], done: list[int], **overrides: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "paused": False,
        "partitions": len(enq),
        "enq": enq,
        "done": done,
        "fired": 0,
        "failed": 0,
        "cap": 100,
        "due_now": 0,
        "due_capped": False,
        "oldest_due_age_seconds": None,
        "pickup_delays": [],
        "acked_estimate": None,
        "failed_estimate": None,
    }
    args.update(overrides)
    return live_counts("orders", **args)


def reading(shard: str, queues: list[dict[str, Any]]) -> dict[str, Any]:
    return {"shards": [{"shard": shard, "queues": queues}]}


def test_live_events_are_enqueued_minus_done_per_partition() -> None:
    q = row([10, 5, 0], [4, 5, 0], fired=2)
    assert q["loads"] == [6, 0, 0] and q["live"] == 6 and q["to_be_fired"] == 4
    assert q["enqueued_total"] == 15 and q["done_total"] == 9
    # a partition whose done counter ran ahead (an ack counted before its insert's bump) is 0, not negative
    assert row([3, 1], [5, 0])["loads"] == [0, 1]


def test_capped_counts_and_estimates_say_what_they_are() -> None:
    q = row([0], [0], failed=100, fired=100, failed_estimate=123_456.0, acked_estimate=-1.0)
    assert q["failed_capped"] and q["fired_capped"] and q["failed_estimate"] == 123_456
    assert q["acked_estimate"] is None  # never counted (reltuples -1)
    q = row([0], [0], failed=99)
    assert not q["failed_capped"]


def test_pickup_percentiles_are_the_code_bases_percentile() -> None:
    q = row([0], [0], pickup_delays=[float(i) for i in range(1, 102)])
    assert (q["pickup_p50"], q["pickup_p99"], q["pickup_sample"]) == (51.0, 100.0, 101)
    assert row([0], [0])["pickup_p50"] is None


def test_rates_come_from_the_counters_differences() -> None:
    h = History(every_seconds=5, keep_seconds=3600)
    assert h.rates("s0", "orders") is None
    h.add(1000.0, reading("s0", [row([100], [40])]))
    h.add(1005.0, reading("s0", [row([150], [60])]))
    assert h.rates("s0", "orders") is None  # not yet two sample intervals (10 s) apart
    h.add(1010.0, reading("s0", [row([300], [140])]))
    assert h.rates("s0", "orders") == (20.0, 10.0)  # (300-100)/10, (140-40)/10
    # a reconciliation that sets a done counter back gives no negative rate
    h.add(1020.0, reading("s0", [row([300], [100])]))
    assert h.rates("s0", "orders") == (0.0, 0.0)


def test_the_series_buckets_the_last_hour_and_forgets_older_samples() -> None:
    h = History(every_seconds=60, keep_seconds=3600)
    for minute in range(90):
        h.add(60.0 * minute, reading("s0", [row([minute * 60], [0], failed=minute)]))
    now = 60.0 * 89
    series = h.series("s0", "orders", now)
    assert len(series["enq"]) == 60
    assert {v for v in series["enq"] if v is not None} == {1.0}  # 60 events a minute
    assert series["failed"][-1] == 89.0 and min(v for v in series["failed"] if v is not None) >= 29
    assert h.since() is not None and h.since() >= now - 3600


def test_a_young_history_spreads_over_the_charts_width() -> None:
    h = History(every_seconds=5, keep_seconds=3600)
    for i in range(25):  # two minutes of samples
        h.add(1000.0 + 5 * i, reading("s0", [row([10 * i], [0])]))
    now = 1000.0 + 5 * 24
    assert h.span(now) == 120.0
    series = h.series("s0", "orders", now)
    # a bucket per sample interval, each with its sample (but the first, on the edge of (now - 120, now])
    assert len(series["live"]) == 24 and all(v is not None for v in series["live"])
    assert {v for v in series["enq"] if v is not None} == {2.0}


def test_a_dropped_queue_leaves_the_history_but_a_shard_down_keeps_it() -> None:
    h = History(every_seconds=1)
    h.add(0.0, reading("s0", [row([1], [0])]))
    h.add(5.0, {"shards": [{"shard": "s0", "error": "unreachable"}]})
    assert 1.0 in h.series("s0", "orders", 5.0)["live"]
    h.add(10.0, reading("s0", []))
    assert all(v is None for v in h.series("s0", "orders", 10.0)["live"])


def test_a_sparkline_is_an_svg_with_a_line_per_series_and_gaps_for_missing_samples() -> None:
    svg = sparkline([[0.0, 1.0, None, 2.0, 4.0], [1.0, 1.0, 1.0, 1.0, 1.0]], width=100, height=20, label="a<b")
    assert svg.startswith('<svg class="spark"') and "<title>a&lt;b (max 4)</title>" in svg
    assert svg.count('class="s0"') == 2 and svg.count('class="s1"') == 1  # s0 is broken by the None
    ys = [float(y) for y in re.findall(r",([0-9.]+)", svg)]
    assert min(ys) == 1.0 and max(ys) == 19.0  # the maximum at the top, zero at the bottom
    empty = sparkline([[None, None]])
    assert "<polyline" not in empty and "max 0" in empty
