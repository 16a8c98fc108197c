"""Leadership of the shard: take the lease, renew it, run one session per term, step down.

The lease is the row ``qm.leader`` in the shard's database (sql/schema/leadership/): a term, a holder
and an expiry by the database's clock. The loop:

- as a **standby**, reads the lease every ``standby_poll`` (a plain read, no lock) and takes it
  when it has expired, or when its holder has had no connection to the database for
  DEAD_HOLDER_GRACE (its process died: :class:`Succession` decides, ``qm.take_over_leadership``
  takes it); it sleeps no longer than until the expiry it read;
- as the **leader**, renews every ``lease_ttl / 3`` and trusts the lease only until the start of
  the last good renewal + TTL - margin (:class:`~queue_manager.manager.runtime.Lease`). It runs one
  :class:`~queue_manager.manager.term.TermSession` at a time and wakes at once when it fails;
- restarts a failed session after renewing the lease (same term); a leader that has been unable
  to dispatch for ``recovery_deadline`` seconds while its lease renews fine **gives the lease up**
  (``qm.release_leadership``), so that a standby takes over, and stays out for a moment;
- **steps down** when a renewal is refused (another manager holds the term now) or cannot be made
  before the trust runs out: the lease is dropped first (the role turns ``standby`` at once), then
  receivers are closed with 4001, then the session is ended. A renewal it gave up on may still
  have reached the database and extended the lease for nobody: the term is released as soon as
  the database answers again.

A manager woken after a pause (SIGSTOP, a long GC pause, a frozen VM) no longer trusts its lease
by time, so it neither answers ``/health/leader`` 200 nor fires, until a renewal checked its term
(given at least RENEW_FLOOR to answer: the term may well still be its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

import psycopg

from queue_manager.manager import store
from queue_manager.manager.config import LEASE_MARGIN
from queue_manager.manager.runtime import Runtime
from queue_manager.manager.store import AsyncConn

logger = logging.getLogger(__name__)

#: how soon a lost connection to the database is tried again, seconds
RECONNECT_DELAY = 0.25
#: a dispatcher that starts no round for this long is stuck: its session is failed
STALL_AFTER = 30.0
#: while the database stays unreachable, a reminder is logged this often, seconds
OUTAGE_REMINDER = 30.0
#: a holder that has had no connection to the database for this long is taken over before its lease
#: expires, seconds: its process died (its connections closed with it). A live leader whose
#: connections were cut notices at once (its session fails) and reconnects after RECONNECT_DELAY.
DEAD_HOLDER_GRACE = 1.0
#: a standby wakes this long after the expiry it read (the database clock runs on meanwhile)
EXPIRY_SLACK = 0.005


class Move(Enum):
    """What a standby does after reading the lease."""

    #: the lease has expired: take it (qm.acquire_leadership)
    ACQUIRE = "acquire"
    #: its holder has had no connection for DEAD_HOLDER_GRACE: take it (qm.take_over_leadership)
    TAKE_OVER = "take_over"
    #: read it again later
    WAIT = "wait"


@dataclass(frozen=True, slots=True)
class Step:
    move: Move
    #: seconds to sleep when nothing was taken
    sleep: float


class Succession:
    """A standby's reading of the lease, poll after poll, pure: take it when it has expired, or when
    its holder has been seen without a connection to the database, for the same term and backend,
    for DEAD_HOLDER_GRACE (a killed leader's connections close with its process, so the shard is
    led again about a second after a crash instead of a whole lease after it). Sleep until the next
    poll, and no longer than until the expiry read or the end of the grace."""

    def __init__(self, grace: float = DEAD_HOLDER_GRACE) -> None:
        self.grace = grace
        #: (term, backend) last seen gone, and since when (monotonic)
        self._gone: tuple[int, int] | None = None
        self._gone_since = 0.0

    def next(self, lease: store.LeaseView, now: float, poll: float) -> Step:
        if lease.expires_in <= 0:
            self._gone = None
            return Step(Move.ACQUIRE, poll)
        sleep = min(poll, lease.expires_in + EXPIRY_SLACK)
        if lease.connected or lease.holder_pid is None:
            self._gone = None
            return Step(Move.WAIT, sleep)
        seen = (lease.term, lease.holder_pid)
        if self._gone != seen:
            self._gone, self._gone_since = seen, now
        left = self._gone_since + self.grace - now
        if left <= 0:
            return Step(Move.TAKE_OVER, sleep)
        return Step(Move.WAIT, min(sleep, left))


def _ignore_outcome(task: asyncio.Future[Any]) -> None:
    """Retrieve the result of an abandoned task, so that its failure is not reported as never retrieved."""
    if not task.cancelled():
        task.exception()


class OutageLog:
    """One line when the database is lost, a reminder every OUTAGE_REMINDER seconds, one line when
    it is back: not a line per reconnection attempt (four a second)."""

    def __init__(self, log: logging.Logger, clock: Callable[[], float]) -> None:
        self._log = log
        self._clock = clock
        self._since: float | None = None
        self._reminded = 0.0
        self._attempts = 0

    @property
    def down(self) -> bool:
        return self._since is not None

    def failed(self, error: str) -> None:
        now = self._clock()
        self._attempts += 1
        if self._since is None:
            self._since = self._reminded = now
            self._attempts = 1
            self._log.warning("shard database unreachable", extra={"action": "db_lost", "error": error[:300]})
        elif now - self._reminded >= OUTAGE_REMINDER:
            self._reminded = now
            self._log.warning(
                "shard database still unreachable",
                extra={
                    "action": "db_still_lost",
                    "down_s": round(now - self._since, 1),
                    "attempts": self._attempts,
                    "error": error[:300],
                },
            )

    def succeeded(self) -> None:
        if self._since is None:
            return
        down = self._clock() - self._since
        self._log.warning(
            "shard database reachable again",
            extra={"action": "db_back", "down_s": round(down, 1), "attempts": self._attempts},
        )
        self._since = None


class LeaderSession(Protocol):
    """What the loop needs of a term's session (``TermSession``)."""

    @property
    def failed(self) -> BaseException | None: ...

    @property
    def failed_event(self) -> asyncio.Event: ...

    def stalled(self, now: float, after: float) -> bool: ...

    def fail(self, exc: BaseException) -> None: ...

    async def close(self) -> None: ...


