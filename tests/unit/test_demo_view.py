"""The demo's live view says what it does: the producer's target beside its actual rate."""

from __future__ import annotations

from queue_manager.demo import _Counts, _Snapshot, producer_behind


def test_the_demo_says_when_its_producer_cannot_keep_up() -> None:
    assert producer_behind(None, 150) is None  # no rate yet
    assert producer_behind(149, 150) is None
    assert producer_behind(136, 150) is None  # within 10 %
    assert producer_behind(60, 150) == "producer behind: 60 of 150/s"


def test_the_progress_line_shows_the_target_and_says_when_behind() -> None:
    snap = _Snapshot(
        elapsed=12.0,
        counts={"s0": _Counts(acked=10)},
        enqueued=700,
        enqueued_rate=58.0,
        acked_rate=55.0,
        p50=0.004,
        p99=0.02,
        tenants=[],
        leaders={"s0": [("manager-s0-a", "leader", 2)]},
        target_rate=150.0,
        producer_rate=60.0,
    )
    line = snap.line()
    assert "enqueued 700 (58/s of 150/s)" in line
    assert line.endswith("  !! producer behind: 60 of 150/s")
    snap.producer_rate = 148.0
    assert "behind" not in snap.line()
