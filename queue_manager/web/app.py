"""The dashboard as an ASGI application (Starlette, Jinja2 templates, server-sent events and one
small static script for the live parts; no JavaScript build).

``create_app(config)`` returns the application; ``qm web`` serves it with uvicorn, and any ASGI
server or a host application can mount it (``root_path`` puts every route under a sub-path).

Every page needs a login (a ``[[web_token]]`` secret, access.py) except ``/login``, ``/health``
and the static files. Every POST needs the same origin (``Sec-Fetch-Site``/``Origin``) and, for
a session, its CSRF token (form field ``csrf`` or header ``X-CSRF-Token``); actions need the admin
scope. Database work runs in the thread pool, each statement under the statement timeout.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import psycopg
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp

from queue_manager import admin
from queue_manager.domain.names import check_queue_name
from queue_manager.domain.settings import SETTINGS, TENANT_SETTINGS, Setting
from queue_manager.domain.topology import Topology
from queue_manager.errors import ConfigurationError, InvalidNameError, QueueManagerError, UnknownQueueError
from queue_manager.web import data, managers
from queue_manager.web.access import Sessions, WebTokens, WebUser
from queue_manager.web.filters import (
    STATES,
    EventFilter,
    FilterError,
    format_cursor,
    format_ids,
    parse_cursor,
    parse_filter,
    parse_ids,
    parse_time,
)
from queue_manager.web.headers import Guarded
from queue_manager.web.monitor import Monitor
from queue_manager.web.readings import History, bars, sparkline

logger = logging.getLogger(__name__)

COOKIE = "qm_session"
#: the fields of a bulk form that are not the event filter
BULK_FIELDS = frozenset({"csrf", "sel", "do", "bound", "new_fire_at"})
Selection = dict[str, list[int]]
HERE = Path(str(resources.files("queue_manager.web")))


@dataclass
class WebConfig:
    """What ``qm web`` serves."""

    #: the shards read (every one of them)
    topology: Topology
    #: who may log in
    tokens: WebTokens
    #: signs the session cookies; None: a random one per process (a restart logs everyone out)
    session_secret: str | None = None
    #: serve every route under this path ("/qm"), for a reverse proxy or a host application
    root_path: str = ""
    #: cost guards
    limits: data.Limits = field(default_factory=data.Limits)
    #: the overview's live part is pushed at most this often to an open, visible tab, seconds (at least 1)
    refresh_seconds: float = 1.0
    #: a live stream ends after this long, seconds (the browser opens a new one at once)
    stream_seconds: float = 300.0
    #: the overview's reading is taken at least this often, seconds, notified of a change or not
    #: (a manager's own acks send no notification); it is also the charts' sample interval
    idle_seconds: float = 5.0
    #: the health page's reading is shared by every open tab for this long, seconds
    cache_seconds: float = 5.0
    #: the health page's reading is taken again only after 1/db_share times as long as the last one took
    db_share: float = 0.015
    #: each shard's managers (``ws://host:port/``), whose /health the overview reads
    managers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: how long the overview waits for a manager's /health, seconds
    manager_timeout: float = 1.0
    #: the session cookie is sent over HTTPS only
    secure_cookie: bool = False

    def __post_init__(self) -> None:
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ConfigurationError(f"root path {self.root_path!r}: start it with / and end it without, e.g. /qm")
        if not 0 < self.db_share <= 1:
            raise ConfigurationError("db_share is a fraction of the time: give 0 < db_share <= 1")
        if self.refresh_seconds < 1:
            raise ConfigurationError("the live refresh is at most once a second: give refresh_seconds >= 1")
        if self.idle_seconds < self.refresh_seconds:
            raise ConfigurationError(
                "idle_seconds is the longest wait between readings: give idle_seconds >= refresh_seconds"
            )
        known = {s.name for s in self.topology.shards}
        for shard, urls in self.managers.items():
            if shard not in known:
                raise ConfigurationError(f"managers: no shard named {shard!r} (shards: {', '.join(sorted(known))})")
            for url in urls:
                managers.health_url(url)


class Refused(Exception):
    """A request refused with a status and a message the person can act on."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Shared:
    """One reading shared by every request. It is taken again only after ``ttl`` seconds and after
    ``1 / share`` times as long as the last reading took, in a thread of its own while requests
    go on being served the previous one (only the very first reading makes a request wait): however
    many tabs are open and however large the tables, the readings keep the database busy at most
    ``share`` of the time, and no page waits for them."""

    def __init__(self, ttl: float, read: Callable[[], dict[str, Any]], share: float = 0.02) -> None:
        self.ttl = ttl
        self.share = share
        self._read = read
        self._first = threading.Lock()
        self._lock = threading.Lock()
        self._value: dict[str, Any] | None = None
        self._at = float("-inf")
        self._took = 0.0
        self._busy = False

    def _take(self) -> None:
        started = time.monotonic()
        try:
            value = self._read()
        finally:
            took = time.monotonic() - started
            with self._lock:
                self._at, self._took = time.monotonic(), took
        value["reading"] = {"at": time.time(), "took": took}
        with self._lock:
            self._value = value

    def _background(self) -> None:
        try:
            self._take()
        except Exception:  # the previous reading stays; the next request tries again after the wait
            logger.exception("the dashboard's shared reading failed", extra={"action": "web_reading_failed"})
        finally:
            with self._lock:
                self._busy = False

    def get(self) -> dict[str, Any]:
        """The reading, with ``reading``: when it was taken (epoch seconds) and how long it took."""
        if self._value is None:
            with self._first:
                if self._value is None:
                    self._take()
        with self._lock:
            due = time.monotonic() - self._at >= max(self.ttl, self._took / self.share)
            if due and not self._busy:
                self._busy = True
                threading.Thread(target=self._background, name="qm-web-reading", daemon=True).start()
            assert self._value is not None
            return self._value


