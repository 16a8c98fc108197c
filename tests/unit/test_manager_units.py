"""The manager's pure logic, without a database: frames, tokens, the window cache, metrics text."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from queue_manager.errors import ConfigurationError
from queue_manager.manager.auth import Grant, TokenStore
from queue_manager.manager.cache import LOOKAHEAD, REFILL_LEAD, Entry, WindowCache
from queue_manager.manager.metrics import Registry
from queue_manager.wire import frames as proto
from tests.framecheck import delivered

# ============================================================================ protocol.parse


def frame(**body: Any) -> str:
    return json.dumps(body)


def refused(text: str | bytes) -> proto.FrameError:
    with pytest.raises(proto.FrameError) as info:
        proto.parse(text)
    return info.value


def test_parse_ack_both_item_forms_and_ref() -> None:
    f = proto.parse(frame(type="ack", ref="r1", events=[[1, 1], {"id": 2**63 - 1, "attempt": 2**31 - 1}]))
    assert f == proto.Ack(((1, 1), (2**63 - 1, 2**31 - 1)), "r1")
    assert proto.parse(frame(type="ack", ref=7, events=[[5, 3]])) == proto.Ack(((5, 3),), 7)
    assert proto.parse(frame(type="ack", events=[[5, 3]])).ref is None


def test_parse_nack_defaults_delay_and_error() -> None:
    f = proto.parse(
        frame(
            type="nack",
            ref="n",
            events=[
                {"id": 1, "attempt": 1},
                {"id": 2, "attempt": 3, "delay": 0, "error": "boom"},
                {"id": 3, "attempt": 1, "delay": 2.5, "error": None},
                {"id": 4, "attempt": 1, "delay": proto.MAX_NACK_DELAY_SECONDS},
            ],
        )
    )
    assert f == proto.Nack(
        (
            proto.NackItem(1, 1, None, None),
            proto.NackItem(2, 3, 0.0, "boom"),
            proto.NackItem(3, 1, 2.5, None),
            proto.NackItem(4, 1, proto.MAX_NACK_DELAY_SECONDS, None),
        ),
        "n",
    )
    assert isinstance(f, proto.Nack) and isinstance(f.items[1].delay, float)


def test_parse_nack_error_text_is_truncated_not_refused() -> None:
    long = "é" * (proto.MAX_ERROR_TEXT + 50)
    f = proto.parse(frame(type="nack", events=[{"id": 1, "attempt": 1, "error": long}]))
    assert isinstance(f, proto.Nack)
    assert f.items[0].error == "é" * proto.MAX_ERROR_TEXT


def test_parse_nack_error_nul_is_replaced_for_postgres() -> None:
    f = proto.parse(frame(type="nack", events=[{"id": 1, "attempt": 1, "error": "a\x00b"}]))
    assert isinstance(f, proto.Nack)
    assert f.items[0].error == "a\ufffdb"


def test_parse_extend() -> None:
    f = proto.parse(
        frame(
            type="extend",
            ref=3,
            events=[{"id": 9, "attempt": 2, "seconds": 30}, {"id": 10, "attempt": 1, "seconds": 0.25}],
        )
    )
    assert f == proto.Extend((proto.ExtendItem(9, 2, 30.0), proto.ExtendItem(10, 1, 0.25)), 3)


def test_parse_credit_bounds() -> None:
    assert proto.parse(frame(type="credit", credit=0)) == proto.Credit(0, None)
    assert proto.parse(frame(type="credit", credit=proto.MAX_CREDIT, ref="c")) == proto.Credit(proto.MAX_CREDIT, "c")
    for bad in (-1, proto.MAX_CREDIT + 1, 5.0, "5", True, None):
        err = refused(frame(type="credit", credit=bad, ref="c"))
        assert err.code == proto.BAD_FRAME
        assert err.message == f"credit must be an integer from 0 to {proto.MAX_CREDIT}, got {json.dumps(bad)}"
        assert err.ref == "c"


def test_parse_subscribe() -> None:
    assert proto.parse(frame(type="subscribe", queue="orders")) == proto.Subscribe("orders", None, None, None)
    f = proto.parse(frame(type="subscribe", queue="orders", tenants=["acme", "Zürich"], credit=10, ref="s"))
    assert f == proto.Subscribe("orders", ("acme", "Zürich"), 10, "s")
    assert proto.parse(frame(type="subscribe", queue="orders", tenants=None, credit=None)) == proto.Subscribe(
        "orders", None, None, None
    )


@pytest.mark.parametrize("queue", [None, "", 5, ["orders"]])
def test_parse_subscribe_bad_queue(queue: Any) -> None:
    err = refused(frame(type="subscribe", queue=queue, ref="s"))
    assert (err.code, err.message, err.ref) == (proto.BAD_FRAME, "'queue' must be a queue name", "s")


@pytest.mark.parametrize(
    "tenants",
    [[], "acme", ["acme", ""], ["acme", 5], {"acme": 1}, ["t"] * (proto.MAX_TENANTS_PER_SUBSCRIPTION + 1)],
)
def test_parse_subscribe_bad_tenants(tenants: Any) -> None:
    err = refused(frame(type="subscribe", queue="orders", tenants=tenants))
    assert err.code == proto.BAD_FRAME
    assert err.message == (
        f"'tenants' must be a list of 1 to {proto.MAX_TENANTS_PER_SUBSCRIPTION} non-empty strings, or null"
    )


def test_parse_subscribe_max_tenants_is_allowed() -> None:
    many = [f"t{i}" for i in range(proto.MAX_TENANTS_PER_SUBSCRIPTION)]
    f = proto.parse(frame(type="subscribe", queue="orders", tenants=many))
    assert isinstance(f, proto.Subscribe) and f.tenants is not None and len(f.tenants) == len(many)


def test_parse_subscribe_bad_credit() -> None:
    err = refused(frame(type="subscribe", queue="orders", credit=-1))
    assert err.code == proto.BAD_FRAME
    assert err.message == f"credit must be an integer from 0 to {proto.MAX_CREDIT}, got -1"


def test_parse_ping_and_unknown_fields_are_ignored() -> None:
    assert proto.parse(frame(type="ping")) == proto.Ping(None)
    assert proto.parse(frame(type="ping", ref="p", future_field={"x": 1})) == proto.Ping("p")
    assert proto.parse(frame(type="credit", credit=3, extra=[1, 2])) == proto.Credit(3, None)


def test_parse_binary_frames() -> None:
    assert proto.parse(frame(type="ping", ref="é").encode("utf-8")) == proto.Ping("é")
    err = refused(b'{"type": "ping", "ref": "\xff"}')
    assert (err.code, err.message, err.ref) == (proto.BAD_JSON, "binary frames must hold UTF-8 JSON text", None)


def test_parse_bad_json() -> None:
    err = refused("{not json")
    assert err.code == proto.BAD_JSON
    assert err.message.startswith("frame is not valid JSON: Expecting property name")
    assert err.ref is None
    assert refused("").code == proto.BAD_JSON


def test_valid_json_that_python_cannot_hold_is_a_bad_frame_not_bad_json() -> None:
    """Valid JSON: a deeply nested value, an integer too long to convert (docs: bad_frame)."""
    deep = refused("[" * 100_000 + "]" * 100_000)
    assert (deep.code, deep.message) == (proto.BAD_FRAME, "the frame nests arrays or objects too deeply")
    nested_unknown = refused('{"type": "ping", "extra": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert nested_unknown.code == proto.BAD_FRAME
    huge = refused('{"type": "ack", "events": [[' + "9" * 5000 + ", 1]]}")
    assert (huge.code, huge.message) == (proto.BAD_FRAME, "an integer in the frame has too many digits")


@pytest.mark.parametrize(
    "text",
    [
        '{"type":"ack","items":[{"id":18446744073709551616,"attempt":1}]}',  # past 64 bits
        '{"type":"extend","seconds":NaN,"items":[]}',
        '{"type":"ping","ref":"\\ud800"}',  # a lone surrogate
        '{"type":"ack","items":[{"id":1,"attempt":1}],"items":[]}',  # a repeated member: the last
        '{"type":"credit","credit":1e2}',
        "not json",
    ],
)
def test_the_fast_codec_reads_what_the_standard_library_reads(text: str) -> None:
    """frames.loads is orjson's, with the standard library's where orjson refuses: whatever the
    text, the frame decoded (or the error) is the standard library's."""
    try:
        expected: object = json.loads(text)
    except ValueError as exc:
        with pytest.raises(type(exc)):
            proto.loads(text)
    else:
        got = proto.loads(text)
        assert got == expected or (got != got and expected != expected)
        assert proto.loads(text.encode()) == got or got != got


