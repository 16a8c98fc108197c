"""The database health page (``/database``: each shard's health, maintenance slices, Spark runs
and prepared transactions, from a reading shared by every tab) and ``/health`` (JSON, no login:
each shard reachable or why not; 503 when one is not)."""

from __future__ import annotations

from functools import partial

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from queue_manager.web.auth import require, route
from queue_manager.web.context import Web
from queue_manager.web.shards import ping


async def database(web: Web, request: Request) -> Response:
    user, _ = await require(web, request)
    snapshot = await run_in_threadpool(web.health.get)
    return web.page(request, "database.html", user, snap=snapshot)


async def health(web: Web, request: Request) -> Response:
    shards = await run_in_threadpool(ping, web.db)
    ok = all(v is None for v in shards.values())
    body = {"status": "ok" if ok else "degraded", "shards": {k: v or "ok" for k, v in shards.items()}}
    return JSONResponse(body, status_code=200 if ok else 503)


def routes(web: Web) -> list[Route]:
    return [route(web, "/database", database), Route("/health", partial(health, web), methods=["GET"])]
