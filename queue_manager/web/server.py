"""``qm web``: the dashboard served by uvicorn."""

from __future__ import annotations

import logging

import uvicorn

from queue_manager.web.app import WebConfig, create_app

logger = logging.getLogger(__name__)


def serve(config: WebConfig, host: str = "127.0.0.1", port: int = 8080) -> None:
    """Serve the dashboard until SIGINT/SIGTERM."""
    app = create_app(config)
    shown = host if ":" not in host else f"[{host}]"
    print(f"dashboard: http://{shown}:{port}{config.root_path}/   (health: {config.root_path}/health)", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", proxy_headers=False, server_header=False)
