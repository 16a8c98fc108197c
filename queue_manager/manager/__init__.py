"""The manager: one active process per shard that fires due events to receivers over websockets.

:mod:`.server` wires the parts; its docstring maps them. The protocol they speak lives in
:mod:`queue_manager.wire`.

``Manager`` (and its server's imports: websockets, the runtime) loads on first use, so that reading
:class:`ManagerConfig` (``qm``'s flag defaults) costs only the configuration module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from queue_manager.manager.config import ManagerConfig
    from queue_manager.manager.server import Manager

__all__ = ["Manager", "ManagerConfig"]


def __getattr__(name: str) -> Any:
    if name == "Manager":
        from queue_manager.manager.server import Manager

        return Manager
    if name == "ManagerConfig":
        from queue_manager.manager.config import ManagerConfig

        return ManagerConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
