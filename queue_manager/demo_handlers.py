"""The demo's receiver handler (``qm receive ... queue_manager.demo_handlers:handle``).

Most events succeed at once. Events of the ``tenant-bad-*`` tenants fail every time: they are
retried with the queue's back-off, then dead-lettered at ``max_attempts``. Events of the
``tenant-slow-*`` tenants take a little longer (0.2 to 0.6 s). Everything the demo shows is read
from the database, so the handler records nothing itself.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any


class DemoFailure(Exception):
    """What a failing tenant's handler raises (it becomes the event's ``last_error``)."""


def _tenant(event: Any) -> str:
    return str(getattr(event, "tenant", ""))


async def handle(event: Any) -> None:
    """Ack most events at once; fail the bad tenants' events; take a while for the slow ones."""
    tenant = _tenant(event)
    if tenant.startswith("tenant-bad-"):
        raise DemoFailure(f"demo: {tenant}'s downstream always refuses (attempt {getattr(event, 'attempt', '?')})")
    if tenant.startswith("tenant-slow-"):
        await asyncio.sleep(random.uniform(0.2, 0.6))
