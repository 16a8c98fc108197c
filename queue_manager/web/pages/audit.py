"""The audit page (``/audit``): the operator actions, newest first, one line per action with its
counts per shard (``admin.recent``)."""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from queue_manager import admin
from queue_manager.web.auth import require, route
from queue_manager.web.context import Web


async def audit(web: Web, request: Request) -> Response:
    user, _ = await require(web, request)
    actions = await run_in_threadpool(admin.recent, web.db, 100)
    return web.page(request, "audit.html", user, actions=actions)


def routes(web: Web) -> list[Route]:
    return [route(web, "/audit", audit)]