def test_the_fast_codec_writes_the_standard_librarys_values() -> None:
    obj = {"type": "pong", "time": 1764400000.123456, "ref": "é\u2028x", "n": [1, 2.5e-7, -0.0, 2**63], "z": None}
    assert json.loads(proto.dumps(obj)) == obj
    assert json.loads(proto.dumps({"big": 2**70, "s": "\ud800"})) == {"big": 2**70, "s": "\ud800"}  # as before


@pytest.mark.parametrize("queue", ["*", "Orders", "qm_internal", "x" * 41, "a-b", "select"])
def test_a_malformed_queue_name_is_a_bad_frame_whatever_the_token(queue: str) -> None:
    err = refused(frame(type="subscribe", queue=queue, ref="s"))
    assert (err.code, err.ref) == (proto.BAD_FRAME, "s")
    assert "queue" in err.message


@pytest.mark.parametrize("text", ["[1, 2]", '"ping"', "42", "null"])
def test_parse_not_an_object(text: str) -> None:
    err = refused(text)
    assert (err.code, err.message) == (proto.BAD_FRAME, "a frame must be a JSON object with a 'type'")


@pytest.mark.parametrize("kind", [None, 5, ["ack"], {"t": 1}])
def test_parse_missing_or_non_string_type(kind: Any) -> None:
    body = {"ref": "x"} if kind is None else {"type": kind, "ref": "x"}
    err = refused(json.dumps(body))
    assert (err.code, err.message, err.ref) == (proto.BAD_FRAME, "a frame must be a JSON object with a 'type'", "x")


def test_parse_unknown_type_names_it_truncated() -> None:
    err = refused(frame(type="launch", ref=1))
    assert (err.code, err.message, err.ref) == (proto.UNKNOWN_TYPE, "unknown frame type 'launch'", 1)
    err = refused(frame(type="x" * 100))
    assert err.message == f"unknown frame type {'x' * 40!r}"
    assert refused(frame(type="ACK", events=[[1, 1]])).code == proto.UNKNOWN_TYPE  # types are case-sensitive


@pytest.mark.parametrize(
    "ref", [True, 1.5, ["r"], {"r": 1}, "r" * (proto.MAX_REF_LENGTH + 1), 10**proto.MAX_REF_LENGTH]
)
def test_parse_bad_ref(ref: Any) -> None:
    err = refused(frame(type="ping", ref=ref))
    assert err.code == proto.BAD_FRAME
    assert err.message == f"'ref' must be a string or integer of at most {proto.MAX_REF_LENGTH} characters"
    assert err.ref is None  # an invalid ref is never echoed


def test_parse_ref_limits() -> None:
    assert proto.parse(frame(type="ping", ref="r" * proto.MAX_REF_LENGTH)) == proto.Ping("r" * proto.MAX_REF_LENGTH)
    assert proto.parse(frame(type="ping", ref=-5)) == proto.Ping(-5)
    assert proto.parse(frame(type="ping", ref="")) == proto.Ping("")


def test_parse_lone_surrogates_are_refused_where_echoed_or_stored() -> None:
    # valid escaped pairs decode to one code point and are fine
    assert proto.parse('{"type": "ping", "ref": "\\ud83d\\ude00"}') == proto.Ping("\U0001f600")
    err = refused('{"type": "ping", "ref": "a\\ud800"}')
    assert err.code == proto.BAD_FRAME and "lone surrogate" in err.message and err.ref is None
    err = refused('{"type": "subscribe", "queue": "orders", "tenants": ["\\udfff"], "ref": "s"}')
    assert (err.code, err.ref) == (proto.BAD_FRAME, "s") and "'tenants'" in err.message
    err = refused('{"type": "nack", "events": [{"id": 1, "attempt": 1, "error": "\\ud800"}]}')
    assert err.code == proto.BAD_FRAME and err.message == "event #0: error holds a lone surrogate escape"


@pytest.mark.parametrize("kind", ["ack", "nack", "extend"])
def test_parse_items_list_shape(kind: str) -> None:
    for events in (None, [], {"id": 1}, "1,1"):
        body = {"type": kind, "ref": "i"} if events is None else {"type": kind, "ref": "i", "events": events}
        err = refused(json.dumps(body))
        assert (err.code, err.message, err.ref) == (proto.BAD_FRAME, "'events' must be a non-empty list", "i")
    item = [1, 1] if kind == "ack" else {"id": 1, "attempt": 1, "seconds": 1}
    err = refused(frame(type=kind, events=[item] * (proto.MAX_ITEMS_PER_FRAME + 1)))
    assert err.code == proto.BAD_FRAME
    assert err.message == (
        f"'events' holds {proto.MAX_ITEMS_PER_FRAME + 1} items; at most {proto.MAX_ITEMS_PER_FRAME} per frame"
    )
    full = proto.parse(frame(type=kind, events=[item] * proto.MAX_ITEMS_PER_FRAME))
    assert isinstance(full, proto.Ack | proto.Nack | proto.Extend)
    assert len(full.items) == proto.MAX_ITEMS_PER_FRAME


