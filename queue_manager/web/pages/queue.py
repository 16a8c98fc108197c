"""A queue's page (``/queues/{queue}``): its shards live (pushed as they change), the charts of
the last hour, exact counts on demand, the top tenants, the tenant overrides, every setting, its
recent actions; and its actions (admin scope): pause, resume, limits, settings, tenant overrides,
each an operator action of ``queue_manager.admin``, after which the page tells what it did."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from queue_manager import admin
from queue_manager.domain.names import check_queue_name
from queue_manager.domain.settings import SETTINGS, TENANT_SETTINGS, Setting
from queue_manager.web import reads
from queue_manager.web.auth import Refused, require, route
from queue_manager.web.context import Web
from queue_manager.web.stream import stream

#: a form field left empty
_UNSET: Any = object()


def form_value(key: str, spec: Setting, raw: str) -> Any:
    """A form field as ``spec``'s type (the admin functions check the range): ``_UNSET`` when
    empty, None for "default"/"unlimited" in a field that may be null."""
    raw = raw.strip()
    if not raw:
        return _UNSET
    if spec.nullable and raw.lower() in ("default", "unlimited", "none", "null"):
        return None
    try:
        return spec.kind(raw)
    except ValueError:
        expected = "an integer" if spec.kind is int else "a number"
        raise Refused(400, f"{key}: {raw[:40]!r} is not {expected}") from None


async def queue_page(web: Web, request: Request) -> Response:
    user, _ = await require(web, request)
    queue = check_queue_name(request.path_params["queue"])
    snapshot = await run_in_threadpool(web.monitor.get)
    detail = await run_in_threadpool(reads.queue_detail, web.db, queue, web.limits, snapshot)
    exact = None
    if request.query_params.get("exact"):
        exact = await run_in_threadpool(reads.exact_counts, web.db, queue)
    done = None
    done_id = request.query_params.get("done")
    if done_id:  # the notice of an action just taken: told from its audit, never from the URL's text
        done = await run_in_threadpool(admin.find, web.db, done_id)
    return web.page(request, "queue.html", user, q=detail, exact=exact, done=done)


async def queue_stream(web: Web, request: Request) -> Response:
    user, _ = await require(web, request)
    queue = check_queue_name(request.path_params["queue"])
    return stream(web, request, user, "queue_live.html", queue=queue)


async def _act(
    web: Web, request: Request, take: Callable[[Web, str, FormData, str, uuid.UUID], Any]
) -> Response:
    """An action of the queue page: ``take(web, queue, form, actor, action_id)`` in a thread, then
    back to the page, which tells what it did."""
    user, form = await require(web, request, action=True)
    queue = check_queue_name(request.path_params["queue"])
    action_id = uuid.uuid4()
    await run_in_threadpool(take, web, queue, form, user.name, action_id)
    return web.done(request, queue, action_id)


def _pause(web: Web, queue: str, form: FormData, actor: str, action_id: uuid.UUID) -> None:
    admin.pause(web.db, queue, actor=actor, via="web", action_id=action_id)


def _resume(web: Web, queue: str, form: FormData, actor: str, action_id: uuid.UUID) -> None:
    admin.resume(web.db, queue, actor=actor, via="web", action_id=action_id)


def _limits(web: Web, queue: str, form: FormData, actor: str, action_id: uuid.UUID) -> None:
    settings: dict[str, Any] = {}
    for key, kind in (("max_qps", float), ("max_concurrency", int)):
        raw = str(form.get(key) or "").strip()
        if raw == "" or raw == "unlimited":
            settings[key] = None
            continue
        try:
            settings[key] = kind(raw)
        except ValueError:
            expected = "an integer" if kind is int else "a number"
            raise Refused(400, f"{key}: {raw[:40]!r} is not {expected}; leave it empty for no limit") from None
    admin.alter_queue(web.db, queue, settings, actor=actor, via="web", action="limits", action_id=action_id)


def _settings(web: Web, queue: str, form: FormData, actor: str, action_id: uuid.UUID) -> None:
    """Only the values that differ from the queue's current ones, on every shard."""
    current = admin.queue_row(web.db, queue)
    settings: dict[str, Any] = {}
    for key, spec in SETTINGS.items():
        if spec.flag is None or key not in form:
            continue
        value = form_value(key, spec, str(form.get(key) or ""))
        if value is _UNSET:
            if not spec.nullable:
                raise Refused(400, f"{key}: give a value ({spec.range_text()})")
            value = None
        if value != current.get(key):
            settings[key] = value
    if not settings:
        raise Refused(400, "nothing to change: every value is the queue's current one")
    admin.alter_queue(web.db, queue, settings, actor=actor, via="web", action="settings", action_id=action_id)


def _tenant(form: FormData) -> str:
    tenant = str(form.get("tenant") or "")
    if not tenant.strip():
        raise Refused(400, "tenant: give the tenant whose overrides to change")
    return tenant


def _tenant_set(web: Web, queue: str, form: FormData, actor: str, action_id: uuid.UUID) -> None:
    tenant = _tenant(form)
    settings: dict[str, Any] = {}
    for key, spec in TENANT_SETTINGS.items():
        value = form_value(key, spec, str(form.get(key) or ""))
        if value is not _UNSET:
            settings[key] = value
    if form.get("default_max_in_flight"):
        settings["max_in_flight"] = None
    if not settings:
        raise Refused(400, "nothing to change: give a weight and/or a max in flight (or tick the queue default)")
    admin.set_tenant(web.db, queue, tenant, settings, actor=actor, via="web", action_id=action_id)


def _tenant_unset(web: Web, queue: str, form: FormData, actor: str, action_id: uuid.UUID) -> None:
    admin.unset_tenant(web.db, queue, _tenant(form), actor=actor, via="web", action_id=action_id)


def _action(take: Callable[[Web, str, FormData, str, uuid.UUID], Any]) -> Callable[[Web, Request], Any]:
    async def handler(web: Web, request: Request) -> Response:
        return await _act(web, request, take)

    return handler


def routes(web: Web) -> list[Route]:
    return [
        route(web, "/queues/{queue}", queue_page),
        route(web, "/live/queues/{queue}", queue_stream),
        *(
            route(web, f"/queues/{{queue}}/{path}", _action(take), "POST")
            for path, take in (
                ("pause", _pause),
                ("resume", _resume),
                ("limits", _limits),
                ("settings", _settings),
                ("tenants", _tenant_set),
                ("tenants/unset", _tenant_unset),
            )
        ),
    ]
