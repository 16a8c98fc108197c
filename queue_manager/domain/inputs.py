"""What an operator's input must be before it reaches PostgreSQL: the rules a tenant, a dedup key,
a JSON value or an event id breaks when the database would refuse it.

Pure: each ``*_problem`` function returns None for a good value, else the rule it breaks in words
an operator can act on; the callers raise their own error with it (the dashboard's filters a
FilterError, the operator actions an InvalidInputError), so that a bad value is answered up front
with the rule, never by the database's refusal (which a page could mistake for a shard that did
not answer).
"""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

#: PostgreSQL's numeric (a jsonb number) holds at most this many digits before the decimal point...
NUMERIC_DIGITS_BEFORE = 131_072
#: ...and at most this many after it
NUMERIC_DIGITS_AFTER = 16_383
#: the largest event id (a bigint)
MAX_EVENT_ID = 2**63 - 1


def text_problem(value: str) -> str | None:
    """Why PostgreSQL's text cannot hold ``value`` (a NUL, or a lone UTF-16 surrogate, which is
    not UTF-8), or None."""
    if "\x00" in value:
        return "contains a NUL character (U+0000), which PostgreSQL text cannot hold"
    if any("\ud800" <= ch <= "\udfff" for ch in value):
        return "contains a lone surrogate (U+D800 to U+DFFF), which is not a character of UTF-8"
    return None


def number_problem(value: Decimal) -> str | None:
    """Why a JSON number is not a PostgreSQL numeric (not finite, or too many digits), or None."""
    if not value.is_finite():
        return f"{value} is not a finite number"
    exponent = value.as_tuple().exponent
    assert isinstance(exponent, int)
    if not value.is_zero() and value.adjusted() >= NUMERIC_DIGITS_BEFORE:
        return f"a number may have at most {NUMERIC_DIGITS_BEFORE} digits before the point (PostgreSQL's numeric)"
    if -exponent > NUMERIC_DIGITS_AFTER:
        return f"a number may have at most {NUMERIC_DIGITS_AFTER} digits after the point (PostgreSQL's numeric)"
    return None


def parse_json(text: str) -> Any:
    """``text`` as JSON with its numbers exact (``Decimal``), NaN and Infinity refused:
    ValueError when it is not JSON."""

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_float=Decimal, parse_int=Decimal, parse_constant=constant)


def json_problem(value: Any) -> str | None:
    """Why PostgreSQL's jsonb cannot hold ``value`` (as :func:`parse_json` returns it): a string or a
    key it cannot hold as text, or a number it cannot hold as numeric; None when it can."""
    if isinstance(value, str):
        problem = text_problem(value)
        return None if problem is None else f"a string {problem}"
    if isinstance(value, Decimal):
        return number_problem(value)
    if isinstance(value, list):
        return next((p for p in map(json_problem, value) if p is not None), None)
    if isinstance(value, dict):
        for key, item in value.items():
            problem = text_problem(key)
            if problem is not None:
                return f"a key {problem}"
            problem = json_problem(item)
            if problem is not None:
                return problem
    return None


def dump_json(value: Any) -> str:
    """The canonical JSON text of a value :func:`parse_json` returned (numbers as written)."""
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, list):
        return "[" + ",".join(dump_json(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{dump_json(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def event_id_problem(value: int) -> str | None:
    """Why ``value`` is not an event id (a positive bigint), or None."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_EVENT_ID:
        return f"{value!r} is not an event id (a whole number from 1 to {MAX_EVENT_ID})"
    return None