class WrongShard(SystemExit):
    """The configured shard is not the database's."""


class Leadership:
    """The leadership loop of one manager process."""

    def __init__(
        self,
        rt: Runtime,
        open_session: Callable[[int], Awaitable[LeaderSession]],
        stepped_down: Callable[[], Awaitable[None]],
    ) -> None:
        self.rt = rt
        self._open_session = open_session
        self._stepped_down = stepped_down
        self.session: LeaderSession | None = None
        self._ctl: AsyncConn | None = None
        #: monotonic time since which this leader has had no working session (None: it has one)
        self._unhealthy_since: float | None = None
        #: after giving the lease up, do not compete again before this monotonic time
        self._cool_off_until = 0.0
        self.outage = OutageLog(logger, rt.clock.monotonic)
        self.succession = Succession()
        #: a term whose renewal was given up on while it may have reached the database: released
        #: (if still ours) once the database answers again, not left to run out for nobody
        self._abandoned: int | None = None

    async def run(self) -> None:
        rt = self.rt
        cfg = rt.config
        lease = rt.lease
        clock = rt.clock
        while True:
            try:
                ctl = await self._control()
                self.outage.succeeded()
                if self._abandoned is not None and lease.term is None:
                    await self._release_abandoned(ctl)
                if lease.term is None:
                    await self._compete(ctl)
                    continue
                s = self.session
                if s is None or s.failed is not None:
                    await self._restart(ctl)
                    continue
                # leading with a working session: renew on schedule, at once if the session fails
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(cfg.renew_interval):
                        await s.failed_event.wait()
                if s.failed is None and s.stalled(clock.monotonic(), STALL_AFTER):
                    s.fail(RuntimeError(f"the dispatcher started no round for {STALL_AFTER:g} s"))
                if s.failed is not None:
                    continue  # _restart renews, once, before the next session (not here as well)
                await self._renew_within_trust(ctl)
            except asyncio.CancelledError:
                raise
            except (psycopg.Error, OSError) as exc:  # OSError includes TimeoutError
                self.outage.failed(str(exc).strip() or type(exc).__name__)
                await self._drop_control()
                if lease.term is not None and not lease.trusted(clock.monotonic()):
                    # receivers first (closed with 4001): ending a session whose connections hang can take long
                    await self.step_down("lease could not be renewed")
                else:
                    await self._end_session()
                await asyncio.sleep(RECONNECT_DELAY)

    async def _renew_within_trust(self, ctl: AsyncConn) -> None:
        """Renew, but wait no longer than until the lease may have expired in the database (the
        trust left plus its margin: from then on a standby may hold it). On a link gone silent (a
        partition that drops packets, not connections) a renewal would wait for TCP to give up, and
        the receivers would stay on a leader that no longer leads. Cancelling the statement would not
        help: psycopg then sends a cancel request over the same silent network and waits seconds for
        it. So the renewal is left behind, its connection closed under it, and the wait ends as a
        TimeoutError (an OSError: the caller's outage path, which steps down, the trust being over).
        A renewal that is only slow (a loaded machine) and answers before then keeps the lease."""
        lease, clock = self.rt.lease, self.rt.clock
        term = lease.term
        renewal = asyncio.ensure_future(self._renew(ctl))
        # At least RENEW_FLOOR: a manager whose trust ran out while it was paused or starved
        # already claims nothing, and its term may still be its own. Given no time at all, its
        # renewal was abandoned after it had been sent: it extended the lease in the database for
        # a manager that had stepped down, and the shard waited a whole lease for the next leader.
        budget = max(self.rt.config.renew_interval, lease.trusted_until + LEASE_MARGIN - clock.monotonic())
        done, _ = await asyncio.wait({renewal}, timeout=budget)
        if renewal in done:
            renewal.result()
            return
        renewal.add_done_callback(_ignore_outcome)
        self._abandoned = term
        await self._drop_control()
        renewal.cancel()
        raise TimeoutError("the lease renewal got no answer before the lease's trust ran out")

    async def _release_abandoned(self, ctl: AsyncConn) -> None:
        """End the lease of a term whose renewal was given up on, if it is still this manager's."""
        term, self._abandoned = self._abandoned, None
        if term is not None and await store.resign(ctl, self.rt.config.holder, term):
            logger.info("released a term whose renewal was given up on", extra={"action": "resign", "term": term})

    async def _control(self) -> AsyncConn:
        """The control connection (lease statements), opened and checked on first use."""
        if self._ctl is not None and not self._ctl.closed:
            return self._ctl
        cfg = self.rt.config
        self._ctl = await store.connect(cfg.dsn, f"qm-manager-ctl {cfg.holder}")
        name = await store.shard_name(self._ctl)
        if cfg.shard is not None and name != cfg.shard:
            logger.error("wrong shard", extra={"action": "start", "expected": cfg.shard, "found": name})
            raise WrongShard(f"the database is shard {name!r}, not {cfg.shard!r}")
        self.rt.shard_name = name
        if self.rt.tracer is not None:
            self.rt.tracer.shard = name
        self.rt.shard_checked = True
        return self._ctl

    async def _drop_control(self) -> None:
        if self._ctl is not None:
            with contextlib.suppress(Exception):
                await self._ctl.close()
        self._ctl = None

    async def _compete(self, ctl: AsyncConn) -> None:
        rt = self.rt
        cfg = rt.config
        now = rt.clock.monotonic()
        if now < self._cool_off_until:
            await asyncio.sleep(min(cfg.standby_poll, self._cool_off_until - now))
            return
        started = rt.clock.monotonic()
        seen = await store.lease(ctl)
        step = self.succession.next(seen, rt.clock.monotonic(), cfg.standby_poll)
        term = None
        if step.move is Move.ACQUIRE:
            term = await store.acquire(ctl, cfg.holder, cfg.lease_ttl)
        elif step.move is Move.TAKE_OVER and seen.holder_pid is not None:
            term = await store.take_over(ctl, cfg.holder, cfg.lease_ttl, seen.term, seen.holder_pid)
            if term is not None:
                logger.warning(
                    "took over from a holder with no connection left",
                    extra={
                        "action": "take_over",
                        "term": term,
                        "from_term": seen.term,
                        "lease_left_s": round(seen.expires_in, 3),
                    },
                )
        rt.signals.lease_tried.emit(term)
        if term is None:
            await asyncio.sleep(step.sleep)
            return
        rt.lease.granted(term, started)
        self._unhealthy_since = None
        logger.info("leadership acquired", extra={"action": "lead", "term": term})
        await self._start_session(term)

    async def _renew(self, ctl: AsyncConn) -> bool:
        """Renew the lease; step down when the database refuses (the term moved on)."""
        rt = self.rt
        term = rt.lease.term
        assert term is not None
        started = rt.clock.monotonic()
        if await store.renew(ctl, rt.config.holder, term, rt.config.lease_ttl):
            rt.lease.granted(term, started)
            self._abandoned = None
            rt.wake.set()  # a dispatcher that stopped trusting the lease (a pause) may go on
            rt.role_changed()  # and /health/leader's held probes may answer 200 again
            return True
        await self.step_down("lease taken over")
        return False

    async def _restart(self, ctl: AsyncConn) -> None:
        """Leading without a working session: renew, then start a session, or give the lease up."""
        rt = self.rt
        now = rt.clock.monotonic()
        await self._end_session()
        if self._unhealthy_since is None:
            self._unhealthy_since = now
        if not await self._renew(ctl):
            return
        if now - self._unhealthy_since >= rt.config.recovery_deadline:
            await self.resign(f"unable to dispatch for {now - self._unhealthy_since:.1f} s")
            return
        term = rt.lease.term
        assert term is not None
        try:
            await self._start_session(term)
        except (psycopg.Error, OSError) as exc:
            logger.warning(
                "session could not start", extra={"action": "session_start", "term": term, "error": str(exc)[:300]}
            )
            await asyncio.sleep(RECONNECT_DELAY)

    async def _start_session(self, term: int) -> None:
        self.session = await self._open_session(term)
        self._unhealthy_since = None

    async def _end_session(self) -> None:
        s, self.session = self.session, None
        if s is not None:
            await s.close()

    async def step_down(self, why: str) -> None:
        """Stop leading: drop the lease first (no claim to lead from here on), then close receivers and the session."""
        rt = self.rt
        logger.warning("stepping down", extra={"action": "step_down", "term": rt.lease.term, "reason": why})
        rt.lease.dropped()
        await self._stepped_down()
        await self._end_session()

    async def resign(self, why: str) -> None:
        """Give the lease up at once so that a standby takes over, and keep out for a moment."""
        rt = self.rt
        term = rt.lease.term
        await self.step_down(why)
        self._cool_off_until = rt.clock.monotonic() + rt.config.lease_ttl
        if term is not None and self._ctl is not None:
            with contextlib.suppress(psycopg.Error, OSError):
                await store.resign(self._ctl, rt.config.holder, term)

    async def release(self) -> None:
        """On shutdown: end the session and hand the lease over without waiting out its TTL."""
        rt = self.rt
        await self._end_session()
        term = rt.lease.term
        rt.lease.dropped()
        if term is not None and self._ctl is not None:
            with contextlib.suppress(Exception):
                await store.resign(self._ctl, rt.config.holder, term)
                logger.info("leadership released", extra={"action": "resign", "term": term})
        await self._drop_control()
