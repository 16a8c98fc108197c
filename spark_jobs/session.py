"""The Spark session of a job, and the PostgreSQL JDBC driver it needs.

The driver comes from, in this order: the ``jdbc_jar`` option (``--jdbc-jar``), ``$QM_JDBC_JAR``,
Debian's ``/usr/share/java/postgresql.jar`` (package ``libpostgresql-jdbc-java``), else Maven
coordinates (``spark.jars.packages``, :data:`JDBC_PACKAGE`), which Spark downloads at start-up.
:func:`require_jdbc_driver` checks, before a job does any work, that the driver loads, and names
all three ways when it does not.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from pyspark.sql import SparkSession

from queue_manager.errors import ConfigurationError
from spark_jobs.routing import DEBIAN_JDBC_JAR, JDBC_JAR_ENV, find_jdbc_jar, spark_session

#: Maven coordinates of the driver, used when no jar is found locally (needs Maven Central)
JDBC_PACKAGE = "org.postgresql:postgresql:42.7.4"
#: the driver's class name
JDBC_DRIVER_CLASS = "org.postgresql.Driver"

_HOW_TO_GET_THE_DRIVER = (
    f"pass --jdbc-jar PATH (jdbc_jar=...), set {JDBC_JAR_ENV}=PATH, install {DEBIAN_JDBC_JAR} "
    f"(apt-get install libpostgresql-jdbc-java), or let Spark download {JDBC_PACKAGE} (spark.jars.packages, "
    "needs access to Maven Central); under spark-submit, pass --jars PATH or --packages "
    f"{JDBC_PACKAGE}"
)


def local_session(app_name: str, jdbc_jar: str | None = None) -> SparkSession:
    """A local session (:func:`spark_jobs.routing.spark_session`) with the JDBC driver: a jar when one
    is found, else the Maven coordinates. Raises ConfigurationError naming every way to get the
    driver when Spark cannot start with it."""
    if jdbc_jar is not None or find_jdbc_jar() is not None:
        return spark_session(app_name, jdbc_jar=jdbc_jar)
    try:
        return spark_session(app_name, jdbc_package=JDBC_PACKAGE)
    except Exception as exc:  # Ivy's resolution failure surfaces as a py4j/JVM error
        raise ConfigurationError(f"no PostgreSQL JDBC driver: {exc}; {_HOW_TO_GET_THE_DRIVER}") from None


def require_jdbc_driver(spark: SparkSession) -> None:
    """ConfigurationError, naming every way to provide it, unless the JDBC driver loads in the JVM."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    try:
        loader = jvm.java.lang.Thread.currentThread().getContextClassLoader()
        jvm.java.lang.Class.forName(JDBC_DRIVER_CLASS, True, loader)
    except Exception:
        raise ConfigurationError(
            f"the PostgreSQL JDBC driver ({JDBC_DRIVER_CLASS}) is not on Spark's class path: {_HOW_TO_GET_THE_DRIVER}"
        ) from None


@contextmanager
def job_session(app_name: str, jdbc_jar: str | None = None) -> Iterator[SparkSession]:
    """The Spark session of a command-line run, stopped at the end if this call started it.

    Under ``spark-submit`` (or any running session) its ``--master`` and ``--jars`` stand; otherwise
    a local session (:func:`local_session`). The JDBC driver is checked before the job starts.
    """
    existing = SparkSession.getActiveSession()
    if existing is not None:
        session = existing
    elif os.environ.get("PYSPARK_GATEWAY_PORT"):  # spark-submit started the JVM for us
        session = SparkSession.builder.appName(app_name).getOrCreate()
    else:
        session = local_session(app_name, jdbc_jar)
    try:
        require_jdbc_driver(session)
        yield session
    finally:
        if existing is None:
            session.stop()
