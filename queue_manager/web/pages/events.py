"""The event browser (``/queues/{queue}/events``): the filters, newest first across the shards the
filter can match on, keyset-paged (reads.events_page); and the bulk actions (admin scope) on the
ticked events or on all matching: a confirmation page that counts the matches and binds the newest
``bulk_cap`` of them (``admin.bind``), then the action on exactly those (``admin.run``)."""

from __future__ import annotations

from datetime import datetime
from urllib.parse import urlencode

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from queue_manager import admin
from queue_manager.domain.names import check_queue_name
from queue_manager.domain.settings import PRIORITY_LEVELS
from queue_manager.web import reads
from queue_manager.web.auth import Refused, require, route
from queue_manager.web.context import Web
from queue_manager.web.filters import (
    EventFilter,
    format_cursor,
    format_ids,
    parse_cursor,
    parse_filter,
    parse_ids,
    parse_time,
)

#: the fields of a bulk form that are not the event filter
BULK_FIELDS = frozenset({"csrf", "sel", "do", "bound", "new_fire_at", "new_priority"})
Selection = dict[str, list[int]]


async def events(web: Web, request: Request) -> Response:
    user, _ = await require(web, request)
    queue = check_queue_name(request.path_params["queue"])
    flt = parse_filter(request.query_params, web.shard_names)
    cursor = parse_cursor(request.query_params.get("cursor"), web.shard_names)
    result = await run_in_threadpool(reads.events_page, web.db, queue, flt, cursor, web.limits)
    next_query = urlencode({**flt.query(), "cursor": format_cursor(result.cursor)}) if result.more else None
    return web.page(
        request,
        "events.html",
        user,
        queue=queue,
        flt=flt,
        form=flt.query(),
        result=result,
        next_query=next_query,
        first_query=urlencode(flt.query()),
        limits=web.limits,
    )


def _selection(web: Web, form: FormData) -> Selection | None:
    picked = [str(v) for v in form.getlist("sel")]
    if not picked:
        return None
    out: Selection = {}
    for item in picked:
        name, _, raw = item.partition(":")
        if name not in web.shard_names or not raw.isdigit() or len(raw) > 18:
            raise Refused(400, f"selection: {item[:40]!r} is not shard:id")
        out.setdefault(name, []).append(int(raw))
    if sum(len(v) for v in out.values()) > web.limits.bulk_cap:
        raise Refused(400, f"selection: more than {web.limits.bulk_cap} events; use a filter and 'all matching'")
    return out


def _new_priority(form: FormData) -> int | None:
    """A reschedule's new priority (None: kept)."""
    raw = str(form.get("new_priority") or "").strip()
    if not raw:
        return None
    if not raw.isdigit() or not 1 <= int(raw) <= PRIORITY_LEVELS:
        raise Refused(400, f"reschedule: the new priority must be 1 (highest) to {PRIORITY_LEVELS}, got {raw[:20]!r}")
    return int(raw)


def _bulk_request(
    web: Web, form: FormData, confirming: bool = False
) -> tuple[admin.EventAction, EventFilter, Selection | None, datetime | None]:
    """The action, the filter (none for a selection), the selection (none when confirming: the
    confirmation's bound events are the selection then) and the new fire_at of a bulk form (its
    new priority: :func:`_new_priority`)."""
    do = str(form.get("do") or "")
    name, _, scope = do.partition("/")
    action = admin.ACTIONS.get(name)
    if action is None or scope not in ("selection", "all"):
        raise Refused(400, f"unknown bulk action {do[:40]!r}; use one of the event browser's buttons")
    fire_at = None
    if action.name == "reschedule":
        raw = str(form.get("new_fire_at") or "").strip()
        if not raw and _new_priority(form) is None:
            raise Refused(
                400, "reschedule: give the new fire_at (ISO 8601, e.g. 2026-11-28T09:00:00Z) and/or the new priority"
            )
        fire_at = parse_time("new fire_at", raw) if raw else None
    if scope == "all":
        fields = {k: str(v) for k, v in form.items() if k not in BULK_FIELDS}
        return action, parse_filter(fields, web.shard_names), None, fire_at
    selection = None if confirming else _selection(web, form)
    if selection is None and not confirming:
        raise Refused(400, "nothing selected: tick some events, or choose 'all matching the filter'")
    return action, EventFilter(), selection, fire_at


async def bulk_preview(web: Web, request: Request) -> Response:
    """The confirmation: how many events match now, truthfully, and the ones it binds the action to."""
    user, form = await require(web, request, action=True)
    queue = check_queue_name(request.path_params["queue"])
    action, flt, selection, fire_at = _bulk_request(web, form)
    priority = _new_priority(form) if action.name == "reschedule" else None
    limits = web.limits
    binding = await run_in_threadpool(
        lambda: admin.bind(
            web.db,
            queue,
            action,
            flt,
            selection,
            cap=limits.bulk_cap,
            count_cap=limits.bulk_count_cap,
            fire_at=fire_at,
            priority=priority,
        )
    )
    return web.page(
        request,
        "confirm.html",
        user,
        queue=queue,
        action=action,
        do=str(form.get("do")),
        new_fire_at=fire_at.isoformat() if fire_at else "",
        new_priority=priority,
        binding=binding,
        bound=format_ids(binding.ids),
        fields=flt.query(),
        cap=limits.bulk_cap,
        what=(flt.describe() if selection is None else f"{sum(map(len, selection.values()))} selected events"),
    )


async def bulk_run(web: Web, request: Request) -> Response:
    """The confirmed action, on the events the confirmation bound (those still in its state)."""
    user, form = await require(web, request, action=True)
    queue = check_queue_name(request.path_params["queue"])
    action, flt, _, fire_at = _bulk_request(web, form, confirming=True)
    priority = _new_priority(form) if action.name == "reschedule" else None
    raw = str(form.get("bound") or "")
    if not raw:
        raise Refused(400, "confirm the events shown on the confirmation page first")
    bound = parse_ids(raw, web.shard_names, web.limits.bulk_cap)
    selected = str(form.get("do") or "").endswith("/selection")
    what = f"{sum(map(len, bound.values()))} selected events" if selected else flt.describe()
    outcome = await run_in_threadpool(
        lambda: admin.run(
            web.db,
            queue,
            action,
            flt,
            bound,
            actor=user.name,
            via="web",
            description=what,
            fire_at=fire_at,
            priority=priority,
            slice_size=web.limits.bulk_slice,
        )
    )
    return web.done(request, queue, outcome.action_id)


def routes(web: Web) -> list[Route]:
    return [
        route(web, "/queues/{queue}/events", events),
        route(web, "/queues/{queue}/bulk", bulk_preview, "POST"),
        route(web, "/queues/{queue}/bulk/confirm", bulk_run, "POST"),
    ]
