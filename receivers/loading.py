"""Find a handler by name: ``package.module:function`` (or ``module:object.method``)."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from receivers.errors import HandlerImportError
from receivers.receiver import Handler


def load_handler(spec: str, *, search_cwd: bool = True) -> Handler:
    """Import ``module:function`` and return the function; :class:`HandlerImportError` says what
    is wrong (the form, a module that cannot be found or fails while importing, a missing or
    uncallable attribute). With ``search_cwd`` the current directory is searched first, as
    ``python -m`` does."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise HandlerImportError(f"handler {spec!r}: name it as module:function, e.g. myapp.handlers:handle")
    if search_cwd and os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise HandlerImportError(
                f"handler {spec!r}: no module named {exc.name!r} (searched {os.getcwd()} and the Python path)"
            ) from None
        raise HandlerImportError(f"handler {spec!r}: importing module {module_name!r} failed: {exc}") from None
    except Exception as exc:
        raise HandlerImportError(
            f"handler {spec!r}: importing module {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from None
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            names = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n, None)))
            hint = f"; its callables: {', '.join(names[:20])}" if names else ""
            raise HandlerImportError(
                f"handler {spec!r}: module {module_name!r} has no attribute {attr!r}{hint}"
            ) from None
    if not callable(obj):
        raise HandlerImportError(f"handler {spec!r}: {attr!r} is a {type(obj).__name__}, not a function")
    handler: Handler = obj
    return handler
