"""The leader's database health reading, for the gauges of ``/metrics``.

Every ``health_interval`` (10 s by default, never per dispatch round) the active manager reads the
shard's database health (``queue_manager/db/sql/health.sql``: the xmin horizon and what holds it,
replication slots, the NOTIFY queue, per queue table its tuples, vacuum ages, sizes and index bloat
estimate) and judges it on the thresholds of ``queue_manager.domain.health``, as ``qm status``
does. Catalog and statistics reads only: about a millisecond per queue table.

It reads on a connection of its own, not the writer's, so that acks never wait behind it, with
short lock and statement timeouts (``pg_relation_size`` waits for an ACCESS EXCLUSIVE lock that
a ``VACUUM FULL`` or an ``ALTER TABLE`` holds). A failed reading is logged and leaves the gauges
empty until the next one; it never fails the session.
"""

from __future__ import annotations

import contextlib
import logging

import psycopg

from queue_manager.db.health import aread_health
from queue_manager.domain import health
from queue_manager.domain.health import ShardHealth
from queue_manager.manager import store
from queue_manager.manager.runtime import Runtime
from queue_manager.manager.store import AsyncConn

logger = logging.getLogger(__name__)

#: the reading's own guards: it is worth less than anything it could wait for
HEALTH_LOCK_TIMEOUT_MS = 1000
HEALTH_STATEMENT_TIMEOUT_MS = 5000


class HealthMonitor:
    """Reads the shard's health on the leader and publishes it to the metrics."""

    name = "health"

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self._conn: AsyncConn | None = None
        self._warned = 0

    async def _connection(self) -> AsyncConn:
        if self._conn is None or self._conn.closed:
            cfg = self.rt.config
            conn = await store.connect(cfg.dsn, f"qm-manager-health {cfg.holder}")
            await conn.execute(
                f"SET lock_timeout = {HEALTH_LOCK_TIMEOUT_MS}; SET statement_timeout = {HEALTH_STATEMENT_TIMEOUT_MS}"
            )
            self._conn = conn
        return self._conn

    async def run_once(self) -> ShardHealth | None:
        """Take one reading (None when not leading or when the database could not answer)."""
        rt = self.rt
        if not rt.leading():
            return None
        started = rt.clock.monotonic()
        try:
            reading = await aread_health(await self._connection())
        except psycopg.Error as exc:
            logger.warning("database health reading failed", extra={"action": "health", "error": repr(exc)[:300]})
            rt.metrics.maintenance.inc(job=self.name, outcome="aborted")
            rt.metrics.set_health(None, [])
            await self._drop()
            return None
        warnings = health.warnings(reading)
        rt.metrics.set_health(reading, warnings, rt.clock.monotonic() - started)
        rt.metrics.maintenance.inc(job=self.name, outcome="finished")
        if len(warnings) != self._warned:  # log changes, not every reading
            self._warned = len(warnings)
            if warnings:
                logger.warning(
                    "database health: %d warning(s): %s",
                    len(warnings),
                    "; ".join(warnings),
                    extra={"action": "health_warning", "warnings": warnings},
                )
            else:
                logger.info("database health: no warnings", extra={"action": "health_warning", "warnings": []})
        rt.signals.health_read.emit(warnings)
        return reading

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()

    async def close(self) -> None:
        """The session ended: no gauges from a manager that no longer leads."""
        self.rt.metrics.set_health(None, [])
        await self._drop()
