"""Maintenance in slices any manager may take: the failed events' retention, per-partition retention
indexes, the done counters' lock and the per-partition reconciliation, the slices' counters.

Revision ID: 0009_maintenance_slices
Revises: 0008_adopt
Create Date: 2026-11-26
"""

from __future__ import annotations

from alembic import op

from queue_manager.db.sqlfiles import read_sql, run_script

revision = "0009_maintenance_slices"
down_revision = "0008_adopt"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script(op.get_bind(), read_sql("schema_0009.sql"))


def downgrade() -> None:
    raise NotImplementedError(
        "revision 0009 replaces every queue's acked index and qm.create_queue: downgrading past it is not "
        "supported; restore a backup taken before the upgrade"
    )
