"""The schedules page (``/schedules``): every shard's periodic schedules with their next runs and
their last slot's event (``admin.schedules``); with an admin token, pause and resume each one.
Changes go through the operator-action API like every action of the dashboard, audited."""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from queue_manager.admin import schedules
from queue_manager.domain.names import check_queue_name
from queue_manager.web.auth import Refused, require, route
from queue_manager.web.context import Web, base


async def schedules_page(web: Web, request: Request) -> Response:
    user, _ = await require(web, request)
    raw = request.query_params.get("queue") or None
    queue = None if raw is None else check_queue_name(raw)
    found = await run_in_threadpool(schedules.list_schedules, web.db, queue, 500)
    changed = request.query_params.get("changed")
    return web.page(request, "schedules.html", user, schedules=found, queue=queue, changed=changed)


async def change(web: Web, request: Request) -> Response:
    """Pause or resume one schedule, then back to the page, which names it."""
    user, form = await require(web, request, action=True)
    name = str(form.get("name") or "")
    what = request.path_params["what"]
    if what not in ("pause", "resume"):
        raise Refused(404, f"no schedule action {what[:20]!r}: pause or resume")
    take = schedules.pause if what == "pause" else schedules.resume
    await run_in_threadpool(lambda: take(web.db, name, actor=user.name, via="web"))
    return RedirectResponse(f"{base(request)}/schedules?changed={what}d", status_code=303)


def routes(web: Web) -> list[Route]:
    return [route(web, "/schedules", schedules_page), route(web, "/schedules/{what}", change, "POST")]
