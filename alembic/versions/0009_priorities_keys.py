"""Priorities with aging, and concurrency and rate limits per key: priority, concurrency_key and
rate_key on each queue table, the due index by (partition, priority, fire_at), the queues' settings
and qm.key_settings.

Revision ID: 0009_priorities_keys
Revises: 0008_schedules_cancel
Create Date: 2026-11-29
"""

from __future__ import annotations

from alembic import op

from queue_manager.db.sqlfiles import read_sql, run_script

revision = "0009_priorities_keys"
down_revision = "0008_schedules_cancel"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script(op.get_bind(), read_sql("revisions/0009_priorities_keys.sql"))


def downgrade() -> None:
    run_script(op.get_bind(), read_sql("revisions/0009_priorities_keys_downgrade.sql"))
