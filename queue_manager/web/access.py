"""Who may use the dashboard: tokens with a read-only or an admin scope, and signed session cookies.

The tokens live in the managers' token file, in tables of their own (the managers read only the
``[[token]]`` tables, so they ignore these)::

    [[web_token]]
    name = "ops-alice"                    # recorded in the audit table, never the secret
    secret = "at-least-16-characters"     # or: secret_sha256 = "<hex digest of the secret>"
    scope = "admin"                       # "read": every page, no action; "admin": actions too

A person logs in with a secret once and gets a session cookie signed with the server's secret
(itsdangerous), holding the token's name, a digest prefix (so a token removed from the file ends
its sessions at the next restart) and the session's CSRF token. Scripts may send
``Authorization: Bearer <secret>`` instead.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from itsdangerous import BadSignature, URLSafeTimedSerializer

from queue_manager.errors import ConfigurationError
from queue_manager.manager.auth import bearer_secret, find_by_secret, read_token_tables, token_identity

Scope = Literal["read", "admin"]
SCOPES: tuple[Scope, ...] = ("read", "admin")
#: a session lasts this long after login, seconds
SESSION_MAX_AGE = 12 * 3600


@dataclass(frozen=True)
class WebUser:
    """Who a request comes from."""

    name: str
    scope: Scope
    #: the session's CSRF token; None for a bearer request (no ambient credential to forge)
    csrf: str | None = None

    @property
    def admin(self) -> bool:
        return self.scope == "admin"


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


class WebTokens:
    """The dashboard's tokens, looked up by secret (SHA-256 digests compared in constant time)."""

    def __init__(self, tokens: Mapping[str, tuple[str, Scope]]) -> None:
        #: digest -> (name, scope)
        self._by_digest = dict(tokens)

    @classmethod
    def from_entries(cls, entries: Iterable[Any]) -> WebTokens:
        tokens: dict[str, tuple[str, Scope]] = {}
        names: set[str] = set()
        for i, entry in enumerate(entries):
            name, where, digest = token_identity(entry, i, "web_token", names, {"scope"})
            scope = entry.get("scope")
            if scope not in SCOPES:
                raise ConfigurationError(f'{where}: \'scope\' must be "read" or "admin", got {scope!r}')
            if digest in tokens:
                raise ConfigurationError(f"{where}: the same secret is used by web_token {tokens[digest][0]!r}")
            tokens[digest] = (name, scope)
        if not tokens:
            raise ConfigurationError(
                'the token file defines no [[web_token]]; nobody could log in (docs/dashboard.md, "Access")'
            )
        return cls(tokens)

    @classmethod
    def load(cls, path: str | Path) -> WebTokens:
        return cls.from_entries(read_token_tables(path, "web_token"))

    def lookup(self, secret: str) -> WebUser | None:
        found = find_by_secret(self._by_digest, secret)
        return None if found is None else WebUser(*found)

    def _by_name(self, name: str, digest_prefix: str) -> WebUser | None:
        for known, (n, scope) in self._by_digest.items():
            if n == name and hmac.compare_digest(known[:16], digest_prefix):
                return WebUser(n, scope)
        return None

    def from_authorization(self, header: str | None) -> WebUser | None:
        """The user of an ``Authorization: Bearer <secret>`` header value, or None."""
        secret = bearer_secret(header)
        return None if secret is None else self.lookup(secret)

    def digest_prefix(self, secret: str) -> str:
        return _digest(secret)[:16]


class Sessions:
    """Signed, timed session cookies (the signing secret is the server's; random per process when
    not given, so a restart logs everyone out)."""

    def __init__(self, tokens: WebTokens, secret: str | None = None, max_age: int = SESSION_MAX_AGE) -> None:
        self.tokens = tokens
        self.max_age = max_age
        self._signer = URLSafeTimedSerializer(secret or secrets.token_urlsafe(32), salt="qm-web-session")

    def issue(self, secret: str) -> tuple[str, WebUser] | None:
        """The cookie value for a login with ``secret``, or None when no token has that secret."""
        user = self.tokens.lookup(secret)
        if user is None:
            return None
        csrf = secrets.token_urlsafe(24)
        value = self._signer.dumps({"n": user.name, "d": self.tokens.digest_prefix(secret), "c": csrf})
        return value, WebUser(user.name, user.scope, csrf)

    def read(self, cookie: str | None) -> WebUser | None:
        """The user of a session cookie, or None when it is absent, forged, expired or its token gone."""
        if not cookie:
            return None
        try:
            data = self._signer.loads(cookie, max_age=self.max_age)
        except BadSignature:
            return None
        if not isinstance(data, dict) or not all(isinstance(data.get(k), str) for k in ("n", "d", "c")):
            return None
        user = self.tokens._by_name(data["n"], data["d"])
        return None if user is None else WebUser(user.name, user.scope, data["c"])
