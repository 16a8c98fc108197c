"""The Spark archive job's ledger in each shard: each run's latest step and its rows.

Revision ID: 0004_archive_ledger
Revises: 0003_web_audit
Create Date: 2026-11-27
"""

from __future__ import annotations

from alembic import op

from queue_manager.db.sqlfiles import read_sql, run_script

revision = "0004_archive_ledger"
down_revision = "0003_web_audit"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script(op.get_bind(), read_sql("revisions/0004_archive_ledger.sql"))


def downgrade() -> None:
    op.execute("DROP TABLE IF EXISTS qm.archive_runs")
