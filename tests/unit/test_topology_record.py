"""Managers recorded in the topology file (queue_manager.domain.topology, .topology_file): the pure changes,
and the file's writers, which hold its lock and rename a whole new file into place."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest

from queue_manager.domain.topology import KeyRange, Shard, Topology
from queue_manager.domain.topology_file import forget_manager, record_manager, write_topology_file
from queue_manager.errors import TopologyError

TWO = Topology(
    (
        Shard("s0", "postgresql://h/a", KeyRange.parse("-80")),
        Shard("s1", "postgresql://h/b", KeyRange.parse("80-"), ("ws://b:1/",)),
    )
)


def managers(topology: Topology) -> dict[str, tuple[str, ...]]:
    return {s.name: s.managers for s in topology.shards}


def test_a_manager_is_added_once_to_its_shard_and_removed() -> None:
    one = TWO.with_manager("s0", "ws://a:1/")
    assert managers(one) == {"s0": ("ws://a:1/",), "s1": ("ws://b:1/",)}
    assert one.with_manager("s0", "ws://a:1/") == one
    assert managers(one.with_manager("s0", "ws://a:2/"))["s0"] == ("ws://a:1/", "ws://a:2/")
    assert one.without_manager("s0", "ws://a:1/") == TWO
    assert one.without_manager("s0", "ws://nobody:1/") == one
    assert TWO.with_manager("s7", "ws://a:1/") == TWO  # no such shard: nothing
    with pytest.raises(TopologyError, match="shard s0: manager URL 'http//x': use ws://host:port/"):
        TWO.with_manager("s0", "http//x")


def test_the_managers_of_another_topology_are_kept_for_the_shards_of_the_same_name() -> None:
    recorded = TWO.with_manager("s0", "ws://a:1/").with_manager("s1", "ws://b:2/")
    fresh = Topology(
        (
            Shard("s0", "postgresql://h2/a", KeyRange.parse("-80")),
            Shard("s1", "postgresql://h2/b", KeyRange.parse("80-"), ("ws://b:1/", "ws://c:1/")),
        )
    )
    kept = fresh.with_managers_of(recorded)
    assert managers(kept) == {"s0": ("ws://a:1/",), "s1": ("ws://b:1/", "ws://c:1/", "ws://b:2/")}
    assert [s.dsn for s in kept.shards] == ["postgresql://h2/a", "postgresql://h2/b"]  # the new file's DSNs


def test_record_and_forget_change_the_file_and_only_for_a_shard_it_has(tmp_path: Path) -> None:
    path = tmp_path / "topology.toml"
    assert record_manager(path, "s0", "ws://a:1/") is False  # no file: nothing written
    assert not path.exists()
    write_topology_file(path, TWO)
    assert record_manager(path, "s0", "ws://a:1/") is True
    assert record_manager(path, "s0", "ws://a:1/") is True  # listed once
    assert record_manager(path, "s9", "ws://a:1/") is False  # a reshard's target before the switch
    assert managers(Topology.load(path)) == {"s0": ("ws://a:1/",), "s1": ("ws://b:1/",)}
    forget_manager(path, "s0", "ws://a:1/")
    assert Topology.load(path) == TWO
    assert sorted(p.name for p in tmp_path.iterdir()) == [".topology.toml.lock", "topology.toml"]  # no temporary left


def test_a_rewrite_keeps_the_recorded_managers_and_replaces_an_invalid_file(tmp_path: Path) -> None:
    path = tmp_path / "topology.toml"
    write_topology_file(path, TWO.with_manager("s0", "ws://a:1/"))
    again = write_topology_file(path, TWO, keep_managers=True)
    assert managers(again)["s0"] == ("ws://a:1/",) and Topology.load(path) == again
    assert write_topology_file(path, TWO) == TWO == Topology.load(path)  # without keep_managers: as given
    path.write_text("not [toml")
    assert write_topology_file(path, TWO, keep_managers=True) == TWO == Topology.load(path)
    path.write_text("not [toml")
    with pytest.raises(TopologyError, match="is not valid TOML"):
        record_manager(path, "s0", "ws://a:1/")
    assert path.read_text() == "not [toml"  # left as it was


def _record_many(path: str, shard: str, first: int, count: int, barrier: Any) -> None:
    barrier.wait()
    for port in range(first, first + count):
        record_manager(path, shard, f"ws://127.0.0.1:{port}/")


def test_managers_recording_themselves_at_once_are_all_listed(tmp_path: Path) -> None:
    """Eight processes add 15 URLs each to the same file at the same moment: every one is there at the
    end (without the lock, concurrent read-modify-writes lose each other's changes)."""
    path = tmp_path / "topology.toml"
    write_topology_file(path, TWO)
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(8)
    procs = [
        ctx.Process(target=_record_many, args=(str(path), f"s{i % 2}", 10_000 + 100 * i, 15, barrier)) for i in range(8)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    listed = managers(Topology.load(path))
    expected: dict[str, set[str]] = {"s0": set(), "s1": {"ws://b:1/"}}
    for i in range(8):
        expected[f"s{i % 2}"] |= {f"ws://127.0.0.1:{10_000 + 100 * i + k}/" for k in range(15)}
    assert {name: set(urls) for name, urls in listed.items()} == expected
    assert all(len(urls) == len(set(urls)) for urls in listed.values())
