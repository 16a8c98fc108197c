"""The reshard plan and its state machine (queue_manager/reshard/plan.py): pure, no database."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from queue_manager.domain.topology import KeyRange, Shard, Topology
from queue_manager.errors import ConfigurationError
from queue_manager.reshard.plan import (
    CUTOVER_STEPS,
    ReshardState,
    begin_cutover,
    check_allowed,
    make_plan,
    next_step,
    overlaps,
    rolled_back,
    step_done,
)


def shard(name: str, spec: str) -> Shard:
    return Shard(name, f"dbname={name}", KeyRange.parse(spec))


FOUR = Topology((shard("a", "-40"), shard("b", "40-80"), shard("c", "80-c0"), shard("d", "c0-")))


def test_overlaps_of_half_open_ranges() -> None:
    r = KeyRange.parse
    assert overlaps(r("-80"), r("40-c0")) and overlaps(r("-"), r("80-"))
    assert not overlaps(r("-80"), r("80-")) and not overlaps(r("80-"), r("-80"))
    assert overlaps(r("40-80"), r("40-80"))


def test_a_split_a_merge_and_an_n_to_m_move() -> None:
    split = make_plan(FOUR, [shard("a0", "-20"), shard("a1", "20-40")])
    assert split.kind == "split" and [s.name for s in split.sources] == ["a"]
    assert [s.name for s in split.new.shards] == ["b", "c", "d", "a0", "a1"]
    assert [(s.name, t.name) for s, t in split.streams()] == [("a", "a0"), ("a", "a1")]
    merge = make_plan(FOUR, [shard("ab", "-80")])
    assert merge.kind == "merge" and [s.name for s in merge.sources] == ["a", "b"]
    n_to_m = make_plan(FOUR, [shard("x", "-60"), shard("y", "60-c0")])
    assert n_to_m.kind == "reshard" and [s.name for s in n_to_m.sources] == ["a", "b", "c"]
    assert [(s.name, t.name) for s, t in n_to_m.streams()] == [("a", "x"), ("b", "x"), ("b", "y"), ("c", "y")]
    assert "split: a (-40) -> a0 (-20), a1 (20-40)" in split.describe()[0]


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        ([], "at least one target"),
        ([shard("x", "-20")], "exactly the ranges"),  # only part of a
        ([shard("x", "-60")], "exactly the ranges"),  # a and part of b
        ([shard("x", "-20"), shard("x", "20-40")], "unique"),
        ([shard("b", "-40")], "must be new"),
        ([Shard("x", "dbname=a", KeyRange.parse("-40"))], "new database"),
        ([shard("x", "-40"), shard("y", "20-40")], "exactly the ranges|do not fit"),  # overlapping targets
    ],
)
def test_bad_plans_say_what_is_wrong(targets: list[Shard], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        make_plan(FOUR, targets)


def test_the_cutover_steps_in_order_then_the_other_side_serves() -> None:
    state = ReshardState(make_plan(FOUR, [shard("a0", "-20"), shard("a1", "20-40")]), copied=True)
    state = begin_cutover(state, "targets")
    seen = []
    while (step := next_step(state)) is not None:
        seen.append(step)
        state = step_done(state, step, "t")
    assert tuple(seen) == CUTOVER_STEPS
    assert (state.phase, state.serving, state.step) == ("switched", "targets", None)
    # back again, the same steps towards the sources
    state = begin_cutover(state, "sources")
    assert next_step(state) == "freeze"
    for step in CUTOVER_STEPS:
        state = step_done(state, step, "t")
    assert (state.phase, state.serving) == ("copying", "sources")
    assert [h["to"] for h in state.history] == ["targets"] * 4 + ["sources"] * 4


def test_what_each_phase_allows() -> None:
    plan = make_plan(FOUR, [shard("ab", "-80")])
    copying = ReshardState(plan)
    with pytest.raises(ConfigurationError, match="copy has not finished"):
        begin_cutover(copying, "targets")
    copying.copied = True
    with pytest.raises(ConfigurationError, match="serve already"):
        begin_cutover(copying, "sources")
    with pytest.raises(ConfigurationError, match="only once the targets serve"):
        check_allowed(copying, "cleanup")
    check_allowed(copying, "cancel")
    cutover = step_done(begin_cutover(copying, "targets"), "freeze", "t")
    assert begin_cutover(cutover, "targets") is cutover  # a rerun resumes
    with pytest.raises(ConfigurationError, match="interrupted"):
        begin_cutover(cutover, "sources")
    back = rolled_back(cutover, "t", "timeout")
    assert (back.phase, back.serving, back.step) == ("copying", "sources", None)
    served = step_done(step_done(cutover, "catch_up", "t"), "serve", "t")
    with pytest.raises(ConfigurationError, match="past its 'serve' step"):
        rolled_back(served, "t", "no")
    with pytest.raises(ConfigurationError):
        check_allowed(served, "cancel")
    switched = step_done(served, "topology", "t")
    check_allowed(switched, "cleanup")
    with pytest.raises(ConfigurationError, match="reverse first"):
        check_allowed(switched, "cancel")
    # after cleanup (or a cancel) there is nothing to cancel, and the message says so
    with pytest.raises(ConfigurationError, match=r"finished.*nothing to cancel"):
        check_allowed(replace(switched, phase="done"), "cancel")
    with pytest.raises(ConfigurationError, match="cancelled already"):
        check_allowed(replace(copying, phase="cancelled"), "cancel")
    # an interrupted reverse is finished, not cancelled: cancel drops the targets' events
    with pytest.raises(ConfigurationError, match="reverse was interrupted"):
        check_allowed(begin_cutover(switched, "sources"), "cancel")


def test_two_targets_naming_one_database_are_refused() -> None:
    """Targets are compared with each other as well as with the shards, by what names their
    database (the shell normalises DSNs; here, the database name alone)."""

    def database_of(dsn: str) -> str:
        return dsn.split("dbname=")[1].split()[0]

    twins = [
        Shard("x", "host=h dbname=n", KeyRange.parse("-20")),
        Shard("y", "dbname=n port=5432", KeyRange.parse("20-40")),
    ]
    with pytest.raises(ConfigurationError, match="targets 'x' and 'y' name the same database"):
        make_plan(FOUR, twins, database_of)
    with pytest.raises(ConfigurationError, match="database of shard 'a'"):
        make_plan(FOUR, [Shard("x", "host=h dbname=a", KeyRange.parse("-40"))], database_of)
    make_plan(FOUR, twins)  # compared as written, the two DSNs differ


def test_the_state_survives_its_json() -> None:
    # a target's managers too: the switch writes them to the topology file, for receivers
    target = replace(shard("ab", "-80"), managers=("ws://mgr-e:8765/",))
    state = step_done(begin_cutover(ReshardState(make_plan(FOUR, [target]), copied=True), "targets"), "freeze", "t")
    state.cursors["a/orders"] = 42
    again = ReshardState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert again == state


def test_reshard_targets_take_their_managers_from_the_command_line() -> None:
    import argparse

    from queue_manager.cli.reshard import _targets

    def args(*managers: str) -> argparse.Namespace:
        return argparse.Namespace(
            target=[["s2", "-40", "dbname=s2"], ["s3", "40-80", "dbname=s3"]], target_manager=list(managers)
        )

    s2, s3 = _targets(args("s2=ws://e:1/", "s2=ws://f:1/"))
    assert s2.managers == ("ws://e:1/", "ws://f:1/") and s3.managers == ()
    with pytest.raises(ConfigurationError, match="names no --target: s9"):
        _targets(args("s9=ws://e:1/"))
    with pytest.raises(ConfigurationError, match="give NAME=URL"):
        _targets(args("ws://e:1/"))
    with pytest.raises(ConfigurationError, match="use ws://host:port/"):
        _targets(args("s2=postgresql://e/qm"))


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ("postgresql://u@localhost/qm", "host=127.0.0.1 port=5432 user=u dbname=qm", True),
        ("postgresql://u@db-c:5433/qm", "host=DB-C port=5433 dbname=qm user=v", True),
        ("postgresql://u@/qm?host=/var/run/postgresql", "postgresql://u@localhost:5432/qm", True),
        ("postgresql://u@db-c/qm", "postgresql://u@db-d/qm", False),
        ("postgresql://u@db-c/qm", "postgresql://u@db-c:5433/qm", False),
        ("postgresql://u@db-c/qm", "postgresql://u@db-c/qm2", False),
    ],
)
def test_dsns_are_compared_by_the_database_they_name(a: str, b: str, same: bool) -> None:
    from queue_manager.reshard.workflow import database_of

    assert (database_of(a) == database_of(b)) is same


def test_a_range_that_starts_with_a_dash_is_read_as_a_value() -> None:
    from queue_manager.cli.main import build_parser

    args = build_parser().parse_args(
        ["reshard", "plan", "--target", "s2", "-a0", "dbname=x", "--target", "s3", "-F0", "dbname=y"]
    )
    assert args.target == [["s2", "-a0", "dbname=x"], ["s3", "-F0", "dbname=y"]]
