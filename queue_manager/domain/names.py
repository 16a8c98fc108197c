"""Allow-lists for names that end up in SQL identifiers, metrics and errors."""

from __future__ import annotations

import re

from queue_manager.errors import InvalidNameError

_QUEUE_RE = re.compile(r"^[a-z][a-z0-9_]{0,39}$")
_SHARD_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
#: names a queue table may not take (our own objects and common SQL words)
RESERVED_QUEUE_NAMES = frozenset({"qm", "public", "user", "table", "select", "insert", "order", "group"})


def check_queue_name(name: str) -> str:
    """Return ``name`` if it is a valid queue name, else raise InvalidNameError.

    A queue name becomes a table name, so it is restricted to lowercase ASCII letters,
    digits and underscores, starting with a letter, at most 40 characters, not starting
    with ``qm_`` (our own objects) and not a reserved word.
    """
    if not isinstance(name, str) or not _QUEUE_RE.match(name):
        raise InvalidNameError(
            f"invalid queue name {name!r}: use 1-40 lowercase letters, digits or '_', starting with a letter"
        )
    if name.startswith("qm_") or name in RESERVED_QUEUE_NAMES:
        raise InvalidNameError(f"invalid queue name {name!r}: it is reserved (names starting with 'qm_' are ours)")
    return name


def check_shard_name(name: str) -> str:
    """Return ``name`` if it is a valid shard name (1-63 of letters, digits, '_', '.', '-')."""
    if not isinstance(name, str) or not _SHARD_RE.match(name):
        raise InvalidNameError(
            f"invalid shard name {name!r}: use 1-63 letters, digits, '_', '.' or '-', starting with a letter or digit"
        )
    return name
