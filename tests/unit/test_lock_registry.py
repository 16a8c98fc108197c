"""The registry of advisory locks (queue_manager/db/locks.py, sql/schema/locks/lock_classes.sql):
one class per purpose, the same in Python and SQL, and no source that takes an advisory lock of a
class spelled any other way.

Why it matters: the dedup lock once took the queue id as its class, (queue id, hash of the key), so
a queue whose id reached 29037 would have shared its dedup locks' class with every queue's wake-up
lock (29037, queue id); and an adoption run once held (29038, hashtext(name)), the class of the
queues' load lock (29038, queue id). tests/integration/test_lock_registry.py checks the functions of
a migrated database, the generated ones of each queue included.
"""

from __future__ import annotations

import re
from pathlib import Path

from queue_manager.db.locks import LockClass

ROOT = Path(__file__).resolve().parents[2]
SQL = ROOT / "queue_manager" / "db" / "sql"
#: every directory of code that may take an advisory lock
SOURCES = ("queue_manager", "receivers", "spark_jobs", "benchmarks", "tests", "alembic", "scripts")
#: a call of any advisory lock function: pg_advisory_lock, pg_try_advisory_xact_lock_shared, ...
CALL = re.compile(r"pg_\w*advisory\w*\s*\(")
#: not scanned: the old head's dump (its locks are what the registry replaced) and this file's examples
EXEMPT = ("tests/fixtures/", "tests/unit/test_lock_registry.py")
#: the one allowed first argument: a class of the registry by name (quotes doubled inside a literal),
#: followed by the key (the two-key form)
REGISTERED = re.compile(r"\s*qm\.lock_class\(('{1,2})([a-z_]+)\1\)\s*,")
#: the migration lock, taken before qm.lock_class exists; its class is bound from LockClass.MIGRATION
MIGRATION_LOCK = "pg_advisory_xact_lock(%(lock_class)s, 0)"


def registry_sql() -> dict[str, int]:
    text = (SQL / "schema" / "locks" / "lock_classes.sql").read_text(encoding="utf-8")
    return {name: int(value) for name, value in re.findall(r"\('([a-z_]+)', (\d+)\)", text)}


def advisory_calls(text: str) -> list[tuple[str, str | None]]:
    """Each advisory lock call in ``text``: (its text from the function name, the purpose it names,
    or None when its class is not ``qm.lock_class('<purpose>')`` followed by a key)."""
    calls: list[tuple[str, str | None]] = []
    for m in CALL.finditer(text):
        named = REGISTERED.match(text, m.end())
        calls.append((text[m.start() : m.end() + 60].split("\n")[0], named.group(2) if named else None))
    return calls


def source_files() -> list[Path]:
    files: list[Path] = []
    for d in SOURCES:
        files += [p for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".sql") and p.is_file()]
    return sorted(p for p in files if not str(p.relative_to(ROOT)).startswith(EXEMPT))


def test_each_purpose_has_a_class_of_its_own_and_sql_agrees_with_python() -> None:
    python = {c.purpose: int(c) for c in LockClass}
    assert len(set(python.values())) == len(python)
    assert all(0 < v < 2**31 for v in python.values())
    assert registry_sql() == python
    assert python == {
        "migration": 29036,
        "wake": 29037,
        "maintenance": 29039,
        "adopt": 29041,
        "spark_run": 29042,
        "dedup": 29043,
        "reshard": 29044,
    }, "a class was added or removed, or a number changed (a removed class's number is not reused)"


def test_every_advisory_lock_in_the_sources_takes_a_registered_class() -> None:
    python = {c.purpose for c in LockClass}
    seen: dict[str, set[str]] = {}
    wrong: list[str] = []
    for path in source_files():
        text = path.read_text(encoding="utf-8")
        for call, purpose in advisory_calls(text):
            where = str(path.relative_to(ROOT))
            if purpose is None and call.startswith(MIGRATION_LOCK) and where == "queue_manager/db/sql/migrate.sql":
                purpose = "migration"
            if purpose not in python:
                wrong.append(f"{where}: {call}")
            else:
                seen.setdefault(purpose, set()).add(where)
    assert not wrong, "advisory locks whose class is not qm.lock_class('<registered purpose>'):\n" + "\n".join(wrong)
    # the scan finds the locks where they are taken (it would pass vacuously otherwise)
    expected = {
        "migration": "queue_manager/db/sql/migrate.sql",
        "wake": "queue_manager/db/sql/manager.sql",
        "maintenance": "queue_manager/db/sql/schema/maintenance/count_maintenance.sql",
        "dedup": "queue_manager/db/sql/schema/queue_triggers/route_source.sql",
        "adopt": "queue_manager/db/sql/adopt.sql",
        "spark_run": "queue_manager/db/sql/spark.sql",
    }
    assert all(where in seen.get(purpose, set()) for purpose, where in expected.items()), seen


def test_the_migration_lock_is_bound_from_the_registry() -> None:
    text = (ROOT / "queue_manager" / "db" / "schema.py").read_text(encoding="utf-8")
    assert '"lock_class": int(LockClass.MIGRATION)' in text


def test_the_scan_refuses_a_class_outside_the_registry() -> None:
    assert advisory_calls("SELECT pg_advisory_xact_lock(qm.lock_class('wake'), 7)") == [
        ("pg_advisory_xact_lock(qm.lock_class('wake'), 7)", "wake")
    ]
    assert advisory_calls("format('PERFORM pg_advisory_xact_lock(qm.lock_class(''dedup''), h)')")[0][1] == "dedup"
    for bad in (
        "SELECT pg_advisory_xact_lock(29038, 7)",  # a bare number
        "PERFORM pg_advisory_xact_lock(5, hashtext(k))",  # a queue id as class
        "SELECT pg_try_advisory_lock(qm.lock_class('wake'))",  # the one-key form
        "SELECT pg_advisory_lock(qm.wake_lock_key(), 1)",  # another spelling
    ):
        assert advisory_calls(bad)[0][1] is None, bad
