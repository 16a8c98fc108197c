"""Queues across the shards: created on every shard with the same settings (``qm.create_queue``,
which also works from any SQL client), and the registry, tenant overrides and key limits read back. Changing
a queue is an operator action: :mod:`queue_manager.admin.settings`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import psycopg
from psycopg import errors as pg

from queue_manager.admin.shards import Connector, check_queue, connector, db_error
from queue_manager.db.sqlfiles import query
from queue_manager.domain.settings import check_settings
from queue_manager.domain.topology import Topology
from queue_manager.errors import ConfigurationError, UnknownQueueError


def create_queue(
    db: Topology | Connector, queue: str, settings: Mapping[str, Any], *, if_not_exists: bool = False
) -> dict[str, dict[str, Any]]:
    """Create the queue on every shard; returns each shard's registry row, with ``existed``: whether
    the queue was there already (left unchanged with ``if_not_exists``; an error naming the shard
    without it)."""
    check_queue(queue)
    params = {"queue": queue, "settings": json.dumps(check_settings(settings)), "if_not_exists": if_not_exists}
    shards = connector(db)
    results = {}
    for shard in shards.shards:
        found = None
        try:
            with shards.connect(shard) as conn:
                found = conn.execute(query("queue_exists"), params).fetchone()
                row = conn.execute(query("create_queue"), params).fetchone()
        except pg.DuplicateTable as exc:
            hint = " (qm queue alter changes its settings)" if found and found["existed"] else ""
            what = (exc.diag.message_primary or str(exc)).replace(" on this shard", "")
            raise ConfigurationError(f"shard {shard.name}: {what}{hint}") from exc
        except psycopg.Error as exc:
            raise db_error(exc, queue, shard) from exc
        assert row is not None and found is not None
        results[shard.name] = {**dict(row), "existed": bool(found["existed"])}
    return results


def list_queues(db: Topology | Connector) -> dict[str, list[dict[str, Any]]]:
    """Every shard's queue registry."""
    shards = connector(db)
    out = {}
    for shard in shards.shards:
        with shards.connect(shard) as conn:
            out[shard.name] = [dict(r) for r in conn.execute(query("list_queues")).fetchall()]
    return out


def queue_row(db: Topology | Connector, queue: str) -> dict[str, Any]:
    """A queue's registry row (as the first shard that has it stores it); UnknownQueueError if none has."""
    check_queue(queue)
    for rows in list_queues(db).values():
        for row in rows:
            if row["name"] == queue:
                return row
    raise UnknownQueueError(f"no queue named {queue!r} on any shard")


def _overrides(db: Topology | Connector, name: str, queue: str | None) -> list[dict[str, Any]]:
    """The rows of the query ``name`` of one queue (or of every queue) on every shard, each with its shard."""
    if queue is not None:
        check_queue(queue)
    shards = connector(db)
    out = []
    for shard in shards.shards:
        with shards.connect(shard) as conn:
            out += [{"shard": shard.name, **dict(r)} for r in conn.execute(query(name), {"queue": queue})]
    return out


def list_tenants(db: Topology | Connector, queue: str | None = None) -> list[dict[str, Any]]:
    """Every tenant override of a queue (or of every queue), with the shard that holds it."""
    return _overrides(db, "list_tenants", queue)


def list_keys(db: Topology | Connector, queue: str | None = None) -> list[dict[str, Any]]:
    """Every key's own limits of a queue (or of every queue), with the shard that holds them."""
    return _overrides(db, "list_keys", queue)
