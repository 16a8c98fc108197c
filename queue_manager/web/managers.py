"""What the managers themselves know, read from their ``/health`` (docs/manager.md): each one's
role (leader, standby...), term and its receiver connections with their credit.

The dashboard is told the managers' URLs (``qm web --manager SHARD=URL``, as ``qm receive``
is); a manager that cannot be reached, or answers something else than its health, is shown with
the reason, never an error of the page.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from queue_manager.errors import ConfigurationError

_SCHEMES = {"ws": "http", "wss": "https", "http": "http", "https": "https"}


def health_url(base: str) -> str:
    """The ``/health`` URL of the manager at ``base`` (``ws://host:port/``, wss, http or https)."""
    parts = urlsplit(base)
    scheme = _SCHEMES.get(parts.scheme)
    if scheme is None or not parts.hostname:
        raise ConfigurationError(f"manager URL {base!r}: use ws://host:port/ (or wss://, http://, https://)")
    return urlunsplit((scheme, parts.netloc, "/health", "", ""))


def parse_managers(entries: list[str], shard_names: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """``SHARD=URL`` entries (``qm web --manager``) by shard; a bare URL needs a one-shard topology."""
    out: dict[str, list[str]] = {}
    for entry in entries:
        name, sep, url = entry.partition("=")
        if not sep or "://" in name:
            if len(shard_names) != 1:
                raise ConfigurationError(f"--manager {entry!r}: name its shard, e.g. s0=ws://mgr-a:8765/")
            name, url = shard_names[0], entry
        if name not in shard_names:
            raise ConfigurationError(
                f"--manager {entry!r}: no shard named {name!r} in the topology (shards: {', '.join(shard_names)})"
            )
        health_url(url)
        out.setdefault(name, []).append(url)
    return {k: tuple(v) for k, v in out.items()}


def read_one(url: str, timeout: float) -> dict[str, Any]:
    """One manager's health: its ``/health`` JSON with ``url``, or ``url`` and ``error``."""
    try:
        with urllib.request.urlopen(health_url(url), timeout=timeout) as response:
            body = json.loads(response.read(1_000_000))
        if not isinstance(body, dict) or "role" not in body:
            return {"url": url, "error": "its /health did not answer a manager's health"}
        return {"url": url, **body}
    except json.JSONDecodeError:
        return {"url": url, "error": "its /health did not answer a manager's health (not JSON)"}
    except urllib.error.HTTPError as exc:
        return {"url": url, "error": f"HTTP {exc.code} from its /health"}
    except (OSError, ValueError) as exc:  # refused, timed out, unknown host, not JSON
        reason = getattr(exc, "reason", None) or exc
        return {"url": url, "error": f"unreachable: {reason}"}


def read_all(managers: dict[str, tuple[str, ...]], timeout: float = 1.0) -> dict[str, list[dict[str, Any]]]:
    """Every manager's health by shard, read in parallel (each within ``timeout`` seconds)."""
    urls = [(shard, url) for shard, many in managers.items() for url in many]
    if not urls:
        return {}
    with ThreadPoolExecutor(max_workers=min(8, len(urls)), thread_name_prefix="qm-web-managers") as pool:
        found = list(pool.map(lambda item: read_one(item[1], timeout), urls))
    out: dict[str, list[dict[str, Any]]] = {}
    for (shard, _), health in zip(urls, found, strict=True):
        out.setdefault(shard, []).append(health)
    return out
