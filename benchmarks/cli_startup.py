"""What a ``qm`` command costs before it does any work: the CPU (user + system) and wall time of
``qm --help`` and of the imports ``qm enqueue`` needs, beside a bare interpreter's start, in
alternating rounds (the machine is shared: medians and spread, not one run).

    python -m benchmarks.cli_startup [--rounds 15] [--other CHECKOUT]

``--other``: the same commands from another checkout's virtualenv (``CHECKOUT/.venv/bin/python``),
in the same rounds, e.g. ``git worktree add /tmp/base main`` and ``make setup`` there. The target
(issue 38): ``qm --help`` under 0.3 s of CPU.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.lib.report import emit, header

#: what each round runs, by name: the interpreter's arguments
COMMANDS = {
    "python -c pass": ["-c", "pass"],
    "qm --help": ["-m", "queue_manager.cli.main", "--help"],
    "qm enqueue's imports": ["-c", "import queue_manager.cli.main, queue_manager.producer"],
}
TARGET_HELP_CPU_S = 0.3


def _run(python: str, args: list[str], cwd: Path) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one child process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([python, *args], cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall


def _summary(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    return {
        "median": round(statistics.median(v), 4),
        "min": round(v[0], 4),
        "p90": round(v[min(len(v) - 1, int(0.9 * len(v)))], 4),
        "max": round(v[-1], 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15, help="rounds of every command (default 15)")
    parser.add_argument("--other", type=Path, help="another checkout with its own .venv, measured alongside")
    args = parser.parse_args(argv)
    here = Path(__file__).resolve().parents[1]
    sides = {"this": (sys.executable, here)}
    if args.other is not None:
        python = args.other / ".venv" / "bin" / "python"
        if not python.exists():
            parser.error(f"--other {args.other}: no .venv/bin/python there (run make setup in it)")
        sides["other"] = (str(python), args.other.resolve())
    samples: dict[str, dict[str, list[tuple[float, float]]]] = {s: {c: [] for c in COMMANDS} for s in sides}
    for _ in range(args.rounds):
        for side, (python, cwd) in sides.items():  # alternated: both sides see the same load
            for name, cmd in COMMANDS.items():
                samples[side][name].append(_run(python, cmd, cwd))
    report: dict[str, Any] = header("cli_startup")
    report["rounds"] = args.rounds
    report["load_average"] = os.getloadavg()
    for side, by_command in samples.items():
        report[side] = {
            name: {
                "cpu_s": _summary([cpu for cpu, _ in runs]),
                "wall_s": _summary([wall for _, wall in runs]),
            }
            for name, runs in by_command.items()
        }
    if args.other is not None:
        report["other_checkout"] = str(args.other)
    help_cpu = report["this"]["qm --help"]["cpu_s"]["median"]
    report["target"] = {"qm --help cpu_s": TARGET_HELP_CPU_S, "met": help_cpu < TARGET_HELP_CPU_S}
    emit(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
