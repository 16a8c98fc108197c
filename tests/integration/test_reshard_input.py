"""What an operator types, and what they are told: ``qm reshard`` refuses bad input with a clear
error and records nothing, reads a range that starts with "-", fails fast on a target it cannot use,
cancels quickly whatever a target's state, says what is true after cleanup, and answers ``status``
while ``start`` runs (docs/operations.md, "Resharding")."""

from __future__ import annotations

import io
import json
import threading
import time
import uuid
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from subprocess import CompletedProcess
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from queue_manager.cli.common import run
from queue_manager.cli.main import build_parser
from queue_manager.domain.topology import Topology
from queue_manager.reshard.workflow import Reshard, load_state, state_path
from tests import pgtest
from tests.conftest import DatabaseFactory, tenants_of
from tests.integration.test_reshard import events, seed, shard_state, split_targets, write_topology
from tests.integration.test_reshard_faults import ok, target_args


def qm(topo: Path, *args: str) -> CompletedProcess[str]:
    """``qm reshard ARGS --topology TOPO`` in this process (the command line's parser and exit
    statuses, without a Python start-up per call): its exit status, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = run(build_parser().parse_args(["reshard", *args, "--topology", str(topo)]))
    return CompletedProcess(["qm", "reshard", *args], code, out.getvalue(), err.getvalue())


def test_plan_refuses_two_targets_that_name_one_database(shards: Topology, tmp_path: Path) -> None:
    topo = write_topology(tmp_path / "topology.toml", shards)
    s0 = shards.by_name("s0")
    info = conninfo_to_dict(s0.dsn)
    url = f"postgresql://{info['user']}@localhost:{info['port']}/qm_new_target"
    same = make_conninfo(host="127.0.0.1", port=str(info["port"]), user=str(info["user"]), dbname="qm_new_target")
    result = qm(topo, "plan", "--target", "s2", "-40", url, "--target", "s3", "40-80", same)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "targets 's2' and 's3' name the same database" in result.stderr
    # an existing shard's database written another way is refused too
    s0_url = f"postgresql://{info['user']}@localhost:{info['port']}/{info['dbname']}"
    result = qm(topo, "plan", "--target", "s2", "-40", s0_url, "--target", "s3", "40-80", url)
    assert result.returncode == 2 and "has the database of shard 's0'" in result.stderr, result.stderr
    assert not state_path(topo).exists()


def test_a_range_that_starts_with_a_dash_and_a_hex_letter_is_typed_as_it_is(
    shards: Topology, new_database: DatabaseFactory, tmp_path: Path
) -> None:
    topo = write_topology(tmp_path / "topology.toml", shards)
    result = ok(qm(topo, "plan", "--target", "s2", "-a0", new_database(), "--target", "s3", "a0-", new_database()))
    assert "-> s2 (-a0), s3 (a0-)" in result.stdout
    assert 'range = "-a0"' in result.stdout


def test_start_with_a_target_database_that_cannot_be_created_fails_fast_and_records_nothing(
    shards: Topology, make_queue: Any, tmp_path: Path, pg_admin_dsn: str
) -> None:
    """The target's database does not exist and its role may not create it: the command says so
    at once (no retries), and nothing is recorded or turned on: no reshard to cancel."""
    make_queue("orders")
    topo = write_topology(tmp_path / "topology.toml", shards)
    role = f"qm_nocreate_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_admin_dsn, autocommit=True) as c:
        c.execute(f"CREATE ROLE {role} LOGIN NOCREATEDB")
    try:
        missing = make_conninfo(pg_admin_dsn, user=role, dbname=f"qm_missing_{uuid.uuid4().hex[:8]}")
        other = make_conninfo(pg_admin_dsn, user=role, dbname=f"qm_missing_{uuid.uuid4().hex[:8]}")
        t0 = time.monotonic()
        result = qm(topo, "start", "--target", "s2", "-40", missing, "--target", "s3", "40-80", other)
        assert time.monotonic() - t0 < 15
        assert result.returncode == 2, result.stdout + result.stderr
        assert "target 's2': database" in result.stderr and "does not exist and could not be created" in result.stderr
        assert "nothing was started or recorded" in result.stderr
        assert load_state(topo) is None
        assert shard_state(shards.by_name("s0").dsn) == ("s0", "serving", False)  # no capture turned on
    finally:
        with psycopg.connect(pg_admin_dsn, autocommit=True) as c:
            c.execute(f"DROP ROLE {role}")


def test_cancel_is_quick_when_a_target_database_is_gone(
    shards: Topology, new_database: DatabaseFactory, make_queue: Any, tmp_path: Path, pg_admin_dsn: str
) -> None:
    """A failure that no retry mends ("database does not exist") is not retried for 30 s: cancel
    ends the capture, says which target it could not clear, and is done."""
    make_queue("orders")
    s0 = shards.by_name("s0")
    seed(s0.dsn, tenants_of(s0, 4), 0, 20)
    topo = write_topology(tmp_path / "topology.toml", shards)
    targets = split_targets(new_database)
    ok(qm(topo, "start", *target_args(targets)))
    pgtest.drop_database(pg_admin_dsn, str(conninfo_to_dict(targets[1].dsn)["dbname"]))
    t0 = time.monotonic()
    result = ok(qm(topo, "cancel"))
    assert time.monotonic() - t0 < 15
    assert "target s3: not cleared" in result.stdout and "does not exist" in result.stdout
    assert events(targets[0].dsn) == {}
    assert shard_state(s0.dsn) == ("s0", "serving", False)
    state = load_state(topo)
    assert state is not None and state.phase == "cancelled"


def test_cancel_after_cleanup_says_the_reshard_is_finished(
    shards: Topology, new_database: DatabaseFactory, make_queue: Any, tmp_path: Path
) -> None:
    make_queue("orders")
    topo = write_topology(tmp_path / "topology.toml", shards)
    targets = split_targets(new_database)
    for verb in ("start", "switch", "cleanup"):
        ok(qm(topo, verb, *(target_args(targets) if verb == "start" else [])))
    result = qm(topo, "cancel")
    assert result.returncode == 2
    assert "the reshard is finished" in result.stderr and "nothing to cancel" in result.stderr, result.stderr
    assert "reverse first" not in result.stderr
    assert shard_state(targets[0].dsn)[1] == "serving"


def test_status_answers_while_start_runs(
    shards: Topology, new_database: DatabaseFactory, make_queue: Any, tmp_path: Path
) -> None:
    """``start`` holds the reshard lock on every shard for its whole copy; ``status`` reads without
    it. The copy is held at its first write to a target (a lock the test holds there), so that the
    status is read while start certainly runs."""
    make_queue("orders")
    s0 = shards.by_name("s0")
    seed(s0.dsn, tenants_of(s0, 4), 0, 40)
    topo = write_topology(tmp_path / "topology.toml", shards)
    targets = split_targets(new_database)
    said: list[str] = []
    errors: list[BaseException] = []

    def start() -> None:
        try:
            with Reshard(topo, say=said.append) as r:
                r.start(targets, batch=10)
        except BaseException as exc:  # asserted on below
            errors.append(exc)

    with psycopg.connect(targets[0].dsn) as hold:
        hold.execute("LOCK TABLE qm.reshard_rows IN EXCLUSIVE MODE")
        thread = threading.Thread(target=start)
        thread.start()
        try:
            _wait_for_a_waiting_backend(targets[0].dsn)
            status = json.loads(ok(qm(topo, "status", "--json")).stdout)
            assert (status["phase"], status["copied"]) == ("copying", False)
            assert status["snapshot"]["s0/orders"]["left"] > 0
            assert status["lag"] == {"s0": 0}
            assert "snapshot copy running" in ok(qm(topo, "status")).stdout
        finally:
            hold.rollback()
            thread.join(60)
    assert not thread.is_alive() and errors == []
    assert json.loads(ok(qm(topo, "status", "--json")).stdout)["copied"] is True


WAITING_FOR_A_LOCK = (
    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
)


def _wait_for_a_waiting_backend(dsn: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    with psycopg.connect(dsn, autocommit=True) as c:
        while c.execute(WAITING_FOR_A_LOCK).fetchone() == (0,):
            assert time.monotonic() < deadline, "start did not reach its first write to the target"
            time.sleep(0.05)
