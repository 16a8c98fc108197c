"""The manager: one active process per shard that fires due events to receivers over websockets.

- :mod:`.lease` holds leadership (a lease with a term in the shard's database);
- :mod:`.cache` is the in-memory window of upcoming events, read round-robin by partition;
- :mod:`.store` runs the manager's SQL (scan, fire, ack, release, extend, sweep), always fenced;
- :mod:`.protocol` parses and builds websocket frames (documented in docs/protocol.md);
- :mod:`.auth` checks tokens and their scopes before the websocket upgrade;
- :mod:`.server` ties them together; :mod:`.metrics` exposes Prometheus text.
"""

from queue_manager.manager.server import Manager, ManagerConfig

__all__ = ["Manager", "ManagerConfig"]
