"""One event (``/queues/{queue}/events/{shard}/{id}``): every column, its timeline, its payload,
and the actions it may take (each through the events page's confirmation)."""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from queue_manager.domain.names import check_queue_name
from queue_manager.web import reads
from queue_manager.web.auth import Refused, require, route
from queue_manager.web.context import Web


async def event(web: Web, request: Request) -> Response:
    user, _ = await require(web, request)
    queue = check_queue_name(request.path_params["queue"])
    shard = request.path_params["shard"]
    if shard not in web.shard_names:
        raise Refused(404, f"no shard named {shard!r} (shards: {', '.join(web.shard_names)})")
    raw_id = request.path_params["id"]
    if not raw_id.isdigit() or len(raw_id) > 18:
        raise Refused(400, f"{raw_id[:40]!r} is not an event id (a positive whole number)")
    row = await run_in_threadpool(reads.event, web.db, queue, shard, int(raw_id))
    if row is None:
        raise Refused(404, f"no event {raw_id} in queue {queue!r} on shard {shard!r} (deleted by retention?)")
    return web.page(request, "event.html", user, queue=queue, shard=shard, e=row)


def routes(web: Web) -> list[Route]:
    return [route(web, "/queues/{queue}/events/{shard}/{id}", event)]
