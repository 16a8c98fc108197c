"""The Spark session a job runs in, and the PostgreSQL JDBC driver it needs.

A command-line job takes :func:`job_session`: spark-submit's session when run under it, else a local
``local[2]`` one (:func:`spark_session`) with the driver found as a jar (``--jdbc-jar``, ``$QM_JDBC_JAR``,
Debian's) or fetched by Spark from Maven Central; :func:`require_jdbc_driver` checks that it loads.
"""

from __future__ import annotations

import gc
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession

from queue_manager.errors import ConfigurationError
from spark_jobs.jdbc import JDBC_DRIVER, JdbcTarget

#: Debian/Ubuntu's ``libpostgresql-jdbc-java`` installs the driver here
DEBIAN_JDBC_JAR = "/usr/share/java/postgresql.jar"
#: environment variable naming a PostgreSQL JDBC driver jar
JDBC_JAR_ENV = "QM_JDBC_JAR"
#: Maven coordinates fetched (spark.jars.packages) when no jar is found; $QM_JDBC_PACKAGE overrides
JDBC_PACKAGE = "org.postgresql:postgresql:42.7.4"
#: the error a job gives when the driver is missing: every way to provide it
NO_DRIVER_HINT = (
    "the PostgreSQL JDBC driver was not found: pass --jdbc-jar (or set $QM_JDBC_JAR) to its jar, "
    f"install Debian's libpostgresql-jdbc-java ({DEBIAN_JDBC_JAR}), or let Spark fetch "
    f"{JDBC_PACKAGE} from Maven Central (spark.jars.packages; needs network access)"
)


def find_jdbc_jar() -> str | None:
    """The PostgreSQL JDBC driver jar: ``$QM_JDBC_JAR``, else Debian's, else None.

    Raises ConfigurationError if ``QM_JDBC_JAR`` is set but names no file.
    """
    env = os.environ.get(JDBC_JAR_ENV)
    if env:
        if not Path(env).is_file():
            raise ConfigurationError(f"{JDBC_JAR_ENV}={env!r} is not a file (point it at the PostgreSQL JDBC jar)")
        return env
    if Path(DEBIAN_JDBC_JAR).is_file():
        return DEBIAN_JDBC_JAR
    return None


def spark_session(app_name: str = "qm", *, jdbc_jar: str | None = None) -> SparkSession:
    """A local Spark session sized for a small (2-core) machine.

    ``local[2]``, 4 shuffle partitions, no UI, 1 GiB driver. The PostgreSQL JDBC jar
    (``jdbc_jar``, else :func:`find_jdbc_jar`) is added with ``spark.jars`` when found, else Spark
    fetches :data:`JDBC_PACKAGE` (``spark.jars.packages``, needs network access).
    Settings only take effect if no session is running yet in this process (``getOrCreate``).
    Raises ConfigurationError if ``jdbc_jar`` is given but names no file.
    """
    if jdbc_jar is not None and not Path(jdbc_jar).is_file():
        raise ConfigurationError(f"JDBC jar {jdbc_jar!r} is not a file")
    jar = jdbc_jar or find_jdbc_jar()
    builder = (
        SparkSession.builder.master("local[2]")
        .appName(app_name)
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.memory", "1g")
    )
    if jar:
        builder = builder.config("spark.jars", jar)
    else:
        builder = builder.config("spark.jars.packages", os.environ.get("QM_JDBC_PACKAGE", JDBC_PACKAGE))
    try:
        return builder.getOrCreate()
    except Exception as exc:
        _forget_failed_start()
        if jar is None:  # most often: Maven Central cannot be reached
            raise ConfigurationError(f"Spark did not start ({exc}); {NO_DRIVER_HINT}") from exc
        raise


def _forget_failed_start() -> None:
    """Close what a failed Spark start left open. When the JVM exits before it answers, PySpark
    raises without closing the pipe it opened to the JVM's stdin; unreachable from here, it would
    be reported (a ResourceWarning) whenever the garbage collector next runs, in whatever code
    runs then. Collect it now, quietly."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


@contextmanager
def job_session(app_name: str, jdbc_jar: str | None = None) -> Iterator[SparkSession]:
    """The Spark session of a command-line job, stopped at the end if this call started it.

    Under ``spark-submit`` (which starts the JVM first) its ``--master`` and ``--jars`` stand;
    otherwise a local session (:func:`spark_session`, ``local[2]``). A session already running in
    this process (a caller's, a test's) is used and left running.
    """
    existing = SparkSession.getActiveSession()
    if existing is not None:
        session = existing
    elif os.environ.get("PYSPARK_GATEWAY_PORT"):
        session = SparkSession.builder.appName(app_name).getOrCreate()
    else:
        session = spark_session(app_name, jdbc_jar=jdbc_jar)
    try:
        yield session
    finally:
        if existing is None:
            session.stop()


def require_jdbc_driver(spark: SparkSession) -> None:
    """ConfigurationError naming every way to provide it, unless the JDBC driver loads in Spark's JVM:
    a job checks before it does any work, instead of failing at its first write."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    try:
        loader = jvm.java.lang.Thread.currentThread().getContextClassLoader()
        jvm.java.lang.Class.forName(JDBC_DRIVER, True, loader)
    except Exception:
        raise ConfigurationError(f"{NO_DRIVER_HINT} (the class {JDBC_DRIVER} does not load)") from None


def jdbc_connection(spark: SparkSession, target: JdbcTarget) -> Any:
    """A JDBC connection (a ``java.sql.Connection`` proxy) opened in Spark's driver JVM, with the
    driver class Spark loaded: for the JDBC driver's own API (``getCopyAPI()``), which Spark's
    reader and writer do not expose. The caller closes it."""
    jvm: Any = spark.sparkContext._jvm
    assert jvm is not None
    loader = jvm.java.lang.Thread.currentThread().getContextClassLoader()
    driver = jvm.java.lang.Class.forName(JDBC_DRIVER, True, loader).newInstance()
    props = jvm.java.util.Properties()
    for key, value in {**target.properties, "ApplicationName": "qm-spark-enqueue"}.items():
        props.setProperty(key, value)
    conn = driver.connect(target.url, props)
    if conn is None:  # the driver does not take the URL (it takes every jdbc:postgresql: URL)
        raise ConfigurationError(f"the PostgreSQL JDBC driver refused the URL {target.url!r}")
    return conn
