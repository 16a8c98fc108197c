"""The dashboard as an ASGI application (Starlette, Jinja2 templates, server-sent events and one
small static script for the live parts; no JavaScript build).

``create_app(config)`` returns the application; ``qm web`` serves it with uvicorn, and any ASGI
server or a host application can mount it (``root_path`` puts every route under a sub-path).

The package, beside this assembly: one module per page in ``pages/`` (overview, queue, events,
event, health, audit, schedules), each with its routes; the pieces they share beside them: ``context.py``
(the shared :class:`~queue_manager.web.context.Web`), ``auth.py`` (login, CSRF, the scopes, what a
refused request is answered), ``formatting.py``, ``cache.py`` and ``monitor.py`` (the readings),
``stream.py`` (the live parts), ``headers.py`` (what every response carries), ``reads.py`` and
``shards.py`` (the shards), ``filters.py`` and ``browse.py`` (pure). The actions are the admin
API's (``queue_manager.admin``). Database work runs in the thread pool, each statement under the
statement timeout.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp

from queue_manager.web import auth
from queue_manager.web.cache import Shared
from queue_manager.web.config import WebConfig
from queue_manager.web.context import HERE, build
from queue_manager.web.headers import Guarded
from queue_manager.web.pages import audit, event, events, health, overview, queue, schedules

__all__ = ["Shared", "WebConfig", "create_app"]


class Dashboard(Starlette):
    """The application, wrapped whole (its error pages too) in :class:`~queue_manager.web.headers.Guarded`."""

    def build_middleware_stack(self) -> ASGIApp:
        return Guarded(super().build_middleware_stack())


def create_app(config: WebConfig) -> Starlette:
    """The dashboard application for ``config``."""
    web = build(config)
    routes: list[BaseRoute] = [
        *health.routes(web),
        *auth.routes(web),
        *overview.routes(web),
        *queue.routes(web),
        *events.routes(web),
        *event.routes(web),
        *audit.routes(web),
        *schedules.routes(web),
        Mount("/static", app=StaticFiles(directory=str(HERE / "static")), name="static"),
    ]

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await run_in_threadpool(web.close)

    if not config.root_path:
        app = Dashboard(routes=routes, lifespan=lifespan)
    else:

        async def to_root(request: Request) -> Response:
            return RedirectResponse(f"{config.root_path}/", status_code=307)

        app = Dashboard(
            routes=[Route("/", to_root), Mount(config.root_path, app=Starlette(routes=routes))], lifespan=lifespan
        )
    app.state.close = web.close
    app.state.monitor = web.monitor
    return app
