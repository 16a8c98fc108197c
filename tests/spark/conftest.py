"""The Spark tests: one local Spark session per test process, and a clear skip where Spark cannot run.

A JVM start costs seconds of CPU, so every Spark test of a process shares one session (``spark``,
started by the first test that needs it, stopped at the end), and under ``pytest -n`` every Spark
test goes to the same worker (each module's ``xdist_group`` mark; ``make test`` runs ``--dist
loadgroup``).

On a machine without Java 17+ or the PostgreSQL JDBC jar (which ``make setup`` installs when run as
root), each Spark test is skipped with a one-line reason naming what is missing and how to install
it, never reported as an error.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_HERE = Path(__file__).resolve().parent
_INSTALL = "as root, `make setup` installs it"


def _java_major() -> int | None:
    """The major version of the Java that PySpark would start ($JAVA_HOME's, else the one on PATH)."""
    home = os.environ.get("JAVA_HOME")
    java = str(Path(home, "bin", "java")) if home and Path(home, "bin", "java").is_file() else shutil.which("java")
    if java is None:
        return None
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30).stderr
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r'version "(\d+)', out)
    return int(found.group(1)) if found else None


def spark_missing() -> str | None:
    """Why Spark cannot run here (one line), or None."""
    try:
        import pyspark  # noqa: F401
    except ImportError:
        return "pyspark is not installed: run `make setup`"
    major = _java_major()
    if major is None or major < 17:
        found = "no Java" if major is None else f"Java {major}"
        return f"Spark needs Java 17+ and found {found}: {_INSTALL} (apt-get install openjdk-17-jre-headless)"
    from queue_manager.errors import ConfigurationError
    from spark_jobs.session import find_jdbc_jar

    try:
        jar = find_jdbc_jar()
    except ConfigurationError as exc:
        return str(exc)
    if jar is None:
        return f"no PostgreSQL JDBC jar: {_INSTALL} (apt-get install libpostgresql-jdbc-java), or set QM_JDBC_JAR"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [item for item in items if _HERE in Path(str(item.path)).parents]
    reason = spark_missing() if mine else None
    if reason is not None:
        for item in mine:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session", autouse=True)
def spark() -> Iterator[Any]:
    """The process's Spark session (``local[2]``, the JDBC jar loaded), for every Spark test."""
    import json

    from pyspark.sql import SparkSession

    from spark_jobs.session import require_jdbc_driver, spark_session

    for k, v in json.loads(os.environ.get("QM_TEST_SPARK_CONF", "{}")).items():
        SparkSession.builder.config(k, v)
    session = spark_session("qm-tests")
    try:
        session.sparkContext.setLogLevel("ERROR")
        require_jdbc_driver(session)
        yield session
    finally:
        session.stop()
