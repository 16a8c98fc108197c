"""Access to the SQL files shipped with the package: revisions, the schema source, named runtime queries."""

from __future__ import annotations

import re
from functools import cache
from importlib import resources
from typing import Any, LiteralString, cast

_BLOCK_RE = re.compile(r"^-- ([a-z0-9_]+) --\n", re.MULTILINE)


def read_sql(name: str) -> str:
    """The text of ``queue_manager/db/sql/<name>`` (``name`` may name a subdirectory: ``schema/...``)."""
    return resources.files("queue_manager.db").joinpath("sql", *name.split("/")).read_text(encoding="utf-8")


@cache
def queries(filename: str = "queries.sql") -> dict[str, LiteralString]:
    """Named runtime queries from ``sql/<filename>``: blocks introduced by ``-- name --``.

    Comment lines right after the name line document the query and are kept; queue table
    names are written ``{queue}`` and filled in with ``psycopg.sql`` after an allow-list check.
    """
    text = read_sql(filename)
    parts = _BLOCK_RE.split(text)
    found: dict[str, LiteralString] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in found:
            raise RuntimeError(f"{filename} defines {name!r} twice")
        # the SQL comes from a file shipped with the package, never from user input
        found[name] = cast(LiteralString, body.strip())
    return found


def query(name: str, filename: str = "queries.sql") -> LiteralString:
    """One named runtime query; KeyError names the missing block."""
    try:
        return queries(filename)[name]
    except KeyError:
        raise KeyError(f"no query named {name!r} in {filename}") from None


def run_script(bind: Any, script: str) -> None:
    """Run a multi-statement SQL script on the psycopg connection under a SQLAlchemy Connection.

    psycopg runs several statements in one call only without parameters, and SQLAlchemy
    always passes some, so the script goes straight to the driver connection.
    """
    bind.connection.driver_connection.execute(script)
