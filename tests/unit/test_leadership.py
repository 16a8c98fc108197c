"""A standby's reading of the lease (leadership.Succession) and the held /health/leader probe's
``wait``, as pure functions."""

from __future__ import annotations

import pytest

from queue_manager.manager.http import MAX_HOLD, hold_seconds
from queue_manager.manager.leadership import DEAD_HOLDER_GRACE, EXPIRY_SLACK, Move, Succession
from queue_manager.manager.store import LeaseView

POLL = 0.1


def view(term: int = 3, pid: int | None = 4242, expires_in: float = 4.0, connected: bool = True) -> LeaseView:
    return LeaseView(term, pid, expires_in, connected)


def test_a_running_lease_with_a_connected_holder_is_waited_for_until_the_next_poll() -> None:
    s = Succession()
    step = s.next(view(), 100.0, POLL)
    assert (step.move, step.sleep) == (Move.WAIT, POLL)


def test_the_standby_wakes_at_the_expiry_it_read_when_that_comes_before_the_next_poll() -> None:
    step = Succession().next(view(expires_in=0.03), 100.0, POLL)
    assert step.move is Move.WAIT and step.sleep == pytest.approx(0.03 + EXPIRY_SLACK)


def test_an_expired_lease_is_acquired() -> None:
    for expires_in in (0.0, -0.2, -1e9):
        assert Succession().next(view(expires_in=expires_in), 100.0, POLL).move is Move.ACQUIRE


def test_a_holder_whose_backend_stays_gone_for_the_grace_is_taken_over() -> None:
    s = Succession()
    gone = view(connected=False)
    first = s.next(gone, 100.0, POLL)
    assert first.move is Move.WAIT and first.sleep == pytest.approx(POLL)
    assert s.next(gone, 100.0 + DEAD_HOLDER_GRACE / 2, POLL).move is Move.WAIT
    # the last wait before the grace ends sleeps exactly until it does
    late = s.next(gone, 100.0 + DEAD_HOLDER_GRACE - 0.02, POLL)
    assert late.move is Move.WAIT and late.sleep == pytest.approx(0.02)
    assert s.next(gone, 100.0 + DEAD_HOLDER_GRACE, POLL).move is Move.TAKE_OVER


def test_the_grace_starts_again_when_the_holder_comes_back_or_the_lease_moves_on() -> None:
    s = Succession()
    s.next(view(connected=False), 100.0, POLL)
    # back (it renewed from a new backend, or the old one was only a moment away): no takeover
    assert s.next(view(pid=5151), 100.3, POLL).move is Move.WAIT
    assert s.next(view(pid=5151, connected=False), 100.4, POLL).move is Move.WAIT
    assert s.next(view(pid=5151, connected=False), 100.4 + DEAD_HOLDER_GRACE - 0.01, POLL).move is Move.WAIT
    # another backend of the same term, or a new term, seen gone: each starts its own grace
    s.next(view(pid=6161, connected=False), 101.0, POLL)
    assert s.next(view(pid=6161, connected=False), 101.0 + DEAD_HOLDER_GRACE - 0.01, POLL).move is Move.WAIT
    s.next(view(term=4, pid=6161, connected=False), 101.6, POLL)
    assert s.next(view(term=4, pid=6161, connected=False), 101.6 + DEAD_HOLDER_GRACE, POLL).move is Move.TAKE_OVER


def test_a_lease_without_a_holder_backend_is_waited_out() -> None:
    # a reshard's lease (holder 'reshard', no backend): only its expiry ends it
    s = Succession()
    for t in (100.0, 101.0, 102.0):
        assert s.next(view(pid=None, connected=False, expires_in=5.0), t, POLL).move is Move.WAIT


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/health/leader", 0.0),
        ("/health/leader?wait=5", 5.0),
        ("/health/leader?wait=0.25", 0.25),
        ("/health/leader?wait=3600", MAX_HOLD),
        ("/health/leader?wait=inf", MAX_HOLD),
        ("/health/leader?wait=-1", 0.0),
        ("/health/leader?wait=nan", 0.0),
        ("/health/leader?wait=soon", 0.0),
        ("/health/leader?other=1&wait=2", 2.0),
    ],
)
def test_a_probe_is_held_for_the_wait_it_asks_within_the_bound(path: str, expected: float) -> None:
    assert hold_seconds(path) == expected
