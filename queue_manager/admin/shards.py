"""How the admin API reaches the shards, what it makes of their errors, and the checks of its
inputs before any shard sees them.

Every function of the API takes either a :class:`~queue_manager.domain.topology.Topology` (a new
connection per shard and call: the CLI) or any :class:`Connector` (the dashboard passes its
pools, whose connections carry its statement timeout).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import psycopg
from psycopg import errors as pg
from psycopg.rows import dict_row

from queue_manager.db.errors import translate
from queue_manager.domain.inputs import event_id_problem, text_problem
from queue_manager.domain.names import check_queue_name
from queue_manager.domain.topology import Shard, Topology
from queue_manager.errors import ConfigurationError, InvalidInputError, QueueManagerError, UnknownQueueError

Conn = psycopg.Connection[dict[str, Any]]


class Connector(Protocol):
    """The shards, and a connection to one: in autocommit mode, with ``dict_row`` rows."""

    @property
    def shards(self) -> tuple[Shard, ...]: ...

    def shard_for(self, tenant: str) -> Shard: ...

    def connect(self, shard: Shard) -> AbstractContextManager[Conn]: ...


class Direct:
    """The shards of a topology, a new connection for each use."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.shards = topology.shards

    def shard_for(self, tenant: str) -> Shard:
        return self.topology.shard_for(tenant)

    def connect(self, shard: Shard) -> AbstractContextManager[Conn]:
        return psycopg.connect(shard.dsn, autocommit=True, row_factory=dict_row)


def connector(db: Topology | Connector) -> Connector:
    """``db`` as a :class:`Connector` (a topology: :class:`Direct`)."""
    return Direct(db) if isinstance(db, Topology) else db


def db_error(exc: psycopg.Error, queue: str | None, shard: Shard | None = None) -> QueueManagerError | psycopg.Error:
    """The error to raise for ``exc``: a refused value is the input's fault (InvalidInputError, never
    "unreachable"); a connection that failed, or a statement cancelled, stays the driver's
    OperationalError (the CLI says the database could not be reached, the dashboard that a shard
    did not answer, or was too slow)."""
    on = f" on shard {shard.name!r}" if shard is not None else ""
    what = f"queue {queue!r}" if queue else "the action"
    message = exc.diag.message_primary or str(exc).strip()
    if isinstance(exc, pg.UndefinedTable):
        return UnknownQueueError(f"{message}{on}" if exc.diag.message_primary else f"no queue named {queue!r}{on}")
    if isinstance(exc, pg.CheckViolation) and exc.diag.table_name in ("queues", "tenant_settings", "key_settings"):
        kind = {"queues": "settings", "tenant_settings": "tenant settings"}.get(exc.diag.table_name, "key settings")
        return ConfigurationError(f"{what}: invalid {kind} ({message})")
    if isinstance(exc, pg.DuplicateTable):
        return ConfigurationError(message)
    if isinstance(exc, pg.InvalidParameterValue | psycopg.DataError | psycopg.IntegrityError):
        return InvalidInputError(f"{what}{on}: the database refused a value: {message}")
    return translate(exc, queue=queue)


def check_tenant(tenant: str) -> str:
    """``tenant`` if it can name a tenant (not empty, text PostgreSQL can hold), else InvalidInputError."""
    if not isinstance(tenant, str) or not tenant:
        raise InvalidInputError("give a non-empty tenant")
    problem = text_problem(tenant)
    if problem is not None:
        raise InvalidInputError(f"tenant {tenant[:40]!r} {problem}")
    return tenant


def check_ids(ids: Iterable[int]) -> list[int]:
    """``ids`` if each is an event id (a positive bigint), else InvalidInputError."""
    out = list(ids)
    for i in out:
        problem = event_id_problem(i)
        if problem is not None:
            raise InvalidInputError(f"event id {problem}")
    return out


def check_queue(queue: str) -> str:
    """``queue`` if it is a queue's name, else InvalidNameError."""
    return check_queue_name(queue)
