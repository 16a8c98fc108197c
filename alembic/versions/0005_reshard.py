"""Online resharding: a shard's serving state, the change capture table and the copied-row map.

Revision ID: 0005_reshard
Revises: 0004_archive_ledger
Create Date: 2026-11-27
"""

from __future__ import annotations

from alembic import op

from queue_manager.db.sqlfiles import read_sql, run_script

revision = "0005_reshard"
down_revision = "0004_archive_ledger"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script(op.get_bind(), read_sql("revisions/0005_reshard.sql"))


def downgrade() -> None:
    op.execute("DROP TABLE IF EXISTS qm.reshard_rows")
    op.execute("DROP TABLE IF EXISTS qm.reshard_capture")
    op.execute("ALTER TABLE qm.shard DROP COLUMN IF EXISTS capturing, DROP COLUMN IF EXISTS serving")