@pytest.mark.parametrize("item", [[1], [1, 1, 1], "1", 1, None])
def test_parse_ack_item_shape(item: Any) -> None:
    err = refused(frame(type="ack", events=[[1, 1], item]))
    assert err.code == proto.BAD_FRAME
    assert err.message == 'event #1: give [id, attempt] or {"id": ..., "attempt": ...}'


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ([0, 1], "event #0: id must be an integer from 1 to 9223372036854775807, got 0"),
        ([2**63, 1], "event #0: id must be an integer from 1 to 9223372036854775807, got 9223372036854775808"),
        (["7", 1], 'event #0: id must be an integer from 1 to 9223372036854775807, got "7"'),
        ([7.0, 1], "event #0: id must be an integer from 1 to 9223372036854775807, got 7.0"),
        ([True, 1], "event #0: id must be an integer from 1 to 9223372036854775807, got true"),
        ({"attempt": 1}, "event #0: id must be an integer from 1 to 9223372036854775807, got null"),
        ([7, 0], "event #0: attempt must be an integer from 1 to 2147483647, got 0"),
        ([7, 2**31], "event #0: attempt must be an integer from 1 to 2147483647, got 2147483648"),
        ({"id": 7}, "event #0: attempt must be an integer from 1 to 2147483647, got null"),
    ],
)
def test_parse_id_and_attempt_ranges(item: Any, message: str) -> None:
    err = refused(frame(type="ack", ref="a", events=[item]))
    assert (err.code, err.message, err.ref) == (proto.BAD_FRAME, message, "a")


def test_parse_nack_item_errors() -> None:
    err = refused(frame(type="nack", events=[{"id": 1, "attempt": 1}, [2, 1]]))
    assert err.message == 'event #1: give {"id", "attempt"[, "delay", "error"]}'
    err = refused(frame(type="nack", events=[{"id": 1, "attempt": 1, "delay": -5}]))
    assert err.message == "event #0: delay must be a number of seconds from 0 to 3.15576e+08, got -5"
    err = refused(frame(type="nack", events=[{"id": 1, "attempt": 1, "delay": proto.MAX_NACK_DELAY_SECONDS + 1}]))
    assert err.message.startswith("event #0: delay must be a number of seconds from 0 to")
    for bad in ("5", True, [1]):
        assert refused(frame(type="nack", events=[{"id": 1, "attempt": 1, "delay": bad}])).code == proto.BAD_FRAME
    # Python's json reads NaN and Infinity; they are still refused
    err = refused('{"type": "nack", "events": [{"id": 1, "attempt": 1, "delay": NaN}]}')
    assert err.message.endswith("got NaN")
    err = refused('{"type": "nack", "events": [{"id": 1, "attempt": 1, "delay": Infinity}]}')
    assert err.message.endswith("got Infinity")
    err = refused(frame(type="nack", ref=9, events=[{"id": 1, "attempt": 1, "error": 42}]))
    assert (err.code, err.message, err.ref) == (proto.BAD_FRAME, "event #0: error must be a string", 9)


def test_parse_extend_item_errors() -> None:
    err = refused(frame(type="extend", events=[[1, 1]]))
    assert err.message == 'event #0: give {"id", "attempt", "seconds"}'
    err = refused(frame(type="extend", events=[{"id": 1, "attempt": 1}]))
    assert err.message == "event #0: seconds must be a number of seconds from 0 to 86400, got null"
    err = refused(frame(type="extend", events=[{"id": 1, "attempt": 1, "seconds": "long"}]))
    assert err.message == 'event #0: seconds must be a number of seconds from 0 to 86400, got "long"'
    err = refused(frame(type="extend", events=[{"id": 1, "attempt": 1, "seconds": 86_400.5}]))
    assert err.code == proto.BAD_FRAME
    longest = proto.parse(frame(type="extend", events=[{"id": 1, "attempt": 1, "seconds": 86_400}]))
    assert longest == proto.Extend((proto.ExtendItem(1, 1, 86_400.0),), None)


def test_parse_never_raises_anything_but_frame_error() -> None:
    samples = ['{"type": "ack", "events": [[1e400, 1]]}', '{"a":' * 10, "\ud800", "1" * 5000, '{"type": null}']
    for text in samples:
        with pytest.raises(proto.FrameError):
            proto.parse(text)


@settings(max_examples=50, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
        lambda c: st.lists(c) | st.dictionaries(st.text(), c),
        max_leaves=10,
    )
)
def test_parse_arbitrary_json_only_frame_errors(value: Any) -> None:
    for body in (value, {"type": "ack", "events": value}, {"type": "nack", "events": [value]}):
        try:
            proto.parse(json.dumps(body))
        except proto.FrameError as err:
            assert err.code in {proto.BAD_JSON, proto.BAD_FRAME, proto.UNKNOWN_TYPE}
            assert err.message


# ============================================================================ protocol: server frames


def test_event_json_round_trips_unicode_and_nested_payload() -> None:
    tenant = 'Zürich—東京 "quoted" \\ back\nline\u2028'
    payload = {"a": [1, 2.5, None, True, {"deep": {"x": "ünï\u0000"}}], "emoji": "\U0001f600", "n": -(2**62)}
    stored = json.dumps(payload, ensure_ascii=False)
    [got] = delivered(proto.event(2**63 - 1, 3, tenant, 15, 1_700_000_000.123456, stored, 1))
    assert got == {
        "id": 2**63 - 1,
        "attempt": 3,
        "tenant": tenant,
        "partition": 15,
        "fire_at": 1_700_000_000.123456,
        "priority": 1,
        "payload": payload,
    }
    assert list(got) == ["id", "attempt", "tenant", "partition", "fire_at", "priority", "payload"]


@pytest.mark.parametrize("stored", ["null", "[]", '"text"', "42", '{"k": {"k": {"k": []}}}'])
def test_event_json_any_stored_json(stored: str) -> None:
    assert delivered(proto.event(1, 1, "t", 0, 0.5, stored))[0]["payload"] == json.loads(stored)


def test_deliver_frame() -> None:
    events = [proto.event(i, 1, f"tenant-{i}", i % 4, 1.0 + i, json.dumps({"i": i})) for i in range(1, 4)]
    got = json.loads(proto.deliver_frames("orders", events, 10)[0])
    assert got["type"] == "deliver" and got["queue"] == "orders"
    assert [e["id"] for e in got["events"]] == [1, 2, 3]
    assert [e["payload"] for e in got["events"]] == [{"i": 1}, {"i": 2}, {"i": 3}]


