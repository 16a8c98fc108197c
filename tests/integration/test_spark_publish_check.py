"""The database stays the last line on the Spark path: a staged row that breaks a rule of the queue
(one that slipped past the job's checks in Spark, or a stage table written by hand) fails its
shard's publish (qm.publish_run) as a whole, with the queue's verify trigger's precise error, and
the run stays staged. No Spark: the rows are staged by COPY as the job's staging leaves them."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from queue_manager import admin
from queue_manager.domain.routing import shuffle_set
from queue_manager.domain.topology import Shard, Topology
from tests.conftest import tenants_of

QUEUE = "bulk"


@pytest.fixture
def queue(shards: Topology) -> str:
    admin.create_queue(shards, QUEUE, {"partitions": 16, "shuffle": 4, "payload_limit_bytes": 200})
    return QUEUE


def stage(shard: Shard, run: str, rows: list[tuple[Any, ...]]) -> None:
    """A run staged on ``shard`` with ``rows`` (tenant, partition, payload[, traceparent]) as good rows."""
    with psycopg.connect(shard.dsn, autocommit=True) as conn:
        row = conn.execute("SELECT stage_table FROM qm.stage_run(%s, %s)", (run, QUEUE)).fetchone()
        assert row is not None
        with conn.cursor().copy(
            f"COPY qm.{row[0]} (row_key, tenant, partition, payload, traceparent) FROM STDIN"  # type: ignore[arg-type]
        ) as copy:
            for i, r in enumerate(rows):
                copy.write_row((i, r[0], r[1], r[2], r[3] if len(r) > 3 else None))
        conn.execute("SELECT * FROM qm.staged_run(%s, %s)", (run, QUEUE))


def good_rows(shard: Shard, count: int) -> list[tuple[Any, ...]]:
    tenants = tenants_of(shard, 20)
    return [(t, shuffle_set(t, 16, 4)[i % 4], f'{{"n": {i}}}') for i, t in enumerate(tenants * (count // 20))]


def publish(shard: Shard, run: str) -> int:
    with psycopg.connect(shard.dsn) as conn:
        row = conn.execute("SELECT qm.publish_run(%s, %s)", (run, QUEUE)).fetchone()
        conn.commit()
    assert row is not None
    return int(row[0])


def refused_by(exc: psycopg.Error) -> str:
    """The function that called qm.refuse_event/refuse_trace: the error's context, next frame."""
    frames = [line for line in (exc.diag.context or "").splitlines() if "PL/pgSQL function" in line]
    callers = [f for f in frames if "refuse_event" not in f and "refuse_trace" not in f]
    return callers[0]


def test_a_good_run_is_published_whole(shards: Topology, queue: str) -> None:
    s0 = shards.shards[0]
    stage(s0, "ok", good_rows(s0, 2000))
    assert publish(s0, "ok") == 2000
    with psycopg.connect(s0.dsn) as conn:
        assert conn.execute(f"SELECT count(*) FROM {QUEUE}").fetchone() == (2000,)


@pytest.mark.parametrize(
    ("bad", "rule"),
    [
        ("other shard", "keyspace"),
        ("outside the shuffle set", "shuffle_set"),
        ("payload over the limit as jsonb", "payload_within_limit"),
        ("malformed traceparent", "traceparent"),
        ("empty tenant", "tenant_not_empty"),
    ],
)
def test_a_staged_row_that_breaks_a_rule_fails_its_shards_publish_with_the_triggers_error(
    shards: Topology, queue: str, bad: str, rule: str
) -> None:
    s0, s1 = shards.shards
    rows = good_rows(s0, 1000)
    tenant = rows[0][0]
    members = shuffle_set(tenant, 16, 4)
    if bad == "other shard":
        stranger = tenants_of(s1, 1)[0]
        rows.append((stranger, shuffle_set(stranger, 16, 4)[0], "{}"))
    elif bad == "outside the shuffle set":
        rows.append((tenant, next(p for p in range(16) if p not in members), "{}"))
    elif bad == "payload over the limit as jsonb":
        rows.append((tenant, members[0], '{"p": "' + "y" * 190 + '"}'))
    elif bad == "malformed traceparent":
        rows.append((tenant, members[0], "{}", "00-XYZ"))
    else:
        rows.append(("", 0, "{}"))
    stage(s0, "bad", rows)
    with pytest.raises(psycopg.Error) as caught:
        publish(s0, "bad")
    assert rule in str(caught.value) or rule in (caught.value.diag.constraint_name or ""), str(caught.value)
    # raised by the queue's verify trigger, inside the publish
    assert "_verify()" in refused_by(caught.value), caught.value.diag.context
    assert "qm.publish_run(" in (caught.value.diag.context or "")
    with psycopg.connect(s0.dsn) as conn:
        assert conn.execute(f"SELECT count(*) FROM {QUEUE}").fetchone() == (0,)
        assert conn.execute("SELECT state FROM qm.spark_runs WHERE run_id = 'bad'").fetchone() == ("staged",)
