"""Per-tenant dispatch settings: a queue's default per-tenant in-flight cap, and per-tenant weight
and cap overrides (qm.tenant_settings, qm.set_tenant, qm.unset_tenant).

Revision ID: 0011_tenant_settings
Revises: 0010_rate_leases
Create Date: 2026-11-25
"""

from __future__ import annotations

from alembic import op

from queue_manager.db.sqlfiles import read_sql, run_script

revision = "0011_tenant_settings"
down_revision = "0010_rate_leases"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_script(op.get_bind(), read_sql("schema_0011.sql"))


def downgrade() -> None:
    op.execute("DROP FUNCTION qm.unset_tenant(text, text)")
    op.execute("DROP FUNCTION qm.set_tenant(text, text, jsonb)")
    op.execute("DROP TABLE qm.tenant_settings")
    op.execute("DROP FUNCTION qm.notify_tenant_settings_changed()")
    op.execute(
        "CREATE OR REPLACE FUNCTION qm.settable_columns() RETURNS text[] LANGUAGE sql IMMUTABLE "
        "RETURN ARRAY['partitions', 'shuffle', 'window_seconds', 'cache_size', 'ack_timeout_seconds', "
        "'backoff_min_seconds', 'backoff_max_seconds', 'max_attempts', 'max_qps', 'max_concurrency', "
        "'retention_seconds', 'failed_retention_seconds', 'payload_limit_bytes', 'max_delay_seconds', 'paused']"
    )
    op.execute("ALTER TABLE qm.queues DROP COLUMN tenant_max_in_flight")
