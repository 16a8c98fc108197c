"""A page's live part pushed as server-sent events (the overview's and the queue page's): the
part re-rendered over each new reading of the monitor that changes it, at most once per refresh."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from queue_manager.web.access import WebUser
from queue_manager.web.context import Web, base


def stream(web: Web, request: Request, user: WebUser, template: str, **extra: Any) -> Response:
    """``template`` over the monitor's reading, as server-sent events."""
    fragment = web.templates.get_template(template)
    context = {"base": base(request), "user": user, "csrf": user.csrf or "", **extra}
    refresh = web.config.refresh_seconds
    monitor = web.monitor

    async def events() -> AsyncIterator[str]:
        """The live part at each new reading that changes it (a notification on qm_wake brings one
        within a second, else one comes every ``idle_seconds``); at most once per refresh. The
        stream ends after ``stream_seconds`` (the browser reconnects)."""
        yield f"retry: {int(refresh * 1000)}\n\n"
        sent = None
        version = -1
        deadline = time.monotonic() + web.config.stream_seconds
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
            await asyncio.sleep(refresh if pushed else 0.2)

    headers = {"cache-control": "no-store", "x-accel-buffering": "no"}
    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)
