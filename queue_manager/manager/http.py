"""The manager's plain HTTP answers on the websocket port: health, metrics, and the handshake's checks.

Checks before a websocket upgrade, in this order (docs/protocol.md): the path, the ``Origin``
allow-list (403), the bearer token (401), and whether this manager leads the shard right now
(503 with ``Retry-After``). Every answer carries exactly one ``Content-Type``.

``GET /health/leader?wait=S`` on a manager that does not lead is held until it leads (then 200, at
once) or for S seconds (then 503), at most MAX_HOLD: receivers learn of a takeover the moment the
new leader's session starts, with one request per manager every few seconds instead of a probe
every fraction of a second (docs/receivers.md, "Failover"). Without ``wait`` it answers at once.
"""

from __future__ import annotations

import asyncio
import http
import json
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

from websockets.asyncio.server import ServerConnection
from websockets.http11 import Request, Response

from queue_manager.manager.auth import TokenStore

TEXT = "text/plain; charset=utf-8"
JSON = "application/json"
PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"
#: the longest a /health/leader probe is held, seconds: websockets gives the whole opening
#: handshake open_timeout (10 s) to finish, process_request included
MAX_HOLD = 8.0
#: a held probe looks at the role again at least this often, seconds (besides the wake-ups)
RECHECK = 1.0
#: the roles a held probe waits in: a manager in one of them may lead next (a draining or stopped
#: one never will: it answers at once)
MAY_LEAD = frozenset({"starting", "standby", "degraded"})


def hold_seconds(path: str) -> float:
    """The ``wait`` of a ``/health/leader`` query, within 0 and MAX_HOLD (0 when absent or bad)."""
    _, _, query = path.partition("?")
    values = parse_qs(query).get("wait")
    if not values:
        return 0.0
    try:
        wait = float(values[0])
    except ValueError:
        return 0.0
    return min(MAX_HOLD, wait) if wait > 0 else 0.0  # NaN is not > 0


def respond(
    connection: ServerConnection, status: http.HTTPStatus, body: str, content_type: str = TEXT, **headers: str
) -> Response:
    """A plain HTTP response; ``Retry_After="1"`` becomes the header ``Retry-After: 1``."""
    response = connection.respond(status, body)
    # respond() sets a text/plain Content-Type of its own: replace it, never add a second one
    del response.headers["Content-Type"]
    response.headers["Content-Type"] = content_type
    for k, v in headers.items():
        response.headers[k.replace("_", "-")] = v
    return response


class HttpFront:
    """Answers the HTTP requests that are not websocket sessions, and vets the ones that are."""

    def __init__(
        self,
        tokens: TokenStore,
        allowed_origins: frozenset[str] | None,
        role: Callable[[], str],
        health: Callable[[], dict[str, Any]],
        metrics: Callable[[], str],
        role_change: Callable[[float], Awaitable[None]] | None = None,
    ) -> None:
        """``role_change(timeout)``: returns when this manager may have become the leader (or
        stops), or after ``timeout`` seconds (None: ``?wait`` is not held)."""
        self.tokens = tokens
        self.allowed_origins = allowed_origins
        self._role = role
        self._health = health
        self._metrics = metrics
        self._role_change = role_change

    def process_request(
        self, connection: ServerConnection, request: Request
    ) -> Response | Awaitable[Response | None] | None:
        path = request.path.split("?", 1)[0]
        if path == "/metrics":
            return respond(connection, http.HTTPStatus.OK, self._metrics(), PROMETHEUS)
        if path == "/health":
            return respond(connection, http.HTTPStatus.OK, json.dumps(self._health()), JSON)
        if path == "/health/leader":
            wait = hold_seconds(request.path)
            if wait > 0 and self._role_change is not None and self._role() in MAY_LEAD:
                return self._held_leader(connection, wait)
            return self._leader_answer(connection)
        if path not in ("/", "/v1"):
            return respond(connection, http.HTTPStatus.NOT_FOUND, "not found: use / (websocket), /metrics or /health\n")
        origin = request.headers.get("Origin")
        if self.allowed_origins is not None and origin is not None and origin not in self.allowed_origins:
            return respond(connection, http.HTTPStatus.FORBIDDEN, f"origin {origin!r} is not allowed\n")
        if self.tokens.from_authorization(request.headers.get("Authorization")) is None:
            return respond(
                connection,
                http.HTTPStatus.UNAUTHORIZED,
                "missing or unknown bearer token\n",
                WWW_Authenticate='Bearer realm="qm"',
            )
        role = self._role()
        if role != "leader":
            return respond(
                connection,
                http.HTTPStatus.SERVICE_UNAVAILABLE,
                f"this manager is {role}, not the shard's active manager; try another\n",
                Retry_After="1",
            )
        return None

    def _leader_answer(self, connection: ServerConnection) -> Response:
        health = self._health()
        status = http.HTTPStatus.OK if health["role"] == "leader" else http.HTTPStatus.SERVICE_UNAVAILABLE
        return respond(connection, status, json.dumps(health), JSON)

    async def _held_leader(self, connection: ServerConnection, wait: float) -> Response:
        """Answer /health/leader once this manager leads, or after ``wait`` seconds."""
        assert self._role_change is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while self._role() in MAY_LEAD:
            left = deadline - loop.time()
            if left <= 0:
                break
            await self._role_change(min(left, RECHECK))
        return self._leader_answer(connection)
