"""The error tree of the queue manager.

Every error a user can meet derives from :class:`QueueManagerError`. Each class's
docstring is its default message; callers pass a more precise one (what was wrong,
what was expected, what to do).

    QueueManagerError
    ├── ConfigurationError        bad settings, topology files, CLI arguments
    │   ├── TopologyError         keyspace ranges that do not cover the keyspace exactly
    │   └── InvalidInputError     a value of an operator's command, form or filter PostgreSQL cannot hold
    ├── InvalidNameError          a queue or shard name outside the allow-list
    ├── EnqueueError              the database refused an event
    │   ├── MisroutedTenantError  the tenant belongs to another shard
    │   │   └── TenantMovedError  a reshard moved (or is moving) the tenant's range: retry on the shard named
    │   ├── InvalidEventError     empty tenant, bad fire_at, oversized payload, ...
    │   └── QueuePausedError      (reserved) the queue refuses new events
    ├── UnknownQueueError         no queue of that name on the shard
    ├── LocalClusterError         the embedded PostgreSQL servers could not be started
    ├── MigrationError            a database the migrations cannot bring to head
    ├── ArchiveError              the archive job found its output or a shard not as it left them
    └── AdoptError                qm queue adopt stopped: rows the queue refuses, or a run already going
"""

from __future__ import annotations


class QueueManagerError(Exception):
    """A queue manager operation failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or self.__doc__ or type(self).__name__)


class ConfigurationError(QueueManagerError):
    """The configuration is invalid."""


class TopologyError(ConfigurationError):
    """The topology is invalid."""


class InvalidInputError(ConfigurationError):
    """A value given to a command, a form or a filter is malformed or out of range."""


class InvalidNameError(QueueManagerError):
    """A name is not allowed."""


class EnqueueError(QueueManagerError):
    """The database refused the event."""


class MisroutedTenantError(EnqueueError):
    """The tenant belongs to another shard."""

    def __init__(self, message: str | None = None, *, right_shard: str | None = None) -> None:
        super().__init__(message)
        #: name of the shard that owns the tenant, when the database said so
        self.right_shard = right_shard


class TenantMovedError(MisroutedTenantError):
    """The tenant's range moved, or is moving, to another shard: reload the topology and retry there."""


class InvalidEventError(EnqueueError):
    """The event is invalid."""


class QueuePausedError(EnqueueError):
    """The queue is paused."""


class UnknownQueueError(QueueManagerError):
    """No queue of that name exists on the shard."""


class LocalClusterError(QueueManagerError):
    """The local embedded PostgreSQL cluster could not be managed."""


class MigrationError(QueueManagerError):
    """The database cannot be migrated."""


class ArchiveError(QueueManagerError):
    """The archive job stopped before deleting anything it could not vouch for."""


class AdoptError(QueueManagerError):
    """Adopting the legacy queue stopped; nothing taken from it was lost."""
