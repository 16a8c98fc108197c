"""Keyspace routing and shuffle sharding: pure functions, identical in Python, SQL and Spark SQL.

The whole scheme rests on two native hashes of the tenant's UTF-8 bytes, ``md5`` for the
shard and ``sha256`` for the partitions, which PostgreSQL, Spark SQL and Python (``hashlib``)
all have, so no side needs a user-defined function. Let ``h`` be md5's 32 lowercase hex digits.

Keyspace id
    The first 16 hex digits of ``h`` (64 bits), as in Vitess' ``binary_md5`` vindex. A shard
    owns a half-open range ``[start, end)`` written in Vitess notation (``-80``, ``40-80``,
    ``80-``). Bounds are hex byte strings; we right-pad them with ``0`` to 16 digits and compare
    the 16-digit strings (byte order, ``COLLATE "C"`` in SQL). An empty bound is open.

Shuffle set (tenant -> k of N partitions)
    The N partitions are cut into k contiguous groups: group ``j`` is
    ``[j*N div k, (j+1)*N div k)``. The tenant takes one partition in each group, chosen by
    its own draw from a second native hash, ``g = sha256`` of the tenant's UTF-8 bytes (64 hex
    digits: PostgreSQL ``sha256(bytea)``, Spark SQL ``sha2(binary, 256)``, ``hashlib``). A
    draw is ``w`` hex digits: ``w = 7`` (28 bits) when ``k <= 8``, else ``w = 4`` (16 bits).
    The 64 digits are read as four 16-digit words and a draw never straddles two: a word holds
    ``per = 16 div w`` draws (2 or 4), so draw ``j`` starts at digit
    ``16*(j div per) + w*(j mod per)`` and is read as an integer ``d_j`` (a non-negative int32
    in every engine). The pick is ``lo_j + d_j mod size_j``. So the set is always k distinct
    partitions, and every partition of a group is reachable: a draw has ``16**w`` values, at
    least 65 536, and a group has at most 1 024 partitions (at most 114 once ``k >= 9``). The
    shares are equal up to the rounding of ``d mod size``: a partition's share of uniform
    tenants is within ``size_j / 16**w`` of ``1/size_j`` relatively, below 0.2 % for every
    shape (exactly equal when ``size_j`` is a power of two); :func:`share_bounds` computes it
    and the unit tests check every shape. The membership of one partition ``p`` is a closed
    formula: ``p`` lies in group ``j = ((p+1)*k - 1) div N`` and is in the set iff it equals
    that group's pick. The database checks that formula for every inserted row in one
    set-based pass (the queue's ``qm_verify`` statement trigger), which keeps bulk loads
    (COPY, JDBC) fast while still refusing a row written to a foreign partition.

    Until revision 0005 the draws were ``16 div k`` digits of md5's second half, which left
    partitions no tenant could reach once a group was wider than the draw's range (at N=1024,
    k=16 only 256 of 1 024 partitions were used). Events stored before it stay where they are.

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
#: the largest shuffle-shard size
MAX_SHUFFLE = 16
#: hex digits of the draw hash (sha256)
DRAW_HASH_HEX_DIGITS = 64
#: hex digits per word of the draw hash: a draw never straddles two words
DRAW_WORD_HEX_DIGITS = 16
#: the widest shuffle-shard size whose draws are 7 hex digits (two per word); wider ones use 4
WIDE_DRAW_MAX_SHUFFLE = 8


def tenant_hash(tenant: str) -> str:
    """The 32 lowercase hex digits of md5 over the tenant's UTF-8 bytes."""
    return hashlib.md5(tenant.encode("utf-8"), usedforsecurity=False).hexdigest()


def draw_hash(tenant: str) -> str:
    """The 64 lowercase hex digits of sha256 over the tenant's UTF-8 bytes (the shuffle set's draws)."""
    return hashlib.sha256(tenant.encode("utf-8")).hexdigest()


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
    """Hex digits per draw for a shuffle-shard size ``k``: 7 up to k = 8, else 4."""
    return 7 if k <= WIDE_DRAW_MAX_SHUFFLE else 4


def draw_offset(k: int, j: int) -> int:
    """The 0-based hex digit of the draw hash where group ``j``'s draw starts."""
    width = draw_width(k)
    per_word = DRAW_WORD_HEX_DIGITS // width
    return DRAW_WORD_HEX_DIGITS * (j // per_word) + width * (j % per_word)


def _draw(g: str, k: int, j: int) -> int:
    start = draw_offset(k, j)
    return int(g[start : start + draw_width(k)], 16)


def shuffle_set_from_hash(g: str, n: int, k: int) -> tuple[int, ...]:
    """The shuffle set (ascending) for a tenant whose sha256 hex digest (:func:`draw_hash`) is ``g``."""
    check_shuffle_params(n, k)
    picks = []
    for j in range(k):
        lo, hi = group_bounds(n, k, j)
        picks.append(lo + _draw(g, k, j) % (hi - lo))
    return tuple(picks)


def shuffle_set(tenant: str, n: int, k: int) -> tuple[int, ...]:
    """The k partitions (ascending, distinct) of ``n`` that the tenant may be written to."""
    return shuffle_set_from_hash(draw_hash(tenant), n, k)


def share_bounds(n: int, k: int, p: int) -> tuple[float, float]:
    """The exact share of uniform tenants whose set holds partition ``p``, as ``(share, 1/size)``.

    ``share`` counts the draws ``d`` in ``[0, 16**w)`` with ``lo + d mod size == p``; the
    second value is the ideal share of its group. Their ratio is within ``size / 16**w`` of 1.
    """
    check_shuffle_params(n, k)
    j = ((p + 1) * k - 1) // n
    lo, hi = group_bounds(n, k, j)
    size = hi - lo
    draws = 16 ** draw_width(k)
    hits = draws // size + (1 if (p - lo) < draws % size else 0)
    return hits / draws, 1 / size


def in_shuffle_set(tenant: str, partition: int, n: int, k: int) -> bool:
    """Whether ``partition`` belongs to the tenant's shuffle set (the closed formula the DB checks)."""
    check_shuffle_params(n, k)
    if not 0 <= partition < n:
        return False
    j = ((partition + 1) * k - 1) // n
    lo, hi = group_bounds(n, k, j)
    return partition == lo + _draw(draw_hash(tenant), k, j) % (hi - lo)


def least_loaded(candidates: Sequence[int], load: Mapping[int, int]) -> int:
    """The candidate with the smallest load; ties go to the lowest partition number."""
    if not candidates:
        raise ValueError("no candidate partitions")
    return min(candidates, key=lambda p: (load.get(p, 0), p))
