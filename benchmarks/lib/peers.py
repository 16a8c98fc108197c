"""The peer comparison of ``benchmarks.e2e``: PgQueuer and Procrastinate (``benchmarks/peers``)
run in their own virtualenv on the same server, their raw timings summarised here as ours are.

The virtualenv is ``.venv-peers/`` in the project (``make bench-peers-setup``, pinned versions in
``benchmarks/peers/requirements.txt``); ``PEERS_PYTHON`` names another interpreter.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.lib.machine import ROOT, cpu_delta, cpu_snapshot
from benchmarks.lib.report import median_of, summary_ms

logger = logging.getLogger("bench.peers")

PEERS_VENV = ROOT / ".venv-peers"


def peers_python() -> Path:
    """The peers' interpreter; a clear error when its virtualenv is missing."""
    py = Path(os.environ.get("PEERS_PYTHON", PEERS_VENV / "bin" / "python"))
    if not py.exists():
        raise SystemExit(
            f"the peers' virtualenv is missing ({py}): run `make bench-peers-setup` "
            "(or pass --no-peers to measure this project alone)"
        )
    return py


def run_peer(py: Path, admin_dsn: str, module: str, args: list[str], timeout: float = 300) -> dict[str, Any]:
    """``python -m benchmarks.peers.<module> <args> --dsn <admin_dsn>``: its JSON result, with the
    latency timings summarised (``commit_to_handler_start`` etc. in ms), or ``error``."""
    cmd = [str(py), "-m", f"benchmarks.peers.{module}", *args, "--dsn", admin_dsn]
    shown = " ".join([f"benchmarks.peers.{module}", *args])
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    t = time.monotonic()
    snap0 = cpu_snapshot()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s", "cmd": shown}
    # the whole subprocess (setup, preload and measurement): what else ran on the machine meanwhile
    cpu_whole_run = cpu_delta(snap0, cpu_snapshot(), {}, reaped_group="peer_processes")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"rc={proc.returncode}", "stderr_tail": proc.stderr.strip().splitlines()[-5:], "cmd": shown}
    out: dict[str, Any] = json.loads(lines[-1])
    for name, values in out.pop("timings_s", {}).items():
        out[name] = summary_ms(values)
    out.pop("machine", None)
    out.pop("code", None)
    out["wall_s"] = round(time.monotonic() - t, 1)
    out["cmd"] = shown
    out["cpu_whole_run_pct_of_one_core"] = cpu_whole_run
    return out


def drain_summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [s for s in samples if "error" not in s]
    rates = [s["jobs_per_s"] for s in ok if not s.get("timed_out") and s.get("handled") == s.get("jobs")]
    costs = [s["per_event"] for s in ok if s.get("per_event")]
    per_event = {
        k: round(statistics.median(c[k] for c in costs if c.get(k) is not None), 3)
        for k in (costs[0] if costs else {})
        if any(c.get(k) is not None for c in costs)
    }
    return {
        "jobs_per_s": round(statistics.median(rates), 1) if rates else None,
        "samples": [s.get("jobs_per_s") for s in ok],
        "per_event_median": per_event,
        "per_event_samples": costs,
        "errors": [s for s in samples if "error" in s],
        "cpu": ok[len(ok) // 2].get("cpu") if ok else None,
        "rest_of_machine_pct": [s.get("cpu_whole_run_pct_of_one_core", {}).get("rest_of_machine") for s in ok],
        "jobs": ok[0].get("jobs") if ok else None,
    }


def latency_summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [s for s in samples if "error" not in s]
    lat = [s["commit_to_handler_start"] for s in ok]
    return {
        "p50_ms": median_of(lat, "p50_ms"),
        "p99_ms": median_of(lat, "p99_ms"),
        "max_ms": median_of(lat, "max_ms"),
        "samples": [{k: s.get(k) for k in ("p50_ms", "p99_ms", "max_ms")} for s in lat],
        "missing": sum(s.get("missing", 0) for s in ok),
        "rest_of_machine_pct": [s.get("cpu_whole_run_pct_of_one_core", {}).get("rest_of_machine") for s in ok],
        "errors": [s for s in samples if "error" in s],
    }


def bench_peers(
    admin_dsn: str,
    *,
    reps: int,
    pgq_events: int,
    pgq_batch_sizes: list[int],
    procr_events: int,
    procr_reps: int,
    latency_events: int = 500,
    rate: float = 200.0,
) -> dict[str, Any]:
    """Each peer's best drain configuration (README of each: 2 worker processes; PgQueuer with a
    large dequeue batch, Procrastinate with concurrency 10 and its finished jobs deleted) and
    commit -> handler start at ``rate``/s, ``reps`` times each (medians)."""
    py = peers_python()
    drains: dict[str, dict[str, Any]] = {}
    lats: dict[str, dict[str, Any]] = {}
    for bs in pgq_batch_sizes:
        samples = []
        for rep in range(reps):
            r = run_peer(
                py,
                admin_dsn,
                "pgqueuer_e2e",
                ["drain", "--events", str(pgq_events), "--procs", "2", "--batch-size", str(bs)],
            )
            samples.append(r)
            logger.info(
                "peer pgqueuer drain p2 b%d rep=%d: %s jobs/s %s", bs, rep + 1, r.get("jobs_per_s"), r.get("error", "")
            )
        drains[f"pgqueuer_p2_b{bs}"] = {"lib": "pgqueuer", "procs": 2, "batch_size": bs, **drain_summary(samples)}
    samples = []
    for rep in range(procr_reps):
        r = run_peer(
            py,
            admin_dsn,
            "procrastinate_e2e",
            ["drain", "--events", str(procr_events), "--procs", "2", "--concurrency", "10", "--delete-jobs", "always"],
        )
        samples.append(r)
        logger.info(
            "peer procrastinate drain p2 c10 delete=always rep=%d: %s jobs/s %s",
            rep + 1,
            r.get("jobs_per_s"),
            r.get("error", ""),
        )
    drains["procrastinate_p2_c10_del-always"] = {
        "lib": "procrastinate",
        "procs": 2,
        "concurrency": 10,
        **drain_summary(samples),
    }
    for lib in ("pgqueuer", "procrastinate"):
        samples = []
        for rep in range(reps):
            r = run_peer(py, admin_dsn, f"{lib}_e2e", ["latency", "--events", str(latency_events), "--rate", str(rate)])
            samples.append(r)
            c = r.get("commit_to_handler_start", {})
            logger.info(
                "peer %s latency %g/s rep=%d: p50=%s p99=%s ms %s",
                lib,
                rate,
                rep + 1,
                c.get("p50_ms"),
                c.get("p99_ms"),
                r.get("error", ""),
            )
        lats[lib] = {"lib": lib, "rate": rate, "events": latency_events, **latency_summary(samples)}
    versions: dict[str, str] = {}
    try:
        v = subprocess.run(
            [
                str(py),
                "-c",
                "import importlib.metadata as m, json; "
                "print(json.dumps({p: m.version(p) for p in ('pgqueuer', 'procrastinate', 'asyncpg', 'psycopg')}))",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        versions = json.loads(v.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        logger.warning("could not read the peers' versions: %s", exc)
    return {"versions": versions, "drain": drains, "latency_200_per_s": lats}
