"""Writing the topology file: every writer holds the file's lock from its read to its replace, and
replaces it by renaming a whole new file into place (docs/operations.md, "Topology file").

Its writers: a manager recording itself in its shard's ``managers`` as it starts and forgetting
itself as it stops (``qm manager``), ``qm local start``, and a reshard's switch. Its readers
(receivers, producers, managers following it, :class:`~queue_manager.domain.topology.TopologyFile`)
take no lock: a rename shows them the old file or the new one, whole.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from queue_manager.domain.topology import Topology
from queue_manager.errors import TopologyError


def write_file_atomically(path: Path, text: str) -> None:
    """Write a file whole or not at all: a synced temporary file renamed over it, then the directory synced."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Hold the topology file's lock (``flock`` on ``.NAME.lock`` beside it) while its writers read and replace it."""
    with open(path.with_name(f".{path.name}.lock"), "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def update_topology_file(path: str | Path, change: Callable[[Topology | None], Topology | None]) -> Topology | None:
    """Replace the topology file by ``change(current)`` (``current`` None when there is no file; a None
    result changes nothing) and return what the file then holds.

    Every writer of the file goes through here: the read and the replace happen under the file's
    lock, so writers that run at once (managers starting side by side, ``qm local start``, a
    reshard's switch) never lose each other's change; the new file is renamed into place, so a
    reader (receivers, producers, managers following the file) sees the old file or the new one,
    whole. TopologyError if the current file is invalid (it is left as it is)."""
    p = Path(path)
    with _file_lock(p):
        current = Topology.load(p) if p.exists() else None
        new = change(current)
        if new is None or new == current:
            return current
        write_file_atomically(p, new.to_toml())
        return new


def write_topology_file(path: str | Path, topology: Topology, *, keep_managers: bool = False) -> Topology:
    """Write ``topology`` to its file, under the file's lock (see :func:`update_topology_file`), and return
    what was written. ``keep_managers``: the managers the file records for a shard of the same name are
    kept (:meth:`Topology.with_managers_of`; a missing or invalid file has none)."""
    p = Path(path)
    with _file_lock(p):
        current = None
        if keep_managers:
            with contextlib.suppress(TopologyError):
                current = Topology.load(p)
        new = topology.with_managers_of(current) if current is not None else topology
        write_file_atomically(p, new.to_toml())
        return new


def record_manager(path: str | Path, shard: str, url: str) -> bool:
    """Add ``url`` to the managers of ``shard`` in the topology file (once); False when the file has no
    such shard (e.g. a reshard's target before the switch) or does not exist."""
    topology = update_topology_file(path, lambda current: None if current is None else current.with_manager(shard, url))
    return topology is not None and any(s.name == shard and url in s.managers for s in topology.shards)


def forget_manager(path: str | Path, shard: str, url: str) -> None:
    """Remove ``url`` from the managers of ``shard`` in the topology file (nothing if it is not there)."""
    update_topology_file(path, lambda current: None if current is None else current.without_manager(shard, url))
