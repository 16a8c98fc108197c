"""Receiver credentials: bearer tokens, each scoped to queues and optionally to tenants.

The token file is TOML::

    [[token]]
    name = "billing-workers"          # shows up in logs and metrics, never the secret
    secret = "s3cr3t-at-least-16-chars"   # or: secret_sha256 = "<hex digest of the secret>"
    queues = ["orders", "invoices"]   # or ["*"] for every queue of the shard
    tenants = ["acme", "globex"]      # optional; omitted = every tenant

Clients send ``Authorization: Bearer <secret>`` with the websocket upgrade request. The manager
checks it before the upgrade completes: no token or an unknown one gets HTTP 401, a token used
from a forbidden ``Origin`` gets HTTP 403.
"""

from __future__ import annotations

import hashlib
import hmac
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from queue_manager.domain.names import check_queue_name
from queue_manager.errors import ConfigurationError, InvalidNameError

MIN_SECRET_LENGTH = 16

T = TypeVar("T")


@dataclass(frozen=True)
class Grant:
    """What one token may do: subscribe to ``queues`` (None = all), for ``tenants`` (None = all)."""

    name: str
    queues: frozenset[str] | None
    tenants: frozenset[str] | None

    def allows_queue(self, queue: str) -> bool:
        return self.queues is None or queue in self.queues

    def allowed_tenants(self, requested: Iterable[str] | None) -> frozenset[str] | None:
        """The tenant filter of a subscription: the requested tenants within the grant.

        Raises PermissionError naming the tenants the grant does not cover.
        """
        if requested is None:
            return self.tenants
        wanted = frozenset(requested)
        if self.tenants is not None:
            outside = wanted - self.tenants
            if outside:
                raise PermissionError(f"token {self.name!r} does not cover tenants {sorted(outside)!r}")
        return wanted


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def read_token_tables(path: str | Path, table: str) -> list[Any]:
    """The ``[[table]]`` entries of a token file (``token`` for the receivers, ``web_token`` for the
    dashboard: one file serves both, each reader ignores the other's tables)."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigurationError(f"token file {str(p)!r} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigurationError(f"token file {str(p)!r} is not valid TOML: {exc}") from None
    entries = data.get(table, [])
    if not isinstance(entries, list):
        raise ConfigurationError(f"token file {str(p)!r}: use [[{table}]] tables")
    return entries


def token_identity(entry: Any, i: int, table: str, names: set[str], keys: set[str]) -> tuple[str, str, str]:
    """Check what every token table has: a unique ``name``, no key outside ``keys``, and exactly one
    of ``secret`` (at least MIN_SECRET_LENGTH characters) and ``secret_sha256``. Returns (name,
    where, digest): ``where`` names the entry in the messages of the caller's own checks; ``names``
    gains the name. ``i``: the entry's position, for the message when it has no name."""
    where = f"{table} #{i + 1}"
    if not isinstance(entry, Mapping):
        raise ConfigurationError(f"{where}: must be a table ([[{table}]]), got {type(entry).__name__}")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"{where}: 'name' must be a non-empty string")
    where = f"{table} {name!r}"
    if name in names:
        raise ConfigurationError(f"{where}: the name is used twice")
    names.add(name)
    secret = entry.get("secret")
    digest = entry.get("secret_sha256")
    if (secret is None) == (digest is None):
        raise ConfigurationError(f"{where}: give exactly one of 'secret' or 'secret_sha256'")
    if secret is not None:
        if not isinstance(secret, str) or len(secret) < MIN_SECRET_LENGTH:
            raise ConfigurationError(f"{where}: 'secret' must be a string of at least {MIN_SECRET_LENGTH} characters")
        digest = _digest(secret)
    elif not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise ConfigurationError(f"{where}: 'secret_sha256' must be 64 lowercase hex digits")
    unknown = set(entry) - keys - {"name", "secret", "secret_sha256"}
    if unknown:
        raise ConfigurationError(f"{where}: unknown keys {sorted(unknown)!r}")
    return name, where, digest


def bearer_secret(header: str | None) -> str | None:
    """The secret of an ``Authorization: Bearer <secret>`` header value, or None."""
    if not header:
        return None
    scheme, _, secret = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        return None
    return secret.strip()


def find_by_secret(by_digest: Mapping[str, T], secret: str) -> T | None:
    """The value whose key is the secret's SHA-256 digest, compared in constant time with each."""
    digest = _digest(secret)
    found = None
    for known, value in by_digest.items():
        if hmac.compare_digest(known, digest):
            found = value
    return found


class TokenStore:
    """Look up grants by secret; compares SHA-256 digests in constant time."""

    def __init__(self, grants: Mapping[str, Grant]) -> None:
        #: sha256 hex digest of the secret -> grant
        self._by_digest = dict(grants)

    @classmethod
    def from_entries(cls, entries: Iterable[Mapping[str, Any]]) -> TokenStore:
        grants: dict[str, Grant] = {}
        names: set[str] = set()
        for i, entry in enumerate(entries):
            name, where, digest = token_identity(entry, i, "token", names, {"queues", "tenants"})
            queues = entry.get("queues")
            if not isinstance(queues, list) or not queues or not all(isinstance(q, str) for q in queues):
                raise ConfigurationError(f"{where}: 'queues' must be a non-empty list of queue names (or [\"*\"])")
            if "*" in queues:
                queue_set = None
            else:
                for q in queues:
                    try:
                        check_queue_name(q)
                    except InvalidNameError as exc:
                        raise ConfigurationError(f"{where}: {exc}") from None
                queue_set = frozenset(queues)
            tenants = entry.get("tenants")
            if tenants is not None and (
                not isinstance(tenants, list) or not tenants or not all(isinstance(t, str) and t for t in tenants)
            ):
                raise ConfigurationError(f"{where}: 'tenants' must be a non-empty list of tenant names, or be left out")
            if digest in grants:
                raise ConfigurationError(f"{where}: the same secret is used by token {grants[digest].name!r}")
            grants[digest] = Grant(name, queue_set, None if tenants is None else frozenset(tenants))
        if not grants:
            raise ConfigurationError("the token file defines no [[token]]; receivers could never connect")
        return cls(grants)

    @classmethod
    def load(cls, path: str | Path) -> TokenStore:
        return cls.from_entries(read_token_tables(path, "token"))

    def lookup(self, secret: str) -> Grant | None:
        return find_by_secret(self._by_digest, secret)

    def from_authorization(self, header: str | None) -> Grant | None:
        """The grant of an ``Authorization: Bearer <secret>`` header value, or None."""
        secret = bearer_secret(header)
        return None if secret is None else self.lookup(secret)
