"""Translate driver errors into the queue manager's error tree, at the adapter boundary."""

from __future__ import annotations

import psycopg
from psycopg import errors as pg

from queue_manager.errors import (
    EnqueueError,
    InvalidEventError,
    InvalidNameError,
    MisroutedTenantError,
    QueueManagerError,
    TenantMovedError,
    UnknownQueueError,
)

#: the SQLSTATE of qm.refuse_moved: the shard does not serve the tenant now (a reshard)
MOVED = "QMM01"


def translate(exc: psycopg.Error, *, queue: str | None = None) -> QueueManagerError | psycopg.Error:
    """The domain error for a database error, or the original error when it is not ours to explain."""
    diag = exc.diag
    message = diag.message_primary or str(exc)
    detail = diag.message_detail or ""
    if exc.sqlstate == MOVED:
        return TenantMovedError(message, right_shard=detail.removeprefix("right_shard=") or None)
    if isinstance(exc, pg.CheckViolation):
        if detail.startswith("right_shard="):
            return MisroutedTenantError(message, right_shard=detail.removeprefix("right_shard=") or None)
        constraint = diag.constraint_name or ""
        if constraint.endswith("_tenant_on_this_shard"):
            return MisroutedTenantError(f"{message}: a tenant in this batch belongs to another shard")
        if constraint.endswith("_partition_in_shuffle_set"):
            return InvalidEventError(f"{message}: a row names a partition outside its tenant's shuffle set")
        return InvalidEventError(message)
    if isinstance(exc, pg.DatetimeFieldOverflow | pg.ProgramLimitExceeded | pg.InvalidDatetimeFormat):
        return InvalidEventError(message)
    if isinstance(exc, pg.NotNullViolation):
        return InvalidEventError(f"{message} ({diag.column_name} must be set)")
    if isinstance(exc, pg.UndefinedTable):
        return UnknownQueueError(f"queue {queue!r} does not exist on this shard ({message})" if queue else message)
    if isinstance(exc, pg.InvalidName):
        return InvalidNameError(message)
    if isinstance(exc, pg.InvalidParameterValue | pg.CheckViolation):
        return EnqueueError(message)
    return exc
