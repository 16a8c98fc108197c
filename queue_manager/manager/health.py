"""The leader's database health reading, for the gauges of ``/metrics``.

Every ``health_interval`` (5 s by default, never per dispatch round) the active manager reads the
shard's database health (``queue_manager/db/sql/health.sql``: the xmin horizon and what holds it,
replication slots, the NOTIFY queue, per queue table its tuples, vacuum ages, sizes and index bloat
estimate) and judges it on the thresholds of ``queue_manager.domain.health``, as ``qm status``
does. Catalog and statistics reads only: about a millisecond per queue table.

It reads on a connection of its own, not the writer's, so that acks never wait behind it, with
short lock and statement timeouts (``pg_relation_size`` waits for an ACCESS EXCLUSIVE lock that
a ``VACUUM FULL`` or an ``ALTER TABLE`` holds). A failed reading is logged and leaves the gauges
empty until the next one; it never fails the session.

**Vacuum when autovacuum is late.** Autovacuum visits a database once per ``autovacuum_naptime``
(60 s by default), a server-wide setting a table's storage parameters cannot change; a queue table
under churn passes its vacuum trigger within seconds, so between two visits its dead rows take new
pages and the table grows (docs/benchmarks-history.md, "Churn"). After each reading the leader therefore
vacuums, on the same connection, every queue table that has been past autovacuum's trigger and
unvacuumed for ``vacuum_after`` seconds (5 by default; ``queue_manager.domain.health.tables_to_vacuum``
has the rule and what it leaves to autovacuum). ``VACUUM (SKIP_LOCKED)``: a table another vacuum
holds is skipped, not waited for.
"""

from __future__ import annotations

import contextlib
import logging

import psycopg
from psycopg import sql

from queue_manager.db.health import aread_health
from queue_manager.domain import health
from queue_manager.domain.health import ShardHealth
from queue_manager.domain.names import check_queue_name
from queue_manager.manager import store
from queue_manager.manager.runtime import Runtime
from queue_manager.manager.store import AsyncConn

logger = logging.getLogger(__name__)

#: the reading's own guards: it is worth less than anything it could wait for
HEALTH_LOCK_TIMEOUT_MS = 1000
HEALTH_STATEMENT_TIMEOUT_MS = 5000
#: a VACUUM's statement timeout (tables over VACUUM_MAX_BYTES are left to autovacuum)
VACUUM_TIMEOUT_MS = 600_000


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
            try:
                await conn.execute(
                    f"SET lock_timeout = {HEALTH_LOCK_TIMEOUT_MS}; "
                    f"SET statement_timeout = {HEALTH_STATEMENT_TIMEOUT_MS}"
                )
            except BaseException:  # cancelled by the session's end, too: not left for the collector
                with contextlib.suppress(Exception):
                    await conn.close()
                raise
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
        for queue in health.tables_to_vacuum(reading, rt.config.vacuum_after):
            if not rt.leading():
                break
            await self._vacuum(queue)
        return reading

    async def _vacuum(self, queue: str) -> None:
        rt = self.rt
        started = rt.clock.monotonic()
        try:
            conn = await self._connection()
            await conn.execute(f"SET statement_timeout = {VACUUM_TIMEOUT_MS}")
            await conn.execute(sql.SQL("VACUUM (SKIP_LOCKED) {}").format(sql.Identifier(check_queue_name(queue))))
            await conn.execute(f"SET statement_timeout = {HEALTH_STATEMENT_TIMEOUT_MS}")
        except psycopg.Error as exc:
            logger.warning(
                "vacuum of a queue table failed",
                extra={"action": "vacuum", "queue": queue, "error": repr(exc)[:300]},
            )
            await self._drop()
            return
        rt.metrics.vacuums.inc(queue=queue)
        logger.debug(
            "vacuumed a queue table autovacuum had left past its trigger",
            extra={"action": "vacuum", "queue": queue, "seconds": round(rt.clock.monotonic() - started, 3)},
        )
        rt.signals.vacuumed.emit(queue)

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()

    async def close(self) -> None:
        """The session ended: no gauges from a manager that no longer leads."""
        self.rt.metrics.set_health(None, [])
        await self._drop()
