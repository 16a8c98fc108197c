"""Manager leadership lease with term fencing, done counters, back-off.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21
"""

from __future__ import annotations

from alembic import op

from queue_manager.db.sqlfiles import read_sql, run_script

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script(op.get_bind(), read_sql("schema_0002.sql"))


def downgrade() -> None:
    run_script(
        op.get_bind(),
        "DROP FUNCTION qm.backoff_seconds(integer, double precision, double precision); "
        "DROP FUNCTION qm.add_done(integer, smallint[]); DROP FUNCTION qm.fence(bigint); "
        "DROP FUNCTION qm.release_leadership(text, bigint); DROP FUNCTION qm.renew_leadership(text, bigint, double precision); "
        "DROP FUNCTION qm.acquire_leadership(text, double precision); DROP TABLE qm.leader;",
    )
