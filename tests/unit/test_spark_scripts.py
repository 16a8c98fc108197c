"""``python -m spark_jobs.enqueue``: the script runs its own job function, so its module is not imported a
second time (the import circle through the ``__main__`` blocks and ``spark_jobs.commands`` is gone; the
import contract in pyproject.toml keeps the command module free of the jobs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from queue_manager.local import fleet

pytest.importorskip("pyspark")


def test_the_enqueue_script_runs_its_own_job_and_imports_itself_once(tmp_path: Path) -> None:
    topology = tmp_path / "topology.toml"  # a shard nobody listens for: the job stops at its first connection
    topology.write_text('[[shards]]\nname = "s0"\ndsn = "postgresql://postgres@127.0.0.1:9/qm"\nrange = "-"\n')
    argv = ["--topology", str(topology), "--queue", "orders", "--input", "in.json", "--run-id", "r1"]
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "spark_jobs.enqueue", *argv],
        cwd=fleet.ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 3, out.stderr[-2000:]  # qm's exit status for an unreachable database
    assert "qm: database unreachable" in out.stderr
    imported = [line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")]
    assert "spark_jobs.commands" in imported
    assert "spark_jobs.enqueue" not in imported, "the script imported its own module a second time"
