"""Queue tables tuned for churn: qm.tune_queue_tables() sets their autovacuum parameters, called by
qm.create_queue and applied to every existing queue.

Revision ID: 0012_table_health
Revises: 0011_tenant_settings
Create Date: 2026-11-25
"""

from __future__ import annotations

from alembic import op

from queue_manager.db.sqlfiles import read_sql, run_script

revision = "0012_table_health"
down_revision = "0011_tenant_settings"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script(op.get_bind(), read_sql("schema_0012.sql"))


def downgrade() -> None:
    raise NotImplementedError(
        "revision 0012_table_health replaces qm.create_queue: downgrading past it is not supported; "
        "restore a backup taken before the upgrade"
    )
