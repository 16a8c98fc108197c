"""Advisory lock classes: each purpose has its own, so that one holder never blocks another's work.

An adoption run once held (29038, hashtext(name)), the class of the queues' load lock (29038, queue
id): a name that hashed to a queue's id would have stalled that queue's acks for the whole run.
"""

from __future__ import annotations

import re
from importlib import resources

from queue_manager.db.migrate import _MIGRATION_LOCK

KEY_FUNCTION = re.compile(r"CREATE FUNCTION qm\.(\w+_lock_key)\(\) RETURNS integer\s+LANGUAGE sql[^;]*?RETURN (\d+);")
LITERAL_CLASS = re.compile(r"pg_\w*advisory\w*\((\d+)\s*,")
RUNTIME_FILES = ("adopt.sql", "archive.sql", "health.sql", "manager.sql", "queries.sql", "spark.sql")


def _sql_files() -> dict[str, str]:
    root = resources.files("queue_manager.db").joinpath("sql")
    return {p.name: p.read_text(encoding="utf-8") for p in root.iterdir() if p.name.endswith(".sql")}


def test_every_lock_key_function_has_a_class_of_its_own() -> None:
    keys: dict[str, int] = {}
    for text in _sql_files().values():
        for name, value in KEY_FUNCTION.findall(text):
            keys[name] = int(value)
    assert {"wake_lock_key", "load_lock_key", "maintenance_lock_key", "enq_lock_key"} <= keys.keys(), keys
    assert len(set(keys.values())) == len(keys), keys


def test_no_runtime_query_takes_a_lock_of_a_key_functions_class() -> None:
    files = _sql_files()
    keys = {int(v) for text in files.values() for _, v in KEY_FUNCTION.findall(text)}
    literals = {(name, int(c)) for name in RUNTIME_FILES for c in LITERAL_CLASS.findall(files[name])}
    assert ("adopt.sql", 29041) in literals
    assert not {c for _, c in literals} & keys, sorted(literals)


def test_each_literal_class_belongs_to_one_purpose() -> None:
    """The classes written as literals (adoption runs, Spark enqueue runs, migrations) are neither
    shared between the runtime files nor with the migration lock or a key function."""
    files = _sql_files()
    keys = {int(v) for text in files.values() for _, v in KEY_FUNCTION.findall(text)}
    literals = {(name, int(c)) for name in RUNTIME_FILES for c in LITERAL_CLASS.findall(files[name])}
    assert {("adopt.sql", 29041), ("spark.sql", 29042)} <= literals, sorted(literals)
    owners: dict[int, set[str]] = {}
    for name, c in literals:
        owners.setdefault(c, set()).add(name)
    assert all(len(names) == 1 for names in owners.values()), owners
    assert _MIGRATION_LOCK not in owners.keys() | keys
