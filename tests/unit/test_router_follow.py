"""Router.refresh and the wait for a moved tenant's new shard (no database: no pool is opened)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from queue_manager.domain.topology import KeyRange, Shard, Topology
from queue_manager.producer import Router

OLD = Topology((Shard("s0", "dbname=a", KeyRange.parse("-80")), Shard("s1", "dbname=b", KeyRange.parse("80-"))))
NEW = Topology(
    (
        Shard("s2", "dbname=c", KeyRange.parse("-40")),
        Shard("s3", "dbname=d", KeyRange.parse("40-80")),
        Shard("s1", "dbname=b", KeyRange.parse("80-")),
    )
)


def tenant_of(key_range: KeyRange) -> str:
    return next(t for t in (f"t{i}" for i in range(1000)) if key_range.contains(t))


def test_refresh_reads_a_changed_file_and_keeps_the_last_good_one(tmp_path: Path) -> None:
    path = tmp_path / "topology.toml"
    path.write_text(OLD.to_toml())
    router = Router.from_file(path)
    assert router.refresh() is False
    path.write_text("[[shards]]\nname = 'half'\n")  # caught half-written: kept
    assert router.refresh() is False and router.topology == OLD
    path.write_text(NEW.to_toml())
    assert router.refresh() is True and router.topology == NEW
    assert Router(OLD).refresh() is False  # no file: nothing to follow


def test_a_moved_tenant_waits_for_the_file_to_name_another_shard(tmp_path: Path) -> None:
    path = tmp_path / "topology.toml"
    path.write_text(OLD.to_toml())
    tenant = tenant_of(KeyRange.parse("40-80"))
    router = Router.from_file(path, moved_wait=5.0, poll_interval=0.01)
    timer = threading.Timer(0.3, lambda: path.write_text(NEW.to_toml()))
    timer.start()
    started = time.monotonic()
    assert router._follow(tenant, "s0") is True
    waited = time.monotonic() - started
    timer.join()
    assert router.shard_for(tenant).name == "s3" and 0.2 < waited < 5.0
    # the file never changes: it gives up after moved_wait
    stuck = Router.from_file(path, moved_wait=0.2, poll_interval=0.01)
    assert stuck._follow(tenant, "s3") is False
