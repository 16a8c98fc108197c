"""Shuffle sets that reach every partition of wide groups: draws from sha256.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25
"""

from __future__ import annotations

from alembic import op

from queue_manager.db.sqlfiles import read_sql, run_script

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script(op.get_bind(), read_sql("schema_0005.sql"))


def downgrade() -> None:
    raise NotImplementedError(
        "revision 0005 changes the shuffle-set rule: downgrading would make the database refuse rows the "
        "producers of this version write; restore a backup taken before the upgrade"
    )
