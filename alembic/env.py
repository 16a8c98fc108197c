"""Alembic environment: one migration history applied to every shard.

The connection comes from ``config.attributes["connection"]`` (set by
``queue_manager.db.migrate``) or from ``-x dsn=...`` on the alembic command line.
The version table lives in the ``qm`` schema, next to the objects it versions.

One transaction does it all: the migration lock, the carry-over of a database migrated by the
history squashed into ``0001_baseline``, the revisions (tables and data only), and, once the
database is at head, the schema's functions and triggers from their source
(``queue_manager.db.schema``).
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, text

from queue_manager.db import schema
from queue_manager.db.migrate import engine_for

config = context.config


def run(connection: Connection) -> None:
    schema.lock_for_migration(connection)
    connection.execute(text("CREATE SCHEMA IF NOT EXISTS qm"))
    schema.carry_over_legacy_head(connection)
    context.configure(connection=connection, version_table_schema="qm", transactional_ddl=True)
    with context.begin_transaction():
        context.run_migrations()
    if set(context.get_context().get_current_heads()) == set(context.script.get_heads()):
        schema.apply_schema(connection)


if context.is_offline_mode():
    raise SystemExit("offline (--sql) mode is not supported: the migrations call server-side functions")

existing = config.attributes.get("connection")
if existing is not None:
    run(existing)
else:
    dsn = context.get_x_argument(as_dictionary=True).get("dsn")
    if not dsn:
        raise SystemExit("pass the database: alembic -x dsn=postgresql://... upgrade head")
    with engine_for(dsn).begin() as conn:
        run(conn)
