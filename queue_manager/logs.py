"""Log lines that keep their structured fields.

Code logs with ``logger.warning("stepping down", extra={"action": "step_down", "term": 7, ...})``.
The standard formatter drops ``extra``; :class:`ExtraFormatter` appends each field as
``key=value`` (``action`` first, then the rest by name), so ``term``, ``reason`` and ``action``
reach the output and can be grepped or parsed.
"""

from __future__ import annotations

import json
import logging
from typing import Any

#: attributes every LogRecord has: anything else came from ``extra``
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}
FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
#: libraries that log a line per request or per connection at INFO (websockets: every HTTP probe
#: of /health/leader, every handshake): at INFO they are kept to their warnings, at DEBUG they speak
CHATTY = ("websockets", "uvicorn.access", "httpx")


def _value(v: Any) -> str:
    if isinstance(v, str) and v and not any(c.isspace() or c in '"=' for c in v):
        return v
    try:
        return json.dumps(v, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return json.dumps(repr(v))


class ExtraFormatter(logging.Formatter):
    """The standard line, then the record's ``extra`` fields as ``key=value``."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = {k: v for k, v in vars(record).items() if k not in _STANDARD}
        if not extras:
            return line
        keys = sorted(extras, key=lambda k: (k != "action", k))
        return line + " " + " ".join(f"{k}={_value(extras[k])}" for k in keys)


def configure(level: int) -> None:
    """Log to stderr at ``level`` with :class:`ExtraFormatter` (the ``qm`` command's set-up); the
    :data:`CHATTY` libraries at WARNING unless ``level`` is DEBUG."""
    handler = logging.StreamHandler()
    handler.setFormatter(ExtraFormatter(FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in CHATTY:
        logging.getLogger(name).setLevel(logging.NOTSET if level <= logging.DEBUG else max(level, logging.WARNING))
