"""Keyspace routing and shuffle sharding as Spark SQL column expressions.

This is :mod:`queue_manager.domain.routing` rewritten with Spark SQL built-in functions only
(``md5``, ``sha2``, ``substring``, ``conv``, ``pmod``, ``div``), so a job can route or check millions of
rows without a Python UDF. Every function takes and returns :class:`pyspark.sql.Column`
expressions; the shuffle-set shape (``n`` partitions, ``k`` per tenant) is a pair of Python
ints, validated with :func:`queue_manager.domain.routing.check_shuffle_params`, so the
per-group constants are folded into the expression when it is built.

Let ``h = md5(cast(tenant as binary))`` and ``g = sha2(cast(tenant as binary), 256)``: Spark
casts a string to its UTF-8 bytes, which is what the Python (``hashlib``) and PostgreSQL
(``md5(text)``, ``sha256(convert_to(text, 'UTF8'))``) sides hash.
All results are NULL for a NULL tenant (and :func:`in_shuffle_set` for a NULL partition).
The test vectors in ``tests/vectors/routing_vectors.json`` pin the behaviour.
"""

from __future__ import annotations

import gc
import os
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pyspark.sql import Column, SparkSession
from pyspark.sql import functions as F

from queue_manager.domain.routing import (
    DRAW_WORD_HEX_DIGITS,
    KEYSPACE_HEX_DIGITS,
    check_shuffle_params,
    draw_offset,
    draw_width,
    group_bounds,
)
from queue_manager.errors import ConfigurationError, TopologyError

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

_BOUND_RE = re.compile(r"^(?:[0-9a-f]{16})?$")


def tenant_md5(tenant: Column) -> Column:
    """The 32 lowercase hex digits of md5 over the tenant's UTF-8 bytes."""
    return F.md5(tenant.cast("binary"))


def tenant_sha256(tenant: Column) -> Column:
    """The 64 lowercase hex digits of sha256 over the tenant's UTF-8 bytes (the draws' hash)."""
    return F.sha2(tenant.cast("binary"), 256)


def _keyspace_hex_of(h: Column) -> Column:
    return h.substr(1, KEYSPACE_HEX_DIGITS)


def keyspace_hex(tenant: Column) -> Column:
    """The tenant's keyspace id as 16 lowercase hex digits (the form key ranges compare against)."""
    return _keyspace_hex_of(tenant_md5(tenant))


def keyspace_id(tenant: Column) -> Column:
    """The tenant's unsigned 64-bit keyspace id as ``decimal(20,0)`` (it does not fit a signed bigint)."""
    return F.conv(keyspace_hex(tenant), 16, 10).cast("decimal(20,0)")


def _hex_to_int(digits: Column, width: int) -> Column:
    """``width`` hex digits as an integer: bigint up to 15 digits, decimal(20,0) for 16 (unsigned 64-bit)."""
    return F.conv(digits, 16, 10).cast("decimal(20,0)" if width >= KEYSPACE_HEX_DIGITS else "bigint")


def _draw(g: Column, k: int, j: int | Column) -> Column:
    """Group ``j``'s draw: ``w`` hex digits of ``g`` from 0-based digit ``draw_offset(k, j)``."""
    width = draw_width(k)
    if isinstance(j, int):
        return _hex_to_int(g.substr(draw_offset(k, j) + 1, width), width)
    per_word = DRAW_WORD_HEX_DIGITS // width
    word = _div(j, F.lit(per_word))
    start = F.lit(1) + word * F.lit(DRAW_WORD_HEX_DIGITS) + F.pmod(j, F.lit(per_word)) * F.lit(width)
    return _hex_to_int(g.substr(start, F.lit(width)), width)


def _div(a: Column, b: Column) -> Column:
    """Integral division (SQL ``a div b``), exact for the non-negative ints used here."""
    return F.call_function("div", a, b)


def shuffle_set(tenant: Column, n: int, k: int) -> Column:
    """The tenant's ``k`` partitions of ``n`` as an ascending ``array<int>`` (one per group).

    Group ``j`` is ``[j*n div k, (j+1)*n div k)`` and its pick is ``lo + draw_j mod size``.
    Raises ConfigurationError for an invalid shape.
    """
    check_shuffle_params(n, k)
    g = tenant_sha256(tenant)
    picks = []
    for j in range(k):
        lo, hi = group_bounds(n, k, j)
        pick = F.lit(lo) + F.pmod(_draw(g, k, j), F.lit(hi - lo))
        picks.append(pick.cast("int"))
    return F.array(*picks)


def in_shuffle_set(tenant: Column, partition: Column, n: int, k: int) -> Column:
    """Whether ``partition`` is in the tenant's shuffle set, by the closed formula the database checks.

    ``p`` lies in group ``j = ((p+1)*k - 1) div n`` and belongs to the set iff it equals that
    group's pick. False for a partition outside ``[0, n)``; NULL for a NULL tenant or partition.
    Raises ConfigurationError for an invalid shape.
    """
    check_shuffle_params(n, k)
    p = partition.cast("bigint")
    g = tenant_sha256(tenant)
    j = _div((p + F.lit(1)) * F.lit(k) - F.lit(1), F.lit(n))
    lo = _div(j * F.lit(n), F.lit(k))
    hi = _div((j + F.lit(1)) * F.lit(n), F.lit(k))
    pick = lo + F.pmod(_draw(g, k, j), hi - lo)
    in_range = (p >= F.lit(0)) & (p < F.lit(n))
    # ``when`` keeps out-of-range partitions away from the draw (a negative j would read bad digits)
    return F.when(in_range, p == pick).when(p.isNotNull(), F.lit(False))


def in_key_range(tenant: Column, start: str, end: str) -> Column:
    """Whether the tenant's keyspace id lies in ``[start, end)``.

    ``start`` and ``end`` are normalised bounds as in
    :class:`queue_manager.domain.topology.KeyRange`: 16 lowercase hex digits, or ``''`` for an
    open end. The comparison is on the hex strings (byte order). Raises TopologyError for a
    malformed bound.
    """
    return keyspace_hex_in_range(keyspace_hex(tenant), start, end)


def keyspace_hex_in_range(kid: Column, start: str, end: str) -> Column:
    """:func:`in_key_range` for a keyspace id already computed (:func:`keyspace_hex`): a job that
    tests several ranges hashes each tenant once."""
    for what, bound in (("start", start), ("end", end)):
        if not _BOUND_RE.match(bound):
            raise TopologyError(
                f"{what} bound {bound!r} must be 16 lowercase hex digits or '' (use KeyRange.parse to normalise)"
            )
    cond = kid.isNotNull()
    if start:
        cond = kid >= F.lit(start)
    if end:
        below = kid < F.lit(end)
        cond = (cond & below) if start else below
    return cond


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
