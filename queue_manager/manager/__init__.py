"""The manager: one active process per shard that fires due events to receivers over websockets.

:mod:`.server` wires the parts; its docstring maps them. The protocol they speak lives in
:mod:`queue_manager.wire`.
"""

from queue_manager.manager.config import ManagerConfig
from queue_manager.manager.server import Manager

__all__ = ["Manager", "ManagerConfig"]
