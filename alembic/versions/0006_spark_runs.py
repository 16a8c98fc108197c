"""Bulk loads from Spark: staging, the run ledger, two-phase decisions, qm.publish_run.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-25
"""

from __future__ import annotations

from alembic import op

from queue_manager.db.sqlfiles import read_sql, run_script

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script(op.get_bind(), read_sql("schema_0006.sql"))


def downgrade() -> None:
    run_script(
        op.get_bind(),
        "DROP FUNCTION qm.publish_run(text, text, text); DROP TABLE qm.spark_decisions; "
        "DROP TABLE qm.spark_runs; DROP TABLE qm.spark_staging;",
    )