def test_deliver_frames_cut_by_count_and_by_bytes_and_keep_the_order() -> None:
    """The manager's path: one orjson call per frame; at most per_frame events and MAX_FRAME_BYTES
    bytes a frame, an event larger than that alone in its own; the same members as a lone event's,
    the trace context's only when set."""
    small = [proto.event(i, 1, "t", 0, 1.5 + i, json.dumps({"i": i}), 2) for i in range(1, 8)]
    texts = proto.deliver_frames("orders", small, 3)
    got = [json.loads(t) for t in texts]
    assert [[e["id"] for e in g["events"]] for g in got] == [[1, 2, 3], [4, 5, 6], [7]]
    assert all(g["type"] == "deliver" and g["queue"] == "orders" for g in got)
    assert texts[0].startswith('{"type":"deliver","queue":"orders","events":[{"id":1,')
    assert got[0]["events"][0] == delivered(proto.event(1, 1, "t", 0, 2.5, '{"i": 1}', 2))[0]
    big = "x" * (proto.MAX_FRAME_BYTES // 3)
    large = [proto.event(i, 1, "t", 0, 1.0, json.dumps(big), 3) for i in range(1, 6)]
    large.append(proto.event(6, 1, "t", 0, 1.0, json.dumps(big * 4), 3))
    texts = proto.deliver_frames("orders", large, 500)
    ids = [[e["id"] for e in json.loads(t)["events"]] for t in texts]
    assert [i for frame in ids for i in frame] == [1, 2, 3, 4, 5, 6] and ids[-1] == [6]
    assert all(len(t.encode()) <= proto.MAX_FRAME_BYTES for t in texts[:-1]) and len(texts) <= 5
    traced = proto.event(9, 2, "t", 1, 1.0, "null", 3, "00-" + "a" * 32 + "-" + "b" * 16 + "-01", None, "a=b")
    (one,) = json.loads(proto.deliver_frames("orders", [traced], 10)[0])["events"]
    members = ["id", "attempt", "tenant", "partition", "fire_at", "priority", "payload", "traceparent", "baggage"]
    assert list(one) == members
    assert proto.deliver_frames("orders", [], 10) == []


@settings(max_examples=100, deadline=None)
@given(
    tenant=st.text(st.characters(blacklist_categories=["Cs"]), min_size=1),
    fire_at=st.floats(min_value=946_684_800, max_value=7_258_118_400, allow_nan=False),
    payload=st.recursive(
        st.none() | st.booleans() | st.integers(-(2**63), 2**63) | st.text(st.characters(blacklist_categories=["Cs"])),
        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=5), c, max_size=4),
        max_leaves=15,
    ),
)
def test_deliver_frame_round_trips(tenant: str, fire_at: float, payload: Any) -> None:
    ev = proto.event(12345678901234, 2, tenant, 3, fire_at, json.dumps(payload, ensure_ascii=False))
    got = json.loads(proto.deliver_frames("q1", [ev, ev], 10)[0])
    assert got["events"][0] == got["events"][1]
    assert got["events"][0] == {
        "id": 12345678901234,
        "attempt": 2,
        "tenant": tenant,
        "partition": 3,
        "fire_at": fire_at,
        "priority": 3,
        "payload": payload,
    }
    # the frame is valid UTF-8, as a websocket text frame must be
    proto.deliver_frames("q1", [ev], 10)[0].encode("utf-8")


def test_error_frame_and_dumps() -> None:
    assert json.loads(proto.Error("stale", "old").to_json()) == {"type": "error", "code": "stale", "message": "old"}
    assert json.loads(proto.Error("forbidden", "no", "s1").to_json()) == {
        "type": "error",
        "code": "forbidden",
        "message": "no",
        "ref": "s1",
    }
    assert json.loads(proto.Error("bad_frame", "m", 0).to_json())["ref"] == 0
    assert proto.dumps({"a": "é", "b": [1, 2]}) == '{"a":"é","b":[1,2]}'


# ============================================================================ auth


SECRET = "s3cr3t-at-least-16-chars"
OTHER = "another-secret-0000001"


def entry(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"name": "w", "secret": SECRET, "queues": ["orders"]}
    base.update(over)
    return {k: v for k, v in base.items() if v is not None}


def config_error(entries: list[Any]) -> str:
    with pytest.raises(ConfigurationError) as info:
        TokenStore.from_entries(entries)
    return str(info.value)


def test_from_entries_validation_errors() -> None:
    assert config_error([]) == "the token file defines no [[token]]; receivers could never connect"
    assert config_error(["x"]) == "token #1: must be a table ([[token]]), got str"
    assert config_error([entry(name=None)]) == "token #1: 'name' must be a non-empty string"
    assert config_error([entry(), entry(name="")]) == "token #2: 'name' must be a non-empty string"
    assert config_error([entry(), entry(secret=OTHER)]) == "token 'w': the name is used twice"
    both = entry(secret_sha256=hashlib.sha256(b"x").hexdigest())
    assert config_error([both]) == "token 'w': give exactly one of 'secret' or 'secret_sha256'"
    assert config_error([entry(secret=None)]) == "token 'w': give exactly one of 'secret' or 'secret_sha256'"
    for bad in ("short", 1234567890123456789, ["x" * 20]):
        assert config_error([entry(secret=bad)]) == "token 'w': 'secret' must be a string of at least 16 characters"
    for bad in ("ABCDEF" + "0" * 58, "0" * 63, "g" * 64, 5):
        assert config_error([entry(secret=None, secret_sha256=bad)]) == (
            "token 'w': 'secret_sha256' must be 64 lowercase hex digits"
        )
    for bad in (None, [], "orders", ["orders", 5]):
        assert config_error([entry(queues=bad)]) == (
            "token 'w': 'queues' must be a non-empty list of queue names (or [\"*\"])"
        )
    msg = config_error([entry(queues=["Orders"])])
    assert msg.startswith("token 'w': invalid queue name 'Orders'")
    assert config_error([entry(queues=["qm_x"])]).startswith("token 'w': invalid queue name 'qm_x': it is reserved")
    for bad in ([], "acme", ["acme", ""], [1]):
        assert config_error([entry(tenants=bad)]) == (
            "token 'w': 'tenants' must be a non-empty list of tenant names, or be left out"
        )
    assert config_error([entry(queue=["orders"], tenant="x")]) == "token 'w': unknown keys ['queue', 'tenant']"
    same = entry(name="b", secret=None, secret_sha256=hashlib.sha256(SECRET.encode()).hexdigest())
    assert config_error([entry(), same]) == "token 'b': the same secret is used by token 'w'"


def store() -> TokenStore:
    return TokenStore.from_entries(
        [
            entry(name="all", queues=["*", "orders"]),
            {
                "name": "hashed",
                "secret_sha256": hashlib.sha256(OTHER.encode("utf-8")).hexdigest(),
                "queues": ["orders", "invoices"],
                "tenants": ["acme", "globex"],
            },
        ]
    )


def test_lookup_plain_and_hashed_secrets() -> None:
    s = store()
    assert s.lookup(SECRET) == Grant("all", None, None)
    assert s.lookup(OTHER) == Grant("hashed", frozenset({"orders", "invoices"}), frozenset({"acme", "globex"}))
    assert s.lookup(SECRET + "x") is None
    assert s.lookup("") is None


