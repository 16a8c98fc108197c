"""The TypeScript receiver's own tests (clients/typescript/test: its frames against
docs/protocol.schema.json, 64-bit ids), run with node's test runner; its behaviour against real
managers is the conformance suite's (tests/integration/test_conformance.py)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

TS = Path(__file__).resolve().parents[2] / "clients" / "typescript"


def test_the_typescript_receivers_tests_pass() -> None:
    if shutil.which("node") is None or not (TS / "dist" / "test").is_dir():
        pytest.skip("node is missing or clients/typescript is not built (make setup does both)")
    run = subprocess.run(["node", "--test", "dist/test/"], cwd=TS, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "# fail 0" in run.stdout
