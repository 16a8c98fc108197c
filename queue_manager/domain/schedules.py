"""Periodic schedules, pure: a schedule's definition checked, its slots (APScheduler 3's cron and
interval triggers), and what the shard's leader enqueues at each pass (the misfire policies).

A schedule is a row of ``qm.schedules`` on the shard that owns its tenant. The leader
(``manager/schedules.py``) enqueues each slot ahead of time as an ordinary event with
``fire_at`` = the slot's instant and the dedup key :func:`dedup_key`; this module decides which
slots, from the schedule's cursor ``next_at`` (the first slot not enqueued yet) and the time:

- slots up to ``now + lookahead`` are enqueued (the lookahead is at least the queue's window, so
  each slot sits in the manager's window cache before it is due and fires at its instant);
- slots before ``now - grace`` were *missed*: nothing led the shard when they should have been
  enqueued (a lookahead's worth of time without a leader). The misfire policy says what becomes of
  them: ``skip`` (none), ``latest`` (the latest one, once, at once), ``catch_up`` (the last
  ``catch_up`` of them, each at once). A slot between ``now - grace`` and ``now`` is not missed: it
  is enqueued and fires at once.

Time zones and DST: cron slots are the instants at which the wall clock of ``timezone`` matches
the expression. A wall time that does not exist (spring forward) fires once, at the instant the
clock jumps to (02:30 becomes 03:30); a wall time that occurs twice (fall back) fires once, at its
first occurrence, when the expression names its hours; an expression whose hour field is ``*``
(``*/15 * * * *``) fires at every matching instant, both passes of the repeated hour included.
Intervals count real seconds from their anchor, whatever the zone. Every instant here is an aware
``datetime``; slots are computed from UTC instants (APScheduler 3 loops in the repeated hour when
it is handed local times).

Everything typed by a user is checked by :func:`check`: a clear :class:`ScheduleError` (an
:class:`~queue_manager.errors.InvalidInputError`) names what is wrong and what is expected.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger

from queue_manager.errors import InvalidInputError

Misfire = Literal["skip", "latest", "catch_up"]
MISFIRES: tuple[Misfire, ...] = ("skip", "latest", "catch_up")
#: the shortest interval (the issue's floor: a slot is an event, and one a second per schedule is plenty)
MIN_INTERVAL = 1.0
#: the longest interval: a leap year
MAX_INTERVAL = 366 * 86400.0
MAX_CATCH_UP = 1000
#: a schedule's name: as qm.schedules' CHECK
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,99}")
#: slots walked for one schedule in one pass at most (a long gap of a cron schedule takes several)
WALK = 10_000
_TICK = timedelta(microseconds=1)


class ScheduleError(InvalidInputError):
    """A schedule's definition is not valid."""


@dataclass(frozen=True)
class Spec:
    """What decides a schedule's slots."""

    cron: str | None
    interval: float | None
    timezone: str
    #: interval slots are anchor + k * interval (k >= 0)
    anchor: datetime
    misfire: Misfire = "latest"
    catch_up: int = 1


def zone(name: str) -> ZoneInfo:
    """The IANA time zone ``name``; ScheduleError when there is none."""
    if not isinstance(name, str) or not name or len(name) > 64 or name != name.strip():
        raise ScheduleError(f"unknown time zone {str(name)[:64]!r}; use an IANA name such as UTC or Europe/Berlin")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise ScheduleError(f"unknown time zone {name!r}; use an IANA name such as UTC or Europe/Berlin") from None


def check_name(name: str) -> str:
    if not isinstance(name, str) or NAME.fullmatch(name) is None:
        raise ScheduleError(
            f"schedule name {str(name)[:60]!r} is not valid: 1 to 100 characters, "
            "letters, digits and _ . : - (not first)"
        )
    return name


