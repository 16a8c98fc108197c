"""What every response of the dashboard carries, and the requests it refuses before any page sees
them: an ASGI wrapper around the whole application (its error pages and static files included).

- **Security headers** on every response: a Content-Security-Policy that allows only the
  dashboard's own scripts, styles and connections (no inline script or style: the pages have
  none), forms posted to itself, and no framing by any page (``frame-ancestors 'none'``, with
  ``X-Frame-Options: DENY`` for older browsers: a page of another site or port cannot frame the
  dashboard and its buttons); ``X-Content-Type-Options: nosniff``; ``Referrer-Policy: same-origin``.
- **Oversized requests** answered instead of dropped: a URL longer than :data:`MAX_URL_BYTES` gets
  HTTP 414, request headers larger than :data:`MAX_HEADER_BYTES` in all get 431 (``qm web``'s
  server reads requests of up to 4 MiB before it gives up on them, more than a browser sends).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

#: the longest URL (path and query string, bytes) a page is asked for; the event browser's longest
#: filter (a 1 000-character tenant and dedup key, a 500-character payload filter, percent-encoded) fits
MAX_URL_BYTES = 16 * 1024
#: the largest request headers (names and values, bytes, in all)
MAX_HEADER_BYTES = 32 * 1024

POLICY = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",
        "form-action 'self'",
        "frame-ancestors 'none'",
        "base-uri 'none'",
    )
)
HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"content-security-policy", POLICY.encode()),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
)
_NAMES = {name for name, _ in HEADERS}


class Guarded:
    """``app`` with the security headers on every response and oversized requests refused."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() not in _NAMES]
                message = {**message, "headers": [*headers, *HEADERS]}
            await send(message)

        too_big = _too_big(scope)
        if too_big is not None:
            status, text = too_big
            body = f"{text}\n".encode()
            headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", b"%d" % len(body))]
            await send_with_headers({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send_with_headers)


def _too_big(scope: Scope) -> tuple[int, str] | None:
    url = len(scope.get("raw_path") or scope.get("path", "").encode()) + len(scope.get("query_string", b""))
    if url > MAX_URL_BYTES:
        return 414, (
            f"URI too long: {url} bytes, at most {MAX_URL_BYTES}; narrow the filter (a tenant, a dedup key "
            "and a payload filter each have a length limit: docs/dashboard.md)"
        )
    headers = sum(len(name) + len(value) for name, value in scope.get("headers", []))
    if headers > MAX_HEADER_BYTES:
        return 431, f"request headers too large: {headers} bytes, at most {MAX_HEADER_BYTES} (a cookie grown too big?)"
    return None
