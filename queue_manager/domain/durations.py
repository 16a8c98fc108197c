"""Durations in the units people read: ``30 days``, ``5 min``, ``250 ms`` (not ``2.592e+06``).

:func:`format_duration` writes seconds in the largest unit that states them exactly (or, when
none does, to three significant digits); :func:`parse_duration` reads them back, and also a bare
number of seconds and the short forms ``30d``, ``12h``, ``90m``, ``250ms``.
"""

from __future__ import annotations

import math
import re

from queue_manager.errors import ConfigurationError

#: (seconds, singular, plural), largest first; a year is 365.25 days (so 10 years = 315 576 000 s)
_UNITS = (
    (31_557_600.0, "year", "years"),
    (86_400.0, "day", "days"),
    (3_600.0, "h", "h"),
    (60.0, "min", "min"),
    (1.0, "s", "s"),
    (0.001, "ms", "ms"),
)

_NAMES = {
    "ms": 0.001,
    "millisecond": 0.001,
    "milliseconds": 0.001,
    "": 1.0,
    "s": 1.0,
    "sec": 1.0,
    "second": 1.0,
    "seconds": 1.0,
    "m": 60.0,
    "min": 60.0,
    "minute": 60.0,
    "minutes": 60.0,
    "h": 3_600.0,
    "hour": 3_600.0,
    "hours": 3_600.0,
    "d": 86_400.0,
    "day": 86_400.0,
    "days": 86_400.0,
    "w": 604_800.0,
    "week": 604_800.0,
    "weeks": 604_800.0,
    "y": 31_557_600.0,
    "year": 31_557_600.0,
    "years": 31_557_600.0,
}
_DURATION = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*")


def _exact(value: float) -> bool:
    return math.isclose(value, round(value), rel_tol=1e-9, abs_tol=1e-9)


def format_duration(seconds: float) -> str:
    """``604800`` -> ``7 days``, ``300`` -> ``5 min``, ``0.25`` -> ``250 ms``, ``90`` -> ``90 s``,
    ``1.5`` -> ``1.5 s``."""
    if seconds == 0:
        return "0 s"
    if not math.isfinite(seconds):
        return str(seconds)
    size = abs(seconds)
    for unit, one, many in _UNITS:
        # exact, and not 1500 ms for 1.5 s (years have no larger unit to go to)
        if unit <= size and (size < 1000 * unit or unit == _UNITS[0][0]) and _exact(size / unit):
            n = round(seconds / unit)
            return f"{n} {one if abs(n) == 1 else many}"
    unit, _, many = next((u for u in _UNITS if size >= u[0]), _UNITS[-1])
    value = seconds / unit
    return f"{value:.3g} {many}" if abs(value) < 1000 else f"{value:.0f} {many}"


def parse_duration(text: str) -> float:
    """Seconds from ``30``, ``30s``, ``250ms``, ``5 min``, ``12h``, ``7 days``, ``2w`` or ``10 years``."""
    m = _DURATION.fullmatch(text.lower())
    if m is None or m[2] not in _NAMES:
        raise ConfigurationError(
            f"invalid duration {text!r}: a number of seconds, or a number and a unit: ms, s, min, h, d, w or years "
            "(e.g. 30, 250ms, 5min, 12h, 7d)"
        )
    return float(m[1]) * _NAMES[m[2]]
