"""Checks on the Spark session a job runs in.

The session itself comes from :func:`spark_jobs.routing.job_session` (a local ``local[2]`` session,
or spark-submit's), which finds the PostgreSQL JDBC driver as a jar (``--jdbc-jar``,
``$QM_JDBC_JAR``, Debian's) or has Spark fetch it from Maven Central.
"""

from __future__ import annotations

from pyspark.sql import SparkSession

from queue_manager.errors import ConfigurationError
from spark_jobs.routing import NO_DRIVER_HINT

#: the driver's class name
JDBC_DRIVER_CLASS = "org.postgresql.Driver"


def require_jdbc_driver(spark: SparkSession) -> None:
    """ConfigurationError naming every way to provide it, unless the JDBC driver loads in Spark's JVM:
    a job checks before it does any work, instead of failing at its first write."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    try:
        loader = jvm.java.lang.Thread.currentThread().getContextClassLoader()
        jvm.java.lang.Class.forName(JDBC_DRIVER_CLASS, True, loader)
    except Exception:
        raise ConfigurationError(f"{NO_DRIVER_HINT} (the class {JDBC_DRIVER_CLASS} does not load)") from None
