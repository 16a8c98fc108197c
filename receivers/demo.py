"""A handler to try ``qm receive`` with; the Docker Compose file (docker-compose.yml) runs it.

    qm receive --queue orders --manager s0=ws://127.0.0.1:8765/ receivers.demo:handle

It logs each event and returns, which acks it. Write your own handler the same way
(docs/receivers.md): return to ack, raise to nack.
"""

from __future__ import annotations

import logging

from receivers.receiver import Event

logger = logging.getLogger("receivers.demo")


async def handle(event: Event) -> None:
    """Log the event (shard, id, attempt, tenant, payload); returning acks it."""
    logger.info(
        "handled %s event %d (attempt %d) of tenant %s",
        event.queue,
        event.id,
        event.attempt,
        event.tenant,
        extra={"shard": event.shard, "payload": event.payload},
    )
