"""The machine a benchmark ran on, the commit it measured, and CPU accounting from /proc.

Standard library only (the PostgreSQL driver is imported inside :func:`count_server`), so the
peers' benchmarks (``benchmarks/peers``, run in their own virtualenv) account CPU the same way.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import resource
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def machine_info() -> dict[str, Any]:
    """The machine facts every benchmark report carries."""
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def code_version() -> dict[str, Any]:
    """The commit measured, and whether the working tree differed from it."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    out: dict[str, Any] = {
        "commit": commit or None,
        "modified_files": sorted(line[3:] for line in status.splitlines() if line.strip()),
    }
    spec = importlib.util.find_spec("queue_manager")  # found, not imported: the peers' side has none
    if spec is not None and spec.origin is not None:
        out["queue_manager_imported_from"] = str(Path(spec.origin).resolve().parent)
    return out


# --------------------------------------------------------------------------- CPU accounting

_CLK = os.sysconf("SC_CLK_TCK")

#: pid of the benchmark server's postmaster once :func:`count_server` found it (its backends are
#: its children); None counts every process named postgres on the machine
_postmaster: int | None = None


def count_server(dsn: str) -> int | None:
    """From now on, :func:`cpu_delta`'s ``postgres`` counts the processes of the server at ``dsn``
    only (when it runs on this machine; otherwise every ``postgres`` process). Returns its pid."""
    import psycopg

    global _postmaster
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_backend_pid()").fetchone()
    try:
        info = _proc_ticks().get(int(row[0])) if row else None
    except (OSError, ValueError):
        info = None
    _postmaster = info[1] if info is not None and info[0] == "postgres" else None
    return _postmaster


def _proc_ticks() -> dict[int, tuple[str, int, int, int]]:
    """pid -> (command, parent pid, CPU ticks used (utime + stime), ticks of its reaped children)."""
    out: dict[int, tuple[str, int, int, int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                s = f.read()
        except OSError:
            continue
        comm = s[s.index("(") + 1 : s.rindex(")")]
        rest = s[s.rindex(")") + 2 :].split()
        out[int(d)] = (comm, int(rest[1]), int(rest[11]) + int(rest[12]), int(rest[13]) + int(rest[14]))
    return out


@dataclass
class CpuSnap:
    busy: int
    ticks: dict[int, tuple[str, int, int, int]]
    at: float
    children: float  # CPU seconds of this process's reaped children (subprocesses such as the peers)


def cpu_snapshot() -> CpuSnap:
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    idle = parts[3] + parts[4]
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return CpuSnap(sum(parts[:8]) - idle, _proc_ticks(), time.monotonic(), ru.ru_utime + ru.ru_stime)


def cpu_delta(
    a: CpuSnap, b: CpuSnap, groups: Mapping[str, Sequence[int]], reaped_group: str | None = None
) -> dict[str, float]:
    """CPU use between two snapshots in % of ONE core (200 = both cores of a 2-core machine busy).

    ``postgres`` counts the benchmark server's processes (see :func:`count_server`: live
    backends, plus the backends that exited, through the postmaster's reaped-children time);
    ``groups`` are our processes by pid (alive at the second snapshot); ``reaped_group`` names
    the CPU of subprocesses this process started and reaped in the window (a peer benchmark and its workers);
    ``rest_of_machine`` is everything else that ran, e.g. other work on a shared machine.
    """
    wall = b.at - a.at
    if wall <= 0:
        return {}

    def pct(ticks: float) -> float:
        return round(ticks / _CLK / wall * 100, 1)

    out = {"machine_busy": pct(b.busy - a.busy)}
    ours = 0.0
    pg = 0.0
    for pid, (comm, ppid, t, reaped) in b.ticks.items():
        if comm == "postgres" and (_postmaster is None or pid == _postmaster or ppid == _postmaster):
            before = a.ticks.get(pid)
            pg += t - (before[2] if before else 0)
            if pid == _postmaster:
                pg += reaped - (before[3] if before else 0)
    out["postgres"] = pct(pg)
    ours += pg
    for name, pids in groups.items():
        ticks = sum(b.ticks[p][2] - (a.ticks[p][2] if p in a.ticks else 0) for p in pids if p in b.ticks)
        out[name] = pct(ticks)
        ours += ticks
    if reaped_group is not None:
        reaped_ticks = (b.children - a.children) * _CLK
        out[reaped_group] = pct(reaped_ticks)
        ours += reaped_ticks
    out["rest_of_machine"] = round(out["machine_busy"] - pct(ours), 1)
    return out
