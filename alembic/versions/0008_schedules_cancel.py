"""Periodic schedules (qm.schedules) and the terminal state cancelled (docs/design.md, "Schedules"
and "Cancel").

Revision ID: 0008_schedules_cancel
Revises: 0007_audit
Create Date: 2026-11-29
"""

from __future__ import annotations

from alembic import op

from queue_manager.db.sqlfiles import read_sql, run_script

revision = "0008_schedules_cancel"
down_revision = "0007_audit"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script(op.get_bind(), read_sql("revisions/0008_schedules_cancel.sql"))


def downgrade() -> None:
    run_script(op.get_bind(), read_sql("revisions/0008_schedules_cancel_downgrade.sql"))
