-- Queries of the migrations (queue_manager/db/schema.py, called by alembic/env.py), one named
-- block each ("-- name --").

-- migration_lock --
-- One migration of a database at a time: concurrent runs serialise here, before they read the
-- version. The class is passed in (queue_manager.db.locks.LockClass.MIGRATION): qm.lock_class does
-- not exist before the first migration. Held to the end of the migration's transaction.
SELECT pg_advisory_xact_lock(%(lock_class)s, 0)

-- version_table --
SELECT to_regclass('qm.alembic_version') IS NOT NULL

-- versions --
SELECT version_num FROM qm.alembic_version ORDER BY version_num

-- stamp --
-- A database migrated by the history squashed into the baseline, at its last revision: it has the
-- baseline's tables, and it takes the revisions after the baseline (and the functions) from here.
UPDATE qm.alembic_version SET version_num = %(baseline)s WHERE version_num = %(legacy)s

-- reapply_queues --
-- Every queue's counters, generated functions and triggers, from the functions just applied.
SELECT qm.apply_queue(id) FROM qm.queues ORDER BY id
