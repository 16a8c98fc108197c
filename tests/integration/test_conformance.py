"""The qm.v1 conformance suite (``python -m conformance``, docs/conformance.md) against each receiver
this repository ships: every case passes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.__main__ import CLIENTS, missing

pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_the_client_passes_the_conformance_suite(client: str) -> None:
    why = missing(client, CLIENTS[client])
    if why is not None and client != "python":
        pytest.skip(why)
    run = subprocess.run(
        [sys.executable, "-m", "conformance", "--client", client],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=380,
    )
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert {r["case"] for r in results} >= {"handshake", "credit", "drain", "failover", "heartbeat"}, run.stderr[-3000:]
    failed = [r for r in results if r["status"] == "fail"]
    assert not failed, json.dumps(failed, indent=2)
    assert [r["case"] for r in results if r["status"] == "skip"] == []
    assert run.returncode == 0, run.stderr[-3000:]
