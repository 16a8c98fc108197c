"""The manager's configuration: one frozen, fully validated object (``qm manager`` maps its flags onto it)."""

from __future__ import annotations

import math
import os
import secrets
import socket
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from queue_manager.domain.topology import Topology
from queue_manager.manager.auth import TokenStore

#: how close to the lease's end the manager stops trusting it (seconds)
LEASE_MARGIN = 0.5


def _default_holder() -> str:
    # host + pid + a random incarnation: two processes never share an identity, even on one host
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


@dataclass(frozen=True)
class ManagerConfig:
    """Settings of one manager process. Every field is checked when the object is made."""

    #: libpq connection string of the shard's database
    dsn: str
    #: receiver credentials (docs/protocol.md, "Tokens and scoping")
    tokens: TokenStore
    #: the shard this manager expects to serve; checked against ``qm.shard`` (None: any)
    shard: str | None = None
    #: listen address of the websocket, metrics and health port
    host: str = "127.0.0.1"
    #: listen port; 0 takes any free port (see ``Manager.port``)
    port: int = 0
    #: allowed ``Origin`` headers; None allows any (non-browser clients send none)
    allowed_origins: frozenset[str] | None = None
    #: the leadership lease, seconds; renewed every third of it
    lease_ttl: float = 5.0
    #: how often a standby reads the lease (a plain read: it takes the lease once it has expired, or
    #: once its holder's backend is gone; docs/manager.md, "Leadership and fencing"), seconds
    standby_poll: float = 0.1
    #: how often the old-event collector runs, seconds
    sweep_interval: float = 1.0
    #: how often the leader's baseline pass of the retention purge walks the partitions (deletes settled
    #: events older than the queue's retentions); slices come on top (``slice_interval``)
    purge_interval: float = 5.0
    #: how often the leader's baseline pass re-anchors every partition's load counter on a count of
    #: its live events (the reconciliation period of docs/design.md, "Shuffle sharding"); slices
    #: come on top
    reconcile_interval: float = 60.0
    #: how often the leader reads the database's health for its gauges (xmin horizon, dead tuples,
    #: sizes, bloat estimate, NOTIFY queue; docs/operations.md, "Database health"), seconds
    health_interval: float = 5.0
    #: a queue table past autovacuum's trigger that autovacuum has not vacuumed for this long is
    #: vacuumed by the leader itself (docs/operations.md, "Vacuum"); 0 leaves it to autovacuum
    vacuum_after: float = 5.0
    #: least time between two maintenance slices this process recruits itself for (as leader in its
    #: dispatcher's idle moments, as standby on its maintenance loop), seconds; the baseline passes of
    #: ``purge_interval`` and ``reconcile_interval`` come on top (docs/manager.md, "Maintenance slices")
    slice_interval: float = 0.2
    #: most acked events, and most failed events, one retention slice deletes
    slice_rows: int = 500
    #: the leader takes maintenance slices when its dispatcher has nothing to do
    idle_slices: bool = True
    #: a standby takes maintenance slices (it has spare cycles and a database connection)
    standby_slices: bool = True
    #: every partition of a queue is rescanned at least this often (the safety net), seconds
    rescan_interval: float = 2.0
    #: most events fired by one statement
    fire_batch: int = 1000
    #: on SIGTERM, how long to wait for the acks of events in hand, seconds
    drain_timeout: float = 30.0
    #: most events in one deliver frame
    max_events_per_frame: int = 500
    #: the share of fire and ack batches that get a span linked to their events' trace contexts
    #: (docs/observability.md, "Traces"); 0: none, and OpenTelemetry is not imported
    trace_sample: float = 0.0
    #: websocket keep-alive pings, seconds
    ping_interval: float = 10.0
    ping_timeout: float = 10.0
    #: a leader whose database session has been down this long gives its lease up, so that a
    #: standby can take over; None = the lease TTL
    recover_within: float | None = None
    #: fires wait for their WAL flush before the push (see docs/manager.md, "Durable fires")
    durable_fires: bool = True
    #: every shard of the deployment: the manager writes its slices of the queues' max_qps and
    #: max_concurrency into each of their databases (docs/design.md, "Rate and concurrency limits
    #: across shards"). None: only its own shard's database, so it shares the limits only with
    #: managers that write there (alone, it takes the whole limits)
    topology: Topology | None = None
    #: the topology file ``topology`` came from: when it changes (a reshard's switch rewrites it),
    #: the manager writes its slices into the new set of shards from its next limits round on,
    #: without a restart. None: the topology stays as given
    topology_file: Path | None = None
    #: a slice of a limit is live this long after its last publish, seconds; a manager whose peer
    #: stops publishing takes its share after about this long (published every sixth of it)
    rate_lease_ttl: float = 0.6
    #: this process's identity in the lease
    holder: str = field(default_factory=_default_holder)

    def __post_init__(self) -> None:
        if not self.dsn:
            raise ValueError("dsn must name the shard's database")
        if not 0 <= self.port <= 65_535:
            raise ValueError(f"port must be from 0 to 65535, got {self.port}")
        if not (math.isfinite(self.lease_ttl) and self.lease_ttl >= 1.0):
            raise ValueError("lease_ttl must be at least 1 second")
        if not 1 <= self.fire_batch <= 10_000:
            raise ValueError("fire_batch must be between 1 and 10000")
        if not 1 <= self.slice_rows <= 10_000:
            raise ValueError("slice_rows must be between 1 and 10000")
        if not (math.isfinite(self.trace_sample) and 0 <= self.trace_sample <= 1):
            raise ValueError(f"trace_sample must be from 0 to 1, got {self.trace_sample!r}")
        if not 1 <= self.max_events_per_frame <= 10_000:
            raise ValueError("max_events_per_frame must be between 1 and 10000")
        seconds = (
            "standby_poll",
            "sweep_interval",
            "purge_interval",
            "reconcile_interval",
            "health_interval",
            "slice_interval",
            "rescan_interval",
            "ping_interval",
            "ping_timeout",
        )
        for name in seconds:
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds")
        if not (math.isfinite(self.drain_timeout) and self.drain_timeout >= 0):
            raise ValueError("drain_timeout must be zero or a positive number of seconds")
        if not (math.isfinite(self.vacuum_after) and self.vacuum_after >= 0):
            raise ValueError("vacuum_after must be zero (off) or a positive number of seconds")
        if self.recover_within is not None and not (math.isfinite(self.recover_within) and self.recover_within > 0):
            raise ValueError("recover_within must be a positive number of seconds")
        if not self.holder:
            raise ValueError("holder must be a non-empty name")
        if not (math.isfinite(self.rate_lease_ttl) and 0.1 <= self.rate_lease_ttl <= 60):
            raise ValueError("rate_lease_ttl must be between 0.1 and 60 seconds")
        if self.topology is not None and self.shard is not None:
            self.topology.by_name(self.shard)  # TopologyError naming the shards it has

    @property
    def renew_interval(self) -> float:
        return self.lease_ttl / 3

    @property
    def recovery_deadline(self) -> float:
        """Seconds a leader may stay unable to dispatch before it gives the lease up."""
        return self.lease_ttl if self.recover_within is None else self.recover_within

    @property
    def rate_interval(self) -> float:
        """How often the slices are published and the peers' rows read, seconds."""
        return self.rate_lease_ttl / 6

    @property
    def rate_trust(self) -> float:
        """How long after the start of a publish that reached every live peer its slices may be
        used, seconds: the lease less a margin for the time the publish and the read took."""
        return self.rate_lease_ttl * 0.75

    @classmethod
    def default(cls, name: str) -> Any:
        """The default of the field ``name`` (what ``qm manager``'s flags default to)."""
        for f in fields(cls):
            if f.name == name:
                if f.default is MISSING:
                    raise ValueError(f"ManagerConfig.{name} has no plain default")
                return f.default
        raise ValueError(f"ManagerConfig has no field {name!r}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
