"""Fixtures of the dashboard's tests: two shards with a queue, tokens of both scopes, a client."""

from __future__ import annotations

import contextlib
import http.server
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

pytest.importorskip("starlette", reason="the web extra is not installed: run `make setup`")

from starlette.testclient import TestClient

from queue_manager.domain.topology import Topology
from queue_manager.web.access import WebTokens
from queue_manager.web.app import WebConfig, create_app

ADMIN = "admin-secret-0000001"
READ = "read-secret-00000001"


def web_tokens() -> WebTokens:
    return WebTokens.from_entries(
        [
            {"name": "alice", "secret": ADMIN, "scope": "admin"},
            {"name": "bob", "secret": READ, "scope": "read"},
        ]
    )


@contextlib.contextmanager
def static_page(html: str) -> Iterator[str]:
    """An HTTP server on another port of this host (another origin, the same site) that answers
    every GET with the page ``html``: its URL."""

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = html.encode()
            self.send_response(200)
            self.send_header("content-type", "text/html; charset=utf-8")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    finally:
        httpd.shutdown()
        thread.join(10)
        httpd.server_close()


def csrf_of(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found, "no CSRF field on the page"
    return found.group(1)


@pytest.fixture
def topology(shards: Topology, make_queue: Callable[..., str]) -> Topology:
    make_queue("orders", partitions=4, shuffle=2, max_attempts=2)
    return shards


@pytest.fixture
def app_for(topology: Topology) -> Iterator[Callable[..., TestClient]]:
    clients: list[TestClient] = []

    def make(**overrides: object) -> TestClient:
        config = WebConfig(topology=topology, tokens=web_tokens(), session_secret="test-session-secret", **overrides)  # type: ignore[arg-type]
        client = TestClient(create_app(config), follow_redirects=False)
        clients.append(client)
        return client

    yield make
    for c in clients:
        c.close()
        c.app.state.close()  # type: ignore[attr-defined]  # the monitor's threads and the pools


@pytest.fixture
def client(app_for: Callable[..., TestClient]) -> TestClient:
    return app_for()


def login(client: TestClient, secret: str, base: str = "") -> str:
    """Log in; returns the session's CSRF token."""
    r = client.post(f"{base}/login", data={"token": secret, "next": f"{base}/"})
    assert r.status_code == 303, r.text
    page = client.get(f"{base}/", headers={"accept": "text/html"})
    assert page.status_code == 200, page.text
    return csrf_of(page.text)


@contextlib.contextmanager
def serving(config: WebConfig) -> Iterator[str]:
    """The dashboard of ``config`` served by uvicorn in a thread, as ``qm web`` serves it; its URL."""
    import uvicorn

    from queue_manager.web.server import uvicorn_config

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(config)
    srv = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, lifespan="off", ws="none"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline, "the dashboard did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}{config.root_path}"
    finally:
        srv.should_exit = True
        thread.join(20)
        app.state.close()