class Dashboard(Starlette):
    """The application, wrapped whole (its error pages too) in :class:`~queue_manager.web.headers.Guarded`."""

    def build_middleware_stack(self) -> ASGIApp:
        return Guarded(super().build_middleware_stack())


def create_app(config: WebConfig) -> Starlette:
    """The dashboard application for ``config``."""
    limits = config.limits
    topology = data.Shards(data.guarded(config.topology, limits), limits)
    shard_names = tuple(s.name for s in topology.shards)
    monitor = Monitor(
        lambda: {**data.live(topology, limits), "managers": managers.read_all(config.managers, config.manager_timeout)},
        [partial(data.listen, shard) for shard in topology.shards],
        history=History(every_seconds=config.idle_seconds),
        refresh=config.refresh_seconds,
        idle=config.idle_seconds,
    )
    database_cache = Shared(config.cache_seconds, lambda: data.database(topology), config.db_share)
    sessions = Sessions(config.tokens, config.session_secret)
    templates = Jinja2Templates(directory=str(HERE / "templates"))
    templates.env.globals.update(
        states=STATES,
        shard_names=shard_names,
        refresh=config.refresh_seconds,
        db_share=config.db_share,
        cache_seconds=config.cache_seconds,
        queue_settings=SETTINGS,
        tenant_settings=TENANT_SETTINGS,
        history=monitor.history,
        sparkline=sparkline,
        bars=bars,
        told=told,
        idle=config.idle_seconds,
        has_managers=bool(config.managers),
    )
    templates.env.filters["age"] = _age
    templates.env.filters["clock"] = _clock

    def base(request: Request) -> str:
        return str(request.scope.get("root_path", "")).rstrip("/")

    def user_of(request: Request) -> WebUser | None:
        bearer = config.tokens.from_authorization(request.headers.get("authorization"))
        if bearer is not None:
            return bearer
        return sessions.read(request.cookies.get(COOKIE))

    def same_origin(request: Request) -> None:
        site = request.headers.get("sec-fetch-site")
        if site is not None and site not in ("same-origin", "none"):
            raise Refused(403, f"cross-site request refused (Sec-Fetch-Site: {site}): act from the dashboard itself")
        origin = request.headers.get("origin")
        if origin is not None:
            host = request.headers.get("host", "")
            if origin == "null" or urlsplit(origin).netloc != host:
                raise Refused(403, f"cross-origin request refused (Origin {origin!r} is not this dashboard's)")

    async def form_of(request: Request) -> FormData:
        try:
            return await request.form(max_files=0, max_fields=5000)
        except Exception as exc:  # a malformed body: multipart parser errors have no common base
            raise Refused(400, f"the form could not be read: {exc}") from None

    async def require(request: Request, *, action: bool = False) -> tuple[WebUser, FormData | None]:
        """The user, after the checks of the request's kind (see the module docstring)."""
        user = user_of(request)
        if user is None:
            raise Refused(401, 'log in first: this dashboard needs a token (docs/dashboard.md, "Access")')
        form = None
        if request.method == "POST":
            same_origin(request)
            form = await form_of(request)
            if user.csrf is not None:
                sent = request.headers.get("x-csrf-token") or str(form.get("csrf") or "")
                if not sent or not hmac.compare_digest(sent, user.csrf):
                    raise Refused(403, "the form's CSRF token is missing or stale: reload the page and try again")
        if action and not user.admin:
            raise Refused(403, f'token {user.name!r} is read-only: actions need a token with scope "admin"')
        return user, form

    def page(request: Request, name: str, user: WebUser | None, status: int = 200, **context: Any) -> Response:
        context.update(base=base(request), user=user, csrf=(user.csrf if user else None) or "", now=time.time())
        return templates.TemplateResponse(request, name, context, status_code=status)

    def guard(
        handler: Callable[[Request], Awaitable[Response]],
    ) -> Callable[[Request], Awaitable[Response]]:
        """Turn refusals and the errors a person can act on into pages with their message."""

        async def wrapped(request: Request) -> Response:
            try:
                return await handler(request)
            except Refused as exc:
                if exc.status == 401 and request.method == "GET" and "text/html" in request.headers.get("accept", ""):
                    target = request.url.path
                    return RedirectResponse(f"{base(request)}/login?{urlencode({'next': target})}", status_code=303)
                return error(request, exc.status, exc.message)
            except (FilterError, InvalidNameError, ConfigurationError) as exc:
                return error(request, 400, str(exc))
            except UnknownQueueError as exc:
                return error(request, 404, str(exc))
            except data.StatementTimeout as exc:
                return error(request, 504, str(exc))
            except data.ShardUnavailable as exc:
                return error(request, 503, f"{exc}; try again")
            except QueueManagerError as exc:
                return error(request, 400, str(exc))
            except psycopg.errors.QueryCanceled as exc:
                return error(request, 504, f"a query ran past the dashboard's statement timeout ({exc}); narrow it")
            except psycopg.OperationalError as exc:  # a shard down, wherever it came from
                logger.warning("dashboard request failed", extra={"action": "web_db_error", "error": str(exc)})
                return error(request, 503, f"a shard did not answer: {str(exc).strip()}; try again")
            except (psycopg.DataError, psycopg.IntegrityError) as exc:
                return error(request, 400, f"a shard refused a value: {exc.diag.message_primary or exc}")

        return wrapped

    def error(request: Request, status: int, message: str) -> Response:
        if "text/html" in request.headers.get("accept", ""):
            back = None
            referer = urlsplit(request.headers.get("referer", ""))
            if referer.netloc and referer.netloc == request.headers.get("host"):
                back = _safe_next(referer.path + (f"?{referer.query}" if referer.query else ""), base(request))
            user = user_of(request)
            return page(request, "error.html", user, status=status, code=status, message=message, back=back)
        return PlainTextResponse(f"{message}\n", status_code=status)

    # ------------------------------------------------------------------------------ routes

    async def health(request: Request) -> Response:
        shards = await run_in_threadpool(data.ping, topology)
        ok = all(v is None for v in shards.values())
        body = {"status": "ok" if ok else "degraded", "shards": {k: v or "ok" for k, v in shards.items()}}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def login_form(request: Request) -> Response:
        return page(request, "login.html", None, next=_safe_next(request.query_params.get("next"), base(request)))

    async def login(request: Request) -> Response:
        same_origin(request)
        form = await form_of(request)
        issued = sessions.issue(str(form.get("token") or "").strip())
        target = _safe_next(str(form.get("next") or ""), base(request))
        if issued is None:
            return page(request, "login.html", None, status=401, next=target, message="unknown token")
        value, user = issued
        response = RedirectResponse(target, status_code=303)
        response.set_cookie(
            COOKIE,
            value,
            max_age=sessions.max_age,
            path=base(request) or "/",
            httponly=True,
            samesite="strict",
            secure=config.secure_cookie,
        )
        logger.info("dashboard login", extra={"action": "web_login", "token": user.name, "scope": user.scope})
        return response

    async def logout(request: Request) -> Response:
        await require(request)
        response = RedirectResponse(f"{base(request)}/login", status_code=303)
        response.delete_cookie(COOKIE, path=base(request) or "/")
        return response

    def snapshot_page(template: str, read: Callable[[], dict[str, Any]]) -> Callable[[Request], Awaitable[Response]]:
        """A page that renders a shared reading of every shard (the overview and its live part: the
        monitor's; the database health: its own)."""

        async def handler(request: Request) -> Response:
            user, _ = await require(request)
            snapshot = await run_in_threadpool(read)
            return page(request, template, user, snap=snapshot)

        return handler

    async def overview(request: Request) -> Response:
        user, _ = await require(request)
        snapshot = await run_in_threadpool(monitor.get)
        health = await run_in_threadpool(database_cache.get)
        return page(request, "overview.html", user, snap=snapshot, health=health)

    overview_live = snapshot_page("overview_live.html", monitor.get)
    database = snapshot_page("database.html", database_cache.get)

    async def overview_stream(request: Request) -> Response:
        user, _ = await require(request)
        return stream(request, user, "overview_live.html")

    async def queue_stream(request: Request) -> Response:
        user, _ = await require(request)
        queue = check_queue_name(request.path_params["queue"])
        return stream(request, user, "queue_live.html", queue=queue)

    def stream(request: Request, user: WebUser, template: str, **extra: Any) -> Response:
        """A page's live part (``template`` over the monitor's reading) as server-sent events."""
        fragment = templates.get_template(template)
        context = {"base": base(request), "user": user, "csrf": user.csrf or "", **extra}

        async def events() -> AsyncIterator[str]:
            """The overview's live part at each new reading that changes it (a notification on
            qm_wake brings one within a second, else one comes every ``idle_seconds``); at most
            once per refresh. The stream ends after ``stream_seconds`` (the browser reconnects)."""
            yield f"retry: {int(config.refresh_seconds * 1000)}\n\n"
            sent = None
            version = -1
            deadline = time.monotonic() + config.stream_seconds
            while True:
                pushed = False
                if monitor.version != version:
                    snapshot = await run_in_threadpool(monitor.get)
                    version = monitor.version
                    html = fragment.render(snap=snapshot, now=time.time(), **context)
                    if html != sent:
                        sent, pushed = html, True
                        yield "event: live\n" + "".join(f"data: {line}\n" for line in html.splitlines()) + "\n"
                if time.monotonic() >= deadline:
                    return
                monitor.watch()
                await asyncio.sleep(config.refresh_seconds if pushed else 0.2)

        headers = {"cache-control": "no-store", "x-accel-buffering": "no"}
        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    async def queue_page(request: Request) -> Response:
        user, _ = await require(request)
        queue = check_queue_name(request.path_params["queue"])
        snapshot = await run_in_threadpool(monitor.get)
        detail = await run_in_threadpool(data.queue_detail, topology, queue, limits, snapshot)
        exact = None
        if request.query_params.get("exact"):
            exact = await run_in_threadpool(data.exact_counts, topology, queue)
        done = None
        done_id = request.query_params.get("done")
        if done_id:  # the notice of an action just taken: told from its audit, never from the URL's text
            done = await run_in_threadpool(admin.find, topology, done_id)
        return page(request, "queue.html", user, q=detail, exact=exact, done=done)

    def done(request: Request, queue: str, action_id: uuid.UUID | str) -> Response:
        """Back to the queue page, which tells what the action did (from its audit)."""
        return RedirectResponse(f"{base(request)}/queues/{queue}?{urlencode({'done': action_id})}", status_code=303)

    async def set_paused(request: Request, paused: bool) -> Response:
        user, _ = await require(request, action=True)
        queue = check_queue_name(request.path_params["queue"])
        act = admin.pause if paused else admin.resume
        action_id = uuid.uuid4()
        await run_in_threadpool(lambda: act(topology, queue, actor=user.name, via="web", action_id=action_id))
        return done(request, queue, action_id)

    async def pause(request: Request) -> Response:
        return await set_paused(request, True)

    async def resume(request: Request) -> Response:
        return await set_paused(request, False)

    async def set_limits(request: Request) -> Response:
        user, form = await require(request, action=True)
        assert form is not None
        queue = check_queue_name(request.path_params["queue"])
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
        action_id = uuid.uuid4()
        await run_in_threadpool(
            lambda: admin.alter_queue(
                topology, queue, settings, actor=user.name, via="web", action="limits", action_id=action_id
            )
        )
        return done(request, queue, action_id)

    def tenant_of(form: FormData) -> str:
        tenant = str(form.get("tenant") or "")
        if not tenant.strip():
            raise Refused(400, "tenant: give the tenant whose overrides to change")
        return tenant

    async def set_tenant(request: Request) -> Response:
        user, form = await require(request, action=True)
        assert form is not None
        queue = check_queue_name(request.path_params["queue"])
        tenant = tenant_of(form)
        settings: dict[str, Any] = {}
        for key, spec in TENANT_SETTINGS.items():
            value = _form_value(key, spec, str(form.get(key) or ""))
            if value is not _UNSET:
                settings[key] = value
        if form.get("default_max_in_flight"):
            settings["max_in_flight"] = None
        if not settings:
            raise Refused(400, "nothing to change: give a weight and/or a max in flight (or tick the queue default)")
        action_id = uuid.uuid4()
        await run_in_threadpool(
            lambda: admin.set_tenant(topology, queue, tenant, settings, actor=user.name, via="web", action_id=action_id)
        )
        return done(request, queue, action_id)

    async def unset_tenant(request: Request) -> Response:
        user, form = await require(request, action=True)
        assert form is not None
        queue = check_queue_name(request.path_params["queue"])
        tenant = tenant_of(form)
        action_id = uuid.uuid4()
        await run_in_threadpool(
            lambda: admin.unset_tenant(topology, queue, tenant, actor=user.name, via="web", action_id=action_id)
        )
        return done(request, queue, action_id)

    async def set_settings(request: Request) -> Response:
        user, form = await require(request, action=True)
        assert form is not None
        queue = check_queue_name(request.path_params["queue"])
        current = await run_in_threadpool(admin.queue_row, topology, queue)
        settings: dict[str, Any] = {}
        for key, spec in SETTINGS.items():
            if spec.flag is None or key not in form:
                continue
            value = _form_value(key, spec, str(form.get(key) or ""))
            if value is _UNSET:
                if not spec.nullable:
                    raise Refused(400, f"{key}: give a value ({spec.range_text()})")
                value = None
            if value != current.get(key):
                settings[key] = value
        if not settings:
            raise Refused(400, "nothing to change: every value is the queue's current one")
        action_id = uuid.uuid4()
        await run_in_threadpool(
            lambda: admin.alter_queue(
                topology, queue, settings, actor=user.name, via="web", action="settings", action_id=action_id
            )
        )
        return done(request, queue, action_id)

    async def events(request: Request) -> Response:
        user, _ = await require(request)
        queue = check_queue_name(request.path_params["queue"])
        flt = parse_filter(request.query_params, shard_names)
        cursor = parse_cursor(request.query_params.get("cursor"), shard_names)
        result = await run_in_threadpool(data.events_page, topology, queue, flt, cursor, limits)
        next_query = urlencode({**flt.query(), "cursor": format_cursor(result.cursor)}) if result.more else None
        return page(
            request,
            "events.html",
            user,
            queue=queue,
            flt=flt,
            form=flt.query(),
            result=result,
            next_query=next_query,
            first_query=urlencode(flt.query()),
            limits=limits,
        )

    async def event_page(request: Request) -> Response:
        user, _ = await require(request)
        queue = check_queue_name(request.path_params["queue"])
        shard = request.path_params["shard"]
        if shard not in shard_names:
            raise Refused(404, f"no shard named {shard!r} (shards: {', '.join(shard_names)})")
        raw_id = request.path_params["id"]
        if not raw_id.isdigit() or len(raw_id) > 18:
            raise Refused(400, f"{raw_id[:40]!r} is not an event id (a positive whole number)")
        row = await run_in_threadpool(data.event, topology, queue, shard, int(raw_id))
        if row is None:
            raise Refused(404, f"no event {raw_id} in queue {queue!r} on shard {shard!r} (deleted by retention?)")
        return page(request, "event.html", user, queue=queue, shard=shard, e=row)

    def _selection(form: FormData) -> Selection | None:
        picked = [str(v) for v in form.getlist("sel")]
        if not picked:
            return None
        out: Selection = {}
        for item in picked:
            name, _, raw = item.partition(":")
            if name not in shard_names or not raw.isdigit() or len(raw) > 18:
                raise Refused(400, f"selection: {item[:40]!r} is not shard:id")
            out.setdefault(name, []).append(int(raw))
        if sum(len(v) for v in out.values()) > limits.bulk_cap:
            raise Refused(400, f"selection: more than {limits.bulk_cap} events; use a filter and 'all matching'")
        return out

    def _bulk_request(
        form: FormData, confirming: bool = False
    ) -> tuple[admin.EventAction, EventFilter, Selection | None, datetime | None]:
        """The action, the filter (none for a selection) and the selection (none when confirming:
        the confirmation's bound events are the selection then), and the new fire_at of a bulk form."""
        do = str(form.get("do") or "")
        name, _, scope = do.partition("/")
        action = admin.ACTIONS.get(name)
        if action is None or scope not in ("selection", "all"):
            raise Refused(400, f"unknown bulk action {do[:40]!r}; use one of the event browser's buttons")
        fire_at = None
        if action.name == "reschedule":
            raw = str(form.get("new_fire_at") or "").strip()
            if not raw:
                raise Refused(400, "reschedule: give the new fire_at (ISO 8601, e.g. 2026-11-28T09:00:00Z)")
            fire_at = parse_time("new fire_at", raw)
        if scope == "all":
            fields = {k: str(v) for k, v in form.items() if k not in BULK_FIELDS}
            return action, parse_filter(fields, shard_names), None, fire_at
        selection = None if confirming else _selection(form)
        if selection is None and not confirming:
            raise Refused(400, "nothing selected: tick some events, or choose 'all matching the filter'")
        return action, EventFilter(), selection, fire_at

    async def bulk_preview(request: Request) -> Response:
        """The confirmation: how many events match now, truthfully, and the ones it binds the action to."""
        user, form = await require(request, action=True)
        assert form is not None
        queue = check_queue_name(request.path_params["queue"])
        action, flt, selection, fire_at = _bulk_request(form)
        binding = await run_in_threadpool(
            lambda: admin.bind(
                topology, queue, action, flt, selection,
                cap=limits.bulk_cap, count_cap=limits.bulk_count_cap, fire_at=fire_at,
            )
        )  # fmt: skip
        return page(
            request,
            "confirm.html",
            user,
            queue=queue,
            action=action,
            do=str(form.get("do")),
            new_fire_at=fire_at.isoformat() if fire_at else "",
            binding=binding,
            bound=format_ids(binding.ids),
            fields=flt.query(),
            cap=limits.bulk_cap,
            what=(flt.describe() if selection is None else f"{sum(map(len, selection.values()))} selected events"),
        )

    async def bulk_run(request: Request) -> Response:
        """The confirmed action, on the events the confirmation bound (those still in its state)."""
        user, form = await require(request, action=True)
        assert form is not None
        queue = check_queue_name(request.path_params["queue"])
        action, flt, _, fire_at = _bulk_request(form, confirming=True)
        raw = str(form.get("bound") or "")
        if not raw:
            raise Refused(400, "confirm the events shown on the confirmation page first")
        bound = parse_ids(raw, shard_names, limits.bulk_cap)
        selected = str(form.get("do") or "").endswith("/selection")
        what = f"{sum(map(len, bound.values()))} selected events" if selected else flt.describe()
        outcome = await run_in_threadpool(
            lambda: admin.run(
                topology, queue, action, flt, bound,
                actor=user.name, via="web", description=what, fire_at=fire_at, slice_size=limits.bulk_slice,
            )
        )  # fmt: skip
        return done(request, queue, outcome.action_id)

    async def audit_page(request: Request) -> Response:
        user, _ = await require(request)
        actions = await run_in_threadpool(admin.recent, topology, 100)
        return page(request, "audit.html", user, actions=actions)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/login", guard(login_form), methods=["GET"]),
        Route("/login", guard(login), methods=["POST"]),
        Route("/logout", guard(logout), methods=["POST"]),
        Route("/", guard(overview), methods=["GET"]),
        Route("/partials/overview", guard(overview_live), methods=["GET"]),
        Route("/live/overview", guard(overview_stream), methods=["GET"]),
        Route("/live/queues/{queue}", guard(queue_stream), methods=["GET"]),
        Route("/database", guard(database), methods=["GET"]),
        Route("/audit", guard(audit_page), methods=["GET"]),
        Route("/queues/{queue}", guard(queue_page), methods=["GET"]),
        Route("/queues/{queue}/pause", guard(pause), methods=["POST"]),
        Route("/queues/{queue}/resume", guard(resume), methods=["POST"]),
        Route("/queues/{queue}/limits", guard(set_limits), methods=["POST"]),
        Route("/queues/{queue}/settings", guard(set_settings), methods=["POST"]),
        Route("/queues/{queue}/tenants", guard(set_tenant), methods=["POST"]),
        Route("/queues/{queue}/tenants/unset", guard(unset_tenant), methods=["POST"]),
        Route("/queues/{queue}/events", guard(events), methods=["GET"]),
        Route("/queues/{queue}/events/{shard}/{id}", guard(event_page), methods=["GET"]),
        Route("/queues/{queue}/bulk", guard(bulk_preview), methods=["POST"]),
        Route("/queues/{queue}/bulk/confirm", guard(bulk_run), methods=["POST"]),
        Mount("/static", app=StaticFiles(directory=str(HERE / "static")), name="static"),
    ]

    def close() -> None:
        """Stop the monitor's threads and close the pools (the application's shutdown does it)."""
        monitor.close()
        topology.close()

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await run_in_threadpool(close)

    if not config.root_path:
        app = Dashboard(routes=routes, lifespan=lifespan)
    else:

        async def to_root(request: Request) -> Response:
            return RedirectResponse(f"{config.root_path}/", status_code=307)

        app = Dashboard(
            routes=[Route("/", to_root), Mount(config.root_path, app=Starlette(routes=routes))], lifespan=lifespan
        )
    app.state.close = close
    app.state.monitor = monitor
    return app


