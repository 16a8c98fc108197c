"""Alembic environment: one migration history applied to every shard.

The connection comes from ``config.attributes["connection"]`` (set by
``queue_manager.db.migrate``) or from ``-x dsn=...`` on the alembic command line.
The version table lives in the ``qm`` schema, next to the objects it versions.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, text

from queue_manager.db.migrate import engine_for

config = context.config


def run(connection: Connection) -> None:
    connection.execute(text("CREATE SCHEMA IF NOT EXISTS qm"))
    context.configure(connection=connection, version_table_schema="qm", transactional_ddl=True)
    with context.begin_transaction():
        context.run_migrations()


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
