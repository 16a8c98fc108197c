"""A reconciliation slice sees the enqueues not committed yet: producers hold their partition's
enqueue lock shared from before their counter bump to their commit, a slice tries it exclusively.

Revision ID: 0013_enqueue_lock
Revises: 0012_table_health
Create Date: 2026-11-26
"""

from __future__ import annotations

from alembic import op

from queue_manager.db.sqlfiles import read_sql, run_script

revision = "0013_enqueue_lock"
down_revision = "0012_table_health"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script(op.get_bind(), read_sql("schema_0013.sql"))


def downgrade() -> None:
    raise NotImplementedError(
        "revision 0013_enqueue_lock rewrites every queue's route trigger: downgrading past it is not supported; "
        "restore a backup taken before the upgrade"
    )