_UNSET: Any = object()


def _form_value(key: str, spec: Setting, raw: str) -> Any:
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


def _safe_next(raw: str | None, base: str) -> str:
    """Where to go after login: a path of this dashboard, never another site."""
    home = f"{base}/"
    if not raw or not raw.startswith(home) or raw.startswith("//") or "\\" in raw or not raw.isprintable():
        return home
    return raw


def told(action: admin.Action) -> str:
    """The notice of an action just taken, told from its audit (never from text in the URL)."""
    queue = action.queue or ""
    where = ", ".join(f"{s} {p.affected} of {p.requested}" for s, p in action.parts.items())
    if action.missing:
        where += "; not reached: " + ", ".join(action.missing)
    event_action = admin.ACTIONS.get(action.action)
    if event_action is not None:
        return (
            f"{event_action.verb}: {action.affected} {event_action.noun} of {queue} changed, "
            f"of {action.requested} bound ({where})"
        )
    try:
        detail = json.loads(action.detail)
    except ValueError:
        detail = {}
    everywhere = "on every shard" if action.finished else f"not on every shard ({where})"
    if action.action in ("pause", "resume"):
        return f"{queue} {'paused' if action.action == 'pause' else 'resumed'} {everywhere}"
    changes = {k: v for k, v in detail.items() if k not in ("tenant", "removed")}
    settings = ", ".join(f"{k} {'none' if v is None else v}" for k, v in changes.items())
    if action.action == "tenant_set":
        return f"{queue}: tenant {detail.get('tenant')}: {settings or 'unchanged'} (on its shard)"
    if action.action == "tenant_unset":
        what = "removed" if detail.get("removed") else "none to remove"
        return f"{queue}: tenant {detail.get('tenant')}: overrides {what} (weight 1, the queue's default cap)"
    return f"{queue}: {settings} {everywhere}"


def _clock(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%H:%M:%S UTC")


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"
