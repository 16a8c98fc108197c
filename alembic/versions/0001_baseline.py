"""Baseline: the tables, types, sequences, indexes and seed rows of a shard (the history before it,
revisions 0001 to 0013_enqueue_lock, squashed). The functions and triggers are source, applied after
every migration (queue_manager/db/schema.py).

Revision ID: 0001_baseline
Revises:
Create Date: 2026-11-28
"""

from __future__ import annotations

from alembic import op

from queue_manager.db.sqlfiles import read_sql, run_script

revision = "0001_baseline"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script(op.get_bind(), read_sql("revisions/0001_baseline.sql"))


def downgrade() -> None:
    # every queue table, then everything in qm but alembic's version table
    run_script(op.get_bind(), read_sql("revisions/0001_baseline_downgrade.sql"))
