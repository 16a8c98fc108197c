"""The pure core of a reshard: the plan (which shards' ranges move to which new shards) and the
state machine a run follows and records (its phases and the cut-over's steps). No I/O.

A reshard moves whole shards, as Vitess does: the sources' ranges together are the targets'
ranges (a split ``-80`` -> ``-40``, ``40-80``; a merge, the inverse; or N to M). Its phases:

    copying    the side that serves (the sources at first) is captured and copied to the other
    cutover    a switch (or a reverse) runs its steps, each recorded once done (CUTOVER_STEPS)
    switched   the targets serve; the sources are kept in sync from them (reverse is possible)
    done       cleanup dropped the sources' rows: the reshard is over
    cancelled  cancel dropped the copy before a switch
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from queue_manager.domain.topology import KeyRange, Shard, Topology, shard_from_dict
from queue_manager.errors import ConfigurationError, TopologyError

Phase = Literal["copying", "cutover", "switched", "done", "cancelled"]
Side = Literal["sources", "targets"]

#: tries of each source's freeze when a lock is not granted in time or a deadlock ends it; between
#: two, the source takes writes for as long as a lock wait may last (the writers queued behind the
#: freeze's request go through, and a long transaction that held it back may end)
FREEZE_ATTEMPTS = 5
#: the default bound of each lock wait of the freeze, seconds: while the freeze waits for a lock,
#: the writes queued behind it wait too, so this bounds what one long writer adds to the write block
LOCK_TIMEOUT = 0.5
#: the cut-over's steps, in order; a run records each once it is done, and a rerun resumes after
#: the last one recorded (before the freeze, the other side's change capture is turned on, so
#: that the move can be reversed: it takes no writes but the copy's, which are not captured):
#:   freeze        the serving side refuses writes (QMM01, naming the other side) and its managers
#:                 are deposed (term bump): no event of the moved range changes there any more
#:   catch_up      every captured change applied (bounded; on timeout the freeze is undone), the
#:                 tenant overrides synced, the other side's sequences and term set
#:   serve         the other side serves: it takes writes and its managers take leadership
#:   topology      the topology file (renamed into place) says so; then the frozen side's capture
#:                 ends, it is marked moved, and every shard's stored map is rewritten
CUTOVER_STEPS: tuple[str, ...] = ("freeze", "catch_up", "serve", "topology")
#: steps an earlier version recorded, as the step of this one that stands for them
_OLD_STEPS = {"capture_back": "catch_up"}


def overlaps(a: KeyRange, b: KeyRange) -> bool:
    """Whether two key ranges share a keyspace id."""
    a_below_b = bool(a.end) and bool(b.start) and a.end <= b.start
    b_below_a = bool(b.end) and bool(a.start) and b.end <= a.start
    return not (a_below_b or b_below_a)


def intersection(a: KeyRange, b: KeyRange) -> KeyRange:
    """The keyspace ids in both ranges (which must overlap)."""
    start = max(a.start, b.start)
    ends = [e for e in (a.end, b.end) if e]
    return KeyRange(start, min(ends) if ends else "")


def _covered(ranges: Sequence[KeyRange]) -> list[tuple[str, str]]:
    """The union of ranges as sorted, merged [start, end) pairs ('' ends: open)."""
    end_of_keyspace = "g"  # sorts after every hex bound
    spans = sorted((r.start, r.end or end_of_keyspace) for r in ranges)
    merged: list[tuple[str, str]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return [(s, "" if e == end_of_keyspace else e) for s, e in merged]


@dataclass(frozen=True)
class ReshardPlan:
    """What a reshard moves: the sources (whole shards of the topology in force), the targets (new
    shards owning the same keyspace), and the topology once the targets serve."""

    #: the topology in force before the reshard
    old: Topology
    #: the topology after it: the old one without the sources, with the targets
    new: Topology
    sources: tuple[Shard, ...]
    targets: tuple[Shard, ...]

    @property
    def kind(self) -> str:
        """split (1 -> N), merge (N -> 1) or reshard (N -> M)."""
        if len(self.sources) == 1 and len(self.targets) > 1:
            return "split"
        if len(self.targets) == 1 and len(self.sources) > 1:
            return "merge"
        return "reshard"

    def streams(self) -> list[tuple[Shard, Shard]]:
        """(source, target) pairs whose ranges overlap: the copy streams."""
        return [(s, t) for s in self.sources for t in self.targets if overlaps(s.key_range, t.key_range)]

    def side(self, side: Side) -> tuple[Shard, ...]:
        return self.sources if side == "sources" else self.targets

    def topology_of(self, side: Side) -> Topology:
        """The topology in force while ``side`` serves."""
        return self.old if side == "sources" else self.new

    def describe(self) -> list[str]:
        """Lines for an operator: the move, then each copy stream."""
        lines = [
            f"{self.kind}: {', '.join(f'{s.name} ({s.key_range})' for s in self.sources)}"
            f" -> {', '.join(f'{t.name} ({t.key_range})' for t in self.targets)}"
        ]
        for s, t in self.streams():
            lines.append(f"  copy {s.name} -> {t.name}: tenants of {t.key_range} on {s.name}")
        others = [s.name for s in self.old.shards if s not in self.sources]
        if others:
            lines.append(f"  unchanged: {', '.join(others)}")
        return lines

    def to_dict(self) -> dict[str, Any]:
        return {"old": _shards_dict(self.old.shards), "targets": _shards_dict(self.targets)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReshardPlan:
        old = Topology.from_dict({"shards": data["old"]}, source="reshard state (old topology)")
        targets = tuple(
            shard_from_dict(e, where=f"reshard state (targets[{i}])") for i, e in enumerate(data["targets"])
        )
        return make_plan(old, targets)


def _shards_dict(shards: Sequence[Shard]) -> list[dict[str, Any]]:
    return [
        {"name": s.name, "dsn": s.dsn, "range": str(s.key_range)}
        | ({"managers": list(s.managers)} if s.managers else {})
        for s in shards
    ]


def make_plan(
    old: Topology, targets: Sequence[Shard], database_of: Callable[[str], Hashable] = lambda dsn: dsn
) -> ReshardPlan:
    """Plan moving the shards whose ranges the targets cover to the targets.

    The sources are the shards of ``old`` whose ranges meet a target's; their ranges together must
    be exactly the targets' (whole shards move), target names must be new and unique, each target
    a database of its own (``database_of`` maps a DSN to what names its database: two DSNs written
    differently may name the same one), and the result must be a valid topology. Raises
    ConfigurationError saying what is wrong.
    """
    if not targets:
        raise ConfigurationError("a reshard needs at least one target shard (--target NAME RANGE DSN)")
    existing = {s.name for s in old.shards}
    names = [t.name for t in targets]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigurationError(f"target shard names must be unique; repeated: {', '.join(dupes)}")
    reused = sorted(set(names) & existing)
    if reused:
        raise ConfigurationError(
            f"target shard names must be new; already in the topology: {', '.join(reused)} "
            "(a target is a new database that takes over the sources' ranges)"
        )
    shard_dbs = {database_of(s.dsn): s.name for s in old.shards}
    target_dbs: dict[Hashable, str] = {}
    for t in targets:
        db = database_of(t.dsn)
        if db in shard_dbs:
            raise ConfigurationError(
                f"target {t.name!r} has the database of shard {shard_dbs[db]!r}: a target must be a new database"
            )
        if db in target_dbs:
            raise ConfigurationError(
                f"targets {target_dbs[db]!r} and {t.name!r} name the same database: each target must be a "
                "database of its own"
            )
        target_dbs[db] = t.name
    sources = tuple(s for s in old.shards if any(overlaps(s.key_range, t.key_range) for t in targets))
    source_cover = _covered([s.key_range for s in sources])
    target_cover = _covered([t.key_range for t in targets])
    if source_cover != target_cover:
        raise ConfigurationError(
            "the targets' ranges must together be exactly the ranges of the shards they replace (whole shards move): "
            f"the targets cover {_fmt_cover(target_cover)}, "
            f"the shards they meet ({', '.join(s.name for s in sources)}) "
            f"own {_fmt_cover(source_cover)}"
        )
    rest = tuple(s for s in old.shards if s not in sources)
    try:
        new = Topology(rest + tuple(targets))
    except TopologyError as exc:
        raise ConfigurationError(f"the targets do not fit the topology: {exc}") from None
    return ReshardPlan(old, new, sources, tuple(targets))


def _fmt_cover(cover: list[tuple[str, str]]) -> str:
    return ", ".join(str(KeyRange(s, e)) for s, e in cover) or "nothing"


@dataclass
class ReshardState:
    """What a reshard has done so far, as recorded next to the topology file (JSON)."""

    plan: ReshardPlan
    phase: Phase = "copying"
    #: the side that serves the moved range outside a cut-over
    serving: Side = "sources"
    #: during a cut-over: the side it switches to, and the last step done (None: none yet)
    cutover_to: Side | None = None
    step: str | None = None
    #: the snapshot copy is complete (the capture keeps the copy in sync from then on)
    copied: bool = False
    #: snapshot copy cursors: "<origin>/<queue>" -> highest id copied
    cursors: dict[str, int] = field(default_factory=dict)
    #: (what, when) of every recorded step, for the operator
    history: list[dict[str, Any]] = field(default_factory=list)
    #: rows per second of the last apply round (for the cut-over estimate)
    apply_rate: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "plan": self.plan.to_dict(),
            "phase": self.phase,
            "serving": self.serving,
            "cutover_to": self.cutover_to,
            "step": self.step,
            "copied": self.copied,
            "cursors": self.cursors,
            "history": self.history,
            "apply_rate": self.apply_rate,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReshardState:
        return cls(
            plan=ReshardPlan.from_dict(data["plan"]),
            phase=data["phase"],
            serving=data["serving"],
            cutover_to=data.get("cutover_to"),
            step=_OLD_STEPS.get(data.get("step") or "", data.get("step")),
            copied=bool(data.get("copied")),
            cursors={str(k): int(v) for k, v in data.get("cursors", {}).items()},
            history=list(data.get("history", [])),
            apply_rate=data.get("apply_rate"),
        )

    @property
    def active(self) -> bool:
        """Whether the reshard is still going (not done nor cancelled)."""
        return self.phase not in ("done", "cancelled")


def other(side: Side) -> Side:
    return "targets" if side == "sources" else "sources"


def begin_cutover(state: ReshardState, to: Side) -> ReshardState:
    """The state at the start of a switch (to the targets) or a reverse (to the sources); raises
    ConfigurationError when the reshard is not at a point where that is allowed."""
    if state.phase == "cutover":
        if state.cutover_to != to:
            raise ConfigurationError(
                f"a cut-over to the {state.cutover_to} was interrupted after step {state.step!r}: "
                f"finish it first (qm reshard {'switch' if state.cutover_to == 'targets' else 'reverse'})"
            )
        return state  # resume
    verb = "switch" if to == "targets" else "reverse"
    if not state.active:
        raise ConfigurationError(f"the reshard is {state.phase}: nothing to {verb}")
    if state.serving == to:
        raise ConfigurationError(f"the {to} serve already: nothing to {verb}")
    if not state.copied:
        raise ConfigurationError(f"the copy has not finished: run 'qm reshard start' to the end before '{verb}'")
    return replace(state, phase="cutover", cutover_to=to, step=None)


def next_step(state: ReshardState) -> str | None:
    """The cut-over step to run next, None when the last one is done."""
    if state.phase != "cutover":
        return None
    if state.step is None:
        return CUTOVER_STEPS[0]
    i = CUTOVER_STEPS.index(state.step)
    return CUTOVER_STEPS[i + 1] if i + 1 < len(CUTOVER_STEPS) else None


def step_done(state: ReshardState, step: str, at: str) -> ReshardState:
    """Record a cut-over step; after the last one, the other side serves."""
    assert state.phase == "cutover" and state.cutover_to is not None and next_step(state) == step
    history = [*state.history, {"step": step, "to": state.cutover_to, "at": at}]
    if step == CUTOVER_STEPS[-1]:
        to = state.cutover_to
        return replace(
            state,
            phase="switched" if to == "targets" else "copying",
            serving=to,
            cutover_to=None,
            step=None,
            history=history,
        )
    return replace(state, step=step, history=history)


def rolled_back(state: ReshardState, at: str, why: str) -> ReshardState:
    """The state after a cut-over is undone before its 'serve' step (the frozen side serves again)."""
    if state.phase != "cutover":
        return state
    if state.step is not None and CUTOVER_STEPS.index(state.step) >= CUTOVER_STEPS.index("serve"):
        raise ConfigurationError(
            "the cut-over is past its 'serve' step: the other side serves already; finish it instead"
        )
    history = [*state.history, {"step": "rolled_back", "to": state.cutover_to, "at": at, "why": why}]
    return replace(
        state,
        phase="switched" if state.serving == "targets" else "copying",
        cutover_to=None,
        step=None,
        history=history,
    )


def check_allowed(state: ReshardState, action: str) -> None:
    """Raise ConfigurationError unless ``action`` (cleanup, cancel, sync) may run now."""
    if action == "cleanup":
        if state.phase != "switched":
            raise ConfigurationError(
                f"cleanup drops the sources' rows; it runs only once the targets serve (phase switched), "
                f"the reshard is {state.phase}"
            )
    elif action == "cancel":
        if state.phase == "cutover" and state.cutover_to == "sources":
            raise ConfigurationError(
                f"a reverse was interrupted after step {state.step!r}: finish it with 'qm reshard reverse' "
                "(cancel is allowed only before the switch)"
            )
        if state.phase == "cutover":
            rolled_back(state, "", "")  # raises past 'serve'
        elif state.phase == "done":
            raise ConfigurationError(
                "the reshard is finished (cleaned up: the targets serve and the sources' events are dropped); "
                "there is nothing to cancel"
            )
        elif state.phase == "cancelled":
            raise ConfigurationError("the reshard is cancelled already; there is nothing to cancel")
        elif state.phase != "copying" or state.serving != "sources":
            raise ConfigurationError(
                f"cancel is allowed only before the switch (the reshard is {state.phase}, "
                f"the {state.serving} serve): reverse first (qm reshard reverse), then cancel"
            )
    elif action == "sync":
        if state.phase not in ("copying", "switched"):
            raise ConfigurationError(f"nothing to sync: the reshard is {state.phase}")
    else:  # pragma: no cover - a programming error
        raise ValueError(action)
