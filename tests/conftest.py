"""Shared fixtures: a real PostgreSQL server, one migrated template, a fresh database per test.

``shards`` gives a two-shard topology (``s0`` owns ``-80``, ``s1`` owns ``80-``) as two fresh
databases cloned from the template, each told its identity; ``shard`` is ``s0`` of that pair.
Integration tests that need several *servers* use ``queue_manager.local.embedded.LocalCluster``.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from queue_manager import admin
from queue_manager.db.migrate import set_identity, upgrade
from queue_manager.domain.topology import KeyRange, Shard, Topology
from tests import pgtest
from tests.framecheck import FrameCheck


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what exists once the tests are collected (every module imported: PySpark,
    hypothesis, ...) out of the garbage collector's reach: the full collection at each test's end
    (below) then looks only at what tests made, about 1 ms instead of 70 ms, measured."""
    gc.freeze()


@pytest.fixture(autouse=True)
def _collect_garbage() -> Iterator[None]:
    """Collect what a test left in reference cycles at its end: a connection it leaked unclosed then
    fails that test (a ResourceWarning is an error here), not whichever test the collector next
    happened to run in."""
    yield
    gc.collect()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest work first (the Spark tests, then tests marked ``slow``), so that under
    ``pytest -n`` it starts at once instead of being what the last worker is still doing."""
    items.sort(key=lambda item: 0 if item.get_closest_marker("spark") else 1 if item.get_closest_marker("slow") else 2)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``pytest -n N --dist loadscope`` (``make test``): every Spark test goes to one worker, where
    they share its one Spark session (a JVM start costs seconds of CPU), and every Spark cluster
    test to another, where they share one standalone cluster; the dashboard's browser
    tests likewise go to one worker (one browser, server and manager for them all); every other
    test is a unit of its own, given to whichever worker is free."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SparkTogether(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith("tests/spark/"):
                return "spark"
            if nodeid.startswith("tests/spark_cluster/"):
                return "spark-cluster"  # one standalone cluster for them all, beside the local session's worker
            return "browser" if nodeid.startswith("tests/web/test_browser.py") else nodeid

    return SparkTogether(config, log)


@pytest.fixture(autouse=True)
def _frames_match_the_schema() -> Iterator[FrameCheck]:
    """Every frame a manager or a receiver of the test sends is checked against
    docs/protocol.schema.json (tests/framecheck.py): one that does not match fails the test."""
    check = FrameCheck()
    with check.installed():
        yield check
    bad = check.verify()
    assert not bad, f"{len(bad)} frame(s) do not match docs/protocol.schema.json:\n" + "\n".join(bad[:10])


@pytest.fixture
def server_dir() -> Iterator[Path]:
    """A directory for the embedded PostgreSQL servers a test starts itself, deleted at teardown.

    Not under pytest's ``tmp_path``: every pytest session that starts on the machine makes pytest's
    temporary root private again (mode 0700), which would cut a running server's OS user off from
    its own data directory."""
    directory = Path(tempfile.mkdtemp(prefix="qm-test-servers-", dir=pgtest.scratch_root()))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_admin_dsn() -> str:
    """DSN of the test server's ``postgres`` database."""
    return pgtest.test_server()


@pytest.fixture(scope="session")
def template_db(pg_admin_dsn: str) -> Iterator[str]:
    """Name of a database migrated to head, used as the template of every test database."""
    name = f"qm_tpl_{os.getpid()}"
    pgtest.drop_database(pg_admin_dsn, name)
    dsn = pgtest.fresh_database(pg_admin_dsn, None, name)
    upgrade(dsn)
    yield name
    pgtest.drop_database(pg_admin_dsn, name)


@dataclass
class DatabaseFactory:
    """Creates fresh databases from the template; drops them at teardown."""

    admin_dsn: str
    template: str
    created: list[str]

    def __call__(self) -> str:
        name = f"qm_t_{uuid.uuid4().hex[:12]}"
        dsn = pgtest.fresh_database(self.admin_dsn, self.template, name)
        self.created.append(name)
        return dsn


@pytest.fixture
def new_database(pg_admin_dsn: str, template_db: str) -> Iterator[DatabaseFactory]:
    """A factory of fresh migrated databases (no shard identity yet)."""
    factory = DatabaseFactory(pg_admin_dsn, template_db, [])
    yield factory
    for name in factory.created:
        pgtest.drop_database(pg_admin_dsn, name)


@pytest.fixture
def shards(new_database: DatabaseFactory) -> Topology:
    """Two shards (``s0``: ``-80``, ``s1``: ``80-``) as two fresh databases with identities set."""
    topology = Topology(
        (
            Shard("s0", new_database(), KeyRange.parse("-80")),
            Shard("s1", new_database(), KeyRange.parse("80-")),
        )
    )
    for s in topology.shards:
        set_identity(s.dsn, s, topology)
    return topology


@pytest.fixture
def shard(shards: Topology) -> Shard:
    """Shard ``s0`` (keyspace ``-80``) of the ``shards`` pair."""
    return shards.shards[0]


@pytest.fixture
def topo_file(shards: Topology, tmp_path: Path) -> Path:
    """The ``shards`` pair's topology file (``tmp_path/topology.toml``), for a ``--topology`` flag."""
    path = tmp_path / "topology.toml"
    path.write_text(shards.to_toml())
    return path


@pytest.fixture
def make_queue(shards: Topology) -> Callable[..., str]:
    """Create a queue on both shards: ``make_queue("orders", partitions=8, shuffle=2)``."""

    def make(name: str = "orders", **settings: object) -> str:
        admin.create_queue(shards, name, settings)
        return name

    return make


def count_on_shards(topology: Topology, query: str) -> int:
    """``query``, a ``SELECT count(*)``, summed over every shard of ``topology``."""
    total = 0
    for shard in topology.shards:
        with psycopg.connect(shard.dsn) as conn:
            row = conn.execute(query).fetchone()
        assert row is not None
        total += int(row[0])
    return total


def tenants_of(shard: Shard, count: int, prefix: str = "tenant") -> list[str]:
    """The first ``count`` tenants named ``{prefix}-{i}`` that belong to ``shard``."""
    out: list[str] = []
    i = 0
    while len(out) < count:
        t = f"{prefix}-{i}"
        if shard.key_range.contains(t):
            out.append(t)
        i += 1
    return out


@pytest.fixture
def conn(shard: Shard) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """An autocommit connection to shard ``s0``."""
    with psycopg.connect(shard.dsn, autocommit=True) as c:
        yield c
