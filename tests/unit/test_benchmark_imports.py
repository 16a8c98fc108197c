"""The benchmarks' layout, checked from their source (nothing is imported or run):

- ``benchmarks/<name>.py`` is a benchmark, run as ``python -m benchmarks.<name>``; the helpers
  the benchmarks share are the public names of ``benchmarks/lib/``. A benchmark imports no other
  benchmark, no private module (``_x``) and no private name, and reaches no private attribute
  of a helper module; nothing edits ``sys.path``; imports are absolute.
- ``benchmarks/peers/`` runs in the peers' own virtualenv, which does not have this project
  installed: it imports the standard library, the peers and their drivers, itself,
  ``benchmarks.lib.wal`` (the driver only), ``benchmarks.lib.machine`` and
  ``benchmarks.lib.timings`` (themselves standard library only at import time), nothing else.

A new benchmark module needs no change here: it is checked by being in ``benchmarks/``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
#: what the peers' virtualenv has besides the standard library (benchmarks/peers/requirements.txt)
PEERS_PACKAGES = {"psycopg", "psycopg_pool", "asyncpg", "uvloop", "pgqueuer", "procrastinate"}
#: the project modules the peers' code may import (helpers of the standard library and the driver only)
PEERS_MAY_IMPORT = ("benchmarks.peers", "benchmarks.lib.machine", "benchmarks.lib.wal", "benchmarks.lib.timings")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def benchmark_modules() -> set[str]:
    """The benchmarks themselves: the modules directly in benchmarks/."""
    return {f"benchmarks.{p.stem}" for p in BENCH.glob("*.py") if p.stem != "__init__"}


def problems(module: str, source: str, benchmarks: set[str]) -> list[str]:
    """What breaks the rules above in ``source`` (the text of ``module``)."""
    tree = ast.parse(source)
    out: list[str] = []
    peers_side = module.startswith("benchmarks.peers") or module in ("benchmarks.lib.machine", "benchmarks.lib.timings")
    bench_aliases: set[str] = set()  # local names bound to a benchmarks module

    def check_target(target: str, line: int) -> None:
        top = target.split(".")[0]
        if top == "benchmarks":
            if any(part.startswith("_") for part in target.split(".")):
                out.append(f"{module}:{line}: imports the private module {target}")
            if target in benchmarks and target != module:
                out.append(f"{module}:{line}: imports the benchmark {target} (shared code goes in benchmarks/lib)")
            if peers_side and not target.startswith(PEERS_MAY_IMPORT):
                out.append(f"{module}:{line}: the peers' side imports {target}")
        elif peers_side and top not in sys.stdlib_module_names and top not in PEERS_PACKAGES:
            out.append(f"{module}:{line}: the peers' virtualenv has no {top}")

    # only module-level and function-level imports count for the peers' side at import time, but
    # every import is held to the same rules: a lazy import runs too, just later
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                check_target(alias.name, node.lineno)
                if alias.name.startswith("benchmarks"):
                    bench_aliases.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                out.append(f"{module}:{node.lineno}: a relative import (absolute imports only)")
                continue
            target = node.module or ""
            check_target(target, node.lineno)
            for alias in node.names:
                full = f"{target}.{alias.name}"
                if target.startswith("benchmarks"):
                    if alias.name.startswith("_"):
                        out.append(f"{module}:{node.lineno}: imports the private name {full}")
                    if full in benchmarks or is_module(full):
                        check_target(full, node.lineno)
                        bench_aliases.add(alias.asname or alias.name)
        elif isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "sys" and node.attr == "path":
                out.append(f"{module}:{node.lineno}: uses sys.path (run as python -m benchmarks.<name>)")
            if (
                isinstance(node.value, ast.Name)
                and node.value.id in bench_aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                out.append(f"{module}:{node.lineno}: reaches the private {node.value.id}.{node.attr}")
    return out


def test_benchmarks_import_only_public_helpers() -> None:
    benchmarks = benchmark_modules()
    assert "benchmarks.e2e" in benchmarks and "benchmarks.web" in benchmarks
    found = []
    files = sorted(BENCH.rglob("*.py"))
    assert len(files) > 15
    for path in files:
        found += problems(module_name(path), path.read_text(encoding="utf-8"), benchmarks)
    assert found == []


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        ("benchmarks.churn", "import e2e\nimport sys\nsys.path.insert(0, 'x')\n", "uses sys.path"),
        ("benchmarks.churn", "from benchmarks import e2e\n", "imports the benchmark benchmarks.e2e"),
        ("benchmarks.churn", "from benchmarks.e2e import reset\n", "imports the benchmark benchmarks.e2e"),
        ("benchmarks.churn", "from benchmarks.lib._util import x\n", "private module benchmarks.lib._util"),
        ("benchmarks.churn", "from benchmarks.lib.fleet import _counters\n", "private name"),
        (
            "benchmarks.churn",
            "from benchmarks.lib import fleet\nfleet._CTX.Event()\n",
            "reaches the private fleet._CTX",
        ),
        ("benchmarks.churn", "import benchmarks.lib.fleet as f\nf._x\n", "reaches the private f._x"),
        ("benchmarks.churn", "from . import e2e\n", "relative import"),
        ("benchmarks.peers.harness", "from queue_manager.domain.stats import percentile\n", "has no queue_manager"),
        ("benchmarks.peers.harness", "from benchmarks.lib.report import emit\n", "the peers' side imports"),
        ("benchmarks.lib.machine", "import psycopg.sql\nimport numpy\n", "has no numpy"),
    ],
)
def test_the_check_finds_each_kind_of_breach(module: str, source: str, expected: str) -> None:
    found = problems(module, source, {"benchmarks.e2e", "benchmarks.churn"})
    assert any(expected in p for p in found), found


def test_what_a_benchmark_may_do() -> None:
    source = (
        "from benchmarks.lib import fleet\n"
        "from benchmarks.lib.report import emit, pct_ms\n"
        "from queue_manager.domain.stats import percentile\n"
        "fleet.start_receivers\n"
    )
    assert problems("benchmarks.churn", source, {"benchmarks.e2e", "benchmarks.churn"}) == []


#: the one percentile of samples, and a different thing allowed beside it
PERCENTILE_HOME = "queue_manager/domain/stats.py:percentile"
#: the metrics' quantile of a log-scale histogram (the bucket's bound, not a percentile of samples)
OTHER_QUANTILES = {"queue_manager/manager/metrics.py:_quantile"}


def test_one_percentile_of_samples() -> None:
    """Benchmarks, the library and the tests compute a percentile of samples with
    queue_manager.domain.stats.percentile, not with one of their own."""
    defined = []
    for top in ("benchmarks", "queue_manager", "receivers", "spark_jobs", "tests"):
        for path in sorted((ROOT / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if (
                    isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                    and not node.name.startswith("test_")
                    and any(word in node.name.lower() for word in ("percentile", "quantile"))
                ):
                    defined.append(f"{path.relative_to(ROOT)}:{node.name}")
    assert PERCENTILE_HOME in defined
    assert sorted(set(defined) - {PERCENTILE_HOME} - OTHER_QUANTILES) == []
