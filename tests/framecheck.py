"""Every frame the integration tests' managers and clients send, checked against the protocol's
JSON Schema (docs/protocol.schema.json, the file a client in another language is built from).

The check is installed for every test by an autouse fixture (tests/conftest.py): a server frame is
checked when an in-process manager queues it for a connection and when a receiver library's session
reads it (frames from manager processes included); a client frame is checked when an in-process
manager's parser accepts it. The frames are collected as they go and checked at the test's end, so
that the check does not slow the managers under test (their leases are short). A frame the parser
refuses (or a receiver cannot read) is not checked: the malformed-frame tests send those on purpose.
A frame that does not match fails the test that sent it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "docs" / "protocol.schema.json"


@cache
def schema() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    return loaded


@cache
def _validator(definition: str) -> Draft202012Validator:
    s = schema()
    return Draft202012Validator({"$schema": s["$schema"], "$defs": s["$defs"], "$ref": f"#/$defs/{definition}"})


def problems(value: Any, side: str) -> list[str]:
    """Why ``value`` (a decoded frame; ``side`` is ``client`` or ``server``) is not a frame of that
    side: empty when it is one. The frame's own definition is picked by its ``type``, for precise
    messages."""
    choices = [r["$ref"].rsplit("/", 1)[1] for r in schema()["$defs"][f"{side}_frame"]["oneOf"]]
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in choices:
        return [f"not a {side} frame type: {kind!r}"]
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '(frame)'}: {e.message}" for e in _validator(kind).iter_errors(value)
    ]


#: past this many items, an array of a frame is checked by its first and last SAMPLE // 2 items: a
#: 10 000-item ack takes jsonschema about 0.3 s, which the frames of a busy test would add up to
SAMPLE = 1000


def _sampled(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _sampled(v) for k, v in value.items()}
    if isinstance(value, list) and len(value) > SAMPLE:
        return [*value[: SAMPLE // 2], *value[-SAMPLE // 2 :]]
    return value


class FrameCheck:
    """Collects the frames as they are sent (cheaply: the managers under test are timed) and checks
    them against the schema in :meth:`verify`, at the test's end."""

    def __init__(self) -> None:
        self.bad: list[str] = []
        self.checked = {"client": 0, "server": 0}
        #: the frame types checked, per side
        self.types: dict[str, set[str]] = {"client": set(), "server": set()}
        self._pending: list[tuple[str | bytes, str, str]] = []

    def check(self, text: str | bytes, side: str, where: str) -> None:
        self.checked[side] += 1
        self._pending.append((text, side, where))

    def verify(self) -> list[str]:
        """Check the frames collected so far; the ones that do not match (also kept in ``bad``)."""
        pending, self._pending = self._pending, []
        for text, side, where in pending:
            try:
                value = json.loads(text)
            except ValueError as exc:
                self.bad.append(f"{where}: a {side} frame is not JSON ({exc}): {text[:200]!r}")
                continue
            if isinstance(value, dict) and isinstance(value.get("type"), str):
                self.types[side].add(value["type"])
            found = problems(_sampled(value), side)
            if found:
                self.bad.append(f"{where}: {'; '.join(found[:3])} in {str(text)[:300]}")
        return self.bad

    @contextlib.contextmanager
    def installed(self) -> Iterator[FrameCheck]:
        """Check frames at the manager's and the receivers' codec while the block runs."""
        from queue_manager.manager.connection import ReceiverConnection
        from queue_manager.wire import frames
        from queue_manager.wire.client import ClientSession

        send, parse, receive = ReceiverConnection.send, frames.parse, ClientSession.receive

        def checked_send(conn: ReceiverConnection, text: str) -> None:
            self.check(text, "server", "a manager sent")
            send(conn, text)

        def checked_parse(text: str | bytes) -> frames.ClientFrame:
            frame = parse(text)  # refused frames (FrameError) are the malformed-frame tests' own
            self.check(text, "client", "a manager accepted")
            return frame

        def checked_receive(session: ClientSession[Any], message: str | bytes) -> Any:
            effects = receive(session, message)  # unreadable frames (ServerFrameError) are tests' own
            self.check(message, "server", "a receiver read")
            return effects

        patches: list[tuple[Any, str, Callable[..., Any]]] = [
            (ReceiverConnection, "send", checked_send),
            (frames, "parse", checked_parse),
            (ClientSession, "receive", checked_receive),
        ]
        saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
        for owner, name, new in patches:
            setattr(owner, name, new)
        try:
            yield self
        finally:
            for owner, name, old in saved:
                setattr(owner, name, old)


def delivered(*events: dict[str, Any]) -> list[dict[str, Any]]:
    """The events (from ``frames.event``) as a receiver reads them: written by the manager's own
    ``deliver_frames`` and parsed back."""
    from queue_manager.wire import frames

    return [e for text in frames.deliver_frames("q", list(events), 500) for e in json.loads(text)["events"]]
