"""Shared fixtures: a real PostgreSQL server, one migrated template, a fresh database per test.

``shards`` gives a two-shard topology (``s0`` owns ``-80``, ``s1`` owns ``80-``) as two fresh
databases cloned from the template, each told its identity; ``shard`` is ``s0`` of that pair.
Integration tests that need several *servers* use ``queue_manager.local.embedded.LocalCluster``.
"""

from __future__ import annotations

import gc
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import psycopg
import pytest

from queue_manager import admin
from queue_manager.db.migrate import set_identity, upgrade
from queue_manager.domain.topology import KeyRange, Shard, Topology
from tests import pgtest


@pytest.fixture(autouse=True)
def _collect_garbage() -> Iterator[None]:
    """Collect what a test left in reference cycles at its end: a connection it leaked unclosed then
    fails that test (a ResourceWarning is an error here), not whichever test the collector next
    happened to run in."""
    yield
    gc.collect()


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
def make_queue(shards: Topology) -> Callable[..., str]:
    """Create a queue on both shards: ``make_queue("orders", partitions=8, shuffle=2)``."""

    def make(name: str = "orders", **settings: object) -> str:
        admin.create_queue(shards, name, settings)
        return name

    return make


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
