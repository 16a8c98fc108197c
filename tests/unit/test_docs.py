"""The docs' cheap-to-check statements against the repository: make targets, links, the benchmarks table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def make_targets() -> set[str]:
    return set(re.findall(r"^([a-z][a-z0-9-]*):", (ROOT / "Makefile").read_text(), flags=re.M))


def test_every_make_target_the_docs_name_exists() -> None:
    targets = make_targets()
    missing = {
        f"{page.relative_to(ROOT)}: make {name}"
        for page in PAGES
        for name in re.findall(r"`make ([a-z][a-z0-9-]*)", page.read_text())
        if name not in targets
    }
    assert not missing, sorted(missing)


def test_every_benchmark_has_its_latest_figure_in_the_table() -> None:
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    table = text.split("## Latest figures", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| [^|]+ \| `make (bench-[a-z0-9-]+)[` ]", table, flags=re.M))
    benchmarks = {t for t in make_targets() if t.startswith("bench-") and not t.endswith("-setup")}
    assert benchmarks - listed == set(), "benchmarks without a row in docs/benchmarks.md's latest figures"
    assert listed - benchmarks == set(), "rows naming a make target that does not exist"
    for row in re.findall(r"^\| [^|]+ \| `make bench-.*$", table, flags=re.M):
        dated = re.search(r"\| 20\d\d-\d\d-\d\d, `[0-9a-f]{7,}` \|$", row)
        assert dated, f"a figure without its date and commit: {row}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
        if re.match(r"^[a-z]+:", target):
            continue  # a URL
        if not (page.parent / target).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"


def test_docs_speak_of_the_project_not_of_working_sessions() -> None:
    pattern = re.compile(r"\b(?:session \d+|sessions? of (?:work|the day)|this session|last session)\b", re.I)
    found = [
        f"{page.relative_to(ROOT)}:{n}: {line.strip()}"
        for page in PAGES
        for n, line in enumerate(page.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, found