def check(spec: Spec) -> Trigger:
    """The trigger of ``spec``, every field checked: exactly one of a cron expression and an
    interval, the interval within [1 s, 366 days], a known time zone, a known misfire policy."""
    tz = zone(spec.timezone)
    if (spec.cron is None) == (spec.interval is None):
        raise ScheduleError(
            "give either a cron expression (--cron '0 3 * * *') or an interval (--every 30s), "
            + ("not both" if spec.cron is not None else "one of them")
        )
    if spec.misfire not in MISFIRES:
        raise ScheduleError(f"misfire must be one of {', '.join(MISFIRES)}, got {str(spec.misfire)[:30]!r}")
    if isinstance(spec.catch_up, bool) or not isinstance(spec.catch_up, int) or not 1 <= spec.catch_up <= MAX_CATCH_UP:
        raise ScheduleError(f"catch_up must be an integer from 1 to {MAX_CATCH_UP}, got {spec.catch_up!r}")
    if spec.anchor.tzinfo is None:
        raise ScheduleError("the anchor (start) must carry its offset, e.g. 2026-12-01T09:00:00+01:00")
    if spec.cron is not None:
        return Trigger.cron(spec.cron, tz)
    interval = spec.interval
    if (
        isinstance(interval, bool)
        or not isinstance(interval, int | float)
        or interval != interval
        or not MIN_INTERVAL <= interval <= MAX_INTERVAL
    ):
        raise ScheduleError(f"the interval must be from 1 second to 366 days, got {interval!r} s")
    return Trigger.every(float(interval), spec.anchor, tz)


class Trigger:
    """A schedule's slots: the first at or after an instant, by APScheduler's trigger, plus the
    rule for the repeated hour of a fall-back (module docstring)."""

    __slots__ = ("_fixed_hours", "_trigger", "interval", "tz")

    def __init__(self, trigger: CronTrigger | IntervalTrigger, tz: ZoneInfo, interval: float | None, fixed: bool):
        self._trigger = trigger
        self.tz = tz
        self.interval = interval
        self._fixed_hours = fixed

    @classmethod
    def cron(cls, expr: str, tz: ZoneInfo) -> Trigger:
        text = expr.strip() if isinstance(expr, str) else ""
        fields = text.split()
        if len(text) > 200 or len(fields) != 5:
            raise ScheduleError(
                f"cron expression {str(expr)[:60]!r} is not valid: give 5 fields (minute hour day month weekday), "
                "e.g. '0 3 * * *'"
            )
        try:
            trigger = CronTrigger.from_crontab(text, timezone=tz)
        except (ValueError, KeyError, TypeError) as exc:
            raise ScheduleError(f"cron expression {text[:60]!r} is not valid: {exc}") from None
        # an expression that can never match (30 February) is refused rather than never firing
        probe = trigger.get_next_fire_time(None, datetime(2000, 1, 1, tzinfo=UTC))
        if probe is None:
            raise ScheduleError(f"cron expression {text!r} never matches a date")
        return cls(trigger, tz, None, "*" not in fields[1])

    @classmethod
    def every(cls, seconds: float, anchor: datetime, tz: ZoneInfo) -> Trigger:
        return cls(IntervalTrigger(seconds=seconds, start_date=anchor, timezone=tz), tz, seconds, False)

    def first_at_or_after(self, t: datetime) -> datetime | None:
        """The first slot at or after instant ``t`` (None: no more)."""
        while True:
            found: datetime | None = self._trigger.get_next_fire_time(None, t.astimezone(UTC))
            if found is None:
                return None
            nxt = found.astimezone(UTC)
            if nxt < t:  # never earlier than asked (a guard against the library's DST corners)
                t += timedelta(seconds=1)
                continue
            if self._fixed_hours and self._repeated(nxt):
                t = nxt + _TICK
                continue
            return nxt

    def _repeated(self, t: datetime) -> bool:
        """``t`` shows a wall time that the zone showed once before, an hour or so earlier (the
        second pass of a fall-back's repeated hour)."""
        local = t.astimezone(self.tz)
        if not local.fold:
            return False
        first = local.replace(fold=0)
        return first.utcoffset() != local.utcoffset()

    def slots(self, start: datetime, end: datetime, limit: int) -> list[datetime]:
        """The slots in [start, end], ascending, at most ``limit``."""
        out: list[datetime] = []
        if self.interval is not None:
            # the trigger finds the first; the next ones are a step apart (its own arithmetic), so
            # a pass that takes one slot asks it once, not twice
            first = self.first_at_or_after(start)
            step = timedelta(seconds=self.interval)
            while first is not None and first <= end and len(out) < limit:
                out.append(first)
                first += step
            return out
        t = start
        while len(out) < limit:
            s = self.first_at_or_after(t)
            if s is None or s > end:
                break
            out.append(s)
            t = s + _TICK
        return out

    def next_runs(self, after: datetime, count: int) -> list[datetime]:
        """The next ``count`` slots at or after ``after`` (for ``qm schedule list`` and the dashboard)."""
        return self.slots(after, datetime.max.replace(tzinfo=UTC) - timedelta(days=2), count)