@pytest.mark.parametrize(
    ("header", "name"),
    [
        (f"Bearer {SECRET}", "all"),
        (f"bearer {OTHER}", "hashed"),
        (f"BEARER {OTHER}", "hashed"),
        (f"  Bearer   {SECRET}  ", "all"),
        (None, None),
        ("", None),
        ("Bearer", None),
        ("Bearer    ", None),
        (f"Basic {SECRET}", None),
        (f"Token {SECRET}", None),
        (SECRET, None),
        (f"Bearer {SECRET[:-1]}", None),
        ("Bearer wrong-secret-wrong-secret", None),
    ],
)
def test_from_authorization(header: str | None, name: str | None) -> None:
    grant = store().from_authorization(header)
    assert (grant.name if grant else None) == name


def test_grant_scopes() -> None:
    everything = Grant("all", None, None)
    assert everything.allows_queue("anything")
    assert everything.allowed_tenants(None) is None
    assert everything.allowed_tenants(["x", "y", "x"]) == frozenset({"x", "y"})
    scoped = Grant("scoped", frozenset({"orders"}), frozenset({"acme", "globex"}))
    assert scoped.allows_queue("orders") and not scoped.allows_queue("invoices")
    assert scoped.allowed_tenants(None) == frozenset({"acme", "globex"})
    assert scoped.allowed_tenants(["acme"]) == frozenset({"acme"})
    with pytest.raises(PermissionError) as info:
        scoped.allowed_tenants(["acme", "zeta", "beta"])
    assert str(info.value) == "token 'scoped' does not cover tenants ['beta', 'zeta']"


def test_load_token_file(tmp_path: Path) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text(
        f'[[token]]\nname = "a"\nsecret = "{SECRET}"\nqueues = ["orders"]\ntenants = ["acme"]\n'
        f'[[token]]\nname = "b"\nsecret_sha256 = "{hashlib.sha256(OTHER.encode()).hexdigest()}"\nqueues = ["*"]\n',
        encoding="utf-8",
    )
    s = TokenStore.load(path)
    assert s.lookup(SECRET) == Grant("a", frozenset({"orders"}), frozenset({"acme"}))
    assert s.lookup(OTHER) == Grant("b", None, None)
    with pytest.raises(ConfigurationError, match="does not exist"):
        TokenStore.load(tmp_path / "missing.toml")
    path.write_text("[[token]\n", encoding="utf-8")
    with pytest.raises(ConfigurationError, match="is not valid TOML"):
        TokenStore.load(path)
    path.write_text(f'[token]\nname = "a"\nsecret = "{SECRET}"\nqueues = ["orders"]\n', encoding="utf-8")
    with pytest.raises(ConfigurationError, match=r"use \[\[token\]\] tables"):
        TokenStore.load(path)
    path.write_text("", encoding="utf-8")
    with pytest.raises(ConfigurationError, match="defines no"):
        TokenStore.load(path)


# ============================================================================ cache


def e(ident: int, part: int, fire_at: float, tenant: str = "t") -> Entry:
    return Entry(ident, tenant, part, fire_at)


def anyone(_: Entry) -> str:
    return "r"


def ids(taken: list[tuple[Entry, Any]]) -> list[int]:
    return [x.id for x, _ in taken]


def parts(taken: list[tuple[Entry, Any]]) -> list[int]:
    return [x.partition for x, _ in taken]


def test_take_round_robin_with_a_cursor_across_calls() -> None:
    c = WindowCache()
    # partition 0 holds a big backlog, 1 and 3 a little each
    entries = [e(i, 0, 1.0 + i * 0.001) for i in range(100)]
    entries += [e(1000 + i, 1, 5.0 + i) for i in range(3)] + [e(3000 + i, 3, 2.0 + i) for i in range(3)]
    c.replace(entries, truncated=[0])
    seen = []
    for _ in range(9):
        seen += parts(c.take(100.0, 1, anyone))
    assert seen == [0, 1, 3] * 3
    # the other partitions are empty now; the backlog keeps going
    assert parts(c.take(100.0, 4, anyone)) == [0, 0, 0, 0]
    assert len(c) == 100 - 3 - 4


def test_take_one_per_partition_per_turn_and_fire_at_order_within() -> None:
    c = WindowCache()
    c.replace([e(10 + i, 0, 10.0 - i) for i in range(5)] + [e(20 + i, 2, 1.0 + i) for i in range(5)], [])
    out = c.take(100.0, 6, anyone)
    assert parts(out) == [0, 2, 0, 2, 0, 2]
    assert ids(out) == [14, 20, 13, 21, 12, 22]  # partition 0 was given out of order; replace sorted it
    # the cursor sits after partition 2: the next call starts again at partition 0
    assert parts(c.take(100.0, 1, anyone)) == [0]
    assert parts(c.take(100.0, 1, anyone)) == [2]


def test_take_starts_at_cursor_and_wraps() -> None:
    c = WindowCache()
    c.replace([e(p * 10 + i, p, 1.0) for p in (1, 4, 7) for i in range(3)], [])
    assert parts(c.take(10.0, 2, anyone)) == [1, 4]
    assert parts(c.take(10.0, 2, anyone)) == [7, 1]
    assert parts(c.take(10.0, 5, anyone)) == [4, 7, 1, 4, 7]
    assert len(c) == 0 and c.take(10.0, 5, anyone) == []


def test_full_partition_cannot_starve_the_others() -> None:
    c = WindowCache()
    c.replace([e(i, 5, 0.0) for i in range(1000)] + [e(10_000 + p, p, 0.5) for p in range(5)], [])
    first = []
    while len(first) < 12:
        first += c.take(1.0, 2, anyone)
    # within the first 12 deliveries, every quiet partition got its event
    assert {x.partition for x, _ in first} == {0, 1, 2, 3, 4, 5}
    assert sum(1 for x, _ in first if x.partition == 5) <= 7


def test_take_never_returns_events_not_yet_due() -> None:
    c = WindowCache()
    c.replace([e(1, 0, 5.0), e(2, 0, 10.0), e(3, 1, 10.0), e(4, 2, 9.99)], [])
    assert ids(c.take(9.0, 10, anyone)) == [1]
    assert c.take(9.5, 10, anyone) == []
    assert sorted(ids(c.take(10.0, 10, anyone))) == [2, 3, 4]
    assert len(c) == 0


def test_take_limit_zero_and_empty() -> None:
    c = WindowCache()
    assert c.take(1.0, 5, anyone) == []
    c.replace([e(1, 0, 0.0)], [])
    assert c.take(1.0, 0, anyone) == [] and c.take(1.0, -1, anyone) == []
    assert len(c) == 1


