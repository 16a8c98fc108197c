"""Operator actions on a queue's settings: alter (limits, attempts, windows... any setting of
``qm queue alter``), pause and resume on every shard, and a tenant's overrides and a key's limits on the tenant's shard.

Each shard's change runs in one transaction with its audit row (:mod:`queue_manager.admin.audit`),
through the SQL functions ``qm.alter_queue``, ``qm.set_tenant``, ``qm.unset_tenant``, ``qm.set_key`` and
``qm.unset_key`` (which
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
from queue_manager.domain.settings import check_key_settings, check_settings, check_tenant_settings
from queue_manager.domain.topology import Shard, Topology
from queue_manager.errors import ConfigurationError


def _audited(
    shards: Connector, shard: Shard, queue: str, name: str, params: dict[str, Any], record: audit.Audit
) -> dict[str, Any]:
    """One shard's settings change (the query ``name``) and its audit row, in one transaction; the
    row it returns. The row's first column true (or a row at all) counts as a change."""
    try:
        with shards.connect(shard) as conn, conn.transaction():
            row = conn.execute(query(name), params).fetchone()
            assert row is not None
            changed = next(iter(row.values())) is not False
            record.record(conn, asked=1, changed=int(changed), last=True)
    except psycopg.Error as exc:
        raise db_error(exc, queue, shard) from exc
    return dict(row)


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
    return {s.name: _audited(shards, s, queue, "alter_queue", params, record) for s in shards.shards}


def pause(db: Topology | Connector, queue: str, **who: Any) -> None:
    """Stop dispatching the queue's events on every shard (its managers hear it at the commit);
    ``who``: ``actor``, ``via`` and ``action_id`` as for :func:`alter_queue`."""
    alter_queue(db, queue, {"paused": True}, action="pause", **who)


def resume(db: Topology | Connector, queue: str, **who: Any) -> None:
    """Dispatch the queue's events again on every shard (``who`` as for :func:`pause`)."""
    alter_queue(db, queue, {"paused": False}, action="resume", **who)


def _tenant_action(
    db: Topology | Connector, name: str, queue: str, tenant: str, detail: dict[str, Any], **who: Any
) -> tuple[Shard, dict[str, Any]]:
    """A tenant's overrides changed by the query ``name`` on its shard, audited there."""
    check_queue(queue)
    check_tenant(tenant)
    shards = connector(db)
    shard = shards.shard_for(tenant)
    record = audit.new(f"tenant_{name}", queue, detail={"tenant": tenant, **detail}, plan={shard.name: None}, **who)
    params = {"queue": queue, "tenant": tenant, "settings": json.dumps(detail)}
    return shard, _audited(shards, shard, queue, f"{name}_tenant", params, record)


def set_tenant(
    db: Topology | Connector, queue: str, tenant: str, settings: Mapping[str, Any], **who: Any
) -> dict[str, Any]:
    """Set a tenant's overrides of a queue (weight, max_in_flight) on the tenant's shard, the only
    one that dispatches its events, audited there (``who``: ``actor``, ``via``, ``action_id`` as
    for :func:`alter_queue`); returns the stored row with ``shard``. The shard's manager reloads its
    settings at the commit."""
    if not settings:
        raise ConfigurationError("nothing to change: give a weight and/or a max in flight")
    shard, row = _tenant_action(db, "set", queue, tenant, check_tenant_settings(settings), **who)
    return {"shard": shard.name, **row}


def unset_tenant(db: Topology | Connector, queue: str, tenant: str, **who: Any) -> bool:
    """Drop a tenant's overrides of a queue (it goes back to weight 1 and the queue's default cap),
    audited on the tenant's shard (``who`` as for :func:`set_tenant`); True when it had some."""
    _, row = _tenant_action(db, "unset", queue, tenant, {}, **who)
    return bool(next(iter(row.values())))


def _key_action(
    db: Topology | Connector, name: str, queue: str, tenant: str, key: str, detail: dict[str, Any], **who: Any
) -> tuple[Shard, dict[str, Any]]:
    """A key's limits changed by the query ``name`` on its tenant's shard, audited there."""
    check_queue(queue)
    check_tenant(tenant)
    if not key:
        raise ConfigurationError("give a non-empty key")
    shards = connector(db)
    shard = shards.shard_for(tenant)
    record = audit.new(
        f"key_{name}", queue, detail={"tenant": tenant, "key": key, **detail}, plan={shard.name: None}, **who
    )
    params = {"queue": queue, "tenant": tenant, "key": key, "settings": json.dumps(detail)}
    return shard, _audited(shards, shard, queue, f"{name}_key", params, record)


def set_key(
    db: Topology | Connector, queue: str, tenant: str, key: str, settings: Mapping[str, Any], **who: Any
) -> dict[str, Any]:
    """Set the limits of one key of a tenant (max_in_flight for its concurrency_key, max_qps for its
    rate_key) on the tenant's shard, the only one that dispatches its events, audited there (``who``
    as for :func:`set_tenant`); returns the stored row with ``shard``. The shard's manager reloads
    its settings at the commit (a NOTIFY from ``qm.key_settings``)."""
    if not settings:
        raise ConfigurationError("nothing to change: give a max in flight and/or a max qps")
    shard, row = _key_action(db, "set", queue, tenant, key, check_key_settings(settings), **who)
    return {"shard": shard.name, **row}


def unset_key(db: Topology | Connector, queue: str, tenant: str, key: str, **who: Any) -> bool:
    """Drop a key's own limits (the queue's key_max_in_flight and key_max_qps apply), audited on
    the tenant's shard (``who`` as for :func:`set_tenant`); True when it had some."""
    _, row = _key_action(db, "unset", queue, tenant, key, {}, **who)
    return bool(next(iter(row.values())))
