"""An end-to-end latency run's raw timings, from the producer's times of each event (call start,
commit returned) and the receivers' receipts, the same way for this project's e2e benchmark and for
the peers' (standard library only: the peers' virtualenv imports it too)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def first_receipts(receipts: Iterable[tuple[int, float]]) -> tuple[dict[int, float], int]:
    """Each event's first receipt (seq -> time) and how many receipts came again."""
    first: dict[int, float] = {}
    again = 0
    for seq, t in receipts:
        if seq in first:
            again += 1
        first[seq] = min(t, first.get(seq, t))
    return first, again


def latencies(
    sent: Mapping[int, tuple[float, float]], first: Mapping[int, float]
) -> tuple[list[float], list[float], list[float]]:
    """Seconds, for every measured event (warm-up events have negative seqs): the enqueue call
    (every one), then commit returned -> first receipt and call start -> first receipt (those
    received)."""
    enqueue: list[float] = []
    commit: list[float] = []
    call: list[float] = []
    for seq, (t_call, t_commit) in sent.items():
        if seq < 0:
            continue
        enqueue.append(t_commit - t_call)
        if seq in first:
            commit.append(first[seq] - t_commit)
            call.append(first[seq] - t_call)
    return enqueue, commit, call