def test_choose_none_keeps_the_event_and_lookahead_finds_the_next() -> None:
    c = WindowCache()
    c.replace([e(1, 0, 1.0, "a"), e(2, 0, 2.0, "a"), e(3, 0, 3.0, "b"), e(4, 0, 4.0, "b")], [])
    calls: list[int] = []

    def only_b(x: Entry) -> str | None:
        calls.append(x.id)
        return "rb" if x.tenant == "b" else None

    out = c.take(10.0, 1, only_b)
    assert out == [(e(3, 0, 3.0, "b"), "rb")]
    assert calls == [1, 2, 3]
    assert len(c) == 3
    assert c.next_fire_at() == 1.0  # the refused head stays where it was
    calls.clear()
    assert ids(c.take(10.0, 5, only_b)) == [4]
    # nothing acceptable left: no candidate is tried twice within the call
    assert calls == [1, 2, 4]
    assert ids(c.take(10.0, 5, anyone)) == [1, 2]


def test_lookahead_is_bounded() -> None:
    c = WindowCache()
    blockers = [e(i, 0, float(i), "a") for i in range(LOOKAHEAD)]
    c.replace([*blockers, e(999, 0, 100.0, "b")], [])
    assert c.take(1000.0, 1, lambda x: "r" if x.tenant == "b" else None) == []  # one past the lookahead
    c.replace([*blockers[:-1], e(999, 0, 100.0, "b")], [])
    assert ids(c.take(1000.0, 1, lambda x: "r" if x.tenant == "b" else None)) == [999]  # the last one it looks at


def test_lookahead_stops_at_the_first_event_not_due() -> None:
    c = WindowCache()
    c.replace([e(1, 0, 1.0, "a"), e(2, 0, 10.001, "b")], [])
    assert c.take(10.0, 5, lambda x: "r" if x.tenant == "b" else None) == []
    assert len(c) == 2
    assert ids(c.take(10.001, 5, lambda x: "r" if x.tenant == "b" else None)) == [2]


def test_choose_sees_other_partitions_when_one_refuses() -> None:
    c = WindowCache()
    c.replace([e(1, 0, 1.0, "a"), e(2, 1, 1.0, "b"), e(3, 2, 1.0, "a"), e(4, 3, 1.0, "b")], [])
    assert ids(c.take(10.0, 10, lambda x: x.tenant if x.tenant == "b" else None)) == [2, 4]
    assert len(c) == 2


def test_put_back_keeps_fire_at_order() -> None:
    c = WindowCache()
    c.replace([e(1, 0, 1.0), e(2, 0, 3.0), e(3, 0, 5.0)], [])
    c.put_back([e(10, 0, 3.0), e(11, 0, 0.5), e(12, 0, 9.0), e(13, 4, 2.0)])
    assert len(c) == 7
    assert c.next_fire_at() == 0.5
    out = c.take(100.0, 100, anyone)
    by_part: dict[int, list[int]] = {}
    for x, _ in out:
        by_part.setdefault(x.partition, []).append(x.id)
    assert by_part == {0: [11, 1, 2, 10, 3, 12], 4: [13]}  # an equal fire_at goes after the ones there
    assert len(c) == 0


def test_replace_all_and_a_subset_of_partitions() -> None:
    c = WindowCache()
    c.replace([e(1, 0, 1.0), e(2, 1, 1.0), e(3, 2, 1.0), e(4, 2, 2.0)], truncated=[0, 2])
    assert len(c) == 4 and c.truncated == {0, 2}
    # rescan partitions 1 and 2 only: 1 now holds two events (out of order), 2 none
    c.replace([e(6, 1, 7.0), e(5, 1, 6.0)], truncated=[1], partitions=[1, 2])
    assert len(c) == 3
    assert c.truncated == {0, 1}
    assert ids(c.take(100.0, 10, anyone)) == [1, 5, 6]
    # a full replace drops everything not in the scan
    c.replace([e(7, 3, 1.0)], truncated=[])
    assert len(c) == 1 and c.truncated == set()
    assert ids(c.take(100.0, 10, anyone)) == [7]


def test_needs_refill_next_fire_at_due_count_clear() -> None:
    c = WindowCache()
    assert c.next_fire_at() is None and not c.needs_refill()
    c.replace([e(1, 0, 4.0), e(2, 1, 2.0), e(3, 1, 8.0)], truncated=[1])
    assert c.next_fire_at() == 2.0
    assert c.due_count(4.0) == 2 and c.due_count(1.0) == 0
    assert not c.needs_refill()
    assert ids(c.take(10.0, 10, anyone)) == [1, 2, 3]
    assert c.needs_refill()  # partition 1 was cut short by its quota and ran dry
    c.replace([], truncated=[])
    assert not c.needs_refill()
    c.replace([e(1, 0, 1.0)], truncated=[0])
    c.clear()
    assert len(c) == 0 and c.next_fire_at() is None and c.truncated == set() and not c.needs_refill()


def test_horizon_is_what_the_scans_vouch_for() -> None:
    """The fire_at past which a new event's notice needs no rescan (the session skips it when the
    notice's time lies past it): the latest of every partition's scan coverage or, for a truncated
    partition, its last cached event, and of the coverage of a scan on its way; inf (every notice
    rescans) before every partition was scanned."""
    c = WindowCache()
    assert c.horizon(2) == math.inf  # never scanned
    c.replace([e(1, 0, 4.0), e(2, 1, 2.0), e(3, 1, 8.0)], truncated=[1])
    c.cover([0, 1], 40.0)
    # partition 1 was cut short at 8.0, but partition 0 claims everything up to 40.0: an event
    # announced at 10.0 may be one of partition 0's, which its cache would miss until its next slice
    assert c.horizon(2) == 40.0
    assert c.horizon(3) == math.inf  # a partition (added by a resize) that no scan covered
    c.replace([e(4, 1, 9.0)], truncated=[], partitions=[1])
    c.cover([1], 41.0)
    assert c.horizon(2) == 41.0
    c.begin_scan(45.0)
    assert c.horizon(2) == 45.0  # the scan on its way may miss a row announced meanwhile
    c.replace([e(5, 0, 5.0)], truncated=[0], partitions=[0])
    c.cover([0], 42.0)
    assert c.horizon(2) == 41.0
    c.replace([e(6, 1, 6.0)], truncated=[1], partitions=[1])
    c.cover([1], 43.0)
    assert c.horizon(2) == 6.0  # both truncated: past the latest last cached event
    assert ids(c.take(5.0, 10, anyone)) == [5]
    assert c.horizon(2) == 6.0  # partition 0 ran dry: its refill comes at once
    assert ids(c.take(6.0, 10, anyone)) == [6]
    assert c.horizon(2) == -math.inf  # both ran dry: both are refilled at once
    c.clear()
    assert c.horizon(2) == math.inf


