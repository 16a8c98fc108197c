"""Every operator action audited in qm.audit (was qm.web_audit): its id across shards, where it was
taken (web, cli, api) and its plan per shard.

Revision ID: 0007_audit
Revises: 0006_trace_context
Create Date: 2026-11-29
"""

from __future__ import annotations

from alembic import op

from queue_manager.db.sqlfiles import read_sql, run_script

revision = "0007_audit"
down_revision = "0006_trace_context"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script(op.get_bind(), read_sql("revisions/0007_audit.sql"))


def downgrade() -> None:
    run_script(op.get_bind(), read_sql("revisions/0007_audit_downgrade.sql"))
