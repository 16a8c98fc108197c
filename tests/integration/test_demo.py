"""`make demo` end to end, small: shards, queue, enqueue, managers, receivers, handover."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from queue_manager.demo import run_demo
from queue_manager.local.embedded import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


@pytest.fixture
def demo_dir(tmp_path: Path) -> Iterator[Path]:
    directory = tmp_path / "demo"
    yield directory
    for server in LocalCluster(directory, 2).servers:
        server.stop("immediate")


def test_demo_runs_end_to_end(demo_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_demo(demo_dir, shards=2, tenants=20, events=2) == 0
    out = capsys.readouterr().out
    assert "after ROLLBACK: 0 event(s)" in out
    assert "misrouted tenant: tenant 'tenant-7' belongs to shard" in out
    assert "all delivered and acked" in out
    assert "its standby leads (term 2)" in out
    assert "100 events enqueued after the handover were delivered" in out
    # the final status: nothing left to fire on any shard
    final = out.rsplit("== 9. qm status", 1)[1]
    assert final.count("to_be_fired 0  fired 0") == 2