def test_a_notice_during_a_scan_is_not_skipped() -> None:
    """Issue 36: an event due in 0.5 s, committed after the snapshot of a scan on its way, was
    announced while the scan ran; the horizon said -inf ("vouches for nothing") and the session
    skips a notice whose time lies past the horizon (queue_manager/manager/term.py), so the event
    waited for its partition's next periodic slice: make bench-fire fired it 175-480 ms late."""
    c = WindowCache()
    c.replace([e(1, 0, 101.0)], truncated=[])
    c.cover([0, 1], 130.0)
    c.begin_scan(130.2)  # the next round's rescan, sent before the producer committed
    since = 100.5  # the new event's fire_at, as its notice says
    assert not since > c.horizon(2)  # rescan after this scan
    assert c.horizon(2) < 131.0  # past what the scan on its way covers: found by the slices in time
    c.replace([e(1, 0, 101.0)], truncated=[])  # the scan's result, without the new event
    c.cover([0, 1], 130.2)
    assert not since > c.horizon(2)  # a notice coming only now rescans as well
    assert c.horizon(2) < 131.0


def test_refills_come_before_a_truncated_partition_runs_dry() -> None:
    c = WindowCache()
    c.replace([e(i, 0, float(i)) for i in range(1, 5)] + [e(10, 1, 3.0)], truncated=[0])
    assert c.refills(0.0) == ()
    # half of partition 0's scan is gone and its last cached event is due within REFILL_LEAD
    assert ids(c.take(2.0, 10, anyone)) == [1, 2]
    assert c.refills(4.0 - REFILL_LEAD - 0.01) == ()  # not yet within the lead
    assert c.refills(4.0 - REFILL_LEAD) == (0,)
    # within the lead but most of the scan still there: a partition fired faster than its quota
    # lasts is not rescanned every round
    c.replace([e(i, 0, 4.0 + i / 100) for i in range(20)], truncated=[0], partitions=[0])
    assert c.refills(4.0) == ()
    assert len(c.take(4.2, 10, anyone)) == 10  # partition 1's event and 9 of partition 0's
    assert c.refills(4.2) == ()
    c.take(4.2, 1, anyone)
    assert c.refills(4.2) == (0,)
    # a dry truncated partition is refilled whatever the time
    c.replace([], truncated=[1], partitions=[0, 1])
    assert c.refills(-100.0) == (1,)


entry_st = st.builds(
    lambda i, p, f, t: Entry(i, t, p, f),
    st.integers(1, 60),
    st.integers(0, 5),
    st.integers(0, 20).map(float),
    st.sampled_from(["a", "b", "c"]),
)
op_st = st.one_of(
    st.tuples(st.just("replace"), st.lists(entry_st, max_size=25), st.none() | st.sets(st.integers(0, 5))),
    st.tuples(st.just("take"), st.integers(0, 22).map(float), st.integers(0, 10), st.sampled_from(["all", "a", "b"])),
    st.tuples(st.just("put_back"), st.integers(0, 5)),
    st.tuples(st.just("clear")),
)


@settings(max_examples=120, deadline=None)
@given(st.lists(op_st, max_size=25))
def test_cache_invariants(ops: list[tuple[Any, ...]]) -> None:
    c = WindowCache()
    model: dict[int, Entry] = {}  # what the cache holds, by id
    taken_pool: list[Entry] = []  # taken and not in the cache: candidates for put_back
    for op in ops:
        if op[0] == "replace":
            _, entries, only = op
            fresh = {x.id: x for x in entries}  # a scan never returns an id twice
            if only is None:
                model = dict(fresh)
                c.replace(fresh.values(), [])
            else:
                keep = [x for x in fresh.values() if x.partition in only]
                model = {i: x for i, x in model.items() if x.partition not in only}
                model.update({x.id: x for x in keep if x.id not in model})
                c.replace([x for x in keep if x.id in model and model[x.id] is x], [], partitions=only)
            taken_pool = [x for x in taken_pool if x.id not in model]
        elif op[0] == "take":
            _, now, limit, who = op
            out = c.take(now, limit, lambda x, w=who: "r" if w == "all" or x.tenant == w else None)
            got = ids(out)
            assert len(got) == len(set(got)) <= max(limit, 0)
            assert all(x.fire_at <= now for x, _ in out)
            assert all(who == "all" or x.tenant == who for x, _ in out)
            for x, _ in out:
                assert model.pop(x.id) is x
                taken_pool.append(x)
            # within a partition the earliest acceptable due events go first
            if who == "all":
                for x, _ in out:
                    assert all(y.fire_at >= x.fire_at for y in model.values() if y.partition == x.partition)
        elif op[0] == "put_back":
            back, taken_pool = taken_pool[: op[1]], taken_pool[op[1] :]
            c.put_back(back)
            model.update({x.id: x for x in back})
        else:
            c.clear()
            model.clear()
        assert len(c) == len(model)
        heads = [x.fire_at for x in model.values()]
        assert c.next_fire_at() == (min(heads) if heads else None)
    drained = c.take(math.inf, 10_000, anyone)
    assert sorted(ids(drained)) == sorted(model)
    assert len(c) == 0
    for p in {x.partition for x, _ in drained}:
        times = [x.fire_at for x, _ in drained if x.partition == p]
        assert times == sorted(times)


# ============================================================================ metrics


def test_counter_render() -> None:
    r = Registry()
    ctr = r.counter("qm_things_total", "Things, by kind.")
    ctr.inc(queue="orders")
    ctr.inc(2, queue="orders")
    ctr.inc(0.5, queue="b", reason="x")
    assert ctr.get(queue="orders") == 3 and ctr.get(reason="x", queue="b") == 0.5 and ctr.get(queue="none") == 0
    assert ctr.total() == 3.5
    assert r.render() == (
        "# HELP qm_things_total Things, by kind.\n"
        "# TYPE qm_things_total counter\n"
        'qm_things_total{queue="b",reason="x"} 0.5\n'
        'qm_things_total{queue="orders"} 3\n'
    )


def test_gauge_render_with_callback() -> None:
    r = Registry()
    state = {"n": 1.0}
    g = r.gauge("qm_g", "A gauge.", lambda: [({"queue": "q"}, state["n"]), ({}, 7.0)])
    g.set(4, queue="set")
    g.set(99, queue="q")  # the callback's value wins for the same labels
    state["n"] = 2.25
    assert r.render() == (
        '# HELP qm_g A gauge.\n# TYPE qm_g gauge\nqm_g 7\nqm_g{queue="q"} 2.25\nqm_g{queue="set"} 4\n'
    )
    state["n"] = 3.0
    assert 'qm_g{queue="q"} 3\n' in r.render()  # read at every render


def test_gauge_special_values() -> None:
    r = Registry()
    g = r.gauge("qm_special", "Special values.")
    g.set(math.inf, k="inf")
    g.set(-math.inf, k="ninf")
    g.set(math.nan, k="nan")
    g.set(1e20, k="big")
    g.set(-3, k="neg")
    lines = r.render().splitlines()[2:]
    assert lines == [
        'qm_special{k="big"} 1e+20',
        'qm_special{k="inf"} +Inf',
        'qm_special{k="nan"} NaN',
        'qm_special{k="neg"} -3',
        'qm_special{k="ninf"} -Inf',
    ]


