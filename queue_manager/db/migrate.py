"""Apply the alembic history to shards and record each shard's identity and the topology."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import psycopg
from alembic.config import Config
from sqlalchemy import Engine, create_engine
from sqlalchemy.pool import NullPool

from alembic import command
from queue_manager.domain.topology import Shard, Topology

logger = logging.getLogger(__name__)

_ROOT = Path(__file__).resolve().parents[2]


def engine_for(dsn: str) -> Engine:
    """A SQLAlchemy engine over psycopg 3 for any libpq DSN (URL or key=value form)."""
    return create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(dsn), poolclass=NullPool)


def alembic_config() -> Config:
    """The project's alembic configuration (``alembic.ini`` beside the packages)."""
    ini = _ROOT / "alembic.ini"
    if not ini.exists():  # pragma: no cover - installed without the source tree
        raise FileNotFoundError(f"alembic.ini not found at {ini}: run from a source checkout")
    return Config(str(ini))


def upgrade(dsn: str, revision: str = "head") -> None:
    """Bring one database to ``revision`` in one transaction (idempotent; concurrent callers serialise
    on the migration lock, alembic/env.py). At head, the schema's functions are applied from their
    source and every queue's code is regenerated (queue_manager.db.schema), also when no revision ran.
    """
    cfg = alembic_config()
    with engine_for(dsn).begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)
    logger.info("migrated", extra={"action": "migrate", "revision": revision})


def downgrade(dsn: str, revision: str) -> None:
    """Take one database back to ``revision`` in one transaction: the revisions' downgrades undo their
    tables, columns and indexes. The functions stay those of this code until ``qm migrate`` of the
    code of ``revision`` applies its own (only a migration to head applies the schema source)."""
    cfg = alembic_config()
    with engine_for(dsn).begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)
    logger.info("downgraded", extra={"action": "migrate", "revision": revision})


def topology_json(topology: Topology) -> str:
    """The topology as the JSON array ``qm.set_topology`` takes."""
    return json.dumps(
        [{"name": s.name, "range_start": s.key_range.start, "range_end": s.key_range.end} for s in topology.shards]
    )


def set_identity(dsn: str, shard: Shard, topology: Topology) -> None:
    """Tell a migrated shard who it is and where every tenant lives."""
    with psycopg.connect(dsn) as conn:
        conn.execute("SELECT qm.set_topology(%s, %s::jsonb)", (shard.name, topology_json(topology)))


def migrate_topology(topology: Topology) -> list[str]:
    """Upgrade every shard and record its identity; returns the names migrated."""
    done = []
    for shard in topology.shards:
        upgrade(shard.dsn)
        set_identity(shard.dsn, shard, topology)
        done.append(shard.name)
    return done
