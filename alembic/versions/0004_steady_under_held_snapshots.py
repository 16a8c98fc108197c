"""Done counters in sequences only, the wake-up lock key named, settled-by-SQL notices, notices that
carry the earliest fire_at, fire_at defaulting to the insert's time.

Revision ID: 0004
Revises: 0002
Create Date: 2026-11-25
"""

from __future__ import annotations

from alembic import op

from queue_manager.db.sqlfiles import read_sql, run_script

revision = "0004"
down_revision = "0002"  # 0003 was never landed (the routing fix became 0005)
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script(op.get_bind(), read_sql("schema_0004.sql"))


def downgrade() -> None:
    raise NotImplementedError(
        "revision 0004 drops qm.queue_load (the done counters live in sequences since): downgrading past it "
        "is not supported; restore a backup taken before the upgrade"
    )
