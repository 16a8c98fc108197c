"""`make demo` end to end, without a terminal: shards, managers and receivers as processes, a producer,
a manager failover, a summary checked against the database, and nothing left running."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from queue_manager.local.embedded import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

_ROOT = Path(__file__).resolve().parents[2]


def _processes_mentioning(text: str) -> list[tuple[int, str]]:
    """Live processes whose command line mentions `text` (the demo's managers, receivers and servers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        if text in cmdline and state not in ("Z", "X"):
            found.append((int(entry.name), cmdline.strip()))
    return found


@pytest.fixture
def demo_dir(server_dir: Path) -> Iterator[Path]:
    directory = server_dir / "demo"
    yield directory
    for pid, _ in _processes_mentioning(str(directory / "topology.toml")):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for server in LocalCluster(directory, 2).servers:
        server.stop("immediate")


@pytest.mark.slow
def test_demo_runs_live_fails_over_and_loses_nothing(demo_dir: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(_ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(
        [sys.executable, "-m", "queue_manager.cli.main", "demo", "--dir", str(demo_dir), "--duration", "20"],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=_ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    # no terminal: plain progress lines, with each shard's leader
    assert re.search(r"t=\s*\d+\.\ds\s+enqueued \d+ .* s0\[.*leader\(term \d+\)", out), out
    # the failover: the active manager of s0 killed, its standby leads with a higher term, the old one restarts
    killed = re.search(
        r"failover: SIGKILL the active manager of shard s0 \((manager-s0-[ab]), pid \d+, term (\d+)\)", out
    )
    assert killed, out
    took = re.search(r"failover: (manager-s0-[ab]) now leads shard s0 \(term (\d+)\)", out)
    assert took, out
    assert took.group(1) != killed.group(1)
    assert int(took.group(2)) > int(killed.group(2))
    assert f"failover: {killed.group(1)} restarted" in out
    # the summary, checked against the database
    summary = out.rsplit("== summary", 1)[1]
    assert "lost = 0" in summary
    acked = re.search(r"acked (\d+), dead-lettered (\d+), still pending (\d+)", summary)
    assert acked, summary
    assert int(acked.group(1)) > 500  # ~150 events/s for 20 s, most acked
    assert int(acked.group(2)) > 0  # the failing tenants' events were dead-lettered
    noisy = re.search(r"enqueued (\d+) \(of them (\d+) by tenant-noisy\)", summary)
    assert noisy and int(noisy.group(2)) * 5 > int(noisy.group(1))  # the noisy tenant sends far more than most
    # the producer's rate beside its target, in the progress lines and the summary
    assert re.search(r"enqueued \d+ \(\d+/s of 150/s\)", out), out
    assert re.search(r"producer: \d+ events/s over \d+ s, of the 150/s asked", summary), summary
    # the logs: the killed manager's restart appended to its log; receivers at INFO, failures with tracebacks
    logs = demo_dir / "demo-logs"
    killed_log = (logs / f"{killed.group(1)}.log").read_text()
    assert killed_log.count("qm manager: shard s0") == 2 and "==== restarted by the demo" in killed_log, killed_log
    assert "leadership acquired" in killed_log
    new_leader_log = (logs / f"{took.group(1)}.log").read_text()
    assert f"leadership acquired action=lead term={took.group(2)}" in new_leader_log, new_leader_log
    receiver_log = (logs / "receiver-1.log").read_text()
    assert "INFO receivers subscribed to demo_events on shard s0" in receiver_log, receiver_log[:3000]
    assert re.search(r"WARNING receivers handler failed on event \d+ .*\nTraceback", receiver_log), receiver_log[:3000]
    assert "drained shard s1" in receiver_log, receiver_log[-3000:]
    # nothing left running: children stopped, shards stopped
    assert re.search(r"== dashboard: http://127\.0\.0\.1:\d+/  \(qm web; log in with the token \S{16,}\)", out), out
    assert "== stopped 8 child process(es)" in out and "STILL RUNNING" not in out
    assert "== stopped the shards" in out
    assert _processes_mentioning(str(demo_dir)) == []
