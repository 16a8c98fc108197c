"""The schema as source, the history as data (queue_manager/db/schema.py): every function is
defined once, in a file of its own that the loader applies; no revision defines or edits one; the
revision ids follow one pattern, one after the other."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from queue_manager.db import schema

ROOT = Path(__file__).resolve().parents[2]
SQL = ROOT / "queue_manager" / "db" / "sql"
SOURCE_DIR = SQL / "schema"
DEFINES = re.compile(r"\bCREATE\s+(?:OR\s+REPLACE\s+)?FUNCTION\s+qm\.(\w+)\s*\(", re.IGNORECASE)
#: what editing a function looks like in a revision: defining it, altering it, or rewriting its text
EDITS_A_FUNCTION = re.compile(r"\b(CREATE\s+(OR\s+REPLACE\s+)?FUNCTION|ALTER\s+FUNCTION|pg_get_functiondef)\b", re.I)


def _sql_files_anywhere() -> list[Path]:
    return sorted(p for p in SQL.rglob("*.sql"))


def test_the_loader_applies_every_source_file_once() -> None:
    on_disk = sorted(str(p.relative_to(SOURCE_DIR)) for p in SOURCE_DIR.rglob("*.sql"))
    assert sorted(schema.SOURCE) == on_disk
    assert len(set(schema.SOURCE)) == len(schema.SOURCE)


def test_each_source_file_defines_the_function_it_is_named_after_and_replaces_it() -> None:
    for name in schema.SOURCE:
        text = (SOURCE_DIR / name).read_text(encoding="utf-8")
        assert DEFINES.findall(text) == [Path(name).stem], name
        # applied again after every migration: every statement (they start a line) must replace
        creates = re.findall(r"^CREATE\s+(?!OR\s+REPLACE\b)\w+", text, re.IGNORECASE | re.MULTILINE)
        assert not creates, (name, creates)


def test_each_function_is_defined_in_one_file_only() -> None:
    defined: dict[str, list[str]] = {}
    for path in _sql_files_anywhere():
        for function in DEFINES.findall(path.read_text(encoding="utf-8")):
            defined.setdefault(function, []).append(str(path.relative_to(SQL)))
    assert defined["apply_queue"] == ["schema/queue_triggers/apply_queue.sql"]
    assert {f: files for f, files in defined.items() if len(files) > 1} == {}
    assert all(files[0].startswith("schema/") for files in defined.values()), defined


def test_no_revision_defines_or_edits_a_function() -> None:
    revisions = sorted((SQL / "revisions").glob("*.sql")) + sorted((ROOT / "alembic" / "versions").glob("*.py"))
    assert revisions
    for path in revisions:
        assert not EDITS_A_FUNCTION.search(path.read_text(encoding="utf-8")), path


def _revision(path: Path) -> tuple[str, str | None]:
    """``revision`` and ``down_revision`` of an alembic revision file."""
    values: dict[str, str | None] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id in ("revision", "down_revision")
            and isinstance(node.value, ast.Constant)
        ):
            values[node.targets[0].id] = node.value.value
    return str(values["revision"]), values["down_revision"]


def test_revision_ids_are_numbered_and_named_one_after_the_other() -> None:
    files = sorted((ROOT / "alembic" / "versions").glob("*.py"))
    previous: str | None = None
    for number, path in enumerate(files, start=1):
        revision, down = _revision(path)
        assert re.fullmatch(rf"{number:04d}_[a-z][a-z0-9_]*", revision), revision
        assert path.stem == revision
        assert down == previous, (revision, down)
        previous = revision
    assert _revision(files[0])[0] == schema.BASELINE