def test_histogram_buckets_are_cumulative() -> None:
    r = Registry()
    h = r.histogram("qm_lat_seconds", "Latency.", buckets=(5, 1, 2))
    for v in (0.5, 1, 3, 10):
        h.observe(v, queue="q")
    h.observe(2, queue="other")
    assert h.count(queue="q") == 4 and h.count(queue="none") == 0
    text = r.render()
    assert text == (
        "# HELP qm_lat_seconds Latency.\n"
        "# TYPE qm_lat_seconds histogram\n"
        'qm_lat_seconds_bucket{queue="other",le="1"} 0\n'
        'qm_lat_seconds_bucket{queue="other",le="2"} 1\n'
        'qm_lat_seconds_bucket{queue="other",le="5"} 1\n'
        'qm_lat_seconds_bucket{queue="other",le="+Inf"} 1\n'
        'qm_lat_seconds_sum{queue="other"} 2\n'
        'qm_lat_seconds_count{queue="other"} 1\n'
        'qm_lat_seconds_bucket{queue="q",le="1"} 2\n'
        'qm_lat_seconds_bucket{queue="q",le="2"} 2\n'
        'qm_lat_seconds_bucket{queue="q",le="5"} 3\n'
        'qm_lat_seconds_bucket{queue="q",le="+Inf"} 4\n'
        'qm_lat_seconds_sum{queue="q"} 14.5\n'
        'qm_lat_seconds_count{queue="q"} 4\n'
    )


def test_histogram_observe_many_counts_as_one_observe_each() -> None:
    """A batch's values (the fired and acked batches' path: sorted, one bisection per bucket) land
    where observing them one by one puts them, bounds and values above the last bound included."""
    values = [0.5, 1, 1, 1.5, 2, 7, 0.0, 2, 3]
    one, many = Registry(), Registry()
    h1 = one.histogram("qm_h", "H.", buckets=(1, 2, 5))
    for v in values:
        h1.observe(v, queue="q")
    many.histogram("qm_h", "H.", buckets=(1, 2, 5)).observe_many(iter(values), queue="q")
    assert one.render() == many.render()
    assert 'qm_h_bucket{queue="q",le="1"} 4' in many.render().splitlines()


def test_histogram_default_buckets_and_no_labels() -> None:
    r = Registry()
    h = r.histogram("qm_d", "Default buckets.")
    h.observe(0.0004)
    h.observe(100)
    lines = r.render().splitlines()
    assert lines[2] == 'qm_d_bucket{le="0.0005"} 1'
    assert 'qm_d_bucket{le="1"} 1' in lines and 'qm_d_bucket{le="60"} 1' in lines
    assert lines[-3:] == ['qm_d_bucket{le="+Inf"} 2', "qm_d_sum 100.0004", "qm_d_count 2"]
    counts = [int(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("qm_d_bucket")]
    assert counts == sorted(counts)


def test_label_values_are_escaped() -> None:
    r = Registry()
    r.counter("qm_esc_total", "Escapes.").inc(queue='a"b\\c\nd')
    assert r.render().splitlines()[-1] == 'qm_esc_total{queue="a\\"b\\\\c\\nd"} 1'


def test_registry_renders_in_registration_order_with_trailing_newline() -> None:
    r = Registry()
    r.gauge("qm_b", "B.").set(1)
    r.counter("qm_a_total", "A.")
    text = r.render()
    assert text.endswith("\n") and not text.endswith("\n\n")
    assert text.index("qm_b") < text.index("qm_a_total")
    assert "# TYPE qm_a_total counter\n" in text  # declared even with no series yet


def test_discard_heads_drops_events_fired_elsewhere() -> None:
    from queue_manager.manager.cache import Entry, WindowCache

    cache = WindowCache()
    cache.replace([Entry(1, "a", 0, 1.0), Entry(2, "a", 0, 2.0), Entry(3, "b", 1, 1.5), Entry(4, "b", 1, 3.0)], [])
    assert cache.discard_heads({1, 4}) == 1  # 4 is behind 3, not at a head: it stays
    assert len(cache) == 3
    assert cache.discard_heads({3, 4}) == 2  # consecutive heads go together
    assert [e.id for e, _ in cache.take(10.0, 10, lambda e: "r")] == [2]
    assert len(cache) == 0


@pytest.mark.parametrize("partitions", [1, 3, 4, 16, 17])
def test_periodic_rescan_slices_cover_every_partition_once_per_round(partitions: int) -> None:
    from queue_manager.domain.settings import QueueSettings
    from queue_manager.manager.queues import RESCAN_SLICES, QueueRuntime

    q = QueueRuntime(QueueSettings(id=1, name="orders", partitions=partitions, partitions_physical=partitions))
    for _ in range(2):  # two full rounds: the turns wrap around
        seen = [p for _ in range(RESCAN_SLICES) for p in q.next_slice()]
        assert sorted(seen) == list(range(partitions))


def test_partial_replace_keeps_the_other_partitions() -> None:
    cache = WindowCache()
    cache.replace([Entry(1, "a", 0, 10.0), Entry(2, "b", 1, 11.0), Entry(3, "c", 2, 12.0)], truncated=[1])
    # a rescan of partitions 1 and 3 only: partition 1 is now empty, 3 gains an event, 0 and 2 stay
    cache.replace([Entry(4, "d", 3, 13.0)], truncated=[3], partitions=[1, 3])
    assert len(cache) == 3
    assert cache.truncated == {3}
    assert [e.id for e, _ in cache.take(100.0, 10, lambda e: "r")] == [1, 3, 4]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(1, 5), st.floats(1e9, 1e9 + 100, allow_nan=False)), max_size=40),
    st.lists(st.integers(0, 3), min_size=5, max_size=5),
)
def test_streams_fired_sums_up_a_pick_as_a_step_per_event_does(picked: list[Any], counts: list[int]) -> None:
    """The fired rows' summary by stream (one dictionary step per event, the rest per stream)
    against the plain loop over every row that it replaced."""
    from queue_manager.manager.dispatch import streams_fired

    levels = 5
    rows = [(i, "t", p, 1, t, "{}", None, None, None, v, None, None) for i, (p, v, t) in enumerate(picked)]
    per_slot: dict[int, int] = {}
    tops: dict[int, float] = {}
    heads: dict[int, float] = {}
    lows: dict[int, float] = {}
    per_part: dict[int, int] = {}
    last = max((counts[v - 1] for _, v, _ in picked), default=0)
    for p, v, t in picked:
        slot = p * levels + v - 1
        per_slot[slot] = per_slot.get(slot, 0) + 1
        tops[slot] = max(t, tops.get(slot, t))
        heads[p] = min(t, heads.get(p, t))
        lows[v] = min(t, lows.get(v, t))
        if counts[v - 1] == last:
            per_part[p] = per_part.get(p, 0) + 1
    assert streams_fired(rows, levels, counts) == (per_slot, tops, heads, lows, per_part)
