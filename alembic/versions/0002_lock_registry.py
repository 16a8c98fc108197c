"""The advisory lock classes have one registry (qm.lock_class, queue_manager/db/locks.py): the
functions that named four of them one by one go.

Revision ID: 0002_lock_registry
Revises: 0001_baseline
Create Date: 2026-11-28
"""

from __future__ import annotations

from alembic import op

from queue_manager.db.sqlfiles import read_sql, run_script

revision = "0002_lock_registry"
down_revision = "0001_baseline"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script(op.get_bind(), read_sql("revisions/0002_lock_registry.sql"))


def downgrade() -> None:
    # nothing to restore: the baseline's tables do not need the dropped functions
    pass
