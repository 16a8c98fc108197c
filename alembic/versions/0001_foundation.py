"""Foundation: shard identity, queue registry, routing trigger, queue functions.

Revision ID: 0001
Revises:
Create Date: 2026-11-21
"""

from __future__ import annotations

from alembic import op

from queue_manager.db.sqlfiles import read_sql, run_script

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script(op.get_bind(), read_sql("schema_0001.sql"))


def downgrade() -> None:
    # Dropping the schema drops the registry; queue tables in public are dropped by name first.
    run_script(
        op.get_bind(),
        "DO $$ DECLARE n text; BEGIN FOR n IN SELECT name FROM qm.queues LOOP "
        "EXECUTE format('DROP TABLE IF EXISTS public.%I', n); END LOOP; END $$; "
        "DROP SCHEMA qm CASCADE; CREATE SCHEMA qm;"
    )
