"""``qm web``: the dashboard served by uvicorn."""

from __future__ import annotations

import logging
from typing import Any

import uvicorn

from queue_manager.web.app import WebConfig, create_app

logger = logging.getLogger(__name__)

#: the most of a request uvicorn reads before it gives up on it (a browser sends URLs of up to 2 MB):
#: anything smaller reaches the application, which answers an oversized URL with 414 and oversized
#: headers with 431 (headers.py) instead of the connection being dropped
MAX_REQUEST_HEAD_BYTES = 4 * 1024 * 1024


def uvicorn_config(app: Any, host: str = "127.0.0.1", port: int = 8080, **options: Any) -> uvicorn.Config:
    """How ``qm web`` serves ``app`` (the tests serve it the same way)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        proxy_headers=False,
        server_header=False,
        http="h11",
        h11_max_incomplete_event_size=MAX_REQUEST_HEAD_BYTES,
        **options,
    )


def serve(config: WebConfig, host: str = "127.0.0.1", port: int = 8080) -> None:
    """Serve the dashboard until SIGINT/SIGTERM."""
    app = create_app(config)
    shown = host if ":" not in host else f"[{host}]"
    print(f"dashboard: http://{shown}:{port}{config.root_path}/   (health: {config.root_path}/health)", flush=True)
    uvicorn.Server(uvicorn_config(app, host, port)).run()
