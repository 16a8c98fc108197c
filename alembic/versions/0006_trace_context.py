"""W3C trace context on every event: traceparent, tracestate and baggage columns on each queue table.

Revision ID: 0006_trace_context
Revises: 0005_reshard
Create Date: 2026-11-28
"""

from __future__ import annotations

from alembic import op

from queue_manager.db.sqlfiles import read_sql, run_script

revision = "0006_trace_context"
down_revision = "0005_reshard"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script(op.get_bind(), read_sql("revisions/0006_trace_context.sql"))


def downgrade() -> None:
    run_script(op.get_bind(), read_sql("revisions/0006_trace_context_downgrade.sql"))
