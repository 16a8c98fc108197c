"""The overview (``/``): every queue on every shard, live (the monitor's reading, pushed as it
changes), the shards' leaders, the managers and their receivers, the health warnings."""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from queue_manager.web.auth import require, route
from queue_manager.web.context import Web
from queue_manager.web.stream import stream


async def overview(web: Web, request: Request) -> Response:
    user, _ = await require(web, request)
    snapshot = await run_in_threadpool(web.monitor.get)
    health = await run_in_threadpool(web.health.get)
    return web.page(request, "overview.html", user, snap=snapshot, health=health)


async def overview_live(web: Web, request: Request) -> Response:
    """The overview's live part alone (for scripts)."""
    user, _ = await require(web, request)
    snapshot = await run_in_threadpool(web.monitor.get)
    return web.page(request, "overview_live.html", user, snap=snapshot)


async def overview_stream(web: Web, request: Request) -> Response:
    user, _ = await require(web, request)
    return stream(web, request, user, "overview_live.html")


def routes(web: Web) -> list[Route]:
    return [
        route(web, "/", overview),
        route(web, "/partials/overview", overview_live),
        route(web, "/live/overview", overview_stream),
    ]
