"""Spark loads: a stage table per run (no shared staging to bloat), the ledger's counts, decisions
with an outcome, and a verify trigger that lets a two-phase publish send its own wake-up.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-25
"""

from __future__ import annotations

from alembic import op

from queue_manager.db.sqlfiles import read_sql, run_script

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script(op.get_bind(), read_sql("schema_0007.sql"))


def downgrade() -> None:
    raise NotImplementedError(
        "revision 0007 replaces the shared Spark staging table and regenerates every queue's triggers: "
        "downgrading past it is not supported; restore a backup taken before the upgrade"
    )
