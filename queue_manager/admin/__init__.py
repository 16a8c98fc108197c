"""The administration of queues across the shards of a topology, and the one place that performs
an operator action: the CLI (``qm queue ...``, ``qm events ...``), the dashboard and any program
call these functions and nothing else, so they cannot drift apart.

Operator actions, each state-guarded in SQL (db/sql/admin.sql, queries.sql), sliced where it
touches many events, and writing its audit row (``qm.audit``) in the transaction of its change:

- on a queue's settings (:mod:`.settings`): :func:`alter_queue`, :func:`pause`, :func:`resume`,
  a tenant's overrides :func:`set_tenant` and :func:`unset_tenant`, a key's limits :func:`set_key`
  and :func:`unset_key`;
- on events (:mod:`.events`): :func:`retry_failed` (``qm events retry``), and every action of
  :data:`ACTIONS` (retry dead letters, fire now, reschedule, cancel) by :func:`bind` (what a
  confirmation binds) and :func:`run`.

- periodic schedules (:mod:`.schedules`): add or change, pause, resume, remove; list and show
  with their next runs.

Reads: events across the shards (:mod:`.browse`: ``qm events list`` and ``show``),
:func:`create_queue` and the registry (:mod:`.queues`), :func:`status` (:mod:`.status`),
the audit (:mod:`.audit`). Every function takes a topology, or a :class:`Connector` (the
dashboard's pooled connections). Bad input is refused before any shard sees it
(:class:`~queue_manager.errors.InvalidInputError`), and a value a shard refuses is never reported as
a shard that could not be reached.
"""

from __future__ import annotations

from queue_manager.admin import browse, schedules
from queue_manager.admin.audit import Action, find, recent
from queue_manager.admin.events import ACTIONS, Binding, EventAction, Outcome, action_named, bind, retry_failed, run
from queue_manager.admin.queues import create_queue, list_keys, list_queues, list_tenants, queue_row
from queue_manager.admin.settings import alter_queue, pause, resume, set_key, set_tenant, unset_key, unset_tenant
from queue_manager.admin.shards import Connector, Direct, check_tenant
from queue_manager.admin.status import (
    QueueStatus,
    maintenance_counts,
    render_maintenance,
    render_status,
    shard_status,
    status,
)

__all__ = [
    "ACTIONS",
    "Action",
    "Binding",
    "Connector",
    "Direct",
    "EventAction",
    "Outcome",
    "QueueStatus",
    "action_named",
    "alter_queue",
    "bind",
    "browse",
    "check_tenant",
    "create_queue",
    "find",
    "list_keys",
    "list_queues",
    "list_tenants",
    "maintenance_counts",
    "pause",
    "queue_row",
    "recent",
    "render_maintenance",
    "render_status",
    "resume",
    "retry_failed",
    "run",
    "schedules",
    "set_key",
    "set_tenant",
    "shard_status",
    "status",
    "unset_key",
    "unset_tenant",
]
