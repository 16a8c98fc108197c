"""Keyspace routing and shuffle sharding as Spark SQL column expressions.

This is :mod:`queue_manager.domain.routing` rewritten with Spark SQL built-in functions only
(``md5``, ``sha2``, ``substring``, ``conv``, ``pmod``, ``div``), so a job can route or check millions of
rows without a Python UDF. Every function takes and returns :class:`pyspark.sql.Column`
expressions; the shuffle-set shape (``n`` partitions, ``k`` per tenant) is a pair of Python
ints, validated with :func:`queue_manager.domain.routing.check_shuffle_params`, so the
per-group constants are folded into the expression when it is built.

Let ``h = md5(cast(tenant as binary))`` and ``g = sha2(cast(tenant as binary), 256)``: Spark
casts a string to its UTF-8 bytes, which is what the Python (``hashlib``) and PostgreSQL
(``md5(text)``, ``sha256(convert_to(text, 'UTF8'))``) sides hash.
All results are NULL for a NULL tenant (and :func:`in_shuffle_set` for a NULL partition).
The test vectors in ``tests/vectors/routing_vectors.json`` pin the behaviour.
"""

from __future__ import annotations

import re

from pyspark.sql import Column
from pyspark.sql import functions as F

from queue_manager.domain.routing import (
    DRAW_WORD_HEX_DIGITS,
    KEYSPACE_HEX_DIGITS,
    check_shuffle_params,
    draw_offset,
    draw_width,
    group_bounds,
)
from queue_manager.errors import TopologyError

_BOUND_RE = re.compile(r"^(?:[0-9a-f]{16})?$")


def tenant_md5(tenant: Column) -> Column:
    """The 32 lowercase hex digits of md5 over the tenant's UTF-8 bytes."""
    return F.md5(tenant.cast("binary"))


def tenant_sha256(tenant: Column) -> Column:
    """The 64 lowercase hex digits of sha256 over the tenant's UTF-8 bytes (the draws' hash)."""
    return F.sha2(tenant.cast("binary"), 256)


def _keyspace_hex_of(h: Column) -> Column:
    return h.substr(1, KEYSPACE_HEX_DIGITS)


def keyspace_hex(tenant: Column) -> Column:
    """The tenant's keyspace id as 16 lowercase hex digits (the form key ranges compare against)."""
    return _keyspace_hex_of(tenant_md5(tenant))


def keyspace_id(tenant: Column) -> Column:
    """The tenant's unsigned 64-bit keyspace id as ``decimal(20,0)`` (it does not fit a signed bigint)."""
    return F.conv(keyspace_hex(tenant), 16, 10).cast("decimal(20,0)")


def _hex_to_int(digits: Column, width: int) -> Column:
    """``width`` hex digits as an integer: bigint up to 15 digits, decimal(20,0) for 16 (unsigned 64-bit)."""
    return F.conv(digits, 16, 10).cast("decimal(20,0)" if width >= KEYSPACE_HEX_DIGITS else "bigint")


def _draw(g: Column, k: int, j: int | Column) -> Column:
    """Group ``j``'s draw: ``w`` hex digits of ``g`` from 0-based digit ``draw_offset(k, j)``."""
    width = draw_width(k)
    if isinstance(j, int):
        return _hex_to_int(g.substr(draw_offset(k, j) + 1, width), width)
    per_word = DRAW_WORD_HEX_DIGITS // width
    word = _div(j, F.lit(per_word))
    start = F.lit(1) + word * F.lit(DRAW_WORD_HEX_DIGITS) + F.pmod(j, F.lit(per_word)) * F.lit(width)
    return _hex_to_int(g.substr(start, F.lit(width)), width)


def _div(a: Column, b: Column) -> Column:
    """Integral division (SQL ``a div b``), exact for the non-negative ints used here."""
    return F.call_function("div", a, b)


def shuffle_set(tenant: Column, n: int, k: int) -> Column:
    """The tenant's ``k`` partitions of ``n`` as an ascending ``array<int>`` (one per group).

    Group ``j`` is ``[j*n div k, (j+1)*n div k)`` and its pick is ``lo + draw_j mod size``.
    Raises ConfigurationError for an invalid shape.
    """
    check_shuffle_params(n, k)
    g = tenant_sha256(tenant)
    picks = []
    for j in range(k):
        lo, hi = group_bounds(n, k, j)
        pick = F.lit(lo) + F.pmod(_draw(g, k, j), F.lit(hi - lo))
        picks.append(pick.cast("int"))
    return F.array(*picks)


def in_shuffle_set(tenant: Column, partition: Column, n: int, k: int) -> Column:
    """Whether ``partition`` is in the tenant's shuffle set, by the closed formula the database checks.

    ``p`` lies in group ``j = ((p+1)*k - 1) div n`` and belongs to the set iff it equals that
    group's pick. False for a partition outside ``[0, n)``; NULL for a NULL tenant or partition.
    Raises ConfigurationError for an invalid shape.
    """
    check_shuffle_params(n, k)
    p = partition.cast("bigint")
    g = tenant_sha256(tenant)
    j = _div((p + F.lit(1)) * F.lit(k) - F.lit(1), F.lit(n))
    lo = _div(j * F.lit(n), F.lit(k))
    hi = _div((j + F.lit(1)) * F.lit(n), F.lit(k))
    pick = lo + F.pmod(_draw(g, k, j), hi - lo)
    in_range = (p >= F.lit(0)) & (p < F.lit(n))
    # ``when`` keeps out-of-range partitions away from the draw (a negative j would read bad digits)
    return F.when(in_range, p == pick).when(p.isNotNull(), F.lit(False))


def in_key_range(tenant: Column, start: str, end: str) -> Column:
    """Whether the tenant's keyspace id lies in ``[start, end)``.

    ``start`` and ``end`` are normalised bounds as in
    :class:`queue_manager.domain.topology.KeyRange`: 16 lowercase hex digits, or ``''`` for an
    open end. The comparison is on the hex strings (byte order). Raises TopologyError for a
    malformed bound.
    """
    return keyspace_hex_in_range(keyspace_hex(tenant), start, end)


def keyspace_hex_in_range(kid: Column, start: str, end: str) -> Column:
    """:func:`in_key_range` for a keyspace id already computed (:func:`keyspace_hex`): a job that
    tests several ranges hashes each tenant once."""
    for what, bound in (("start", start), ("end", end)):
        if not _BOUND_RE.match(bound):
            raise TopologyError(
                f"{what} bound {bound!r} must be 16 lowercase hex digits or '' (use KeyRange.parse to normalise)"
            )
    cond = kid.isNotNull()
    if start:
        cond = kid >= F.lit(start)
    if end:
        below = kid < F.lit(end)
        cond = (cond & below) if start else below
    return cond
