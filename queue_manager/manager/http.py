"""The manager's plain HTTP answers on the websocket port: health, metrics, and the handshake's checks.

Checks before a websocket upgrade, in this order (docs/protocol.md): the path, the ``Origin``
allow-list (403), the bearer token (401), and whether this manager leads the shard right now
(503 with ``Retry-After``). Every answer carries exactly one ``Content-Type``.
"""

from __future__ import annotations

import http
import json
from collections.abc import Callable
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.http11 import Request, Response

from queue_manager.manager.auth import TokenStore

TEXT = "text/plain; charset=utf-8"
JSON = "application/json"
PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"


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
    ) -> None:
        self.tokens = tokens
        self.allowed_origins = allowed_origins
        self._role = role
        self._health = health
        self._metrics = metrics

    def process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        path = request.path.split("?", 1)[0]
        if path == "/metrics":
            return respond(connection, http.HTTPStatus.OK, self._metrics(), PROMETHEUS)
        if path == "/health":
            return respond(connection, http.HTTPStatus.OK, json.dumps(self._health()), JSON)
        if path == "/health/leader":
            health = self._health()
            status = http.HTTPStatus.OK if health["role"] == "leader" else http.HTTPStatus.SERVICE_UNAVAILABLE
            return respond(connection, status, json.dumps(health), JSON)
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
