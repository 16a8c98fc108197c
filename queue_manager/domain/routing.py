"""Keyspace routing and shuffle sharding: pure functions, identical in Python, SQL and Spark SQL.

The whole scheme rests on one native hash, ``md5`` of the tenant's UTF-8 bytes, which
PostgreSQL (``md5(text)``), Spark SQL (``md5(binary)``) and Python (``hashlib``) all have,
so no side needs a user-defined function. Let ``h`` be its 32 lowercase hex digits.

Keyspace id
    The first 16 hex digits of ``h`` (64 bits), as in Vitess' ``binary_md5`` vindex. A shard
    owns a half-open range ``[start, end)`` written in Vitess notation (``-80``, ``40-80``,
    ``80-``). Bounds are hex byte strings; we right-pad them with ``0`` to 16 digits and compare
    the 16-digit strings (byte order, ``COLLATE "C"`` in SQL). An empty bound is open.

Shuffle set (tenant -> k of N partitions)
    The N partitions are cut into k contiguous groups: group ``j`` is
    ``[j*N div k, (j+1)*N div k)``. The tenant takes one partition in each group, chosen by
    its own draw: ``w = min(16 div k, 7)`` hex digits of ``h`` starting at digit ``16 + j*w``
    read as an integer ``d_j`` (at most 28 bits, so a non-negative int32 in every engine), and
    the pick is ``lo_j + d_j mod size_j``. So the set is always k
    distinct partitions, every partition gets an equal share of uniform tenants, and the
    membership of one partition ``p`` is a closed formula: ``p`` lies in group
    ``j = ((p+1)*k - 1) div N`` and is in the set iff it equals that group's pick. The
    database checks that formula for every inserted row in one set-based pass (the queue's
    ``qm_verify`` statement trigger), which keeps bulk loads (COPY, JDBC) fast while still
    refusing a row written to a foreign partition.

    Compared with a uniformly random k-subset, two tenants share *all* k partitions with
    probability ``prod(1/size_j)`` (about ``(k/N)**k``; 1/256 for 4 of 16) instead of
    ``1/C(N, k)`` (1/1820): a deliberate trade for a rule that needs no lookup table.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

from queue_manager.errors import ConfigurationError

#: hex digits of the keyspace id
KEYSPACE_HEX_DIGITS = 16
#: the largest number of partitions a queue may have
MAX_PARTITIONS = 1024
#: the largest shuffle-shard size (draws must fit in the 16 spare hex digits of md5)
MAX_SHUFFLE = 16
#: the widest draw, in hex digits: 28 bits stay a non-negative int32 in SQL and Spark
MAX_DRAW_HEX_DIGITS = 7


def tenant_hash(tenant: str) -> str:
    """The 32 lowercase hex digits of md5 over the tenant's UTF-8 bytes."""
    return hashlib.md5(tenant.encode("utf-8"), usedforsecurity=False).hexdigest()


def keyspace_hex(tenant: str) -> str:
    """The tenant's keyspace id as 16 lowercase hex digits (the form ranges compare against)."""
    return tenant_hash(tenant)[:KEYSPACE_HEX_DIGITS]


def keyspace_id(tenant: str) -> int:
    """The tenant's 64-bit unsigned keyspace id."""
    return int(keyspace_hex(tenant), 16)


def check_shuffle_params(n: int, k: int) -> None:
    """Raise ConfigurationError unless 1 <= k <= min(n, MAX_SHUFFLE) and 1 <= n <= MAX_PARTITIONS."""
    if not 1 <= n <= MAX_PARTITIONS:
        raise ConfigurationError(f"partitions must be between 1 and {MAX_PARTITIONS}, got {n}")
    if not 1 <= k <= min(n, MAX_SHUFFLE):
        raise ConfigurationError(
            f"shuffle-shard size must be between 1 and min(partitions, {MAX_SHUFFLE}) = {min(n, MAX_SHUFFLE)}, got {k}"
        )


def group_bounds(n: int, k: int, j: int) -> tuple[int, int]:
    """The half-open partition range ``[lo, hi)`` of group ``j``."""
    return (j * n) // k, ((j + 1) * n) // k


def draw_width(k: int) -> int:
    """Hex digits per draw for a shuffle-shard size ``k``."""
    return min(MAX_SHUFFLE // k, MAX_DRAW_HEX_DIGITS)


def _draw(h: str, k: int, j: int) -> int:
    width = draw_width(k)
    start = KEYSPACE_HEX_DIGITS + j * width
    return int(h[start : start + width], 16)


def shuffle_set_from_hash(h: str, n: int, k: int) -> tuple[int, ...]:
    """The shuffle set for a tenant whose md5 hex digest is ``h`` (ascending)."""
    check_shuffle_params(n, k)
    picks = []
    for j in range(k):
        lo, hi = group_bounds(n, k, j)
        picks.append(lo + _draw(h, k, j) % (hi - lo))
    return tuple(picks)


def shuffle_set(tenant: str, n: int, k: int) -> tuple[int, ...]:
    """The k partitions (ascending, distinct) of ``n`` that the tenant may be written to."""
    return shuffle_set_from_hash(tenant_hash(tenant), n, k)


def in_shuffle_set(tenant: str, partition: int, n: int, k: int) -> bool:
    """Whether ``partition`` belongs to the tenant's shuffle set (the closed formula the DB checks)."""
    check_shuffle_params(n, k)
    if not 0 <= partition < n:
        return False
    j = ((partition + 1) * k - 1) // n
    lo, hi = group_bounds(n, k, j)
    return partition == lo + _draw(tenant_hash(tenant), k, j) % (hi - lo)


def least_loaded(candidates: Sequence[int], load: Mapping[int, int]) -> int:
    """The candidate with the smallest load; ties go to the lowest partition number."""
    if not candidates:
        raise ValueError("no candidate partitions")
    return min(candidates, key=lambda p: (load.get(p, 0), p))
