"""The web dashboard's audit table: who did what, on which filter, to how many events, when.

Revision ID: 0003_web_audit
Revises: 0002_lock_registry
Create Date: 2026-11-27
"""

from __future__ import annotations

from alembic import op

from queue_manager.db.sqlfiles import read_sql, run_script

revision = "0003_web_audit"
down_revision = "0002_lock_registry"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script(op.get_bind(), read_sql("revisions/0003_web_audit.sql"))


def downgrade() -> None:
    op.execute("DROP TABLE IF EXISTS qm.web_audit")
