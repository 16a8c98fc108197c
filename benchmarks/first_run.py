"""A new user's first minute: a fresh clone, ``make demo``, events flowing. How long each step takes,
and what the demo's virtualenv holds (no Spark, no Playwright, no test or lint tool).

    python -m benchmarks.first_run [--runs 3] [--source CHECKOUT]

Each run clones ``--source`` (default: this checkout's HEAD) into a new temporary directory, runs
``make demo`` there without a terminal (plain progress lines), and notes when the clone is done, when
the demo starts (its virtualenv installed: the first line of ``qm demo``), and when the first progress
line shows acked events. Then Ctrl-C (SIGINT), as a user would, and the demo's clean exit is waited
for. The pip download cache of the machine is used as is (a first-ever install also downloads the
wheels: the report says which Python and pip options ran). Target (issue 38): under 60 s from the
clone to events flowing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.lib.report import emit, header

#: what the demo's virtualenv must not hold
HEAVY = {"pyspark", "py4j", "playwright", "pytest", "mypy", "ruff", "hypothesis", "testcontainers", "import-linter"}
TARGET_S = 60.0
ACKED = re.compile(r"\backed (\d+) \(")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def one_run(source: Path, work: Path, timeout: float) -> dict[str, Any]:
    clone = work / "queue-manager"
    load_at_start = round(os.getloadavg()[0], 1)
    t0 = time.monotonic()
    subprocess.run(["git", "clone", "-q", str(source), str(clone)], check=True, timeout=120)
    cloned = time.monotonic() - t0
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "QM_TOPOLOGY")}
    proc = subprocess.Popen(
        ["make", "demo", "ARGS=--duration 600"],
        cwd=clone,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    marks: dict[str, float] = {}
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            now = time.monotonic() - t0
            if "== starting" in line and "demo_started" not in marks:
                marks["demo_started"] = now
            m = ACKED.search(line)
            if m and int(m[1]) > 0 and "events_flowing" not in marks:
                marks["events_flowing"] = now

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = t0 + timeout
    while "events_flowing" not in marks and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    flowing = "events_flowing" in marks
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: make and the demo get it, as in a terminal
    try:
        code = proc.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
    reader.join(10)
    venv = clone / ".venv"
    listed = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "list", "--format", "json"],
        capture_output=True,
        text=True,
        check=False,
    )
    packages = sorted(p["name"].lower() for p in json.loads(listed.stdout or "[]"))
    size = subprocess.run(["du", "-sm", str(venv)], capture_output=True, text=True, check=False).stdout.split()
    out = {
        "load_at_start": load_at_start,
        "clone_s": round(cloned, 2),
        "installed_s": round(marks["demo_started"], 2) if "demo_started" in marks else None,
        "events_flowing_s": round(marks["events_flowing"], 2) if flowing else None,
        "exit_code_after_ctrl_c": code,
        "lost_0": any("lost = 0" in line for line in lines),
        "packages": len(packages),
        "heavy_packages": sorted(set(packages) & HEAVY),
        "venv_mb": int(size[0]) if size else None,
    }
    if not flowing:
        out["tail"] = lines[-30:]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="fresh clones, one after the other (default 3)")
    parser.add_argument("--source", type=Path, default=Path(__file__).resolve().parents[1], help="what to clone")
    parser.add_argument("--timeout", type=float, default=300.0, help="give up on a run after this long, s")
    args = parser.parse_args(argv)
    runs = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="qm-first-run-") as tmp:
            _log(f"run {i + 1}: fresh clone in {tmp}")
            runs.append(one_run(args.source, Path(tmp), args.timeout))
            _log(f"run {i + 1}: {runs[-1]}")
            shutil.rmtree(tmp, ignore_errors=True)
    flowing = [r["events_flowing_s"] for r in runs if r["events_flowing_s"] is not None]
    report: dict[str, Any] = header("first_run")
    commit = subprocess.run(
        ["git", "-C", str(args.source), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    report.update(
        {
            "source_commit": commit.stdout.strip(),
            "python": sys.version.split()[0],
            "pip_config": {k: v for k, v in os.environ.items() if k.startswith("PIP_")},
            "load_average": os.getloadavg(),
            "runs": runs,
            "events_flowing_s": {
                "median": round(statistics.median(flowing), 2) if flowing else None,
                "min": min(flowing, default=None),
                "max": max(flowing, default=None),
            },
            "target_s": TARGET_S,
            "met": bool(flowing) and len(flowing) == len(runs) and max(flowing) < TARGET_S,
            "no_heavy_package": all(not r["heavy_packages"] for r in runs),
        }
    )
    emit(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
