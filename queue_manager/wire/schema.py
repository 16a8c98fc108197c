"""The JSON Schema of every frame of protocol ``qm.v1``, generated from the typed frames of
:mod:`queue_manager.wire.frames`: ``python -m queue_manager.wire.schema [--check] [PATH]`` writes
``docs/protocol.schema.json`` (``--check``: fails when the file is not what the frames generate).

Each frame becomes a definition named by its ``type``; ``client_frame`` and ``server_frame`` are
the choices among them, and the document itself accepts either. Members a frame does not list are
allowed (receivers and the manager ignore them: docs/protocol.md, "Versioning"). What a schema
cannot say is left to docs/protocol.md: that a string holds no lone surrogate, that an integer
``ref`` has at most 200 digits, which ids are in hand on a connection.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import operator
import sys
import types
import typing
from pathlib import Path
from typing import Any

from queue_manager.wire import frames as f

SCHEMA_ID = "https://queue-manager.invalid/protocol/qm.v1.schema.json"
DEFAULT_PATH = Path(__file__).resolve().parents[2] / "docs" / "protocol.schema.json"


class _Builder:
    def __init__(self) -> None:
        self.defs: dict[str, Any] = {}

    def of(self, tp: Any) -> dict[str, Any]:
        """The schema of one annotation."""
        origin = typing.get_origin(tp)
        if origin is typing.Annotated:
            base, *meta = typing.get_args(tp)
            schema = self.of(base)
            for m in meta:
                schema = self._constrain(schema, m)
            return schema
        if origin is typing.Literal:
            values = list(typing.get_args(tp))
            return {"const": values[0]} if len(values) == 1 else {"enum": values}
        if origin in (typing.Union, types.UnionType):
            args = typing.get_args(tp)
            return {"anyOf": [self.of(a) for a in args]}
        if origin in (list, tuple) or origin is typing.get_origin(typing.Sequence[int]):
            args = typing.get_args(tp)
            if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
                return {
                    "type": "array",
                    "prefixItems": [self.of(a) for a in args],
                    "items": False,
                    "minItems": len(args),
                }
            return {"type": "array", "items": self.of(args[0])}
        if tp is type(None):
            return {"type": "null"}
        if tp is Any:
            return {}
        simple = {bool: "boolean", int: "integer", float: "number", str: "string"}
        if tp in simple:
            return {"type": simple[tp]}
        if isinstance(tp, type) and (dataclasses.is_dataclass(tp) or typing.is_typeddict(tp)):
            return self.ref(tp)
        raise TypeError(f"no JSON Schema for the annotation {tp!r}")

    def _constrain(self, schema: dict[str, Any], meta: Any) -> dict[str, Any]:
        if isinstance(meta, f.Range):
            schema = {**schema, "minimum": meta.lo}
            if meta.hi is not None:
                schema["maximum"] = meta.hi
        elif isinstance(meta, f.Length):
            lo, hi = ("minItems", "maxItems") if schema.get("type") == "array" else ("minLength", "maxLength")
            schema = {**schema, lo: meta.lo} if meta.lo else dict(schema)
            if meta.hi is not None:
                schema[hi] = meta.hi
        elif isinstance(meta, f.Pattern):
            schema = {**schema, "pattern": meta.regex}
        elif isinstance(meta, f.Doc):
            schema = {**schema, "description": meta.text}
        elif isinstance(meta, f.Either):
            schema = {"anyOf": [schema, self.of(meta.alternative)]}
        return schema

    def ref(self, cls: type) -> dict[str, Any]:
        name = getattr(cls, "TYPE", cls.__name__)
        if name not in self.defs:
            self.defs[name] = {}  # a placeholder while its members are built
            self.defs[name] = self.object(cls)
        return {"$ref": f"#/$defs/{name}"}

    def object(self, cls: type) -> dict[str, Any]:
        hints = typing.get_type_hints(cls, include_extras=True)
        props: dict[str, Any] = {}
        required: list[str] = []
        frame_type = getattr(cls, "TYPE", None)
        if frame_type is not None:
            props["type"] = {"const": frame_type}
            required.append("type")
        if dataclasses.is_dataclass(cls):
            for fld in dataclasses.fields(cls):
                tp = hints[fld.name]
                member = _member(tp)
                name = member.name or fld.name
                optional = fld.default is None
                if optional and member.omit_none:
                    tp = _without_none(tp)
                props[name] = self.of(tp)
                if not optional:
                    required.append(name)
        else:
            for name, tp in hints.items():
                # (read from the annotation: __required_keys__ misses NotRequired in a string annotation)
                if typing.get_origin(tp) is typing.NotRequired:
                    (tp,) = typing.get_args(tp)
                else:
                    required.append(name)
                props[name] = self.of(tp)
        schema: dict[str, Any] = {"type": "object"}
        doc = (cls.__doc__ or "").strip()
        if doc and not doc.startswith(cls.__name__ + "("):  # not the dataclass's generated signature
            schema["description"] = " ".join(doc.replace("``", "`").split())
        schema.update(properties=props, required=required)
        return schema


def _member(tp: Any) -> f.Member:
    if typing.get_origin(tp) is typing.Annotated:
        for m in typing.get_args(tp)[1:]:
            if isinstance(m, f.Member):
                return m
        return _member(typing.get_args(tp)[0])
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        for a in typing.get_args(tp):
            found = _member(a)
            if found != f.Member():
                return found
    return f.Member()


def _without_none(tp: Any) -> Any:
    """``X | None`` as X (a member left out rather than null)."""
    if typing.get_origin(tp) is typing.Annotated:
        base, *meta = typing.get_args(tp)
        return typing.Annotated[(_without_none(base), *meta)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(tp) if a is not type(None)]
        return functools.reduce(operator.or_, rest)
    return tp


def schema() -> dict[str, Any]:
    """The schema of every frame, as a JSON-ready dict."""
    b = _Builder()
    client = [b.ref(cls) for cls in f.CLIENT_FRAMES]
    server = [b.ref(cls) for cls in f.SERVER_FRAMES]
    defs = {
        "client_frame": {"description": "a frame a receiver sends", "oneOf": client},
        "server_frame": {"description": "a frame the manager sends", "oneOf": server},
        **dict(sorted(b.defs.items())),
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": f"protocol {f.PROTOCOL}: one JSON object per websocket text message",
        "description": "Generated from queue_manager/wire/frames.py by `python -m queue_manager.wire.schema`; "
        "the rules are docs/protocol.md's.",
        "oneOf": [{"$ref": "#/$defs/client_frame"}, {"$ref": "#/$defs/server_frame"}],
        "$defs": defs,
    }


def render() -> str:
    """The schema as the file holds it."""
    return json.dumps(schema(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m queue_manager.wire.schema", description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", type=Path, default=DEFAULT_PATH)
    parser.add_argument("--check", action="store_true", help="fail if the file is not what the frames generate")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.path.read_text(encoding="utf-8") if args.path.exists() else ""
        if current != text:
            print(f"{args.path} is stale: run python -m queue_manager.wire.schema", file=sys.stderr)
            return 1
        return 0
    args.path.write_text(text, encoding="utf-8")
    print(f"wrote {args.path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
