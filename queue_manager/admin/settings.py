"""Operator actions on a queue's settings: alter (limits, attempts, windows... any setting of
``qm queue alter``), pause and resume on every shard, and a tenant's overrides on its shard.

Each shard's change runs in one transaction with its audit row (:mod:`queue_manager.admin.audit`),
through the SQL functions ``qm.alter_queue``, ``qm.set_tenant`` and ``qm.unset_tenant`` (which
check the values again, and whose NOTIFY makes the shard's managers apply the change at its
commit).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

import psycopg

from queue_manager.admin import audit
from queue_manager.admin.audit import Via
from queue_manager.admin.shards import Connector, check_queue, check_tenant, connector, db_error
from queue_manager.db.sqlfiles import query
from queue_manager.domain.settings import check_settings, check_tenant_settings
from queue_manager.domain.topology import Topology
from queue_manager.errors import ConfigurationError


def alter_queue(
    db: Topology | Connector,
    queue: str,
    settings: Mapping[str, Any],
    *,
    actor: str | None = None,
    via: Via = "api",
    action: str = "settings",
    action_id: uuid.UUID | None = None,
) -> dict[str, dict[str, Any]]:
    """Change settings on every shard, each shard's change audited in its transaction (a shrink
    of the partitions completes later: ``qm.finish_resize``); returns each shard's registry row."""
    check_queue(queue)
    if not settings:
        raise ConfigurationError("nothing to change: give at least one setting")
    checked = check_settings(settings)
    shards = connector(db)
    plan = dict.fromkeys(s.name for s in shards.shards)
    record = audit.new(action, queue, actor=actor, via=via, detail=checked, plan=plan, action_id=action_id)
    params = {"queue": queue, "settings": json.dumps(checked)}
    results = {}
    for shard in shards.shards:
        try:
            with shards.connect(shard) as conn, conn.transaction():
                row = conn.execute(query("alter_queue"), params).fetchone()
                record.record(conn, asked=1, changed=1, last=True)
        except psycopg.Error as exc:
            raise db_error(exc, queue, shard) from exc
        assert row is not None
        results[shard.name] = dict(row)
    return results


def pause(
    db: Topology | Connector,
    queue: str,
    *,
    actor: str | None = None,
    via: Via = "api",
    action_id: uuid.UUID | None = None,
) -> None:
    """Stop dispatching the queue's events on every shard (its managers hear it at the commit)."""
    alter_queue(db, queue, {"paused": True}, actor=actor, via=via, action="pause", action_id=action_id)


def resume(
    db: Topology | Connector,
    queue: str,
    *,
    actor: str | None = None,
    via: Via = "api",
    action_id: uuid.UUID | None = None,
) -> None:
    """Dispatch the queue's events again on every shard."""
    alter_queue(db, queue, {"paused": False}, actor=actor, via=via, action="resume", action_id=action_id)


def set_tenant(
    db: Topology | Connector,
    queue: str,
    tenant: str,
    settings: Mapping[str, Any],
    *,
    actor: str | None = None,
    via: Via = "api",
    action_id: uuid.UUID | None = None,
) -> dict[str, Any]:
    """Set a tenant's overrides of a queue (weight, max_in_flight) on the tenant's shard, the only
    one that dispatches its events, audited there; returns the stored row with ``shard``. The
    shard's manager reloads its settings at the commit."""
    check_queue(queue)
    check_tenant(tenant)
    if not settings:
        raise ConfigurationError("nothing to change: give a weight and/or a max in flight")
    checked = check_tenant_settings(settings)
    shards = connector(db)
    shard = shards.shard_for(tenant)
    detail = {"tenant": tenant, **checked}
    record = audit.new(
        "tenant_set", queue, actor=actor, via=via, detail=detail, plan={shard.name: None}, action_id=action_id
    )
    params = {"queue": queue, "tenant": tenant, "settings": json.dumps(checked)}
    try:
        with shards.connect(shard) as conn, conn.transaction():
            row = conn.execute(query("set_tenant"), params).fetchone()
            record.record(conn, asked=1, changed=1, last=True)
    except psycopg.Error as exc:
        raise db_error(exc, queue, shard) from exc
    assert row is not None
    return {"shard": shard.name, **dict(row)}


def unset_tenant(
    db: Topology | Connector,
    queue: str,
    tenant: str,
    *,
    actor: str | None = None,
    via: Via = "api",
    action_id: uuid.UUID | None = None,
) -> bool:
    """Drop a tenant's overrides of a queue (it goes back to weight 1 and the queue's default cap),
    audited on the tenant's shard; True when it had some."""
    check_queue(queue)
    check_tenant(tenant)
    shards = connector(db)
    shard = shards.shard_for(tenant)
    try:
        with shards.connect(shard) as conn, conn.transaction():
            row = conn.execute(query("unset_tenant"), {"queue": queue, "tenant": tenant}).fetchone()
            removed = bool(row and next(iter(row.values())))
            detail = {"tenant": tenant, "removed": removed}
            plan = {shard.name: None}
            record = audit.new(
                "tenant_unset", queue, actor=actor, via=via, detail=detail, plan=plan, action_id=action_id
            )
            record.record(conn, asked=1, changed=int(removed), last=True)
    except psycopg.Error as exc:
        raise db_error(exc, queue, shard) from exc
    return removed
