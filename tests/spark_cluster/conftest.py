"""The cluster tests: one Spark standalone cluster (a master and two workers, JVMs of their own)
for the whole run of the process, started by the first test that needs it (``spark_cluster``).

Under ``pytest -n`` these tests go to one worker of their own (tests/conftest.py), beside the one
that runs the local-session Spark tests. Skipped, with the reason, where Spark cannot run (as the
local-session tests) or where a worker cannot be given a ``/tmp`` of its own.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.spark.conftest import spark_missing

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [item for item in items if _HERE in Path(str(item.path)).parents]
    if not mine:
        return
    reason = spark_missing()
    if reason is None:
        from tests.spark_cluster.cluster import isolation_missing

        reason = isolation_missing()
    if reason is not None:
        for item in mine:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def _cluster_session() -> Iterator[object]:
    from tests.spark_cluster.cluster import SparkCluster, new_cluster_root

    root = new_cluster_root()
    cluster = SparkCluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def spark_cluster(_cluster_session: object) -> object:
    """The run's cluster, with both workers up (a test before may have killed one)."""
    from tests.spark_cluster.cluster import SparkCluster

    assert isinstance(_cluster_session, SparkCluster)
    _cluster_session.ensure_workers()
    return _cluster_session
