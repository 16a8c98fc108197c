"""The ``qm`` command line against real shards: what ``qm enqueue`` imports, what ``qm queue create``
says about a queue that exists, and ``qm shard-for``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from queue_manager.cli.main import main
from queue_manager.domain.topology import Topology
from tests.conftest import tenants_of

ROOT = Path(__file__).resolve().parents[2]


def qm(*argv: str, env: dict[str, str] | None = None, importtime: bool = False) -> subprocess.CompletedProcess[str]:
    flags = ["-X", "importtime"] if importtime else []
    return subprocess.run(
        [sys.executable, *flags, "-m", "queue_manager.cli.main", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
    )


def test_qm_enqueue_imports_no_migration_tool_no_sqlalchemy_no_reshard_workflow(topo_file: Path, make_queue) -> None:  # type: ignore[no-untyped-def]
    make_queue("orders")
    out = qm("enqueue", "orders", "acme", '{"n": 1}', "--topology", str(topo_file), importtime=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.match(r"enqueued event \d+ on shard s[01]", out.stdout), out.stdout
    imported = set(re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s+(\S+)$", out.stderr, flags=re.M))
    assert "psycopg" in imported, "the import log was read"
    heavy = sorted(
        m
        for m in imported
        if m.split(".")[0] in ("alembic", "sqlalchemy") or m.startswith("queue_manager.reshard.workflow")
    )
    assert heavy == []


def test_create_names_the_shard_of_an_existing_queue_and_if_not_exists_leaves_it(
    shards: Topology, topo_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["queue", "create", "jobs", "--partitions", "8", "--topology", str(topo_file)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "s0: queue jobs created, partitions=8 shuffle=4",
        "s1: queue jobs created, partitions=8 shuffle=4",
    ]
    assert main(["queue", "create", "jobs", "--topology", str(topo_file)]) == 2
    err = capsys.readouterr().err
    assert 'shard s0: queue "jobs" already exists (qm queue alter changes its settings)' in err, err
    assert main(["queue", "create", "jobs", "--partitions", "4", "--if-not-exists", "--topology", str(topo_file)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        f"{s}: queue jobs exists (unchanged) (settings given are not applied: qm queue alter changes them)"
        for s in ("s0", "s1")
    ]
    for shard in shards.shards:
        with psycopg.connect(shard.dsn) as conn:
            row = conn.execute("SELECT partitions FROM qm.queues WHERE name = 'jobs'").fetchone()
        assert row == (8,), "unchanged"


def test_shard_for_names_the_tenants_shard_and_its_dsn(shards: Topology, topo_file: Path) -> None:
    env = {**os.environ, "QM_TOPOLOGY": str(topo_file)}
    for shard in shards.shards:
        tenant = tenants_of(shard, 1)[0]
        out = qm("shard-for", tenant, env=env)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(f"tenant {tenant}: shard {shard.name} (key range {shard.key_range}")
        dsn = qm("shard-for", tenant, "--dsn", env=env).stdout.strip()
        assert dsn == shard.dsn
        with psycopg.connect(dsn) as conn:  # where its INSERTs belong
            name = conn.execute("SELECT name FROM qm.shard").fetchone()
        assert name == (shard.name,)
