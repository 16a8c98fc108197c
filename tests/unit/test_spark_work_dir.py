"""The bulk loader's work directory (spark_jobs.enqueue.work_base): required on a cluster, where
the driver's temporary directory is not the executors'."""

from __future__ import annotations

import tempfile

import pytest

pytest.importorskip("pyspark", reason="pyspark is not installed: run `make setup`")

from queue_manager.errors import ConfigurationError
from spark_jobs.enqueue import work_base


@pytest.mark.parametrize("master", ["local", "local[2]", "local[*]", "local-cluster[2,1,1024]"])
def test_a_local_master_defaults_to_the_drivers_temporary_directory(master: str) -> None:
    assert work_base(master, None) == f"{tempfile.gettempdir()}/qm-spark-enqueue"


@pytest.mark.parametrize("master", ["spark://127.0.0.1:7077", "yarn", "k8s://https://10.0.0.1:6443"])
def test_a_cluster_master_without_a_work_directory_is_refused_with_what_to_pass(master: str) -> None:
    with pytest.raises(ConfigurationError, match=r"needs --work-dir .* every executor read and write"):
        work_base(master, None)


def test_a_given_work_directory_stands_whatever_the_master() -> None:
    assert work_base("yarn", "hdfs:///qm/work/") == "hdfs:///qm/work"
    assert work_base("local[2]", "/shared/work") == "/shared/work"
