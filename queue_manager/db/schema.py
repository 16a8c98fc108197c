"""The schema as source: functions, trigger generators and triggers applied after every migration.

The alembic revisions (``alembic/versions``, SQL in ``sql/revisions/``) hold only tables, types,
sequences, indexes and data. Every function of schema ``qm``, every generator of a queue's
triggers and every trigger on a ``qm`` table is defined once, in its own file under
``sql/schema/`` (``qm.<name>`` in ``<area>/<name>.sql``), with ``CREATE OR REPLACE``. At the end of
every migration to head, :func:`apply_schema` runs those files in the order of :data:`SOURCE`, then
regenerates every queue's counters, functions and triggers from them (``qm.apply_queue``), all in the
migration's transaction. So the files are the functions' current definition, and a database
migrated step by step has the functions of one built fresh (``tests/integration/test_migrations.py``
compares their schema dumps).

Rules for a change (docs/design.md, "Schema source and migrations"):

* a function's body changes: edit its file; no revision;
* a new function: a new file, listed in :data:`SOURCE`;
* a function removed, or its arguments or result type changed: a revision drops the old one
  (``CREATE OR REPLACE`` cannot change them), and the file says the new;
* a table, column, index, sequence or data change: a revision.

The history before ``0001_baseline`` was squashed into it. A database that history brought to its
last revision, :data:`LEGACY_HEAD`, has the baseline's tables: :func:`carry_over_legacy_head`
records it at the baseline, and it takes the later revisions and the functions from there.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg

from queue_manager.db.locks import LockClass
from queue_manager.db.sqlfiles import query, read_sql, run_script
from queue_manager.errors import MigrationError

logger = logging.getLogger(__name__)

#: the first revision of the history
BASELINE = "0001_baseline"
#: the last revision of the history squashed into the baseline
LEGACY_HEAD = "0013_enqueue_lock"
#: the earlier revisions of that history: a database at one of them cannot be carried over
LEGACY_REVISIONS = frozenset(
    {
        "0001",
        "0002",
        "0004",
        "0005",
        "0006",
        "0007",
        "0008_adopt",
        "0009_maintenance_slices",
        "0010_rate_leases",
        "0011_tenant_settings",
        "0012_table_health",
    }
)

#: the files under sql/schema/, in the order they are applied. SQL-language functions are bound
#: when they are created, so what they call comes first; PL/pgSQL bodies are bound when they run.
#: A trigger on a qm table is in the file of its function, after it.
SOURCE: tuple[str, ...] = (
    # the advisory lock classes: every lock below names its class through qm.lock_class
    "locks/lock_classes.sql",
    "locks/lock_class.sql",
    # the queue of a name: every function that acts on a queue looks it up (and refuses it) here
    "queues/queue_named.sql",
    # keyspace, shuffle sets, topology
    "routing/keyspace_hex.sql",
    "routing/draw_hex.sql",
    "routing/draw_width.sql",
    "routing/shuffle_set.sql",
    "routing/shard_for.sql",
    "routing/partition_loads.sql",
    "routing/set_topology.sql",
    # queue settings and tenant overrides
    "settings/settable_columns.sql",
    "settings/check_settings.sql",
    "settings/write_settings.sql",
    "settings/override_queue.sql",
    "settings/set_tenant.sql",
    "settings/unset_tenant.sql",
    "settings/set_key.sql",
    "settings/unset_key.sql",
    # the generator of a queue's counters, functions and triggers, and what the generated code calls
    "queue_triggers/rule_fresh.sql",
    "queue_triggers/rule_trace.sql",
    "queue_triggers/rule_keys.sql",
    "queue_triggers/rule_valid.sql",
    "queue_triggers/rule_member.sql",
    "queue_triggers/route_picks.sql",
    "queue_triggers/no_identity_body.sql",
    "queue_triggers/backdated_ms.sql",
    "queue_triggers/route_source.sql",
    "queue_triggers/verify_source.sql",
    "queue_triggers/apply_queue_counters.sql",
    "queue_triggers/apply_queue_triggers.sql",
    "queue_triggers/apply_queue_default.sql",
    "queue_triggers/apply_queue.sql",
    "queue_triggers/refuse_event.sql",
    "queue_triggers/refuse_trace.sql",
    "queue_triggers/refuse_keys.sql",
    "queue_triggers/refuse_fresh_partition.sql",
    "queue_triggers/notify_settled.sql",
    "queue_triggers/notify_rescheduled.sql",
    # queues: create, alter, resize
    "queues/create_retention_indexes.sql",
    "queues/tune_queue_tables.sql",
    "queues/create_queue.sql",
    "queues/alter_queue.sql",
    "queues/finish_resize.sql",
    # the load counters
    "counters/add_load.sql",
    "counters/add_done.sql",
    "counters/reconcile_partition.sql",
    "counters/reconcile_load.sql",
    # the manager: leadership, back-off
    "leadership/holder_connected.sql",
    "leadership/take_over_leadership.sql",
    "leadership/acquire_leadership.sql",
    "leadership/renew_leadership.sql",
    "leadership/release_leadership.sql",
    "leadership/fence.sql",
    "dispatch/backoff_seconds.sql",
    # maintenance slices' counters
    "maintenance/maintenance_jobs.sql",
    "maintenance/count_maintenance.sql",
    "maintenance/maintenance_counts.sql",
    # Spark bulk loads
    "spark/stage_run.sql",
    "spark/staged_run.sql",
    "spark/publish_run.sql",
    "spark/abandon_run.sql",
    "spark/cleanup_spark_runs.sql",
    # online resharding: serving state, the moved and capture triggers, the copy's apply
    "reshard/refuse_moved.sql",
    "reshard/reshard_capture_rows.sql",
    "reshard/apply_reshard_triggers.sql",
    "reshard/set_shard_map.sql",
    "reshard/set_serving.sql",
    "reshard/set_capturing.sql",
    "reshard/reshard_prepare_target.sql",
    "reshard/reshard_apply.sql",
    "reshard/reshard_sync_tenants.sql",
    "reshard/reshard_finish_copy.sql",
    # periodic schedules (the leader enqueues their slots: manager/schedules.py) and cancel
    "schedules/schedule_drop_pending.sql",
    "schedules/schedule_write.sql",
    "schedules/schedule_add.sql",
    "schedules/schedule_upsert.sql",
    "schedules/schedule_locked.sql",
    "schedules/schedule_pause.sql",
    "schedules/schedule_resume.sql",
    "schedules/schedule_remove.sql",
    "cancel/cancel.sql",
    # settings notices: the functions and the triggers on qm.queues and qm.tenant_settings
    "notices/notify_settings_changed.sql",
    "notices/notify_tenant_settings_changed.sql",
)


def _driver(bind: Any) -> psycopg.Connection[Any]:
    """The psycopg connection under a SQLAlchemy Connection."""
    conn: psycopg.Connection[Any] = bind.connection.driver_connection
    return conn


def lock_for_migration(bind: Any) -> None:
    """Wait for any other migration of this database; held to the end of the transaction."""
    _driver(bind).execute(query("migration_lock", "migrate.sql"), {"lock_class": int(LockClass.MIGRATION)})


def carry_over_legacy_head(bind: Any) -> None:
    """Record a database at :data:`LEGACY_HEAD` as being at :data:`BASELINE`; refuse an older one."""
    conn = _driver(bind)
    row = conn.execute(query("version_table", "migrate.sql")).fetchone()
    if row is None or not row[0]:
        return
    versions = [r[0] for r in conn.execute(query("versions", "migrate.sql")).fetchall()]
    if LEGACY_HEAD in versions:
        conn.execute(query("stamp", "migrate.sql"), {"baseline": BASELINE, "legacy": LEGACY_HEAD})
        logger.info(
            "carried over",
            extra={"action": "migrate_carry_over", "from_revision": LEGACY_HEAD, "to_revision": BASELINE},
        )
    elif LEGACY_REVISIONS.intersection(versions):
        raise MigrationError(
            f"this database is at revision {versions[0]} of the history that was squashed into {BASELINE}; "
            f"only its last revision, {LEGACY_HEAD}, can be carried over: migrate it to {LEGACY_HEAD} first, "
            "with the code from before the squash (the git history before revision 0001_baseline)"
        )


def apply_schema(bind: Any) -> None:
    """Apply every file of :data:`SOURCE`, then regenerate every queue's code from them."""
    for name in SOURCE:
        try:
            run_script(bind, read_sql(f"schema/{name}"))
        except psycopg.Error as e:
            e.add_note(f"while applying queue_manager/db/sql/schema/{name}")
            raise
    _driver(bind).execute(query("reapply_queues", "migrate.sql"))
    logger.info("schema applied", extra={"action": "migrate_apply_schema", "files": len(SOURCE)})
