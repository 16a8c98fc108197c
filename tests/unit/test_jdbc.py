"""JDBC settings of a shard from its libpq DSN (spark_jobs.jdbc)."""

from __future__ import annotations

import pytest

from queue_manager.errors import ConfigurationError
from spark_jobs.jdbc import JDBC_DRIVER, shard_jdbc_target


def test_jdbc_target_from_a_dsn() -> None:
    t = shard_jdbc_target("postgresql://alice:s3cret@db.example:6543/qm?sslmode=require&application_name=arch")
    assert t.url == "jdbc:postgresql://db.example:6543/qm"
    assert t.properties == {
        "driver": JDBC_DRIVER,
        "user": "alice",
        "password": "s3cret",
        "sslmode": "require",
        "ApplicationName": "arch",
    }
    t = shard_jdbc_target("host=10.0.0.1,10.0.0.2 port=5432,5433 dbname=my/db user=bob connect_timeout=5")
    assert t.url == "jdbc:postgresql://10.0.0.1:5432,10.0.0.2:5433/my%2Fdb"
    assert t.properties["connectTimeout"] == "5" and "password" not in t.properties
    assert shard_jdbc_target("host=::1 dbname=qm user=u").url == "jdbc:postgresql://[::1]:5432/qm"
    with pytest.raises(ConfigurationError, match="Unix socket"):
        shard_jdbc_target("host=/var/run/postgresql dbname=qm")
    with pytest.raises(ConfigurationError, match="2 hosts but 3 ports"):
        shard_jdbc_target("host=a,b port=1,2,3 dbname=qm")
    with pytest.raises(ConfigurationError, match="invalid DSN"):
        shard_jdbc_target("host=a port")