@dataclass(frozen=True)
class Pass:
    """What one pass of the leader does with one schedule."""

    #: slots to enqueue now, ascending (missed ones the policy keeps first, due at once)
    enqueue: list[datetime]
    #: slots the misfire policy skipped
    missed: int
    #: the schedule's new cursor: slots from here on are not enqueued yet
    next_at: datetime


def plan(
    trigger: Trigger,
    spec: Spec,
    next_at: datetime,
    now: datetime,
    lookahead: float,
    grace: float,
    limit: int = 1000,
) -> Pass:
    """The slots to enqueue for a schedule whose cursor is ``next_at``, at database time ``now``:
    the missed ones the policy keeps, then every slot up to ``now + lookahead`` (at most ``limit``
    in all; the rest wait for the next pass). Pure: same inputs, same answer."""
    late = now - timedelta(seconds=grace)
    horizon = now + timedelta(seconds=lookahead)
    missed: list[datetime] = []
    skipped = 0
    cursor = next_at
    if cursor < late:
        keep = {"skip": 0, "latest": 1, "catch_up": spec.catch_up}[spec.misfire]
        if trigger.interval is not None:
            # an interval's missed slots are counted, not walked: the first one not missed, and back
            first_ok = trigger.first_at_or_after(late)
            first_missed = trigger.first_at_or_after(cursor)
            if first_ok is not None and first_missed is not None and first_missed < first_ok:
                step = timedelta(seconds=trigger.interval)
                n = round((first_ok - first_missed) / step)
                kept = min(keep, n)
                missed = [first_ok - step * (kept - i) for i in range(kept)]
                skipped = n - kept
            cursor = first_ok if first_ok is not None else horizon + _TICK
        else:
            walked = trigger.slots(cursor, late - _TICK, WALK)
            if len(walked) == WALK:  # a long gap: this pass walks part of it, the next goes on
                return Pass([], len(walked), walked[-1] + _TICK)
            missed = walked[len(walked) - keep :] if keep else []
            skipped = len(walked) - len(missed)
            cursor = late
    ahead = trigger.slots(cursor, horizon, max(0, limit - len(missed)))
    out = missed + ahead
    # more due within the lookahead than one pass takes: the next pass goes on after the last
    full = bool(ahead) and len(ahead) == limit - len(missed)
    return Pass(out, skipped, ahead[-1] + _TICK if full else max(cursor, horizon + _TICK))


def dedup_key(schedule_id: int, slot: datetime) -> str:
    """The slot event's dedup key: the schedule and the slot's instant in microseconds since the
    epoch. Unique per (tenant, key) in the queue table, so a slot is enqueued at most once however
    many times a leader tries."""
    return f"qm:schedule:{schedule_id}:{micros(slot)}"


def micros(t: datetime) -> int:
    delta = t - datetime(1970, 1, 1, tzinfo=UTC)
    return (delta.days * 86400 + delta.seconds) * 1_000_000 + delta.microseconds
