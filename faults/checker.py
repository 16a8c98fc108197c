"""The checker: reads a whole history (faults.history) and counts what broke a guarantee.

Pure: records in, a :class:`Report` out; no clock, no I/O. The definitions (docs/faults.md):

* **lost**: an event whose enqueue committed and that was neither acked (a confirmed ack in the
  history, or ``acked`` in the final read of the database) nor dead-lettered (``failed``);
* **unexpected**: a delivery of a key that never committed (rolled back, skipped as a duplicate
  dedup key, or never enqueued). Keys whose commit outcome is unknown may or may not be delivered.
  Each key is enqueued once, as one row: deliveries of one key under two event ids (a bulk load
  that published a row twice) count the second row's as unexpected too;
* **early**: a delivery recorded before the event's ``fire_at`` (less a tolerance for the
  microsecond rounding of the two clocks' readings: the same clock, see faults.history);
* **after_ack**: a delivery recorded after a confirmed ack of the same event, of a later attempt
  (a fire after the ack) or of the acked attempt again (a second push of it). A delivery of an
  *earlier* attempt recorded late is a push sent before the ack that a frozen receiver read only
  when it woke: not a fire after the ack;
* **cross_tenant**: a delivery whose tenant is not the tenant the key was enqueued for, or not one
  of the tenants the receiver subscribed to;
* **deposed_deliveries**: a delivery fired by a leader whose term was already superseded. Terms
  grow at every takeover and each fire adds one to the event's attempts, so for one event a higher
  attempt never comes from a lower term: an attempt delivered under term T after a lower attempt of
  the same event was delivered under a term above T was fired by a deposed leader. So is an attempt
  delivered under two different terms (two leaders fired the same attempt number);
* **duplicates**: deliveries of a key beyond its first (allowed: delivery is at least once);
* **max_stall_s**: the longest time a committed event waited, from when it was due (its
  ``fire_at``, or its commit when later) to its first delivery, counting only the time when some
  receiver that may take it (alive, not paused, its tenant filter admitting the event) was up.
  An SQL ack that rolled back makes the event due again (its record's ``due_again``: the rollback,
  or the ack deadline when later); the wait from then to its next delivery (of a later attempt)
  counts the same way, unless no later attempt was delivered and the final read has the event
  settled: its socket ack after the rollback committed though the answer was lost (a reset of
  the manager's link), so it was never due again.
  A round whose ``nemesis`` start record has ``exempt_s`` exempts the events that became due within
  that many seconds of its start (before or after): those a fault is expected to hold, such as
  the events in hand of a receiver frozen at the start;
* **recovery_s_p99**: per round, the time from the fault's start to the first delivery, on a
  shard the fault hit, of an event committed after the fault started; the p99 over rounds;
* **key_over_limit** (with ``key_max_in_flight``): fires of an event of a concurrency key that
  made more of that key's events in hand than the limit. An event is in hand from its fire to its
  settle or its return to the queue, as the shard's database recorded each change of its state
  (``state`` records, from the fault suite's trigger on the queue table): exactly what the limit
  bounds, "fired and unsettled". (A receiver's handler runs within that interval unless the event
  outlives its ack deadline, which the key scenarios' receivers do not);
* **key_over_rate** (with ``key_max_qps``): the 1 s windows in which a rate key was fired more than
  its rate plus one (the burst of one token), less RATE_JITTER of slack for the moment a fire's
  statement records it after the manager admitted it; counted once per fire that ends such a window.
* **slots**, **slots_missing**, **slots_twice** (periodic schedules, ``schedule`` records): the
  slot events enqueued (``enqueued`` records whose key is a slot's dedup key,
  ``qm:schedule:<id>:<microseconds>``), the slots of each schedule's interval grid between its first
  and its last enqueued slot that were not enqueued (none may be: the schedules of the suite skip
  missed slots, and a leader's gap never outlasts the lookahead), and the slots enqueued as more
  than one row. A slot event is an event like the others for every check above (lost, early,
  duplicates, the stall bound).

``pass`` is true when every safety count is 0 and ``max_stall_s`` is within the scenario's bound.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Record = Mapping[str, Any]

#: the JSON line's fields, in order
FIELDS = (
    "scenario",
    "rounds",
    "events",
    "lost",
    "unexpected",
    "early",
    "after_ack",
    "cross_tenant",
    "deposed_deliveries",
    "key_over_limit",
    "key_over_rate",
    "duplicates",
    "max_stall_s",
    "recovery_s_p99",
    "slots",
    "slots_missing",
    "slots_twice",
    "pass",
)
#: the counts that must be 0
SAFETY = (
    "lost",
    "unexpected",
    "early",
    "after_ack",
    "cross_tenant",
    "deposed_deliveries",
    "slots_missing",
    "slots_twice",
    "key_over_limit",
    "key_over_rate",
)
#: the dedup key of a schedule's slot event (queue_manager/domain/schedules.py)
SLOT_PREFIX = "qm:schedule:"
#: two readings of one clock, each rounded to a microsecond, may disagree by this much
EARLY_TOLERANCE = 0.002
#: violations kept per kind in Report.examples
EXAMPLES = 5
#: the final states of an event no receiver is owed again
SETTLED = ("acked", "cancelled", "failed")
#: how much later than its admission a fire's statement may record it (the rate check's slack)
RATE_JITTER = 0.05


@dataclass
class Report:
    scenario: str
    rounds: int
    events: int
    lost: int
    unexpected: int
    early: int
    after_ack: int
    cross_tenant: int
    deposed_deliveries: int
    duplicates: int
    max_stall_s: float
    recovery_s_p99: float | None
    stall_bound_s: float
    slots: int = 0
    slots_missing: int = 0
    slots_twice: int = 0
    #: the worst stall of each round (round 0: before the first fault)
    stall_by_round: dict[int, float] = field(default_factory=dict)
    #: a few offending records per violated check
    examples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    key_over_limit: int = 0
    key_over_rate: int = 0
    #: per key limit check: the most events of one key ever in hand at once, and of one rate key
    #: fired in one second
    key_most_in_hand: int = 0
    key_most_per_second: int = 0
    #: fires that found their key at its limit (the limit bound then)
    key_fires_at_limit: int = 0

    @property
    def passed(self) -> bool:
        return all(getattr(self, name) == 0 for name in SAFETY) and self.max_stall_s <= self.stall_bound_s

    def line(self) -> dict[str, Any]:
        """The scenario's JSON line: exactly FIELDS."""
        out = {name: getattr(self, name) for name in FIELDS if name != "pass"}
        out["max_stall_s"] = round(self.max_stall_s, 3)
        out["recovery_s_p99"] = None if self.recovery_s_p99 is None else round(self.recovery_s_p99, 3)
        out["pass"] = self.passed
        return out


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _covered(intervals: Sequence[tuple[float, float]], a: float, b: float) -> float:
    """How much of [a, b] the (merged) intervals cover."""
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in intervals if y > a and x < b)


