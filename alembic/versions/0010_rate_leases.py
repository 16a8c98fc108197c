"""Rate and concurrency limits across shards (qm.rate_leases), and a NOTIFY on settings changes.

Revision ID: 0010_rate_leases
Revises: 0009_maintenance_slices
Create Date: 2026-11-27
"""

from __future__ import annotations

from alembic import op

from queue_manager.db.sqlfiles import read_sql, run_script

revision = "0010_rate_leases"
down_revision = "0009_maintenance_slices"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script(op.get_bind(), read_sql("schema_0010_rate_leases.sql"))


def downgrade() -> None:
    run_script(
        op.get_bind(),
        "DROP TRIGGER qm_settings_updated ON qm.queues; DROP TRIGGER qm_settings_changed ON qm.queues; "
        "DROP FUNCTION qm.notify_settings_changed(); DROP TABLE qm.rate_leases;",
    )
