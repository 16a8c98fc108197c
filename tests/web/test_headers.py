"""What every response of the dashboard carries (a Content-Security-Policy without inline scripts,
no framing, no sniffing), and oversized requests answered with 414/431 instead of a reset, through
Starlette's test client and through the real server (uvicorn, raw sockets)."""

from __future__ import annotations

import socket
from collections.abc import Callable

import pytest
from starlette.testclient import TestClient

from queue_manager.domain.topology import Topology
from queue_manager.web.app import WebConfig
from queue_manager.web.headers import MAX_HEADER_BYTES, MAX_URL_BYTES
from tests.web.conftest import ADMIN, READ, login, serving, web_tokens

HTML = {"accept": "text/html"}


def assert_guarded(headers: object, what: str) -> None:
    h = {k.lower(): v for k, v in dict(headers).items()}  # type: ignore[call-overload]
    csp = h.get("content-security-policy", "")
    assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp, (what, csp)
    assert "unsafe-inline" not in csp, what
    assert h.get("x-frame-options") == "DENY", what
    assert h.get("x-content-type-options") == "nosniff", what


def test_every_response_carries_the_security_headers(app_for: Callable[..., TestClient], topology: Topology) -> None:
    client = app_for(stream_seconds=0)
    seen: set[int] = set()

    def check(method: str, path: str, **kw: object) -> None:
        r = client.request(method, path, **kw)  # type: ignore[arg-type]
        assert_guarded(r.headers, f"{method} {path} -> {r.status_code}")
        seen.add(r.status_code)

    check("GET", "/health")
    check("GET", "/login", headers=HTML)
    check("GET", "/", headers=HTML)  # 303 to the login page
    check("GET", "/queues/orders")  # 401
    check("POST", "/login", data={"token": "wrong-token-000000", "next": "/"})  # 401
    check("GET", "/static/style.css")
    check("GET", "/static/live.js")
    check("GET", "/static/nosuch.js")  # 404
    check("GET", "/nosuch")  # 404
    check("GET", "/queues/orders/pause")  # 405
    check("GET", "/queues/orders/events?" + "a" * (MAX_URL_BYTES + 1))  # 414
    check("GET", "/health", headers={"x-big": "a" * (MAX_HEADER_BYTES + 1)})  # 431
    csrf = login(client, READ)
    check("POST", "/login", data={"token": READ, "next": "/"})  # 303
    for path in ("/", "/partials/overview", "/queues/orders", "/queues/orders/events", "/database", "/audit"):
        check("GET", path, headers=HTML)
    check("GET", "/live/overview")  # a server-sent event stream
    check("GET", "/queues/orders/events?state=done", headers=HTML)  # 400
    check("GET", "/queues/orders/events/s0/999", headers=HTML)  # 404
    check("POST", "/queues/orders/pause", data={"csrf": csrf})  # 403: read-only
    login(client, ADMIN)
    check("POST", "/queues/orders/pause", data={"csrf": "stale"})  # 403: CSRF
    assert {200, 303, 400, 401, 403, 404, 405, 414, 431} <= seen, seen


def test_a_mounted_dashboard_carries_them_too(app_for: Callable[..., TestClient]) -> None:
    client = app_for(root_path="/qm")
    for path in ("/", "/qm/", "/qm/health", "/qm/static/style.css", "/elsewhere"):
        assert_guarded(client.get(path).headers, path)


def test_the_pages_have_no_inline_script_or_style(client: TestClient, topology: Topology) -> None:
    login(client, ADMIN)
    for path in ("/", "/queues/orders", "/queues/orders/events", "/database", "/audit", "/login"):
        page = client.get(path, headers=HTML).text
        assert "<script>" not in page and "<script type" not in page and " style=" not in page, path
        assert "javascript:" not in page and " onclick=" not in page, path
    assert "<script>" not in client.get("/queues/orders/events?state=done", headers=HTML).text


def _exchange(url: str, request: bytes) -> bytes:
    """Send ``request`` whole to the server at ``url`` and read its whole answer (a reset raises)."""
    host, port = url.split("//", 1)[1].split("/", 1)[0].split(":")
    with socket.create_connection((host, int(port)), timeout=20) as s:
        s.sendall(request)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


@pytest.mark.parametrize(
    ("request_", "status"),
    [
        (b"GET /queues/orders/events?tenant=" + b"a" * 1_000_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", b"414"),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n", b"431"),
        (b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: a\r\n" % i for i in range(5000)) + b"\r\n", b"431"),
    ],
    ids=["1 MB URL", "100 kB header", "5000 headers"],
)
def test_the_server_answers_a_huge_request_instead_of_resetting(
    topology: Topology, request_: bytes, status: bytes
) -> None:
    with serving(WebConfig(topology=topology, tokens=web_tokens())) as url:
        answer = _exchange(url, request_)
    head = answer.split(b"\r\n\r\n", 1)[0].decode()
    assert head.startswith(f"HTTP/1.1 {status.decode()} "), head
    assert_guarded(dict(line.split(": ", 1) for line in head.split("\r\n")[1:]), head)
