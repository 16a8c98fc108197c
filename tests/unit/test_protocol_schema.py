"""docs/protocol.schema.json: generated from the typed frames, and in agreement with them, with the
manager's parser and with docs/protocol.md's examples."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from queue_manager.wire import frames as f
from queue_manager.wire import schema
from tests.framecheck import SCHEMA_PATH, problems

PROTOCOL_MD = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"

CLIENT_EXAMPLES: list[f.ClientFrame] = [
    f.Subscribe("orders"),
    f.Subscribe("orders", ("acme", "Zürich"), 100, "sub"),
    f.Subscribe("orders", None, 10, "sub", ("cancel",)),
    f.Credit(0, 7),
    f.Credit(f.MAX_CREDIT),
    f.Ack(((1041, 1), (2**63 - 1, 2**31 - 1)), 12),
    f.Nack((f.NackItem(1043, 1, 30.0, "upstream 503"), f.NackItem(1044, 2)), 13),
    f.Extend((f.ExtendItem(1044, 1, 300.0),), "x" * f.MAX_REF_LENGTH),
    f.Ping("p1"),
    f.Ping(),
]

EVENT: f.DeliveredEvent = {
    "id": 1041,
    "attempt": 1,
    "tenant": "acme",
    "partition": 3,
    "fire_at": 1763719200.104512,
    "payload": {"order": 42},
}

SERVER_EXAMPLES: list[f.ServerFrame] = [
    f.Welcome(f.PROTOCOL, "s0", 12, "mgr-a:4711:9f2c01ab", f.limits(500)),
    f.Subscribed("orders", ("acme",), 100, "sub"),
    f.Subscribed("orders", None, 0),
    f.Subscribed("orders", None, 10, "sub", ("cancel",)),
    f.CreditSet(50, 7),
    f.Deliver("orders", [EVENT, {**EVENT, "id": 1042, "traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"}]),
    f.AckResult([1041], [f.item_error(1042, 2, f.STALE, "re-fired")], 12),
    f.NackResult([1043], [1044], []),
    f.ExtendResult([{"id": 1044, "ack_deadline": 1763719522.5}], [], 14),
    f.Pong(1763719201.337, "p1"),
    f.Error(f.FORBIDDEN, "token 'billing-workers' may not read queue 'audit'", "sub"),
    f.Cancel("orders", [{"id": 1041, "attempt": 1}]),
    f.AckResult([], [f.item_error(1041, 1, f.CANCELLED, "an operator cancelled this event")], 15),
]


def test_the_schema_file_is_what_the_typed_frames_generate() -> None:
    assert SCHEMA_PATH.read_text(encoding="utf-8") == schema.render(), (
        "docs/protocol.schema.json is stale: run python -m queue_manager.wire.schema"
    )
    assert schema.main(["--check", str(SCHEMA_PATH)]) == 0


def test_the_check_command_fails_on_a_stale_file(tmp_path: Path) -> None:
    stale = tmp_path / "schema.json"
    stale.write_text(schema.render().replace('"maximum": 100000', '"maximum": 100001'), encoding="utf-8")
    assert schema.main(["--check", str(stale)]) == 1


def test_every_frame_type_has_an_example_here() -> None:
    assert {type(x) for x in CLIENT_EXAMPLES} == set(f.CLIENT_FRAMES)
    assert {type(x) for x in SERVER_EXAMPLES} == set(f.SERVER_FRAMES)
    defs = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))["$defs"]
    assert {r["$ref"].rsplit("/", 1)[1] for r in defs["client_frame"]["oneOf"]} == {c.TYPE for c in f.CLIENT_FRAMES}
    assert {r["$ref"].rsplit("/", 1)[1] for r in defs["server_frame"]["oneOf"]} == {c.TYPE for c in f.SERVER_FRAMES}


@pytest.mark.parametrize("frame", CLIENT_EXAMPLES, ids=lambda x: type(x).__name__)
def test_client_frames_match_the_schema_and_read_back_through_the_managers_parser(frame: f.ClientFrame) -> None:
    text = frame.to_json()
    assert problems(json.loads(text), "client") == []
    assert f.parse(text) == frame


@pytest.mark.parametrize("frame", SERVER_EXAMPLES, ids=lambda x: type(x).__name__)
def test_server_frames_match_the_schema_and_read_back_through_the_receivers_parser(frame: f.ServerFrame) -> None:
    text = frame.to_json()
    assert problems(json.loads(text), "server") == []
    assert f.parse_server(text) == frame


def test_the_managers_deliver_frame_matches_the_schema() -> None:
    tp = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    events = [f.event(1, 1, "acme", 0, 1.5, '{"a": [1, 2]}'), f.event(2, 3, "é", 7, 2.0, "null", 3, tp, "k=v", "a=b")]
    (text,) = f.deliver_frames("orders", events, 10)
    assert problems(json.loads(text), "server") == []
    parsed = f.parse_server(text)
    assert isinstance(parsed, f.Deliver) and [e["id"] for e in parsed.events] == [1, 2]


def test_a_result_past_the_error_messages_limit_still_matches() -> None:
    errors = [f.item_error(i, 1, f.UNKNOWN_ID, "not here") for i in range(1, f.MAX_ERROR_MESSAGES + 11)]
    value = json.loads(f.AckResult([], errors).to_json())
    assert problems(value, "server") == []
    assert sum("message" in e for e in value["errors"]) == f.MAX_ERROR_MESSAGES


#: frames the manager refuses as bad_frame; the schema refuses each of them too
MALFORMED: list[dict[str, Any]] = [
    {"type": "subscribe"},
    {"type": "subscribe", "queue": "Orders"},
    {"type": "subscribe", "queue": "orders", "credit": -1},
    {"type": "subscribe", "queue": "orders", "credit": f.MAX_CREDIT + 1},
    {"type": "subscribe", "queue": "orders", "tenants": []},
    {"type": "subscribe", "queue": "orders", "tenants": [""]},
    {"type": "subscribe", "queue": "orders", "features": "cancel"},
    {"type": "subscribe", "queue": "orders", "features": [""]},
    {"type": "credit", "credit": 5.5},
    {"type": "credit", "credit": "5"},
    {"type": "ack", "events": []},
    {"type": "ack", "events": [["1042", 2]]},
    {"type": "ack", "events": [[1, 0]]},
    {"type": "ack", "events": [[0, 1]]},
    {"type": "ack", "events": [[1, 1, 1]]},
    {"type": "ack", "events": [{"id": 1}]},
    {"type": "ack", "events": [[1, 1]] * (f.MAX_ITEMS_PER_FRAME + 1)},
    {"type": "nack", "events": [[1, 1]]},
    {"type": "nack", "events": [{"id": 1, "attempt": 1, "delay": -5}]},
    {"type": "nack", "events": [{"id": 1, "attempt": 1, "error": 5}]},
    {"type": "extend", "events": [{"id": 1, "attempt": 1}]},
    {"type": "extend", "events": [{"id": 1, "attempt": 1, "seconds": f.MAX_EXTEND_SECONDS + 1}]},
    {"type": "ping", "ref": True},
    {"type": "ping", "ref": 1.5},
    {"type": "ping", "ref": "x" * (f.MAX_REF_LENGTH + 1)},
    {"type": "launch"},
    {"no": "type"},
]


@pytest.mark.parametrize("value", MALFORMED, ids=lambda v: json.dumps(v)[:60])
def test_the_schema_refuses_what_the_manager_refuses(value: dict[str, Any]) -> None:
    with pytest.raises(f.FrameError) as refused:
        f.parse(json.dumps(value))
    assert refused.value.code in (f.BAD_FRAME, f.UNKNOWN_TYPE)
    assert problems(value, "client") != []


def _protocol_md_examples() -> list[tuple[str, str]]:
    """(side, JSON text) of every frame docs/protocol.md shows: its ```json blocks and the lines
    of its worked example session."""
    text = PROTOCOL_MD.read_text(encoding="utf-8")
    found: list[tuple[str, str]] = []
    server_types = {c.TYPE for c in f.SERVER_FRAMES}
    for block in re.findall(r"```json\n(.*?)```", text, re.S):
        value = json.loads(block)
        if "type" in value:
            found.append(("server" if value["type"] in server_types else "client", block))
        else:
            found.append(("event", block))
    session = text[text.index("## A worked example session") :]
    for side, line in re.findall(r"^([CS]): (\{.*\})$", session, re.M):
        found.append(("client" if side == "C" else "server", line))
    return found


def test_protocol_md_shows_every_frame_type() -> None:
    shown = {json.loads(t).get("type") for _, t in _protocol_md_examples()}
    assert {c.TYPE for c in (*f.CLIENT_FRAMES, *f.SERVER_FRAMES)} <= shown


@pytest.mark.parametrize(("side", "text"), _protocol_md_examples(), ids=lambda v: str(v)[:50])
def test_protocol_md_examples_match_the_schema(side: str, text: str) -> None:
    value = json.loads(text)
    if side == "event":  # the event with a trace context
        assert problems({"type": "deliver", "queue": "orders", "events": [value]}, "server") == []
        return
    if value.get("events") == [["1042", 2]]:  # the example's quoted id, refused on purpose
        assert problems(value, side) != []
        with pytest.raises(f.FrameError):
            f.parse(text)
        return
    assert problems(value, side) == []
    if side == "client":
        f.parse(text)
    else:
        assert f.parse_server(text) is not None


def test_the_frame_check_of_the_test_suite_catches_a_frame_off_the_schema(_frames_match_the_schema: Any) -> None:
    from tests.framecheck import FrameCheck

    before = _frames_match_the_schema.checked["client"]
    f.parse(f.Ping("p").to_json())  # the installed check sees what the manager's parser accepts
    assert _frames_match_the_schema.checked["client"] == before + 1
    check = FrameCheck()
    check.check('{"type": "ack_result", "acked": ["1041"], "errors": []}', "server", "here")
    check.check('{"type": "subscribed", "queue": "orders", "credit": 1}', "server", "here")  # no tenants
    check.check(f.AckResult([1041]).to_json(), "server", "here")
    bad = check.verify()
    assert len(bad) == 2 and "acked/0" in bad[0] and "tenants" in bad[1]


ROOT = Path(__file__).resolve().parents[2]
FRAME_SPELLERS = ("queue_manager", "receivers", "faults", "benchmarks", "conformance", "spark_jobs", "tests")
#: modules that write frames as JSON text on purpose, and why
RAW_BY_DESIGN = {"benchmarks/wire_codec.py": "it measures other checkouts too: the same bytes whatever their API"}


def _raw_frames(path: Path) -> list[int]:
    """Lines of ``path`` that build a frame as a dict with a "type" and dump it to JSON by hand,
    outside a function named for malformed frames and without a "malformed" comment on the line."""
    import ast

    source = path.read_text()
    lines = source.splitlines()
    found: list[int] = []

    def visit(node: ast.AST, malformed: bool) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            malformed = malformed or "malformed" in node.name
        if (
            isinstance(node, ast.Call)
            and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) == "dumps"
            and node.args
            and isinstance(node.args[0], ast.Dict)
            and any(isinstance(k, ast.Constant) and k.value == "type" for k in node.args[0].keys)
            and not malformed
            and "malformed" not in lines[node.lineno - 1]
        ):
            found.append(node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child, malformed)

    visit(ast.parse(source), False)
    return found


def test_frames_are_spelled_by_the_typed_frames_only() -> None:
    """Every frame is built by queue_manager.wire (its typed constructors); a test that sends a
    malformed frame on purpose says so (its function's name or a comment on the line)."""
    raw = {
        f"{path.relative_to(ROOT)}:{line}"
        for top in FRAME_SPELLERS
        for path in sorted((ROOT / top).rglob("*.py"))
        if "wire" not in path.relative_to(ROOT).parts[:2] and str(path.relative_to(ROOT)) not in RAW_BY_DESIGN
        for line in _raw_frames(path)
    }
    assert raw == set()
    # the check finds a hand-built frame where one is
    assert _raw_frames(ROOT / "benchmarks" / "wire_codec.py")
