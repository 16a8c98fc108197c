"""JDBC connection settings of a shard, translated from its libpq DSN.

Spark reaches PostgreSQL through the JDBC driver, which takes a URL
(``jdbc:postgresql://host:port/dbname``) and a map of properties (``user``, ``password``, ...),
not a libpq DSN. :func:`shard_jdbc_target` translates a shard's DSN from the topology file
(URI or ``key=value`` form), so that the topology stays the one place that names the databases.

Only what a job needs is carried over: hosts and ports (several for a multi-host DSN), the
database, the user, the password, ``sslmode``, ``connect_timeout`` and ``application_name``.
Other libpq settings (``passfile``, ``service``, ...) have no JDBC equivalent and are ignored.
A Unix-socket host (a path) is refused: the JDBC driver speaks TCP only.
"""

from __future__ import annotations

import getpass
from dataclasses import dataclass, field
from urllib.parse import quote

from psycopg.conninfo import conninfo_to_dict

from queue_manager.errors import ConfigurationError

#: class name of the PostgreSQL JDBC driver
JDBC_DRIVER = "org.postgresql.Driver"

# libpq keyword -> JDBC property, for the settings that are passed through as is
_PASSED_THROUGH = {
    "password": "password",
    "sslmode": "sslmode",
    "connect_timeout": "connectTimeout",
    "application_name": "ApplicationName",
}


@dataclass(frozen=True)
class JdbcTarget:
    """Where and how Spark connects to one shard."""

    #: ``jdbc:postgresql://host:port[,host:port...]/dbname``
    url: str
    #: JDBC connection properties (``driver``, ``user`` and, when the DSN has them, ``password``,
    #: ``sslmode``, ``connectTimeout``, ``ApplicationName``)
    properties: dict[str, str] = field(default_factory=dict)


def shard_jdbc_target(dsn: str) -> JdbcTarget:
    """The JDBC URL and properties of a libpq DSN; ConfigurationError if it cannot be expressed in JDBC."""
    try:
        params = {k: str(v) for k, v in conninfo_to_dict(dsn).items() if v is not None}
    except Exception as exc:  # psycopg raises ProgrammingError for a malformed DSN
        raise ConfigurationError(f"invalid DSN for a JDBC connection: {exc}") from None
    hosts = (params.get("host") or params.get("hostaddr") or "localhost").split(",")
    ports = (params.get("port") or "5432").split(",")
    if len(ports) == 1:
        ports = ports * len(hosts)
    if len(ports) != len(hosts):
        raise ConfigurationError(f"DSN lists {len(hosts)} hosts but {len(ports)} ports")
    for host in hosts:
        if host.startswith("/") or host.startswith("@"):
            raise ConfigurationError(
                f"DSN host {host!r} is a Unix socket, which JDBC cannot use: give the shard a TCP host and port"
            )
    user = params.get("user") or getpass.getuser()
    dbname = params.get("dbname") or user
    netlocs = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in zip(hosts, ports, strict=True))
    properties = {"driver": JDBC_DRIVER, "user": user}
    for libpq_key, jdbc_key in _PASSED_THROUGH.items():
        if params.get(libpq_key):
            properties[jdbc_key] = params[libpq_key]
    return JdbcTarget(f"jdbc:postgresql://{netlocs}/{quote(dbname, safe='')}", properties)
