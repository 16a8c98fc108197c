"""Adopting a legacy queue table: the adoption ledger ``qm.adopted``.

Revision ID: 0008_adopt
Revises: 0007
Create Date: 2026-11-28
"""

from __future__ import annotations

from alembic import op

from queue_manager.db.sqlfiles import read_sql, run_script

revision = "0008_adopt"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script(op.get_bind(), read_sql("schema_0008.sql"))


def downgrade() -> None:
    run_script(op.get_bind(), "DROP TABLE qm.adopted;")
