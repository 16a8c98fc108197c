"""The receiver library's pure parts: Backoff, CreditBook, URLs, Retry, handler kinds."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from queue_manager.errors import TopologyError
from receivers import Backoff, CreditBook, Event, Retry
from receivers.receiver import http_url, is_async_handler, ws_url

# ---------------------------------------------------------------- Backoff


def test_backoff_doubles_up_to_its_maximum_without_jitter() -> None:
    b = Backoff(initial=0.1, maximum=1.0, jitter=0.0)
    assert [round(b.next(), 6) for _ in range(7)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    assert b.attempts == 7


def test_backoff_reset_starts_again_from_initial() -> None:
    b = Backoff(initial=0.5, maximum=8.0, jitter=0.0)
    for _ in range(5):
        b.next()
    b.reset()
    assert b.next() == 0.5


def test_backoff_jitter_stays_within_its_band_and_the_cap() -> None:
    b = Backoff(initial=1.0, maximum=4.0, jitter=0.5, rng=random.Random(7))
    delays = [b.next() for _ in range(200)]
    assert 0.5 <= delays[0] <= 1.5
    assert 1.0 <= delays[1] <= 3.0
    assert all(d <= 4.0 for d in delays)
    assert all(2.0 <= d <= 4.0 for d in delays[3:])  # 4.0 * [0.5, 1.5], capped at 4.0
    assert len({round(d, 9) for d in delays}) > 100  # spread, not one value


def test_backoff_is_reproducible_with_a_seeded_rng() -> None:
    a = Backoff(rng=random.Random(1))
    b = Backoff(rng=random.Random(1))
    assert [a.next() for _ in range(20)] == [b.next() for _ in range(20)]


def test_backoff_never_overflows_after_many_failures() -> None:
    b = Backoff(initial=0.1, maximum=30.0, jitter=0.0)
    b.attempts = 100_000
    assert b.next() == 30.0


@pytest.mark.parametrize(
    "kwargs",
    [{"initial": 0}, {"initial": 2, "maximum": 1}, {"factor": 0.5}, {"jitter": 1.0}, {"jitter": -0.1}],
)
def test_backoff_refuses_bad_settings(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Backoff(**kwargs)  # type: ignore[arg-type]


@given(st.floats(0.001, 10), st.floats(1, 3), st.floats(0, 0.99), st.integers(0, 60))
def test_backoff_delays_are_bounded(initial: float, factor: float, jitter: float, n: int) -> None:
    b = Backoff(initial=initial, maximum=initial * 50, factor=factor, jitter=jitter, rng=random.Random(n))
    for _ in range(n):
        d = b.next()
        assert initial * (1 - jitter) - 1e-9 <= d <= initial * 50


# ---------------------------------------------------------------- CreditBook


def test_the_manager_may_never_send_more_than_the_free_slots() -> None:
    """credit - held (what the manager may send: held = in hand with no ack on its way) never
    exceeds the free slots, in any order of handler returns and commits."""
    book = CreditBook(2)
    acking: set[tuple[int, int]] = set()  # handlers returned, their acks on their way
    held = lambda: len(book.in_hand) - len(acking)  # noqa: E731
    assert book.credit == 2  # a new connection: two free slots
    assert book.delivered(1, 1)
    book.started(1, 1, from_waiting=False)
    assert book.credit - held() == book.free == 1
    assert book.delivered(2, 1)
    book.started(2, 1, from_waiting=False)
    assert book.credit - held() == book.free == 0
    book.handler_returned(1, 1)  # event 1 done, its ack on its way: the slot is free ...
    acking.add((1, 1))
    assert book.free == 1 and book.credit - held() == 1  # ... and the manager may refill it at once
    book.settled(1, 1)  # the commit changes neither count
    acking.discard((1, 1))
    assert book.credit - held() == book.free == 1
    book.handler_returned(2, 1)
    book.settled(2, 1)
    assert book.credit == 2 and book.idle


def test_a_handler_that_outlives_its_connection_keeps_its_slot() -> None:
    book = CreditBook(3)
    for i in (1, 2):
        assert book.delivered(i, 1)
        book.started(i, 1, from_waiting=False)
    book.connection_lost(waiting_dropped=book.waiting)
    assert book.in_hand == {} and book.busy == 2 and book.orphans == 2
    assert book.credit == 1  # the new connection may get one event: two slots are still busy
    book.handler_returned(1, 1)
    book.handler_returned(2, 1)
    assert book.credit == 3 and book.idle


def test_a_timed_out_thread_holds_its_slot_after_its_nack() -> None:
    book = CreditBook(2)
    book.delivered(5, 1)
    book.started(5, 1, from_waiting=False)
    assert book.credit == 2  # nack on its way: still held by the manager, still running here
    book.settled(5, 1)  # the nack committed; the thread still runs
    assert book.orphans == 1 and book.credit == 1 and book.free == 1
    book.handler_returned(5, 1)
    assert book.credit == 2 and book.idle


def test_an_event_for_a_busy_slot_waits_and_takes_the_next_one() -> None:
    book = CreditBook(1)
    assert book.delivered(1, 1)
    book.started(1, 1, from_waiting=False)
    book.settled(1, 1)  # taken back by the manager while its handler runs on
    assert not book.delivered(2, 1)  # the manager saw a free slot before the lowered credit arrived
    assert book.waiting == 1 and book.free == 0 and book.credit == 0
    book.handler_returned(1, 1)
    assert book.can_start_waiting()
    book.started(2, 1, from_waiting=True)
    assert book.waiting == 0 and book.busy == 1 and book.credit == 1


def test_settling_an_old_attempt_keeps_the_new_one_in_hand() -> None:
    book = CreditBook(2)
    book.delivered(7, 1)
    book.started(7, 1, from_waiting=False)
    book.delivered(7, 2)  # re-fired after its deadline, to this same connection
    book.started(7, 2, from_waiting=False)
    book.settled(7, 1)  # the old attempt's ack came back stale
    assert book.holds(7, 2) and not book.holds(7, 1)
    assert book.orphans == 1 and book.credit == 1


@given(st.lists(st.tuples(st.sampled_from(["deliver", "return", "commit", "lose"]), st.integers(0, 5)), max_size=80))
def test_credit_never_lets_the_manager_overfill(ops: list[tuple[str, int]]) -> None:
    """A model of the manager (held = in hand less the acks on their way, whose handlers returned)
    against random returns, commits and reconnects: with no event taken back behind the receiver's
    back, nothing ever waits for a slot."""
    book = CreditBook(3)
    next_id = 1
    done: list[tuple[int, int]] = []  # handlers returned, result not committed
    for op, k in ops:
        if op == "deliver" and book.credit - (len(book.in_hand) - len(done)) > 0:
            assert book.delivered(next_id, 1), "an event arrived for a busy slot"
            book.started(next_id, 1, from_waiting=False)
            next_id += 1
        elif op == "return" and book.running:
            ident, attempt = sorted(book.running)[k % len(book.running)]
            book.handler_returned(ident, attempt)
            done.append((ident, attempt))
        elif op == "commit" and done:
            book.settled(*done.pop(k % len(done)))
        elif op == "lose":
            book.connection_lost(book.waiting)
            done.clear()
        assert book.waiting == 0 and 0 <= book.busy <= book.slots
        assert book.credit - (len(book.in_hand) - len(done)) <= book.free


def test_draining_grants_no_credit() -> None:
    book = CreditBook(4)
    book.draining = True
    assert book.credit == 0


def test_credit_book_refuses_no_slots() -> None:
    with pytest.raises(ValueError):
        CreditBook(0)


# ---------------------------------------------------------------- the rest


def test_manager_urls_map_to_websocket_and_health_urls() -> None:
    assert ws_url("http://h:1") == "ws://h:1/"
    assert ws_url("wss://h:1/v1") == "wss://h:1/v1"
    assert http_url("ws://h:8765/", "/health/leader") == "http://h:8765/health/leader"
    assert http_url("wss://h/", "/health/leader") == "https://h/health/leader"
    with pytest.raises(ValueError):
        ws_url("ftp://h/")
    with pytest.raises(ValueError):
        ws_url("h:8765")


def test_retry_carries_its_delay_and_refuses_a_bad_one() -> None:
    assert Retry(delay=2.5).delay == 2.5
    assert Retry().delay is None
    with pytest.raises(ValueError):
        Retry(delay=-1)


def test_async_and_sync_handlers_are_told_apart() -> None:
    async def coro(event: Event) -> None: ...

    def plain(event: Event) -> None: ...

    class AsyncCallable:
        async def __call__(self, event: Event) -> None: ...

    class SyncCallable:
        def __call__(self, event: Event) -> None: ...

    assert is_async_handler(coro) and is_async_handler(AsyncCallable())
    assert not is_async_handler(plain) and not is_async_handler(SyncCallable())


def test_qm_receive_reads_its_manager_options_against_the_topology() -> None:
    from queue_manager.cli.main import _managers
    from queue_manager.domain.topology import KeyRange, Shard, Topology
    from queue_manager.errors import ConfigurationError

    two = Topology((Shard("s0", "dsn0", KeyRange.parse("-80")), Shard("s1", "dsn1", KeyRange.parse("80-"))))
    one = Topology((Shard("only", "dsn", KeyRange.parse("-")),))
    assert _managers(["s0=ws://a:1/", "s0=ws://b:1/", "s1=ws://c:1/"], two) == {
        "s0": ["ws://a:1/", "ws://b:1/"],
        "s1": ["ws://c:1/"],
    }
    assert _managers(["ws://a:1/?x=y"], one) == {"only": ["ws://a:1/?x=y"]}
    assert _managers(["ws://a:1/"], None) == {"default": ["ws://a:1/"]}
    with pytest.raises(ConfigurationError, match=r"no --manager for shard\(s\) s1"):
        _managers(["s0=ws://a:1/"], two)
    with pytest.raises(ConfigurationError, match="topology does not have: s9"):
        _managers(["s0=ws://a:1/", "s1=ws://a:1/", "s9=ws://a:1/"], two)
    with pytest.raises(ConfigurationError, match="name its shard"):
        _managers(["ws://a:1/"], two)
    with pytest.raises(ConfigurationError, match="give the managers"):
        _managers([], None)
    # a shard whose managers the topology file names needs no --manager (the file's are used)
    named = Topology((two.shards[0], Shard("s1", "dsn1", KeyRange.parse("80-"), ("ws://d:1/",))))
    assert _managers(["s0=ws://a:1/"], named) == {"s0": ["ws://a:1/"]}
    with pytest.raises(ConfigurationError, match=r"no --manager for shard\(s\) s0 and the topology file names"):
        _managers([], named)


def test_a_receiver_following_a_topology_file_takes_its_managers(tmp_path: Path) -> None:
    from receivers import Receiver

    async def handle(event: Event) -> None: ...

    path = tmp_path / "topology.toml"
    path.write_text(
        '[[shards]]\nname = "s0"\ndsn = "a"\nrange = "-80"\nmanagers = ["ws://a:1/", "ws://b:1/"]\n'
        '[[shards]]\nname = "s1"\ndsn = "b"\nrange = "80-"\n'
    )
    with pytest.raises(ValueError, match=r"names no managers for shard\(s\) s1"):
        Receiver.from_topology(path, "orders", handle)
    r = Receiver.from_topology(path, "orders", handle, managers={"s1": ["ws://c:1/"]})
    assert r.shards == {"s0": ["ws://a:1/", "ws://b:1/"], "s1": ["ws://c:1/"]}
    r = Receiver.from_topology(path, "orders", handle, managers={"s0": ["ws://x:1/"], "s1": ["ws://c:1/"]})
    assert r.shards["s0"] == ["ws://x:1/"]
    with pytest.raises(ValueError, match="does not have: s9"):
        Receiver.from_topology(path, "orders", handle, managers={"s1": ["ws://c:1/"], "s9": ["ws://c:1/"]})
    with pytest.raises(TopologyError, match="does not exist"):
        Receiver.from_topology(tmp_path / "missing.toml", "orders", handle)
