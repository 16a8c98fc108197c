"""What every page of the dashboard shares: :class:`Web`, built once per application by
:func:`build` (the shards' pools, the live reading, the health page's cache, the sessions, the
templates), and how a page renders and how an action hands back to its queue's page."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from functools import partial
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.templating import Jinja2Templates

from queue_manager.domain.settings import SETTINGS, TENANT_SETTINGS
from queue_manager.web import formatting, managers, reads
from queue_manager.web.access import Sessions, WebUser
from queue_manager.web.cache import Shared
from queue_manager.web.config import WebConfig
from queue_manager.web.filters import STATES
from queue_manager.web.monitor import Monitor
from queue_manager.web.readings import History, bars, sparkline
from queue_manager.web.shards import Limits, Shards, guarded, listen

HERE = Path(str(resources.files("queue_manager.web")))


def base(request: Request) -> str:
    """The path the dashboard is served under ("" at the root)."""
    return str(request.scope.get("root_path", "")).rstrip("/")


@dataclass
class Web:
    """The dashboard's shared pieces, given to every page's handlers."""

    config: WebConfig
    #: every shard, through its pool (the admin API's actions are given it too)
    db: Shards
    #: the overview's live reading (and the charts' history), kept by a thread of its own
    monitor: Monitor
    #: the health page's reading, shared by every tab for ``cache_seconds``
    health: Shared
    sessions: Sessions
    templates: Jinja2Templates
    shard_names: tuple[str, ...]

    @property
    def limits(self) -> Limits:
        return self.config.limits

    def page(self, request: Request, name: str, user: WebUser | None, status: int = 200, **context: Any) -> Response:
        """The template ``name`` rendered for ``user``."""
        context.update(base=base(request), user=user, csrf=(user.csrf if user else None) or "", now=time.time())
        return self.templates.TemplateResponse(request, name, context, status_code=status)

    def done(self, request: Request, queue: str, action_id: uuid.UUID | str) -> Response:
        """After an action: back to its queue's page, which tells what it did (from its audit)."""
        query = urlencode({"done": str(action_id)})
        return RedirectResponse(f"{base(request)}/queues/{queue}?{query}", status_code=303)

    def close(self) -> None:
        """Stop the monitor's threads and close the pools (the application's shutdown does it)."""
        self.monitor.close()
        self.db.close()


def build(config: WebConfig) -> Web:
    """The shared pieces of a dashboard serving ``config``."""
    limits = config.limits
    db = Shards(guarded(config.topology, limits), limits)
    monitor = Monitor(
        lambda: {**reads.live(db, limits), "managers": managers.read_all(config.managers, config.manager_timeout)},
        [partial(listen, shard) for shard in db.shards],
        history=History(every_seconds=config.idle_seconds),
        refresh=config.refresh_seconds,
        idle=config.idle_seconds,
    )
    health = Shared(config.cache_seconds, lambda: reads.database(db), config.db_share)
    shard_names = tuple(s.name for s in db.shards)
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
        told=formatting.told,
        setting=formatting.setting,
        idle=config.idle_seconds,
        has_managers=bool(config.managers),
    )
    templates.env.filters.update(formatting.FILTERS)
    return Web(config, db, monitor, health, Sessions(config.tokens, config.session_secret), templates, shard_names)