def p99(values: Sequence[float]) -> float | None:
    """Nearest-rank 99th percentile (the largest of fewer than 100 values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def key_limits(
    states: Sequence[Record], key_max_in_flight: int | None, key_max_qps: float | None
) -> tuple[int, int, int, int, int, dict[str, list[dict[str, Any]]]]:
    """(fires over the in-flight limit, windows over the rate, most in hand at once, most fired in
    a second, fires that reached the limit, examples) from the ``state`` records: each a change of
    an event's state as its shard's database recorded it (k, shard, tenant, ckey, rkey, attempt,
    old, new), in time order."""
    over_limit = over_rate = most = fastest = at_limit = 0
    examples: dict[str, list[dict[str, Any]]] = defaultdict(list)
    in_hand: dict[tuple[str, str], set[tuple[str, str]]] = defaultdict(set)
    fires: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in states:
        event = (str(r["shard"]), str(r["k"]))
        if r.get("ckey") is not None:
            key = (str(r["tenant"]), str(r["ckey"]))
            held = in_hand[key]
            if r["new"] == "fired":
                held.add(event)
                most = max(most, len(held))
                if key_max_in_flight is not None and len(held) == key_max_in_flight:
                    at_limit += 1
                if key_max_in_flight is not None and len(held) > key_max_in_flight:
                    over_limit += 1
                    if len(examples["key_over_limit"]) < EXAMPLES:
                        examples["key_over_limit"].append({**r, "in_hand": sorted(held)})
            elif r["old"] == "fired":
                held.discard(event)
        if r.get("rkey") is not None and r["new"] == "fired":
            fires[(str(r["tenant"]), str(r["rkey"]))].append(float(r["t"]))
    for key, times in fires.items():
        start = 0
        for end, t in enumerate(times):
            while times[start] <= t - 1.0:
                start += 1
            n = end - start + 1
            fastest = max(fastest, n)
            if key_max_qps is not None and n > math.floor(key_max_qps * (1.0 + RATE_JITTER)) + 1:
                over_rate += 1
                if len(examples["key_over_rate"]) < EXAMPLES:
                    examples["key_over_rate"].append({"tenant": key[0], "rkey": key[1], "t": t, "fires_in_1s": n})
    return over_limit, over_rate, most, fastest, at_limit, dict(examples)


def check(
    records: Iterable[Record],
    *,
    scenario: str,
    stall_bound_s: float,
    key_max_in_flight: int | None = None,
    key_max_qps: float | None = None,
) -> Report:
    """Check a history (records in any order; they are sorted by ``t``)."""
    recs = sorted(records, key=lambda r: float(r["t"]))
    end = float(recs[-1]["t"]) if recs else 0.0
    examples: dict[str, list[dict[str, Any]]] = defaultdict(list)

    def flag(kind: str, rec: Record, **why: Any) -> None:
        if len(examples[kind]) < EXAMPLES:
            examples[kind].append({**rec, **why})

    committed: dict[str, Record] = {}
    not_committed: set[str] = set()
    unknown: set[str] = set()
    deliveries: dict[str, list[Record]] = defaultdict(list)
    acked_at: dict[str, float] = {}
    acked_attempt: dict[str, int] = {}
    final: dict[str, str] = {}
    # receiver availability: name -> (tenants filter or None, up since or None, intervals)
    scopes: dict[str, frozenset[str] | None] = {}
    up_since: dict[str, float | None] = {}
    up: dict[str, list[tuple[float, float]]] = defaultdict(list)
    rounds: list[tuple[int, float, frozenset[str]]] = []  # (round, start, shards)
    exempt: list[tuple[float, float]] = []
    due_again: list[tuple[str, float, int]] = []  # (k, due again at, attempt rolled back)
    states: list[Record] = []
    intervals: dict[str, float] = {}  # schedule id -> its interval (seconds)
    slot_rows: dict[str, int] = defaultdict(int)  # slot key -> enqueued records

    for r in recs:
        kind, t = r["kind"], float(r["t"])
        if kind == "schedule":
            intervals[str(r["schedule_id"])] = float(r["interval_s"])
        elif kind == "enqueued":
            if str(r["k"]).startswith(SLOT_PREFIX):
                slot_rows[r["k"]] += 1
            outcome = r["outcome"]
            if outcome == "commit":
                committed[r["k"]] = r
            elif outcome == "unknown":
                unknown.add(r["k"])
            else:
                not_committed.add(r["k"])
        elif kind == "deliver":
            deliveries[r["k"]].append(r)
        elif kind == "ack" and r.get("outcome") == "ok":
            if r["k"] not in acked_at:
                acked_at[r["k"]] = t
                acked_attempt[r["k"]] = int(r.get("attempt") or 0)
        elif kind == "ack" and r.get("due_again") is not None:
            due_again.append((r["k"], float(r["due_again"]), int(r.get("attempt") or 0)))
        elif kind == "final":
            final[r["k"]] = r["state"]
        elif kind == "state":
            states.append(r)
        elif kind == "receiver":
            name = r["r"]
            if r["state"] == "up":
                tenants = r.get("tenants")
                scopes[name] = None if tenants is None else frozenset(tenants)
                if up_since.get(name) is None:
                    up_since[name] = t
            else:
                since = up_since.get(name)
                if since is not None:
                    up[name].append((since, t))
                up_since[name] = None
        elif kind == "nemesis" and r["phase"] == "start":
            rounds.append((int(r["round"]), t, frozenset(r.get("shards") or ())))
            if r.get("exempt_s"):
                exempt.append((t - float(r["exempt_s"]), t + float(r["exempt_s"])))
    for name, since in up_since.items():
        if since is not None:
            up[name].append((since, end))

    # ---- safety
    lost = 0
    for k, rec in committed.items():
        if k not in acked_at and final.get(k) not in SETTLED:
            lost += 1
            flag("lost", rec, final_state=final.get(k), deliveries=len(deliveries.get(k, ())))
    unexpected = early = after_ack = cross = deposed = duplicates = 0
    for k, ds in deliveries.items():
        duplicates += len(ds) - 1
        rows: dict[tuple[str, int], Record] = {}
        for d in ds:
            rows.setdefault((d["shard"], int(d["id"])), d)
        for d in list(rows.values())[1:]:
            unexpected += 1
            flag("unexpected", d, why="a second row of the key", first_row=next(iter(rows)))
        enqueued = committed.get(k)
        if enqueued is None:
            if k not in unknown:
                unexpected += len(ds)
                for d in ds:
                    flag("unexpected", d, enqueue_outcome="rollback or skipped" if k in not_committed else "none")
            continue
        rec = enqueued
        fire_at = rec.get("fire_at")
        confirmed = acked_at.get(k)
        seen: set[int] = set()
        for d in ds:
            t = float(d["t"])
            attempt = int(d["attempt"])
            again = attempt in seen
            seen.add(attempt)
            if fire_at is not None and t < float(fire_at) - EARLY_TOLERANCE:
                early += 1
                flag("early", d, fire_at_enqueued=fire_at)
            done = acked_attempt.get(k, 0)
            if confirmed is not None and t > confirmed and (attempt > done or (attempt == done and again)):
                after_ack += 1
                flag("after_ack", d, acked_at=confirmed)
            scope = scopes.get(d["r"])
            if d["tenant"] != rec["tenant"] or (scope is not None and d["tenant"] not in scope):
                cross += 1
                flag("cross_tenant", d, enqueued_tenant=rec["tenant"])
        # fencing: along attempts, terms never go down, and one attempt has one term
        terms_of: dict[int, set[int]] = defaultdict(set)
        for d in ds:
            if d.get("term") is not None:
                terms_of[int(d["attempt"])].add(int(d["term"]))
        highest = -1
        for attempt in sorted(terms_of):
            terms = terms_of[attempt]
            bad = len(terms) > 1 or min(terms) < highest
            if bad:
                deposed += 1
                flag("deposed_deliveries", ds[0], attempt=attempt, terms=sorted(terms), earlier_term=highest)
            highest = max(highest, *terms)

    # ---- liveness
    merged_up = {name: _merge(iv) for name, iv in up.items()}
    stall_by_round: dict[int, float] = {}
    max_stall = 0.0

    def round_of(t: float) -> int:
        current = 0
        for number, start, _ in rounds:
            if start <= t:
                current = number
        return current

    waits: list[tuple[str, float, float, bool]] = []  # (k, due, delivered at, delivered at all)
    for k, rec in committed.items():
        commit_t = float(rec["t"])
        due = max(commit_t, float(rec["fire_at"])) if rec.get("fire_at") is not None else commit_t
        got = deliveries.get(k)
        first = min(float(d["t"]) for d in got) if got else end
        waits.append((k, due, first, bool(got)))
    for k, due, rolled in due_again:
        # the next fire is a later attempt (an earlier one read late by a frozen receiver is not it)
        later = [float(d["t"]) for d in deliveries.get(k, ()) if int(d["attempt"]) > rolled]
        # owed again unless the rolled-back attempt's socket ack committed though its answer was
        # lost (a reset): then the final read has it settled and no later attempt was fired
        owed = k in committed and k not in acked_at and final.get(k) not in SETTLED
        if owed or later:
            waits.append((k, due, min(later) if later else end, bool(later)))
    for k, due, first, delivered in waits:
        waiting = committed.get(k)
        if waiting is None or first <= due or any(a <= due <= b for a, b in exempt):
            continue
        able = _merge(
            [
                iv
                for name, ivs in merged_up.items()
                if scopes.get(name) is None or waiting["tenant"] in (scopes.get(name) or ())
                for iv in ivs
            ]
        )
        waited = _covered(able, due, first)
        number = round_of(due)
        stall_by_round[number] = max(stall_by_round.get(number, 0.0), waited)
        if waited > max_stall:
            max_stall = waited
            examples["max_stall"] = [
                {**waiting, "due": due, "delivered": first if delivered else None, "waited": waited}
            ]

    recoveries: list[float] = []
    for _number, start, shards in rounds:
        firsts = [
            float(d["t"])
            for k, ds in deliveries.items()
            if k in committed and float(committed[k]["t"]) >= start and committed[k]["shard"] in shards
            for d in ds
        ]
        if firsts:
            recoveries.append(min(firsts) - start)

    over_limit, over_rate, most, fastest, at_limit, key_examples = key_limits(states, key_max_in_flight, key_max_qps)
    examples.update(key_examples)
    slots_missing, slots_twice = _slots(slot_rows, intervals, flag)

    return Report(
        scenario=scenario,
        rounds=len({number for number, _, _ in rounds}),
        events=len(committed),
        lost=lost,
        unexpected=unexpected,
        early=early,
        after_ack=after_ack,
        cross_tenant=cross,
        deposed_deliveries=deposed,
        duplicates=duplicates,
        max_stall_s=max_stall,
        recovery_s_p99=p99(recoveries),
        stall_bound_s=stall_bound_s,
        slots=len(slot_rows),
        slots_missing=slots_missing,
        slots_twice=slots_twice,
        stall_by_round=stall_by_round,
        examples=dict(examples),
        key_over_limit=over_limit,
        key_over_rate=over_rate,
        key_most_in_hand=most,
        key_most_per_second=fastest,
        key_fires_at_limit=at_limit,
    )


def _slots(rows: Mapping[str, int], intervals: Mapping[str, float], flag: Any) -> tuple[int, int]:
    """Slots missing from each schedule's grid (first to last enqueued slot), and slots enqueued
    as more than one row."""
    by_schedule: dict[str, list[int]] = defaultdict(list)
    twice = 0
    for k, n in rows.items():
        sid, _, micros = k[len(SLOT_PREFIX) :].partition(":")
        by_schedule[sid].append(int(micros))
        if n > 1:
            twice += n - 1
            flag("slots_twice", {"k": k, "rows": n})
    missing = 0
    for sid, slots in by_schedule.items():
        step = round(intervals.get(sid, 0.0) * 1_000_000)
        if step <= 0:
            continue
        slots.sort()
        for a, b in itertools.pairwise(slots):
            gap = round((b - a) / step) - 1
            if gap > 0:
                missing += gap
                flag("slots_missing", {"schedule": sid, "after_us": a, "missing": gap})
    return missing, twice
